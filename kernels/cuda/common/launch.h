// Helpers the kernel families share: launching and describing their kernels (host) and finding a
// CTA's work (device).
#pragma once

#include <cuda_runtime.h>

#include "kernels/cuda/common/cuda_check.h"
#include "kernels/cuda/api.h"

namespace attn::cuda {

// Lets `kernel` use `smem_bytes` of dynamic shared memory (beyond the default 48 KiB).
template <typename Kernel>
cudaError_t AllowSharedMemory(Kernel kernel, int smem_bytes) {
  return cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem_bytes);
}

// Fills the tile shape and the occupancy of `kernel` (launched with `threads` and `smem_bytes`).
template <typename Kernel>
cudaError_t DescribeKernel(Kernel kernel, int threads, int smem_bytes, int block_m, int block_n,
                           KernelTiling* tiling) {
  ATTN_CUDA_RETURN_IF_ERROR(AllowSharedMemory(kernel, smem_bytes));
  tiling->block_m = block_m;
  tiling->block_n = block_n;
  return cudaOccupancyMaxActiveBlocksPerMultiprocessor(&tiling->ctas_per_sm, kernel, threads,
                                                       smem_bytes);
}

// The current device's compute capability major version (9: Hopper).
inline cudaError_t CurrentComputeMajor(int* major) {
  int device = 0;
  ATTN_CUDA_RETURN_IF_ERROR(cudaGetDevice(&device));
  return cudaDeviceGetAttribute(major, cudaDevAttrComputeCapabilityMajor, device);
}

// Launches over (work item, KV head) pairs use a 1-D grid in item-major order: the CTAs of one
// item's heads are adjacent, so the GPU starts items in the planner's longest-first order across
// all heads. (A grid of (items, heads) starts each head's items from the longest again, leaving
// the last head's longest items for the tail: a 4096-token causal prefill with 32/8 heads ran
// 610 us that way and 513 us this way on H200, bench/RESULTS.md.)
inline dim3 ItemHeadGrid(int num_items, int num_heads) {
  return dim3(static_cast<unsigned>(num_items) * static_cast<unsigned>(num_heads));
}

struct ItemHead {
  int item;
  int head;
};

__device__ __forceinline__ ItemHead CurrentItemHead(int num_heads) {
  return {static_cast<int>(blockIdx.x) / num_heads, static_cast<int>(blockIdx.x) % num_heads};
}

// Programmatic dependent launch (sm_90+; no-ops on older devices, where a dependent launch runs
// after the grid before it as any other). A grid calls TriggerDependentLaunch to let the next
// grid on its stream, when launched with cudaLaunchAttributeProgrammaticStreamSerialization,
// start once every CTA of this one has triggered or exited; that grid calls WaitForPrimaryGrid
// before it reads anything the grid before it writes, which returns once that grid has completed
// and its writes are visible.
__device__ __forceinline__ void TriggerDependentLaunch() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.launch_dependents;\n" ::: "memory");
#endif
}

__device__ __forceinline__ void WaitForPrimaryGrid() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;\n" ::: "memory");
#endif
}

}  // namespace attn::cuda
