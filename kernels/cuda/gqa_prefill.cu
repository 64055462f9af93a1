// GQA paged prefill, FlashAttention-2 style on mma.sync tensor cores.
//
// One CTA = one work item (kernels/cuda/plan.h) x one KV head: kBlockM packed rows (query token x
// query head of this KV head) against keys [kv_begin, kv_end) of one sequence. Each warp owns 16 *
// kMTiles rows, so every K/V fragment read from shared memory feeds kMTiles MMAs (shared memory
// bandwidth, not the tensor cores, bounds a 16-row warp). K and V tiles of kBlockN keys are
// gathered from their pages with cp.async into swizzled shared memory; the V load of tile t
// overlaps S = Q K^T of tile t and the K load of tile t+1 overlaps O += P V of tile t. Causal
// masking is applied only on the tiles that cross a row's limit; the planner has already cut
// kv_end to the keys the tile's last row can see (causal block skipping).
#include <cuda_runtime.h>

#include "kernels/cuda/common/cuda_check.h"
#include "kernels/cuda/common/epilogue.cuh"
#include "kernels/cuda/common/launch.h"
#include "kernels/cuda/common/smem_tile.cuh"
#include "kernels/cuda/common/softmax_state.cuh"
#include "kernels/cuda/launchers.h"

namespace attn::cuda {
namespace {

template <int kHeadDim, int kWarps, int kMTiles, int kBlockN>
struct PrefillTraits {
  static constexpr int kThreads = kWarps * 32;
  static constexpr int kWarpRows = 16 * kMTiles;
  static constexpr int kBlockM = kWarps * kWarpRows;
  static constexpr int kDTiles = kHeadDim / 8;   // 8-column output tiles
  static constexpr int kNTiles = kBlockN / 8;    // 8-key score tiles
  static constexpr int kKSteps = kHeadDim / 16;  // k-steps of Q K^T
  using Tile = SwizzledTile<kHeadDim>;
  using Ring = RowOffsetRing<kBlockN>;
  static constexpr int kSmemBytes =
      (kBlockM + 2 * kBlockN) * kHeadDim * 2 + static_cast<int>(sizeof(Ring));
};

template <int kHeadDim, int kWarps, int kMTiles, int kBlockN>
__global__ void __launch_bounds__(kWarps * 32)
    GqaPrefillKernel(const GqaParams p, const DeviceWorkItem* __restrict__ items,
                     const RowSink sink) {
  using T = PrefillTraits<kHeadDim, kWarps, kMTiles, kBlockN>;
  using Tile = typename T::Tile;
  extern __shared__ __align__(128) unsigned char smem[];
  bf16* s_q = reinterpret_cast<bf16*>(smem);
  bf16* s_k = s_q + T::kBlockM * kHeadDim;
  bf16* s_v = s_k + kBlockN * kHeadDim;
  auto* ring = reinterpret_cast<typename T::Ring*>(s_v + kBlockN * kHeadDim);

  const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32;
  const ItemHead cta = CurrentItemHead(p.cache.num_kv_heads);
  const DeviceWorkItem& planned = items[cta.item];
  const WorkItem item = planned.item;
  const int kv_head = cta.head;
  const int group = p.num_qo_heads / p.cache.num_kv_heads;
  const SeqExtent seq = ExtentOf(planned, p.batch);
  const int num_rows = seq.q_len * group;

  Tile::template LoadPackedQuery<T::kBlockM, T::kThreads>(s_q, p, seq, item.row_begin, num_rows,
                                                          kv_head, group, tid);

  const PagedRows rows = GqaKeyRows(p.cache, p.batch, seq, kv_head);
  const bf16* k_base = rows.base;
  const bf16* v_base = rows.base + GqaValueOffset(p.cache);
  auto tile_key = [&](int t) { return item.kv_begin + t * kBlockN; };

  // Each lane holds rows g and g + 8 of each of its warp's m-tiles. Their key limits are
  // recomputed in the few tiles that need masking rather than kept in registers.
  const int warp_row0 = warp * T::kWarpRows;
  auto limit = [&](int r) {
    return min(VisibleKeys(seq, (item.row_begin + r) / group, p.causal), item.kv_end);
  };
  const int tile_min_limit = limit(0);  // rows only see more keys further down the tile

  const int num_tiles = (item.kv_end - item.kv_begin + kBlockN - 1) / kBlockN;
  ring->Store(0, T::Ring::Lookup(rows, tile_key(0), item.kv_end, tid), tid);
  __syncthreads();
  Tile::template LoadRows<kBlockN, T::kThreads>(s_k, k_base, ring->Offsets(0), tid);
  CommitAsyncGroup();

  float o[kMTiles][T::kDTiles][4] = {};
  OnlineSoftmax<T::kNTiles> softmax[kMTiles];
  const float scale_log2 = p.sm_scale * kLog2e;

  for (int t = 0; t < num_tiles; ++t) {
    const int n0 = tile_key(t);
    WaitAsyncGroups<0>();
    __syncthreads();  // K tile t (and Q) visible to every warp
    Tile::template LoadRows<kBlockN, T::kThreads>(s_v, v_base, ring->Offsets(t), tid);
    CommitAsyncGroup();
    const int64_t next_offset = T::Ring::Lookup(rows, tile_key(t + 1), item.kv_end, tid);

    float s[kMTiles][T::kNTiles][4] = {};
#pragma unroll
    for (int ks = 0; ks < T::kKSteps; ++ks) {
      uint32_t a[kMTiles][4];
#pragma unroll
      for (int mt = 0; mt < kMTiles; ++mt) Tile::LoadA(a[mt], s_q, warp_row0 + 16 * mt, ks, lane);
#pragma unroll
      for (int np = 0; np < T::kNTiles / 2; ++np) {
        uint32_t b[4];
        Tile::LoadBT(b, s_k, np * 16, ks, lane);
#pragma unroll
        for (int mt = 0; mt < kMTiles; ++mt) {
          MmaBf16(s[mt][2 * np], a[mt], b[0], b[1]);
          MmaBf16(s[mt][2 * np + 1], a[mt], b[2], b[3]);
        }
      }
    }
    uint32_t p_frag[kMTiles][T::kNTiles / 2][4];
#pragma unroll
    for (int mt = 0; mt < kMTiles; ++mt) {
      if (n0 + kBlockN > tile_min_limit) {
        const int row = warp_row0 + 16 * mt + lane / 4;
        MaskScores(s[mt], n0, lane, limit(row), limit(row + 8));
      }
      float alpha[2];
      softmax[mt].Update(s[mt], scale_log2, alpha);
      RescaleAccumulator(o[mt], alpha);
      ScoresToA(s[mt], p_frag[mt]);
    }
    ring->Store(t + 1, next_offset, tid);

    WaitAsyncGroups<0>();
    __syncthreads();  // V tile t visible; every warp is done with K tile t; next offsets visible
    if (t + 1 < num_tiles) {
      Tile::template LoadRows<kBlockN, T::kThreads>(s_k, k_base, ring->Offsets(t + 1), tid);
    }
    CommitAsyncGroup();
#pragma unroll
    for (int ks = 0; ks < T::kNTiles / 2; ++ks) {
#pragma unroll
      for (int dp = 0; dp < T::kDTiles / 2; ++dp) {
        uint32_t b[4];
        Tile::LoadB(b, s_v, ks * 16, dp * 16, lane);
#pragma unroll
        for (int mt = 0; mt < kMTiles; ++mt) {
          MmaBf16(o[mt][2 * dp], p_frag[mt][ks], b[0], b[1]);
          MmaBf16(o[mt][2 * dp + 1], p_frag[mt][ks], b[2], b[3]);
        }
      }
    }
  }
  WaitAsyncGroups<0>();  // an item without keys still loaded Q

  const RowSink cta_sink = sink.ForItem(item.partial_row, seq, p.causal, kv_head * group);
#pragma unroll
  for (int mt = 0; mt < kMTiles; ++mt) {
    const float sums[2] = {softmax[mt].RowSum(0), softmax[mt].RowSum(1)};
    StoreRows(cta_sink, o[mt], softmax[mt].m, sums, item.row_begin + warp_row0 + 16 * mt, num_rows,
              0, lane, true);
  }
}

template <int kHeadDim, int kWarps, int kMTiles, int kBlockN>
struct Config {
  using T = PrefillTraits<kHeadDim, kWarps, kMTiles, kBlockN>;
  static constexpr auto kKernel = GqaPrefillKernel<kHeadDim, kWarps, kMTiles, kBlockN>;

  static cudaError_t Launch(const GqaParams& p, const DevicePlan& plan, cudaStream_t stream) {
    ATTN_CUDA_RETURN_IF_ERROR(AllowSharedMemory(kKernel, T::kSmemBytes));
    const RowSink sink = RowSink::ForGqa(p, plan);
    const dim3 grid = ItemHeadGrid(plan.num_items, p.cache.num_kv_heads);
    kKernel<<<grid, T::kThreads, T::kSmemBytes, stream>>>(p, plan.items, sink);
    ATTN_CUDA_RETURN_IF_LAUNCH_FAILED();
    return cudaSuccess;
  }

  static cudaError_t Tiling(KernelTiling* tiling) {
    return DescribeKernel(kKernel, T::kThreads, T::kSmemBytes, T::kBlockM, kBlockN, tiling);
  }
};

// Tile shapes per head_dim: 4 warps x 32 rows with 64-key tiles, as FlashAttention-2 does (32-
// and 48-key tiles spill less but measured 5-12% slower on H200, and double-buffering K/V with
// one barrier per tile measured 2-3% slower); head_dim 256 takes 16 rows per warp and 32-key
// tiles so its 128 accumulator floats per lane leave room. `variant` selects among a head_dim's
// shapes; each has one for now.
template <typename Fn>
cudaError_t WithConfig(int head_dim, int variant, Fn&& fn) {
  switch (head_dim * 10 + (variant < 0 ? 0 : variant)) {
    case 640:
      return fn(Config<64, 4, 2, 64>());
    case 1280:
      return fn(Config<128, 4, 2, 64>());
    case 2560:
      return fn(Config<256, 4, 1, 32>());
    default:
      return cudaErrorInvalidValue;
  }
}

}  // namespace

cudaError_t LaunchGqaPrefill(const GqaParams& p, const DevicePlan& plan, cudaStream_t stream,
                             int variant) {
  return WithConfig(p.cache.head_dim, variant,
                    [&](auto config) { return config.Launch(p, plan, stream); });
}

cudaError_t GqaPrefillTiling(int head_dim, int variant, KernelTiling* tiling) {
  return WithConfig(head_dim, variant, [&](auto config) { return config.Tiling(tiling); });
}

}  // namespace attn::cuda
