// Validation of Prefill and Decode requests against a pool, before anything is queued or written.
//
// Every failure is INVALID_ARGUMENT naming the field, the bad value and the limit. Validation
// looks at the request and the pool's geometry only; whether the caller owns the pages it names
// is checked when the call pins them (PagePool::Pin).
#pragma once

#include "absl/status/statusor.h"
#include "attnserve/v1/attention.pb.h"
#include "server/engine/attention_call.h"
#include "server/engine/pool_geometry.h"

namespace attn {

namespace v1 = ::attnserve::v1;

// Largest number of query tokens (Prefill) or sequences (Decode) one call may carry.
inline constexpr int kMaxCallTokens = 1 << 20;

// On success the call's views point into `req`, which must outlive it; out/lse are left null.
absl::StatusOr<AttentionCall> ValidatePrefill(const v1::PrefillRequest& req,
                                              const PoolGeometry& pool);
absl::StatusOr<AttentionCall> ValidateDecode(const v1::DecodeRequest& req,
                                             const PoolGeometry& pool);

}  // namespace attn
