#include "server/rpc/allocator_trim.h"

#include <malloc.h>

#include "absl/time/clock.h"

namespace attn {

AllocatorTrimmer::AllocatorTrimmer() : thread_([this] { Loop(); }) {}

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
}

void AllocatorTrimmer::Loop() {
  absl::MutexLock lock(&mu_);
  for (;;) {
    mu_.Await(absl::Condition(
        +[](AllocatorTrimmer* t) ABSL_NO_THREAD_SAFETY_ANALYSIS { return t->pending_ || t->stop_; },
        this));
    if (stop_) return;
    // Let the call's last buffers go first (gRPC frees what it sent after the call ended).
    mu_.AwaitWithTimeout(absl::Condition(&stop_), absl::Milliseconds(200));
    if (stop_) return;
    pending_ = false;
    mu_.Unlock();
    malloc_trim(0);
    mu_.Lock();
  }
}

}  // namespace attn
