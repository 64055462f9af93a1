// CUDA entry points of the kernels library. Host functions that enqueue work on a stream and
// return the first CUDA error (they never synchronize, exit or throw).
//
// A launch is planned on the host (kernels/cuda/plan.h) from the batch's sequence lengths and the
// tiling of the kernel that will serve it, the plan is copied to the device with the inputs, and
// the attention entry point executes it: one CTA per (work item, KV head), then the split-KV merge
// when the plan has merges. Every pointer in the params and the DevicePlan is a device pointer.
//
// Variants: the portable kernels (mma.sync, cp.async) run on sm_80 and newer. Per-architecture
// variants are selected inside the entry points from the device's compute capability; the
// tiling functions describe whichever variant the entry point will run.
#pragma once

#include <cuda_runtime_api.h>

#include "kernels/attention.h"
#include "kernels/cuda/plan.h"

namespace attn::cuda {

// A work item as the kernels read it: the planner's item and its sequence's extent, which
// LaunchPlan::WriteIndices derives from the page table on the host. A CTA's first load then
// gives it what it needs to issue its Q copies and page-table reads, instead of a load of the
// item and then one of the sequence's indptr entries. 48 bytes: three 16-byte loads.
struct alignas(16) DeviceWorkItem {
  WorkItem item;
  // All but the layer, which is written as 0: it changes between launches over one table
  // (LaunchOptions::table_id), whose items stay on the device, so ExtentOf reads it from the
  // batch, beside the page-table reads.
  SeqExtent seq;
};
static_assert(sizeof(DeviceWorkItem) == 48);

// The item's sequence extent, its layer read from the batch.
ATTN_HOST_DEVICE SeqExtent ExtentOf(const DeviceWorkItem& w, const PagedBatch& b) {
  SeqExtent e = w.seq;
  e.layer = b.seq_layer ? b.seq_layer[w.item.seq] : 0;
  return e;
}

// Where a launch's plan and split-KV workspace live on the device.
struct DevicePlan {
  const DeviceWorkItem* items = nullptr;  // [num_items]
  int num_items = 0;
  const MergeRow* merges = nullptr;  // [num_merges]
  int num_merges = 0;
  int max_splits = 0;            // AttentionPlan::max_splits
  float* partial_out = nullptr;  // [partial_rows, out_dim] (out_dim: head_dim or kMlaCkvDim)
  float* partial_lse = nullptr;  // [partial_rows]
  int variant = -1;              // KernelTiling::variant the plan was made for
  int cluster_splits = 0;        // AttentionPlan::cluster_splits: launch in clusters of that many
  // [2]: the work counter of kernels whose CTAs take items as they go (persistent kernels) and the
  // count of CTAs done with it. Zero before a launch; the last CTA to finish leaves both zero
  // again, so that launches in one stream may share it.
  uint32_t* schedule = nullptr;
  int cta_slots = 0;  // CTAs the device holds at once (KernelTiling): a persistent kernel's grid
};

// GQA prefill variants (KernelTiling::variant): below 10 the portable kernel's tile shapes; 10 and
// up the Hopper kernels (sm_90a, compute capability 9.0, head_dim 64 / 128 / 256), of which the
// default (-1) selects kGqaPrefillSm90TmaLeanLazyRescale where they run (kernels/cuda/sm90/). The
// four (19, 24, 26, 30) run one schedule: each tile's softmax under the previous tile's P V GEMM,
// three K/V stages (two at head_dim 256), the two consumer warpgroups issuing their GEMMs freely.
// The schedules they beat on the H200 (10-14, 18, 22, 23) are gone; bench/RESULTS.md records each.
// The cp.async reference: the producer's lanes gather a tile's row offsets, then copy it with
// plain cp.async. The default before 24: 2-3% faster than 12 (each GEMM waited for) on three of
// kernel_bench's four prefill shapes on the H200 and even on the fourth (bench/RESULTS.md).
inline constexpr int kGqaPrefillSm90LeanOverlapSolo3 = 19;
// A prefill on the decode kernel (16-row CTAs, any compute capability). The planner picks it by
// itself (LaunchOptions::short_prefill) for launches whose sequences each have at most 16 packed
// rows: one or a few new tokens per sequence, where a 128-row prefill CTA is mostly padding.
inline constexpr int kGqaPrefillOnDecodeKernel = 20;
// Head_dim 128 only: the default, kGqaPrefillSm90TmaLeanLazyRescale, writing per-work phase
// stamps into the buffer SetGqaPrefillPhaseStamps names, for kernel_bench --stamps.
inline constexpr int kGqaPrefillSm90Stamped = 21;
// kGqaPrefillSm90LeanOverlapSolo3 with key tiles by TMA (one box per page and 64 columns, issued
// by an elected lane of each producer warp) instead of every producer lane's cp.async, where the
// page size lets boxes cut whole tiles (16, 32, 64, or a multiple of the tile; elsewhere it runs
// 19's kernel). 5.5-9% faster than 19 on kernel_bench's four prefill shapes on the H200 (8192
// causal 956 -> 881 us; bench/RESULTS.md).
inline constexpr int kGqaPrefillSm90Solo3Tma = 24;
// 24 with the softmax's rows in one pass, O rescaled under S, the diagonal's last P V cut. The
// default before 30: on the H200 against 24, 8 x 512 on 1024 at 40/10 heads -3% (past FlashInfer
// fa3), 4096 causal -1.5%, 8192 causal -0.4%, the long items of the 1117-on-71488 chunk +2%
// (bench/RESULTS.md).
inline constexpr int kGqaPrefillSm90Solo3TmaLeanTiles = 26;
// 26 with a lazy rescale (kLazyRescale in kernels/cuda/sm90/gqa_prefill_sm90.cu): a row's maximum
// moves only where a tile's passes it by more than 8 (log2), so O's factor is almost always 1,
// and a consumer warp skips O's rescale where all of its rows' factors are. The default: on the
// H100 against 26, 8192 causal -3.6% (652 TFLOP/s), 4096 causal -2.3%, 8 x 512 -1.8%, the
// 1117-on-71488 chunk -3.5% (bench/RESULTS.md, 2026-12-06).
inline constexpr int kGqaPrefillSm90TmaLeanLazyRescale = 30;
inline constexpr bool IsGqaPrefillSm90Variant(int v) {
  return v == kGqaPrefillSm90LeanOverlapSolo3 || v == kGqaPrefillSm90Stamped ||
         v == kGqaPrefillSm90Solo3Tma || v == kGqaPrefillSm90Solo3TmaLeanTiles ||
         v == kGqaPrefillSm90TmaLeanLazyRescale;
}

// GQA decode variants (KernelTiling::variant of a decode tiling) of the portable decode kernel
// (kernels/cuda/gqa_decode.cu). The default (-1) resolves to kGqaDecodeAdaptive.
inline constexpr int kGqaDecodePageIdsPerTile = 0;  // each tile's page ids read from global memory
inline constexpr int kGqaDecodeStagedPageIds = 1;   // page ids copied ahead into shared memory
// The default: each launch picks by its page size and plan. Staged page ids below 64 tokens a
// page, per-tile reads above (as short prefills, kGqaPrefillOnDecodeKernel, do). Launches that
// split keys copy K/V evict-first in L2 and run the wide split-KV merge as a programmatic
// dependent launch (sm_90+); unsplit ones copy K/V as 0 and 1 do. On the H200: b1 x 16384
// 36.5 -> 30.1 us, unsplit decodes unchanged (evict-first would cost them 3-5% after an L2
// flush, and gain nothing from a clean L2). Numbered 5 as when it was measured beside 2-4, 6 and
// 7, since removed (gqa_decode.cu has what they showed).
inline constexpr int kGqaDecodeAdaptive = 5;
inline constexpr bool IsGqaDecodeVariant(int v) {
  return v == kGqaDecodePageIdsPerTile || v == kGqaDecodeStagedPageIds || v == kGqaDecodeAdaptive;
}

// MLA variants (KernelTiling::variant): the portable kernel and the Hopper ones (sm_90a, compute
// capability 9.0), of which the default (-1) selects kMlaSm90PersistentLean (prefills on TMA
// tiles), kMlaSm90PersistentTouch2Lean (other prefills), kMlaSm90LateRightTmaLazy (wide
// decodes on TMA tiles where HBM is fast), kMlaSm90LateRightTmaTouch2Lazy (other wide decodes),
// kMlaSm90Narrow16 or kMlaSm90Narrow32 (decodes of few heads) where they run
// (kernels/cuda/sm90/mla_sm90.cu; api.cc's DefaultSm90Mla says why). The numbers are those the
// variants were measured under; the schedules they beat on the H200 and H100 (10-14, 16-18, 22,
// 23, 28-33, 38) are gone, and bench/RESULTS.md records each.
inline constexpr int kMlaPortable = 0;
// Keys per tile of the 64-row kernels: their tiles come by TMA where the page size is a multiple.
inline constexpr int kMlaSm90KeyTile = 64;
// Transposed for few heads: keys and output columns as wgmma's M, 16 or 32 heads (packed rows) as
// its N, so a decode of 8-32 heads does no tensor work on padding rows; a split decode's chunks
// of a row tile run as one cluster that merges them in distributed shared memory instead of a
// merge kernel; each key stage is released as soon as the P V that read it is done.
inline constexpr int kMlaSm90Narrow16 = 39;
inline constexpr int kMlaSm90Narrow32 = 40;
inline constexpr int kMlaSm90NarrowMaxHeads = 32;  // the most heads the two take
// 64-row tiles (41): S in two chains of k-steps, whole 64-key tiles by TMA where the page size is
// a multiple of 64 (elsewhere cp.async), the second consumer's P V deferred until the first's is
// done (beside the end of the next S and under the softmax after it), each stage released by
// halves, and a lazy rescale (as the GQA prefill's 30): both consumer warpgroups skip their 128
// multiplies of O a lane where no row's maximum moved (against the same kernels without it,
// variants 18 and 38, since removed: on the H100 the 128-head decode -10%, the page-64 prefill
// -6%, the page-1 seed -2%; bench/RESULTS.md, 2026-12-06).
// 42: 41 with the pages of each key tile touched two tiles before its copies are issued (their
// address translation done ahead): the default for decodes of more than 32 heads on devices with
// little HBM per SM (the page-1 seed -2% on the H100 and the H200, 128 heads -7% on the H100 but
// +1.7% on the H200; the page-64 prefill, on TMA tiles, +3%). It replaced 28, which brought the
// whole tile into L2 and was no faster.
inline constexpr int kMlaSm90LateRightTmaLazy = 41;
inline constexpr int kMlaSm90LateRightTmaTouch2Lazy = 42;
// 41 and 42 with the score warpgroup's softmax in UpdatePositiveScale's straight-line pass over
// both rows (kLeanSoftmax in kernels/cuda/sm90/mla_sm90.cu), which the prefills' defaults take (the
// page-64 prefill -1.2%, the page-1 seed -1.1% on the H200; the 128-head decode +1.5% with 43, so
// wide decodes keep 41 and 42; bench/RESULTS.md, 2026-12-06).
inline constexpr int kMlaSm90LateRightTmaLazyLean = 43;
inline constexpr int kMlaSm90LateRightTmaTouch2LazyLean = 44;
// 43 and 44 persistent (kPersistent in kernels/cuda/sm90/mla_sm90.cu): one CTA an SM takes items
// from the plan's counter (DevicePlan::schedule) until none is left, loading the next item's Q
// and first keys while it finishes the one before: the prefills' defaults.
inline constexpr int kMlaSm90PersistentLean = 45;
inline constexpr int kMlaSm90PersistentTouch2Lean = 46;
// 46 with phase stamps (SetMlaPhaseStamps): each item writes one record at its index, its start
// being when the producer takes it up. An instrument (kernel_bench --stamps on the MLA prefills),
// never a default.
inline constexpr int kMlaSm90Stamped = 55;
// Trials: 45 and 46 with the next item's whole work description handed to the consumers through
// shared memory and its first tile's page-table reads issued before the producer waits for the
// item before to finish with Q (56, 57); 58: 57 with the next item's first two tiles touched
// there as well.
inline constexpr int kMlaSm90PersistentLeanNext = 56;
inline constexpr int kMlaSm90PersistentTouch2LeanNext = 57;
inline constexpr int kMlaSm90PersistentTouch2LeanNextTouched = 58;
// 56 and 58 with Q completing by column blocks, each issued just before the first key tile's: the
// item's first S starts once the first block of each has landed.
inline constexpr int kMlaSm90PersistentLeanSplitQ = 59;
inline constexpr int kMlaSm90PersistentTouch2LeanSplitQ = 60;
// 60 with 55's phase stamps; its "Q issued" is stamped once the first tile's copies (which carry
// Q's) are issued, and its "Q ready" when the score warpgroup starts the first S, which waits for
// Q block by block.
inline constexpr int kMlaSm90StampedSplitQ = 61;
inline constexpr bool IsMlaSm90Variant(int v) {
  return v == kMlaSm90Narrow16 || v == kMlaSm90Narrow32 || v == kMlaSm90LateRightTmaLazy ||
         v == kMlaSm90LateRightTmaTouch2Lazy || v == kMlaSm90LateRightTmaLazyLean ||
         v == kMlaSm90LateRightTmaTouch2LazyLean || v == kMlaSm90PersistentLean ||
         v == kMlaSm90PersistentTouch2Lean || v == kMlaSm90Stamped ||
         v == kMlaSm90PersistentLeanNext || v == kMlaSm90PersistentTouch2LeanNext ||
         v == kMlaSm90PersistentTouch2LeanNextTouched || v == kMlaSm90PersistentLeanSplitQ ||
         v == kMlaSm90PersistentTouch2LeanSplitQ || v == kMlaSm90StampedSplitQ;
}

// Phase stamps of a stamped variant (kernels/cuda/common/phase_stamps.cuh): one record of
// kPhaseStampSlots words per work (the GQA prefill: item index * KV heads + KV head, one CTA; the
// persistent MLA kernel: item index, many a CTA, consumer warpgroup 0 the score warpgroup), each
// slot a PhaseSlot.
enum class PhaseSlot : int {
  kSmAndTiles = 0,  // %smid | key tiles << 32
  kStartNs,         // global timer (ns) at the CTA's start
  kEndNs0,          // global timer at the end of consumer warpgroup 0's epilogue
  kEndNs1,          // ... and warpgroup 1's
  kStartClock,      // the SM's clock (cycles) at the CTA's start
  kQIssuedClock,    // the producer has issued the Q tile's copies
  kProducedClock,   // the producer has issued its last tile's copies
  kQReadyClock,     // consumer warpgroup 0 sees Q in shared memory
  kFirstSClock,     // ... has the first tile's S
  kLoopEndClock,    // ... has the last tile's P V
  kStoredClock0,    // ... has stored its rows
  kStoredClock1,    // consumer warpgroup 1 has stored its rows
  kCount
};
inline constexpr int kPhaseStampSlots = static_cast<int>(PhaseSlot::kCount);
struct PhaseStampBuffer {
  uint64_t* records = nullptr;  // device memory, [capacity, kPhaseStampSlots]
  int capacity = 0;             // records
};
// Names the buffer the stamped GQA prefill variant writes (records null: none; it writes
// nothing). Takes effect for launches enqueued after it returns; cudaErrorNotSupported where the
// Hopper kernels are not built.
cudaError_t SetGqaPrefillPhaseStamps(const PhaseStampBuffer& buffer);
// The same for the stamped MLA variants (kMlaSm90Stamped, kMlaSm90StampedSplitQ).
cudaError_t SetMlaPhaseStamps(const PhaseStampBuffer& buffer);

// What the planner needs to know of the kernel a launch will run on the current device.
struct KernelTiling {
  int variant = -1;     // which of the family's tile shapes (-1: the default for the shape)
  int block_m = 0;      // packed rows per CTA
  int block_n = 0;      // key tile
  int ctas_per_sm = 0;  // resident CTAs per SM at this kernel's resources
  int num_sms = 0;
  // Shortest split-KV chunk worth its partial-output traffic (MLA partial rows are 512 floats).
  int min_chunk_len = 256;
  // PlanConfig::waves_before_split: a kernel of few, long CTAs per SM splits only when a launch
  // would not fill the GPU once.
  double waves_before_split = 2.0;
  double target_waves = 4.0;  // PlanConfig::target_waves
  double no_split_fill = 0;   // PlanConfig::no_split_fill
  double no_split_fill_one_wave = 0;  // PlanConfig::no_split_fill_one_wave
  // PlanConfig's cost model of a split (cta_start_keys 0: off).
  double cta_start_keys = 0;
  double merge_keys = 0;
  double merge_keys_per_row = 0;
  int cluster_splits = 0;     // PlanConfig::cluster_splits: the kernel merges splits in clusters
};

// Tiling of the kernel serving GQA (prefill when `decode` is false) / MLA launches.
// tiling->variant may name a variant on entry (tests and benchmarks compare them); on return it
// names the one the launch runs.
cudaError_t GetGqaTiling(int head_dim, bool decode, KernelTiling* tiling);
// Tiling of kGqaPrefillOnDecodeKernel, for LaunchOptions::short_prefill.
cudaError_t GetGqaShortPrefillTiling(int head_dim, KernelTiling* tiling);
// MLA: the default variant depends on the cache's page size too (api.cc, DefaultSm90Mla).
cudaError_t GetMlaTiling(int num_heads, int page_size, bool decode, KernelTiling* tiling);

// The planner's configuration for a launch of `params` with `tiling`; the workspace holds
// max_partial_rows rows.
PlanConfig GqaPlanConfig(const GqaParams& params, const KernelTiling& tiling,
                         int64_t max_partial_rows);
PlanConfig MlaPlanConfig(const MlaParams& params, const KernelTiling& tiling,
                         int64_t max_partial_rows);

// The calls a launch merges, for the finiteness check: query rows [rows[c], rows[c + 1]) belong
// to call c. `refused[c]` (zeroed before the check) collects kFinite* bits for each of call c's
// inputs that holds a NaN or Inf; the append writes no row of a call with any bit set. All
// device memory; num_calls == 0: nothing is checked and every row is appended.
struct CallChecks {
  const int32_t* rows = nullptr;  // [num_calls + 1], rows[0] == 0, rows[num_calls] == total_q
  uint32_t* refused = nullptr;    // [num_calls]
  int num_calls = 0;
};
inline constexpr uint32_t kFiniteQ = 1, kFiniteQPe = 2, kFiniteKNew = 4, kFiniteVNew = 8;

// One input tensor the check reads: `rows` rows of `width` bf16 elements (16-byte aligned), whose
// NaN or Inf sets `bit` in its call's refused entry.
struct CheckedInput {
  const bf16* data = nullptr;
  int64_t rows = 0;
  int64_t width = 0;
  uint32_t bit = 0;
};

// Sets checks.refused bits for the calls whose inputs (up to 4) hold a NaN or Inf: a bf16 whose
// exponent bits are all ones. One launch reading every input once, sized for `num_sms` SMs
// (KernelTiling::num_sms); enqueue it after the inputs' copies and before the append.
cudaError_t CheckFinite(const CheckedInput* inputs, int num_inputs, const CallChecks& checks,
                        int num_sms, cudaStream_t stream);

// Writes the new K/V rows into their page slots (no-op when params.k_new is null), except the
// rows of calls `checks` refused. Enqueue it before the attention launch on the same stream.
cudaError_t GqaAppendKv(const GqaParams& params, const CallChecks& checks, cudaStream_t stream);
cudaError_t MlaAppendKv(const MlaParams& params, const CallChecks& checks, cudaStream_t stream);

// Zeroes pages of a pool's storage, laid out [num_layers, num_pages, page_bytes] (both cache
// layouts are): every layer of each of the `num_listed` page ids in `pages` (device memory,
// distinct ids in [0, num_pages)). One launch; page_bytes a multiple of 16, storage 16-byte
// aligned (cudaErrorInvalidValue otherwise).
cudaError_t ZeroPages(void* storage, int num_layers, int num_pages, int64_t page_bytes,
                      const int32_t* pages, int num_listed, cudaStream_t stream);

// Paged attention over the plan (decode when params.batch.qo_indptr is null). The kernels read q
// and write out 16 bytes at a time: both 16-byte aligned.
cudaError_t GqaAttention(const GqaParams& params, const DevicePlan& plan, cudaStream_t stream);
cudaError_t MlaAttention(const MlaParams& params, const DevicePlan& plan, cudaStream_t stream);

}  // namespace attn::cuda
