// Validation of Prefill and Decode requests against a pool, before anything is queued or written.
//
// Every failure is INVALID_ARGUMENT naming the field, the bad value and the limit, except page ids
// that are in range but not allocated (FAILED_PRECONDITION). Validation reads the pool's
// allocation state and changes nothing.
#pragma once

#include "absl/status/statusor.h"
#include "attnserve/v1/attention.pb.h"
#include "server/attention_call.h"
#include "server/page_pool.h"
#include "server/pool_geometry.h"

namespace attn {

namespace v1 = ::attnserve::v1;

// Largest number of query tokens (Prefill) or sequences (Decode) one call may carry.
inline constexpr int kMaxCallTokens = 1 << 20;

// On success the call's views point into `req`, which must outlive it; out/lse are left null.
absl::StatusOr<AttentionCall> ValidatePrefill(const v1::PrefillRequest& req,
                                              const PoolGeometry& pool, const PagePool& pages);
absl::StatusOr<AttentionCall> ValidateDecode(const v1::DecodeRequest& req,
                                             const PoolGeometry& pool, const PagePool& pages);

}  // namespace attn
