// Host-side helpers the kernel families share for launching and describing their kernels.
#pragma once

#include <cuda_runtime_api.h>

#include "kernels/common/cuda_check.h"
#include "kernels/cuda_attention.h"

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

}  // namespace attn::cuda
