// POSIX shared memory mapped as a region (server/engine/regions.h), shared by the backends.
//
// The owner of a shared-memory object can truncate it at any time; touching a page of a mapping
// past the new end raises SIGBUS, which would kill the server. A process-wide SIGBUS handler
// (installed with the first mapping) recognises faults inside these mappings, maps anonymous zero
// pages over the mapping so the faulting access completes, and marks it broken: the call that
// was using it then fails (RegionUse::CheckIntact) and later calls are refused. Faults anywhere
// else go to the handler that was installed before (or the default action), as if this one were
// not there. This is how display servers survive clients that shrink shared buffers.
#pragma once

#include <cstdint>
#include <memory>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "server/engine/regions.h"

namespace attn {

// A mapped shared-memory region. The mapping covers whole pages around the region.
class SharedMemoryMapping final : public MappedMemory {
 public:
  ~SharedMemoryMapping() override;
  RegionKind kind() const override { return RegionKind::kSharedMemory; }
  char* data() const override { return map_base_ + lead_; }
  int64_t size() const override { return size_; }
  bool broken() const override;

  // The page-aligned mapping around the region (what cudaHostRegister pins).
  char* map_base() const { return map_base_; }
  int64_t map_bytes() const { return map_bytes_; }

 private:
  friend absl::StatusOr<std::unique_ptr<SharedMemoryMapping>> MapSharedMemory(
      const RegionSpec& spec, absl::string_view name_prefix);
  SharedMemoryMapping() = default;

  char* map_base_ = nullptr;
  int64_t map_bytes_ = 0;
  int64_t lead_ = 0;  // region start - map_base_
  int64_t size_ = 0;
  int guard_slot_ = -1;
};

// Opens spec.shm_name (which must start with `name_prefix` and be a POSIX shm name: one leading
// '/', no other), maps [spec.offset, spec.offset + spec.size) read-write and checks the region
// header (kRegionMagic, then spec.key). INVALID_ARGUMENT for a bad name, offset, size or key,
// NOT_FOUND for a missing object, FAILED_PRECONDITION when the server may not open it, the
// object is smaller than the region or the header does not match, RESOURCE_EXHAUSTED when the
// process maps too many regions.
absl::StatusOr<std::unique_ptr<SharedMemoryMapping>> MapSharedMemory(const RegionSpec& spec,
                                                                     absl::string_view name_prefix);

// Checks the region header at `data` (host memory of at least kRegionHeaderBytes).
absl::Status CheckRegionHeader(const char* data, absl::string_view key);

}  // namespace attn
