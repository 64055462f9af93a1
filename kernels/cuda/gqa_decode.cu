// GQA paged decode on mma.sync tensor cores.
//
// One CTA = one work item x one KV head: the (up to 16) query heads of the KV head are packed into
// the 16 rows of the MMA M dimension, so each K/V row read from memory serves all of them. Decode
// is bound by reading K/V once, so the CTA streams key tiles of kBlockN through a kStages-deep
// cp.async pipeline and its 4 warps split every tile (16 keys each), each keeping its own online
// softmax state; the warps' states are merged through shared memory at the end. Split-KV across
// CTAs (the planner's chunks) lets a batch of one long sequence fill the GPU.
//
// Copies: each thread copies one 16-byte chunk of a K row and of the V row beside it per row
// offset it reads (SwizzledTile::LoadRowPairs), and rows past the key range repeat the range's
// last key (RowOffsetRing<kBlockN, true>), which the mask hides, instead of being zero-filled: so
// every copy is a plain one. The zero-filling copies, their source-size selects and a K and a V
// pass that each read every offset took ~27 instructions a 16-byte copy, and the tile loop 903
// instructions a thread; now ~9 and 566 (bench/RESULTS.md, 2026-12-06: cuDNN's decode, the same
// grid and occupancy, issues 2.6x fewer instructions and reads DRAM 3% faster). Fewer still, each
// K and V row by one cp.async.bulk a thread into padded rows, completing on an mbarrier a stage
// (trial 11: ~390 fewer instructions in the head_dim-128 kernels), ran 3-5% slower on every
// unsplit decode on two H100s (bench/RESULTS.md, 2026-12-07) and was dropped.
//
// Page tables: page size 1 reads one page id per key, and those reads miss L2 (the L2 holds K/V,
// and the ids of the next tile are the next 256 bytes of the table). kGqaDecodePageIdsPerTile
// reads a tile's ids from global memory one tile ahead, and every tile waits for them: at page
// size 1 the kernel ran 0.80x of FlashInfer with contiguous pages as with scattered ones
// (bench/RESULTS.md). kGqaDecodeStagedPageIds copies each tile's ids into shared memory with the
// copies of the tile kStages before it, so that they have landed when the tile needs them.
//
// Launches that split keys (the plan has merges: a few long sequences, whose K/V is not much more
// than the L2) differ in two ways, each measured on the H200 with kernel_bench (median us) on
// b1 x 16384 at head_dim 128 (32 chunks of 512 keys): 36.5 -> 30.1 us in all, 1.08x+ the speed
// of SDPA's cuDNN.
//  - K/V copies under an L2 evict-first policy: -2.7 us. Each K/V row is read once, by one CTA
//    (the packed rows fit one tile), so keeping it in L2 serves nobody, while allocating it there
//    evicts another line, after real traffic's appends and outputs (or kernel_bench's flush) a
//    dirty one: a DRAM write beside the read. Evict-first makes the clean K/V lines the victims.
//  - merge_states.cu's wide merge (-2.8 us) as a programmatic dependent launch (-1.0 us): its
//    CTAs start while the attention's last CTAs run (this kernel triggers it as it starts: every
//    CTA of a split launch is then resident) and wait for the attention's completion only before
//    they read the partial rows.
// Unsplit launches keep the plain copies. Their reads (1 GiB and more) dwarf any writebacks saved,
// and evict-first added 3-5% there (b64 x 4096 at page size 1 266 -> 279 us on the H200, 40/10
// b128 x 2048 327 -> 339 us) when the L2 starts full of dirty lines, as after kernel_bench's flush
// (and the peers' benchmarks'): Nsight Compute on the H100 (bench/RESULTS.md, 2026-12-06) shows
// the same DRAM reads and fewer writebacks under evict-first, yet 3% more time, and from a clean
// L2 the two level (within 0.5%). The streamed lines, first to go, seem to get only the ways the
// dirty lines leave them. A 256-byte L2 fetch hint (.L2::256B) changed nothing. Page ids, Q and
// the partial rows keep the normal policy.
//
// Prefills whose sequences each have at most 16 packed rows run here too
// (kGqaPrefillOnDecodeKernel): the rows carry their causal limits, so nothing in the kernel is
// decode-only, and a 128-row prefill CTA would be mostly padding.
#include <cuda_runtime.h>

#include "kernels/cuda/common/cuda_check.h"
#include "kernels/cuda/common/epilogue.cuh"
#include "kernels/cuda/common/launch.h"
#include "kernels/cuda/common/smem_tile.cuh"
#include "kernels/cuda/common/softmax_state.cuh"
#include "kernels/cuda/launchers.h"

namespace attn::cuda {
namespace {

constexpr int kBlockM = 16;

constexpr int kWarps = 4;
constexpr int kThreads = kWarps * 32;
constexpr int kBlockN = kWarps * 16;

// Stages: enough bytes in flight per SM to cover memory latency, with 2+ CTAs per SM where the
// tiles allow (head_dim 128: 3 x 32 KiB K/V tiles + Q = 100 KiB per CTA). One CTA an SM with six
// stages (160 KiB in flight against two CTAs' 128) lost 3-7% on every decode on the H100
// (bench/RESULTS.md, 2026-12-06): four warps an SM issue and wait less well than eight. Eight
// warps with 128-key tiles in that one CTA (trial 12: half the tiles, barriers and ring stores a
// key) ran level on the unsplit decodes and 5-10% slower on the split b1 x 16384 on the H100
// (bench/RESULTS.md, 2026-12-07, fourth part): the per-tile work is not what the decode waits on.
constexpr int StagesFor(int head_dim) { return head_dim == 64 ? 4 : head_dim == 128 ? 3 : 2; }

// What a build of the kernel does, as bits of its kKernel (KernelOf picks a launch's build).
constexpr int kStagedIdsBit = 1;  // page ids through shared memory (PageIdStage)
// For launches that split keys (file comment): K/V copied under EvictFirstPolicy, and the merge,
// a programmatic dependent launch, let start as each CTA starts.
constexpr int kSplitKeysBit = 2;

// A build's tiles and how it finds its rows.
template <int kHeadDim, int kKernel>
struct DecodeTraits {
  static constexpr int kStages = StagesFor(kHeadDim);
  static constexpr bool kStagedIds = (kKernel & kStagedIdsBit) != 0;
  static constexpr bool kSplitKeys = (kKernel & kSplitKeysBit) != 0;

  static constexpr int kDTiles = kHeadDim / 8;
  static constexpr int kKSteps = kHeadDim / 16;
  static constexpr bool kQInRegisters = kHeadDim <= 128;
  using Tile = SwizzledTile<kHeadDim>;
  static constexpr int kTileElems = kBlockN * kHeadDim;
  static constexpr int kPipelineBytes = kStages * 2 * kTileElems * 2;
  // The warps' partial outputs, merged at the end, reuse the pipeline's buffers. Rows are padded
  // by 4 floats to spread the 8 rows a store instruction writes over different banks.
  static constexpr int kMergeStride = kHeadDim + 4;
  using Exchange = SoftmaxExchange<kWarps, kBlockM>;
  static constexpr int kMergeBytes = kWarps * kBlockM * kMergeStride * 4 + Exchange::kBytes;
  static_assert(kMergeBytes <= kPipelineBytes);
  using Ring = RowOffsetRing<kBlockN, /*kRepeatLastKey=*/true>;
  // Tile T's ids come with the copies of tile T - kStages and are read when those have landed;
  // the copy group issued then (tile T + kStages - 1's, with the ids of tile T + 2 kStages - 1)
  // takes the slot of tile T - 1, whose ids were read a __syncthreads before: kStages slots.
  using Ids = PageIdStage<kBlockN, kStages>;
  static constexpr int kSmemBytes = kBlockM * kHeadDim * 2 + kPipelineBytes +
                                    static_cast<int>(sizeof(Ring)) + static_cast<int>(sizeof(Ids));
};

template <int kHeadDim, int kKernel>
__global__ void __launch_bounds__(kThreads)
    GqaDecodeKernel(const GqaParams p, const DeviceWorkItem* __restrict__ items,
                    const RowSink sink) {
  using T = DecodeTraits<kHeadDim, kKernel>;
  constexpr int kStages = T::kStages;
  using Tile = typename T::Tile;
  if constexpr (T::kSplitKeys) TriggerDependentLaunch();
  extern __shared__ __align__(128) unsigned char smem[];
  bf16* s_q = reinterpret_cast<bf16*>(smem);
  bf16* s_kv = s_q + kBlockM * kHeadDim;  // stage s: K at 2 s, V at 2 s + 1 (tiles)
  auto* ring = reinterpret_cast<typename T::Ring*>(s_kv + kStages * 2 * T::kTileElems);
  auto* ids = reinterpret_cast<typename T::Ids*>(ring + 1);

  const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32;
  const ItemHead cta = CurrentItemHead(p.cache.num_kv_heads);
  const DeviceWorkItem& planned = items[cta.item];
  const WorkItem item = planned.item;
  const int kv_head = cta.head;
  const int group = p.num_qo_heads / p.cache.num_kv_heads;
  const SeqExtent seq = ExtentOf(planned, p.batch);
  const int num_rows = seq.q_len * group;

  Tile::template LoadPackedQuery<kBlockM, kThreads>(s_q, p, seq, item.row_begin, num_rows, kv_head,
                                                    group, tid);

  const PagedRows rows = GqaKeyRows(p.cache, p.batch, seq, kv_head);
  const bf16* k_base = rows.base;
  const int64_t v_offset = GqaValueOffset(p.cache);  // a V row from its K row
  const uint64_t kv_policy = T::kSplitKeys ? EvictFirstPolicy() : 0;

  const int num_tiles = (item.kv_end - item.kv_begin + kBlockN - 1) / kBlockN;
  auto first_key = [&](int t) { return item.kv_begin + t * kBlockN; };
  // Row offsets of tile t from the page table in global memory.
  auto lookup = [&](int t) { return T::Ring::Lookup(rows, first_key(t), item.kv_end, tid); };
  // The same from the ids staged in shared memory (T::kStagedIds; tile t's copy group done).
  auto staged_lookup = [&](int t) { return ids->Lookup(rows, t, first_key(t), item.kv_end, tid); };
  // Issues tile t's copies from its ring slot (stored and synchronized before), and with them
  // those of tile t + kStages's page ids.
  auto load_tile = [&](int t) {
    if (t < num_tiles) {
      bf16* stage = s_kv + (t % kStages) * 2 * T::kTileElems;
      Tile::template LoadRowPairs<kBlockN, kThreads, T::kSplitKeys>(
          stage, stage + T::kTileElems, k_base, v_offset, ring->Offsets(t), tid, kv_policy);
    }
    if constexpr (T::kStagedIds) {
      ids->Fetch(rows, t + kStages, first_key(t + kStages), item.kv_end, tid);
    }
    CommitAsyncGroup();  // empty groups keep the wait counts uniform
  };
  if constexpr (T::kStagedIds) {
    // The first tiles' page-table reads all in flight at once, not one after another.
    int64_t first_offsets[kStages];
#pragma unroll
    for (int s = 0; s < kStages; ++s) first_offsets[s] = lookup(s);
#pragma unroll
    for (int s = 0; s < kStages - 1; ++s) {  // Q rides in the first group
      ring->Store(s, first_offsets[s], tid);
      __syncthreads();
      load_tile(s);
    }
    ring->Store(kStages - 1, first_offsets[kStages - 1], tid);
  } else {
#pragma unroll
    for (int s = 0; s < kStages - 1; ++s) {  // Q rides in the first group
      ring->Store(s, lookup(s), tid);
      __syncthreads();
      load_tile(s);
    }
    ring->Store(kStages - 1, lookup(kStages - 1), tid);
  }

  const int row_g = lane / 4;
  auto limit = [&](int r) {
    return min(VisibleKeys(seq, (item.row_begin + r) / group, p.causal), item.kv_end);
  };
  const int limit_g = limit(row_g), limit_g8 = limit(row_g + 8);
  const int tile_min_limit = limit(0);

  float o[T::kDTiles][4] = {};
  OnlineSoftmax<2> softmax;
  uint32_t q_frag[T::kQInRegisters ? T::kKSteps : 1][4];
  const float scale_log2 = p.sm_scale * kLog2e;

  for (int t = 0; t < num_tiles; ++t) {
    WaitAsyncGroups<kStages - 2>();
    __syncthreads();  // tile t visible; every warp is done with tile t - 1, whose stage refills
    load_tile(t + kStages - 1);
    // Stored after this tile's math. Staged: tile t + kStages's ids came with tile t's copies.
    const int64_t next_offset = T::kStagedIds ? staged_lookup(t + kStages) : lookup(t + kStages);
    if constexpr (T::kQInRegisters) {
      if (t == 0) {
#pragma unroll
        for (int ks = 0; ks < T::kKSteps; ++ks) Tile::LoadA(q_frag[ks], s_q, 0, ks, lane);
      }
    }
    const bf16* s_k = s_kv + (t % kStages) * 2 * T::kTileElems;
    const bf16* s_v = s_k + T::kTileElems;
    const int key0 = warp * 16;  // this warp's keys within the tile
    const int n0 = item.kv_begin + t * kBlockN + key0;

    float s[2][4] = {};
#pragma unroll
    for (int ks = 0; ks < T::kKSteps; ++ks) {
      uint32_t a[4], b[4];
      if constexpr (T::kQInRegisters) {
#pragma unroll
        for (int i = 0; i < 4; ++i) a[i] = q_frag[ks][i];
      } else {
        Tile::LoadA(a, s_q, 0, ks, lane);
      }
      Tile::LoadBT(b, s_k, key0, ks, lane);
      MmaBf16(s[0], a, b[0], b[1]);
      MmaBf16(s[1], a, b[2], b[3]);
    }
    if (n0 + 16 > tile_min_limit) MaskScores(s, n0, lane, limit_g, limit_g8);
    float alpha[2];
    softmax.Update(s, scale_log2, alpha);
    uint32_t p_frag[1][4];
    ScoresToA(s, p_frag);
    RescaleAccumulator(o, alpha);
#pragma unroll
    for (int dp = 0; dp < T::kDTiles / 2; ++dp) {
      uint32_t b[4];
      Tile::LoadB(b, s_v, key0, dp * 16, lane);
      MmaBf16(o[2 * dp], p_frag[0], b[0], b[1]);
      MmaBf16(o[2 * dp + 1], p_frag[0], b[2], b[3]);
    }
    ring->Store(t + kStages, next_offset, tid);
  }
  WaitAsyncGroups<0>();
  __syncthreads();  // the pipeline buffers become the merge area

  // Merge the 4 warps' (m, sum, O) states of the same 16 rows.
  float* s_o = reinterpret_cast<float*>(s_kv);  // [kWarps][kBlockM][kMergeStride]
  const auto exchange = T::Exchange::At(s_o + kWarps * kBlockM * T::kMergeStride);
#pragma unroll
  for (int x = 0; x < 2; ++x) {
    const int r = row_g + 8 * x;
    const float sum = softmax.RowSum(x);
    if ((lane & 3) == 0) exchange.Publish(warp, r, softmax.m[x], sum);
    float* dst = s_o + (warp * kBlockM + r) * T::kMergeStride + 2 * (lane & 3);
#pragma unroll
    for (int j = 0; j < T::kDTiles; ++j) {
      *reinterpret_cast<float2*>(dst + 8 * j) = make_float2(o[j][2 * x], o[j][2 * x + 1]);
    }
  }
  __syncthreads();

  const RowSink cta_sink = sink.ForItem(item.partial_row, seq, p.causal, kv_head * group);
  constexpr int kVecs = kHeadDim / 4;  // float4 columns per row
  for (int idx = tid; idx < kBlockM * kVecs; idx += kThreads) {
    const int r = idx / kVecs, c = (idx % kVecs) * 4;
    const int packed = item.row_begin + r;
    if (packed >= num_rows) continue;
    // A warp whose logits overflowed passes it on: its NaN sum stays NaN under any weight, and its
    // +inf max makes its weight 2^(inf - inf) = NaN (softmax_state.cuh). The sink's Inverse and
    // StoreLse turn the merged state into the contract's NaN or empty row.
    float weight[kWarps];
    const auto merged = exchange.Merge(r, weight);
    float acc[4] = {0.f, 0.f, 0.f, 0.f};
#pragma unroll
    for (int w = 0; w < kWarps; ++w) {
      const float4 v =
          *reinterpret_cast<const float4*>(s_o + (w * kBlockM + r) * T::kMergeStride + c);
      acc[0] += weight[w] * v.x;
      acc[1] += weight[w] * v.y;
      acc[2] += weight[w] * v.z;
      acc[3] += weight[w] * v.w;
    }
    const int64_t row = cta_sink.Row(packed);
    cta_sink.StoreColumns(row, c, acc, cta_sink.Inverse(packed, merged.m, merged.sum));
    if (c == 0) cta_sink.StoreLse(packed, row, merged.m, merged.sum);
  }
}

template <int kHeadDim, int kKernel>
cudaError_t Launch(const GqaParams& p, const DevicePlan& plan, cudaStream_t stream) {
  using T = DecodeTraits<kHeadDim, kKernel>;
  auto kernel = GqaDecodeKernel<kHeadDim, kKernel>;
  ATTN_CUDA_RETURN_IF_ERROR(AllowSharedMemory(kernel, T::kSmemBytes));
  const RowSink sink = RowSink::ForGqa(p, plan);
  const dim3 grid = ItemHeadGrid(plan.num_items, p.cache.num_kv_heads);
  kernel<<<grid, kThreads, T::kSmemBytes, stream>>>(p, plan.items, sink);
  ATTN_CUDA_RETURN_IF_LAUNCH_FAILED();
  return cudaSuccess;
}

template <int kHeadDim, int kKernel>
cudaError_t Tiling(KernelTiling* tiling) {
  using T = DecodeTraits<kHeadDim, kKernel>;
  // Measured on H200 (bench/RESULTS.md): batch 1 x 16384 keys ran 44 us with 256-key chunks,
  // 37 us with 512 (fewer CTAs and merge inputs, each CTA long enough to fill its pipeline).
  tiling->min_chunk_len = 512;
  // Batch 64 x 4096 (32/8 heads: 512 CTAs, 1.94 waves) ran 268 us unsplit and 277 us in 2048-key
  // chunks at page size 1 on the H200, and 32 x 8192 (256 CTAs, 0.97 of a wave) 361 us unsplit
  // and 383 us in 2048-key chunks on an H100 (bench/RESULTS.md).
  tiling->no_split_fill = 0.9;
  // Within one wave a lower share holds (32/8, page 16): 28 x 8192 (224 CTAs on 264 slots,
  // 0.85) ran 1.4% faster unsplit than in 1792-key chunks on the H200, 0.7% on an H100; 24 x 8192
  // (0.73) 2.5% faster on the H200 but 2% slower on the H100, so it stays split; past one wave
  // 48 x 4096 (1.45 waves, 0.73) lost 1.4% unsplit, 40 x 4096 (0.61) 13%.
  tiling->no_split_fill_one_wave = 0.8;
  return DescribeKernel(GqaDecodeKernel<kHeadDim, kKernel>, kThreads, T::kSmemBytes, kBlockM,
                        kBlockN, tiling);
}

// Runs F<kHeadDim, kernel>::Run(args...) for the head_dim and build.
template <template <int, int> class F, int kHeadDim, typename... Args>
cudaError_t ForKernel(int kernel, Args&&... args) {
  switch (kernel) {
    case 0:
      return F<kHeadDim, 0>::Run(args...);
    case kStagedIdsBit:
      return F<kHeadDim, kStagedIdsBit>::Run(args...);
    case kSplitKeysBit:
      return F<kHeadDim, kSplitKeysBit>::Run(args...);
    case kStagedIdsBit | kSplitKeysBit:
      return F<kHeadDim, kStagedIdsBit | kSplitKeysBit>::Run(args...);
    default:
      return cudaErrorInvalidValue;
  }
}

template <template <int, int> class F, typename... Args>
cudaError_t Dispatch(int head_dim, int kernel, Args&&... args) {
  switch (head_dim) {
    case 64:
      return ForKernel<F, 64>(kernel, args...);
    case 128:
      return ForKernel<F, 128>(kernel, args...);
    case 256:
      return ForKernel<F, 256>(kernel, args...);
    default:
      return cudaErrorInvalidValue;
  }
}

template <int kHeadDim, int kKernel>
struct LaunchOf {
  static cudaError_t Run(const GqaParams& p, const DevicePlan& plan, cudaStream_t stream) {
    return Launch<kHeadDim, kKernel>(p, plan, stream);
  }
};

template <int kHeadDim, int kKernel>
struct TilingOf {
  static cudaError_t Run(KernelTiling* tiling) { return Tiling<kHeadDim, kKernel>(tiling); }
};

// The build a plan's variant runs at a page size, on a launch that splits keys or not. Variants 0
// and 1 stay as bench/RESULTS.md measured them; the others take staged page ids where a tile
// spans several pages (page size 1: 64 ids a tile, read from DRAM), the page-table reads otherwise
// (one id a tile, adjacent to the last one: 1-2% faster at page size 64 on the H200,
// bench/RESULTS.md). Short prefills (kGqaPrefillOnDecodeKernel) keep the plain copies and the row
// merge on split launches too: not measured with the split build.
int KernelOf(int variant, int page_size, bool splits) {
  if (variant == kGqaDecodePageIdsPerTile) return 0;
  if (variant == kGqaDecodeStagedPageIds) return kStagedIdsBit;
  const int ids = page_size < kBlockN ? kStagedIdsBit : 0;
  return variant == kGqaDecodeAdaptive && splits ? ids | kSplitKeysBit : ids;
}

}  // namespace

cudaError_t LaunchGqaDecode(const GqaParams& p, const DevicePlan& plan, cudaStream_t stream) {
  const int kernel = KernelOf(plan.variant, p.cache.page_size, plan.num_merges > 0);
  return Dispatch<LaunchOf>(p.cache.head_dim, kernel, p, plan, stream);
}

MergeKind GqaDecodeMergeKind(int variant) {
  return variant == kGqaDecodeAdaptive ? MergeKind::kWideDependent : MergeKind::kRows;
}

cudaError_t GqaDecodeTiling(int head_dim, KernelTiling* tiling) {
  // The default resolves here, as the prefill's and MLA's do (api.h). The builds of a variant
  // (page-id schemes, split or not) have the same tiles and occupancy; they are described as the
  // unsplit build at page size 1.
  int& variant = tiling->variant;
  if (variant < 0) variant = kGqaDecodeAdaptive;
  if (!IsGqaDecodeVariant(variant) && variant != kGqaPrefillOnDecodeKernel) {
    return cudaErrorInvalidValue;
  }
  return Dispatch<TilingOf>(head_dim, KernelOf(variant, 1, false), tiling);
}

}  // namespace attn::cuda
