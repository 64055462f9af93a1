// The CPU backend: pools in host memory, kernels from kernels/cpu on a shared worker pool.
#pragma once

#include <memory>
#include <string>
#include <vector>

#include "server/engine/backend.h"

namespace attn {

// `threads` workers (0: one per hardware thread) shared by all lanes.
std::unique_ptr<Backend> CreateCpuBackend(int threads);

}  // namespace attn
