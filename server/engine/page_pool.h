// Page id allocator of one KV pool, with ownership and pins. The pages' storage belongs to the
// backend; this class only tracks which ids are handed out, to which session, and which ones an
// unfinished call is using.
//
// Invariant: free_pages() + used_pages() == total_pages() at all times. Every operation is
// all-or-nothing: a failing call changes nothing. A pinned page (in the page table of a call that
// has not finished) is never freed: Free refuses it, and pages released with their session are
// freed when their last pin goes. Every change of the counts is reported to the PageObserver,
// under the pool's lock (so in order). Thread safe.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_set.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/types/span.h"
#include "server/engine/attention_call.h"
#include "server/engine/observer.h"
#include "server/engine/sessions.h"

namespace attn {

class PagePool {
 public:
  // `name` is the pool's name in the observer's reports; `observer` may be null and must outlive
  // the pool.
  explicit PagePool(int num_pages, std::string name = "", PageObserver* observer = nullptr);

  PagePool(const PagePool&) = delete;
  PagePool& operator=(const PagePool&) = delete;

  // num_pages distinct free ids, now owned by `owner`. INVALID_ARGUMENT for num_pages < 1 or
  // above the pool's size, RESOURCE_EXHAUSTED when fewer pages are free.
  // With `to_scrub`, the ids among them that were allocated before (an earlier owner may have
  // written them) are added to it and pinned: the caller zeroes their storage, then Unpins them
  // (so a close meanwhile cannot free them while the scrub runs). Pages never allocated are
  // zero already (the backend zeroes storage at start).
  absl::StatusOr<std::vector<int32_t>> Allocate(int num_pages, SessionId owner,
                                                std::vector<int32_t>* to_scrub = nullptr);

  // Frees pages of `owner`: INVALID_ARGUMENT for an id out of range or listed twice,
  // FAILED_PRECONDITION for an id that is not allocated, is another session's, or is in use by
  // an unfinished call.
  absl::Status Free(absl::Span<const int32_t> ids, SessionId owner);

  // Pins the pages a call reads and writes: every id must be in range (INVALID_ARGUMENT) and
  // allocated to `owner` (FAILED_PRECONDITION); the message names `field` and the position.
  absl::Status Pin(absl::Span<const int32_t> ids, SessionId owner, const char* field);
  // Undoes Pin(ids) once the call finished; frees released pages whose last pin this was.
  void Unpin(absl::Span<const int32_t> ids);

  // Releases every page of `owner` (a closed or expired session, reported as `why`): unpinned
  // pages are free at once, pinned ones when their calls finish. Returns how many pages it
  // released.
  int ReleaseOwner(SessionId owner, PageEvent why = PageEvent::kClosed);
  // The same for several owners at once, in one pass over the pool.
  int ReleaseOwners(absl::Span<const SessionId> owners, PageEvent why);

  int total_pages() const { return num_pages_; }
  int free_pages() const;
  int used_pages() const { return total_pages() - free_pages(); }

  // For tests and diagnostics: pages `owner` holds, and pages some unfinished call has pinned.
  int pages_of(SessionId owner) const;
  int pinned_pages() const;

 private:
  // owner_ value of a page released while pinned: freed by its last Unpin.
  static constexpr SessionId kReleased = -1;

  absl::Status CheckOwnedLocked(absl::Span<const int32_t> ids, SessionId owner,
                                const char* field) const ABSL_SHARED_LOCKS_REQUIRED(mu_);
  void FreeLocked(int32_t id) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void ReportLocked(PageEvent event, int pages) const ABSL_SHARED_LOCKS_REQUIRED(mu_);

  const int num_pages_;
  const std::string name_;
  PageObserver* const observer_;
  mutable absl::Mutex mu_;
  // Free ids, popped from the back; initially in descending order so the first pages handed out
  // are 0, 1, 2, ...
  std::vector<int32_t> free_list_ ABSL_GUARDED_BY(mu_);
  std::vector<SessionId> owner_ ABSL_GUARDED_BY(mu_);  // [num_pages_]: 0 = free
  std::vector<int32_t> pins_ ABSL_GUARDED_BY(mu_);     // [num_pages_]
  std::vector<bool> used_before_ ABSL_GUARDED_BY(mu_);  // [num_pages_]: allocated at least once
};

// The pages unfinished calls append to, per layer (AppendKey). Two calls appending to the same
// page of the same layer at once would race on the device, one overwriting the other's rows; the
// later one is refused instead. Thread safe.
class AppendLocks {
 public:
  // Takes every key or none: FAILED_PRECONDITION naming the first page another call holds.
  absl::Status Acquire(absl::Span<const int64_t> keys);
  // Gives back keys taken by a successful Acquire.
  void Release(absl::Span<const int64_t> keys);

 private:
  absl::Mutex mu_;
  absl::flat_hash_set<int64_t> held_ ABSL_GUARDED_BY(mu_);
};

}  // namespace attn
