#include "server/rpc/call_log.h"

#include <algorithm>
#include <iostream>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "server/engine/client_text.h"

namespace attn {

bool LogLimiter::Allow(int64_t* suppressed) {
  absl::MutexLock lock(&mu_);
  const absl::Time now = absl::Now();
  if (tokens_ < 0) {
    tokens_ = burst_;
  } else {
    tokens_ = std::min(burst_, tokens_ + absl::ToDoubleSeconds(now - last_) * per_second_);
  }
  last_ = now;
  if (tokens_ < 1) {
    ++suppressed_;
    return false;
  }
  tokens_ -= 1;
  *suppressed = suppressed_;
  suppressed_ = 0;
  return true;
}

void LogFailedCall(absl::string_view method, const absl::Status& status,
                   absl::string_view request_id, absl::string_view peer) {
  static LogLimiter* const limiter = new LogLimiter(/*per_second=*/10, /*burst=*/20);
  int64_t suppressed = 0;
  if (!limiter->Allow(&suppressed)) return;
  std::string line = absl::StrCat(
      "attnserve: ", method, " ", absl::StatusCodeToString(status.code()),
      " request_id=", request_id.empty() ? "-" : ShownClientString(request_id),
      " peer=", ShownClientString(peer), ": ", ShownClientString(status.message(), 300));
  if (suppressed > 0) absl::StrAppend(&line, " (", suppressed, " earlier lines suppressed)");
  line += "\n";
  std::cerr << line << std::flush;
}

}  // namespace attn
