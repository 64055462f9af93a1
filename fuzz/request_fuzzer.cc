// libFuzzer target: one Prefill or Decode request from the wire through the engine's admission to
// the CPU kernels, the path every untrusted request takes in the server (minus gRPC).
//
// Input: byte 0 selects what the rest is; bytes 1.. are protobuf wire bytes, so truncated,
// duplicated, unknown and hostile fields are all explored.
//   bits 0-1: the pool (0 and 3: kPools[0], 1: kPools[1], 2: kPools[2])
//   bit 2:    0 = attnserve.v1.PrefillRequest, 1 = DecodeRequest
//   bit 3:    submit the call twice, to run in one launch (a merged batch of two calls)
//   bit 4:    (without bit 3) the request's page table goes into a plan first (ValidatePlanTable,
//             Engine::CreatePlan), which is released from the session at once; the call names
//             it and keeps it alive until it is over
// Steps, as the service takes them: parse with the request reader (server/rpc/request_reader.h:
// tensors stay in the input bytes); validate against the pool (server/api/validate.h), resolving
// region references against a shared-memory region "r" of kRegionBytes that the connection's
// session registered (a page table at 1024, random bf16 values from 4096 on);
// then, on a fresh Engine over a CPU backend (server/engine/engine.h) whose pools' pages
// 0 .. num_pages - 4 belong to the caller's session, the next two to another session and the last
// is free: Engine::Admit as the session the request names (the caller's when it names none, as a
// client names its own), which resolves the handle, pins kv_indices and takes the append locks;
// drop admitted calls whose attention work exceeds kWorkBudget (one input must not take seconds);
// Engine::Submit and wait for the answer; check the pools are as they were.
//
// Besides sanitizer reports, the target aborts when an API contract is broken: a validation error
// that is not INVALID_ARGUMENT, an admission error other than INVALID_ARGUMENT /
// FAILED_PRECONDITION / NOT_FOUND, a second admission of an appending call that is not refused
// (its append locks) or of a reading call that is, a failed launch, two calls that did not share
// one launch, outputs of the wrong size, or pages left pinned, counted as busy or changed hands.
//
// fuzz/make_corpus.py writes the seed corpus (fuzz/corpus/) in this format. ATTN_FUZZ_VERBOSE=1
// prints what happened to each input (the error, or the launch), to check what seeds reach.
#include <fcntl.h>
#include <sys/mman.h>
#include <unistd.h>

#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <memory>
#include <string>
#include <type_traits>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/notification.h"
#include "absl/time/time.h"
#include "attnserve/v1/attention.pb.h"
#include "fuzz/verbose.h"
#include "google/protobuf/stubs/logging.h"
#include "server/api/pool_config.h"
#include "server/api/validate.h"
#include "server/backends/cpu_backend.h"
#include "server/engine/engine.h"
#include "server/engine/pool_geometry.h"
#include "server/rpc/request_reader.h"

namespace attn {
namespace {

// Multiply-adds of attention (sum over sequences of q_len * kv_len * heads * width) one input may
// run: about 10 ms under ASan + UBSan.
constexpr int64_t kWorkBudget = int64_t{1} << 22;

constexpr uint64_t kEpoch = 0x00000000a77e5e11;

// Small pools covering both kinds, page sizes 1 and > 1, and GQA groups 2 and 3. The corpus
// generator (fuzz/make_corpus.py) knows these numbers.
v1::PoolConfig PoolConfig(int index) {
  v1::PoolConfig c;
  switch (index) {
    case 0:
      c.set_name("gqa");
      c.set_kind(v1::POOL_KIND_GQA);
      c.set_num_layers(2);
      c.set_page_size(4);
      c.set_num_qo_heads(4);
      c.set_num_kv_heads(2);
      c.set_head_dim(64);
      c.set_num_pages(16);
      break;
    case 1:
      c.set_name("gqa_p1");
      c.set_kind(v1::POOL_KIND_GQA);
      c.set_num_layers(1);
      c.set_page_size(1);
      c.set_num_qo_heads(3);
      c.set_num_kv_heads(1);
      c.set_head_dim(64);
      c.set_num_pages(32);
      break;
    default:
      c.set_name("mla");
      c.set_kind(v1::POOL_KIND_MLA);
      c.set_num_layers(2);
      c.set_page_size(4);
      c.set_num_qo_heads(2);
      c.set_num_pages(8);
      break;
  }
  return c;
}
constexpr int kNumPools = 3;

void Note(const char* what, const absl::Status& status = absl::OkStatus()) {
  if (!FuzzVerbose()) return;
  std::fprintf(stderr, "request_fuzzer: %s%s%s\n", what, status.ok() ? "" : " ",
               status.ok() ? "" : status.ToString().c_str());
}

[[noreturn]] void Fail(const char* what, const absl::Status& status = absl::OkStatus()) {
  std::fprintf(stderr, "request_fuzzer: %s %s\n", what, status.ToString().c_str());
  std::abort();
}

// The region every World registers: a shared-memory object made once per process, with the
// region header at 0 and random bf16 values (finite, small) from 4096 on.
constexpr int64_t kRegionBytes = int64_t{1} << 20;

// The pools' geometries and the shared-memory object, built once.
struct Fixture {
  Fixture() {
    // Protobuf logs an ERROR line for every string field with invalid UTF-8 (the parse fails
    // either way); at tens of thousands of inputs a second that is all the fuzzer would do.
    google::protobuf::SetLogHandler(nullptr);
    for (int i = 0; i < kNumPools; ++i) {
      absl::StatusOr<PoolGeometry> g = GeometryFromConfig(PoolConfig(i));
      if (!g.ok()) Fail("bad fixture pool", g.status());
      pools.push_back(*g);
    }
    region.shm_name = absl::StrCat("/attnserve-fuzz-", getpid());
    region.size = kRegionBytes;
    region.key = std::string(kRegionKeyBytes, 'k');
    const int fd = shm_open(region.shm_name.c_str(), O_RDWR | O_CREAT | O_TRUNC, 0600);
    if (fd < 0 || ftruncate(fd, kRegionBytes) != 0) Fail("fixture shared memory");
    void* p = mmap(nullptr, kRegionBytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    close(fd);
    if (p == MAP_FAILED) Fail("fixture mmap");
    char* bytes = static_cast<char*>(p);
    std::memcpy(bytes, kRegionMagic.data(), kRegionMagic.size());
    std::memcpy(bytes + kRegionMagic.size(), region.key.data(), region.key.size());
    uint32_t x = 12345;
    for (int64_t i = 4096; i + 1 < kRegionBytes; i += 2) {
      x = x * 1664525u + 1013904223u;
      const uint16_t bf16_bits = static_cast<uint16_t>(0x3c00 | ((x >> 16) & 0x7f)) |
                                 static_cast<uint16_t>((x >> 31) << 15);  // +-[0.0078, 0.0156)
      std::memcpy(bytes + i, &bf16_bits, 2);
    }
    // A page table at 1024 (PageTableRef batch 1, num_pages 1): kv_indptr {0, 1},
    // kv_last_page_len {1}, kv_indices {0} (the owner's page 0), then qo_indptr {0, 1}.
    const int32_t table[] = {0, 1, 1, 0, 0, 1};
    std::memcpy(bytes + 1024, table, sizeof(table));
    mapping = bytes;  // kept: Restore writes the image back
    image.assign(bytes, kRegionBytes);
    // Worlds map it by name; the name goes when the process exits normally.
    static std::string name = region.shm_name;
    std::atexit([] { shm_unlink(name.c_str()); });
  }
  // Writes the region's first contents back. A call may write its output anywhere in the region,
  // its header included (the caller's memory is the caller's), and every World maps the same
  // object: without this, one such input would change what later inputs read and make every
  // later World's registration fail.
  void Restore() { std::memcpy(mapping, image.data(), image.size()); }

  std::vector<PoolGeometry> pools;
  RegionSpec region;
  char* mapping = nullptr;  // the region, mapped here for the life of the process
  std::string image;        // its contents as made
};

Fixture& GetFixture() {
  static Fixture* fixture = new Fixture();  // never destroyed: no exit-time ordering issues
  return *fixture;
}

// The caller's session is the first one a fresh engine opens.
constexpr SessionId kOwner = 1;
constexpr int kOtherPages = 2;

// A fresh engine per input keeps runs reproducible (its pools start zeroed and in the same
// hands). `calls_per_launch` calls are held until they can all run in one launch.
class World {
 public:
  explicit World(int calls_per_launch) {
    BatchingOptions batching;
    batching.max_queue_delay = absl::InfiniteDuration();
    batching.max_batch_requests = calls_per_launch;
    batching.max_batch_tokens = std::numeric_limits<int>::max();
    DataPlaneOptions data_plane;
    data_plane.shared_memory = true;
    absl::StatusOr<std::unique_ptr<Engine>> engine =
        Engine::Create(CreateCpuBackend(1), GetFixture().pools, batching, SessionOptions{}, kEpoch,
                       nullptr, nullptr, data_plane);
    if (!engine.ok()) Fail("Engine::Create", engine.status());
    engine_ = *std::move(engine);
    absl::StatusOr<OpenedSession> mine = engine_->OpenSession(absl::ZeroDuration(), 0, {});
    absl::StatusOr<OpenedSession> theirs = engine_->OpenSession(absl::ZeroDuration(), 0, {});
    if (!mine.ok() || !theirs.ok() || mine->id != kOwner) Fail("fixture sessions");
    owner_handle_ = mine->handle;
    const Caller owner{owner_handle_, Principal{}};
    const Caller other{theirs->handle, Principal{}};
    if (auto st = engine_->RegisterRegion(owner, "r", GetFixture().region); !st.ok())
      Fail("fixture region", st.status());
    for (const PoolGeometry& g : GetFixture().pools) {
      // Allocation hands out 0, 1, 2, ... first: the owner gets 0 .. n - 4.
      if (!engine_->AllocatePages(g.name, owner, g.num_pages - 1 - kOtherPages).ok() ||
          !engine_->AllocatePages(g.name, other, kOtherPages).ok()) {
        Fail("fixture allocation failed");
      }
    }
  }

  Engine& engine() { return *engine_; }
  const std::string& owner_handle() const { return owner_handle_; }

  // Every call is over and every page where the setup put it.
  void CheckUntouched() {
    // A call leaves the drain count just after its answer: wait for that (the bound only turns
    // a leak into a failure).
    if (!engine_->WaitForIdle(absl::Now() + absl::Seconds(10))) Fail("a call is never over");
    for (const auto& pool : engine_->pools()) {
      const PagePool& pages = pool->pages();
      if (pages.pinned_pages() != 0) Fail("pages left pinned");
      if (pages.pages_of(kOwner) != pool->total_pages() - 1 - kOtherPages ||
          pages.free_pages() != 1) {
        Fail("pages changed hands");
      }
    }
  }

 private:
  std::unique_ptr<Engine> engine_;
  std::string owner_handle_;
};

// Attention multiply-adds of a validated call, in 64 bits (inputs are bounded by the message,
// but page tables may name far more keys than they carry queries).
int64_t Work(const AttentionCall& call, const PoolGeometry& g) {
  // Scores plus P x V per head and key: 2 x head_dim (GQA), 576 + 512 (MLA).
  const RowShapes& rows = g.rows();
  const int64_t width = rows.q.dim + rows.q_pe.dim + rows.out.dim;
  int64_t work = 0;
  for (int b = 0; b < call.batch_size; ++b) {
    const int64_t q_len =
        call.qo_indptr.empty() ? 1 : int64_t{call.qo_indptr[b + 1]} - call.qo_indptr[b];
    const int64_t pages = int64_t{call.kv_indptr[b + 1]} - call.kv_indptr[b];
    const int64_t kv_len = pages == 0 ? 0 : (pages - 1) * g.page_size + call.kv_last_page_len[b];
    work += q_len * (kv_len + 1) * g.num_qo_heads * width;
    if (work > kWorkBudget) return work;
  }
  return work;
}

absl::StatusOr<ValidatedCall> Validate(const v1::PrefillRequest& req, const InlineTensors& data,
                                       const PoolGeometry& g, const RegionResolver& regions,
                                       const Plan* plan = nullptr) {
  return ValidatePrefill(req, data, g, regions, FiniteCheck::kHost,
                         plan ? &plan->table() : nullptr);
}
absl::StatusOr<ValidatedCall> Validate(const v1::DecodeRequest& req, const InlineTensors& data,
                                       const PoolGeometry& g, const RegionResolver& regions,
                                       const Plan* plan = nullptr) {
  return ValidateDecode(req, data, g, regions, FiniteCheck::kHost, plan ? &plan->table() : nullptr);
}

// The request's page table (fields or PageTableRef) as a CreatePlanRequest for plan "p", and the
// request naming that plan instead.
template <typename Request>
v1::CreatePlanRequest MoveIntoPlan(Request& req, const std::string& pool) {
  v1::CreatePlanRequest c;
  c.set_pool(pool);
  c.set_name("p");
  if constexpr (std::is_same_v<Request, v1::PrefillRequest>) {
    c.set_prefill(true);
    c.mutable_qo_indptr()->Swap(req.mutable_qo_indptr());
  }
  c.mutable_kv_indptr()->Swap(req.mutable_kv_indptr());
  c.mutable_kv_indices()->Swap(req.mutable_kv_indices());
  c.mutable_kv_last_page_len()->Swap(req.mutable_kv_last_page_len());
  if (req.has_page_table()) c.mutable_page_table()->Swap(req.mutable_page_table());
  req.clear_page_table();
  req.set_plan("p");
  return c;
}

// Validation errors: INVALID_ARGUMENT, or for region references NOT_FOUND (not registered).
bool ValidationError(const absl::Status& st) {
  return absl::IsInvalidArgument(st) || absl::IsNotFound(st);
}

// (PERMISSION_DENIED cannot happen: every session here is the anonymous principal's.)
bool AdmissionError(const absl::Status& st) {
  return absl::IsInvalidArgument(st) || absl::IsFailedPrecondition(st) || absl::IsNotFound(st);
}

template <typename Request>
void RunOne(Request req, const InlineTensors& data, int pool_index, bool merge, bool use_plan) {
  const PoolGeometry& g = GetFixture().pools[pool_index];
  // Validation resolves regions, so the world (its engine and region) comes first; an invalid
  // request must leave it as it was.
  World probe(1);
  // The session the request names, or (none named) the owner's: handles are random per world.
  const auto CallerIn = [&req](World& w) {
    return Caller{req.session().empty() ? w.owner_handle() : req.session(), Principal{}};
  };
  Engine& probe_engine = probe.engine();
  const Caller probe_caller = CallerIn(probe);
  const RegionResolver probe_regions = [&](absl::Span<const SliceRef> slices) {
    return probe_engine.ResolveRegions(probe_caller, slices);
  };
  std::shared_ptr<const Plan> plan;
  if (use_plan) {
    Engine::Pool& probe_pool = **probe_engine.FindPool(g.name);
    const v1::CreatePlanRequest create = MoveIntoPlan(req, g.name);
    absl::StatusOr<PlanTable> table = ValidatePlanTable(create, g, probe_regions);
    const absl::Status made =
        table.ok() ? probe_engine.CreatePlan(probe_pool, probe_caller, "p", *std::move(table))
                   : table.status();
    if (!made.ok()) {
      if (!ValidationError(made) && !AdmissionError(made)) Fail("plan error code", made);
      Note("no plan:", made);
      probe.CheckUntouched();
      return;
    }
    constexpr Op kOp = std::is_same_v<Request, v1::PrefillRequest> ? Op::kPrefill : Op::kDecode;
    absl::StatusOr<std::shared_ptr<const Plan>> found =
        probe_engine.FindPlan(probe_pool, probe_caller, "p", kOp);
    if (!found.ok()) Fail("the plan made is not found", found.status());
    plan = *std::move(found);
    // Gone from the session: from here on only this call keeps it (and its pins).
    if (absl::Status st = probe_engine.ReleasePlan(probe_caller, "p"); !st.ok()) {
      Fail("ReleasePlan", st);
    }
  }
  absl::StatusOr<ValidatedCall> valid = Validate(req, data, g, probe_regions, plan.get());
  if (!valid.ok()) {
    if (!ValidationError(valid.status()) && !absl::IsFailedPrecondition(valid.status())) {
      Fail("validation error code", valid.status());
    }
    Note("invalid:", valid.status());
    plan.reset();  // its pins go with it
    probe.CheckUntouched();
    return;
  }
  const AttentionCall* call = &valid->call;
  // The same call twice: an appending call holds append locks on its pages, so its copy must be
  // refused; a call that only reads is admitted twice.
  const bool twice = merge && call->append_pages.empty();
  std::unique_ptr<World> merged_world = twice ? std::make_unique<World>(2) : nullptr;
  World& world = twice ? *merged_world : probe;
  Engine& engine = world.engine();
  Engine::Pool& pool = **engine.FindPool(g.name);
  const Caller caller = CallerIn(world);
  const RegionResolver regions = [&](absl::Span<const SliceRef> slices) {
    return engine.ResolveRegions(caller, slices);
  };
  if (twice) {  // validated again against the world that runs it
    valid = Validate(req, data, g, regions);
    if (!valid.ok()) Fail("validation changed its mind", valid.status());
    call = &valid->call;
  }

  // What the checks below need, read before the call moves into its admission.
  const int64_t work = Work(*call, g);
  const size_t tokens = call->total_q;
  const bool return_lse = call->return_lse;
  std::vector<Admission> admitted;
  absl::StatusOr<Admission> first = engine.Admit(pool, caller, std::move(valid->call),
                                                 std::move(valid->regions), std::move(plan));
  if (!first.ok()) {
    if (!AdmissionError(first.status())) Fail("admission error code", first.status());
    Note("not admitted:", first.status());
    world.CheckUntouched();
    return;
  }
  admitted.push_back(*std::move(first));
  if (merge) {
    absl::StatusOr<ValidatedCall> again = Validate(req, data, g, regions);
    if (!again.ok()) Fail("validation changed its mind", again.status());
    absl::StatusOr<Admission> second =
        engine.Admit(pool, caller, std::move(again->call), std::move(again->regions));
    if (second.ok() != twice) Fail("second admission", second.status());
    if (second.ok()) {
      admitted.push_back(*std::move(second));
    } else if (!absl::IsFailedPrecondition(second.status())) {
      Fail("append lock error code", second.status());
    } else {
      Note("copy not admitted:", second.status());
    }
  }

  const int n = static_cast<int>(admitted.size());
  if (work * n > kWorkBudget) {
    Note("over the work budget");
    admitted.clear();  // released unrun
    world.CheckUntouched();
    return;
  }
  struct Outcome {
    absl::Notification done;
    absl::Status status;
    CallReport report;
  };
  std::vector<Outcome> outcomes(n);
  for (int i = 0; i < n; ++i) {
    Outcome& o = outcomes[i];
    engine.Submit(std::move(admitted[i]), absl::InfiniteFuture(), nullptr,
                  [&o](const absl::Status& st, const CallReport& report) {
                    o.status = st;
                    o.report = report;
                    o.done.Notify();
                  });
  }
  const RowShapes& rows = g.rows();
  for (Outcome& o : outcomes) {
    o.done.WaitForNotification();
    if (!o.status.ok()) Fail("Run", o.status);
    if (o.report.batch_requests != n) Fail("the calls did not share one launch");
    // Outputs not written into the region come back for the response.
    const size_t out_bytes = req.has_output_to() ? 0 : tokens * rows.out.elements() * sizeof(bf16);
    const size_t lse_bytes =
        return_lse && !req.has_lse_to() ? tokens * rows.lse * sizeof(float) : 0;
    if (o.report.out.size != out_bytes) Fail("output size");
    if (o.report.lse.size != lse_bytes) Fail("lse size");
  }
  Note(n == 2 ? "ran twice in one launch" : "ran");
  world.CheckUntouched();
}

}  // namespace
}  // namespace attn

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace attn;
  GetFixture();  // first: it also silences protobuf's parse-error logging
  if (size < 1) return 0;
  const uint8_t selector = data[0];
  const int pool = (selector & 3) % kNumPools;
  const bool decode = selector & 4;
  const bool merge = selector & 8;
  const bool plan = !merge && (selector & 16);
  // Two pieces, as a message may arrive in slices: the reader must not care where they split.
  const absl::string_view bytes(reinterpret_cast<const char*>(data + 1), size - 1);
  const size_t cut = bytes.size() / 3;
  const absl::string_view pieces[] = {bytes.substr(0, cut), bytes.substr(cut)};
  InlineTensors tensors;
  if (decode) {
    v1::DecodeRequest req;
    if (!ReadAttentionRequest(pieces, &req, &tensors).ok()) {
      Note("not a DecodeRequest");
      return 0;
    }
    RunOne(req, tensors, pool, merge, plan);
    if (req.has_output_to() || req.has_lse_to()) GetFixture().Restore();
  } else {
    v1::PrefillRequest req;
    if (!ReadAttentionRequest(pieces, &req, &tensors).ok()) {
      Note("not a PrefillRequest");
      return 0;
    }
    RunOne(req, tensors, pool, merge, plan);
    if (req.has_output_to() || req.has_lse_to()) GetFixture().Restore();
  }
  return 0;
}
