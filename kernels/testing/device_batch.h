// Runs host-built batches (paged_batch_builder.h) through the CUDA entry points with the same
// launch binding as the server's CUDA backend (kernels/cuda/launch_plan.h): plan on the host, one
// staging buffer of inputs, page table and plan copied to the device, append + attention (+
// split-KV merge) on a stream. Used by kernel_tests and kernel_bench.
#pragma once

#include <cuda_runtime_api.h>

#include <cstddef>
#include <memory>
#include <vector>

#include "kernels/cuda/api.h"
#include "kernels/cuda/launch_plan.h"
#include "kernels/cuda/plan.h"
#include "kernels/testing/paged_batch_builder.h"

namespace attn::testing {

// cudaMalloc'd bytes, freed on destruction.
class DeviceBuffer {
 public:
  DeviceBuffer() = default;
  ~DeviceBuffer();
  DeviceBuffer(const DeviceBuffer&) = delete;
  DeviceBuffer& operator=(const DeviceBuffer&) = delete;

  cudaError_t Allocate(size_t bytes);
  // Allocates and copies `n` elements from host.
  template <typename T>
  cudaError_t Upload(const T* host, size_t n) {
    cudaError_t err = Allocate(n * sizeof(T));
    if (err != cudaSuccess || n == 0) return err;
    return cudaMemcpy(ptr_, host, n * sizeof(T), cudaMemcpyHostToDevice);
  }
  template <typename T>
  cudaError_t Upload(const std::vector<T>& host) {
    return Upload(host.data(), host.size());
  }
  template <typename T>
  T* get() const {
    return static_cast<T*>(ptr_);
  }
  size_t bytes() const { return bytes_; }

 private:
  void* ptr_ = nullptr;
  size_t bytes_ = 0;
};

// Workspace rows a test or benchmark plans with (float32 rows of up to 512 columns: 1 GiB).
inline constexpr int64_t kTestPartialRows = int64_t{1} << 19;

// Planner settings a benchmark may override (0 keeps the kernel's own).
struct PlanOverrides {
  int min_chunk_len = 0;
  double target_waves = 0;
  double waves_before_split = 0;  // LaunchOptions::waves_before_split
  double no_split_fill = 0;       // LaunchOptions::no_split_fill
  size_t output_chunk_bytes = 0;  // LaunchOptions::output_chunk_bytes
};

// One batch resident on the device, runnable many times.
class DeviceBatch {
 public:
  // Copies `host` (GQA or MLA) to the device and plans it for the current device.
  // `variant`: the GQA prefill tile shape (KernelTiling::variant; -1 for the default).
  static cudaError_t Create(GqaHostBatch& host, std::unique_ptr<DeviceBatch>* out, int variant = -1,
                            PlanOverrides overrides = {});
  // `variant`: the MLA kernel (KernelTiling::variant; -1 for the default).
  static cudaError_t Create(MlaHostBatch& host, std::unique_ptr<DeviceBatch>* out, int variant = -1,
                            PlanOverrides overrides = {});

  // Append (when the batch has new K/V) and attention, enqueued on `stream`.
  cudaError_t Run(cudaStream_t stream) { return launch_.Enqueue(stream); }
  // Attention alone (what a benchmark times once the cache is filled).
  cudaError_t RunAttention(cudaStream_t stream) { return launch_.EnqueueAttention(stream); }
  // As Run, with the attention launched chunk by chunk (PlanOverrides::output_chunk_bytes), in
  // `order` (indices into output_chunks(); empty: in row order).
  cudaError_t RunChunked(cudaStream_t stream, const std::vector<int>& order = {});
  const std::vector<cuda::OutputChunk>& output_chunks() const { return launch_.output_chunks(); }
  // Fills the outputs with `byte`: by default NaN-poisoned again (0xff bytes are NaN in bf16 and
  // float32); a test that expects NaN fills them with a finite pattern instead.
  cudaError_t PoisonOutputs(cudaStream_t stream, int byte = 0xff);

  // Copies out, lse and the cache back (synchronizes).
  cudaError_t Download(std::vector<bf16>* out, std::vector<float>* lse,
                       std::vector<bf16>* cache) const;

  const AttentionPlan& plan() const { return launch_.plan(); }

 private:
  DeviceBatch() = default;
  // Stages the batch's tensors (host arrays of widths() elements per row; null: absent) and the
  // plan's indices, copies them to the device and binds the launch.
  cudaError_t Stage(const void* q, const void* q_pe, const void* k_new, const void* v_new);

  cuda::LaunchPlan launch_;
  DeviceBuffer cache_, inputs_, outputs_, workspace_;
};

// True when a CUDA device is usable (tests skip otherwise).
bool CudaDeviceAvailable();

}  // namespace attn::testing
