// A testing hook in the executor: a Backend decorator that makes one launch fail the way a device
// can, so the server's handling of device failures is exercised without a failing device.
//
//   --inject_fault=sticky:N   the N-th launch (counted over every lane) fails as a sticky CUDA
//                             error would: INTERNAL for it and every later launch, and the
//                             fatal-error handler runs (health NOT_SERVING, exit 1).
//   --inject_fault=alloc:N    the N-th launch fails as a device allocation would:
//                             RESOURCE_EXHAUSTED for that call only; the server keeps serving.
//   --inject_fault=delay:MS   every launch takes MS milliseconds longer, as a long kernel would
//                             (nothing interrupts it): tests that need a call to be running, or
//                             queued behind a running one, make it so instead of racing a
//                             fraction of a measured duration.
#pragma once

#include <functional>
#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "server/engine/backend.h"

namespace attn {

struct FaultPlan {
  enum class Kind { kSticky, kAllocation, kDelay };
  Kind kind = Kind::kSticky;
  int64_t at_launch = 1;  // 1-based (kSticky, kAllocation)
  int64_t delay_ms = 0;   // kDelay
};

// Parses "sticky:N", "alloc:N" (N >= 1) or "delay:MS" (MS >= 1).
absl::StatusOr<FaultPlan> ParseFaultPlan(const std::string& text);

// Wraps `backend` so its lanes fail as `plan` says; `on_fatal_error` runs once for a sticky fault.
std::unique_ptr<Backend> InjectFaults(std::unique_ptr<Backend> backend, FaultPlan plan,
                                      std::function<void(const absl::Status&)> on_fatal_error);

}  // namespace attn
