#include "server/backends/cuda_regions.h"

#include <cuda.h>
#include <cuda_runtime_api.h>

#include <cstring>
#include <string>

#include "absl/strings/str_cat.h"
#include "server/backends/shared_memory.h"

namespace attn {
namespace {

std::string CudaMessage(cudaError_t err, const char* what) {
  return absl::StrCat(what, ": ", cudaGetErrorName(err), " (", cudaGetErrorString(err), ")");
}

class PinnedSharedMemory final : public MappedMemory {
 public:
  explicit PinnedSharedMemory(std::unique_ptr<SharedMemoryMapping> mapping)
      : mapping_(std::move(mapping)) {}
  ~PinnedSharedMemory() override { cudaHostUnregister(mapping_->map_base()); }
  RegionKind kind() const override { return RegionKind::kSharedMemory; }
  char* data() const override { return mapping_->data(); }
  int64_t size() const override { return mapping_->size(); }
  bool broken() const override { return mapping_->broken(); }

 private:
  std::unique_ptr<SharedMemoryMapping> mapping_;
};

class IpcMemory final : public MappedMemory {
 public:
  IpcMemory(void* base, int64_t offset, int64_t size, int device)
      : base_(base), offset_(offset), size_(size), device_(device) {}
  ~IpcMemory() override {
    cudaSetDevice(device_);
    cudaIpcCloseMemHandle(base_);
  }
  RegionKind kind() const override { return RegionKind::kCudaIpc; }
  char* data() const override { return static_cast<char*>(base_) + offset_; }
  int64_t size() const override { return size_; }

 private:
  void* base_;
  int64_t offset_;
  int64_t size_;
  int device_;
};

// Base and size of the allocation containing `ptr` (driver API, through the runtime's entry
// point so the binary needs no link against libcuda).
absl::Status AllocationRange(void* ptr, CUdeviceptr* base, size_t* size) {
  using GetRange = CUresult (*)(CUdeviceptr*, size_t*, CUdeviceptr);
  static GetRange get_range = [] {
    void* fn = nullptr;
    cudaDriverEntryPointQueryResult found{};
    if (cudaGetDriverEntryPointByVersion("cuMemGetAddressRange", &fn, 12000, cudaEnableDefault,
                                         &found) != cudaSuccess ||
        found != cudaDriverEntryPointSuccess) {
      fn = nullptr;
    }
    return reinterpret_cast<GetRange>(fn);
  }();
  if (get_range == nullptr) {
    return absl::InternalError("the CUDA driver has no cuMemGetAddressRange");
  }
  if (get_range(base, size, reinterpret_cast<CUdeviceptr>(ptr)) != CUDA_SUCCESS) {
    return absl::FailedPreconditionError("cuMemGetAddressRange failed on the opened IPC memory");
  }
  return absl::OkStatus();
}

absl::StatusOr<std::unique_ptr<MappedMemory>> OpenIpc(const RegionSpec& spec, int device) {
  cudaIpcMemHandle_t handle;
  if (spec.ipc_handle.size() != sizeof(handle)) {
    return absl::InvalidArgumentError(absl::StrCat("cuda_ipc.handle has ", spec.ipc_handle.size(),
                                                   " bytes; a cudaIpcMemHandle_t has ",
                                                   sizeof(handle)));
  }
  if (spec.offset < 0 || spec.offset % kRegionMapAlignment != 0 || spec.size < kRegionHeaderBytes) {
    return absl::InvalidArgumentError(absl::StrCat(
        "offset = ", spec.offset, " must be a non-negative multiple of ", kRegionMapAlignment,
        " and size = ", spec.size, " at least ", kRegionHeaderBytes));
  }
  std::memcpy(&handle, spec.ipc_handle.data(), sizeof(handle));
  void* base = nullptr;
  if (cudaError_t err = cudaIpcOpenMemHandle(&base, handle, cudaIpcMemLazyEnablePeerAccess);
      err != cudaSuccess) {
    cudaGetLastError();  // not sticky: clear it so later calls do not see it
    return absl::FailedPreconditionError(CudaMessage(err, "cudaIpcOpenMemHandle"));
  }
  auto memory = std::make_unique<IpcMemory>(base, spec.offset, spec.size, device);
  CUdeviceptr alloc_base = 0;
  size_t alloc_size = 0;
  if (absl::Status st = AllocationRange(base, &alloc_base, &alloc_size); !st.ok()) return st;
  const int64_t available =
      static_cast<int64_t>(alloc_size) - (reinterpret_cast<CUdeviceptr>(base) - alloc_base);
  if (spec.offset > available || spec.size > available - spec.offset) {
    return absl::InvalidArgumentError(absl::StrCat("region [", spec.offset, ", ", spec.offset,
                                                   " + ", spec.size, ") lies outside the ",
                                                   available, "-byte allocation"));
  }
  char header[kRegionHeaderBytes];
  if (cudaError_t err = cudaMemcpy(header, memory->data(), sizeof(header), cudaMemcpyDeviceToHost);
      err != cudaSuccess) {
    return absl::InternalError(CudaMessage(err, "reading the region header"));
  }
  if (absl::Status st = CheckRegionHeader(header, spec.key); !st.ok()) return st;
  return memory;
}

}  // namespace

absl::StatusOr<std::unique_ptr<MappedMemory>> MapCudaRegion(const RegionSpec& spec, int device,
                                                            absl::string_view shm_name_prefix) {
  if (cudaError_t err = cudaSetDevice(device); err != cudaSuccess) {
    return absl::InternalError(CudaMessage(err, "cudaSetDevice"));
  }
  if (spec.kind == RegionKind::kCudaIpc) return OpenIpc(spec, device);
  absl::StatusOr<std::unique_ptr<SharedMemoryMapping>> mapping =
      MapSharedMemory(spec, shm_name_prefix);
  if (!mapping.ok()) return mapping.status();
  if (cudaError_t err =
          cudaHostRegister((*mapping)->map_base(), static_cast<size_t>((*mapping)->map_bytes()),
                           cudaHostRegisterDefault);
      err != cudaSuccess) {
    cudaGetLastError();
    return absl::ResourceExhaustedError(CudaMessage(err, "cudaHostRegister of the region"));
  }
  return std::make_unique<PinnedSharedMemory>(*std::move(mapping));
}

}  // namespace attn
