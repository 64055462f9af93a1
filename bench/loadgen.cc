// attn_loadgen: drives a running server with N concurrent clients and reports throughput and
// latency, client-side and as the server itself measured it (queue / compute / total).
//
//   attn_loadgen --address=127.0.0.1:50051 --clients=8 --batch=8 --context=4096 --seconds=10
//
// Each client owns `batch` sequences of `context` tokens in the pool (filled once with random
// K/V through Prefill, layer 0), then calls Decode over them (batch one-token queries, no append,
// so the context stays fixed) or Prefill (`prefill_tokens` new query tokens over the context)
// back to back. --background_prefill_tokens adds one more client that runs long prefills the
// whole time, to show what a long prefill does to decode latency.
//
// --transport picks how tensors travel (attention.proto, "Registered memory"): bytes in the
// messages; shm, a POSIX shared-memory region per client holding q (and K/V), the page table and
// the outputs, so only small messages cross gRPC; cuda, the tensors and outputs in device memory
// shared through CUDA IPC (the page table in shared memory). The server must enable them
// (ServerConfig.data_plane). --append makes the measured prefills append their K/V.
// --call_queue (with shm or cuda) sends the calls through a call queue per client (attention.proto,
// "Call queues"; client/cpp/call_queue_client.h) instead of gRPC, which then only sets up.
// --plan checks and pins each client's page table once (CreatePlan; attention.proto, "Plans")
// and every call names the plan instead of carrying or staging the table: what a scheduler's
// per-layer calls of one step cost.
//
// Over bytes the messages are protobuf's wire format either way, but attn_loadgen writes each
// request once with its tensors as slices of their own and reads the response's tensors where
// gRPC received them (server/rpc/tensor_message.h), as the server does; --protobuf_bytes builds
// and parses them with protobuf instead (every tensor copied in and out of a string), as a
// client using the generated stub does.
#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#if ATTN_LOADGEN_CUDA
#include <cuda_runtime_api.h>
#endif

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <memory>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "attnserve/v1/attention.grpc.pb.h"
#include "client/cpp/call_queue_client.h"
#include "grpcpp/generic/generic_stub.h"
#include "grpcpp/grpcpp.h"
#include "proto/attnserve/v1/call_queue.h"
#include "server/rpc/tensor_message.h"
#include "server/rpc/transport_args.h"

ABSL_FLAG(std::string, address, "127.0.0.1:50051", "Server address");
ABSL_FLAG(std::string, pool, "", "Pool (empty: the server's only pool)");
ABSL_FLAG(int, clients, 1, "Concurrent clients, each with its own connection");
ABSL_FLAG(int, batch, 64, "Sequences per call");
ABSL_FLAG(int, context, 4096, "Tokens each sequence holds");
ABSL_FLAG(std::string, op, "decode", "decode or prefill");
ABSL_FLAG(int, prefill_tokens, 512, "New tokens per sequence of a prefill call (--op=prefill)");
ABSL_FLAG(int, background_prefill_tokens, 0,
          "When > 0, one extra client runs prefills of this many tokens (one sequence) throughout");
ABSL_FLAG(double, seconds, 10, "Measured duration");
ABSL_FLAG(double, warmup_seconds, 1, "Unmeasured calls first");
ABSL_FLAG(std::string, json, "", "Also write the results here");
ABSL_FLAG(std::string, transport, "bytes", "bytes, shm or cuda (registered memory)");
ABSL_FLAG(bool, append, false, "Measured prefills append their K/V");
ABSL_FLAG(bool, plan, false,
          "Each client's page table goes into a plan (CreatePlan) that its calls name");
ABSL_FLAG(bool, call_queue, false,
          "With --transport=shm or cuda: calls go through a shared-memory call queue per client "
          "instead of gRPC");
ABSL_FLAG(int, call_queue_spin_us, -1,
          "--call_queue: how long a call polls its slot before sleeping on the slot's futex "
          "(default: 200 on a machine of 8 or more cores, else 0)");
ABSL_FLAG(bool, call_queue_predict, true,
          "--call_queue: a call longer than the spin window sleeps through most of the time its "
          "shape's calls took, then polls (CallQueueClient::Options::predict); false: poll, then "
          "sleep until woken");
ABSL_FLAG(std::vector<std::string>, channel_args, {},
          "More integer gRPC channel arguments, NAME=VALUE,... (they override the HTTP/2 and TCP "
          "sizes set for MB messages, e.g. grpc.http2.max_frame_size=16384)");
ABSL_FLAG(bool, protobuf_bytes, false,
          "--transport=bytes: serialize requests and parse responses with protobuf, copying "
          "every tensor (the generated stub's way), instead of sending the tensors as slices");
ABSL_FLAG(bool, spin, false,
          "Wait for each reply by polling a completion queue instead of sleeping in it (how "
          "much of a call's cost is waking the caller's thread)");

namespace attn::bench {
namespace {

namespace v1 = ::attnserve::v1;
using Clock = std::chrono::steady_clock;

#define CHECK_RPC(call)                                                        \
  do {                                                                         \
    const grpc::Status _st = (call);                                           \
    if (!_st.ok()) {                                                           \
      std::fprintf(stderr, "%s failed: %s %s\n", #call,                        \
                   std::to_string(static_cast<int>(_st.error_code())).c_str(), \
                   _st.error_message().c_str());                               \
      std::exit(1);                                                            \
    }                                                                          \
  } while (0)

// A stub on a new channel to `address`; the channel also goes to `channel` when given.
std::unique_ptr<v1::AttentionService::Stub> Connect(
    const std::string& address, std::shared_ptr<grpc::Channel>* channel = nullptr) {
  grpc::ChannelArguments args;
  args.SetMaxReceiveMessageSize(-1);
  args.SetMaxSendMessageSize(-1);
  // A connection per client, as separate scheduler processes would have.
  args.SetInt(GRPC_ARG_USE_LOCAL_SUBCHANNEL_POOL, 1);
  // Sized for messages of megabytes, as the server's side (server/rpc/transport_args.h).
  absl::StatusOr<IntChannelArgs> overrides = ParseIntChannelArgs(absl::GetFlag(FLAGS_channel_args));
  if (!overrides.ok()) {
    std::fprintf(stderr, "--channel_args: %s\n", std::string(overrides.status().message()).c_str());
    std::exit(2);
  }
  SetBulkTransportArgs(&args, *overrides);
  std::shared_ptr<grpc::Channel> c =
      grpc::CreateCustomChannel(address, grpc::InsecureChannelCredentials(), args);
  if (channel != nullptr) *channel = c;
  return v1::AttentionService::NewStub(c);
}

void RandomBf16(v1::Tensor* t, std::vector<int64_t> shape, std::mt19937& rng) {
  t->set_dtype(v1::DTYPE_BF16);
  int64_t n = 1;
  for (int64_t d : shape) {
    t->add_shape(d);
    n *= d;
  }
  std::string* data = t->mutable_data();
  data->resize(n * 2);
  // Uniform in [-1, 1), four values per 64-bit splitmix64 draw: filling a batch-256 x 4096
  // context takes seconds instead of the half-minute per scenario of std::mt19937 per value.
  uint64_t state = (uint64_t{rng()} << 32) | rng();
  for (int64_t i = 0; i < n; i += 4) {
    state += 0x9e3779b97f4a7c15ull;
    uint64_t z = state;
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    z ^= z >> 31;
    for (int64_t j = i; j < std::min(i + 4, n); ++j, z >>= 16) {
      const float f = static_cast<float>(z & 0xffff) * (1.f / 32768.f) - 1.f;
      uint32_t bits;
      std::memcpy(&bits, &f, 4);
      const uint16_t h = static_cast<uint16_t>(bits >> 16);
      std::memcpy(data->data() + 2 * j, &h, 2);
    }
  }
}

struct Geometry {
  v1::PoolInfo pool;
  bool mla() const { return pool.kind() == v1::POOL_KIND_MLA; }
  int q_dim() const { return mla() ? 512 : pool.head_dim(); }
};

// Sequences of one client: their session, pages and page table.
struct Sequences {
  std::string session;
  std::vector<int32_t> kv_indptr{0}, kv_indices, kv_last_page_len;
  std::vector<int32_t> all_pages;
};

// One session for every client: the load of one scheduler over several connections, so that
// Timings.batch_requests (which counts the caller's own session's calls) shows the merging.
std::string OpenSession(v1::AttentionService::Stub& stub) {
  grpc::ClientContext ctx;
  v1::OpenSessionResponse resp;
  CHECK_RPC(stub.OpenSession(&ctx, v1::OpenSessionRequest(), &resp));
  return resp.session();
}

Sequences Allocate(v1::AttentionService::Stub& stub, const Geometry& g, const std::string& session,
                   int count, int tokens) {
  Sequences s;
  s.session = session;
  const int ps = g.pool.page_size();
  const int pages = (tokens + ps - 1) / ps;
  for (int b = 0; b < count; ++b) {
    grpc::ClientContext ctx;
    v1::AllocatePagesRequest req;
    req.set_pool(g.pool.name());
    req.set_session(session);
    req.set_num_pages(pages);
    v1::AllocatePagesResponse resp;
    CHECK_RPC(stub.AllocatePages(&ctx, req, &resp));
    s.kv_indices.insert(s.kv_indices.end(), resp.page_ids().begin(), resp.page_ids().end());
    s.kv_indptr.push_back(static_cast<int32_t>(s.kv_indices.size()));
    s.kv_last_page_len.push_back(tokens - (pages - 1) * ps);
  }
  s.all_pages = s.kv_indices;
  return s;
}

void Free(v1::AttentionService::Stub& stub, const Geometry& g, const Sequences& s) {
  grpc::ClientContext ctx;
  v1::FreePagesRequest req;
  req.set_pool(g.pool.name());
  req.set_session(s.session);
  *req.mutable_page_ids() = {s.all_pages.begin(), s.all_pages.end()};
  v1::FreePagesResponse resp;
  CHECK_RPC(stub.FreePages(&ctx, req, &resp));
}

// Prefill request for `q_len` new tokens at the end of sequence b's `tokens` (append or not).
v1::PrefillRequest PrefillOf(const Geometry& g, const Sequences& s, int b, int tokens, int q_len,
                             bool append, std::mt19937& rng) {
  v1::PrefillRequest r;
  r.set_pool(g.pool.name());
  r.set_session(s.session);
  const int64_t h = g.pool.num_qo_heads();
  RandomBf16(r.mutable_q(), {q_len, h, g.q_dim()}, rng);
  if (g.mla()) RandomBf16(r.mutable_q_pe(), {q_len, h, 64}, rng);
  if (append && g.mla()) {
    RandomBf16(r.mutable_ckv_new(), {q_len, 512}, rng);
    RandomBf16(r.mutable_kpe_new(), {q_len, 64}, rng);
  } else if (append) {
    RandomBf16(r.mutable_k_new(), {q_len, g.pool.num_kv_heads(), g.pool.head_dim()}, rng);
    RandomBf16(r.mutable_v_new(), {q_len, g.pool.num_kv_heads(), g.pool.head_dim()}, rng);
  }
  if (g.mla()) r.set_sm_scale(0.1352337747812271f);
  r.add_qo_indptr(0);
  r.add_qo_indptr(q_len);
  const int ps = g.pool.page_size();
  const int pages = (tokens + ps - 1) / ps;
  r.add_kv_indptr(0);
  r.add_kv_indptr(pages);
  for (int i = 0; i < pages; ++i) r.add_kv_indices(s.kv_indices[s.kv_indptr[b] + i]);
  r.add_kv_last_page_len(tokens - (pages - 1) * ps);
  return r;
}

// Writes random K/V into every token of the client's sequences, in chunks.
void Fill(v1::AttentionService::Stub& stub, const Geometry& g, const Sequences& s, int tokens,
          std::mt19937& rng) {
  constexpr int kChunk = 2048;
  for (size_t b = 0; b + 1 < s.kv_indptr.size(); ++b) {
    for (int done = 0; done < tokens; done += kChunk) {
      const int n = std::min(kChunk, tokens - done);
      v1::PrefillRequest r = PrefillOf(g, s, static_cast<int>(b), done + n, n, true, rng);
      grpc::ClientContext ctx;
      v1::AttentionResponse resp;
      CHECK_RPC(stub.Prefill(&ctx, r, &resp));
    }
  }
}

v1::DecodeRequest DecodeOf(const Geometry& g, const Sequences& s, std::mt19937& rng) {
  v1::DecodeRequest r;
  r.set_pool(g.pool.name());
  r.set_session(s.session);
  const int64_t batch = static_cast<int64_t>(s.kv_indptr.size()) - 1;
  RandomBf16(r.mutable_q(), {batch, g.pool.num_qo_heads(), g.q_dim()}, rng);
  if (g.mla()) {
    RandomBf16(r.mutable_q_pe(), {batch, g.pool.num_qo_heads(), 64}, rng);
    r.set_sm_scale(0.1352337747812271f);
  }
  *r.mutable_kv_indptr() = {s.kv_indptr.begin(), s.kv_indptr.end()};
  *r.mutable_kv_indices() = {s.kv_indices.begin(), s.kv_indices.end()};
  *r.mutable_kv_last_page_len() = {s.kv_last_page_len.begin(), s.kv_last_page_len.end()};
  return r;
}

// ---- Registered memory: one region per client for its tensors (and one for the page table with
// --transport=cuda, which must be in shared memory).

constexpr char kMagic[] = "attnserve.region";
constexpr size_t kAlign = 256;
size_t AlignUp(size_t n) { return (n + kAlign - 1) / kAlign * kAlign; }

// A region's memory: POSIX shared memory mapped here, or a device allocation (CUDA IPC).
class Arena {
 public:
  Arena(v1::AttentionService::Stub& stub, const std::string& session, const std::string& name,
        size_t bytes, bool cuda)
      : name_(name), bytes_(AlignUp(bytes + kAlign)), cuda_(cuda) {
    std::mt19937_64 rng(std::random_device{}());
    key_.resize(32);
    for (char& c : key_) c = static_cast<char>(rng());
    v1::RegisterRegionRequest req;
    req.set_name(name);
    req.set_session(session);
    req.set_size(static_cast<int64_t>(bytes_));
    req.set_key(key_);
    std::string header = std::string(kMagic, 16) + key_;
    if (!cuda_) {
      shm_name_ = absl::StrCat("/attnserve-loadgen-", getpid(), "-", name);
      const int fd = shm_open(shm_name_.c_str(), O_RDWR | O_CREAT | O_EXCL, 0600);
      if (fd < 0 || ftruncate(fd, static_cast<off_t>(bytes_)) != 0) Die("shm_open/ftruncate");
      host_ = static_cast<char*>(mmap(nullptr, bytes_, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0));
      close(fd);
      if (host_ == MAP_FAILED) Die("mmap");
      std::memcpy(host_, header.data(), header.size());
      req.mutable_shared_memory()->set_shm_name(shm_name_);
    } else {
#if ATTN_LOADGEN_CUDA
      if (cudaMalloc(&device_, bytes_) != cudaSuccess) Die("cudaMalloc");
      cudaMemcpy(device_, header.data(), header.size(), cudaMemcpyHostToDevice);
      cudaIpcMemHandle_t handle;
      if (cudaIpcGetMemHandle(&handle, device_) != cudaSuccess) Die("cudaIpcGetMemHandle");
      req.mutable_cuda_ipc()->set_handle(reinterpret_cast<const char*>(&handle), sizeof(handle));
#else
      Die("this attn_loadgen was built without CUDA");
#endif
    }
    grpc::ClientContext ctx;
    v1::RegisterRegionResponse resp;
    CHECK_RPC(stub.RegisterRegion(&ctx, req, &resp));
    if (!cuda_) shm_unlink(shm_name_.c_str());  // mapped by the server: the name can go
    next_ = kAlign;                             // past the header
  }
  ~Arena() {
    if (host_) munmap(host_, bytes_);
#if ATTN_LOADGEN_CUDA
    if (device_) cudaFree(device_);
#endif
  }

  // A slice of `bytes`, filled with `data` (when given).
  v1::RegionSlice Slice(size_t bytes, const std::string* data = nullptr) {
    const size_t at = next_;
    next_ += AlignUp(bytes);
    if (next_ > bytes_) Die("arena too small");
    if (data != nullptr) {
      if (cuda_) {
#if ATTN_LOADGEN_CUDA
        cudaMemcpy(static_cast<char*>(device_) + at, data->data(), data->size(),
                   cudaMemcpyHostToDevice);
#endif
      } else {
        std::memcpy(host_ + at, data->data(), data->size());
      }
    }
    v1::RegionSlice s;
    s.set_name(name_);
    s.set_offset(static_cast<int64_t>(at));
    return s;
  }

 private:
  [[noreturn]] static void Die(const char* what) {
    std::fprintf(stderr, "attn_loadgen: %s failed: %s\n", what, std::strerror(errno));
    std::exit(1);
  }
  std::string name_, shm_name_, key_;
  size_t bytes_;
  bool cuda_;
  char* host_ = nullptr;
  void* device_ = nullptr;
  size_t next_ = 0;
};

// Bytes a request's tensors and outputs take.
template <typename Request>
size_t TensorBytes(const Request& r) {
  size_t n = 0;
  for (const v1::Tensor* t :
       {&r.q(), &r.q_pe(), &r.k_new(), &r.v_new(), &r.ckv_new(), &r.kpe_new()}) {
    n += AlignUp(t->data().size());
  }
  return n;
}

// Replaces a request's page table by a plan of `session` called `name` holding it (CreatePlan).
template <typename Request>
void OntoPlan(v1::AttentionService::Stub& stub, const std::string& session, const std::string& name,
              Request* r) {
  v1::CreatePlanRequest req;
  req.set_pool(r->pool());
  req.set_session(session);
  req.set_name(name);
  if constexpr (std::is_same_v<Request, v1::PrefillRequest>) {
    req.set_prefill(true);
    *req.mutable_qo_indptr() = r->qo_indptr();
    r->clear_qo_indptr();
  }
  *req.mutable_kv_indptr() = r->kv_indptr();
  *req.mutable_kv_indices() = r->kv_indices();
  *req.mutable_kv_last_page_len() = r->kv_last_page_len();
  r->clear_kv_indptr();
  r->clear_kv_indices();
  r->clear_kv_last_page_len();
  grpc::ClientContext ctx;
  v1::CreatePlanResponse resp;
  const auto start = Clock::now();
  const grpc::Status st = stub.CreatePlan(&ctx, req, &resp);
  if (!st.ok()) {
    std::fprintf(stderr, "CreatePlan failed: %s\n", st.error_message().c_str());
    std::exit(1);
  }
  const double us = std::chrono::duration<double, std::micro>(Clock::now() - start).count();
  std::printf("  plan %s: %d sequences, %d pages, created in %.0f us\n", name.c_str(), resp.batch(),
              resp.num_pages(), us);
  r->set_plan(name);
}

// Moves a request's tensors into `arena`, its page table (unless it names a plan) into
// `tables`, and points its outputs into `arena`.
template <typename Request>
void IntoRegions(Request* r, const Geometry& g, Arena& arena, Arena& tables, bool prefill) {
  int64_t total_q = 0;
  for (v1::Tensor* t : {r->mutable_q(), r->mutable_q_pe(), r->mutable_k_new(), r->mutable_v_new(),
                        r->mutable_ckv_new(), r->mutable_kpe_new()}) {
    if (t->data().empty()) continue;
    const std::string data = t->data();
    t->clear_data();
    *t->mutable_region() = arena.Slice(data.size(), &data);
  }
  total_q = r->q().shape(0);
  for (const char* field : {"q_pe", "k_new", "v_new", "ckv_new", "kpe_new"}) {
    const auto* fd = r->GetDescriptor()->FindFieldByName(field);
    auto* t = static_cast<v1::Tensor*>(r->GetReflection()->MutableMessage(r, fd));
    if (t->shape_size() == 0 && !t->has_region()) r->GetReflection()->ClearField(r, fd);
  }
  const size_t out_bytes = static_cast<size_t>(total_q) * g.pool.num_qo_heads() * g.q_dim() * 2;
  *r->mutable_output_to() = arena.Slice(out_bytes);
  if (!r->plan().empty()) return;
  // The page table: kv_indptr, kv_last_page_len, kv_indices, then qo_indptr (prefill).
  std::vector<int32_t> table(r->kv_indptr().begin(), r->kv_indptr().end());
  table.insert(table.end(), r->kv_last_page_len().begin(), r->kv_last_page_len().end());
  table.insert(table.end(), r->kv_indices().begin(), r->kv_indices().end());
  v1::PageTableRef* ref = r->mutable_page_table();
  ref->set_batch(r->kv_indptr_size() - 1);
  ref->set_num_pages(r->kv_indices_size());
  if constexpr (std::is_same_v<Request, v1::PrefillRequest>) {
    table.insert(table.end(), r->qo_indptr().begin(), r->qo_indptr().end());
    r->clear_qo_indptr();
  }
  (void)prefill;
  const std::string bytes(reinterpret_cast<const char*>(table.data()), table.size() * 4);
  *ref->mutable_at() = tables.Slice(bytes.size(), &bytes);
  r->clear_kv_indptr();
  r->clear_kv_last_page_len();
  r->clear_kv_indices();
}

// One call through the async API, its completion polled without sleeping: the calling thread
// does the call's I/O itself and is never woken.
grpc::Status SpinCall(v1::AttentionService::Stub& stub, grpc::ClientContext* ctx,
                      const v1::DecodeRequest& decode,
                      const std::vector<v1::PrefillRequest>& prefills, size_t& next,
                      v1::AttentionResponse* resp) {
  grpc::CompletionQueue cq;
  grpc::Status status;
  auto reader = prefills.empty() ? stub.AsyncDecode(ctx, decode, &cq)
                                 : stub.AsyncPrefill(ctx, prefills[next++ % prefills.size()], &cq);
  reader->Finish(resp, &status, reinterpret_cast<void*>(1));
  void* tag = nullptr;
  bool ok = false;
  while (cq.AsyncNext(&tag, &ok, gpr_time_0(GPR_CLOCK_MONOTONIC)) !=
         grpc::CompletionQueue::NextStatus::GOT_EVENT) {
  }
  cq.Shutdown();
  while (cq.Next(&tag, &ok)) {
  }
  return status;
}

// A call queue registered for one client (--call_queue).
std::unique_ptr<client::CallQueueClient> RegisterQueue(v1::AttentionService::Stub& stub,
                                                       const std::string& session,
                                                       const std::string& name,
                                                       size_t request_bytes) {
  client::CallQueueClient::Options options;
  options.slots = 2;
  const int spin_us = absl::GetFlag(FLAGS_call_queue_spin_us);
  options.spin = std::chrono::microseconds(
      spin_us >= 0 ? spin_us : (std::thread::hardware_concurrency() >= 8 ? 200 : 0));
  options.predict = absl::GetFlag(FLAGS_call_queue_predict);
  options.request_bytes = static_cast<int>((request_bytes + 4096 + 63) / 64 * 64);
  std::string error;
  auto queue = client::CallQueueClient::Create(options, &error);
  if (queue == nullptr) {
    std::fprintf(stderr, "attn_loadgen: %s\n", error.c_str());
    std::exit(1);
  }
  v1::RegisterRegionRequest req;
  req.set_name(name);
  req.set_session(session);
  req.mutable_shared_memory()->set_shm_name(queue->shm_name());
  req.set_size(queue->size());
  req.set_key(queue->key());
  req.mutable_call_queue()->set_slots(options.slots);
  req.mutable_call_queue()->set_request_bytes(options.request_bytes);
  req.mutable_call_queue()->set_response_bytes(options.response_bytes);
  grpc::ClientContext ctx;
  v1::RegisterRegionResponse resp;
  const grpc::Status st = stub.RegisterRegion(&ctx, req, &resp);
  queue->Unlink();  // mapped by the server, or refused: the name goes either way
  if (!st.ok()) {
    std::fprintf(stderr, "RegisterRegion (call queue) failed: %d %s\n",
                 static_cast<int>(st.error_code()), st.error_message().c_str());
    std::exit(1);
  }
  return queue;
}

// One call through the client's queue: the request serialized, sent, its answer parsed.
grpc::Status QueueCall(client::CallQueueClient& queue, const v1::DecodeRequest& decode,
                       const std::vector<v1::PrefillRequest>& prefills, size_t& next,
                       v1::AttentionResponse* resp) {
  namespace cq = ::attnserve::v1::call_queue;
  const bool prefill = !prefills.empty();
  const std::string bytes =
      prefill ? prefills[next++ % prefills.size()].SerializeAsString() : decode.SerializeAsString();
  client::CallQueueClient::Answer answer =
      queue.Call(prefill ? cq::kPrefill : cq::kDecode, bytes, std::chrono::seconds(60));
  if (answer.code != 0) return grpc::Status(grpc::StatusCode(answer.code), answer.bytes);
  if (!resp->ParseFromString(answer.bytes)) {
    return grpc::Status(grpc::StatusCode::INTERNAL, "the answer is not an AttentionResponse");
  }
  return grpc::Status::OK;
}
// ---- The bytes transport without protobuf's copies: each request is written once (its tensors'
// data borrowed from the request it was built from, as slices of the gRPC message) and sent again
// on every call; the response's output and lse stay in the slices gRPC received them in (a real
// caller would copy them once, to where it needs them). The bytes on the wire are protobuf's.
class SliceCalls {
 public:
  // `decode` and `prefills` must outlive this object, unchanged; calls go to the prefills (in
  // turn) when there are any, else to the decode.
  SliceCalls(std::shared_ptr<grpc::Channel> channel, const v1::DecodeRequest& decode,
             const std::vector<v1::PrefillRequest>& prefills)
      : stub_(std::move(channel)),
        method_(absl::StrCat("/", v1::AttentionService::service_full_name(),
                             prefills.empty() ? "/Decode" : "/Prefill")) {
    if (prefills.empty()) requests_.push_back(Prepare(decode));
    for (const v1::PrefillRequest& p : prefills) requests_.push_back(Prepare(p));
  }
  ~SliceCalls() {
    cq_.Shutdown();
    void* tag;
    bool ok;
    while (cq_.Next(&tag, &ok)) {
    }
  }

  // One call, its reply awaited in the completion queue (polled without sleeping with `spin`).
  grpc::Status Call(grpc::ClientContext* ctx, bool spin, v1::AttentionResponse* resp) {
    std::unique_ptr<grpc::GenericClientAsyncResponseReader> call =
        stub_.PrepareUnaryCall(ctx, method_, requests_[next_++ % requests_.size()], &cq_);
    call->StartCall();
    grpc::ByteBuffer reply;
    grpc::Status status;
    call->Finish(&reply, &status, this);
    void* tag = nullptr;
    bool ok = false;
    if (spin) {
      while (cq_.AsyncNext(&tag, &ok, gpr_time_0(GPR_CLOCK_MONOTONIC)) !=
             grpc::CompletionQueue::NextStatus::GOT_EVENT) {
      }
    } else {
      cq_.Next(&tag, &ok);
    }
    if (!status.ok()) return status;
    HostBytes data[2];  // output, lse
    if (absl::Status st =
            ReadTensorMessage(reply, &slices_, v1::AttentionResponse::kOutputFieldNumber,
                              v1::AttentionResponse::kLseFieldNumber, resp, data);
        !st.ok()) {
      return grpc::Status(grpc::StatusCode::INTERNAL, std::string(st.message()));
    }
    // The data must be what the shapes say: a reader that lost bytes would show here.
    if (resp->has_output() && data[0].size() != Elements(resp->output()) * 2) {
      return grpc::Status(grpc::StatusCode::INTERNAL,
                          absl::StrCat("output has ", data[0].size(), " bytes for shape ",
                                       resp->output().ShortDebugString()));
    }
    return status;
  }

 private:
  static grpc::ByteBuffer Prepare(const google::protobuf::Message& request) {
    const google::protobuf::Descriptor* d = request.GetDescriptor();
    std::vector<TensorSlice> tensors;
    for (const google::protobuf::FieldDescriptor* f :
         {d->FindFieldByName("q"), d->FindFieldByName("q_pe"), d->FindFieldByName("k_new"),
          d->FindFieldByName("v_new"), d->FindFieldByName("ckv_new"),
          d->FindFieldByName("kpe_new")}) {
      if (f == nullptr) continue;
      const auto& t =
          static_cast<const v1::Tensor&>(request.GetReflection()->GetMessage(request, f));
      tensors.push_back({f->number(), BorrowedSlice(t.data().data(), t.data().size())});
    }
    return WriteTensorMessage(request, tensors);
  }
  static int64_t Elements(const v1::Tensor& t) {
    int64_t n = 1;
    for (int64_t d : t.shape()) n *= d;
    return n;
  }

  grpc::GenericStub stub_;
  const std::string method_;
  grpc::CompletionQueue cq_;
  std::vector<grpc::ByteBuffer> requests_;
  size_t next_ = 0;
  std::vector<grpc::Slice> slices_;  // the last response's
};

struct Sample {
  double client_us, queue_us, compute_us, total_us;
  int batch_requests;
  double prepare_us, execute_us, finish_us;
};

struct Stats {
  std::vector<Sample> samples;
  int64_t tokens = 0;
};

double Percentile(std::vector<double> v, double p) {
  if (v.empty()) return 0;
  std::sort(v.begin(), v.end());
  return v[std::min(v.size() - 1, static_cast<size_t>(p * v.size()))];
}

template <typename Field>
std::vector<double> Column(const std::vector<Sample>& s, Field f) {
  std::vector<double> v;
  for (const Sample& x : s) v.push_back(f(x));
  return v;
}

int Main() {
  const std::string address = absl::GetFlag(FLAGS_address);
  const int clients = absl::GetFlag(FLAGS_clients), batch = absl::GetFlag(FLAGS_batch);
  const int context = absl::GetFlag(FLAGS_context);
  const bool prefill = absl::GetFlag(FLAGS_op) == "prefill";
  const int prefill_tokens = absl::GetFlag(FLAGS_prefill_tokens);
  const int background = absl::GetFlag(FLAGS_background_prefill_tokens);

  auto info_stub = Connect(address);
  grpc::ClientContext info_ctx;
  v1::GetServerInfoResponse info;
  CHECK_RPC(info_stub->GetServerInfo(&info_ctx, {}, &info));
  Geometry g;
  for (const v1::PoolInfo& p : info.pools()) {
    if (absl::GetFlag(FLAGS_pool).empty() || p.name() == absl::GetFlag(FLAGS_pool)) g.pool = p;
  }
  std::printf("server %s backend %s (%s); pool %s: %d/%d heads, page %d\n", info.version().c_str(),
              info.backend().c_str(), info.device().c_str(), g.pool.name().c_str(),
              g.pool.num_qo_heads(), g.pool.num_kv_heads(), g.pool.page_size());

  // Set-up: every client's sequences, filled with random K/V.
  const int seq_tokens = prefill ? context + prefill_tokens : context;
  std::vector<std::unique_ptr<v1::AttentionService::Stub>> stubs;
  std::vector<std::shared_ptr<grpc::Channel>> channels;
  std::vector<Sequences> seqs;
  std::mt19937 rng(1);
  std::string session;
  for (int c = 0; c < clients + (background > 0); ++c) {
    const bool bg = c == clients;
    stubs.push_back(Connect(address, &channels.emplace_back()));
    if (session.empty()) session = OpenSession(*stubs.back());
    seqs.push_back(
        Allocate(*stubs.back(), g, session, bg ? 1 : batch, bg ? background : seq_tokens));
    Fill(*stubs.back(), g, seqs.back(), bg ? background : seq_tokens, rng);
  }

  const std::string transport = absl::GetFlag(FLAGS_transport);
  if (transport != "bytes" && transport != "shm" && transport != "cuda") {
    std::fprintf(stderr, "--transport must be bytes, shm or cuda\n");
    return 2;
  }
  const bool call_queue = absl::GetFlag(FLAGS_call_queue);
  if (call_queue && transport == "bytes") {
    std::fprintf(stderr, "--call_queue needs --transport=shm or cuda\n");
    return 2;
  }
  std::atomic<bool> measuring{false}, stop{false};
  std::vector<Stats> stats(clients + (background > 0));
  std::vector<std::thread> threads;
  for (int c = 0; c < clients + (background > 0); ++c) {
    threads.emplace_back([&, c] {
      std::mt19937 local(c + 7);
      const bool bg = c == clients;
      v1::DecodeRequest decode = DecodeOf(g, seqs[c], local);
      std::vector<v1::PrefillRequest> prefills;
      const bool append = absl::GetFlag(FLAGS_append);
      if (bg) {
        prefills.push_back(PrefillOf(g, seqs[c], 0, background, background, false, local));
      } else if (prefill) {
        for (int b = 0; b < batch; ++b) {
          prefills.push_back(PrefillOf(g, seqs[c], b, seq_tokens, prefill_tokens, append, local));
        }
      }
      std::vector<std::string> plans;
      if (absl::GetFlag(FLAGS_plan) && !bg) {
        const std::string& session = seqs[c].session;
        if (prefills.empty()) {
          OntoPlan(*stubs[c], session, plans.emplace_back(absl::StrCat("p", c)), &decode);
        }
        for (size_t i = 0; i < prefills.size(); ++i) {
          OntoPlan(*stubs[c], session, plans.emplace_back(absl::StrCat("p", c, "-", i)),
                   &prefills[i]);
        }
      }
      std::unique_ptr<Arena> arena, tables;
      if (transport != "bytes" && !bg) {
        // Inputs, and an output as large as q for each request.
        size_t bytes = 2 * TensorBytes(decode) + (size_t{1} << 20);
        for (const auto& p : prefills) bytes += 2 * TensorBytes(p);
        const std::string& session = seqs[c].session;
        arena = std::make_unique<Arena>(*stubs[c], session, absl::StrCat("c", c), bytes,
                                        transport == "cuda");
        tables =
            transport == "cuda"
                ? std::make_unique<Arena>(*stubs[c], session, absl::StrCat("t", c), 16 << 20, false)
                : nullptr;
        Arena& t = tables ? *tables : *arena;
        IntoRegions(&decode, g, *arena, t, false);
        for (auto& p : prefills) IntoRegions(&p, g, *arena, t, true);
      }
      std::unique_ptr<client::CallQueueClient> queue;
      if (call_queue && !bg) {
        size_t largest = decode.ByteSizeLong();
        for (const auto& p : prefills) largest = std::max(largest, p.ByteSizeLong());
        queue = RegisterQueue(*stubs[c], seqs[c].session, absl::StrCat("q", c), largest);
      }
      size_t next = 0;
      const bool spin = absl::GetFlag(FLAGS_spin);
      std::unique_ptr<SliceCalls> slice_calls;
      if (transport == "bytes" && !absl::GetFlag(FLAGS_protobuf_bytes)) {
        slice_calls = std::make_unique<SliceCalls>(channels[c], decode, prefills);
      }
      while (!stop.load()) {
        grpc::ClientContext ctx;
        ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(60));
        v1::AttentionResponse resp;
        const auto start = Clock::now();
        const grpc::Status st =
            queue              ? QueueCall(*queue, decode, prefills, next, &resp)
            : slice_calls      ? slice_calls->Call(&ctx, spin, &resp)
            : spin             ? SpinCall(*stubs[c], &ctx, decode, prefills, next, &resp)
            : prefills.empty() ? stubs[c]->Decode(&ctx, decode, &resp)
                               : stubs[c]->Prefill(&ctx, prefills[next++ % prefills.size()], &resp);
        const double us = std::chrono::duration<double, std::micro>(Clock::now() - start).count();
        if (!st.ok()) {
          std::fprintf(stderr, "call failed: %s\n", st.error_message().c_str());
          std::exit(1);
        }
        if (!measuring.load()) continue;
        const v1::Timings& t = resp.timings();
        stats[c].samples.push_back({us, double(t.queue_us()), double(t.compute_us()),
                                    double(t.total_us()), t.batch_requests(),
                                    double(t.prepare_us()), double(t.execute_us()),
                                    double(t.finish_us())});
        stats[c].tokens += prefills.empty() ? batch : (bg ? background : prefill_tokens);
      }
      if (queue) {
        grpc::ClientContext ctx;
        v1::UnregisterRegionRequest req;
        req.set_name(absl::StrCat("q", c));
        req.set_session(seqs[c].session);
        v1::UnregisterRegionResponse resp;
        CHECK_RPC(stubs[c]->UnregisterRegion(&ctx, req, &resp));
      }
      for (const std::string& name : plans) {  // their pins keep the pages from FreePages
        grpc::ClientContext ctx;
        v1::ReleasePlanRequest req;
        req.set_name(name);
        req.set_session(seqs[c].session);
        v1::ReleasePlanResponse resp;
        CHECK_RPC(stubs[c]->ReleasePlan(&ctx, req, &resp));
      }
    });
  }
  std::this_thread::sleep_for(std::chrono::duration<double>(absl::GetFlag(FLAGS_warmup_seconds)));
  measuring = true;
  const auto begin = Clock::now();
  std::this_thread::sleep_for(std::chrono::duration<double>(absl::GetFlag(FLAGS_seconds)));
  measuring = false;
  const double elapsed = std::chrono::duration<double>(Clock::now() - begin).count();
  stop = true;
  for (auto& t : threads) t.join();
  for (int c = 0; c < clients + (background > 0); ++c) Free(*stubs[c], g, seqs[c]);

  Stats fg;
  for (int c = 0; c < clients; ++c) {
    fg.samples.insert(fg.samples.end(), stats[c].samples.begin(), stats[c].samples.end());
    fg.tokens += stats[c].tokens;
  }
  auto col = [&](auto f) { return Column(fg.samples, f); };
  const auto client = col([](const Sample& s) { return s.client_us; });
  const auto queue = col([](const Sample& s) { return s.queue_us; });
  const auto compute = col([](const Sample& s) { return s.compute_us; });
  const auto total = col([](const Sample& s) { return s.total_us; });
  const auto overhead = col([](const Sample& s) { return s.total_us - s.compute_us; });
  // The server's overhead stage by stage: gathering inputs; copies, launches and the wait beyond
  // the kernels; writing outputs; and the rest (validation, handing the call to the batcher
  // thread and back).
  const auto prepare = col([](const Sample& s) { return s.prepare_us; });
  const auto transfer = col([](const Sample& s) { return s.execute_us - s.compute_us; });
  const auto finish = col([](const Sample& s) { return s.finish_us; });
  const auto rest = col([](const Sample& s) {
    return s.total_us - s.queue_us - s.prepare_us - s.execute_us - s.finish_us;
  });
  // What the caller pays beyond the kernel: the server's overhead plus gRPC on both ends.
  const auto end_to_end = col([](const Sample& s) { return s.client_us - s.compute_us; });
  double merged = 0;
  for (const Sample& s : fg.samples) merged += s.batch_requests;
  merged /= std::max<size_t>(1, fg.samples.size());
  const double calls_per_s = fg.samples.size() / elapsed;
  const double tokens_per_s = fg.tokens / elapsed;

  std::printf("%d clients x %s batch %d, context %d%s: %zu calls in %.1f s\n", clients,
              prefill ? "prefill" : "decode", batch, context,
              background > 0 ? absl::StrCat(", background prefill ", background).c_str() : "",
              fg.samples.size(), elapsed);
  std::printf("  throughput  %.0f calls/s, %.0f tokens/s; calls merged per launch %.2f\n",
              calls_per_s, tokens_per_s, merged);
  std::printf("  client us   p50 %.0f  p90 %.0f  p99 %.0f\n", Percentile(client, .5),
              Percentile(client, .9), Percentile(client, .99));
  std::printf(
      "  server us   queue p50 %.0f p99 %.0f | compute p50 %.0f p99 %.0f | total p50 %.0f "
      "p99 %.0f | overhead (total - compute) p50 %.0f p99 %.0f\n",
      Percentile(queue, .5), Percentile(queue, .99), Percentile(compute, .5),
      Percentile(compute, .99), Percentile(total, .5), Percentile(total, .99),
      Percentile(overhead, .5), Percentile(overhead, .99));
  std::printf(
      "  overhead us p50: queue %.0f | prepare %.0f | execute - compute %.0f | finish %.0f | "
      "rest %.0f\n",
      Percentile(queue, .5), Percentile(prepare, .5), Percentile(transfer, .5),
      Percentile(finish, .5), Percentile(rest, .5));
  std::printf("  end to end  client - compute p50 %.0f p99 %.0f\n", Percentile(end_to_end, .5),
              Percentile(end_to_end, .99));
  if (const std::string path = absl::GetFlag(FLAGS_json); !path.empty()) {
    std::ofstream f(path);
    f << "{\"clients\": " << clients << ", \"batch\": " << batch << ", \"context\": " << context
      << ", \"op\": \"" << (prefill ? "prefill" : "decode")
      << "\", \"background_prefill\": " << background << ", \"calls_per_s\": " << calls_per_s
      << ", \"tokens_per_s\": " << tokens_per_s << ", \"merged_per_launch\": " << merged
      << ", \"client_us\": {\"p50\": " << Percentile(client, .5)
      << ", \"p90\": " << Percentile(client, .9) << ", \"p99\": " << Percentile(client, .99)
      << "}, \"server_overhead_us\": {\"p50\": " << Percentile(overhead, .5)
      << ", \"p99\": " << Percentile(overhead, .99)
      << "}, \"end_to_end_overhead_us\": {\"p50\": " << Percentile(end_to_end, .5)
      << ", \"p99\": " << Percentile(end_to_end, .99)
      << "}, \"compute_us_p50\": " << Percentile(compute, .5)
      << ", \"queue_us_p50\": " << Percentile(queue, .5)
      << ", \"stage_us_p50\": {\"prepare\": " << Percentile(prepare, .5)
      << ", \"execute_minus_compute\": " << Percentile(transfer, .5)
      << ", \"finish\": " << Percentile(finish, .5) << ", \"rest\": " << Percentile(rest, .5)
      << "}}\n";
  }
  return 0;
}

}  // namespace
}  // namespace attn::bench

int main(int argc, char** argv) {
#ifdef NDEBUG
  // Without the lock-order graph Debian's Abseil keeps behind every absl::Mutex (gRPC's too),
  // as the server (server/main.cc).
  absl::SetMutexDeadlockDetectionMode(absl::OnDeadlockCycle::kIgnore);
#endif
  absl::ParseCommandLine(argc, argv);
  return attn::bench::Main();
}
