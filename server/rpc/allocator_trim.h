// Gives back to the system the memory large calls leave in the allocator's free lists.
//
// A large call's request and response are freed when it ends, and gRPC frees the buffers it
// sent from a little later; all of that is heap memory of gRPC's threads' arenas, which glibc
// keeps (a 98 MiB call left the process 100-200 MiB larger, growing with each one). Trimming
// right when the call ends is too early for the send buffers, so a thread trims a moment after.
// Thread safe.
#pragma once

#include <thread>

#include "absl/base/thread_annotations.h"
#include "absl/synchronization/mutex.h"

namespace attn {

class AllocatorTrimmer {
 public:
  AllocatorTrimmer();
  ~AllocatorTrimmer();  // stops the thread
  AllocatorTrimmer(const AllocatorTrimmer&) = delete;
  AllocatorTrimmer& operator=(const AllocatorTrimmer&) = delete;

  // A large call ended: trim about 200 ms from now (several such calls share one trim).
  void LargeCallEnded();

 private:
  void Loop();

  absl::Mutex mu_;
  bool pending_ ABSL_GUARDED_BY(mu_) = false;
  bool stop_ ABSL_GUARDED_BY(mu_) = false;
  std::thread thread_;
};

}  // namespace attn
