// MLA (DeepSeek-style, absorbed) paged prefill and decode on mma.sync tensor cores.
//
// Every query head attends to the same 576-wide cache rows: logits use all 576 columns (the
// 512-wide latent ckv and the 64-wide rope part kpe) and the output is P times the first 512. One
// CTA = one work item: 16 * kRowGroups packed rows (query token x head) against a key range.
// Warps form a kRowGroups x 4 grid: warp (r, c) computes the scores of row group r for keys
// [8c, 8c + 8) of each 32-key tile, and accumulates the output of row group r for columns
// [128c, 128c + 128) (a 16 x 512 float accumulator would not fit one warp's registers). The row
// maxima and sums cross the 4 warps of a row group through shared memory, and so does P.
#include <cuda_runtime.h>

#include "kernels/cuda/common/cuda_check.h"
#include "kernels/cuda/common/epilogue.cuh"
#include "kernels/cuda/common/launch.h"
#include "kernels/cuda/common/smem_tile.cuh"
#include "kernels/cuda/common/softmax_state.cuh"
#include "kernels/cuda/launchers.h"

namespace attn::cuda {
namespace {

constexpr int kBlockN = 32;
constexpr int kColWarps = 4;
constexpr int kOutCols = kMlaCkvDim / kColWarps;  // 128 output columns per warp

template <int kRowGroups, int kStages>
struct MlaTraits {
  static constexpr int kWarps = kRowGroups * kColWarps;
  static constexpr int kThreads = kWarps * 32;
  static constexpr int kBlockM = kRowGroups * 16;
  using Tile = SwizzledTile<kMlaTokenDim>;
  using PTile = PaddedTile<kBlockN>;
  static constexpr int kKSteps = kMlaTokenDim / 16;  // 36
  static constexpr int kDTiles = kOutCols / 8;       // 16
  static constexpr int kQElems = kBlockM * kMlaTokenDim;
  static constexpr int kTileElems = kBlockN * kMlaTokenDim;
  using Ring = RowOffsetRing<kBlockN>;
  using Exchange = SoftmaxExchange<kColWarps, kBlockM>;  // the row groups' 4 column warps
  static constexpr int kSmemBytes =
      (kQElems + kStages * kTileElems + kBlockM * PTile::kStride) * 2 + Exchange::kBytes +
      static_cast<int>(sizeof(Ring));
};

template <int kRowGroups, int kStages>
__global__ void __launch_bounds__(MlaTraits<kRowGroups, kStages>::kThreads)
    MlaKernel(const MlaParams p, const DeviceWorkItem* __restrict__ items, const RowSink sink) {
  using T = MlaTraits<kRowGroups, kStages>;
  using Tile = typename T::Tile;
  using PTile = typename T::PTile;
  extern __shared__ __align__(128) unsigned char smem[];
  bf16* s_q = reinterpret_cast<bf16*>(smem);
  bf16* s_kv = s_q + T::kQElems;
  bf16* s_p = s_kv + kStages * T::kTileElems;
  auto* s_exchange = reinterpret_cast<unsigned char*>(s_p + T::kBlockM * PTile::kStride);
  const auto exchange = T::Exchange::At(s_exchange);
  auto* ring = reinterpret_cast<typename T::Ring*>(s_exchange + T::Exchange::kBytes);

  const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32;
  const int rg = warp / kColWarps, cw = warp % kColWarps;
  const DeviceWorkItem& planned = items[blockIdx.x];
  const WorkItem item = planned.item;
  const int heads = p.num_heads;
  const SeqExtent seq = ExtentOf(planned, p.batch);
  const int num_rows = seq.q_len * heads;

  // Query rows: q_nope (chunks 0..63) then q_pe (chunks 64..71).
  for (int idx = tid; idx < T::kBlockM * Tile::kChunks; idx += T::kThreads) {
    const int r = idx / Tile::kChunks, c = idx % Tile::kChunks;
    const int packed = item.row_begin + r;
    const bool valid = packed < num_rows;
    const int64_t qrow = (int64_t{seq.q_begin} + packed / heads) * heads + packed % heads;
    const bf16* src = c < kMlaCkvDim / 8 ? p.q_nope + qrow * kMlaCkvDim + c * 8
                                         : p.q_pe + qrow * kMlaKpeDim + (c - kMlaCkvDim / 8) * 8;
    CopyAsync16(s_q + Tile::Offset(r, c), valid ? src : p.q_nope, valid);
  }

  const PagedRows rows = MlaRows(p.cache, p.batch, seq);

  const int num_tiles = (item.kv_end - item.kv_begin + kBlockN - 1) / kBlockN;
  auto lookup = [&](int t) {
    return T::Ring::Lookup(rows, item.kv_begin + t * kBlockN, item.kv_end, tid);
  };
  auto load_tile = [&](int t) {
    if (t < num_tiles) {
      Tile::template LoadRows<kBlockN, T::kThreads>(s_kv + (t % kStages) * T::kTileElems, rows.base,
                                                    ring->Offsets(t), tid);
    }
    CommitAsyncGroup();
  };
#pragma unroll
  for (int s = 0; s < kStages - 1; ++s) {  // Q rides in the first group
    ring->Store(s, lookup(s), tid);
    __syncthreads();
    load_tile(s);
  }
  ring->Store(kStages - 1, lookup(kStages - 1), tid);

  const int row_g = rg * 16 + lane / 4;  // this lane's rows in the tile: row_g and row_g + 8
  auto limit = [&](int r) {
    return min(VisibleKeys(seq, (item.row_begin + r) / heads, p.causal), item.kv_end);
  };
  const int limit_g = limit(row_g), limit_g8 = limit(row_g + 8);
  const int tile_min_limit = limit(0);
  const float scale_log2 = p.sm_scale * kLog2e;

  float o[T::kDTiles][4] = {};
  // Each warp's state covers its quarter of every tile's keys, against maxima shared by the row
  // group's 4 warps (exchanged each tile), so the warps' sums simply add up at the end.
  OnlineSoftmax<1> softmax;

  for (int t = 0; t < num_tiles; ++t) {
    WaitAsyncGroups<kStages - 2>();
    __syncthreads();  // tile t visible; every warp is done with tile t - 1, s_p and the maxima
    load_tile(t + kStages - 1);
    const int64_t next_offset = lookup(t + kStages);  // stored after this tile's math
    const bf16* s_k = s_kv + (t % kStages) * T::kTileElems;
    const int key0 = cw * 8;
    const int n0 = item.kv_begin + t * kBlockN + key0;

    // Scores of this warp's 16 rows x 8 keys over all 576 columns.
    // Two accumulators halve the chain of dependent MMAs.
    float s[1][4] = {}, s_odd[4] = {};
#pragma unroll 6
    for (int ks = 0; ks < T::kKSteps; ks += 2) {
      uint32_t b[4], a[4];
      Tile::LoadBT8(b, s_k, key0, ks, lane);
      Tile::LoadA(a, s_q, rg * 16, ks, lane);
      MmaBf16(s[0], a, b[0], b[1]);
      Tile::LoadA(a, s_q, rg * 16, ks + 1, lane);
      MmaBf16(s_odd, a, b[2], b[3]);
    }
#pragma unroll
    for (int c = 0; c < 4; ++c) s[0][c] += s_odd[c];
    if (n0 + 8 > tile_min_limit) MaskScores(s, n0, lane, limit_g, limit_g8);
    const float local_max[2] = {QuadMax(softmax.TileMax(s, 0, scale_log2)),
                                QuadMax(softmax.TileMax(s, 1, scale_log2))};
    if ((lane & 3) == 0) {
      exchange.PublishMax(cw, row_g, local_max[0]);
      exchange.PublishMax(cw, row_g + 8, local_max[1]);
    }
    __syncthreads();

    float alpha[2];
#pragma unroll
    for (int x = 0; x < 2; ++x) {
      const auto r = softmax.Rescale(x, exchange.MaxOf(row_g + 8 * x));
      softmax.Exponentiate(s, x, scale_log2, r);
      alpha[x] = r.alpha;
      *reinterpret_cast<uint32_t*>(s_p + PTile::Offset(row_g + 8 * x, key0 + 2 * (lane & 3))) =
          PackBf16(s[0][2 * x], s[0][2 * x + 1]);
    }
    __syncthreads();  // P and every warp's reads of this tile's maxima done
    RescaleAccumulator(o, alpha);
    // O (16 rows x this warp's 128 columns) += P (16 x 32 keys) * V (first 512 columns of K).
#pragma unroll
    for (int ks = 0; ks < kBlockN / 16; ++ks) {
      uint32_t a[4];
      PTile::LoadA(a, s_p, rg * 16, ks, lane);
#pragma unroll
      for (int dp = 0; dp < T::kDTiles / 2; ++dp) {
        uint32_t b[4];
        Tile::LoadB(b, s_k, ks * 16, cw * kOutCols + dp * 16, lane);
        MmaBf16(o[2 * dp], a, b[0], b[1]);
        MmaBf16(o[2 * dp + 1], a, b[2], b[3]);
      }
    }
    ring->Store(t + kStages, next_offset, tid);
  }
  WaitAsyncGroups<0>();

  // The row's sum over all keys: the 4 column warps' sums (same maxima, so no reweighting).
#pragma unroll
  for (int x = 0; x < 2; ++x) {
    const float row_sum = softmax.RowSum(x);
    if ((lane & 3) == 0) exchange.Publish(cw, row_g + 8 * x, softmax.m[x], row_sum);
  }
  __syncthreads();
  const float sums[2] = {exchange.SumOf(row_g), exchange.SumOf(row_g + 8)};
  const RowSink cta_sink = sink.ForItem(item.partial_row, seq, p.causal, 0);
  StoreRows(cta_sink, o, softmax.m, sums, item.row_begin + rg * 16, num_rows, cw * kOutCols, lane,
            cw == 0);
}

// Heads per CTA: 16 rows per row group; many heads (or prefill's many tokens) take 4 row groups
// so each cache tile read from L2 serves 64 rows.
template <int kRowGroups, int kStages>
struct Config {
  using T = MlaTraits<kRowGroups, kStages>;
  static constexpr auto kKernel = MlaKernel<kRowGroups, kStages>;

  static cudaError_t Launch(const MlaParams& p, const DevicePlan& plan, cudaStream_t stream) {
    ATTN_CUDA_RETURN_IF_ERROR(AllowSharedMemory(kKernel, T::kSmemBytes));
    const RowSink sink = RowSink::ForMla(p, plan);
    kKernel<<<plan.num_items, T::kThreads, T::kSmemBytes, stream>>>(p, plan.items, sink);
    ATTN_CUDA_RETURN_IF_LAUNCH_FAILED();
    return cudaSuccess;
  }

  static cudaError_t Tiling(KernelTiling* tiling) {
    // Each chunk of each sequence costs a 16 x 512 float partial write and read: 1024-key chunks
    // keep that under 3% of the KV bytes (measured on H200: 2.82 TB/s vs 2.36 with 256).
    tiling->min_chunk_len = 1024;
    return DescribeKernel(kKernel, T::kThreads, T::kSmemBytes, T::kBlockM, kBlockN, tiling);
  }
};

using SmallConfig = Config<1, 2>;  // 16 rows, 2 x 36 KiB stages: 92 KiB, 2 CTAs per SM
using LargeConfig = Config<4, 2>;  // 64 rows, 72 KiB of queries + 2 stages: 150 KiB

bool UseLarge(int num_heads, bool decode) { return !decode || num_heads > 16; }

}  // namespace

cudaError_t LaunchMla(const MlaParams& p, const DevicePlan& plan, cudaStream_t stream) {
  return UseLarge(p.num_heads, p.batch.qo_indptr == nullptr) ? LargeConfig::Launch(p, plan, stream)
                                                             : SmallConfig::Launch(p, plan, stream);
}

cudaError_t MlaTiling(int num_heads, bool decode, KernelTiling* tiling) {
  return UseLarge(num_heads, decode) ? LargeConfig::Tiling(tiling) : SmallConfig::Tiling(tiling);
}

}  // namespace attn::cuda
