// Appending new tokens' K/V (GQA) or ckv/kpe (MLA) into their page slots: one warp per new row,
// 16-byte copies. Row r of sequence b is token kv_len - q_len + (r - q_begin) of that sequence.
#include <cuda_runtime.h>

#include "kernels/cuda/common/cuda_check.h"
#include "kernels/cuda/api.h"

namespace attn::cuda {
namespace {

constexpr int kThreads = 256;
constexpr int kRowsPerBlock = kThreads / 32;

// The sequence of query row `row`: the last b with qo_indptr[b] <= row (decode: row itself).
__device__ int SequenceOfRow(const PagedBatch& batch, int row) {
  if (batch.qo_indptr == nullptr) return row;
  int lo = 0, hi = batch.batch_size - 1;
  while (lo < hi) {
    const int mid = (lo + hi + 1) / 2;
    if (batch.qo_indptr[mid] <= row) lo = mid; else hi = mid - 1;
  }
  return lo;
}

// Where token `pos` of the sequence lives: page and slot.
__device__ int64_t TokenSlot(const PagedBatch& batch, const SeqExtent& seq, int page_size,
                             int pos) {
  const int page = batch.kv_indices[seq.page_begin + pos / page_size];
  return int64_t{page} * page_size + pos % page_size;
}

__device__ void CopyRow(bf16* dst, const bf16* src, int elems, int lane) {
  for (int i = lane * 8; i < elems; i += 32 * 8) {
    *reinterpret_cast<uint4*>(dst + i) = *reinterpret_cast<const uint4*>(src + i);
  }
}

__global__ void __launch_bounds__(kThreads) GqaAppendKernel(const GqaParams p) {
  const int row = blockIdx.x * kRowsPerBlock + threadIdx.x / 32;
  if (row >= p.batch.total_q) return;
  const int lane = threadIdx.x % 32;
  const GqaCache& c = p.cache;
  const int b = SequenceOfRow(p.batch, row);
  const SeqExtent seq = GetSeqExtent(p.batch, c.page_size, b);
  const int pos = seq.kv_len - seq.q_len + (row - seq.q_begin);
  const int64_t slot = TokenSlot(p.batch, seq, c.page_size, pos);
  const int64_t page = slot / c.page_size, in_page = slot % c.page_size;
  bf16* k = c.data + seq.layer * c.LayerStride() + page * c.PageStride() + in_page * c.TokenStride();
  const int elems = static_cast<int>(c.TokenStride());
  CopyRow(k, p.k_new + int64_t{row} * elems, elems, lane);
  CopyRow(k + c.page_size * c.TokenStride(), p.v_new + int64_t{row} * elems, elems, lane);
}

__global__ void __launch_bounds__(kThreads) MlaAppendKernel(const MlaParams p) {
  const int row = blockIdx.x * kRowsPerBlock + threadIdx.x / 32;
  if (row >= p.batch.total_q) return;
  const int lane = threadIdx.x % 32;
  const MlaCache& c = p.cache;
  const int b = SequenceOfRow(p.batch, row);
  const SeqExtent seq = GetSeqExtent(p.batch, c.page_size, b);
  const int pos = seq.kv_len - seq.q_len + (row - seq.q_begin);
  bf16* dst = c.data + seq.layer * c.LayerStride() +
              TokenSlot(p.batch, seq, c.page_size, pos) * kMlaTokenDim;
  CopyRow(dst, p.ckv_new + int64_t{row} * kMlaCkvDim, kMlaCkvDim, lane);
  CopyRow(dst + kMlaCkvDim, p.kpe_new + int64_t{row} * kMlaKpeDim, kMlaKpeDim, lane);
}

int Blocks(int rows) { return (rows + kRowsPerBlock - 1) / kRowsPerBlock; }

}  // namespace

cudaError_t GqaAppendKv(const GqaParams& p, cudaStream_t stream) {
  if (p.k_new == nullptr || p.batch.total_q == 0) return cudaSuccess;
  GqaAppendKernel<<<Blocks(p.batch.total_q), kThreads, 0, stream>>>(p);
  ATTN_CUDA_RETURN_IF_LAUNCH_FAILED();
  return cudaSuccess;
}

cudaError_t MlaAppendKv(const MlaParams& p, cudaStream_t stream) {
  if (p.ckv_new == nullptr || p.batch.total_q == 0) return cudaSuccess;
  MlaAppendKernel<<<Blocks(p.batch.total_q), kThreads, 0, stream>>>(p);
  ATTN_CUDA_RETURN_IF_LAUNCH_FAILED();
  return cudaSuccess;
}

}  // namespace attn::cuda
