// Page id allocator of one KV pool. The pages' storage belongs to the backend; this class only
// tracks which ids are handed out.
//
// Invariant: free_pages() + used_pages() == total_pages() at all times. Allocate and Free are
// all-or-nothing: a failing call changes nothing. Thread safe.
#pragma once

#include <cstdint>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/types/span.h"

namespace attn {

class PagePool {
 public:
  explicit PagePool(int num_pages);

  PagePool(const PagePool&) = delete;
  PagePool& operator=(const PagePool&) = delete;

  // num_pages distinct free ids, now allocated. INVALID_ARGUMENT for num_pages < 1 or above the
  // pool's size, RESOURCE_EXHAUSTED when fewer pages are free.
  absl::StatusOr<std::vector<int32_t>> Allocate(int num_pages);

  // Frees every id, or none: INVALID_ARGUMENT for an id out of range or listed twice,
  // FAILED_PRECONDITION for an id that is not allocated.
  absl::Status Free(absl::Span<const int32_t> ids);

  // OK when every id is in range and allocated; otherwise the error Free would give, naming
  // `field` and the position of the first bad id.
  absl::Status CheckAllocated(absl::Span<const int32_t> ids, const char* field) const;

  int total_pages() const { return num_pages_; }
  int free_pages() const;
  int used_pages() const { return total_pages() - free_pages(); }

 private:
  absl::Status CheckAllocatedLocked(absl::Span<const int32_t> ids, const char* field) const
      ABSL_SHARED_LOCKS_REQUIRED(mu_);

  const int num_pages_;
  mutable absl::Mutex mu_;
  // Free ids, popped from the back; initially in descending order so the first pages handed out
  // are 0, 1, 2, ...
  std::vector<int32_t> free_list_ ABSL_GUARDED_BY(mu_);
  std::vector<uint8_t> allocated_ ABSL_GUARDED_BY(mu_);  // [num_pages_], 1 = allocated
};

}  // namespace attn
