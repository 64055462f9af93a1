// libFuzzer target: a hostile caller's writes into a call queue's segment (the layout is
// proto/attnserve/v1/call_queue.h) against the real service (server/rpc/service.h) serving the
// queue over an Engine with the CPU backend: the path every call over a queue takes.
//
// The queue's thread runs the input: the service's CallQueueOptions.before_sleep hook, which the
// thread calls each time it found nothing to do and before its last scan, applies the input's
// next step there, so each step's writes land between two polls of the server, the same way
// every run (calls answered by the batcher's thread still end when they end). Nothing waits on
// a clock: the hook rings the doorbell after each step, so the thread's futex wait returns at
// once.
//
// Input: byte 0 picks the geometry (1 + byte % 4 slots of kAreaBytes request and response
// bytes); then operations, each an opcode byte (% kOps) and its operands, until the input ends
// (at most kMaxOps operations; an operand cut short by the end of the input reads as zeros):
//   0 word    slot, word (% 16), u32: any 4-byte word of a slot's header (state, method,
//             request_len, timeout halves, cancel, the answer's words, padding)
//   1 bytes   slot, u16 offset (% kAreaBytes), u8 n, then n bytes: into the request area
//   2 publish slot: state = kSubmitted, then ring the doorbell (as a caller publishes)
//   3 queue   word (% 16), u32: any word of the segment's queue header (doorbell,
//             server_sleeping, closed, padding), no ring
//   4 poll    the step ends: the server scans (also the end of the input)
//   5 idle    wait until every call handed to the engine is over (their answers written)
//   6 call    slot, variant byte, u16: a valid request (or one near it) built for the
//             session's pages, with method and length, then published; the variant picks
//             Prefill or Decode, an append, lse, the last page's length, q as a reference into
//             the queue's own region (at 16 x the u16), a session that is not the queue's
//   7 timeout slot, i64: the timeout word
// After the input the queue is unregistered (which answers once its calls are answered), the
// session closed, and the target aborts unless: the server set `closed`; every byte the caller
// owns (the region header, the request areas, the caller's slot words, padding) is as the
// caller last wrote it; nothing past the segment changed (the object's last page continues with
// kSubmitted words: a scan past the last slot would take them); every answer the server wrote
// is well formed (a canonical code, a length within the area, a message of at most 1 KiB, an
// AttentionResponse that parses); no call it took was left unanswered; and the engine is idle
// with no page pinned or owned. A hang is libFuzzer's timeout; a write outside the mapping
// crashes under ASan/UBSan or SEGVs.
//
// fuzz/make_corpus.py writes the seed corpus (fuzz/call_queue_corpus/) in this format.
// ATTN_FUZZ_VERBOSE=1 prints each answer's status.
#include <fcntl.h>
#include <sys/mman.h>
#include <unistd.h>

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/notification.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "attnserve/v1/attention.grpc.pb.h"
#include "fuzz/verbose.h"
#include "google/protobuf/stubs/logging.h"
#include "grpcpp/grpcpp.h"
#include "proto/attnserve/v1/call_queue.h"
#include "server/backends/cpu_backend.h"
#include "server/engine/engine.h"
#include "server/rpc/auth.h"
#include "server/rpc/service.h"
#include "server/rpc/test_tensors.h"

namespace attn {
namespace {

namespace cq = ::attnserve::v1::call_queue;

constexpr int kAreaBytes = 2048;  // request and response areas: a call and its answer fit
constexpr int kOps = 8;
constexpr int kMaxOps = 512;
constexpr int kPageSize = 4, kHeads = 4, kKvHeads = 2, kDim = 64, kPoolPages = 8;
constexpr int kSessionPages = 2;

[[noreturn]] void Fail(const std::string& what) {
  std::fprintf(stderr, "call_queue_fuzzer: %s\n", what.c_str());
  std::abort();
}

// What the hook runs; set while an input's queue is registered.
class Driver;
std::atomic<Driver*> current_driver{nullptr};
void BeforeSleep();

// The server, built once per process: an in-process gRPC server for the control plane over an
// engine with one small GQA pool.
struct Fixture {
  Fixture() {
    google::protobuf::SetLogHandler(nullptr);  // parse errors of garbage requests: not news
    metrics = std::make_unique<Metrics>("fuzz", "cpu", "fuzz");
    SessionOptions sessions;
    sessions.default_lease = absl::Hours(1);
    DataPlaneOptions plane;
    plane.shared_memory = true;
    absl::StatusOr<std::unique_ptr<Engine>> e = Engine::Create(
        CreateCpuBackend(1),
        {PoolGeometry::Gqa("gqa", 1, kPageSize, kHeads, kKvHeads, kDim, kPoolPages)},
        BatchingOptions{}, sessions, /*epoch=*/0xf022, metrics.get(), metrics.get(), plane);
    if (!e.ok()) Fail(e.status().ToString());
    engine = *std::move(e);
    absl::StatusOr<Authorizer> a = Authorizer::Create({});
    if (!a.ok()) Fail(a.status().ToString());
    auth = std::make_unique<Authorizer>(*std::move(a));
    CallQueueOptions options;
    options.spin = absl::ZeroDuration();
    options.before_sleep = BeforeSleep;
    service = std::make_unique<AttentionServiceImpl>(engine.get(), metrics.get(), auth.get(),
                                                     int64_t{16} << 20, options);
    grpc::ServerBuilder builder;
    builder.RegisterService(service.get());
    server = builder.BuildAndStart();
    if (server == nullptr) Fail("grpc server");
    stub = v1::AttentionService::NewStub(server->InProcessChannel(grpc::ChannelArguments()));
  }
  std::unique_ptr<Metrics> metrics;
  std::unique_ptr<Engine> engine;
  std::unique_ptr<Authorizer> auth;
  std::unique_ptr<AttentionServiceImpl> service;
  std::unique_ptr<grpc::Server> server;
  std::unique_ptr<v1::AttentionService::Stub> stub;
};

Fixture& GetFixture() {
  static Fixture* fixture = new Fixture();  // never destroyed: no exit-time ordering issues
  return *fixture;
}

void Check(const grpc::Status& st, const char* what) {
  if (!st.ok()) Fail(absl::StrCat(what, ": ", st.error_message()));
}

// The caller's segment: a shared-memory object whose last page continues past the segment with
// kSubmitted words, mapped here as the caller maps it. `shadow` holds what the caller last
// wrote into every byte.
class Segment {
 public:
  explicit Segment(int slots) : slots_(slots) {
    static int counter = 0;
    name_ = absl::StrCat("/attnserve-fuzzq-", getpid(), "-", counter++);
    bytes_ = cq::SegmentBytes(slots, kAreaBytes, kAreaBytes);
    const size_t page = static_cast<size_t>(sysconf(_SC_PAGESIZE));
    object_bytes_ = (bytes_ + page - 1) / page * page;
    if (object_bytes_ == bytes_) object_bytes_ += page;  // always a tail to watch
    const int fd = shm_open(name_.c_str(), O_RDWR | O_CREAT | O_EXCL, 0600);
    if (fd < 0 || ftruncate(fd, static_cast<off_t>(object_bytes_)) != 0) Fail("shm_open");
    void* p = mmap(nullptr, object_bytes_, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    close(fd);
    if (p == MAP_FAILED) Fail("mmap");
    base_ = static_cast<char*>(p);
    key_.assign(kRegionKeyBytes, 'k');
    std::memcpy(base_, kRegionMagic.data(), kRegionMagic.size());
    std::memcpy(base_ + kRegionMagic.size(), key_.data(), key_.size());
    for (size_t at = bytes_; at + 4 <= object_bytes_; at += 4) {
      std::memcpy(base_ + at, &cq::kSubmitted, 4);
    }
    shadow_.assign(base_, object_bytes_);
  }
  ~Segment() {
    munmap(base_, object_bytes_);
    shm_unlink(name_.c_str());
  }

  int slots() const { return slots_; }
  size_t bytes() const { return bytes_; }
  char* base() const { return base_; }
  const std::string& name() const { return name_; }
  const std::string& key() const { return key_; }
  size_t SlotOffset(int i) const {
    return cq::kSlots + static_cast<size_t>(i) * cq::SlotStride(kAreaBytes, kAreaBytes);
  }
  char* Slot(int i) const { return base_ + SlotOffset(i); }

  // The caller's writes, recorded in the shadow.
  void Store32(size_t at, uint32_t v) {
    cq::Word(base_, at).store(v, std::memory_order_seq_cst);
    std::memcpy(&shadow_[at], &v, 4);
  }
  void Store64(size_t at, int64_t v) {
    cq::Word64(base_, at).store(v, std::memory_order_seq_cst);
    std::memcpy(&shadow_[at], &v, 8);
  }
  // Into a request area (never read by the server while it copies one out: both run on the
  // queue's thread).
  void Write(size_t at, const char* data, size_t n) {
    std::memcpy(base_ + at, data, n);
    std::memcpy(&shadow_[at], data, n);
  }
  void Ring() {
    cq::Word(base_, cq::kDoorbell).fetch_add(1, std::memory_order_seq_cst);
    cq::FutexWake(base_ + cq::kDoorbell, 1);
  }

  // Bytes only the caller writes are as it wrote them; the server's words and areas are not
  // compared.
  void CheckCallerBytes() const {
    const auto same = [&](size_t from, size_t to, const char* what) {
      if (std::memcmp(base_ + from, shadow_.data() + from, to - from) != 0) {
        Fail(absl::StrCat("the server wrote into ", what, " [", from, ", ", to, ")"));
      }
    };
    same(0, cq::kDoorbell, "the region header");
    same(cq::kClosed + 4, cq::kSlots, "the queue header's padding");
    for (int i = 0; i < slots_; ++i) {
      const size_t s = SlotOffset(i);
      same(s + cq::kClientWaiting, s + cq::kStatus, "a slot's caller words");
      same(s + cq::kRetryAfterMs + 4, s + cq::kSlotHeaderBytes + kAreaBytes,
           "a slot's padding or request area");
    }
    same(bytes_, object_bytes_, "the memory past the segment");
  }

 private:
  int slots_;
  std::string name_, key_;
  size_t bytes_ = 0, object_bytes_ = 0;
  char* base_ = nullptr;
  std::string shadow_;
};

// Reads the input's operands; past its end, zeros.
class Reader {
 public:
  Reader(const uint8_t* data, size_t size) : data_(data), size_(size) {}
  bool done() const { return at_ >= size_; }
  uint8_t U8() { return at_ < size_ ? data_[at_++] : 0; }
  uint16_t U16() { return static_cast<uint16_t>(U8() | (U8() << 8)); }
  uint32_t U32() { return static_cast<uint32_t>(U16()) | (static_cast<uint32_t>(U16()) << 16); }
  uint64_t U64() { return static_cast<uint64_t>(U32()) | (static_cast<uint64_t>(U32()) << 32); }
  std::string Bytes(size_t n) {
    n = std::min(n, size_ - std::min(at_, size_));
    std::string out(reinterpret_cast<const char*>(data_ + at_), n);
    at_ += n;
    return out;
  }

 private:
  const uint8_t* data_;
  size_t size_;
  size_t at_ = 0;
};

// A request over the session's first page (op 6): valid unless the variant says otherwise.
template <typename Request>
std::string MakeRequest(uint8_t variant, uint16_t offset, int32_t page) {
  Request r;
  r.set_pool("gqa");
  const bool append = variant & 2;
  FillBf16(r.mutable_q(), {1, kHeads, kDim}, 0.5f);
  if (append) {
    FillBf16(r.mutable_k_new(), {1, kKvHeads, kDim}, 1.f);
    FillBf16(r.mutable_v_new(), {1, kKvHeads, kDim}, 1.5f);
  }
  if constexpr (std::is_same_v<Request, v1::PrefillRequest>) {
    r.add_qo_indptr(0);
    r.add_qo_indptr(1);
  }
  r.add_kv_indptr(0);
  r.add_kv_indptr(1);
  r.add_kv_indices(page);
  r.add_kv_last_page_len(1 + ((variant >> 4) & 3));
  r.set_return_lse(variant & 4);
  if (variant & 64) {  // q from the queue's own memory, wherever the caller says
    r.mutable_q()->clear_data();
    r.mutable_q()->mutable_region()->set_name("q");
    r.mutable_q()->mutable_region()->set_offset(int64_t{16} * offset);
  }
  if (variant & 128) r.set_session("0000000000000001-not-the-queues-session");
  return r.SerializeAsString();
}

// Runs the input's operations on the queue's thread, a step per call of the hook.
class Driver {
 public:
  Driver(Segment* segment, Reader input, int32_t page)
      : seg_(segment),
        in_(input),
        page_(page),
        last_state_(segment->slots(), cq::kFree),
        answer_written_(segment->slots(), false) {}

  // One step: operations until a poll or the end of the input. Once they are all done, the
  // next call (the thread found nothing more to take) ends the run.
  void Step() {
    if (finished_.HasBeenNotified()) return;
    if (in_.done() || ops_ >= kMaxOps) return finished_.Notify();
    while (!in_.done() && ops_ < kMaxOps) {
      ++ops_;
      if (!Apply(in_.U8() % kOps)) break;
    }
    seg_->Ring();  // the thread's wait returns at once
  }
  void AwaitFinished() { finished_.WaitForNotification(); }

  // After the queue stopped.
  void CheckAnswers() const {
    if (cq::Word(seg_->base(), cq::kClosed).load() != 1) Fail("the server did not set `closed`");
    for (int i = 0; i < seg_->slots(); ++i) {
      char* slot = seg_->Slot(i);
      const uint32_t state = cq::Word(slot, cq::kState).load();
      // The caller's last state write was kSubmitted or a value the server ignores; only the
      // server moved it since.
      if (state == cq::kTaken && last_state_[i] != cq::kTaken) {
        Fail(absl::StrCat("slot ", i, " was taken and never answered"));
      }
      if (state != cq::kDone || last_state_[i] == cq::kDone || answer_written_[i]) continue;
      const auto status = static_cast<int32_t>(cq::Word(slot, cq::kStatus).load());
      const uint32_t len = cq::Word(slot, cq::kResponseLen).load();
      if (status < 0 || status > 16) Fail(absl::StrCat("slot ", i, ": status ", status));
      if (len > static_cast<uint32_t>(kAreaBytes)) Fail(absl::StrCat("response_len ", len));
      const char* answer = slot + cq::kSlotHeaderBytes + kAreaBytes;
      if (status != 0 && len > cq::kMaxMessageBytes) Fail("a message longer than 1 KiB");
      if (status == 0) {
        v1::AttentionResponse resp;
        if (!resp.ParseFromArray(answer, static_cast<int>(len)))
          Fail("an OK answer that does not parse");
      }
      if (FuzzVerbose()) {
        std::fprintf(stderr, "call_queue_fuzzer: slot %d: %d %.*s\n", i, status,
                     status == 0 ? 0 : static_cast<int>(len), answer);
      }
    }
  }

 private:
  // Applies one operation; false when the step ends.
  bool Apply(int op) {
    const int slot = op == 3 || op == 4 || op == 5 ? 0 : in_.U8() % seg_->slots();
    const size_t s = seg_->SlotOffset(slot);
    switch (op) {
      case 0: {
        const size_t word = (in_.U8() % 16) * 4;
        StoreSlotWord(slot, s + word, in_.U32());
        return true;
      }
      case 1: {
        const size_t offset = in_.U16() % kAreaBytes;
        const size_t n = std::min<size_t>(in_.U8(), kAreaBytes - offset);
        const std::string bytes = in_.Bytes(n);
        seg_->Write(s + cq::kSlotHeaderBytes + offset, bytes.data(), bytes.size());
        return true;
      }
      case 2:
        Publish(slot);
        return true;
      case 3:
        seg_->Store32(cq::kDoorbell + (in_.U8() % 16) * 4, in_.U32());
        return true;
      case 4:
        return false;
      case 5:
        if (!GetFixture().engine->WaitForIdle(absl::Now() + absl::Seconds(30))) {
          Fail("a call is never over");
        }
        return false;
      case 6: {
        const uint8_t variant = in_.U8();
        const uint16_t offset = in_.U16();
        const bool prefill = variant & 1;
        const std::string req = prefill ? MakeRequest<v1::PrefillRequest>(variant, offset, page_)
                                        : MakeRequest<v1::DecodeRequest>(variant, offset, page_);
        seg_->Write(s + cq::kSlotHeaderBytes, req.data(), req.size());
        StoreSlotWord(slot, s + cq::kMethod, prefill ? cq::kPrefill : cq::kDecode);
        StoreSlotWord(slot, s + cq::kRequestLen, static_cast<uint32_t>(req.size()));
        Publish(slot);
        return true;
      }
      default:
        seg_->Store64(s + cq::kTimeoutUs, static_cast<int64_t>(in_.U64()));
        return true;
    }
  }
  void StoreSlotWord(int slot, size_t at, uint32_t v) {
    const size_t word = at - seg_->SlotOffset(slot);
    if (word == cq::kState) {
      last_state_[slot] = v;
      answer_written_[slot] = false;
    } else if (word >= cq::kStatus && word < cq::kRetryAfterMs + 4) {
      answer_written_[slot] = true;
    }
    seg_->Store32(at, v);
  }
  void Publish(int slot) {
    StoreSlotWord(slot, seg_->SlotOffset(slot) + cq::kState, cq::kSubmitted);
    seg_->Ring();
  }

  Segment* seg_;
  Reader in_;
  const int32_t page_;
  int ops_ = 0;
  // Per slot: the caller's last write of its state, and whether it wrote the answer's words
  // since (then the answer is not the server's to check).
  std::vector<uint32_t> last_state_;
  std::vector<bool> answer_written_;
  absl::Notification finished_;
};

void BeforeSleep() {
  if (Driver* d = current_driver.load(std::memory_order_acquire)) d->Step();
}

void RunOne(const uint8_t* data, size_t size) {
  Fixture& f = GetFixture();
  Segment seg(1 + data[0] % 4);
  std::string session;
  int32_t page = -1;
  {
    grpc::ClientContext ctx;
    v1::OpenSessionResponse resp;
    Check(f.stub->OpenSession(&ctx, v1::OpenSessionRequest(), &resp), "OpenSession");
    session = resp.session();
  }
  {
    grpc::ClientContext ctx;
    v1::AllocatePagesRequest req;
    req.set_pool("gqa");
    req.set_session(session);
    req.set_num_pages(kSessionPages);
    v1::AllocatePagesResponse resp;
    Check(f.stub->AllocatePages(&ctx, req, &resp), "AllocatePages");
    page = resp.page_ids(0);
  }
  Driver driver(&seg, Reader(data + 1, size - 1), page);
  current_driver.store(&driver, std::memory_order_release);
  {
    grpc::ClientContext ctx;
    v1::RegisterRegionRequest req;
    req.set_name("q");
    req.set_session(session);
    req.mutable_shared_memory()->set_shm_name(seg.name());
    req.set_size(static_cast<int64_t>(seg.bytes()));
    req.set_key(seg.key());
    req.mutable_call_queue()->set_slots(seg.slots());
    req.mutable_call_queue()->set_request_bytes(kAreaBytes);
    req.mutable_call_queue()->set_response_bytes(kAreaBytes);
    v1::RegisterRegionResponse resp;
    Check(f.stub->RegisterRegion(&ctx, req, &resp), "RegisterRegion");
  }
  driver.AwaitFinished();
  // Calls whose tensors are in the queue's region hold it until they are over: UnregisterRegion
  // refuses it until then.
  for (grpc::Status st = grpc::Status::CANCELLED; !st.ok();) {
    if (!f.engine->WaitForIdle(absl::Now() + absl::Seconds(30))) Fail("a call is never over");
    grpc::ClientContext ctx;
    v1::UnregisterRegionRequest req;
    req.set_session(session);
    req.set_name("q");
    v1::UnregisterRegionResponse resp;
    st = f.stub->UnregisterRegion(&ctx, req, &resp);
    if (!st.ok() && st.error_code() != grpc::StatusCode::FAILED_PRECONDITION) {
      Check(st, "UnregisterRegion");
    }
  }
  // The queue's thread stopped before UnregisterRegion answered: it calls the hook no more.
  current_driver.store(nullptr, std::memory_order_release);
  seg.CheckCallerBytes();
  driver.CheckAnswers();
  {
    grpc::ClientContext ctx;
    v1::CloseSessionRequest req;
    req.set_session(session);
    v1::CloseSessionResponse resp;
    Check(f.stub->CloseSession(&ctx, req, &resp), "CloseSession");
  }
  if (!f.engine->WaitForIdle(absl::Now() + absl::Seconds(30))) Fail("a call is never over");
  for (const auto& pool : f.engine->pools()) {
    if (pool->pages().pinned_pages() != 0) Fail("pages left pinned");
    if (pool->pages().free_pages() != pool->total_pages()) Fail("pages left owned");
  }
}

}  // namespace
}  // namespace attn

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  attn::GetFixture();
  if (size < 1) return 0;
  attn::RunOne(data, size);
  return 0;
}
