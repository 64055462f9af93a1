// Split-KV merge: combines the float32 partial (output, lse) rows of the chunks a query token saw
// into its final bf16 output and base-2 lse:
//   lse = log2(sum_s 2^lse_s),  out = sum_s 2^(lse_s - lse) * out_s.
#include <cuda_bf16.h>

#include <algorithm>

#include "kernels/cuda/common/cuda_check.h"
#include "kernels/cuda/common/math.cuh"
#include "kernels/cuda/common/softmax_state.cuh"
#include "kernels/cuda/launchers.h"

namespace attn::cuda {
namespace {

constexpr int kMaxThreads = 128;

// One CTA per (merged token, head). The chunk weights 2^(lse_s - lse) go through shared memory;
// then each thread owns 4 output columns and sums the chunks' rows.
__global__ void __launch_bounds__(kMaxThreads)
    MergeStatesKernel(const MergeRow* __restrict__ merges, const float* __restrict__ partial_out,
                      const float* __restrict__ partial_lse, int num_heads, int out_dim,
                      __nv_bfloat16* __restrict__ out, float* __restrict__ lse) {
  extern __shared__ float s_weight[];  // [num_splits]
  __shared__ float s_reduce[kMaxThreads / 32];
  const MergeRow m = merges[blockIdx.x];
  const int head = blockIdx.y, tid = threadIdx.x, lane = tid % 32, warp = tid / 32;
  const int warps = blockDim.x / 32;
  const int64_t first = int64_t{m.partial_row} + head;

  // Block-wide max, then sum, of the chunks' lse (log2 units).
  auto reduce = [&](float v, bool is_max) {
    for (int o = 16; o > 0; o /= 2) {
      const float other = __shfl_xor_sync(0xffffffffu, v, o);
      v = is_max ? fmaxf(v, other) : v + other;
    }
    __syncthreads();  // s_reduce may still be read from the previous reduction
    if (lane == 0) s_reduce[warp] = v;
    __syncthreads();
    v = s_reduce[0];
    for (int w = 1; w < warps; ++w) v = is_max ? fmaxf(v, s_reduce[w]) : v + s_reduce[w];
    return v;
  };
  float local = -INFINITY;
  for (int s = tid; s < m.num_splits; s += blockDim.x) {
    s_weight[s] = partial_lse[first + int64_t{s} * m.split_stride];
    local = fmaxf(local, s_weight[s]);
  }
  const float max_lse = reduce(local, true);
  const float base = ExpBase(max_lse);
  local = 0.f;
  for (int s = tid; s < m.num_splits; s += blockDim.x) {
    s_weight[s] = Exp2(s_weight[s] - base);
    local += s_weight[s];
  }
  const float sum = reduce(local, false);  // its barriers also publish s_weight
  // The contract's rule for the merged row, with "sees keys" = the token has a chunk. fmaxf above
  // drops a NaN chunk lse, but its weight 2^(NaN - base) is NaN, and so is a +inf chunk's
  // 2^(inf - inf): either makes sum NaN. Chunks that are all -inf leave max_lse -inf and sum 0.
  const bool sees_keys = m.num_splits > 0;
  const float inv = InverseSum(sees_keys, max_lse, sum);

  for (int c = tid * 4; c < out_dim; c += blockDim.x * 4) {
    float4 acc = make_float4(0.f, 0.f, 0.f, 0.f);
#pragma unroll 4
    for (int s = 0; s < m.num_splits; ++s) {
      const float w = s_weight[s];
      const float4 v = *reinterpret_cast<const float4*>(
          partial_out + (first + int64_t{s} * m.split_stride) * out_dim + c);
      acc.x += w * v.x;
      acc.y += w * v.y;
      acc.z += w * v.z;
      acc.w += w * v.w;
    }
    __nv_bfloat16* dst = out + (int64_t{m.out_row} * num_heads + head) * out_dim + c;
    *reinterpret_cast<__nv_bfloat162*>(dst) = __floats2bfloat162_rn(acc.x * inv, acc.y * inv);
    *reinterpret_cast<__nv_bfloat162*>(dst + 2) = __floats2bfloat162_rn(acc.z * inv, acc.w * inv);
  }
  if (lse != nullptr && tid == 0) {
    lse[int64_t{m.out_row} * num_heads + head] = FinalLse(sees_keys, max_lse, sum);
  }
}

}  // namespace

cudaError_t LaunchMergeStates(const DevicePlan& plan, int num_heads, int out_dim, bf16* out,
                              float* lse, cudaStream_t stream) {
  if (plan.num_merges == 0) return cudaSuccess;
  // One thread per 4 columns (32 for head_dim 128, 128 for MLA's 512); one weight per chunk.
  const int threads = std::min(kMaxThreads, std::max(32, out_dim / 4));
  const dim3 grid(plan.num_merges, num_heads);
  MergeStatesKernel<<<grid, threads, plan.max_splits * sizeof(float), stream>>>(
      plan.merges, plan.partial_out, plan.partial_lse, num_heads, out_dim,
      reinterpret_cast<__nv_bfloat16*>(out), lse);
  ATTN_CUDA_RETURN_IF_LAUNCH_FAILED();
  return cudaSuccess;
}

}  // namespace attn::cuda
