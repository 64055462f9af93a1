// Regions on the CUDA backend (server/engine/regions.h): POSIX shared memory page-locked for DMA,
// and CUDA memory of another process opened from its IPC handle.
//
// Shared memory: mapped as on the CPU backend (server/backends/shared_memory.h), then registered
// with cudaHostRegister, so the backend's copies run straight between the caller's memory and
// the device with no staging copy on the host.
//
// CUDA IPC: cudaIpcOpenMemHandle on the backend's device (peer access is enabled lazily when the
// memory is on another GPU). The region must lie inside the exported allocation (its bounds come
// from the driver, so a caller cannot make the server touch device memory outside it), and its
// header is read back and checked like a shared-memory region's. Built only with the CUDA backend.
#pragma once

#include <memory>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "server/engine/regions.h"

namespace attn {

// Maps `spec` for use on CUDA device `device` (the calling thread's current device is set to it).
// Errors as MapSharedMemory's; for CUDA IPC, INVALID_ARGUMENT for a handle of the wrong size or a
// region outside the allocation, FAILED_PRECONDITION for a handle that does not open.
absl::StatusOr<std::unique_ptr<MappedMemory>> MapCudaRegion(const RegionSpec& spec, int device,
                                                            absl::string_view shm_name_prefix);

}  // namespace attn
