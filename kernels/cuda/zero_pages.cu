// Zeroing listed pages of a pool: what the server does to a page before it hands it to a new
// owner. One launch for the whole list, a CTA per (listed page, layer), 16-byte stores.
#include <cuda_runtime.h>

#include "kernels/cuda/api.h"
#include "kernels/cuda/common/cuda_check.h"

namespace attn::cuda {
namespace {

constexpr int kThreads = 256;

__global__ void __launch_bounds__(kThreads)
    ZeroPagesKernel(uint4* storage, int64_t page_vecs, int64_t layer_vecs, const int32_t* pages) {
  uint4* page = storage + blockIdx.y * layer_vecs + int64_t{pages[blockIdx.x]} * page_vecs;
  for (int64_t i = threadIdx.x; i < page_vecs; i += kThreads) page[i] = make_uint4(0, 0, 0, 0);
}

}  // namespace

cudaError_t ZeroPages(void* storage, int num_layers, int num_pages, int64_t page_bytes,
                      const int32_t* pages, int num_listed, cudaStream_t stream) {
  if (num_listed == 0) return cudaSuccess;
  if (page_bytes % sizeof(uint4) != 0 || reinterpret_cast<uintptr_t>(storage) % sizeof(uint4) ||
      num_layers < 1 || num_layers > 65535 || num_listed < 0) {
    return cudaErrorInvalidValue;
  }
  const int64_t page_vecs = page_bytes / static_cast<int64_t>(sizeof(uint4));
  const dim3 grid(static_cast<unsigned>(num_listed), static_cast<unsigned>(num_layers));
  ZeroPagesKernel<<<grid, kThreads, 0, stream>>>(static_cast<uint4*>(storage), page_vecs,
                                                 page_vecs * num_pages, pages);
  ATTN_CUDA_RETURN_IF_LAUNCH_FAILED();
  return cudaSuccess;
}

}  // namespace attn::cuda
