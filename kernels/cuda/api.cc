// Host-side dispatch of the CUDA entry points to the kernel families.
#include "kernels/cuda/api.h"

#include "kernels/cuda/common/cuda_check.h"
#include "kernels/cuda/launchers.h"
#ifdef ATTN_HAVE_SM90
#include "kernels/cuda/sm90/launchers_sm90.h"
#endif

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
  c.waves_before_split = tiling.waves_before_split;
  c.target_waves = tiling.target_waves;
  c.no_split_fill = tiling.no_split_fill;
  c.no_split_fill_one_wave = tiling.no_split_fill_one_wave;
  c.cta_start_keys = tiling.cta_start_keys;
  c.merge_keys = tiling.merge_keys;
  c.merge_keys_per_row = tiling.merge_keys_per_row;
  c.cluster_splits = tiling.cluster_splits;
  c.causal = causal;
  c.max_partial_rows = max_partial_rows;
  return c;
}

// The Hopper prefill variant the default selects (tests and benchmarks name the others): the
// fastest that passed kernel_tests on the H200 (bench/RESULTS.md).
constexpr int kDefaultSm90Prefill = kGqaPrefillSm90TmaLeanLazyRescale;

// Resolves a GQA prefill variant for the current device: the default becomes the Hopper kernel
// where it runs; a Hopper variant where it does not run is an error.
cudaError_t ResolvePrefillVariant(int head_dim, int* variant) {
  bool sm90 = false;
#ifdef ATTN_HAVE_SM90
  if (*variant < 0 || IsGqaPrefillSm90Variant(*variant)) {
    ATTN_CUDA_RETURN_IF_ERROR(GqaPrefillSm90Available(head_dim, &sm90));
  }
#endif
  if (IsGqaPrefillSm90Variant(*variant) && !sm90) return cudaErrorNotSupported;
  if (*variant < 0 && sm90) *variant = kDefaultSm90Prefill;
  return cudaSuccess;
}

// The Hopper MLA variant the default selects for wide decodes where HBM is fast
// (DefaultSm90Mla): S in two chains with TMA key tiles at page sizes that are multiples of 64
// (elsewhere cp.async), the second consumer's P V issued once the first's is done, and the lazy
// rescale. Beside 13 (the same without the late right half) in one H200 run: the 16-head prefill
// 988 -> 924 us, the 128-head decode 284.6 -> 274.2 us, the page-1 seed 276.5 -> 272.8 us; the
// lazy rescale (41 in place of 18) took the 128-head decode 267.2 -> 253.9 us on the H200
// (bench/RESULTS.md).
constexpr int kDefaultSm90MlaWideDecode = kMlaSm90LateRightTmaLazy;

// Peak HBM bandwidth of the current device per SM, bytes a second (two transfers a memory clock).
cudaError_t HbmBandwidthPerSm(double* bytes_per_second) {
  int device = 0, khz = 0, bits = 0, sms = 0;
  ATTN_CUDA_RETURN_IF_ERROR(cudaGetDevice(&device));
  ATTN_CUDA_RETURN_IF_ERROR(cudaDeviceGetAttribute(&khz, cudaDevAttrMemoryClockRate, device));
  ATTN_CUDA_RETURN_IF_ERROR(cudaDeviceGetAttribute(&bits, cudaDevAttrGlobalMemoryBusWidth, device));
  ATTN_CUDA_RETURN_IF_ERROR(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device));
  *bytes_per_second = sms > 0 ? 2.0 * khz * 1e3 * (bits / 8) / sms : 0.0;
  return cudaSuccess;
}

// Below this share of HBM per SM a wide MLA decode waits on memory more than on its tensor work
// (DefaultSm90Mla): the H100 SXM has 25 GB/s an SM, the H200 36.
constexpr double kLeanHbmPerSm = 30e9;

// The Hopper MLA variant the default selects for a launch of num_heads heads on pages of
// page_size keys, on a device with hbm_per_sm bytes a second of HBM per SM: a decode of at most
// 32 heads fills one transposed tile's columns (kMlaSm90Narrow*), anything else the 64-row tiles.
// The transposed kernels merge a split decode's chunks in clusters: the 16-head b64 x 4096 decode
// 95.1 -> 90.8 us against the merge kernel (89 us since each stage is released early).
// Touching the pages of a key tile two tiles ahead (42, 44) removes the wait on each new page's
// address translation where the CTA is its pages' only reader and waits on memory: the page-1
// seed (cp.async tiles; -2% on the H100 and the H200) and the 128-head decode on the H100 (316 ->
// 295 us). On the H200, with 1.4x the HBM per SM, that decode waits on its tensor work instead,
// and the touch's producer work costs it 1.7% (18: 275 us, 38: 280; 41: 254.7, 42: 260.4). A
// prefill's TMA tiles (page sizes that are multiples of 64), whose items of one sequence read the
// same pages together, only pay for the touch (+3%). Prefills take the score warpgroup's lean
// softmax pass (43, 44: the page-64 prefill 860.0 -> 849.8 us, the page-1 seed 253.2 -> 250.5 us
// on the H200), which the 128-head decode does not gain from (41: 254.7 us, 43: 258.5), in
// persistent CTAs (45, 46: a prefill's ~1500 items of a few tiles each pay a CTA's start and Q
// between items no more; on the H100 the page-64 prefill 850 -> 821 us, the page-1 seed 254 ->
// 235 us; the 128-head decode's 256 long items gain nothing from it); bench/RESULTS.md has each.
int DefaultSm90Mla(int num_heads, int page_size, bool decode, double hbm_per_sm) {
  static_assert(kMlaSm90NarrowMaxHeads == 32);
  if (decode && num_heads <= 16) return kMlaSm90Narrow16;
  if (decode && num_heads <= 32) return kMlaSm90Narrow32;
  const bool tma_tiles = page_size % kMlaSm90KeyTile == 0;
  if (!decode) return tma_tiles ? kMlaSm90PersistentLean : kMlaSm90PersistentTouch2Lean;
  if (!tma_tiles || hbm_per_sm < kLeanHbmPerSm) return kMlaSm90LateRightTmaTouch2Lazy;
  return kDefaultSm90MlaWideDecode;
}

// Resolves an MLA variant for the current device as ResolvePrefillVariant does.
cudaError_t ResolveMlaVariant(int num_heads, int page_size, bool decode, int* variant) {
  bool sm90 = false;
#ifdef ATTN_HAVE_SM90
  if (*variant < 0 || IsMlaSm90Variant(*variant)) ATTN_CUDA_RETURN_IF_ERROR(DeviceRunsSm90a(&sm90));
#endif
  if (IsMlaSm90Variant(*variant) && !sm90) return cudaErrorNotSupported;
  if (*variant < 0 && !sm90) *variant = kMlaPortable;
  if (*variant < 0) {
    double hbm_per_sm = 0;
    ATTN_CUDA_RETURN_IF_ERROR(HbmBandwidthPerSm(&hbm_per_sm));
    *variant = DefaultSm90Mla(num_heads, page_size, decode, hbm_per_sm);
  }
  return cudaSuccess;
}

cudaError_t LaunchMlaVariant(const MlaParams& p, const DevicePlan& plan, cudaStream_t stream) {
#ifdef ATTN_HAVE_SM90
  if (IsMlaSm90Variant(plan.variant)) return LaunchMlaSm90(p, plan, stream, plan.variant);
#endif
  return LaunchMla(p, plan, stream);
}

}  // namespace

cudaError_t GetGqaTiling(int head_dim, bool decode, KernelTiling* tiling) {
  ATTN_CUDA_RETURN_IF_ERROR(CountSms(tiling));
  if (decode || tiling->variant == kGqaPrefillOnDecodeKernel) {
    return GqaDecodeTiling(head_dim, tiling);
  }
  ATTN_CUDA_RETURN_IF_ERROR(ResolvePrefillVariant(head_dim, &tiling->variant));
#ifdef ATTN_HAVE_SM90
  if (IsGqaPrefillSm90Variant(tiling->variant)) {
    return GqaPrefillSm90Tiling(head_dim, tiling->variant, tiling);
  }
#endif
  return GqaPrefillTiling(head_dim, tiling->variant, tiling);
}

cudaError_t GetGqaShortPrefillTiling(int head_dim, KernelTiling* tiling) {
  tiling->variant = kGqaPrefillOnDecodeKernel;
  return GetGqaTiling(head_dim, false, tiling);
}

cudaError_t GetMlaTiling(int num_heads, int page_size, bool decode, KernelTiling* tiling) {
  if (page_size <= 0) return cudaErrorInvalidValue;
  ATTN_CUDA_RETURN_IF_ERROR(CountSms(tiling));
  ATTN_CUDA_RETURN_IF_ERROR(ResolveMlaVariant(num_heads, page_size, decode, &tiling->variant));
#ifdef ATTN_HAVE_SM90
  if (IsMlaSm90Variant(tiling->variant)) {
    return MlaSm90Tiling(tiling->variant, num_heads, decode, tiling);
  }
#endif
  if (tiling->variant != kMlaPortable) return cudaErrorInvalidValue;
  return MlaTiling(num_heads, decode, tiling);
}

PlanConfig GqaPlanConfig(const GqaParams& p, const KernelTiling& tiling, int64_t max_partial_rows) {
  PlanConfig c = BaseConfig(tiling, max_partial_rows, p.causal);
  c.group = p.num_qo_heads / p.cache.num_kv_heads;
  c.num_kv_heads = p.cache.num_kv_heads;
  c.num_qo_heads = p.num_qo_heads;
  return c;
}

PlanConfig MlaPlanConfig(const MlaParams& p, const KernelTiling& tiling, int64_t max_partial_rows) {
  PlanConfig c = BaseConfig(tiling, max_partial_rows, p.causal);
  c.group = p.num_heads;
  c.num_kv_heads = 1;
  c.num_qo_heads = p.num_heads;
  return c;
}

#ifndef ATTN_HAVE_SM90
cudaError_t SetGqaPrefillPhaseStamps(const PhaseStampBuffer&) { return cudaErrorNotSupported; }
cudaError_t SetMlaPhaseStamps(const PhaseStampBuffer&) { return cudaErrorNotSupported; }
#endif

cudaError_t GqaAttention(const GqaParams& p, const DevicePlan& plan, cudaStream_t stream) {
  const bool decode = p.batch.qo_indptr == nullptr;
  if (plan.num_items > 0) {
    if (decode || plan.variant == kGqaPrefillOnDecodeKernel) {
      ATTN_CUDA_RETURN_IF_ERROR(LaunchGqaDecode(p, plan, stream));
#ifdef ATTN_HAVE_SM90
    } else if (IsGqaPrefillSm90Variant(plan.variant)) {
      ATTN_CUDA_RETURN_IF_ERROR(LaunchGqaPrefillSm90(p, plan, stream, plan.variant));
#endif
    } else {
      ATTN_CUDA_RETURN_IF_ERROR(LaunchGqaPrefill(p, plan, stream, plan.variant));
    }
  }
  return LaunchMergeStates(plan, p.num_qo_heads, p.cache.head_dim, p.out, p.lse, stream,
                           decode ? GqaDecodeMergeKind(plan.variant) : MergeKind::kRows);
}

cudaError_t MlaAttention(const MlaParams& p, const DevicePlan& plan, cudaStream_t stream) {
  if (plan.num_items > 0) ATTN_CUDA_RETURN_IF_ERROR(LaunchMlaVariant(p, plan, stream));
  return LaunchMergeStates(plan, p.num_heads, kMlaCkvDim, p.out, p.lse, stream);
}

}  // namespace attn::cuda
