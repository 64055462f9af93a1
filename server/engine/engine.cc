#include "server/engine/engine.h"

#include <algorithm>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "server/engine/status_macros.h"

namespace attn {

Engine::Engine(std::unique_ptr<Backend> backend, const SessionOptions& sessions, uint64_t epoch,
               ReclaimObserver on_reclaim)
    : backend_(std::move(backend)), sessions_(epoch, sessions), on_reclaim_(std::move(on_reclaim)) {}

absl::StatusOr<std::unique_ptr<Engine>> Engine::Create(std::unique_ptr<Backend> backend,
                                                       std::vector<PoolGeometry> pools,
                                                       const BatchingOptions& batching,
                                                       const SessionOptions& sessions,
                                                       uint64_t epoch, BatchObserver* observer,
                                                       ReclaimObserver on_reclaim) {
  if (pools.empty()) return absl::InvalidArgumentError("no pools configured");
  std::unique_ptr<Engine> engine(
      new Engine(std::move(backend), sessions, epoch, std::move(on_reclaim)));
  for (PoolGeometry& g : pools) {
    for (const auto& existing : engine->pools_) {
      if (existing->geometry.name == g.name) {
        return absl::InvalidArgumentError(absl::StrCat("pool name '", g.name, "' is used twice"));
      }
    }
    const int index = static_cast<int>(engine->pools_.size());
    ATTN_RETURN_IF_ERROR(engine->backend_->AddPool(g));
    auto pool = std::make_unique<Pool>(std::move(g));
    for (Op op : {Op::kPrefill, Op::kDecode}) {
      ATTN_ASSIGN_OR_RETURN(std::unique_ptr<Lane> lane, engine->backend_->CreateLane(index, op));
      auto batcher =
          std::make_unique<Batcher>(pool->geometry.name, op, std::move(lane), batching, observer);
      (op == Op::kPrefill ? pool->prefill : pool->decode) = std::move(batcher);
    }
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

int Engine::ReleaseSession(SessionId id, bool expired) {
  int released = 0;
  for (auto& pool : pools_) {
    const int pages = pool->pages.ReleaseOwner(id);
    if (expired && pages > 0 && on_reclaim_) on_reclaim_(pool->geometry.name, pages);
    released += pages;
  }
  return released;
}

absl::StatusOr<int> Engine::CloseSession(absl::string_view handle) {
  absl::StatusOr<SessionId> id = sessions_.Close(handle);
  if (!id.ok()) return id.status();
  return ReleaseSession(*id, /*expired=*/false);
}

void Engine::ExpireSessions(absl::Time now) {
  for (SessionId id : sessions_.Expire(now)) ReleaseSession(id, /*expired=*/true);
}

Engine::~Engine() {
  stop_reaper_.Notify();
  if (reaper_.joinable()) reaper_.join();
  // Batchers first: their threads use the lanes, which use the backend's storage.
  for (auto& pool : pools_) {
    pool->prefill.reset();
    pool->decode.reset();
  }
}

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
      absl::StrCat("no pool '", name, "'; pools: ", absl::StrJoin(names, ", ")));
}

}  // namespace attn
