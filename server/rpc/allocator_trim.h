// Gives back to the system the memory large calls leave in the allocator's free lists.
//
// A large call's request and response are freed when it ends, and gRPC frees the buffers it
// sent from a little later; all of that is heap memory of gRPC's threads' arenas, which glibc
// keeps (a 98 MiB call left the process 100-200 MiB larger, growing with each one). The trim
// waits until large calls have stopped for a moment (`quiet`): while they keep coming, the next
// one would fault in again what a trim gave back (a few microseconds a page), and the last
// call's send buffers go first. Thread safe.
#pragma once

#include <functional>
#include <thread>

#include "absl/base/thread_annotations.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"

namespace attn {

class AllocatorTrimmer {
 public:
  // `trim` gives the memory back (by default glibc's malloc_trim, or jemalloc's purge of every
  // arena when the process runs on jemalloc); it runs on the trimmer's thread once no large call
  // has ended for `quiet`.
  explicit AllocatorTrimmer(absl::Duration quiet = absl::Milliseconds(200),
                            std::function<void()> trim = nullptr);
  ~AllocatorTrimmer();  // stops the thread; a trim still waiting does not run
  AllocatorTrimmer(const AllocatorTrimmer&) = delete;
  AllocatorTrimmer& operator=(const AllocatorTrimmer&) = delete;

  // A large call ended: trim `quiet` after the last of the large calls that keep coming.
  void LargeCallEnded();

 private:
  void Loop();

  const absl::Duration quiet_;
  const std::function<void()> trim_;
  absl::Mutex mu_;
  bool pending_ ABSL_GUARDED_BY(mu_) = false;
  absl::Time last_ ABSL_GUARDED_BY(mu_);  // when the last large call ended
  bool stop_ ABSL_GUARDED_BY(mu_) = false;
  std::thread thread_;
};

}  // namespace attn
