// libFuzzer target: one Prefill or Decode request from the wire to the CPU kernels, the path every
// untrusted request takes in the server (minus gRPC).
//
// Input: byte 0 selects what the rest is; bytes 1.. are protobuf wire bytes, so truncated,
// duplicated, unknown and hostile fields are all explored.
//   bits 0-1: the pool (0 and 3: kPools[0], 1: kPools[1], 2: kPools[2])
//   bit 2:    0 = attnserve.v1.PrefillRequest, 1 = DecodeRequest
//   bit 3:    run the call twice in one launch (merged batch of two calls)
// Steps: parse; resolve the request's `session` handle (if any) in a SessionTable; validate against
// the pool (server/api/validate.h); pin kv_indices in a PagePool where pages 0 .. num_pages - 4 are
// owned by the caller's session, the next two by another session and the last one is free; reject
// calls whose attention work exceeds kWorkBudget (one input must not take seconds); run the call on
// a fresh CPU backend (server/backends/cpu_backend.h, caller thread only); unpin.
//
// Besides sanitizer reports, the target aborts when an API contract is broken: a validation error
// that is not INVALID_ARGUMENT, a pin error other than INVALID_ARGUMENT / FAILED_PRECONDITION, a
// launch failure, outputs of the wrong size, or pages left pinned / freed afterwards.
//
// fuzz/make_corpus.py writes the seed corpus (fuzz/corpus/) in this format. ATTN_FUZZ_VERBOSE=1
// prints what happened to each input (the error, or the launch), to check what seeds reach.
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/time/time.h"
#include "attnserve/v1/attention.pb.h"
#include "google/protobuf/stubs/logging.h"
#include "server/engine/backend.h"
#include "server/backends/cpu_backend.h"
#include "server/engine/page_pool.h"
#include "server/engine/pool_geometry.h"
#include "server/engine/sessions.h"
#include "server/api/pool_config.h"
#include "server/api/validate.h"

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

bool Verbose() {
  static const bool verbose = [] {
    const char* env = std::getenv("ATTN_FUZZ_VERBOSE");
    return env != nullptr && env[0] == '1';
  }();
  return verbose;
}

void Note(const char* what, const absl::Status& status = absl::OkStatus()) {
  if (!Verbose()) return;
  std::fprintf(stderr, "request_fuzzer: %s%s%s\n", what, status.ok() ? "" : " ",
               status.ok() ? "" : status.ToString().c_str());
}

[[noreturn]] void Fail(const char* what, const absl::Status& status = absl::OkStatus()) {
  std::fprintf(stderr, "request_fuzzer: %s %s\n", what, status.ToString().c_str());
  std::abort();
}

struct Pool {
  PoolGeometry geometry;
  std::unique_ptr<PagePool> pages;
  int free_after_setup = 0;
};

struct Fixture {
  Fixture() : sessions(kEpoch, SessionOptions{}) {
    // Protobuf logs an ERROR line for every string field with invalid UTF-8 (the parse fails
    // either way); at tens of thousands of inputs a second that is all the fuzzer would do.
    google::protobuf::SetLogHandler(nullptr);
    const absl::Time now = absl::Now();
    owner = sessions.Open(absl::ZeroDuration(), 0, now).id;
    other = sessions.Open(absl::ZeroDuration(), 0, now).id;
    for (int i = 0; i < kNumPools; ++i) {
      absl::StatusOr<PoolGeometry> g = GeometryFromConfig(PoolConfig(i));
      if (!g.ok()) Fail("bad fixture pool", g.status());
      Pool& p = pools[i];
      p.geometry = *g;
      p.pages = std::make_unique<PagePool>(g->num_pages);
      // Allocation hands out 0, 1, 2, ... first: the owner gets 0 .. n - 4.
      if (!p.pages->Allocate(g->num_pages - 3, owner).ok() || !p.pages->Allocate(2, other).ok()) {
        Fail("fixture allocation failed");
      }
      p.free_after_setup = p.pages->free_pages();
    }
  }
  SessionTable sessions;
  SessionId owner = 0, other = 0;
  Pool pools[kNumPools];
};

Fixture& GetFixture() {
  static Fixture* fixture = new Fixture();  // never destroyed: no exit-time ordering issues
  return *fixture;
}

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

absl::StatusOr<AttentionCall> Validate(const v1::PrefillRequest& req, const PoolGeometry& g) {
  return ValidatePrefill(req, g);
}
absl::StatusOr<AttentionCall> Validate(const v1::DecodeRequest& req, const PoolGeometry& g) {
  return ValidateDecode(req, g);
}

template <typename Request>
void RunOne(const Request& req, Op op, int pool_index, bool merge) {
  Fixture& f = GetFixture();
  Pool& pool = f.pools[pool_index];

  // The session named by the request (hostile handles included). Calls always run as the owner:
  // which session owns the pages is the pool's business, tested below.
  if (!req.session().empty()) {
    absl::StatusOr<SessionId> id = f.sessions.Resolve(req.session(), "fuzz-peer", absl::Now());
    if (!id.ok() && !absl::IsInvalidArgument(id.status()) &&
        !absl::IsFailedPrecondition(id.status()) && !absl::IsNotFound(id.status())) {
      Fail("unexpected session error", id.status());
    }
    if (!id.ok()) Note("session:", id.status());
  }

  absl::StatusOr<AttentionCall> call = Validate(req, pool.geometry);
  if (!call.ok()) {
    if (!absl::IsInvalidArgument(call.status())) Fail("validation error code", call.status());
    Note("invalid:", call.status());
    return;
  }
  if (absl::Status pin = pool.pages->Pin(call->kv_indices, f.owner, "kv_indices"); !pin.ok()) {
    if (!absl::IsInvalidArgument(pin) && !absl::IsFailedPrecondition(pin)) {
      Fail("pin error code", pin);
    }
    Note("not pinned:", pin);
    return;
  }

  if (Work(*call, pool.geometry) * (merge ? 2 : 1) > kWorkBudget) {
    Note("over the work budget");
  } else {
    // A fresh backend per input keeps runs reproducible (the cache starts zeroed).
    std::unique_ptr<Backend> backend = CreateCpuBackend(1);
    for (int i = 0; i < kNumPools; ++i) {
      if (absl::Status st = backend->AddPool(f.pools[i].geometry); !st.ok()) Fail("AddPool", st);
    }
    absl::StatusOr<std::unique_ptr<Lane>> lane = backend->CreateLane(pool_index, op);
    if (!lane.ok()) Fail("CreateLane", lane.status());

    const int n = merge ? 2 : 1;
    std::vector<AttentionCall> calls(n, *call);
    std::vector<std::string> out(n), lse(n);
    std::vector<AttentionCall*> ptrs;
    for (int i = 0; i < n; ++i) {
      calls[i].out = &out[i];
      calls[i].lse = &lse[i];
      ptrs.push_back(&calls[i]);
    }
    absl::StatusOr<LaunchStats> stats = (*lane)->Run(ptrs);
    if (!stats.ok()) Fail("Run", stats.status());

    const RowShapes& rows = pool.geometry.rows();
    const size_t tokens = call->total_q;
    for (int i = 0; i < n; ++i) {
      if (out[i].size() != tokens * rows.out.elements() * sizeof(bf16)) Fail("output size");
      if (lse[i].size() != (call->return_lse ? tokens * rows.lse * sizeof(float) : 0)) {
        Fail("lse size");
      }
    }
    Note(merge ? "ran twice in one launch" : "ran");
  }

  pool.pages->Unpin(call->kv_indices);
  if (pool.pages->free_pages() != pool.free_after_setup) Fail("pages changed hands");
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
  if (decode) {
    v1::DecodeRequest req;
    if (!req.ParseFromArray(data + 1, static_cast<int>(size - 1))) {
      Note("not a DecodeRequest");
      return 0;
    }
    RunOne(req, Op::kDecode, pool, merge);
  } else {
    v1::PrefillRequest req;
    if (!req.ParseFromArray(data + 1, static_cast<int>(size - 1))) {
      Note("not a PrefillRequest");
      return 0;
    }
    RunOne(req, Op::kPrefill, pool, merge);
  }
  return 0;
}
