// The CUDA backend: every pool's pages in one device allocation, one stream per lane (decode lanes
// at higher priority than prefill lanes so a long prefill does not delay decodes), pinned staging
// so each launch makes one host-to-device copy of its inputs and plan and one device-to-host copy
// of its outputs.
//
// A sticky CUDA error (illegal address, launch failure, ...) poisons the context: the failing
// launch and every later one return INTERNAL, and the fatal-error handler runs once so the server
// can stop serving and exit non-zero.
//
// Built only when nvcc is found (ATTN_HAVE_CUDA); see server/backends/backend_factory.h.
#pragma once

#include <functional>
#include <memory>

#include "absl/status/statusor.h"
#include "server/engine/backend.h"

namespace attn {

struct CudaBackendOptions {
  int device = 0;
  // Split-KV workspace of each lane (float32 partial rows), in bytes.
  int64_t workspace_bytes = int64_t{256} << 20;
  // Every lane on one stream (measurement only: decodes then wait behind prefills).
  bool single_stream = false;
  // A decode launch of one call whose output goes to a shared-memory region of at least this many
  // bytes has the kernels write it there instead of copying it after them (0: never; a server's
  // default is BackendOptions').
  int64_t direct_output_min_bytes = 0;
  // A prefill launch whose output rows hold at least twice this many bytes computes them in
  // chunks of at least this many (at most 8, cuda::LaunchOptions::output_chunk_bytes) and copies
  // each chunk out while the next is computed, on a copy stream of the lane (0: one launch, then
  // the copies; so is every launch with single_stream).
  int64_t output_chunk_bytes = 0;
  // Called once, from a lane's thread, after the first sticky error.
  std::function<void(const absl::Status&)> on_fatal_error;
};

// Number of usable CUDA devices (0 when there is no driver or device).
int CudaDeviceCount();

// UNAVAILABLE when no device is present.
absl::StatusOr<std::unique_ptr<Backend>> CreateCudaBackend(CudaBackendOptions options);

}  // namespace attn
