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

// Combines the plan's split-KV partials into out (bf16 [total_q, num_heads, out_dim]) and lse.
cudaError_t LaunchMergeStates(const DevicePlan& plan, int num_heads, int out_dim, bf16* out,
                              float* lse, cudaStream_t stream);

}  // namespace attn::cuda
