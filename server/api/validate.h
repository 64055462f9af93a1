// Validation of Prefill and Decode requests against a pool, before anything is queued or written.
//
// Every failure is INVALID_ARGUMENT naming the field, the bad value and the limit (a NaN or Inf
// in a tensor in host memory included), except for
// region references (NOT_FOUND: a region the caller has not registered; FAILED_PRECONDITION: its
// memory went away). Validation looks at the request, the pool's geometry and the regions the
// request names; whether the caller owns the pages it names is checked when the call pins them
// (PagePool::Pin).
#pragma once

#include <functional>

#include "absl/status/statusor.h"
#include "absl/types/span.h"
#include "attnserve/v1/attention.pb.h"
#include "server/api/inline_tensors.h"
#include "server/engine/attention_call.h"
#include "server/engine/plans.h"
#include "server/engine/pool_geometry.h"
#include "server/engine/regions.h"

namespace attn {

namespace v1 = ::attnserve::v1;

// Largest number of query tokens (Prefill) or sequences (Decode) one call may carry.
inline constexpr int kMaxCallTokens = 1 << 20;
// Largest page table (kv_indices entries) a PageTableRef may name.
inline constexpr int kMaxTablePages = 1 << 24;

// The caller's regions (Engine::ResolveRegions for its session), for requests that name some.
using RegionResolver = std::function<absl::StatusOr<RegionUse>(absl::Span<const SliceRef>)>;

struct ValidatedCall {
  AttentionCall call;
  RegionUse regions;  // the regions the call reads and writes, in use until the call is over
};

// Who refuses NaN and Inf in q, q_pe and the new K/V: validation, scanning the inputs in host
// memory (kHost; inputs in device memory are not checked), or the backend (kBackend, for one
// that Backend::ChecksFiniteInputs: on the GPU, for every input, at memory speed).
enum class FiniteCheck { kHost, kBackend };

// `data` holds the bytes of the request's inline tensors (InlineTensorsOf(req) when the message
// holds them itself). On success the call's views point into `req`, `data`'s pieces and the
// regions; outputs not named in a region are left for the backend. `regions` may be null for
// callers that allow no regions. A request naming a plan (`plan`) is validated on `plan`'s
// table (Engine::FindPlan; its views then point into it) and refused when `plan` is null.
absl::StatusOr<ValidatedCall> ValidatePrefill(const v1::PrefillRequest& req,
                                              const InlineTensors& data, const PoolGeometry& pool,
                                              const RegionResolver& regions,
                                              FiniteCheck finite = FiniteCheck::kHost,
                                              const PlanTable* plan = nullptr);
absl::StatusOr<ValidatedCall> ValidateDecode(const v1::DecodeRequest& req,
                                             const InlineTensors& data, const PoolGeometry& pool,
                                             const RegionResolver& regions,
                                             FiniteCheck finite = FiniteCheck::kHost,
                                             const PlanTable* plan = nullptr);

// A CreatePlan request's page table, checked as a call's is (the same errors), copied out of
// the request or its region. Whether its pages are the caller's is checked when
// Engine::CreatePlan pins them.
absl::StatusOr<PlanTable> ValidatePlanTable(const v1::CreatePlanRequest& req,
                                            const PoolGeometry& pool,
                                            const RegionResolver& regions);

// The same for a request whose tensors are all in the message, naming no region.
absl::StatusOr<AttentionCall> ValidatePrefill(const v1::PrefillRequest& req,
                                              const PoolGeometry& pool);
absl::StatusOr<AttentionCall> ValidateDecode(const v1::DecodeRequest& req,
                                             const PoolGeometry& pool);

}  // namespace attn
