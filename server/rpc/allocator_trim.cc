#include "server/rpc/allocator_trim.h"

#include <malloc.h>

#include <utility>

#include "absl/time/clock.h"

namespace attn {

AllocatorTrimmer::AllocatorTrimmer(absl::Duration quiet, std::function<void()> trim)
    : quiet_(quiet),
      trim_(trim ? std::move(trim) : [] { malloc_trim(0); }),
      thread_([this] { Loop(); }) {}

AllocatorTrimmer::~AllocatorTrimmer() {
  {
    absl::MutexLock lock(&mu_);
    stop_ = true;
  }
  thread_.join();
}

void AllocatorTrimmer::LargeCallEnded() {
  absl::MutexLock lock(&mu_);
  pending_ = true;
  last_ = absl::Now();
}

void AllocatorTrimmer::Loop() {
  absl::MutexLock lock(&mu_);
  for (;;) {
    mu_.Await(absl::Condition(
        +[](AllocatorTrimmer* t) ABSL_NO_THREAD_SAFETY_ANALYSIS { return t->pending_ || t->stop_; },
        this));
    // Each large call that ends meanwhile moves the deadline.
    while (!stop_ && absl::Now() < last_ + quiet_) {
      mu_.AwaitWithDeadline(absl::Condition(&stop_), last_ + quiet_);
    }
    if (stop_) return;
    pending_ = false;
    mu_.Unlock();
    trim_();
    mu_.Lock();
  }
}

}  // namespace attn
