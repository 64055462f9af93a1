// Host-side dispatch of the CUDA entry points to the kernel families.
#include "kernels/cuda/api.h"

#include "kernels/cuda/common/cuda_check.h"
#include "kernels/cuda/launchers.h"

namespace attn::cuda {
namespace {

cudaError_t CountSms(KernelTiling* tiling) {
  int device = 0;
  ATTN_CUDA_RETURN_IF_ERROR(cudaGetDevice(&device));
  return cudaDeviceGetAttribute(&tiling->num_sms, cudaDevAttrMultiProcessorCount, device);
}

PlanConfig BaseConfig(const KernelTiling& tiling, int64_t max_partial_rows, bool causal) {
  PlanConfig c;
  c.block_m = tiling.block_m;
  c.block_n = tiling.block_n;
  c.cta_slots = tiling.num_sms * tiling.ctas_per_sm;
  c.min_chunk_len = tiling.min_chunk_len;
  c.causal = causal;
  c.max_partial_rows = max_partial_rows;
  return c;
}

}  // namespace

cudaError_t GetGqaTiling(int head_dim, bool decode, KernelTiling* tiling) {
  ATTN_CUDA_RETURN_IF_ERROR(CountSms(tiling));
  return decode ? GqaDecodeTiling(head_dim, tiling)
                : GqaPrefillTiling(head_dim, tiling->variant, tiling);
}

cudaError_t GetMlaTiling(int num_heads, bool decode, KernelTiling* tiling) {
  ATTN_CUDA_RETURN_IF_ERROR(CountSms(tiling));
  return MlaTiling(num_heads, decode, tiling);
}

PlanConfig GqaPlanConfig(const GqaParams& p, const KernelTiling& tiling,
                         int64_t max_partial_rows) {
  PlanConfig c = BaseConfig(tiling, max_partial_rows, p.causal);
  c.group = p.num_qo_heads / p.cache.num_kv_heads;
  c.num_kv_heads = p.cache.num_kv_heads;
  c.num_qo_heads = p.num_qo_heads;
  return c;
}

PlanConfig MlaPlanConfig(const MlaParams& p, const KernelTiling& tiling,
                         int64_t max_partial_rows) {
  PlanConfig c = BaseConfig(tiling, max_partial_rows, p.causal);
  c.group = p.num_heads;
  c.num_kv_heads = 1;
  c.num_qo_heads = p.num_heads;
  return c;
}

cudaError_t GqaAttention(const GqaParams& p, const DevicePlan& plan, cudaStream_t stream) {
  if (plan.num_items > 0) {
    const bool decode = p.batch.qo_indptr == nullptr;
    ATTN_CUDA_RETURN_IF_ERROR(decode ? LaunchGqaDecode(p, plan, stream)
                                     : LaunchGqaPrefill(p, plan, stream, plan.variant));
  }
  return LaunchMergeStates(plan, p.num_qo_heads, p.cache.head_dim, p.out, p.lse, stream);
}

cudaError_t MlaAttention(const MlaParams& p, const DevicePlan& plan, cudaStream_t stream) {
  if (plan.num_items > 0) ATTN_CUDA_RETURN_IF_ERROR(LaunchMla(p, plan, stream));
  return LaunchMergeStates(plan, p.num_heads, kMlaCkvDim, p.out, p.lse, stream);
}

}  // namespace attn::cuda
