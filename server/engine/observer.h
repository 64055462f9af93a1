// How the engine reports what happens to its pools' pages (the metrics implement this). Every
// change of a pool's page counts reaches OnPageChange, whatever caused it, so a gauge fed from
// here cannot fall behind the pool.
#pragma once

#include <string>

namespace attn {

enum class PageEvent {
  kAllocated,  // AllocatePages
  kFreed,      // FreePages
  kClosed,     // CloseSession released the session's pages
  kReclaimed,  // a lease expired and the session's pages were released
  kUnpinned,   // released pages whose last unfinished call ended were freed
};

struct PageChange {
  const std::string& pool;
  PageEvent event;
  // Pages the event moved: allocated, freed, released with their session (pinned ones included:
  // they are freed later, with a kUnpinned change) or freed by their last unpin.
  int pages;
  // The pool right after the change.
  int free_pages;
  int total_pages;
};

// Implementations must be thread safe and must not call back into the engine: OnPageChange runs
// under the pool's lock, so that the changes of one pool arrive in the order they happened.
class PageObserver {
 public:
  virtual ~PageObserver() = default;
  // A pool was created with every page free (before any change of it is reported).
  virtual void OnPoolAdded(const std::string& pool, int total_pages) = 0;
  virtual void OnPageChange(const PageChange& change) = 0;
  // AllocatePages was refused for want of free pages or of quota.
  virtual void OnAllocationFailure(const std::string& pool) = 0;
};

}  // namespace attn
