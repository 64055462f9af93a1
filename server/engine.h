// The server's core without gRPC: the backend, the pools (geometry, page ids, storage) and one
// batcher per (pool, op).
#pragma once

#include <memory>
#include <string>
#include "absl/strings/string_view.h"
#include <vector>

#include "absl/status/statusor.h"
#include "server/backend.h"
#include "server/batcher.h"
#include "server/page_pool.h"
#include "server/pool_geometry.h"

namespace attn {

class Engine {
 public:
  struct Pool {
    Pool(PoolGeometry g) : geometry(std::move(g)), pages(geometry.num_pages) {}
    const PoolGeometry geometry;
    PagePool pages;
    std::unique_ptr<Batcher> prefill;
    std::unique_ptr<Batcher> decode;
    Batcher& batcher(Op op) { return op == Op::kPrefill ? *prefill : *decode; }
  };

  // Allocates every pool's storage on `backend` and starts the batchers. `observer` may be null
  // and must outlive the engine.
  static absl::StatusOr<std::unique_ptr<Engine>> Create(std::unique_ptr<Backend> backend,
                                                        std::vector<PoolGeometry> pools,
                                                        const BatchingOptions& batching,
                                                        BatchObserver* observer);
  ~Engine();  // stops the batchers

  // The pool called `name`; an empty name selects the only pool when there is exactly one.
  absl::StatusOr<Pool*> FindPool(absl::string_view name);

  const Backend& backend() const { return *backend_; }
  const std::vector<std::unique_ptr<Pool>>& pools() const { return pools_; }

 private:
  explicit Engine(std::unique_ptr<Backend> backend) : backend_(std::move(backend)) {}

  std::unique_ptr<Backend> backend_;
  std::vector<std::unique_ptr<Pool>> pools_;
};

}  // namespace attn
