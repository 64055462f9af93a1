// The server's core without gRPC: the backend, the pools (geometry, page ids, storage), one
// batcher per (pool, op), the sessions that own pages, and admission: every rule that decides
// whether a call may touch a pool (leases, quotas, page ownership, pins, append locks, the drain).
// A background thread reclaims the pages of expired leases. The RPC edge only converts messages
// into these calls and statuses back.
//
// Lock order: Engine::mu_ (sessions and page ownership, changed together) -> SessionTable ->
// PagePool -> the PageObserver. drain_mu_ is never held together with another of them. Thread
// safe.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/synchronization/mutex.h"
#include "absl/synchronization/notification.h"
#include "absl/time/time.h"
#include "absl/types/span.h"
#include "server/engine/attention_call.h"
#include "server/engine/backend.h"
#include "server/engine/batcher.h"
#include "server/engine/observer.h"
#include "server/engine/page_pool.h"
#include "server/engine/plans.h"
#include "server/engine/pool_geometry.h"
#include "server/engine/regions.h"
#include "server/engine/sessions.h"

namespace attn {

// Who makes a call: the principal the RPC edge authenticated, and the session the call names.
struct Caller {
  std::string session;  // a handle from OpenSession (required by every call that uses pages)
  Principal principal;
};

class Admission;

class Engine {
 public:
  // One pool. Its pages change only through the Engine's methods; this view is read-only.
  class Pool {
   public:
    const PoolGeometry geometry;
    int free_pages() const { return pages_.free_pages(); }
    int total_pages() const { return pages_.total_pages(); }
    const PagePool& pages() const { return pages_; }

   private:
    friend class Admission;
    friend class Engine;
    Pool(int index, PoolGeometry g, PageObserver* observer)
        : geometry(std::move(g)),
          index_(index),
          pages_(geometry.num_pages, geometry.name, observer) {}
    Batcher& batcher(Op op) { return op == Op::kPrefill ? *prefill_ : *decode_; }

    const int index_;  // the backend's pool number
    PagePool pages_;
    AppendLocks appends_;  // pages unfinished calls append to
    std::unique_ptr<Batcher> prefill_;
    std::unique_ptr<Batcher> decode_;
  };

  // How a submitted call ends: called exactly once, after its pages were unpinned (a client that
  // frees them on the answer finds them free to free) and before the drain stops counting it.
  // `report.retry_after` is set when the queue was full.
  using Done = std::function<void(const absl::Status&, const CallReport&)>;

  // Allocates every pool's storage on `backend`, starts the batchers and the lease reaper. The
  // observers may be null and must outlive the engine.
  static absl::StatusOr<std::unique_ptr<Engine>> Create(
      std::unique_ptr<Backend> backend, std::vector<PoolGeometry> pools,
      const BatchingOptions& batching, const SessionOptions& sessions, uint64_t epoch,
      BatchObserver* batch_observer, PageObserver* page_observer,
      const DataPlaneOptions& data_plane = {});
  ~Engine();  // stops the reaper and the batchers (queued calls end UNAVAILABLE)

  // --- Sessions (the contract is attention.proto's "Sessions and leases"). Only a session's
  // owner (or an admin) may use it: PERMISSION_DENIED otherwise, and the lease is not renewed.
  // lease and max_pages of 0 take the defaults; both are capped at the server's limits.
  // RESOURCE_EXHAUSTED when the server holds its most sessions.
  absl::StatusOr<OpenedSession> OpenSession(absl::Duration lease, int max_pages,
                                            const Principal& owner);
  // Closes the session `handle` names and releases its pages; returns how many.
  absl::StatusOr<int> CloseSession(absl::string_view handle, const Principal& who);
  // Renews the caller's lease.
  absl::Status RenewLease(const Caller& caller);
  // Releases the pages of every session whose lease ran out by `now` (the reaper calls this).
  void ExpireSessions(absl::Time now);

  // --- Pages. The session's quota and the pool change together under mu_, so a session cannot
  // close or expire between the two (its new pages would belong to no one until a restart).
  // Pages an earlier session held are zeroed (Backend::ScrubPages) before their ids are
  // returned, outside mu_ and pinned meanwhile, so no one reads another owner's rows.
  // UNAVAILABLE while draining; INVALID_ARGUMENT for num_pages outside [1, pool size];
  // RESOURCE_EXHAUSTED past the quota or the free pages (nothing allocated).
  absl::StatusOr<std::vector<int32_t>> AllocatePages(absl::string_view pool, const Caller& caller,
                                                     int num_pages);
  // Frees pages of the caller's session (PagePool::Free's errors; works while draining).
  // Returns the pool's free pages afterwards.
  absl::StatusOr<int> FreePages(absl::string_view pool, const Caller& caller,
                                absl::Span<const int32_t> page_ids);

  // --- Registered memory (attention.proto, "Registered memory"), per session.
  const DataPlaneOptions& data_plane() const { return data_plane_; }
  // Maps `spec` for the caller's session under `name` (RegionTable::Reserve's errors,
  // UNIMPLEMENTED for a kind the server does not allow, the backend's mapping errors). `use` is
  // what else the registration asks of the region (a call queue's geometry): a retry must repeat
  // it as exactly as the memory.
  absl::StatusOr<RegionInfo> RegisterRegion(const Caller& caller, absl::string_view name,
                                            const RegionSpec& spec, RegistrationFields use = {});
  absl::Status UnregisterRegion(const Caller& caller, absl::string_view name);
  absl::StatusOr<std::vector<RegionInfo>> ListRegions(const Caller& caller);
  // The slices a call names in its session's regions, checked and counted as in use
  // (RegionTable::Resolve); pass the result to Admit.
  absl::StatusOr<RegionUse> ResolveRegions(const Caller& caller, absl::Span<const SliceRef> slices);
  // Keeps the caller's region `name` mapped for a call queue (RegionTable::Hold).
  absl::StatusOr<RegionHold> HoldRegion(const Caller& caller, absl::string_view name,
                                        std::function<void(RegionGone)> on_gone);

  // --- Plans (attention.proto, "Plans"; server/engine/plans.h), per session.
  // Pins `table` (checked by server/api/validate.h's ValidatePlanTable) for the caller's session
  // and keeps it as `name`, replacing the session's plan of that name: PagePool::Pin's errors,
  // PlanRegistry::Put's. All or nothing: a refused table leaves the old plan in place.
  absl::Status CreatePlan(Pool& pool, const Caller& caller, absl::string_view name,
                          PlanTable table);
  // Drops the caller's plan `name` (NOT_FOUND). Calls admitted with it keep it until they end.
  absl::Status ReleasePlan(const Caller& caller, absl::string_view name);
  // The caller's plan `name` for a call of `op` on `pool`: NOT_FOUND, or INVALID_ARGUMENT when
  // the plan is another pool's or method's. Pass it to Admit with the call validated on it.
  absl::StatusOr<std::shared_ptr<const Plan>> FindPlan(const Pool& pool, const Caller& caller,
                                                       absl::string_view name, Op op);

  // --- Prefill and Decode.
  // The pool called `name`; an empty name selects the only pool when there is exactly one.
  absl::StatusOr<Pool*> FindPool(absl::string_view name);
  // Admits a validated call of `pool`: checks its work against the budget (INVALID_ARGUMENT past
  // BatchingOptions::max_call_key_reads), renews the caller's lease, counts the call for the
  // drain (UNAVAILABLE while draining), pins its page table (every page must be the caller's)
  // and locks the pages it appends to (FAILED_PRECONDITION when another unfinished call appends
  // there). All or nothing: a refused call holds nothing. A call whose page table is `plan`'s
  // (FindPlan) is not pinned again: the admission holds the plan, whose pins cover it.
  absl::StatusOr<Admission> Admit(Pool& pool, const Caller& caller, AttentionCall call,
                                  RegionUse regions = {},
                                  std::shared_ptr<const Plan> plan = nullptr);
  // Queues an admitted call on its pool's batcher. `done` runs once, on the batcher thread, or
  // here when the queue refuses the call (RESOURCE_EXHAUSTED when full, in calls or in bytes,
  // with retry_after).
  // `is_cancelled` is polled before the launch; a call past `deadline` is dropped.
  void Submit(Admission admission, absl::Time deadline, std::function<bool()> is_cancelled,
              Done done);

  // --- Graceful drain: from StartDrain on, Admit and AllocatePages answer UNAVAILABLE (FreePages
  // and the rest keep working, so clients can give their pages back); admitted calls run to the
  // end. WaitForIdle waits until every admitted call has finished, or until `deadline`; true if
  // none is left.
  void StartDrain();
  bool draining() const;
  bool WaitForIdle(absl::Time deadline);
  // Ends every queued call with `why` (they never reach the backend); returns how many. Calls
  // already running on a backend cannot be stopped: they end when their launch does.
  int CancelQueued(const absl::Status& why);
  int active_calls() const;  // admitted calls not yet over

  uint64_t epoch() const { return sessions_.epoch(); }
  absl::Duration default_lease() const { return sessions_.default_lease(); }
  const SessionTable& sessions() const { return sessions_; }
  const Backend& backend() const { return *backend_; }
  const std::vector<std::unique_ptr<Pool>>& pools() const { return pools_; }

 private:
  friend class Admission;

  Engine(std::unique_ptr<Backend> backend, const BatchingOptions& batching,
         const SessionOptions& sessions, uint64_t epoch, PageObserver* page_observer,
         const DataPlaneOptions& data_plane);
  absl::StatusOr<SessionId> Resolve(const Caller& caller);
  // Releases the sessions' pages in every pool and their regions (into `unmap`, for the caller
  // to destroy outside the lock); returns how many pages.
  int ReleaseLocked(absl::Span<const SessionId> ids, PageEvent why,
                    std::vector<std::shared_ptr<void>>* unmap) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void EndCall();  // an admitted call is over (the drain count)

  std::unique_ptr<Backend> backend_;
  const BatchingOptions batching_;
  PageObserver* const page_observer_;
  std::vector<std::unique_ptr<Pool>> pools_;
  // Held across every change of sessions together with pages: allocation and free with their
  // quota charge, close and expiry with the release of the pages.
  absl::Mutex mu_;
  SessionTable sessions_;
  const DataPlaneOptions data_plane_;
  RegionTable regions_;
  PlanRegistry plans_;

  mutable absl::Mutex drain_mu_;
  bool draining_ ABSL_GUARDED_BY(drain_mu_) = false;
  int active_calls_ ABSL_GUARDED_BY(drain_mu_) = 0;  // admitted calls not yet over

  absl::Notification stop_reaper_;
  std::thread reaper_;
};

// The right of one admitted call to run (RAII, move-only): it holds the call, its page pins, its
// append locks and its place in the drain count, and gives all of them back when it goes out of
// scope. Engine::Submit keeps it until the call is over; an admission that is never submitted
// releases everything when destroyed.
class Admission {
 public:
  Admission(Admission&& other) noexcept;
  Admission& operator=(Admission&& other) noexcept;
  Admission(const Admission&) = delete;
  Admission& operator=(const Admission&) = delete;
  ~Admission() { Release(); }

  // The admitted call, for the caller to point its outputs at before submitting it.
  AttentionCall& call() { return call_; }

 private:
  friend class Engine;
  Admission(Engine* engine, Engine::Pool* pool, AttentionCall call, RegionUse regions)
      : engine_(engine), pool_(pool), call_(std::move(call)), regions_(std::move(regions)) {}
  // Unpins the page table (or lets its plan go), unlocks the appended pages and stops using the
  // regions (before the call is answered: a client may unregister them on the answer).
  void ReleasePages();
  // ReleasePages, then leaves the drain count.
  void Release();

  Engine* engine_ = nullptr;  // null: holds nothing (released or moved from)
  Engine::Pool* pool_ = nullptr;
  AttentionCall call_;
  SessionId session_ = 0;
  int64_t work_ = 0;   // key reads + query rows: what the batcher estimates its time from
  int64_t bytes_ = 0;  // the call's tensors and page table: what it holds while queued
  absl::Span<const int32_t> pinned_;  // views into the request, as call_.kv_indices
  std::vector<int64_t> locked_;       // AppendKeys
  RegionUse regions_;                 // the regions the call reads or writes
  std::shared_ptr<const Plan> plan_;  // the plan whose table the call reads, pinned for it
};

}  // namespace attn
