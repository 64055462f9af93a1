// GQA paged prefill for Hopper (sm_90a): wgmma tensor cores fed by a producer warpgroup,
// FlashAttention-3 style.
//
// One CTA = one work item (kernels/cuda/plan.h) x one KV head, as in the portable kernel: kBlockM
// = 128 packed rows (query token x query head of the KV head) against keys [kv_begin, kv_end) of
// one sequence, in tiles of kBlockN keys. Three warpgroups:
//   - the producer (warpgroup 0, few registers) copies the Q tile once and then each K and V tile
//     from its pages into a ring of swizzled tiles (three stages; two at head_dim 256); the
//     copies of a stage complete on the stage's "full" mbarrier, and the producer refills a stage
//     once both consumers have arrived on its "empty" mbarrier. The default takes whole tiles by
//     TMA where the page size allows (kTmaKv below); elsewhere cp.async (a tile of 128 keys spans
//     128 pages at page size 1 and does not align with odd page sizes): each lane looks up one
//     row's page and its row group shares the offsets by shuffles, and a lane gathers all of a
//     tile's row offsets before it issues the tile's plain copies (about 8 instructions per
//     16-byte copy instead of 22 pass by pass: 1.3-1.5x faster on the H200).
//   - two consumers (warpgroups 1, 2; 64 rows each) compute S = Q K^T with wgmma from shared
//     memory, the online softmax in registers (the accumulator fragment is the mma.sync one, so
//     the portable OnlineSoftmax / MaskScores / StoreRows apply), and O += P V with P as the
//     register A operand and V as the transposed shared-memory B operand.
// The schedule: tile t's S and tile t-1's P V GEMMs are issued back to back and tile t's softmax
// runs while the P V GEMM is in flight, the two consumer warpgroups issuing their GEMMs freely
// (FA3's intra-warpgroup overlap, without its pingpong). The schedules it beat on the H200 (each
// GEMM waited for, the warpgroups taking turns at the GEMMs, two stages, copies pass by pass,
// persistent CTAs: variants 10-14, 18, 22 and 23) are gone; bench/RESULTS.md records each.
//
// TMA variant (kTmaKv): key tiles come as TMA boxes, one per page and 64-column block (page sizes
// 16-128 that divide the tile) or one per column block (page sizes that are multiples of it), each
// producer warp's elected lane issuing every fourth box, instead of 128 lanes issuing 32 cp.async
// each after gathering their row offsets (it won 5.5-9% on the H200,
// bench/RESULTS.md; 26 below is 24 with lean tiles). With cp.async (19) each producer warp issues
// ~340 instructions per tile, a quarter of all issued on its SM sub-partition, in bursts when a
// stage frees (during the consumers' softmax); here ~170, mostly on the uniform datapath. TMA
// writes through the async proxy, so the consumers no longer fence (MEMBAR) before each GEMM. A
// work's last tile, where it reaches past the sequence's keys (slots there may hold NaN), is copied
// by every producer lane as before; page sizes TMA cannot cut tiles from run the copying twin.
//
// Causal block skipping is the planner's (kv_end is cut to the keys the tile's last row sees);
// masking runs only on the tiles that cross a row's limit: with 128 packed rows of 32 tokens
// (group 4) and 128-key tiles that is each work's last tile alone, behind a branch the others
// skip. Split-KV items write float32 partials through the common epilogue for the merge kernel.
//
// Lean tiles (kLeanTiles, variant 26): the consumer loop's path from a P V GEMM's end to the
// next S GEMM's issue, which both warpgroups walk at once without the turns, carried work that
// did not need to be there. In 24's SASS the softmax ran row after row, each behind a branch on
// the scale's sign, with a 17-deep chain of maxima and two shuffles before its first exponential
// (one consumer warp of each warpgroup per SM sub-partition hides little of it), and O's 64
// multiplies sat between the P V wait and the next S. 26 takes the rows in one pass (maxima as
// trees, row g + 8's chain under row g's exponentials) and rescales O under the S GEMM. The
// default since it beat 24 on the H200 where rows are short (8 x 512 on 1024 -3%, 4096 causal
// -1.5%); on the 1117-on-71488 chunk's 188-tile items it is 2% slower: with the two warpgroups
// drifting apart over long items the gap it closes is hidden anyway, and O's multiplies between
// a warpgroup's S and its P V let the other's S in ahead (bench/RESULTS.md, variants 27-29).
//
// Lazy rescale (kLazyRescale, variant 30, the default): a consumer warp issues its tile loop's
// ~560 instructions in order, and the next GEMM waits for them: every instruction added to the
// loop, before or after the GEMMs' issue, cost ~4.5 cycles (the FMA-pipe exponentials, the row
// sums moved under the S GEMM, both removed: +10 to +17%). So a row's maximum moves only where a
// tile's passes it by more than 8 (log2; p stays below 2^8, the lse m + log2(sum) is the same),
// O's factor is then almost always exactly 1 after a row's first tiles, and the warp skips O's 64
// multiplies a lane on a vote (8192 causal -3.6% on the H100). Summing P on the tensor cores
// (eight N = 8 wgmmas beside each P V) instead of the 64 additions cost more than it saved (+6%),
// and folding each k-step's descriptor from the tile's saved ~40 uniform instructions a tile and
// nothing measurable (bench/RESULTS.md, 2026-12-06).
#include <cuda.h>  // CUtensorMap
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>

#include "kernels/cuda/common/cuda_check.h"
#include "kernels/cuda/common/epilogue.cuh"
#include "kernels/cuda/common/launch.h"
#include "kernels/cuda/common/paged_kv.cuh"
#include "kernels/cuda/common/phase_stamps.cuh"
#include "kernels/cuda/common/softmax_state.cuh"
#include "kernels/cuda/sm90/hopper.cuh"
#include "kernels/cuda/sm90/launchers_sm90.h"
#include "kernels/cuda/sm90/wgmma.cuh"

namespace attn::cuda {
namespace sm90 {
namespace {

constexpr int kBlockM = 128;  // packed rows per CTA: 64 per consumer warpgroup
constexpr int kThreads = 384;
// Registers per lane at launch: the most __launch_bounds__(kThreads, 1) leaves (ptxas allocates
// in steps of 8), which is the pool setmaxnreg redistributes.
constexpr int kLaunchRegisters = 65536 / kThreads / 8 * 8;
// The smallest page TMA boxes are cut to (smaller pages run the copying twin).
constexpr int kMinTmaPage = 16;

// Where the stamped variant writes its records (SetGqaPrefillPhaseStamps).
__device__ PhaseStampBuffer g_phase_stamps;

// One kernel instance: head_dim and three switches.
//   kTmaKv: key tiles inside the sequence come by TMA (launched with a tensor map of the cache
//     where the page size allows; CopiesTwin otherwise).
//   kLeanTiles: less on the path between one GEMM's end and the next one's issue. The softmax
//     takes both of a lane's rows in one straight-line pass where the scale is positive
//     (OnlineSoftmax::UpdatePositiveScale); O's rescale by tile t - 1's factor runs after tile
//     t's S GEMM is issued; and the work's last P V, which nothing overlaps, skips the half of
//     the tile past its keys where it ends there (the causal diagonal).
//   kStamps: the CTA writes its phase stamps (one record, at its work's index).
//   kLazyRescale: the lean softmax moves a row's maximum only where a tile's passes it by more
//     than 8 (log2; OnlineSoftmax::RescaleLazy), so that after a row's first tiles O's factor is
//     almost always exactly 1, and a consumer warp skips O's 64 multiplies a lane where all of
//     its rows' factors are (a vote).
// Key tiles: 128 keys for head_dim 64 and 128 (Q + three stages of K and V: 224 KiB at 128); 64
// for head_dim 256, whose O takes 128 registers per lane, in two stages (192 KiB).
template <int kHeadDim_, bool kTmaKv_, bool kLeanTiles_, bool kStamps_ = false,
          bool kLazyRescale_ = false>
struct Traits {
  static constexpr int kHeadDim = kHeadDim_;
  static constexpr bool kTmaKv = kTmaKv_;
  static constexpr bool kLeanTiles = kLeanTiles_;
  static constexpr bool kStamps = kStamps_;
  static constexpr bool kLazyRescale = kLazyRescale_;
  static_assert(!kLazyRescale || kLeanTiles, "the lazy rescale is the lean softmax's");
  using CopiesTwin = Traits<kHeadDim_, false, kLeanTiles_, kStamps_, kLazyRescale_>;
  static constexpr int kBlockN = kHeadDim == 256 ? 64 : 128;
  static constexpr int kStages = kHeadDim == 256 ? 2 : 3;
  // setmaxnreg moves registers within the CTA's pool: 384 lanes x 168 = 128 x 56 + 256 x 224
  // (the producer's copies hold a tile's row offsets). A split asking for more than the pool
  // leaves the consumers waiting in setmaxnreg forever.
  static constexpr int kProducerRegisters = 56;
  static constexpr int kConsumerRegisters = 224;
  static constexpr int kPoolRegisters = 128 * kProducerRegisters + 256 * kConsumerRegisters;
  static_assert(kPoolRegisters <= kThreads * kLaunchRegisters);
  static constexpr int kChunks = kHeadDim / 8;        // 16-byte chunks per row
  static constexpr int kRowsPerPass = 128 / kChunks;  // rows the producer copies per pass
  static constexpr int kKvPasses = kBlockN / kRowsPerPass;
  static constexpr int kQPasses = kBlockM / kRowsPerPass;
  static_assert(kKvPasses <= kChunks, "one producer lane per row of a pass group holds its page");
  static constexpr int kQBytes = kBlockM * kHeadDim * 2;
  static constexpr int kTileBytes = kBlockN * kHeadDim * 2;
  static constexpr int kBarriers = 2 + 4 * kStages;
  // 1 KiB of slack to start the tiles on the swizzle pattern's 1024-byte period.
  static constexpr int kSmemBytes = 1024 + kQBytes + 2 * kStages * kTileBytes + 8 * kBarriers;
  static_assert(kSmemBytes <= 227 * 1024, "shared memory of one CTA");
};

// Shared-memory map (32-bit shared addresses): Q, K stages, V stages, then the mbarriers.
template <typename T>
struct Smem {
  uint32_t base;  // 1024-byte aligned

  __device__ uint32_t Q() const { return base; }
  __device__ uint32_t K(int stage) const { return base + T::kQBytes + stage * T::kTileBytes; }
  __device__ uint32_t V(int stage) const {
    return base + T::kQBytes + (T::kStages + stage) * T::kTileBytes;
  }
  __device__ uint32_t Barrier(int i) const {
    return base + T::kQBytes + 2 * T::kStages * T::kTileBytes + 8 * i;
  }
  __device__ uint32_t QFull() const { return Barrier(0); }
  __device__ uint32_t KFull(int stage) const { return Barrier(1 + stage); }
  __device__ uint32_t KEmpty(int stage) const { return Barrier(1 + T::kStages + stage); }
  __device__ uint32_t VFull(int stage) const { return Barrier(1 + 2 * T::kStages + stage); }
  __device__ uint32_t VEmpty(int stage) const { return Barrier(1 + 3 * T::kStages + stage); }
  __device__ uint32_t QEmpty() const { return Barrier(1 + 4 * T::kStages); }
};

// The stamped variant's stamp of `slot` (the others compile nothing): the SM's clock, or `value`.
// Record `record` is the work's index.
template <typename T>
__device__ __forceinline__ void Stamp(int record, PhaseSlot slot) {
  if constexpr (T::kStamps) StampClock(g_phase_stamps, record, slot);
}
template <typename T>
__device__ __forceinline__ void Stamp(int record, PhaseSlot slot, uint64_t value) {
  if constexpr (T::kStamps) WriteStamp(g_phase_stamps, record, slot, value);
}

// What both roles know of the CTA's work.
struct Work {
  int index;  // item index * heads + KV head
  WorkItem item;
  SeqExtent seq;
  int kv_head;
  int group;
  int num_rows;   // packed rows of the sequence
  int num_tiles;  // key tiles of the item
};

// Work index `index` (item-major: item index / heads, KV head index % heads).
template <typename T>
__device__ __forceinline__ Work MakeWork(const GqaParams& p, const DeviceWorkItem* items,
                                         int index) {
  const int heads = p.cache.num_kv_heads;
  Work w;
  w.index = index;
  const DeviceWorkItem& planned = items[index / heads];
  w.item = planned.item;
  w.seq = ExtentOf(planned, p.batch);
  w.kv_head = index % heads;
  w.group = p.num_qo_heads / heads;
  w.num_rows = w.seq.q_len * w.group;
  w.num_tiles = max(0, (w.item.kv_end - w.item.kv_begin + T::kBlockN - 1) / T::kBlockN);
  return w;
}

// The leading key tiles of a TMA variant's work that come by TMA: the whole tiles inside the
// sequence's keys (past kv_end they are real, finite keys the mask hides), when the work starts
// on the tile grid the pages are cut along (the planner's works all do). The rest, at most the
// last tile, is copied.
template <typename T>
__device__ __forceinline__ int TmaTiles(const Work& w) {
  if (w.item.kv_begin % T::kBlockN != 0) return 0;
  return max(0, min(w.num_tiles, (w.seq.kv_len - w.item.kv_begin) / T::kBlockN));
}

// Warpgroup 0: all copies into shared memory. kv_map: the cache's tensor map (kTmaKv).
template <typename T>
__device__ __forceinline__ void Produce(const GqaParams& p, const Work& w, const Smem<T>& s,
                                        const CUtensorMap* kv_map, int tid) {
  constexpr int kBlockN = T::kBlockN;
  const int chunk = tid % T::kChunks;  // this lane's 16 bytes of every row it copies
  const int row0 = tid / T::kChunks;   // and its first row; then every kRowsPerPass-th
  const int group_lane0 = (tid % 32) & ~(T::kChunks - 1) & 31;  // lanes copying the same rows
  if (tid == 0)
    Stamp<T>(w.index, PhaseSlot::kSmAndTiles, SmId() | uint64_t{uint32_t(w.num_tiles)} << 32);
  if (w.num_tiles == 0) return;  // nothing to copy; the consumers skip it as well

  // The consumers' release of the Q buffer, which a CTA fills once: returns at once. (Kept from
  // the persistent CTAs, as is the consumers' arrival, so that the kernels' code stays as
  // measured.)
  BarrierWait(s.QEmpty(), 1);
  for (int i = 0; i < T::kQPasses; ++i) {
    const int r = row0 + i * T::kRowsPerPass;
    const int packed = w.item.row_begin + r;
    const bool valid = packed < w.num_rows;  // rows past the sequence are zero-filled
    const int token = packed / w.group, head = w.kv_head * w.group + packed % w.group;
    const bf16* src =
        p.q + ((int64_t{w.seq.q_begin} + token) * p.num_qo_heads + head) * T::kHeadDim + chunk * 8;
    CopyAsync16(s.Q() + SwizzledOffset(kBlockM, r, chunk), valid ? src : p.q, valid);
  }
  BarrierArriveOnCopies(s.QFull());
  if (tid == 0) Stamp<T>(w.index, PhaseSlot::kQIssuedClock);

  const PagedRows rows = GqaKeyRows(p.cache, p.batch, w.seq, w.kv_head);
  const bf16* k_base = rows.base + chunk * 8;
  const bf16* v_base = k_base + GqaValueOffset(p.cache);
  // Lane `chunk` of a row group looks up the row its group copies in pass `chunk`. Rows past the
  // key range copy the range's last key again: real, finite data the consumers mask, so every
  // copy is a plain one. (Never the slot itself: a NaN-poisoned slot would survive a zero softmax
  // weight.)
  // The page-table read is issued a tile ahead and kept as read: the row's offset is computed
  // from it in the tile's own iteration. Computed at the lookup, it made the producer wait there
  // for the read before it issued the copies of the tile before.
  struct Lookup {
    int32_t page_id;
    int slot;
  };
  auto lookup = [&](int t) -> Lookup {
    const int key = w.item.kv_begin + t * kBlockN + row0 + chunk * T::kRowsPerPass;
    const bool used = chunk < T::kKvPasses && t < w.num_tiles;
    Lookup l;
    int page;
    rows.PageSlot(min(key, w.item.kv_end - 1), &page, &l.slot);
    l.page_id = used ? rows.pages[page] : 0;
    return l;
  };
  // (No page id is negative: the -1 is what the copies pass by pass zero-filled. Without the
  // test ptxas schedules the producer differently, so it stays until that is measured.)
  auto offset_of = [&](const Lookup& l) -> int64_t {
    return l.page_id >= 0 ? rows.OffsetIn(l.page_id, l.slot) : -1;
  };
  // All of the tile's row offsets first, then all its copies: the shuffles' and the address
  // arithmetic's latencies overlap instead of adding up pass by pass.
  auto copy_tile = [&](uint32_t tile, const bf16* base, int64_t offset) {
    int64_t row_offset[T::kKvPasses];
#pragma unroll
    for (int i = 0; i < T::kKvPasses; ++i) {
      row_offset[i] = __shfl_sync(0xffffffffu, offset, group_lane0 + i);
    }
#pragma unroll
    for (int i = 0; i < T::kKvPasses; ++i) {
      const int r = row0 + i * T::kRowsPerPass;
      CopyAsync16(tile + SwizzledOffset(kBlockN, r, chunk), base + row_offset[i]);
    }
  };

  if constexpr (T::kTmaKv) {
    // Boxes of a tile: one per page and column block (pages that divide the tile) or one per
    // column block (pages the tile divides). Producer warp `warp` issues boxes warp, warp + 4, ...
    // and makes its warp's one arrival of the four each full barrier counts, with its boxes'
    // bytes. Every warp follows the ring itself. The warp runs this converged, with the warp index
    // and the page ids it reads warp-uniform, and one elected lane issues: so the compiler keeps
    // the boxes' coordinates in uniform registers (~5 instructions a box; from one lane of a
    // diverged warp it was ~20, the operands moved to uniform registers lane by lane).
    constexpr int kColumnBlocks = T::kHeadDim / 64;
    constexpr int kMaxWarpBoxes = kBlockN / kMinTmaPage * kColumnBlocks / 4;
    const int warp = __shfl_sync(0xffffffffu, tid / 32, 0);
    const int tma_tiles = TmaTiles<T>(w);
    if (tma_tiles > 0) {
      if (warp == 0 && ElectOne()) PrefetchTensorMap(kv_map);
      const int box_rows = min(rows.page_size, kBlockN);
      const int boxes = kBlockN / box_rows * kColumnBlocks;
      const int warp_boxes = boxes > warp ? (boxes - warp + 3) / 4 : 0;
      const uint32_t warp_bytes = warp_boxes * box_rows * 128;
      const int c0 = w.kv_head * T::kHeadDim;
      // The map's row of K in the layer's page `id` is 2 (layer_row0 + id) (+ 1 for V).
      const int layer_row0 = w.seq.layer * p.cache.num_pages;
      // Tile t's first page (index into the sequence's pages) and its first slot there (nonzero
      // only for pages larger than the tile), stepped tile by tile.
      int page, slot;
      rows.PageSlot(w.item.kv_begin, &page, &slot);
      auto step = [&](int& tile_page, int& tile_slot) {
        if (box_rows == kBlockN) {
          tile_slot += kBlockN;
          if (tile_slot == rows.page_size) {
            tile_slot = 0;
            ++tile_page;
          }
        } else {
          tile_page += kBlockN / box_rows;
        }
      };
      // Box warp + 4 j of a tile is in page warp / kColumnBlocks + 4 j / kColumnBlocks of it (the
      // column blocks divide 4): this warp's boxes' map rows (of K) in the tile at `tile_page`.
      const int32_t* warp_pages = rows.pages + warp / kColumnBlocks;
      auto read_rows = [&](int t, int tile_page, int(&map_rows)[kMaxWarpBoxes]) {
#pragma unroll
        for (int j = 0; j < kMaxWarpBoxes; ++j) {
          const bool used = t < tma_tiles && warp + 4 * j < boxes;
          map_rows[j] = used ? 2 * (layer_row0 + warp_pages[tile_page + 4 * j / kColumnBlocks]) : 0;
        }
      };
      int map_rows[kMaxWarpBoxes];
      read_rows(0, page, map_rows);
      for (int t = 0; t < tma_tiles; ++t) {
        const int stage = t % T::kStages;
        const uint32_t parity = ((t / T::kStages) & 1) ^ 1;
        // The next tile's page ids are read while this one is issued.
        int next_page = page, next_slot = slot;
        step(next_page, next_slot);
        int next[kMaxWarpBoxes];
        read_rows(t + 1, next_page, next);
        auto issue = [&](uint32_t tile, int half, uint32_t bar) {
          if (ElectOne()) {
            if (warp_bytes > 0) {
              BarrierArriveExpectTx(bar, warp_bytes);
            } else {
              BarrierArrive(bar);
            }
#pragma unroll
            for (int j = 0; j < kMaxWarpBoxes; ++j) {
              const int b = warp + 4 * j;
              if (b < boxes) {
                const int cb = b % kColumnBlocks, row = b / kColumnBlocks * box_rows;
                TmaLoad3d(tile + (cb * kBlockN + row) * 128, kv_map, c0 + cb * 64, slot,
                          map_rows[j] + half, bar);
              }
            }
          }
          __syncwarp();
        };
        BarrierWait(s.KEmpty(stage), parity);
        issue(s.K(stage), 0, s.KFull(stage));
        BarrierWait(s.VEmpty(stage), parity);
        issue(s.V(stage), 1, s.VFull(stage));
        page = next_page;
        slot = next_slot;
#pragma unroll
        for (int j = 0; j < kMaxWarpBoxes; ++j) map_rows[j] = next[j];
      }
    }
    // The copied tail: once the stage is free each warp's lanes copy their rows of K and V and
    // wait for their copies, and one lane makes the warp's arrival on both full barriers.
    for (int t = tma_tiles; t < w.num_tiles; ++t) {
      const int stage = t % T::kStages;
      const uint32_t parity = ((t / T::kStages) & 1) ^ 1;
      BarrierWait(s.KEmpty(stage), parity);
      BarrierWait(s.VEmpty(stage), parity);
      const int64_t offset = offset_of(lookup(t));
#pragma unroll 1
      for (int i = 0; i < T::kKvPasses; ++i) {
        const int64_t row_offset = __shfl_sync(0xffffffffu, offset, group_lane0 + i);
        const uint32_t dst = SwizzledOffset(kBlockN, row0 + i * T::kRowsPerPass, chunk);
        CopyAsync16(s.K(stage) + dst, k_base + row_offset);
        CopyAsync16(s.V(stage) + dst, v_base + row_offset);
      }
      WaitAllCopies();
      __syncwarp();
      if (tid % 32 == 0) {
        BarrierArrive(s.KFull(stage));
        BarrierArrive(s.VFull(stage));
      }
    }
  } else {
    Lookup current = lookup(0);
    for (int t = 0; t < w.num_tiles; ++t) {
      const int stage = t % T::kStages;
      const uint32_t parity = ((t / T::kStages) & 1) ^ 1;  // the consumers' release of this stage
      const Lookup next = lookup(t + 1);  // the page-table read flies while this tile is issued
      const int64_t offset = offset_of(current);  // read a tile ago
      BarrierWait(s.KEmpty(stage), parity);
      copy_tile(s.K(stage), k_base, offset);
      BarrierArriveOnCopies(s.KFull(stage));
      BarrierWait(s.VEmpty(stage), parity);
      copy_tile(s.V(stage), v_base, offset);
      BarrierArriveOnCopies(s.VFull(stage));
      current = next;
    }
  }
  if (tid == 0) Stamp<T>(w.index, PhaseSlot::kProducedClock);
}

// S = Q K^T over head_dim for a consumer warpgroup's 64 rows of Q (at q) and a key tile (at k):
// k-step ks reads column block ks / 4 of Q and K, 32 bytes further per step inside it. Over the
// tile's first kN keys.
template <typename T, int kN>
__device__ __forceinline__ void IssueQk(float (&d)[kN / 8][4], uint32_t q, uint32_t k) {
  static_assert(kN <= T::kBlockN);
#pragma unroll
  for (int ks = 0; ks < T::kHeadDim / 16; ++ks) {
    const uint32_t step = (ks % 4) * 32;
    const uint32_t a = q + (ks / 4) * kBlockM * 128 + step;
    const uint32_t b = k + (ks / 4) * T::kBlockN * 128 + step;
    Wgmma<kN>::SS(d, KMajorDescriptor(a), KMajorDescriptor(b), ks > 0 ? 1u : 0u);
  }
}

// O += P V over the first kSteps 16-key steps of a value tile (at v): k-step ks covers keys
// [16 ks, 16 ks + 16), 16 rows of 128 bytes of V.
template <typename T, int kSteps>
__device__ __forceinline__ void IssuePv(float (&o)[T::kHeadDim / 8][4],
                                        const uint32_t (&pf)[T::kBlockN / 16][4], uint32_t v) {
#pragma unroll
  for (int ks = 0; ks < kSteps; ++ks) {
    Wgmma<T::kHeadDim>::RSTransB(o, pf[ks], MnMajorDescriptor(v + ks * 2048, T::kBlockN * 128));
  }
}

// Warpgroups 1 and 2 (`cwg` 0, 1): rows [64 cwg, 64 cwg + 64) of the tile.
template <typename T>
__device__ __forceinline__ void Consume(const GqaParams& p, const Work& w, const Smem<T>& s,
                                        int ctid, RowSink sink) {
  constexpr int kBlockN = T::kBlockN;
  constexpr int kNTiles = kBlockN / 8;      // 8-key column tiles of S
  constexpr int kDTiles = T::kHeadDim / 8;  // 8-wide column tiles of O
  constexpr int kPSteps = kBlockN / 16;
  const int cwg = ctid / 128, warp = (ctid / 32) % 4, lane = ctid % 32;
  const int warp_row0 = 64 * cwg + 16 * warp;  // first tile row of this warp

  auto limit = [&](int r) {
    return min(VisibleKeys(w.seq, (w.item.row_begin + r) / w.group, p.causal), w.item.kv_end);
  };
  const int limit_g = limit(warp_row0 + lane / 4), limit_g8 = limit(warp_row0 + lane / 4 + 8);
  const int warp_min_limit = limit(warp_row0);  // rows further down see more keys

  float o[kDTiles][4] = {};
  OnlineSoftmax<kNTiles> softmax;
  const float scale_log2 = p.sm_scale * kLog2e;

  const uint32_t q_start = s.Q() + cwg * 64 * 128;
  // The keys of the work's last tile, 1..kBlockN: fewer where the work ends inside it (the
  // causal diagonal: a 128-row tile of 32 tokens x 4 heads ends 32, 64, 96 or 128 keys into it).
  const int last_keys = w.item.kv_end - w.item.kv_begin - (w.num_tiles - 1) * kBlockN;
  // kLeanTiles: where the last tile has at most 64 keys its P V runs the first four 16-key
  // steps (the p past the keys are 0, their V rows finite). That last P V is waited for
  // with nothing under it, and half the works of a causal launch of 32-token tiles end so.
  // (Its S stays whole: an N = 64 GEMM there, however its accumulator was arranged, made
  // ptxas serialize every wgmma of the kernel, C7515.)
  constexpr bool kNarrowLast = T::kLeanTiles && kBlockN == 128;
  const bool narrow_last = kNarrowLast && last_keys <= 64;
  auto narrow = [&](int t) { return narrow_last && t == w.num_tiles - 1; };
  auto issue_qk = [&](float(&acc)[kNTiles][4], int stage) {
    IssueQk<T, kBlockN>(acc, q_start, s.K(stage));
  };
  // O += P V; the first half of the tile's keys for a narrowed tile (two straight-line paths: a
  // branch around each k-step made ptxas fence before each; these two cost it one fence and a
  // dummy wgmma, once per work).
  auto issue_pv = [&](const uint32_t(&pf)[kPSteps][4], int stage, int t) {
    if constexpr (kNarrowLast) {
      if (narrow(t)) {
        IssuePv<T, kPSteps / 2>(o, pf, s.V(stage));
        return;
      }
    }
    IssuePv<T, kPSteps>(o, pf, s.V(stage));
  };
  // The softmax of a tile; kLeanTiles takes UpdatePositiveScale's straight-line pass where it
  // applies (a branch on a launch constant, taken the same way by every lane). Not at head_dim
  // 256, whose O takes 128 registers a lane: there the pass spilled.
  const bool lean_pass = T::kLeanTiles && T::kHeadDim <= 128 && scale_log2 > 0.f;
  auto update = [&](OnlineSoftmax<kNTiles>& sm, float(&acc)[kNTiles][4], float(&alpha)[2]) {
    if (lean_pass) {
      sm.template UpdatePositiveScale<T::kLazyRescale>(acc, scale_log2, alpha);
    } else {
      sm.Update(acc, scale_log2, alpha);
    }
  };
  auto release = [&](uint32_t bar) {
    if (lane == 0) BarrierArrive(bar);  // one arrival per consumer warp (8 in all)
  };
  // Tile t's stage and phase in the K/V ring.
  auto stage_of = [&](int t) { return t % T::kStages; };
  const int tma_tiles = T::kTmaKv ? TmaTiles<T>(w) : 0;
  auto wait_full = [&](uint32_t bar, int t) {
    BarrierWait(bar, (t / T::kStages) & 1);
    // The cp.async data, seen through the barrier, before wgmma reads it (TMA tiles were written
    // through the async proxy wgmma reads by).
    if (!T::kTmaKv || t >= tma_tiles) FenceProxyAsync();
  };
  // Once the work's last S GEMM has completed, the Q buffer is free.
  auto done_with_q = [&](int t) {
    if (t == w.num_tiles - 1) release(s.QEmpty());
  };
  auto mask = [&](float(&acc)[kNTiles][4], int t) {
    const int n0 = w.item.kv_begin + t * kBlockN;
    if (n0 + kBlockN > warp_min_limit) MaskScores(acc, n0, lane, limit_g, limit_g8);
  };
  auto rescale = [&](const float(&alpha)[2]) { RescaleAccumulator<T::kLazyRescale>(o, alpha); };

  if (w.num_tiles > 0) {
    BarrierWait(s.QFull(), 0);
    if constexpr (T::kTmaKv) FenceProxyAsync();  // Q's copies (the TMA tiles' waits do not fence)
    if (ctid == 0) Stamp<T>(w.index, PhaseSlot::kQReadyClock);
    uint32_t pf[kPSteps][4];
    {
      float acc[kNTiles][4] = {};
      const int stage = stage_of(0);
      wait_full(s.KFull(stage), 0);
      WgmmaFence();
      issue_qk(acc, stage);
      WgmmaCommit();
      WgmmaWait<0>();
      PinRegisters(acc);
      if (ctid == 0) Stamp<T>(w.index, PhaseSlot::kFirstSClock);
      release(s.KEmpty(stage));
      done_with_q(0);
      float alpha[2];
      mask(acc, 0);
      update(softmax, acc, alpha);  // O is still 0: nothing to rescale
      ScoresToA(acc, pf);
    }
    // Tile t's S GEMM and tile t - 1's P V GEMM back to back, tile t's softmax under the P V.
    // kLeanTiles: tile t - 1's factor for O, applied once tile t's S GEMM is issued (before
    // the P V GEMM that adds to O), as FA3 does: the 64 multiplies run under that GEMM instead
    // of between the last P V's end and the next S's issue. After tile 0, O is 0: 1.
    float pending_alpha[2] = {1.f, 1.f};
    for (int t = 1; t < w.num_tiles; ++t) {
      const int stage = stage_of(t), prev = stage_of(t - 1);
      float acc[kNTiles][4] = {};
      wait_full(s.KFull(stage), t);
      WgmmaFence();
      issue_qk(acc, stage);
      WgmmaCommit();
      if constexpr (T::kLeanTiles) {
        rescale(pending_alpha);
        PinRegisters(o);  // before the P V GEMM's fence
      }
      wait_full(s.VFull(prev), t - 1);
      WgmmaFence();
      IssuePv<T, kPSteps>(o, pf, s.V(prev));  // (never the work's last tile)
      WgmmaCommit();
      WgmmaWait<1>();  // S of tile t is ready; P V of tile t - 1 still runs
      PinRegisters(acc);
      release(s.KEmpty(stage));
      done_with_q(t);
      float alpha[2];
      mask(acc, t);
      update(softmax, acc, alpha);
      WgmmaWait<0>();
      PinRegisters(o);
      PinRegisters(pf);  // the GEMM read pf until here
      release(s.VEmpty(prev));
      // P is packed only now, into the registers the finished GEMM read: written while it
      // ran, the compiler would serialize every wgmma.
      ScoresToA(acc, pf);
      if constexpr (T::kLeanTiles) {
        pending_alpha[0] = alpha[0];
        pending_alpha[1] = alpha[1];
      } else {
        rescale(alpha);
        PinRegisters(o);  // the rescale stays before the next GEMMs are issued
      }
      PinRegisters(pf);
    }
    if constexpr (T::kLeanTiles) rescale(pending_alpha);
    const int last = stage_of(w.num_tiles - 1);
    wait_full(s.VFull(last), w.num_tiles - 1);
    WgmmaFence();
    issue_pv(pf, last, w.num_tiles - 1);
    WgmmaCommit();
    WgmmaWait<0>();
    PinRegisters(o);
    if (ctid == 0) Stamp<T>(w.index, PhaseSlot::kLoopEndClock);
    release(s.VEmpty(last));
  }

  const RowSink cta_sink = sink.ForItem(w.item.partial_row, w.seq, p.causal, w.kv_head * w.group);
  const float sums[2] = {softmax.RowSum(0), softmax.RowSum(1)};
  StoreRows(cta_sink, o, softmax.m, sums, w.item.row_begin + warp_row0, w.num_rows, 0, lane, true);
  if (ctid % 128 == 0) {
    Stamp<T>(w.index, cwg == 0 ? PhaseSlot::kStoredClock0 : PhaseSlot::kStoredClock1);
    Stamp<T>(w.index, cwg == 0 ? PhaseSlot::kEndNs0 : PhaseSlot::kEndNs1, GlobalTimerNs());
  }
}

// A CTA of either kernel below; kv_map: the cache's tensor map (kTmaKv), else null.
template <typename T>
__device__ __forceinline__ void RunCta(const GqaParams& p, const DeviceWorkItem* __restrict__ items,
                                       RowSink sink, const CUtensorMap* kv_map) {
  extern __shared__ __align__(1024) unsigned char smem[];
  const Smem<T> s{(SharedAddress(smem) + 1023u) & ~1023u};

  const int tid = threadIdx.x;
  if (tid == 0) {
    Stamp<T>(blockIdx.x, PhaseSlot::kStartNs, GlobalTimerNs());
    Stamp<T>(blockIdx.x, PhaseSlot::kStartClock);
    BarrierInit(s.QFull(), 128);  // copies of the 128 producer lanes
    BarrierInit(s.QEmpty(), 8);   // one arrival per consumer warp
    // Full: the copies of the 128 producer lanes; with kTmaKv one arrival per producer warp (with
    // its TMA boxes' bytes, or once its lanes' copies of a copied tile have landed).
    const uint32_t full_arrivals = T::kTmaKv ? 4 : 128;
    for (int i = 0; i < T::kStages; ++i) {
      BarrierInit(s.KFull(i), full_arrivals);
      BarrierInit(s.VFull(i), full_arrivals);
      BarrierInit(s.KEmpty(i), 8);  // one arrival per consumer warp
      BarrierInit(s.VEmpty(i), 8);
    }
  }
  __syncthreads();

  if (tid < 128) {
    ReleaseRegisters<T::kProducerRegisters>();
    Produce<T>(p, MakeWork<T>(p, items, blockIdx.x), s, kv_map, tid);
    WaitAllCopies();
  } else {
    ClaimRegisters<T::kConsumerRegisters>();
    Consume<T>(p, MakeWork<T>(p, items, blockIdx.x), s, tid - 128, sink);
  }
}

template <typename T>
__global__ void __launch_bounds__(kThreads, 1)
    GqaPrefillSm90Kernel(const GqaParams p, const DeviceWorkItem* __restrict__ items,
                         RowSink sink) {
  RunCta<T>(p, items, sink, nullptr);
}

template <typename T>
__global__ void __launch_bounds__(kThreads, 1)
    GqaPrefillSm90TmaKernel(const GqaParams p, const DeviceWorkItem* __restrict__ items,
                            RowSink sink, const __grid_constant__ CUtensorMap kv_map) {
  RunCta<T>(p, items, sink, &kv_map);
}

// The cache as a 3-D TMA tensor map: (the columns of all KV heads of a token, the slots of a page,
// the K and V blocks of every layer's pages in order), boxes of 64 columns (one 128-byte column
// block of a tile) x min(page size, key tile) slots, in the 128-byte swizzle the tiles use. A box
// of KV head h, column block cb, page id `page` of layer l starts at (h head_dim + 64 cb, first
// slot, 2 (l num_pages + page) + 0 for K or 1 for V).
template <typename T>
bool KvMapFits(const GqaCache& c) {
  const bool tiles_in_pages = (c.page_size >= kMinTmaPage && T::kBlockN % c.page_size == 0) ||
                              c.page_size % T::kBlockN == 0;
  return tiles_in_pages && c.head_dim == T::kHeadDim &&
         2 * int64_t{c.num_layers} * c.num_pages <= INT32_MAX &&
         reinterpret_cast<uintptr_t>(c.data) % 16 == 0;
}

template <typename T>
cudaError_t EncodeGqaKvMap(const GqaCache& c, CUtensorMap* map) {
  const TensorMapEncodeTiled encode = TensorMapEncoder();
  if (encode == nullptr) return cudaErrorNotSupported;
  const cuuint64_t token_bytes = c.TokenStride() * sizeof(bf16);
  const cuuint64_t dims[3] = {static_cast<cuuint64_t>(c.TokenStride()),
                              static_cast<cuuint64_t>(c.page_size),
                              2 * static_cast<cuuint64_t>(c.num_layers) * c.num_pages};
  const cuuint64_t strides[2] = {token_bytes, token_bytes * c.page_size};
  const cuuint32_t box[3] = {64, static_cast<cuuint32_t>(std::min(c.page_size, T::kBlockN)), 1};
  const cuuint32_t element_strides[3] = {1, 1, 1};
  const CUresult r =
      encode(map, CU_TENSOR_MAP_DATA_TYPE_BFLOAT16, 3, c.data, dims, strides, box, element_strides,
             CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_128B,
             CU_TENSOR_MAP_L2_PROMOTION_L2_256B, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
  return r == CUDA_SUCCESS ? cudaSuccess : cudaErrorInvalidValue;
}

template <typename T>
constexpr auto KernelOf() {
  if constexpr (T::kTmaKv) {
    return GqaPrefillSm90TmaKernel<T>;
  } else {
    return GqaPrefillSm90Kernel<T>;
  }
}

template <typename T>
struct Config {
  static constexpr auto kKernel = KernelOf<T>();

  static cudaError_t Launch(const GqaParams& p, const DevicePlan& plan, cudaStream_t stream) {
    if constexpr (T::kTmaKv) {
      // Page sizes TMA boxes cannot cut whole tiles from: the same kernel with copies (the same
      // tiles and shared memory, so the plan holds).
      if (!KvMapFits<T>(p.cache)) return Config<typename T::CopiesTwin>::Launch(p, plan, stream);
    }
    ATTN_CUDA_RETURN_IF_ERROR(AllowSharedMemory(kKernel, T::kSmemBytes));
    const RowSink sink = RowSink::ForGqa(p, plan);
    const dim3 grid = ItemHeadGrid(plan.num_items, p.cache.num_kv_heads);
    if constexpr (T::kTmaKv) {
      CUtensorMap kv_map{};
      ATTN_CUDA_RETURN_IF_ERROR(EncodeGqaKvMap<T>(p.cache, &kv_map));
      kKernel<<<grid, kThreads, T::kSmemBytes, stream>>>(p, plan.items, sink, kv_map);
    } else {
      kKernel<<<grid, kThreads, T::kSmemBytes, stream>>>(p, plan.items, sink);
    }
    ATTN_CUDA_RETURN_IF_LAUNCH_FAILED();
    return cudaSuccess;
  }

  static cudaError_t Tiling(KernelTiling* tiling) {
    // The register split assumes the compiler gave the kernel the whole launch bound.
    cudaFuncAttributes attributes;
    ATTN_CUDA_RETURN_IF_ERROR(cudaFuncGetAttributes(&attributes, kKernel));
    if (attributes.numRegs * kThreads < T::kPoolRegisters) return cudaErrorNotSupported;
    return DescribeKernel(kKernel, kThreads, T::kSmemBytes, kBlockM, T::kBlockN, tiling);
  }
};

// The variants (kernels/cuda/api.h) by head_dim.
template <int kHeadDim, typename Fn>
cudaError_t WithVariant(int variant, Fn&& fn) {
  switch (variant) {
    case kGqaPrefillSm90LeanOverlapSolo3:
      return fn(Config<Traits<kHeadDim, false, false>>());
    case kGqaPrefillSm90Solo3Tma:
      return fn(Config<Traits<kHeadDim, true, false>>());
    case kGqaPrefillSm90Solo3TmaLeanTiles:
      return fn(Config<Traits<kHeadDim, true, true>>());
    case kGqaPrefillSm90TmaLeanLazyRescale:
      return fn(Config<Traits<kHeadDim, true, true, false, true>>());
    case kGqaPrefillSm90Stamped:  // an instrument, built for head_dim 128 alone
      if constexpr (kHeadDim == 128) return fn(Config<Traits<128, true, true, true, true>>());
      return cudaErrorInvalidValue;
    default:
      return cudaErrorInvalidValue;
  }
}

template <typename Fn>
cudaError_t WithConfig(int head_dim, int variant, Fn&& fn) {
  switch (head_dim) {
    case 64:
      return WithVariant<64>(variant, fn);
    case 128:
      return WithVariant<128>(variant, fn);
    case 256:
      return WithVariant<256>(variant, fn);
    default:
      return cudaErrorInvalidValue;
  }
}

}  // namespace
}  // namespace sm90

cudaError_t DeviceRunsSm90a(bool* runs) {
  int device = 0, major = 0, minor = 0;
  ATTN_CUDA_RETURN_IF_ERROR(cudaGetDevice(&device));
  ATTN_CUDA_RETURN_IF_ERROR(
      cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device));
  ATTN_CUDA_RETURN_IF_ERROR(
      cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, device));
  // The kernels are built for sm_90a only: that image runs on compute capability 9.0 alone.
  *runs = major == 9 && minor == 0;
  return cudaSuccess;
}

cudaError_t GqaPrefillSm90Available(int head_dim, bool* available) {
  ATTN_CUDA_RETURN_IF_ERROR(DeviceRunsSm90a(available));
  *available = *available && (head_dim == 64 || head_dim == 128 || head_dim == 256);
  return cudaSuccess;
}

cudaError_t LaunchGqaPrefillSm90(const GqaParams& p, const DevicePlan& plan, cudaStream_t stream,
                                 int variant) {
  return sm90::WithConfig(p.cache.head_dim, variant,
                          [&](auto config) { return config.Launch(p, plan, stream); });
}

cudaError_t SetGqaPrefillPhaseStamps(const PhaseStampBuffer& buffer) {
  return cudaMemcpyToSymbol(sm90::g_phase_stamps, &buffer, sizeof(buffer));
}

cudaError_t GqaPrefillSm90Tiling(int head_dim, int variant, KernelTiling* tiling) {
  return sm90::WithConfig(head_dim, variant, [&](auto config) { return config.Tiling(tiling); });
}

}  // namespace attn::cuda
