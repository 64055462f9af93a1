// One log line per refused or failed call, rate limited, carrying the caller's x-request-id so
// an operator can match a client's report to the server's reason.
#pragma once

#include <cstdint>
#include <string>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/strings/string_view.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"

namespace attn {

// A token bucket for log lines: `burst` lines at once, refilled at `per_second`. Lines it
// refuses are counted and reported by the next line it lets through. Thread safe.
class LogLimiter {
 public:
  LogLimiter(double per_second, double burst) : per_second_(per_second), burst_(burst) {}
  // True when a line may be written now; *suppressed is then the number refused since the
  // last one that was let through.
  bool Allow(int64_t* suppressed);

 private:
  const double per_second_, burst_;
  absl::Mutex mu_;
  double tokens_ ABSL_GUARDED_BY(mu_) = -1;  // -1: full (not started)
  absl::Time last_ ABSL_GUARDED_BY(mu_);
  int64_t suppressed_ ABSL_GUARDED_BY(mu_) = 0;
};

// The line for a call of `method` that ended with `status` (not OK), written to stderr:
//   attnserve: Decode NOT_FOUND request_id=abc peer=ipv4:... : session '...' is closed ...
// `request_id` and `peer` come from the client and are shown escaped and shortened. At most
// 10 lines a second (bursts of 20); the rest are counted in the next line.
void LogFailedCall(absl::string_view method, const absl::Status& status,
                   absl::string_view request_id, absl::string_view peer);

}  // namespace attn
