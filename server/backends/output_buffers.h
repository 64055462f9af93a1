// Buffers a lane's outputs are written into and sent from: one per launch, handed to the RPC edge
// as SharedBytes (server/engine/host_bytes.h) and reused when the edge is done with it (the last
// reference gone), so outputs go from the backend's buffer to the wire without a copy. The
// backend chooses the memory (plain host memory, or pinned memory the GPU copies into).
//
// At most a few idle buffers are kept, none larger than a limit: one huge call does not pin its
// scratch for the life of the process. Thread safe; buffers may outlive the OutputBuffers.
#pragma once

#include <cstddef>
#include <functional>
#include <memory>

#include "absl/status/statusor.h"

namespace attn {

class OutputBuffers {
 public:
  using Allocate = std::function<void*(size_t bytes)>;  // nullptr when out of memory
  using Free = std::function<void(void* buffer)>;

  // Keeps up to `max_idle` idle buffers of at most `max_idle_bytes` each.
  OutputBuffers(Allocate allocate, Free free, int max_idle = 4,
                size_t max_idle_bytes = size_t{64} << 20);
  ~OutputBuffers();
  OutputBuffers(const OutputBuffers&) = delete;
  OutputBuffers& operator=(const OutputBuffers&) = delete;

  // A buffer of at least `bytes` (an idle one when one is large enough). RESOURCE_EXHAUSTED when
  // the memory cannot be allocated.
  absl::StatusOr<std::shared_ptr<char>> Get(size_t bytes);

  // Frees the idle buffers larger than `keep` bytes (a lane gone idle after large launches).
  void ReleaseIdle(size_t keep);

  // Plain host memory (the CPU backend).
  static std::unique_ptr<OutputBuffers> Host();

 private:
  struct State;
  std::shared_ptr<State> state_;
};

}  // namespace attn
