// Appending new tokens' K/V (GQA) or ckv/kpe (MLA) into their page slots: one warp per new row,
// 16-byte copies. Query row r of sequence b goes to token AppendPosition(seq, r - q_begin)
// (kernels/attention.h), addressed through the same PagedRows as the attention kernels' reads.
#include <cuda_runtime.h>

#include "kernels/cuda/api.h"
#include "kernels/cuda/common/call_checks.cuh"
#include "kernels/cuda/common/cuda_check.h"
#include "kernels/cuda/common/paged_kv.cuh"

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
    if (batch.qo_indptr[mid] <= row)
      lo = mid;
    else
      hi = mid - 1;
  }
  return lo;
}

__device__ void CopyRow(bf16* dst, const bf16* src, int elems, int lane) {
  for (int i = lane * 8; i < elems; i += 32 * 8) {
    *reinterpret_cast<uint4*>(dst + i) = *reinterpret_cast<const uint4*>(src + i);
  }
}

// The warp's query row, its sequence and the row's token position.
struct AppendRow {
  int row;
  SeqExtent seq;
  int pos;
};

// Finds the warp's row; false when the warp has none, the row has no slot (q_len > kv_len) or
// its call was refused.
__device__ __forceinline__ bool FindRow(const PagedBatch& batch, int page_size,
                                        const CallChecks& checks, AppendRow* r) {
  r->row = blockIdx.x * kRowsPerBlock + threadIdx.x / 32;
  if (r->row >= batch.total_q) return false;
  if (checks.num_calls > 0 && checks.refused[CallOfRow(checks, r->row)] != 0) return false;
  r->seq = GetSeqExtent(batch, page_size, SequenceOfRow(batch, r->row));
  r->pos = AppendPosition(r->seq, r->row - r->seq.q_begin);
  return r->pos >= 0;
}

__global__ void __launch_bounds__(kThreads)
    GqaAppendKernel(const GqaParams p, const CallChecks checks) {
  AppendRow r;
  if (!FindRow(p.batch, p.cache.page_size, checks, &r)) return;
  // Head 0's K row of the token spans every KV head's K; the V rows follow the page's K block.
  const PagedRowsOf<bf16> rows = GqaKeyRows<bf16>(p.cache, p.batch, r.seq, 0);
  bf16* k = rows.Row(r.pos);
  const int elems = rows.token_stride;
  const int lane = threadIdx.x % 32;
  CopyRow(k, p.k_new + int64_t{r.row} * elems, elems, lane);
  CopyRow(k + GqaValueOffset(p.cache), p.v_new + int64_t{r.row} * elems, elems, lane);
}

__global__ void __launch_bounds__(kThreads)
    MlaAppendKernel(const MlaParams p, const CallChecks checks) {
  AppendRow r;
  if (!FindRow(p.batch, p.cache.page_size, checks, &r)) return;
  bf16* dst = MlaRows<bf16>(p.cache, p.batch, r.seq).Row(r.pos);
  const int lane = threadIdx.x % 32;
  CopyRow(dst, p.ckv_new + int64_t{r.row} * kMlaCkvDim, kMlaCkvDim, lane);
  CopyRow(dst + kMlaCkvDim, p.kpe_new + int64_t{r.row} * kMlaKpeDim, kMlaKpeDim, lane);
}

int Blocks(int rows) { return (rows + kRowsPerBlock - 1) / kRowsPerBlock; }

}  // namespace

cudaError_t GqaAppendKv(const GqaParams& p, const CallChecks& checks, cudaStream_t stream) {
  if (p.k_new == nullptr || p.batch.total_q == 0) return cudaSuccess;
  GqaAppendKernel<<<Blocks(p.batch.total_q), kThreads, 0, stream>>>(p, checks);
  ATTN_CUDA_RETURN_IF_LAUNCH_FAILED();
  return cudaSuccess;
}

cudaError_t MlaAppendKv(const MlaParams& p, const CallChecks& checks, cudaStream_t stream) {
  if (p.ckv_new == nullptr || p.batch.total_q == 0) return cudaSuccess;
  MlaAppendKernel<<<Blocks(p.batch.total_q), kThreads, 0, stream>>>(p, checks);
  ATTN_CUDA_RETURN_IF_LAUNCH_FAILED();
  return cudaSuccess;
}

}  // namespace attn::cuda
