// Internal launchers of the Hopper (sm_90a) kernels behind kernels/cuda/api.h. Built only when the
// build targets sm_90a (ATTN_HAVE_SM90); the entry points in api.cc choose them at run time.
#pragma once

#include <cuda_runtime_api.h>

#include "kernels/attention.h"
#include "kernels/cuda/api.h"

namespace attn::cuda {

// Sets *runs when the current device runs the sm_90a kernels (compute capability 9.0).
cudaError_t DeviceRunsSm90a(bool* runs);

// Sets *available when the current device runs the sm_90a GQA kernels and they cover head_dim.
cudaError_t GqaPrefillSm90Available(int head_dim, bool* available);

// `variant`: one of the kGqaPrefillSm90* variants (kernels/cuda/api.h).
cudaError_t LaunchGqaPrefillSm90(const GqaParams& p, const DevicePlan& plan, cudaStream_t stream,
                                 int variant);
cudaError_t GqaPrefillSm90Tiling(int head_dim, int variant, KernelTiling* tiling);

// The MLA kernels (kMlaSm90*), where DeviceRunsSm90a. Beyond kMlaSm90NarrowMaxHeads heads the
// tiling of kMlaSm90Narrow* is cudaErrorNotSupported and its launch cudaErrorInvalidValue.
cudaError_t LaunchMlaSm90(const MlaParams& p, const DevicePlan& plan, cudaStream_t stream,
                          int variant);
cudaError_t MlaSm90Tiling(int variant, int num_heads, bool decode, KernelTiling* tiling);

}  // namespace attn::cuda
