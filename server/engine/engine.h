// The server's core without gRPC: the backend, the pools (geometry, page ids, storage), one
// batcher per (pool, op), and the sessions that own pages, whose expired leases a background
// thread reclaims.
#pragma once

#include <memory>
#include <string>
#include "absl/strings/string_view.h"
#include <functional>
#include <thread>
#include <vector>

#include "absl/synchronization/notification.h"

#include "absl/status/statusor.h"
#include "server/engine/backend.h"
#include "server/engine/batcher.h"
#include "server/engine/page_pool.h"
#include "server/engine/pool_geometry.h"
#include "server/engine/sessions.h"

namespace attn {

class Engine {
 public:
  struct Pool {
    Pool(PoolGeometry g) : geometry(std::move(g)), pages(geometry.num_pages) {}
    const PoolGeometry geometry;
    PagePool pages;
    AppendLocks appends;  // pages unfinished calls append to
    std::unique_ptr<Batcher> prefill;
    std::unique_ptr<Batcher> decode;
    Batcher& batcher(Op op) { return op == Op::kPrefill ? *prefill : *decode; }
  };

  // Called with (pool, pages) when a closed or expired session's pages are released.
  using ReclaimObserver = std::function<void(const std::string& pool, int pages)>;

  // Allocates every pool's storage on `backend`, starts the batchers and the lease reaper.
  // `observer` may be null and must outlive the engine.
  static absl::StatusOr<std::unique_ptr<Engine>> Create(std::unique_ptr<Backend> backend,
                                                        std::vector<PoolGeometry> pools,
                                                        const BatchingOptions& batching,
                                                        const SessionOptions& sessions,
                                                        uint64_t epoch, BatchObserver* observer,
                                                        ReclaimObserver on_reclaim);
  ~Engine();  // stops the reaper and the batchers

  SessionTable& sessions() { return sessions_; }

  // Closes the session `handle` names and releases its pages; returns how many.
  absl::StatusOr<int> CloseSession(absl::string_view handle);
  // Releases the pages of every session whose lease ran out by `now` (the reaper calls this).
  void ExpireSessions(absl::Time now);

  // The pool called `name`; an empty name selects the only pool when there is exactly one.
  absl::StatusOr<Pool*> FindPool(absl::string_view name);

  const Backend& backend() const { return *backend_; }
  const std::vector<std::unique_ptr<Pool>>& pools() const { return pools_; }

 private:
  Engine(std::unique_ptr<Backend> backend, const SessionOptions& sessions, uint64_t epoch,
         ReclaimObserver on_reclaim);
  // Releases a session's pages in every pool; `expired` reports them as reclaimed.
  int ReleaseSession(SessionId id, bool expired);

  std::unique_ptr<Backend> backend_;
  std::vector<std::unique_ptr<Pool>> pools_;
  SessionTable sessions_;
  ReclaimObserver on_reclaim_;
  absl::Notification stop_reaper_;
  std::thread reaper_;
};

}  // namespace attn
