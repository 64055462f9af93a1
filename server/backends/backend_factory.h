// Creates the backend a server's options name: "cpu", "cuda", or "auto" (CUDA when this build has
// the CUDA backend and a device is present, the CPU otherwise).
#pragma once

#include <functional>
#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "server/engine/backend.h"

namespace attn {

// CUDA backend: below ~1 MiB the copy a decode's output region saves (~20 us over PCIe 5) is about
// what the host's wait for the input check's verdict and the kernels' own stores across the link
// cost (bench/RESULTS.md: batch 64, 512 KiB, even; batch 256, 2 MiB, 57 us faster).
inline constexpr int64_t kDefaultCudaDirectOutputMinBytes = int64_t{1} << 20;
inline constexpr int64_t kDefaultCudaOutputChunkBytes = int64_t{8} << 20;

struct BackendOptions {
  std::string kind = "auto";  // "auto", "cpu" or "cuda"
  int cpu_threads = 0;        // 0: hardware concurrency
  bool cuda_single_stream = false;
  int64_t cuda_direct_output_min_bytes = kDefaultCudaDirectOutputMinBytes;  // CudaBackendOptions'
  int64_t cuda_output_chunk_bytes = kDefaultCudaOutputChunkBytes;           // CudaBackendOptions'
  std::string inject_fault;  // testing hook (server/backends/fault_injection.h); empty: none
};

// `on_fatal_error` runs once if the device fails in a way that poisons the process (CUDA sticky
// errors); the server then stops serving and exits non-zero. options.inject_fault wraps the
// backend in the testing hook of server/backends/fault_injection.h.
absl::StatusOr<std::unique_ptr<Backend>> CreateBackend(
    const BackendOptions& options, std::function<void(const absl::Status&)> on_fatal_error);

}  // namespace attn
