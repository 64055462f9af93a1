// Split-KV merge: combines the float32 partial (output, lse) rows of the chunks a query token saw
// into its final bf16 output and base-2 lse:
//   lse = log2(sum_s 2^lse_s),  out = sum_s 2^(lse_s - lse) * out_s.
//
// Two kernels with one arithmetic (ChunkWeights, MergedRow), one CTA per (merged token, head):
//  - MergeStatesWideKernel (MergeKind::kWideDependent) follows the split launches of the default
//    GQA decode (kGqaDecodeAdaptive), whose 16-row CTAs leave a long sequence many chunks: it has
//    every chunk row of a CTA in flight at once. On the H200 (kernel_bench, b1 x 16384, 32 chunks)
//    it took 2.8 us off the row kernel, and 1.0 us more as a programmatic dependent launch, which
//    starts while the attention's last CTAs run.
//  - MergeStatesKernel (MergeKind::kRows) follows prefills, short prefills, MLA and decode
//    variants 0 and 1. MLA's 512 columns would leave the wide kernel one group, the row kernel's
//    shape; prefills were not measured with it, and 0 and 1 stay as bench/RESULTS.md measured
//    them.
#include <cuda_bf16.h>

#include <algorithm>

#include "kernels/cuda/common/cuda_check.h"
#include "kernels/cuda/common/launch.h"
#include "kernels/cuda/common/math.cuh"
#include "kernels/cuda/common/softmax_state.cuh"
#include "kernels/cuda/launchers.h"

namespace attn::cuda {
namespace {

constexpr int kMaxThreads = 128;

// One merged (token, head) row: its chunks' largest lse and the sum of their weights, finished by
// the contract's rule, with "sees keys" = the token has a chunk. fmaxf in ChunkWeights drops a NaN
// chunk lse, but its weight 2^(NaN - base) is NaN, and so is a +inf chunk's 2^(inf - inf): either
// makes sum NaN. Chunks that are all -inf leave max_lse -inf and sum 0.
struct MergedRow {
  int64_t index;  // out_row * num_heads + head
  bool sees_keys;
  float max_lse, sum;

  // Writes columns [c, c + 4) of the output row from their weighted sum over the chunks.
  __device__ __forceinline__ void StoreColumns(__nv_bfloat16* out, int out_dim, int c,
                                               const float4& acc) const {
    const float inv = InverseSum(sees_keys, max_lse, sum);
    __nv_bfloat16* dst = out + index * out_dim + c;
    *reinterpret_cast<__nv_bfloat162*>(dst) = __floats2bfloat162_rn(acc.x * inv, acc.y * inv);
    *reinterpret_cast<__nv_bfloat162*>(dst + 2) = __floats2bfloat162_rn(acc.z * inv, acc.w * inv);
  }

  __device__ __forceinline__ void StoreLse(float* lse) const {
    if (lse != nullptr) lse[index] = FinalLse(sees_keys, max_lse, sum);
  }
};

__device__ __forceinline__ void AddScaled(float4& acc, float w, const float4& x) {
  acc.x += w * x.x;
  acc.y += w * x.y;
  acc.z += w * x.z;
  acc.w += w * x.w;
}

// Writes the weights 2^(lse_s - max_lse) of the chunks of merge row m's head at workspace row
// `first` into s_weight[0, m.num_splits) (every thread of the CTA takes part; its barriers
// publish them) and returns the merged state. s_reduce: kMaxThreads / 32 floats. kL2Only: the lse
// are read through L2 alone (ld.global.cg), never the non-coherent path: for a kernel that starts
// before the grid writing them has ended (MergeKind::kWideDependent).
template <bool kL2Only>
__device__ __forceinline__ MergedRow ChunkWeights(const MergeRow& m, int head, int num_heads,
                                                  int64_t first,
                                                  const float* __restrict__ partial_lse,
                                                  float* s_weight, float* s_reduce) {
  const int tid = threadIdx.x, lane = tid % 32, warp = tid / 32;
  const int warps = blockDim.x / 32;
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
    const float* src = partial_lse + first + int64_t{s} * m.split_stride;
    s_weight[s] = kL2Only ? __ldcg(src) : *src;
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
  return {int64_t{m.out_row} * num_heads + head, m.num_splits > 0, max_lse, sum};
}

// MergeKind::kRows. The chunk weights go through shared memory; then each thread owns 4 output
// columns and sums the chunks' rows, 4 loads in flight at a time.
__global__ void __launch_bounds__(kMaxThreads)
    MergeStatesKernel(const MergeRow* __restrict__ merges, const float* __restrict__ partial_out,
                      const float* __restrict__ partial_lse, int num_heads, int out_dim,
                      __nv_bfloat16* __restrict__ out, float* __restrict__ lse) {
  extern __shared__ float s_weight[];  // [num_splits]
  __shared__ float s_reduce[kMaxThreads / 32];
  const MergeRow m = merges[blockIdx.x];
  const int head = blockIdx.y, tid = threadIdx.x;
  const int64_t first = int64_t{m.partial_row} + head;
  const MergedRow merged =
      ChunkWeights<false>(m, head, num_heads, first, partial_lse, s_weight, s_reduce);
  for (int c = tid * 4; c < out_dim; c += blockDim.x * 4) {
    float4 acc = make_float4(0.f, 0.f, 0.f, 0.f);
#pragma unroll 4
    for (int s = 0; s < m.num_splits; ++s) {
      AddScaled(acc, s_weight[s],
                *reinterpret_cast<const float4*>(
                    partial_out + (first + int64_t{s} * m.split_stride) * out_dim + c));
    }
    merged.StoreColumns(out, out_dim, c, acc);
  }
  if (tid == 0) merged.StoreLse(lse);
}

// MergeKind::kWideDependent: kMaxThreads threads in groups of out_dim / 4, a column quad a
// thread. Group g sums chunks g, g + groups, ..., and loads the rows of its first kWideLoads
// chunks before the weights are known, so that they are in flight with the lse reads: up to
// groups x kWideLoads chunks (32 at head_dim 128) cost one L2 round trip, where MergeStatesKernel
// waits on one per 4 chunks (8 for the 32 chunks of a 16384-key decode, each ~0.5-0.7 us). The
// groups' sums meet in shared memory.
constexpr int kWideLoads = 8;

__global__ void __launch_bounds__(kMaxThreads)
    MergeStatesWideKernel(const MergeRow* __restrict__ merges,
                          const float* __restrict__ partial_out,
                          const float* __restrict__ partial_lse, int num_heads, int out_dim,
                          __nv_bfloat16* __restrict__ out, float* __restrict__ lse) {
  extern __shared__ float4 s_dynamic[];  // [kMaxThreads] the groups' sums, [num_splits] weights
  __shared__ float s_reduce[kMaxThreads / 32];
  float4* s_sums = s_dynamic;
  float* s_weight = reinterpret_cast<float*>(s_dynamic + kMaxThreads);
  // The plan's rows were copied before the attention launch; the partials are the attention's.
  const MergeRow m = merges[blockIdx.x];
  WaitForPrimaryGrid();
  const int head = blockIdx.y, tid = threadIdx.x;
  const int64_t first = int64_t{m.partial_row} + head;
  const int quads = out_dim / 4, groups = blockDim.x / quads;
  const int g = tid / quads, c = (tid % quads) * 4;
  // .cg: written by the grid before, read once; never through a possibly older L1 line.
  auto row = [&](int s) {
    return __ldcg(reinterpret_cast<const float4*>(
        partial_out + (first + int64_t{s} * m.split_stride) * out_dim + c));
  };
  float4 v[kWideLoads];
#pragma unroll
  for (int i = 0; i < kWideLoads; ++i) {
    const int s = g + i * groups;
    v[i] = s < m.num_splits ? row(s) : make_float4(0.f, 0.f, 0.f, 0.f);
  }
  const MergedRow merged =
      ChunkWeights<true>(m, head, num_heads, first, partial_lse, s_weight, s_reduce);
  float4 acc = make_float4(0.f, 0.f, 0.f, 0.f);
#pragma unroll
  for (int i = 0; i < kWideLoads; ++i) {
    const int s = g + i * groups;
    if (s < m.num_splits) AddScaled(acc, s_weight[s], v[i]);
  }
#pragma unroll 4
  for (int s = g + kWideLoads * groups; s < m.num_splits; s += groups) {
    AddScaled(acc, s_weight[s], row(s));
  }
  s_sums[tid] = acc;
  __syncthreads();
  if (tid < quads) {
    float4 total = s_sums[tid];
    for (int k = 1; k < groups; ++k) AddScaled(total, 1.f, s_sums[k * quads + tid]);
    merged.StoreColumns(out, out_dim, c, total);
  }
  if (tid == 0) merged.StoreLse(lse);
}

}  // namespace

cudaError_t LaunchMergeStates(const DevicePlan& plan, int num_heads, int out_dim, bf16* out,
                              float* lse, cudaStream_t stream, MergeKind kind) {
  if (plan.num_merges == 0) return cudaSuccess;
  cudaLaunchConfig_t config = {};
  config.gridDim = dim3(plan.num_merges, num_heads);
  config.stream = stream;
  cudaLaunchAttribute dependent = {};
  dependent.id = cudaLaunchAttributeProgrammaticStreamSerialization;
  dependent.val.programmaticStreamSerializationAllowed = 1;
  auto* kernel = MergeStatesKernel;
  // The wide kernel's groups tile its threads with whole rows (head_dim 64, 128, 256).
  if (kind == MergeKind::kWideDependent && out_dim % 4 == 0 && kMaxThreads % (out_dim / 4) == 0) {
    kernel = MergeStatesWideKernel;
    config.blockDim = dim3(kMaxThreads);
    config.dynamicSmemBytes = kMaxThreads * sizeof(float4) + plan.max_splits * sizeof(float);
    // Programmatic dependent launches exist from compute capability 9.0; before it the merge
    // waits for the attention as any launch does.
    int major = 0;
    ATTN_CUDA_RETURN_IF_ERROR(CurrentComputeMajor(&major));
    if (major >= 9) {
      config.attrs = &dependent;
      config.numAttrs = 1;
    }
  } else {
    // One thread per 4 columns (32 for head_dim 128, 128 for MLA's 512); one weight per chunk.
    config.blockDim = dim3(std::min(kMaxThreads, std::max(32, out_dim / 4)));
    config.dynamicSmemBytes = plan.max_splits * sizeof(float);
  }
  return cudaLaunchKernelEx(&config, kernel, plan.merges,
                            static_cast<const float*>(plan.partial_out),
                            static_cast<const float*>(plan.partial_lse), num_heads, out_dim,
                            reinterpret_cast<__nv_bfloat16*>(out), lse);
}

}  // namespace attn::cuda
