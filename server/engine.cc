#include "server/engine.h"

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "server/status_macros.h"

namespace attn {

absl::StatusOr<std::unique_ptr<Engine>> Engine::Create(std::unique_ptr<Backend> backend,
                                                       std::vector<PoolGeometry> pools,
                                                       const BatchingOptions& batching,
                                                       BatchObserver* observer) {
  if (pools.empty()) return absl::InvalidArgumentError("no pools configured");
  std::unique_ptr<Engine> engine(new Engine(std::move(backend)));
  for (PoolGeometry& g : pools) {
    for (const auto& existing : engine->pools_) {
      if (existing->geometry.name == g.name) {
        return absl::InvalidArgumentError(absl::StrCat("pool name '", g.name, "' is used twice"));
      }
    }
    const int index = static_cast<int>(engine->pools_.size());
    RETURN_IF_ERROR(engine->backend_->AddPool(g));
    auto pool = std::make_unique<Pool>(std::move(g));
    for (Op op : {Op::kPrefill, Op::kDecode}) {
      ASSIGN_OR_RETURN(std::unique_ptr<Lane> lane, engine->backend_->CreateLane(index, op));
      auto batcher =
          std::make_unique<Batcher>(absl::StrCat(pool->geometry.name, "/", OpName(op)), op,
                                    std::move(lane), batching, observer);
      (op == Op::kPrefill ? pool->prefill : pool->decode) = std::move(batcher);
    }
    engine->pools_.push_back(std::move(pool));
  }
  return engine;
}

Engine::~Engine() {
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
