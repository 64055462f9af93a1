// Internal launchers behind kernels/cuda/api.h (one per kernel family and file).
#pragma once

#include <cuda_runtime_api.h>

#include "kernels/attention.h"
#include "kernels/cuda/api.h"

namespace attn::cuda {

// `variant` picks among the tile shapes of a head_dim (-1: the default); see gqa_prefill.cu.
cudaError_t LaunchGqaPrefill(const GqaParams& p, const DevicePlan& plan, cudaStream_t stream,
                             int variant);
cudaError_t GqaPrefillTiling(int head_dim, int variant, KernelTiling* tiling);
cudaError_t LaunchGqaDecode(const GqaParams& p, const DevicePlan& plan, cudaStream_t stream);
cudaError_t GqaDecodeTiling(int head_dim, KernelTiling* tiling);

cudaError_t LaunchMla(const MlaParams& p, const DevicePlan& plan, cudaStream_t stream);
cudaError_t MlaTiling(int num_heads, bool decode, KernelTiling* tiling);

// Which split-KV merge kernel runs (merge_states.cu says which launch uses which and why).
enum class MergeKind {
  kRows,  // a CTA per (token, head) row, a thread per column quad summing every chunk
  // A CTA per row in groups of threads, each group summing a share of the chunks, launched as a
  // programmatic dependent of the kernel before it on the stream (sm_90+): it may start once that
  // kernel triggers (TriggerDependentLaunch), and waits for its completion before reading the
  // partials.
  kWideDependent,
};

// The merge that follows a decode launch of `variant` (gqa_decode.cu; a resolved one, not -1).
MergeKind GqaDecodeMergeKind(int variant);

// Combines the plan's split-KV partials into out (bf16 [total_q, num_heads, out_dim]) and lse.
cudaError_t LaunchMergeStates(const DevicePlan& plan, int num_heads, int out_dim, bf16* out,
                              float* lse, cudaStream_t stream, MergeKind kind = MergeKind::kRows);

}  // namespace attn::cuda
