#include "server/rpc/allocator_trim.h"

#include <dlfcn.h>
#include <malloc.h>

#include <utility>

#include "absl/time/clock.h"

namespace attn {
namespace {

// The allocator the process runs on gives its free memory back: jemalloc (when preloaded, its
// mallctl is found) purges the unused pages of every arena; glibc trims its heaps.
void ReleaseFreeMemory() {
  using Mallctl = int (*)(const char*, void*, size_t*, void*, size_t);
  static const auto mallctl = reinterpret_cast<Mallctl>(dlsym(RTLD_DEFAULT, "mallctl"));
  constexpr char kPurgeAllArenas[] = "arena.4096.purge";  // MALLCTL_ARENAS_ALL
  if (mallctl == nullptr || mallctl(kPurgeAllArenas, nullptr, nullptr, nullptr, 0) != 0) {
    malloc_trim(0);
  }
}

}  // namespace

AllocatorTrimmer::AllocatorTrimmer(absl::Duration quiet, std::function<void()> trim)
    : quiet_(quiet),
      trim_(trim ? std::move(trim) : ReleaseFreeMemory),
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
