#include "server/backends/cuda_backend.h"

#include <cuda_runtime_api.h>

#include <algorithm>
#include <atomic>
#include <mutex>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "kernels/cuda/api.h"
#include "kernels/cuda/launch_plan.h"
#include "server/backends/merged_batch.h"

namespace attn {
namespace {

// Errors after which the context is unusable: every later call fails too.
bool IsSticky(cudaError_t err) {
  switch (err) {
    case cudaErrorIllegalAddress:
    case cudaErrorLaunchFailure:
    case cudaErrorIllegalInstruction:
    case cudaErrorMisalignedAddress:
    case cudaErrorInvalidAddressSpace:
    case cudaErrorInvalidPc:
    case cudaErrorHardwareStackError:
    case cudaErrorAssert:
    case cudaErrorUnknown:
    case cudaErrorECCUncorrectable:
      return true;
    default:
      return false;
  }
}

// Shared by the backend and its lanes: the context's health and the fatal-error callback.
class DeviceState {
 public:
  explicit DeviceState(std::function<void(const absl::Status&)> on_fatal)
      : on_fatal_(std::move(on_fatal)) {}

  // OK, or the error to return for `err` from `what` (sticky errors poison the state).
  absl::Status Check(cudaError_t err, const char* what) {
    if (err == cudaSuccess) return poisoned_.load() ? Poisoned() : absl::OkStatus();
    const std::string message = absl::StrCat("CUDA error in ", what, ": ", cudaGetErrorName(err),
                                             " (", cudaGetErrorString(err), ")");
    if (err == cudaErrorMemoryAllocation) return absl::ResourceExhaustedError(message);
    if (IsSticky(err) && !poisoned_.exchange(true)) {
      const absl::Status fatal = absl::InternalError(message);
      if (on_fatal_) on_fatal_(fatal);
      return fatal;
    }
    return absl::InternalError(message);
  }

  absl::Status Poisoned() const {
    return absl::InternalError("the CUDA context failed earlier; the server is restarting");
  }
  bool poisoned() const { return poisoned_.load(); }

 private:
  std::function<void(const absl::Status&)> on_fatal_;
  std::atomic<bool> poisoned_{false};
};

#define RETURN_IF_CUDA_ERROR(state, expr)                             \
  do {                                                                \
    if (absl::Status _st = (state).Check((expr), #expr); !_st.ok()) { \
      return _st;                                                     \
    }                                                                 \
  } while (0)

// A pinned host buffer and a device buffer of the same capacity, grown on demand (growth is
// rare: capacity doubles, so a lane reallocates a handful of times in its life).
class StagingPair {
 public:
  ~StagingPair() { Release(); }
  absl::Status Reserve(size_t bytes, DeviceState& state) {
    if (bytes <= capacity_) return absl::OkStatus();
    Release();
    capacity_ = std::max(bytes, 2 * capacity_);
    RETURN_IF_CUDA_ERROR(state, cudaHostAlloc(&host_, capacity_, cudaHostAllocDefault));
    RETURN_IF_CUDA_ERROR(state, cudaMalloc(&device_, capacity_));
    return absl::OkStatus();
  }
  char* host() const { return static_cast<char*>(host_); }
  char* device() const { return static_cast<char*>(device_); }

 private:
  void Release() {
    if (host_) cudaFreeHost(host_);
    if (device_) cudaFree(device_);
    host_ = device_ = nullptr;
    capacity_ = 0;
  }
  void* host_ = nullptr;
  void* device_ = nullptr;
  size_t capacity_ = 0;
};

struct CudaPool {
  PoolGeometry geometry;
  void* storage = nullptr;  // one allocation for every layer and page
};

class CudaLane final : public Lane {
 public:
  // `shared_stream`: run on it instead of a stream of the lane's own.
  CudaLane(const CudaPool& pool, Op op, DeviceState& state, int device, int64_t workspace_bytes,
           cudaStream_t shared_stream)
      : pool_(pool),
        op_(op),
        state_(state),
        device_(device),
        workspace_bytes_(workspace_bytes),
        owns_stream_(shared_stream == nullptr),
        stream_(shared_stream) {}

  ~CudaLane() override {
    if (workspace_) cudaFree(workspace_);
    if (start_) cudaEventDestroy(start_);
    if (stop_) cudaEventDestroy(stop_);
    if (stream_ && owns_stream_) cudaStreamDestroy(stream_);
  }

  absl::Status Init() {
    if (owns_stream_) {
      int least = 0, greatest = 0;
      RETURN_IF_CUDA_ERROR(state_, cudaDeviceGetStreamPriorityRange(&least, &greatest));
      // Numerically lower is higher priority: decodes go first.
      RETURN_IF_CUDA_ERROR(state_,
                           cudaStreamCreateWithPriority(&stream_, cudaStreamNonBlocking,
                                                        op_ == Op::kDecode ? greatest : least));
    }
    RETURN_IF_CUDA_ERROR(state_, cudaEventCreate(&start_));
    RETURN_IF_CUDA_ERROR(state_, cudaEventCreate(&stop_));
    RETURN_IF_CUDA_ERROR(state_, cudaMalloc(&workspace_, workspace_bytes_));
    const PoolGeometry& g = pool_.geometry;
    const bool decode = op_ == Op::kDecode;
    RETURN_IF_CUDA_ERROR(state_, g.kind == PoolKind::kGqa
                                     ? cuda::GetGqaTiling(g.head_dim, decode, &tiling_)
                                     : cuda::GetMlaTiling(g.num_qo_heads, decode, &tiling_));
    const int64_t out_dim = g.kind == PoolKind::kGqa ? g.head_dim : kMlaCkvDim;
    max_partial_rows_ = workspace_bytes_ / ((out_dim + 1) * int64_t{sizeof(float)});
    return absl::OkStatus();
  }

  absl::StatusOr<LaunchStats> Run(absl::Span<AttentionCall* const> calls) override {
    if (state_.poisoned()) return state_.Poisoned();
    RETURN_IF_CUDA_ERROR(state_, cudaSetDevice(device_));  // the current device is per thread
    LaunchStats stats;
    StageTimer timer;
    const PoolGeometry& g = pool_.geometry;
    merged_.Build(calls);
    // Plan on the host from the merged page table; the plan lays out the staging buffers.
    cuda::LaunchOptions options;
    options.append = calls.front()->appends();
    options.lse = std::any_of(calls.begin(), calls.end(),
                              [](const AttentionCall* c) { return c->return_lse; });
    options.sm_scale = calls.front()->sm_scale;
    options.tiling = tiling_;
    options.max_partial_rows = max_partial_rows_;
    bf16* storage = static_cast<bf16*>(pool_.storage);
    if (g.kind == PoolKind::kGqa) {
      launch_.PlanGqa(g.GqaView(storage), g.num_qo_heads, merged_.View(op_), options);
    } else {
      launch_.PlanMla(g.MlaView(storage), g.num_qo_heads, merged_.View(op_), options);
    }

    // Inputs: one staging buffer, one copy.
    const cuda::InputLayout& in = launch_.inputs();
    const cuda::RowWidths& w = launch_.widths();
    if (absl::Status st = inputs_.Reserve(in.bytes, state_); !st.ok()) return st;
    char* h = inputs_.host();
    auto rows = [h](const cuda::StagingSection& s) {
      return reinterpret_cast<bf16*>(h + s.offset);
    };
    GatherRows(calls, merged_, &AttentionCall::q, w.q, rows(in.q));
    if (launch_.mla()) GatherRows(calls, merged_, &AttentionCall::q_pe, w.q_pe, rows(in.q_pe));
    if (options.append) {
      GatherRows(calls, merged_, &AttentionCall::k_new, w.k_new, rows(in.k_new));
      GatherRows(calls, merged_, &AttentionCall::v_new, w.v_new, rows(in.v_new));
    }
    launch_.WriteIndices(h);
    // Outputs: out then lse, one buffer, one copy back.
    const cuda::OutputLayout& out = launch_.outputs();
    if (absl::Status st = outputs_.Reserve(out.bytes, state_); !st.ok()) return st;
    RETURN_IF_CUDA_ERROR(state_, launch_.Bind(inputs_.device(), outputs_.device(), workspace_,
                                              static_cast<size_t>(workspace_bytes_)));

    timer.Next(&stats.prepare);
    RETURN_IF_CUDA_ERROR(
        state_, cudaMemcpyAsync(inputs_.device(), h, in.bytes, cudaMemcpyHostToDevice, stream_));
    RETURN_IF_CUDA_ERROR(state_, cudaEventRecord(start_, stream_));
    RETURN_IF_CUDA_ERROR(state_, launch_.Enqueue(stream_));
    RETURN_IF_CUDA_ERROR(state_, cudaEventRecord(stop_, stream_));
    RETURN_IF_CUDA_ERROR(state_, cudaMemcpyAsync(outputs_.host(), outputs_.device(), out.bytes,
                                                 cudaMemcpyDeviceToHost, stream_));
    RETURN_IF_CUDA_ERROR(state_, cudaStreamSynchronize(stream_));
    timer.Next(&stats.execute);

    ScatterOutputs(calls, merged_, outputs_.host() + out.out.offset, w.out * int64_t{sizeof(bf16)},
                   reinterpret_cast<const float*>(outputs_.host() + out.lse.offset),
                   static_cast<int>(w.lse));
    timer.Next(&stats.finish);
    float ms = 0.f;
    RETURN_IF_CUDA_ERROR(state_, cudaEventElapsedTime(&ms, start_, stop_));
    stats.compute = absl::Microseconds(static_cast<int64_t>(ms * 1e3));
    stats.bytes_in = static_cast<int64_t>(in.bytes);
    stats.bytes_out = static_cast<int64_t>(out.bytes);
    return stats;
  }

 private:
  const CudaPool& pool_;
  const Op op_;
  DeviceState& state_;
  const int device_;
  const int64_t workspace_bytes_;
  const bool owns_stream_;
  cudaStream_t stream_ = nullptr;
  cudaEvent_t start_ = nullptr, stop_ = nullptr;
  void* workspace_ = nullptr;
  cuda::KernelTiling tiling_;
  int64_t max_partial_rows_ = 0;  // rows of the workspace
  // Reused across launches.
  MergedBatch merged_;
  cuda::LaunchPlan launch_;
  StagingPair inputs_, outputs_;
};

class CudaBackend final : public Backend {
 public:
  explicit CudaBackend(CudaBackendOptions options)
      : options_(std::move(options)), state_(options_.on_fatal_error) {}

  ~CudaBackend() override {
    for (auto& pool : pools_) cudaFree(pool->storage);
    if (shared_stream_) cudaStreamDestroy(shared_stream_);
  }

  absl::Status Init() {
    RETURN_IF_CUDA_ERROR(state_, cudaSetDevice(options_.device));
    RETURN_IF_CUDA_ERROR(state_, cudaGetDeviceProperties(&props_, options_.device));
    if (options_.single_stream) {
      RETURN_IF_CUDA_ERROR(state_,
                           cudaStreamCreateWithFlags(&shared_stream_, cudaStreamNonBlocking));
    }
    return absl::OkStatus();
  }

  std::string name() const override { return "cuda"; }
  std::string device() const override {
    return absl::StrFormat("%s (sm_%d%d, %d SMs, %.0f GiB)", props_.name, props_.major,
                           props_.minor, props_.multiProcessorCount,
                           props_.totalGlobalMem / double{1 << 30});
  }

  absl::Status AddPool(const PoolGeometry& geometry) override {
    auto pool = std::make_unique<CudaPool>();
    pool->geometry = geometry;
    RETURN_IF_CUDA_ERROR(state_, cudaMalloc(&pool->storage, geometry.TotalBytes()));
    // Zeroed once, so attending over a slot nothing was appended to reads zeros, not garbage.
    RETURN_IF_CUDA_ERROR(state_, cudaMemset(pool->storage, 0, geometry.TotalBytes()));
    pools_.push_back(std::move(pool));
    return absl::OkStatus();
  }

  absl::StatusOr<std::unique_ptr<Lane>> CreateLane(int pool, Op op) override {
    if (pool < 0 || pool >= static_cast<int>(pools_.size())) {
      return absl::InvalidArgumentError(absl::StrCat("no pool number ", pool));
    }
    RETURN_IF_CUDA_ERROR(state_, cudaSetDevice(options_.device));
    auto lane = std::make_unique<CudaLane>(*pools_[pool], op, state_, options_.device,
                                           options_.workspace_bytes, shared_stream_);
    if (absl::Status st = lane->Init(); !st.ok()) return st;
    return std::unique_ptr<Lane>(std::move(lane));
  }

 private:
  CudaBackendOptions options_;
  DeviceState state_;
  cudaDeviceProp props_{};
  cudaStream_t shared_stream_ = nullptr;  // only with options_.single_stream
  std::vector<std::unique_ptr<CudaPool>> pools_;
};

}  // namespace

int CudaDeviceCount() {
  int count = 0;
  return cudaGetDeviceCount(&count) == cudaSuccess ? count : 0;
}

absl::StatusOr<std::unique_ptr<Backend>> CreateCudaBackend(CudaBackendOptions options) {
  if (options.device >= CudaDeviceCount()) {
    return absl::UnavailableError(absl::StrCat("no CUDA device ", options.device));
  }
  auto backend = std::make_unique<CudaBackend>(std::move(options));
  if (absl::Status st = backend->Init(); !st.ok()) return st;
  return std::unique_ptr<Backend>(std::move(backend));
}

}  // namespace attn
