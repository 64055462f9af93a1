#include "server/backends/backend_factory.h"

#include "server/backends/cpu_backend.h"
#include "server/backends/fault_injection.h"
#if ATTN_HAVE_CUDA
#include "server/backends/cuda_backend.h"
#endif

namespace attn {

namespace {

absl::StatusOr<std::unique_ptr<Backend>> CreateDeviceBackend(
    const BackendOptions& options, std::function<void(const absl::Status&)> on_fatal_error) {
#if ATTN_HAVE_CUDA
  if (options.kind == "cuda" || (options.kind == "auto" && CudaDeviceCount() > 0)) {
    CudaBackendOptions cuda;
    cuda.single_stream = options.cuda_single_stream;
    cuda.direct_output_min_bytes = options.cuda_direct_output_min_bytes;
    cuda.output_chunk_bytes = options.cuda_output_chunk_bytes;
    cuda.on_fatal_error = std::move(on_fatal_error);
    return CreateCudaBackend(std::move(cuda));
  }
#else
  (void)on_fatal_error;  // the CPU backend has no fatal errors
  if (options.kind == "cuda") {
    return absl::UnavailableError("this build has no CUDA backend (nvcc was not found)");
  }
#endif
  return CreateCpuBackend(options.cpu_threads);
}

}  // namespace

absl::StatusOr<std::unique_ptr<Backend>> CreateBackend(
    const BackendOptions& options, std::function<void(const absl::Status&)> on_fatal_error) {
  absl::StatusOr<std::unique_ptr<Backend>> backend = CreateDeviceBackend(options, on_fatal_error);
  if (!backend.ok() || options.inject_fault.empty()) return backend;
  absl::StatusOr<FaultPlan> plan = ParseFaultPlan(options.inject_fault);
  if (!plan.ok()) return plan.status();
  return InjectFaults(*std::move(backend), *plan, std::move(on_fatal_error));
}

}  // namespace attn
