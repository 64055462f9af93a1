#include "server/engine/engine.h"

#include <algorithm>
#include <iterator>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/time/clock.h"
#include "server/engine/client_text.h"
#include "server/engine/status_macros.h"

namespace attn {

Engine::Engine(std::unique_ptr<Backend> backend, const BatchingOptions& batching,
               const SessionOptions& sessions, uint64_t epoch, PageObserver* page_observer,
               const DataPlaneOptions& data_plane)
    : backend_(std::move(backend)),
      batching_(batching),
      page_observer_(page_observer),
      sessions_(epoch, sessions),
      data_plane_(data_plane),
      regions_(data_plane.limits),
      plans_(data_plane.max_plans_per_session) {}

namespace {

// Keys the call reads, summed over its sequences: q_len * kv_len each (an upper bound of the
// causal work; a page the table names twice is read twice).
int64_t KeyReads(const AttentionCall& c, int page_size) {
  const PagedBatch view{c.batch_size,
                        c.total_q,
                        c.qo_indptr.empty() ? nullptr : c.qo_indptr.data(),
                        c.kv_indptr.data(),
                        nullptr,
                        c.kv_last_page_len.data(),
                        nullptr};
  int64_t reads = 0;
  for (int b = 0; b < c.batch_size; ++b) {
    const SeqExtent e = GetSeqExtent(view, page_size, b);
    reads += int64_t{e.q_len} * e.kv_len;
  }
  return reads;
}

// The bytes a queued call holds in the server: its tensors that came in the message, the outputs
// it sends back in the response, and its page table (tensors and outputs in the caller's regions
// hold none of the server's memory).
int64_t CallBytes(const AttentionCall& c, const RowShapes& rows) {
  int64_t bytes = 0;
  for (const CallInput* in : {&c.q, &c.q_pe, &c.k_new, &c.v_new}) {
    if (in->present && !in->on_device() && !in->registered) bytes += in->bytes;
  }
  if (!c.out.in_region()) bytes += c.total_q * rows.out.elements() * int64_t{sizeof(bf16)};
  if (c.return_lse && !c.lse.in_region()) bytes += c.total_q * int64_t{rows.lse} * 4;
  const int64_t ints = static_cast<int64_t>(c.qo_indptr.size() + c.kv_indptr.size() +
                                            c.kv_indices.size() + c.kv_last_page_len.size());
  return bytes + ints * 4;
}

}  // namespace

absl::StatusOr<std::unique_ptr<Engine>> Engine::Create(
    std::unique_ptr<Backend> backend, std::vector<PoolGeometry> pools,
    const BatchingOptions& batching, const SessionOptions& sessions, uint64_t epoch,
    BatchObserver* batch_observer, PageObserver* page_observer,
    const DataPlaneOptions& data_plane) {
  if (pools.empty()) return absl::InvalidArgumentError("no pools configured");
  std::unique_ptr<Engine> engine(
      new Engine(std::move(backend), batching, sessions, epoch, page_observer, data_plane));
  for (PoolGeometry& g : pools) {
    for (const auto& existing : engine->pools_) {
      if (existing->geometry.name == g.name) {
        return absl::InvalidArgumentError(absl::StrCat("pool name '", g.name, "' is used twice"));
      }
    }
    const int index = static_cast<int>(engine->pools_.size());
    ATTN_RETURN_IF_ERROR(engine->backend_->AddPool(g));
    std::unique_ptr<Pool> pool(new Pool(index, std::move(g), page_observer));
    for (Op op : {Op::kPrefill, Op::kDecode}) {
      ATTN_ASSIGN_OR_RETURN(std::unique_ptr<Lane> lane, engine->backend_->CreateLane(index, op));
      auto batcher = std::make_unique<Batcher>(pool->geometry.name, op, std::move(lane), batching,
                                               batch_observer);
      (op == Op::kPrefill ? pool->prefill_ : pool->decode_) = std::move(batcher);
    }
    if (page_observer) page_observer->OnPoolAdded(pool->geometry.name, pool->total_pages());
    engine->pools_.push_back(std::move(pool));
  }
  // Leases are checked every second, or more often for shorter leases.
  const absl::Duration period =
      std::clamp(sessions.default_lease / 8, absl::Milliseconds(10), absl::Seconds(1));
  Engine* e = engine.get();
  engine->reaper_ = std::thread([e, period] {
    while (!e->stop_reaper_.WaitForNotificationWithTimeout(period)) e->ExpireSessions(absl::Now());
  });
  return engine;
}

Engine::~Engine() {
  stop_reaper_.Notify();
  if (reaper_.joinable()) reaper_.join();
  // Batchers first: their threads use the lanes, which use the backend's storage, and the calls
  // they still hold release pages of the pools.
  for (auto& pool : pools_) {
    pool->prefill_.reset();
    pool->decode_.reset();
  }
}

// --- Sessions

absl::StatusOr<SessionId> Engine::Resolve(const Caller& caller) {
  return sessions_.Resolve(caller.session, caller.principal, absl::Now());
}

absl::StatusOr<OpenedSession> Engine::OpenSession(absl::Duration lease, int max_pages,
                                                  const Principal& owner) {
  return sessions_.Open(lease, max_pages, owner, absl::Now());
}

absl::Status Engine::RenewLease(const Caller& caller) { return Resolve(caller).status(); }

int Engine::ReleaseLocked(absl::Span<const SessionId> ids, PageEvent why,
                          std::vector<std::shared_ptr<void>>* unmap) {
  int released = 0;
  for (auto& pool : pools_) released += pool->pages_.ReleaseOwners(ids, why);
  for (SessionId id : ids) {
    regions_.ReleaseSession(id, unmap);
    plans_.ReleaseSession(id, unmap);  // their pins go with the last call that uses them
  }
  return released;
}

absl::StatusOr<int> Engine::CloseSession(absl::string_view handle, const Principal& who) {
  std::vector<std::shared_ptr<void>> unmap;  // regions, unmapped after the lock is released
  absl::MutexLock lock(&mu_);
  ATTN_ASSIGN_OR_RETURN(const SessionId id, sessions_.Close(handle, who));
  return ReleaseLocked(absl::MakeConstSpan(&id, 1), PageEvent::kClosed, &unmap);
}

void Engine::ExpireSessions(absl::Time now) {
  std::vector<std::shared_ptr<void>> unmap;
  absl::MutexLock lock(&mu_);
  const std::vector<SessionId> expired = sessions_.Expire(now);
  ReleaseLocked(expired, PageEvent::kReclaimed, &unmap);
}

// --- Registered memory

absl::StatusOr<RegionInfo> Engine::RegisterRegion(const Caller& caller, absl::string_view name,
                                                  const RegionSpec& spec, RegistrationFields use) {
  const bool allowed =
      spec.kind == RegionKind::kSharedMemory ? data_plane_.shared_memory : data_plane_.cuda_ipc;
  if (!allowed) {
    return absl::UnimplementedError(absl::StrCat(
        "this server does not accept ", RegionKindName(spec.kind),
        " regions (ServerConfig.data_plane; GetServerInfo.data_plane says what it accepts)"));
  }
  // What the registration asks for: a retry of one whose answer was lost asks for the same.
  const bool shm = spec.kind == RegionKind::kSharedMemory;
  RegistrationFields what = {
      {"memory", RegionKindName(spec.kind)},
      {shm ? "shared_memory.shm_name" : "cuda_ipc.handle", shm ? spec.shm_name : spec.ipc_handle},
      {"offset", absl::StrCat(spec.offset)},
      {"size", absl::StrCat(spec.size)},
      {"key", spec.key}};
  what.insert(what.end(), std::make_move_iterator(use.begin()), std::make_move_iterator(use.end()));
  SessionId owner = 0;
  {
    absl::MutexLock lock(&mu_);
    ATTN_ASSIGN_OR_RETURN(owner, Resolve(caller));
    ATTN_ASSIGN_OR_RETURN(std::optional<RegionInfo> existing,
                          regions_.Reserve(owner, name, spec.size, std::move(what)));
    if (existing.has_value()) return *std::move(existing);
  }
  // Mapping (and page-locking) can take milliseconds: outside the engine's lock. A session that
  // closes meanwhile drops the reservation, and Commit then unmaps.
  absl::StatusOr<std::unique_ptr<MappedMemory>> memory =
      backend_->MapRegion(spec, data_plane_.shm_name_prefix);
  if (!memory.ok()) {
    regions_.Abandon(owner, name);
    return memory.status();
  }
  return regions_.Commit(owner, name, *std::move(memory));
}

absl::Status Engine::UnregisterRegion(const Caller& caller, absl::string_view name) {
  ATTN_ASSIGN_OR_RETURN(const SessionId owner, Resolve(caller));
  return regions_.Remove(owner, name);
}

absl::StatusOr<std::vector<RegionInfo>> Engine::ListRegions(const Caller& caller) {
  ATTN_ASSIGN_OR_RETURN(const SessionId owner, Resolve(caller));
  return regions_.List(owner);
}

absl::StatusOr<RegionUse> Engine::ResolveRegions(const Caller& caller,
                                                 absl::Span<const SliceRef> slices) {
  if (slices.empty()) return RegionUse();
  ATTN_ASSIGN_OR_RETURN(const SessionId owner, Resolve(caller));
  return regions_.Resolve(owner, slices);
}

absl::StatusOr<RegionHold> Engine::HoldRegion(const Caller& caller, absl::string_view name,
                                              std::function<void(RegionGone)> on_gone) {
  ATTN_ASSIGN_OR_RETURN(const SessionId owner, Resolve(caller));
  return regions_.Hold(owner, name, std::move(on_gone));
}

// --- Plans

absl::Status Engine::CreatePlan(Pool& pool, const Caller& caller, absl::string_view name,
                                PlanTable table) {
  ATTN_RETURN_IF_ERROR(PlanRegistry::CheckName(name));
  ATTN_ASSIGN_OR_RETURN(const SessionId owner, Resolve(caller));
  // Pinning a large table takes a while: outside mu_, as a call's pins are.
  ATTN_ASSIGN_OR_RETURN(std::shared_ptr<Plan> plan,
                        Plan::Create(&pool.pages_, pool.index_, owner, std::move(table)));
  absl::StatusOr<std::shared_ptr<Plan>> replaced;  // destroyed (unpinned) after the lock
  absl::MutexLock lock(&mu_);
  // Still open under mu_, so its release (close, expiry: ReleaseLocked) comes after the plan is
  // in the registry and takes it along; a session that ended meanwhile gets none (the plan's
  // pins then go with `plan`, freeing the released pages).
  if (absl::StatusOr<SessionId> still = Resolve(caller); !still.ok() || *still != owner) {
    return still.ok() ? absl::NotFoundError("the session ended") : still.status();
  }
  replaced = plans_.Put(name, std::move(plan));
  return replaced.status();
}

absl::Status Engine::ReleasePlan(const Caller& caller, absl::string_view name) {
  ATTN_ASSIGN_OR_RETURN(const SessionId owner, Resolve(caller));
  return plans_.Remove(owner, name).status();  // its pins go with its last call
}

absl::StatusOr<std::shared_ptr<const Plan>> Engine::FindPlan(const Pool& pool, const Caller& caller,
                                                             absl::string_view name, Op op) {
  ATTN_ASSIGN_OR_RETURN(const SessionId owner, Resolve(caller));
  ATTN_ASSIGN_OR_RETURN(std::shared_ptr<const Plan> plan, plans_.Find(owner, name));
  if (plan->pool() != pool.index_) {
    return absl::InvalidArgumentError(
        absl::StrCat("plan '", ShownName(name), "' is a page table of pool '",
                     pools_[plan->pool()]->geometry.name, "', not of '", pool.geometry.name, "'"));
  }
  if (plan->table().op != op) {
    return absl::InvalidArgumentError(absl::StrCat(
        "plan '", ShownName(name), "' is a ",
        plan->table().op == Op::kPrefill ? "Prefill" : "Decode", " plan (",
        plan->table().op == Op::kPrefill ? "with" : "without", " qo_indptr); this is a ",
        op == Op::kPrefill ? "Prefill" : "Decode", " call"));
  }
  return plan;
}

// --- Pages

absl::StatusOr<std::vector<int32_t>> Engine::AllocatePages(absl::string_view pool_name,
                                                           const Caller& caller, int num_pages) {
  if (draining()) return absl::UnavailableError("the server is draining; allocate elsewhere");
  ATTN_ASSIGN_OR_RETURN(Pool* const pool, FindPool(pool_name));
  SessionId owner = 0;
  std::vector<int32_t> to_scrub;  // pinned by Allocate until they are zeroed
  absl::StatusOr<std::vector<int32_t>> ids;
  {
    absl::MutexLock lock(&mu_);
    ATTN_ASSIGN_OR_RETURN(owner, Resolve(caller));
    const int total = pool->total_pages();
    if (num_pages < 1 || num_pages > total) {
      return absl::InvalidArgumentError(
          absl::StrCat("num_pages = ", num_pages, " is outside [1, ", total, "]"));
    }
    // The quota first (other sessions' pages are never touched), then the pool.
    if (absl::Status quota = sessions_.Charge(owner, num_pages); !quota.ok()) {
      ids = quota;
    } else {
      ids = pool->pages_.Allocate(num_pages, owner, &to_scrub);
      if (!ids.ok()) sessions_.Refund(owner, num_pages);
    }
  }
  if (absl::IsResourceExhausted(ids.status()) && page_observer_) {
    page_observer_->OnAllocationFailure(pool->geometry.name);
  }
  if (!ids.ok() || to_scrub.empty()) return ids;
  // Outside mu_: other sessions allocate and free meanwhile. The pins keep these pages out of a
  // concurrent close's hands until they are clean; the ids reach no one before that.
  const absl::Status scrubbed = backend_->ScrubPages(pool->index_, to_scrub);
  pool->pages_.Unpin(to_scrub);
  if (!scrubbed.ok()) {
    absl::MutexLock lock(&mu_);
    // Unless the session closed meanwhile (which released them), the pages go back unused.
    if (pool->pages_.Free(*ids, owner).ok()) sessions_.Refund(owner, num_pages);
    return scrubbed;
  }
  return ids;
}

absl::StatusOr<int> Engine::FreePages(absl::string_view pool_name, const Caller& caller,
                                      absl::Span<const int32_t> page_ids) {
  ATTN_ASSIGN_OR_RETURN(Pool* const pool, FindPool(pool_name));
  absl::MutexLock lock(&mu_);
  ATTN_ASSIGN_OR_RETURN(const SessionId owner, Resolve(caller));
  ATTN_RETURN_IF_ERROR(pool->pages_.Free(page_ids, owner));
  sessions_.Refund(owner, static_cast<int>(page_ids.size()));
  return pool->free_pages();
}

// --- Prefill and Decode

absl::StatusOr<Engine::Pool*> Engine::FindPool(absl::string_view name) {
  if (name.empty()) {
    if (pools_.size() == 1) return pools_.front().get();
    return absl::InvalidArgumentError("pool is empty and the server has several pools; name one");
  }
  for (auto& pool : pools_) {
    if (pool->geometry.name == name) return pool.get();
  }
  std::vector<std::string> names;
  for (const auto& pool : pools_) names.push_back(pool->geometry.name);
  return absl::NotFoundError(
      absl::StrCat("no pool '", ShownClientString(name), "'; pools: ", absl::StrJoin(names, ", ")));
}

absl::StatusOr<Admission> Engine::Admit(Pool& pool, const Caller& caller, AttentionCall call,
                                        RegionUse regions, std::shared_ptr<const Plan> plan) {
  // The request alone decides this: refused before the session is looked at (or renewed).
  const int64_t key_reads = KeyReads(call, pool.geometry.page_size);
  if (key_reads > batching_.max_call_key_reads) {
    return absl::InvalidArgumentError(
        absl::StrCat("the call reads ", key_reads,
                     " keys (the sum over its sequences of q_len * kv_len); "
                     "this server's limit is max_call_key_reads = ",
                     batching_.max_call_key_reads, ": split the batch into several calls"));
  }
  ATTN_ASSIGN_OR_RETURN(const SessionId owner, Resolve(caller));
  {
    absl::MutexLock lock(&drain_mu_);
    if (draining_) return absl::UnavailableError("the server is draining; retry on another server");
    ++active_calls_;
  }
  // From here on `admission` owns what has been taken: a refusal below gives it all back.
  Admission admission(this, &pool, std::move(call), std::move(regions));
  admission.session_ = owner;
  admission.work_ = key_reads + admission.call_.total_q;
  admission.bytes_ = CallBytes(admission.call_, pool.geometry.rows());
  // Pinned pages cannot be freed or reclaimed until the call finishes: a plan's are pinned
  // while it lives, and the admission keeps it.
  const AttentionCall& c = admission.call_;
  if (plan != nullptr) {
    if (plan->session() != owner || plan->pool() != pool.index_ ||
        c.kv_indices.data() != plan->table().kv_indices.data()) {
      return absl::InternalError("a call admitted with a plan must be validated on that plan");
    }
    admission.call_.table_id = plan->id();
    admission.plan_ = std::move(plan);
  } else {
    ATTN_RETURN_IF_ERROR(pool.pages_.Pin(c.kv_indices, owner, "kv_indices"));
    admission.pinned_ = c.kv_indices;
  }
  // The pages this call appends to stay its own until it finishes.
  ATTN_RETURN_IF_ERROR(pool.appends_.Acquire(c.append_pages));
  admission.locked_ = c.append_pages;
  return admission;
}

void Engine::Submit(Admission admission, absl::Time deadline, std::function<bool()> is_cancelled,
                    Done done) {
  Pool& pool = *admission.pool_;
  auto pending = std::make_unique<PendingCall>();
  pending->call = std::move(admission.call_);
  pending->deadline = deadline;
  pending->is_cancelled = std::move(is_cancelled);
  pending->session = admission.session_;
  pending->work = admission.work_;
  pending->bytes = admission.bytes_;
  const Op op = pending->call.op;
  // std::function needs a copyable callable: the admission is shared by the copies, and the one
  // call of `finish` releases it.
  auto held = std::make_shared<Admission>(std::move(admission));
  auto finish = [held, done = std::move(done)](const absl::Status& st, const CallReport& report) {
    // A region whose memory went away while the call ran (a truncated shared-memory object)
    // gave the call zeros: it fails instead of answering with them.
    absl::Status result = st.ok() ? held->regions_.CheckIntact() : st;
    held->ReleasePages();
    done(result, report);
    held->Release();
  };
  pending->done = finish;
  Batcher& batcher = pool.batcher(op);
  if (absl::Status st = batcher.Submit(std::move(pending)); !st.ok()) {
    CallReport report;
    report.enqueued = report.finished = absl::Now();
    if (absl::IsResourceExhausted(st)) report.retry_after = batcher.RetryHint();
    finish(st, report);
  }
}

// --- Drain

void Engine::StartDrain() {
  absl::MutexLock lock(&drain_mu_);
  draining_ = true;
}

bool Engine::draining() const {
  absl::MutexLock lock(&drain_mu_);
  return draining_;
}

bool Engine::WaitForIdle(absl::Time deadline) {
  absl::MutexLock lock(&drain_mu_);
  return drain_mu_.AwaitWithDeadline(absl::Condition(
                                         +[](int* active) { return *active == 0; }, &active_calls_),
                                     deadline);
}

int Engine::CancelQueued(const absl::Status& why) {
  int cancelled = 0;
  for (auto& pool : pools_) {
    for (Op op : {Op::kPrefill, Op::kDecode}) cancelled += pool->batcher(op).CancelQueued(why);
  }
  return cancelled;
}

int Engine::active_calls() const {
  absl::MutexLock lock(&drain_mu_);
  return active_calls_;
}

void Engine::EndCall() {
  absl::MutexLock lock(&drain_mu_);
  --active_calls_;
}

// --- Admission

Admission::Admission(Admission&& other) noexcept
    : engine_(std::exchange(other.engine_, nullptr)),
      pool_(other.pool_),
      call_(std::move(other.call_)),
      session_(other.session_),
      work_(other.work_),
      bytes_(other.bytes_),
      pinned_(std::exchange(other.pinned_, {})),
      locked_(std::move(other.locked_)),
      regions_(std::move(other.regions_)),
      plan_(std::move(other.plan_)) {
  other.locked_.clear();
}

Admission& Admission::operator=(Admission&& other) noexcept {
  if (this != &other) {
    Release();
    engine_ = std::exchange(other.engine_, nullptr);
    pool_ = other.pool_;
    call_ = std::move(other.call_);
    session_ = other.session_;
    work_ = other.work_;
    bytes_ = other.bytes_;
    pinned_ = std::exchange(other.pinned_, {});
    locked_ = std::move(other.locked_);
    other.locked_.clear();
    regions_ = std::move(other.regions_);
    plan_ = std::move(other.plan_);
  }
  return *this;
}

void Admission::ReleasePages() {
  if (engine_ == nullptr) return;
  pool_->appends_.Release(locked_);
  locked_.clear();
  pool_->pages_.Unpin(pinned_);
  pinned_ = {};
  regions_ = RegionUse();
  plan_.reset();
}

void Admission::Release() {
  if (engine_ == nullptr) return;
  ReleasePages();
  std::exchange(engine_, nullptr)->EndCall();
}

}  // namespace attn
