// MLA (DeepSeek-style, absorbed) paged prefill and decode for Hopper (sm_90a): wgmma tensor cores
// fed by a producer warpgroup.
//
// One CTA = one work item (kernels/cuda/plan.h): kBlockM = 64 packed rows (query token x head)
// against keys [kv_begin, kv_end) of one sequence, in tiles of kBlockN keys. Every head attends
// to the same 576-wide cache rows, so one key tile serves all 64 rows, and its first 512 columns
// are the V tile as well. Three warpgroups:
//   - the producer (warpgroup 0) copies the Q tile (q_nope | q_pe, 64 x 576) once and each key
//     tile from its pages with cp.async into a ring of swizzled tiles, completing on one mbarrier
//     per 64-column block (page size 1 puts every row on its own page: no TMA box would span
//     them). Eight lanes copy one 128-byte column block of a row, so every lane keeps its swizzle
//     phase and needs only the offsets of its rows, looked up a tile ahead.
//   - the score warpgroup (1) computes S = Q K^T (64 x kBlockN over 576, both operands in shared
//     memory, each column block as soon as it lands), the online softmax, hands P and the rows'
//     rescale factors to warpgroup 2 through shared memory and accumulates O[:, 0:256] += P
//     V[:, 0:256] with P in registers.
//   - the second warpgroup (2) rescales O[:, 256:512] by the score warpgroup's factors and
//     accumulates P V[:, 256:512] with P from shared memory.
//   Each 64 x 256 float accumulator takes 128 registers per lane. P V of tile t is issued before
//   S of tile t + 1, so tile t's stage is refilled while S of tile t + 1 and its softmax run.
//   S accumulates even and odd k-steps into two accumulators, two independent chains of 18
//   wgmmas instead of one of 36, added once the GEMM is done. The right half comes late:
//   warpgroup 2's P V of tile t waits until the score warpgroup's is done, so that it runs beside
//   the end of S of tile t + 1 and fills the tensor cores during the softmax after it, rather than
//   slowing all of S down; stages are released by halves so that the refill starts as early as
//   before. Whole key tiles come by TMA where the page size allows.
// Measured and dropped (bench/RESULTS.md has each with its numbers, git's history the code): one
// chain of S k-steps; the right half's P V beside all of S; FlashMLA's seesaw (both consumers
// compute S, for alternate tiles: it holds each pair's second tile until the pair's end, so with
// two stages its next S waits for copies that could only start then); 32-key tiles in four
// stages (deeper prefetch, but the narrower S reads Q twice as often); cluster pairs that copied
// each tile from L2 once for both halves of a 128-head decode, and the pairs again with TMA
// multicast (one hop, each CTA issuing every other column block to both, a stage refilled once
// both CTAs released it: 128 heads 291.5 -> 320.1 us, the prefill 1030 -> 1073 us; the halved L2
// reads do not pay for the two CTAs waiting on each other's releases); each tile's keys split
// between the two consumers, S, softmax and P V over their own 256 columns each (128 heads +13%,
// the prefill +16%: the consumers' chain is not the bound); the L2 prefetch three tiles ahead
// (level with none), and on the narrow kernel two or three ahead (+40-50%); the whole tile t + 2
// brought into L2 (variant 28: as fast as the touch below on the 128-head decode, 8% slower on
// the seed); the persistent kernel's score warpgroup issuing S of the next item's first tile
// right after an item's last P V (variant 52: the seed +4.5%, the page-64 prefill level; its last
// stage is released only once the next item's Q and first tile have landed); the narrow kernel's
// tiles copied in address order, each completing on all nine column blocks at once (variant 51:
// level); the persistent kernels' next Q brought into L2 when its item is drawn (53, 54: level
// on the page-64 prefill, the seed +1%: the item boundary does not wait on Q's DRAM latency).
// Page touch (kTouchTiles, variants 42, 44 and 46: the default for decodes of more than 32 heads
// where HBM per SM is lean, and for prefills on cp.async tiles): while the
// producer waits for the stage of tile t it touches one line of each page run of tile t + 2
// (prefetch.global.L2), so that the tile's address translation, not its bytes, is done before
// its copies are issued: 128 heads 316 -> 295 us on the H100, the page-1 seed -2%; the 16-head
// narrow kernel gained nothing from it, and the page-64 prefill, whose items of one sequence
// read the same pages together, loses 3% to the producer's extra page-table reads.
// Lazy rescale (every 64-row kernel): a row's maximum moves only where a tile's passes it by more
// than 8 (log2, OnlineSoftmax::RescaleLazy), so its factor is almost always exactly 1 after the
// first tiles, and each consumer warp skips its 128 multiplies of O a lane on a vote: the
// 128-head decode -10% and the prefill -6% on the H100 against the same kernels without it
// (variants 18 and 38, since removed; the consumers' instructions are the path;
// bench/RESULTS.md, 2026-12-06).
// Narrow variant (NarrowTraits, ConsumeNarrow below): for decodes of few heads, a transposed
// kernel of two warpgroups whose GEMMs take the heads as their N side.
// Rows past kv_end in a tile copy the range's last key again (real, finite data the mask hides;
// never the slot itself, which may hold NaN). Causal block skipping is the planner's; masking
// runs only on tiles that cross a row's limit. Split-KV items write float32 partials through the
// common epilogue for the merge kernel.
#include <cooperative_groups.h>
#include <cuda.h>  // CUtensorMap (the driver entry point is looked up at run time)
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <type_traits>

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

constexpr int kHalfCols = kMlaCkvDim / 2;         // output columns per consumer warpgroup
constexpr int kDTiles = kHalfCols / 8;            // 32 accumulator fragments of 8 columns
constexpr int kKSteps = kMlaTokenDim / 16;        // 36 k-steps of S
constexpr int kColumnBlocks = kMlaTokenDim / 64;  // 9 swizzled 128-byte column blocks
constexpr int kRowsPerPass = 128 / 8;             // 8 producer lanes per row

// Named barriers between the consumers (each counts both warpgroups' 256 threads).
constexpr int kPFullBarrier = 1;   // P and the rescale factors of a tile are in shared memory
constexpr int kPEmptyBarrier = 2;  // warpgroup 2 is done reading them
constexpr int kFinalBarrier = 3;   // the rows' final (max, sum) are in shared memory
constexpr int kLeftDoneBarrier = 4;  // the score warpgroup's P V of a tile is done

// The 64-row kernels' softmax moves a row's maximum lazily, and their consumers skip O's rescale
// where a warp's factors are all 1 (file comment).
constexpr bool kLazyRescale = true;

// The 64-row kernel (ConsumeScores/ConsumeSecond), with kTouchTiles as Produce takes it and the
// lazy rescale (kLazyRescale above). kLeanSoftmax: the score warpgroup's softmax takes
// OnlineSoftmax::UpdatePositiveScale's straight-line pass over both rows where the scale is
// positive, as the GQA prefill's lean tiles do: the prefills' default (api.cc's DefaultSm90Mla).
// kPersistent: one CTA an SM runs items until none is left (the kernel's comment below).
// kStamps: every item writes its phase stamps (one record at its index; kMlaSm90Stamped).
// kNextItem (kPersistent, trials), bits: 1, the producer's thread 0 hands the next item's whole
// Work to the consumers through shared memory (no global reads of theirs at an item boundary; the
// producer, well ahead, still reads its own: the 14 words from the slot left it 148 bytes of
// spills), and the producer issues its first tile's page-table reads before it waits for the
// previous item's Q to be read; 2, it also
// touches the pages of the next item's first kTouchTiles tiles there; 4 (kSplitQ), Q completes on
// one barrier per column block, each issued just before the first tile's block, so that the
// item's first S starts once the first of each has landed rather than all of Q.
template <int kTouchTiles_ = 0, bool kLeanSoftmax_ = false, bool kPersistent_ = false,
          bool kStamps_ = false, int kNextItem_ = 0>
struct Traits {
  static constexpr bool kLeanSoftmax = kLeanSoftmax_;
  static constexpr bool kPersistent = kPersistent_;
  static constexpr bool kStamps = kStamps_;
  static constexpr int kNextItem = kNextItem_;
  static_assert(kNextItem == 0 || (kPersistent && (kNextItem & 1)));
  static constexpr bool kSplitQ = (kNextItem & 4) != 0;
  static constexpr int kQBarriers = kSplitQ ? kColumnBlocks : 1;
  static constexpr bool kNarrow = false;
  static constexpr bool kClusterMerge = false;
  static constexpr int kBlockM = 64;  // packed rows per CTA
  static constexpr int kThreads = 384;
  static constexpr int kConsumerWarps = 8;
  // Registers per lane at launch (the most __launch_bounds__(kThreads, 1) leaves), which
  // setmaxnreg redistributes among the three warpgroups (128 x (56 + 240 + 208) = 384 x 168).
  static constexpr int kLaunchRegisters = 65536 / kThreads / 8 * 8;
  static constexpr int kQBlockBytes = kBlockM * 128;            // one column block of Q
  static constexpr int kQBytes = kColumnBlocks * kQBlockBytes;  // 72 KiB
  static constexpr int kPBytes = kBlockM * 64 * 2;  // P, bf16, one column block (up to 64 keys)
  static constexpr int kRowFloats = 3 * kBlockM;    // per row: rescale factor, final max, final sum
  static constexpr int kBlockN = kMlaSm90KeyTile;   // keys per tile
  static constexpr int kStages = 2;
  // Key tiles that lie whole in one page and inside the item's range come by TMA (one thread,
  // 9 boxes of 64 rows x 128 bytes) where the page size is a multiple of 64; the rest by
  // cp.async (page size 1 puts every row on its own page; a range's last, partial tile copies
  // its last key into the rows past the range, never the slots themselves, which may hold NaN).
  static constexpr bool kTma = true;
  // Late right half (ConsumeScores/ConsumeSecond): warpgroup 2 issues P V[:, 256:512] of tile t
  // once the score warpgroup's P V of it is done, so that it runs beside the end of S of tile
  // t + 1 and under the softmax after it, rather than beside all of S. Each stage is released by
  // halves, the score warpgroup's (V's left columns and the rope block) after its P V and the rest
  // after warpgroup 2's, and S reads the blocks in the order they are refilled: 0-3, 8, 4-7.
  static constexpr bool kLateRight = true;
  // The pages of key tile t + kTouchTiles touched while the producer waits to issue tile t's
  // copies (Produce), so that their translation is done when those are issued: 0 for none.
  static constexpr int kTouchTiles = kTouchTiles_;
  // setmaxnreg's split (ptxas spills nothing at these): the score warpgroup holds S twice (two
  // chains of k-steps) and its partner neither.
  static constexpr int kProducerRegisters = 56;
  static constexpr int kFirstRegisters = 240;
  static constexpr int kSecondRegisters = 208;
  static constexpr int kPoolRegisters =
      128 * (kProducerRegisters + kFirstRegisters + kSecondRegisters);
  static_assert(kPoolRegisters <= kThreads * kLaunchRegisters);
  static constexpr int kNTiles = kBlockN / 8;        // score fragments
  static constexpr int kPSteps = kBlockN / 16;       // k-steps of P V
  static constexpr int kBlockBytes = kBlockN * 128;  // one column block of a key tile
  static constexpr int kTileBytes = kColumnBlocks * kBlockBytes;
  static constexpr int kKvPasses = kBlockN / kRowsPerPass;
  // Q's, one per column block of each stage (S starts on a tile's first block while the others
  // are in flight), and each stage's release by halves: V's left columns with the rope block, and
  // the rest (different warpgroups finish with each).
  static constexpr int kReleases = 2;
  // kPersistent: Q's release (QEmpty) and the two slots' (WorkFull, WorkEmpty) of Smem.
  static constexpr int kWorkBarriers = kPersistent ? 5 : 0;
  static constexpr int kBarriers =
      kQBarriers + kStages * kColumnBlocks + kStages * kReleases + kWorkBarriers;
  // 1 KiB of slack to start the tiles on the swizzle pattern's 1024-byte period; kPersistent's
  // two item slots after the barriers.
  // kNextItem: each slot holds a whole Work (kWorkWords words) in place of an index.
  static constexpr int kWorkWords = 14;
  static constexpr int kSlotWords = kNextItem != 0 ? kWorkWords : 1;
  static constexpr int kSmemBytes = 1024 + kQBytes + kStages * kTileBytes + kPBytes +
                                    kRowFloats * 4 + 8 * kBarriers +
                                    (kPersistent ? 2 * 4 * kSlotWords : 0);
  static_assert(kSmemBytes <= 227 * 1024, "shared memory of one CTA");
};

// Shared-memory map: Q, the key stages, P, the row floats, then the mbarriers. Addresses for the
// PTX instructions (32-bit shared window) and a generic pointer for ordinary loads and stores.
template <typename T>
struct Smem {
  uint32_t base;       // 1024-byte aligned
  unsigned char* ptr;  // the same byte, generic

  __device__ uint32_t Q() const { return base; }
  __device__ uint32_t Kv(int stage) const { return base + T::kQBytes + stage * T::kTileBytes; }
  __device__ uint32_t P() const { return base + T::kQBytes + T::kStages * T::kTileBytes; }
  __device__ unsigned char* PPtr() const { return ptr + (P() - base); }
  __device__ float* Rows() const { return reinterpret_cast<float*>(PPtr() + T::kPBytes); }
  __device__ float* Alpha() const { return Rows(); }
  __device__ float* FinalMax() const { return Rows() + T::kBlockM; }
  __device__ float* FinalSum() const { return Rows() + 2 * T::kBlockM; }
  __device__ uint32_t Barrier(int i) const { return P() + T::kPBytes + T::kRowFloats * 4 + 8 * i; }
  __device__ uint32_t QFull(int cb = 0) const { return Barrier(cb); }  // cb: T::kSplitQ
  __device__ uint32_t KvFull(int stage, int cb) const {
    return Barrier(T::kQBarriers + stage * kColumnBlocks + cb);
  }
  __device__ uint32_t KvEmpty(int stage, int half = 0) const {
    return Barrier(T::kQBarriers + T::kStages * kColumnBlocks + stage * T::kReleases + half);
  }
  // T::kPersistent: the score warpgroup is done reading Q (one arrival per warp), so the next
  // item's may come; item k >= 1 of the CTA is handed over in slot (k - 1) % 2 (WorkSlot), full
  // once thread 0 wrote it and empty once all 384 threads read it.
  __device__ uint32_t QEmpty() const { return Barrier(T::kBarriers - 5); }
  __device__ uint32_t WorkFull(int slot) const { return Barrier(T::kBarriers - 4 + slot); }
  __device__ uint32_t WorkEmpty(int slot) const { return Barrier(T::kBarriers - 2 + slot); }
  __device__ volatile int* WorkSlot(int slot) const {
    return reinterpret_cast<volatile int*>(ptr + (Barrier(T::kBarriers) - base)) +
           slot * T::kSlotWords;
  }
};

// Where the stamped variant writes its records (SetMlaPhaseStamps).
__device__ PhaseStampBuffer g_mla_phase_stamps;

struct Work {
  int index;  // in the plan's items
  WorkItem item;
  SeqExtent seq;
  int num_rows;   // packed rows of the sequence
  int num_tiles;  // key tiles of the item
  // The CTA's key tiles and Q loads before this item's (nonzero only in persistent kernels): the
  // ring's stages and barrier phases run on across items.
  int tiles_before = 0;
  int q_loads_before = 0;

  // Key tile t's place in the CTA's sequence of tiles (its stage and phase in the ring).
  __device__ __forceinline__ int Tile(int t) const { return tiles_before + t; }
};

// The stamped variant's stamp of `slot` for item `index` (the others compile nothing): the SM's
// clock, or `value`.
template <typename T>
__device__ __forceinline__ void Stamp(int index, PhaseSlot slot) {
  if constexpr (T::kStamps) StampClock(g_mla_phase_stamps, index, slot);
}
template <typename T>
__device__ __forceinline__ void Stamp(int index, PhaseSlot slot, uint64_t value) {
  if constexpr (T::kStamps) WriteStamp(g_mla_phase_stamps, index, slot, value);
}

// Warpgroup 0: all copies into shared memory.
template <typename T>
__device__ __forceinline__ void Produce(const MlaParams& p, const Work& w, const Smem<T>& s,
                                        const CUtensorMap& kv_map, bool use_tma, int tid) {
  constexpr int kBlockN = T::kBlockN;
  const int chunk = tid % 8;  // this lane's 16 bytes of each 128-byte column block
  const int row0 = tid / 8;   // its rows: row0 + 16 i, all with the same swizzle phase
  const uint32_t lane_offset = row0 * 128 + ((chunk ^ (row0 & 7)) << 4);
  const int heads = p.num_heads;
  if (tid == 0) {
    // An item's start: when the producer takes it up (in a persistent CTA, while the consumers
    // may still work on the item before).
    Stamp<T>(w.index, PhaseSlot::kSmAndTiles, SmId() | uint64_t{uint32_t(w.num_tiles)} << 32);
    Stamp<T>(w.index, PhaseSlot::kStartNs, GlobalTimerNs());
    Stamp<T>(w.index, PhaseSlot::kStartClock);
  }
  if constexpr (T::kPersistent) {
    if (w.num_tiles == 0) return;  // its consumers wait for neither Q nor keys
  }
  // The previous item's S has read Q for the last time (kPersistent).
  auto wait_q_empty = [&] {
    if constexpr (T::kPersistent) {
      if (w.q_loads_before > 0) BarrierWait(s.QEmpty(), (w.q_loads_before - 1) & 1);
    }
  };
  // The lane's Q row of pass i: its packed row, and that row's index in q_nope / q_pe.
  auto q_packed = [&](int i) { return w.item.row_begin + row0 + i * kRowsPerPass; };
  auto q_row = [&](int packed) {
    return (int64_t{w.seq.q_begin} + packed / heads) * heads + packed % heads;
  };
  // Q's copies.
  auto issue_q = [&] {
    wait_q_empty();
#pragma unroll
    for (int i = 0; i < T::kBlockM / kRowsPerPass; ++i) {
      const int packed = q_packed(i);
      const bool valid = packed < w.num_rows;  // tile padding is zero-filled
      const int64_t qrow = q_row(packed);
      const bf16* nope = p.q_nope + qrow * kMlaCkvDim + chunk * 8;
      const bf16* pe = p.q_pe + qrow * kMlaKpeDim + chunk * 8;
#pragma unroll
      for (int cb = 0; cb < kColumnBlocks; ++cb) {
        const bf16* src = cb < kColumnBlocks - 1 ? nope + cb * 64 : pe;
        CopyAsync16(s.Q() + cb * T::kQBlockBytes + i * kRowsPerPass * 128 + lane_offset,
                    valid ? src : p.q_nope, valid);
      }
    }
    BarrierArriveOnCopies(s.QFull());
    if (tid == 0) Stamp<T>(w.index, PhaseSlot::kQIssuedClock);
  };
  // kSplitQ: Q's column block cb, completing on its own barrier; the lane's rows, -1 past the
  // sequence's (zero-filled).
  int32_t q_rows[T::kBlockM / kRowsPerPass];
  if constexpr (T::kSplitQ) {
#pragma unroll
    for (int i = 0; i < T::kBlockM / kRowsPerPass; ++i) {
      const int packed = q_packed(i);
      q_rows[i] = packed < w.num_rows ? static_cast<int32_t>(q_row(packed)) : -1;
    }
  }
  auto issue_q_block = [&](int cb) {
#pragma unroll
    for (int i = 0; i < T::kBlockM / kRowsPerPass; ++i) {
      const int64_t qrow = q_rows[i];
      const bf16* src = cb < kColumnBlocks - 1 ? p.q_nope + qrow * kMlaCkvDim + chunk * 8 + cb * 64
                                               : p.q_pe + qrow * kMlaKpeDim + chunk * 8;
      CopyAsync16(s.Q() + cb * T::kQBlockBytes + i * kRowsPerPass * 128 + lane_offset,
                  qrow >= 0 ? src : p.q_nope, qrow >= 0);
    }
    BarrierArriveOnCopies(s.QFull(cb));
  };
  if constexpr (T::kNextItem == 0) issue_q();

  const PagedRows rows = MlaRows(p.cache, p.batch, w.seq);
  const int page_size = p.cache.page_size;
  const bool tma = use_tma && page_size % T::kBlockN == 0 && w.item.kv_begin % T::kBlockN == 0;
  const int layer_row0 = w.seq.layer * p.cache.num_pages * page_size;  // the map's rows
  auto by_tma = [&](int t) {
    return tma && w.item.kv_begin + t * kBlockN + kBlockN <= w.item.kv_end;
  };
  // A tile's page-table reads, issued a tile ahead and kept as they were read: the rows' offsets
  // are computed from them in the tile's own iteration. Computed at the lookup, they made the
  // producer wait there for the reads (page size 1 reads a page id per row) before it issued the
  // copies of the tile before, the first tile's included.
  // (A tile that comes by TMA reads its one page id when it is issued.)
  struct Lookup {
    int32_t page_id[T::kKvPasses];
    int slot[T::kKvPasses];
  };
  auto lookup = [&](int t, Lookup& l) {
    const bool used = t < w.num_tiles && !by_tma(t);
    const int key0 = w.item.kv_begin + t * kBlockN;
#pragma unroll
    for (int i = 0; i < T::kKvPasses; ++i) {
      int page;
      rows.PageSlot(min(key0 + row0 + i * kRowsPerPass, w.item.kv_end - 1), &page, &l.slot[i]);
      l.page_id[i] = used ? rows.pages[page] : 0;
    }
  };
  Lookup current;
  lookup(0, current);
  // kTouchTiles: lane i < kBlockN takes row i of tile t + kTouchTiles where a run of the tile's
  // rows within one page starts (every row at page size 1, the tile's first alone where a page
  // holds it) and touches its first line. Its page id is read an iteration before.
  struct Touch {
    int32_t page_id;
    int slot;
    bool used;
  };
  auto touch_of = [&](int t) {
    Touch r{0, 0, false};
    const int key0 = w.item.kv_begin + t * kBlockN;
    const int key = key0 + tid;
    if (T::kTouchTiles == 0 || tid >= kBlockN || t >= w.num_tiles) return r;
    if (key >= min(key0 + kBlockN, w.item.kv_end)) return r;
    int page;
    rows.PageSlot(key, &page, &r.slot);
    if (r.slot != 0 && key != key0) return r;
    r.page_id = rows.pages[page];
    r.used = true;
    return r;
  };
  if constexpr (T::kNextItem != 0) {
    // The first tile's page-table reads (above) and, 2, the first tiles' touches fly while the
    // previous item's last S runs.
    if constexpr ((T::kNextItem & 2) != 0) {
#pragma unroll
      for (int t = 0; t < T::kTouchTiles; ++t) {
        const Touch first = touch_of(t);
        if (first.used) PrefetchLineL2(rows.base + rows.OffsetIn(first.page_id, first.slot));
      }
    }
    if constexpr (T::kSplitQ) {
      wait_q_empty();  // Q's blocks go out with the first tile's (copy_blocks)
    } else {
      issue_q();
    }
  }
  Touch touch = touch_of(T::kTouchTiles);
  // Tile t's copies; kWithQ (kSplitQ, the first tile): each column block of Q before the tile's.
  auto issue_tile = [&](int t, auto with_q) {
    constexpr bool kWithQ = decltype(with_q)::value;
    const int stage = w.Tile(t) % T::kStages;
    if constexpr (T::kTouchTiles > 0) {
      if (touch.used) PrefetchLineL2(rows.base + rows.OffsetIn(touch.page_id, touch.slot));
      touch = touch_of(t + 1 + T::kTouchTiles);
    }
    Lookup next;
    lookup(t + 1, next);  // the page-table reads fly while this tile is issued
    const uint32_t empty_parity = ((w.Tile(t) / T::kStages) & 1) ^ 1;
    const uint32_t dst = s.Kv(stage) + lane_offset;
    const int key0 = w.item.kv_begin + t * kBlockN;
    const bool tile_by_tma = by_tma(t);
    // This tile's rows, from the reads issued a tile ago (while the producer waits for the stage
    // below, had they not landed yet).
    int64_t offset[T::kKvPasses];
#pragma unroll
    for (int i = 0; i < T::kKvPasses; ++i) {
      offset[i] = rows.OffsetIn(current.page_id[i], current.slot[i]);
    }
    const int row =
        tile_by_tma ? layer_row0 + rows.pages[key0 / page_size] * page_size + key0 % page_size : 0;
    // Column blocks [first, end), each completing on its own barrier in the order S reads them.
    auto copy_blocks = [&](auto first, auto end) {
#pragma unroll
      for (int cb = decltype(first)::value; cb < decltype(end)::value; ++cb) {
        if constexpr (kWithQ) issue_q_block(cb);
        if (tile_by_tma) {
          // The barrier still counts 128 arrivals: one of them brings the box's bytes.
          if (tid == 0) {
            BarrierArriveExpectTx(s.KvFull(stage, cb), T::kBlockBytes);
            TmaLoad2d(s.Kv(stage) + cb * T::kBlockBytes, &kv_map, cb * 64, row,
                      s.KvFull(stage, cb));
          } else {
            BarrierArrive(s.KvFull(stage, cb));
          }
        } else {
#pragma unroll
          for (int i = 0; i < T::kKvPasses; ++i) {
            CopyAsync16(dst + cb * T::kBlockBytes + i * kRowsPerPass * 128,
                        rows.base + offset[i] + chunk * 8 + cb * 64);
          }
          BarrierArriveOnCopies(s.KvFull(stage, cb));
        }
      }
    };
    using Zero = std::integral_constant<int, 0>;
    using Half = std::integral_constant<int, kHalfCols / 64>;
    using All = std::integral_constant<int, kColumnBlocks>;
    if constexpr (T::kLateRight) {
      using Rope = std::integral_constant<int, kColumnBlocks - 1>;
      BarrierWait(s.KvEmpty(stage, 0), empty_parity);
      copy_blocks(Zero(), Half());
      copy_blocks(Rope(), All());
      BarrierWait(s.KvEmpty(stage, 1), empty_parity);
      copy_blocks(Half(), Rope());
    } else {
      BarrierWait(s.KvEmpty(stage), empty_parity);
      copy_blocks(Zero(), All());
    }

    current = next;
  };
  int first_tile = 0;
  if constexpr (T::kSplitQ) {  // peeled: Q's registers are not live in the loop
    issue_tile(0, std::true_type());
    if (tid == 0) Stamp<T>(w.index, PhaseSlot::kQIssuedClock);  // with the first tile's
    first_tile = 1;
  }
  for (int t = first_tile; t < w.num_tiles; ++t) issue_tile(t, std::false_type());
  if (tid == 0) Stamp<T>(w.index, PhaseSlot::kProducedClock);
  if constexpr (!T::kPersistent) WaitAllCopies();  // persistent: once, after the last item
}

// What both consumers do with a key stage: wait for column block cb of tile t.
template <typename T>
__device__ __forceinline__ void WaitFull(const Smem<T>& s, int t, int cb) {
  BarrierWait(s.KvFull(t % T::kStages, cb), (t / T::kStages) & 1);
  FenceProxyAsync();  // the cp.async data, seen through the barrier, before wgmma reads it
}

template <typename T>
__device__ __forceinline__ void Release(const Smem<T>& s, int t, int lane, int half = 0) {
  if (lane == 0) BarrierArrive(s.KvEmpty(t % T::kStages, half));  // one arrival per consumer warp
}

// A 64 x 64 bf16 tile in one swizzled column block (P) as mma A fragments: the lane's word of row
// r, 8-column chunk c (k-step c / 2, half c % 2).
__device__ __forceinline__ uint32_t* FragmentWord(unsigned char* tile, int r, int c, int lane) {
  return reinterpret_cast<uint32_t*>(tile + r * 128 + ((c ^ (r & 7)) << 4) + (lane & 3) * 4);
}

// kSteps k-steps of A fragments into the tile's 8-column chunks from chunk0 on.
template <int kSteps>
__device__ __forceinline__ void StoreFragments(unsigned char* tile, const uint32_t (&a)[kSteps][4],
                                               int row_g, int lane, int chunk0 = 0) {
#pragma unroll
  for (int x = 0; x < 2; ++x) {
#pragma unroll
    for (int ks = 0; ks < kSteps; ++ks) {
#pragma unroll
      for (int h = 0; h < 2; ++h)
        *FragmentWord(tile, row_g + 8 * x, chunk0 + 2 * ks + h, lane) = a[ks][2 * h + x];
    }
  }
}

// A consumer lane's rows (row_g, row_g + 8) and how far each sees into the item's keys.
struct RowLimits {
  int row_g;
  int limit_g, limit_g8;
  int warp_min_limit;  // the warp's first row's: rows further down see more keys

  __device__ __forceinline__ RowLimits(const MlaParams& p, const Work& w, int warp, int lane) {
    row_g = 16 * warp + lane / 4;
    auto limit = [&](int r) {
      return min(VisibleKeys(w.seq, (w.item.row_begin + r) / p.num_heads, p.causal), w.item.kv_end);
    };
    limit_g = limit(row_g);
    limit_g8 = limit(row_g + 8);
    warp_min_limit = limit(16 * warp);
  }

  // Masks a tile of scores whose first key is n0 where it crosses a row's limit.
  template <int kNTiles>
  __device__ __forceinline__ void Mask(float (&acc)[kNTiles][4], int n0, int lane) const {
    if (n0 + 8 * kNTiles > warp_min_limit) MaskScores(acc, n0, lane, limit_g, limit_g8);
  }
};

// O[:, col0 : col0 + 256] B operand of k-step ks: keys [16 ks, 16 ks + 16) of a stage.
template <typename T>
__device__ __forceinline__ uint64_t ValueDescriptor(const Smem<T>& s, int stage, int col0, int ks) {
  return MnMajorDescriptor(s.Kv(stage) + (col0 / 64) * T::kBlockBytes + ks * 2048, T::kBlockBytes);
}

// x, which the compiler cannot see through (so it cannot hoist what is computed from it).
__device__ __forceinline__ uint64_t Opaque(uint64_t x) {
  asm volatile("" : "+l"(x));
  return x;
}

// The column block S reads i-th: in the order the producer refills a stage's halves.
__device__ __forceinline__ constexpr int BlockOfStep(int i) {
  return i < kHalfCols / 64 ? i : i == kHalfCols / 64 ? kColumnBlocks - 1 : i - 1;
}

// S = Q K^T for a tile as two chains of k-steps (even ones into acc, odd ones into acc_odd):
// k-step ks reads column block BlockOfStep(ks / 4) of Q and of the key tile, each waited for just
// before its k-steps are issued. The k-steps' descriptors are the tile's first plus the step's
// offset (>> 4, the start address field's unit). Q's are the same every tile: hoisted out of the
// caller's loop, all 36 of them would stay live (and spill), so the base is laundered through an
// opaque move each tile.
// kWaitQ (T::kSplitQ, an item's first tile): each column block of Q is waited for with the key
// tile's (q_parity: the barriers' phase).
template <typename T, bool kWaitQ = false>
__device__ __forceinline__ void IssueScores(float (&acc)[T::kNTiles][4],
                                            float (&acc_odd)[T::kNTiles][4], const Smem<T>& s,
                                            int t, uint64_t q_desc0, uint32_t q_parity = 0) {
  const uint64_t q_desc = Opaque(q_desc0);
  const uint64_t k_desc = KMajorDescriptor(s.Kv(t % T::kStages));
#pragma unroll
  for (int ks = 0; ks < kKSteps; ++ks) {
    const int cb = BlockOfStep(ks / 4);
    if constexpr (kWaitQ) {
      if (ks % 4 == 0) BarrierWait(s.QFull(cb), q_parity);
    }
    if (ks % 4 == 0) WaitFull(s, t, cb);
    const uint32_t in_block = (ks % 4) * 32;
    const uint64_t a = q_desc + ((cb * T::kQBlockBytes + in_block) >> 4);
    const uint64_t b = k_desc + ((cb * T::kBlockBytes + in_block) >> 4);
    if (ks % 2 == 0) {
      Wgmma<T::kBlockN>::SS(acc, a, b, ks > 0 ? 1u : 0u);
    } else {
      Wgmma<T::kBlockN>::SS(acc_odd, a, b, ks > 1 ? 1u : 0u);
    }
  }
}

// Once S's GEMM is done: its accumulators are the compiler's again, added into one.
template <int kNTiles>
__device__ __forceinline__ void FinishScores(float (&acc)[kNTiles][4],
                                             float (&acc_odd)[kNTiles][4]) {
  PinRegisters(acc);
  PinRegisters(acc_odd);
#pragma unroll
  for (int j = 0; j < kNTiles; ++j) {
#pragma unroll
    for (int c = 0; c < 4; ++c) acc[j][c] += acc_odd[j][c];
  }
}

// Warpgroup 1: scores, softmax, P for both consumers, and output columns [0, 256).
template <typename T>
__device__ __forceinline__ void ConsumeScores(const MlaParams& p, const Work& w, const Smem<T>& s,
                                              int ctid, const RowSink& sink) {
  constexpr int kBlockN = T::kBlockN;
  const int warp = ctid / 32, lane = ctid % 32;
  const RowLimits rows(p, w, warp, lane);
  const int row_g = rows.row_g;  // this lane's rows: row_g and row_g + 8
  const float scale_log2 = p.sm_scale * kLog2e;

  float o[kDTiles][4] = {};
  float acc[T::kNTiles][4];
  float acc_odd[T::kNTiles][4];  // the odd k-steps' share of S
  uint32_t pf[T::kPSteps][4];
  float alpha[2];
  OnlineSoftmax<T::kNTiles> softmax;

  // S of the whole tile, its column blocks in the order the producer refills a stage's halves.
  const uint64_t q_desc0 = KMajorDescriptor(s.Q());
  auto issue_qk = [&](int t) { IssueScores<T>(acc, acc_odd, s, w.Tile(t), q_desc0); };
  auto finish_qk = [&] { FinishScores(acc, acc_odd); };
  auto softmax_tile = [&](int t) {
    rows.Mask(acc, w.item.kv_begin + t * kBlockN, lane);
    if (T::kLeanSoftmax && scale_log2 > 0.f) {
      softmax.template UpdatePositiveScale<kLazyRescale>(acc, scale_log2, alpha);
    } else {
      softmax.template Update<kLazyRescale>(acc, scale_log2, alpha);
    }
  };
  // P (bf16, swizzled K-major like Q) and the rows' factors for warpgroup 2.
  auto publish_p = [&] {
    StoreFragments(s.PPtr(), pf, row_g, lane);
    if ((lane & 3) == 0) {
      s.Alpha()[row_g] = alpha[0];
      s.Alpha()[row_g + 8] = alpha[1];
    }
    FenceProxyAsync();  // P's ordinary stores before warpgroup 2's wgmma reads them
  };

  // kPersistent: S has read Q for the last time (once the item's last S GEMM is done).
  auto q_read = [&] {
    if constexpr (T::kPersistent) {
      if (lane == 0) BarrierArrive(s.QEmpty());
    }
  };
  if (w.num_tiles > 0) {
    if constexpr (!T::kSplitQ) BarrierWait(s.QFull(), w.q_loads_before & 1);
    if (ctid == 0) Stamp<T>(w.index, PhaseSlot::kQReadyClock);
    WgmmaFence();
    if constexpr (T::kSplitQ) {
      IssueScores<T, true>(acc, acc_odd, s, w.Tile(0), q_desc0, w.q_loads_before & 1);
    } else {
      issue_qk(0);
    }
    WgmmaCommit();
    WgmmaWait<0>();
    if (w.num_tiles == 1) q_read();
    finish_qk();
    softmax_tile(0);  // O is still 0: its factor changes nothing
    ScoresToA(acc, pf);
    if (ctid == 0) Stamp<T>(w.index, PhaseSlot::kFirstSClock);
    // One key tile: P V of tile t, then (kMore) S of tile t + 1, whose softmax runs once P V is
    // done. P V goes first so that tile t's stage is released (and refilled) before S of tile
    // t + 1 runs: issued the other way round, both stages would be in use until tile t + 1's S
    // had to wait for tile t + 2's copies. The last tile is peeled off so that no GEMM is issued
    // conditionally: ptxas serializes every wgmma of a kernel whose in-flight groups it cannot
    // count.
    auto step = [&](int t, auto more) {
      constexpr bool kMore = decltype(more)::value;
      RescaleAccumulator<kLazyRescale>(o, alpha);
      NamedBarrierSync(kPEmptyBarrier, 256);
      publish_p();
      NamedBarrierArrive(kPFullBarrier, 256);
      WgmmaFence();
#pragma unroll
      for (int ks = 0; ks < T::kPSteps; ++ks) {
        Wgmma<kHalfCols>::RSTransB(o, pf[ks], ValueDescriptor(s, w.Tile(t) % T::kStages, 0, ks));
      }
      WgmmaCommit();
      if constexpr (kMore) {
        issue_qk(t + 1);
        WgmmaCommit();
        WgmmaWait<1>();  // P V of tile t is done; S of tile t + 1 may still run
      } else {
        WgmmaWait<0>();
      }
      PinRegisters(o);
      PinRegisters(pf);  // the GEMM read pf until here
      Release(s, w.Tile(t), lane);
      if constexpr (kMore) NamedBarrierArrive(kLeftDoneBarrier, 256);
      if constexpr (kMore) {
        WgmmaWait<0>();
        if (t + 2 == w.num_tiles) q_read();
        finish_qk();
        softmax_tile(t + 1);
        ScoresToA(acc, pf);
      }
    };
    for (int t = 0; t + 1 < w.num_tiles; ++t) step(t, std::true_type());
    step(w.num_tiles - 1, std::false_type());
    if (ctid == 0) Stamp<T>(w.index, PhaseSlot::kLoopEndClock);
  }

  // An item without keys meets warpgroup 2 at no P barrier: in a persistent kernel, wait until it
  // has read the previous item's final rows before writing this one's.
  if (T::kPersistent && w.num_tiles == 0) NamedBarrierSync(kFinalBarrier, 256);
  const float m[2] = {softmax.m[0], softmax.m[1]};
  const float sums[2] = {softmax.RowSum(0), softmax.RowSum(1)};
  if ((lane & 3) == 0) {
#pragma unroll
    for (int x = 0; x < 2; ++x) {
      s.FinalMax()[row_g + 8 * x] = m[x];
      s.FinalSum()[row_g + 8 * x] = sums[x];
    }
  }
  NamedBarrierSync(kFinalBarrier, 256);
  const RowSink cta_sink = sink.ForItem(w.item.partial_row, w.seq, p.causal, 0);
  StoreRows(cta_sink, o, m, sums, w.item.row_begin + 16 * warp, w.num_rows, 0, lane, true);
  if (ctid == 0) {
    Stamp<T>(w.index, PhaseSlot::kStoredClock0);
    Stamp<T>(w.index, PhaseSlot::kEndNs0, GlobalTimerNs());
  }
}

// Warpgroup 2: output columns [256, 512) from the score warpgroup's P and factors.
template <typename T>
__device__ __forceinline__ void ConsumeSecond(const MlaParams& p, const Work& w, const Smem<T>& s,
                                              int ctid, const RowSink& sink) {
  const int warp = ctid / 32, lane = ctid % 32;
  const int row_g = 16 * warp + lane / 4;
  float o[kDTiles][4] = {};

  if (w.num_tiles > 0) {
    NamedBarrierArrive(kPEmptyBarrier, 256);  // P's buffer starts free
    for (int t = 0; t < w.num_tiles; ++t) {
      // Its V half's blocks (done long since: S read them), each seen through its barrier.
#pragma unroll
      for (int cb = kHalfCols / 64; cb < kMlaCkvDim / 64; ++cb) WaitFull(s, w.Tile(t), cb);
      NamedBarrierSync(kPFullBarrier, 256);
      const float alpha[2] = {s.Alpha()[row_g], s.Alpha()[row_g + 8]};
      RescaleAccumulator<kLazyRescale>(o, alpha);
      // The score warpgroup signals its P V of tile t wherever S of tile t + 1 follows it.
      if (t + 1 < w.num_tiles) NamedBarrierSync(kLeftDoneBarrier, 256);
      WgmmaFence();
#pragma unroll
      for (int ks = 0; ks < T::kPSteps; ++ks) {
        Wgmma<kHalfCols>::SSTransB(o, KMajorDescriptor(s.P() + ks * 32),
                                   ValueDescriptor(s, w.Tile(t) % T::kStages, kHalfCols, ks));
      }
      WgmmaCommit();
      WgmmaWait<0>();
      PinRegisters(o);
      Release(s, w.Tile(t), lane, 1);
      // The last tile's P is not refilled: the arrivals match the score warpgroup's waits.
      if (t + 1 < w.num_tiles) NamedBarrierArrive(kPEmptyBarrier, 256);
    }
  }

  if (T::kPersistent && w.num_tiles == 0) NamedBarrierSync(kFinalBarrier, 256);  // as above
  NamedBarrierSync(kFinalBarrier, 256);
  const float m[2] = {s.FinalMax()[row_g], s.FinalMax()[row_g + 8]};
  const float sums[2] = {s.FinalSum()[row_g], s.FinalSum()[row_g + 8]};
  const RowSink cta_sink = sink.ForItem(w.item.partial_row, w.seq, p.causal, 0);
  StoreRows(cta_sink, o, m, sums, w.item.row_begin + 16 * warp, w.num_rows, kHalfCols, lane, false);
  if (ctid == 0) {
    Stamp<T>(w.index, PhaseSlot::kStoredClock1);
    Stamp<T>(w.index, PhaseSlot::kEndNs1, GlobalTimerNs());
  }
}

// ---- The transposed kernel for few heads (NarrowTraits). A decode of 8 to 32 heads fills only
// that many of the 64 rows the kernels above give a tile, so they do 2-8x the tensor work the
// heads need and are bound by it (16 heads: ~2.2 us per 64-key tile, where the tile's 72 KiB take
// ~2.4 us at each SM's share of HBM: compute and copies barely overlap). Transposed, the keys are
// the M side of every GEMM and the heads the N side:
//   S^T (64 keys x kN heads) = K (64 x 576) Q^T,           36 wgmma m64nNk16, both K-major;
//   O^T (512 columns x kN)  += V^T (512 x 64 keys) P^T,    8 column blocks x 4 k-steps, V^T
//                                                          MN-major straight from the key tile,
//                                                          P^T ([head][key], bf16) from shared
//                                                          memory;
// so the tensor work is that of the real heads, and a tile costs about a third of its copy time.
// One consumer warpgroup does it all (O^T is 64-128 registers a lane); the producer warpgroup is
// the one above (Produce), with Q only kN rows. The softmax runs down the columns: each head's
// tile maximum is reduced over the lanes that hold it and then over the four warps through shared
// memory (two buffers, by tile parity, so one barrier a tile suffices); the sums stay per lane
// until the end. Rows are packed as everywhere (token x head), so a prefill runs correctly too;
// it takes at most kMlaSm90NarrowMaxHeads heads, and the default takes it for decodes (api.cc).
// On the H200 (bench/RESULTS.md): 16 heads, b64 x 4096, 102 -> 93 us; in the kernel DRAM at
// 3.67 TB/s (76%) and L2 at 87% of its peak (ncu), and the two chunks' merge takes ~5 us more.
// Per SM it streams as fast as the GQA decode does (ncu on the H100: 21 against 22 GB/s of DRAM
// reads an SM, the same L2 traffic per byte); the whole is slower partly for the 4 SMs its 128
// CTAs leave idle. Tried and dropped: TMA tiles (1.5 us slower; 2.5-3.5% slower with the early
// release below), 56-key tiles in three stages to keep more bytes in flight (1.4 us faster at
// equal chunking: the ring's depth is not what holds the kernel), the keys in a ring of 25 8 KiB
// column blocks with P V's blocks freed a pair at a time (16 blocks in flight while a tile is
// consumed; trial 47: 2.6-3.1% slower on two H100s), S in four chains of k-steps (trial 49: level),
// launching the merge as a programmatic dependent (no change), the merge done by each
// sequence's last chunk to finish instead of a merge kernel (counters in the workspace; the
// kernel ran 94 us against 82 + 5 for the two: the merge lands in the one wave's tail).
// Cluster merge (kClusterMerge, MergeCluster below): a split decode's chunks of one row tile run
// as one thread-block cluster (PlanConfig::cluster_splits, up to kMaxClusterSplits), which merges
// them through distributed shared memory when all are done: no partial rows in global memory,
// no merge kernel and no second launch, and no wait on other CTAs but the cluster's own, which
// started together and stream equal shares of the keys. On the H200, 16 heads, b64 x 4096 (two
// 2048-key chunks a sequence): 95.1 -> 90.8 us, the kernel 82.7 -> 82.7-85.2 us under Nsight
// Compute (the merge kernel took 5.1). A first form that merged a row at a time, each load
// waiting for the one before, took 88 us in the kernel and gained nothing.
constexpr int kMaxClusterSplits = 8;  // the largest portable cluster

// A split decode's chunks of a row tile run as a cluster and merge there (kClusterMerge) where the
// plan groups them (PlanConfig::cluster_splits); other launches run plain CTAs of the same kernel.
template <int kN_>
struct NarrowTraits {
  static constexpr bool kNarrow = true;
  static constexpr bool kClusterMerge = true;
  static constexpr bool kPersistent = false;
  static constexpr bool kStamps = false;
  static constexpr int kNextItem = 0;
  static constexpr bool kSplitQ = false;
  static constexpr int kQBarriers = 1;
  static constexpr int kN = kN_;  // heads (packed rows) per CTA: wgmma's N
  static_assert(kN == 16 || kN == 32, "the widths of Wgmma<16> and Wgmma<32>");
  static constexpr int kBlockM = kN;
  static constexpr int kThreads = 256;  // the producer and one consumer warpgroup
  static constexpr int kConsumerWarps = 4;
  static constexpr int kBlockN = 64;
  static constexpr int kStages = 2;
  static constexpr bool kLateRight = false;
  static constexpr int kTouchTiles = 0;  // as Traits'
  // cp.async, not TMA, at every page size: 1.5-1.8 us faster at 16 heads on the H200 (93.4 against
  // 95.0 us, bench/RESULTS.md).
  static constexpr bool kTma = false;
  static constexpr int kReleases = 1;
  static constexpr int kPoolRegisters = 0;  // no setmaxnreg: 256 lanes leave each 255 registers
  static constexpr int kNTiles = kN / 8;    // 8-head fragments of S^T and O^T
  static constexpr int kOBlocks = kMlaCkvDim / 64;  // O^T's 64-column blocks (wgmma's M)
  static constexpr int kPSteps = kBlockN / 16;
  static constexpr int kBlockBytes = kBlockN * 128;
  static constexpr int kTileBytes = kColumnBlocks * kBlockBytes;
  static constexpr int kKvPasses = kBlockN / kRowsPerPass;
  static constexpr int kQBlockBytes = kN * 128;
  static constexpr int kQBytes = kColumnBlocks * kQBlockBytes;
  static constexpr int kPBytes = kN * kBlockN * 2;  // P^T: kN rows of 64 keys, one column block
  // Per head: each warp's tile maximum for two tiles, each warp's final sum.
  static constexpr int kRowFloats = (2 + 1) * kConsumerWarps * kN;
  static constexpr int kBarriers = 1 + kStages * kColumnBlocks + kStages * kReleases;
  static constexpr int kSmemBytes =
      1024 + kQBytes + kStages * kTileBytes + kPBytes + kRowFloats * 4 + 8 * kBarriers;
  static_assert(kSmemBytes <= 227 * 1024, "shared memory of one CTA");
  // The epilogue stages the finished rows as floats over the key stages, rows 4 floats apart in
  // banks (conflict-free for the fragments' stores, 16-byte aligned for the rows' loads).
  static constexpr int kStagingStride = kMlaCkvDim + 4;
  // After them, kClusterMerge's: each row's chunk lse.
  static_assert((kN * kStagingStride + kN) * 4 <= kStages * kTileBytes);
};

// The narrow epilogue's staging (NarrowTraits::kStagingStride) over the key stages, and after it
// the rows' chunk lse (kClusterMerge).
template <typename T>
__device__ __forceinline__ float* NarrowStaging(const Smem<T>& s) {
  return reinterpret_cast<float*>(s.ptr + (s.Kv(0) - s.base));
}

// The consumer warpgroup's named barriers (128 threads each).
constexpr int kNarrowMaxBarrier = 1;  // every warp's tile maxima are in shared memory
constexpr int kNarrowPBarrier = 2;    // P^T is in shared memory (also: the epilogue's steps)

// `clustered`: the item is one chunk of a cluster's row tile (kClusterMerge), whose rows this
// warpgroup leaves in the staging, normalized by their chunk sum, with their chunk lse, for
// MergeCluster; otherwise it stores them through the sink.
template <typename T>
__device__ __forceinline__ void ConsumeNarrow(const MlaParams& p, const Work& w, const Smem<T>& s,
                                              int ctid, const RowSink& launch_sink,
                                              bool clustered) {
  constexpr int kN = T::kN, kNT = T::kNTiles;
  const RowSink sink = launch_sink.ForItem(w.item.partial_row, w.seq, p.causal, 0);
  const int warp = ctid / 32, lane = ctid % 32;
  const float scale_log2 = p.sm_scale * kLog2e;
  const int item_rows = min(kN, w.num_rows - w.item.row_begin);
  // The lane's heads (columns of S^T and O^T): 8 j + 2 (lane % 4) + e. Its keys (rows of S^T) in
  // a tile: 16 warp + lane / 4 and 8 further (fragment entries c < 2 and c >= 2).
  auto head = [&](int j, int e) { return 8 * j + 2 * (lane & 3) + e; };
  const int key0 = 16 * warp + lane / 4;
  int limit[kNT][2];  // keys [0, limit) of the item's range that the head's row sees
  int min_limit = w.item.kv_end;
#pragma unroll
  for (int j = 0; j < kNT; ++j) {
#pragma unroll
    for (int e = 0; e < 2; ++e) {
      const int r = w.item.row_begin + head(j, e);
      limit[j][e] = r < w.num_rows
                        ? min(VisibleKeys(w.seq, r / p.num_heads, p.causal), w.item.kv_end)
                        : w.item.kv_end;
      min_limit = min(min_limit, limit[j][e]);
    }
  }

  float o[T::kOBlocks][kNT][4] = {};
  float acc[kNT][4];
  float m[kNT][2], d[kNT][2];  // per head: running max of s' and this lane's share of the sum
#pragma unroll
  for (int j = 0; j < kNT; ++j) {
    m[j][0] = m[j][1] = -INFINITY;
    d[j][0] = d[j][1] = 0.f;
  }
  float* const warp_max = s.Rows();                               // [2 tiles][warps][kN]
  float* const warp_sum = warp_max + 2 * T::kConsumerWarps * kN;  // [warps][kN]
  unsigned char* const pt = s.PPtr();

  const uint64_t q_desc0 = KMajorDescriptor(s.Q());
  auto issue_s = [&](int t) {
    const uint64_t q_desc = Opaque(q_desc0);  // as in ConsumeScores: not 36 live descriptors
    const uint64_t k_desc = KMajorDescriptor(s.Kv(t % T::kStages));
#pragma unroll
    for (int ks = 0; ks < kKSteps; ++ks) {
      if (ks % 4 == 0) WaitFull(s, t, ks / 4);
      const uint32_t in_block = (ks % 4) * 32;
      const uint64_t a = k_desc + (((ks / 4) * T::kBlockBytes + in_block) >> 4);
      const uint64_t b = q_desc + (((ks / 4) * T::kQBlockBytes + in_block) >> 4);
      Wgmma<kN>::SS(acc, a, b, ks > 0 ? 1u : 0u);
    }
  };
  auto issue_pv = [&](int t) {
    const uint32_t v = s.Kv(t % T::kStages);
#pragma unroll
    for (int ks = 0; ks < T::kPSteps; ++ks) {
      const uint64_t b = KMajorDescriptor(s.P() + ks * 32);
#pragma unroll
      for (int mb = 0; mb < T::kOBlocks; ++mb) {
        Wgmma<kN>::SSTransA(
            o[mb], MnMajorDescriptor(v + mb * T::kBlockBytes + ks * 2048, T::kBlockBytes), b);
      }
    }
  };
  auto pin_o = [&] {
#pragma unroll
    for (int mb = 0; mb < T::kOBlocks; ++mb) PinRegisters(o[mb]);
  };
  // Tile t's scores become P^T in shared memory; O^T and the sums are rescaled to the new maxima.
  // OnlineSoftmax's rules (TileMax, Rescale, Exponentiate), down columns instead of along rows.
  auto softmax = [&](int t) {
    const int tile_key0 = w.item.kv_begin + t * T::kBlockN;
    if (tile_key0 + T::kBlockN > min_limit) {
#pragma unroll
      for (int j = 0; j < kNT; ++j) {
#pragma unroll
        for (int c = 0; c < 4; ++c) {
          if (tile_key0 + key0 + 8 * (c >> 1) >= limit[j][c & 1]) acc[j][c] = -INFINITY;
        }
      }
    }
    float* const maxima = warp_max + (t & 1) * T::kConsumerWarps * kN;
#pragma unroll
    for (int j = 0; j < kNT; ++j) {
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        float v;
        if (scale_log2 > 0.f) {
          v = fmaxf(acc[j][e], acc[j][e + 2]) * scale_log2;
        } else {
#pragma unroll
          for (int c = e; c < 4; c += 2) {
            acc[j][c] = acc[j][c] == -INFINITY ? -INFINITY : acc[j][c] * scale_log2;
          }
          v = fmaxf(acc[j][e], acc[j][e + 2]);
        }
#pragma unroll
        for (int x = 4; x < 32; x *= 2) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, x));
        if (lane < 4) maxima[warp * kN + head(j, e)] = v;
      }
    }
    NamedBarrierSync(kNarrowMaxBarrier, 128);
    const float scale = scale_log2 > 0.f ? scale_log2 : 1.f;
#pragma unroll
    for (int j = 0; j < kNT; ++j) {
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        const int h = head(j, e);
        float tile_max = maxima[h];
#pragma unroll
        for (int x = 1; x < T::kConsumerWarps; ++x) tile_max = fmaxf(tile_max, maxima[x * kN + h]);
        const float m_new = fmaxf(m[j][e], tile_max);
        const float base = ExpBase(m_new);
        const float alpha = Exp2(m[j][e] - base);
        m[j][e] = m_new;
        acc[j][e] = Exp2(fmaf(acc[j][e], scale, -base));
        acc[j][e + 2] = Exp2(fmaf(acc[j][e + 2], scale, -base));
        d[j][e] = d[j][e] * alpha + (acc[j][e] + acc[j][e + 2]);
#pragma unroll
        for (int mb = 0; mb < T::kOBlocks; ++mb) {
          o[mb][j][e] *= alpha;
          o[mb][j][e + 2] *= alpha;
        }
      }
    }
    // P^T, [head][key] in the 128-byte swizzle: the K-major B operand of P V.
#pragma unroll
    for (int j = 0; j < kNT; ++j) {
#pragma unroll
      for (int c = 0; c < 4; ++c) {
        const int h = head(j, c & 1), k = key0 + 8 * (c >> 1);
        *reinterpret_cast<uint16_t*>(pt + h * 128 + (((k >> 3) ^ (h & 7)) << 4) + (k & 7) * 2) =
            __bfloat16_as_ushort(__float2bfloat16_rn(acc[j][c]));
      }
    }
    FenceProxyAsync();  // P^T's ordinary stores before the wgmma reads them
    NamedBarrierSync(kNarrowPBarrier, 128);
  };

  if (w.num_tiles > 0) {
    BarrierWait(s.QFull(), 0);
    WgmmaFence();
    issue_s(0);
    WgmmaCommit();
    WgmmaWait<0>();
    PinRegisters(acc);
    softmax(0);
    // P V of tile t, waited for, then (kMore) S of tile t + 1 on the other stage. Tile t's stage
    // is released as soon as P V is done, before S of tile t + 1, whose issue waits for each of
    // that tile's blocks: released after it (P V and S overlapping), tile t + 2's copies could
    // not start before tile t + 1 had landed, one tile in flight at a time (2% slower on the
    // H200, level on the H100: bench/RESULTS.md; the tensor work is a third of the copy time).
    // Every warp passes the wait for P V before the next tile's maximum barrier, so P^T is not
    // overwritten under a running GEMM. The last tile is peeled off (no GEMM issued
    // conditionally: see ConsumeScores).
    auto step = [&](int t, auto more) {
      constexpr bool kMore = decltype(more)::value;
      WgmmaFence();
      issue_pv(t);
      WgmmaCommit();
      WgmmaWait<0>();
      pin_o();
      Release(s, t, lane);
      if constexpr (kMore) {
        WgmmaFence();
        issue_s(t + 1);
        WgmmaCommit();
        WgmmaWait<0>();
        PinRegisters(acc);
        softmax(t + 1);
      }
    };
    for (int t = 0; t + 1 < w.num_tiles; ++t) step(t, std::true_type());
    step(w.num_tiles - 1, std::false_type());
  }

  // Each head's sum: over the lanes that hold it, then over the warps. The barrier also means
  // every warp's GEMMs are done, so the staging may overlay the key stages.
#pragma unroll
  for (int j = 0; j < kNT; ++j) {
#pragma unroll
    for (int e = 0; e < 2; ++e) {
      float v = d[j][e];
#pragma unroll
      for (int x = 4; x < 32; x *= 2) v += __shfl_xor_sync(0xffffffffu, v, x);
      if (lane < 4) warp_sum[warp * kN + head(j, e)] = v;
    }
  }
  NamedBarrierSync(kNarrowPBarrier, 128);
  float* const staging = NarrowStaging(s);
  float* const chunk_lse = staging + kN * T::kStagingStride;
#pragma unroll
  for (int j = 0; j < kNT; ++j) {
#pragma unroll
    for (int e = 0; e < 2; ++e) {
      const int h = head(j, e);
      float v = warp_sum[h];
#pragma unroll
      for (int x = 1; x < T::kConsumerWarps; ++x) v += warp_sum[x * kN + h];
      const int packed = w.item.row_begin + h;
      const float inv = h >= item_rows ? 0.f
                        : clustered    ? ChunkInverseSum(v)
                                       : sink.Inverse(packed, m[j][e], v);
#pragma unroll
      for (int mb = 0; mb < T::kOBlocks; ++mb) {
#pragma unroll
        for (int x = 0; x < 2; ++x) {
          // O^T's rows are output columns, as S^T's are keys.
          staging[h * T::kStagingStride + 64 * mb + key0 + 8 * x] = o[mb][j][e + 2 * x] * inv;
        }
      }
      if (warp == 0 && lane < 4) {
        if (clustered) {
          chunk_lse[h] = PartialLse(m[j][e], v);
        } else if (h < item_rows) {
          sink.StoreLse(packed, sink.Row(packed), m[j][e], v);
        }
      }
    }
  }
  if (clustered) return;  // the cluster's barrier publishes the staging to MergeCluster
  NamedBarrierSync(kNarrowPBarrier, 128);
  // Each lane stores 4 columns of every row: whole rows, 16 bytes a lane.
  for (int h = 0; h < item_rows; ++h) {
    const float4 v = *reinterpret_cast<const float4*>(staging + h * T::kStagingStride + 4 * ctid);
    sink.StoreColumns<4>(sink.Row(w.item.row_begin + h), 4 * ctid, {v.x, v.y, v.z, v.w}, 1.f);
  }
}

// The cluster's chunks of one row tile merged as merge_states.cu merges a token's chunks:
//   lse = log2(sum_c 2^lse_c),  out = sum_c 2^(lse_c - lse) * out_c,
// from every CTA's staging and chunk lse (ConsumeNarrow, clustered) in distributed shared memory.
// CTA r of the kSplits takes rows r, r + kSplits, ...: its two warpgroups (the producer's too)
// every other one of those, each lane 4 columns of the row. Every load is issued before the first
// is used (a remote one costs about an L2 hit), and the weights' order is the merge kernel's.
template <typename T, int kSplits>
__device__ __forceinline__ void MergeCluster(const MlaParams& p, const Work& w, const Smem<T>& s,
                                             int tid, const RowSink& launch_sink) {
  namespace cg = cooperative_groups;
  const cg::cluster_group cluster = cg::this_cluster();
  constexpr int kRows = (T::kN + 2 * kSplits - 1) / (2 * kSplits);  // per warpgroup, at most
  const int rank = static_cast<int>(cluster.block_rank());
  const int col = 4 * (tid % 128);
  const RowSink sink = launch_sink.ForItem(-1, w.seq, p.causal, 0);
  const int item_rows = min(T::kN, w.num_rows - w.item.row_begin);
  const float* chunk[kSplits];
#pragma unroll
  for (int c = 0; c < kSplits; ++c) chunk[c] = cluster.map_shared_rank(NarrowStaging(s), c);
  auto row_of = [&](int i) { return rank + kSplits * (2 * i + tid / 128); };
  float lse[kRows][kSplits];
  float4 v[kRows][kSplits];
#pragma unroll
  for (int i = 0; i < kRows; ++i) {
    const int h = row_of(i);
#pragma unroll
    for (int c = 0; c < kSplits; ++c) {
      if (h < item_rows) {
        lse[i][c] = chunk[c][T::kN * T::kStagingStride + h];
        v[i][c] = *reinterpret_cast<const float4*>(chunk[c] + h * T::kStagingStride + col);
      }
    }
  }
#pragma unroll
  for (int i = 0; i < kRows; ++i) {
    const int h = row_of(i);
    if (h >= item_rows) break;
    float max_lse = -INFINITY;
#pragma unroll
    for (int c = 0; c < kSplits; ++c) max_lse = fmaxf(max_lse, lse[i][c]);
    // The merge's rule for the row (merge_states.cu): a NaN or +inf chunk lse makes sum NaN.
    const float base = ExpBase(max_lse);
    float sum = 0.f;
    float acc[4] = {0.f, 0.f, 0.f, 0.f};
#pragma unroll
    for (int c = 0; c < kSplits; ++c) {
      const float weight = Exp2(lse[i][c] - base);
      sum += weight;
      acc[0] += weight * v[i][c].x;
      acc[1] += weight * v[i][c].y;
      acc[2] += weight * v[i][c].z;
      acc[3] += weight * v[i][c].w;
    }
    const int packed = w.item.row_begin + h;
    const int64_t row = sink.Row(packed);
    sink.StoreOutputColumns<4>(row, col, acc, InverseSum(sink.SeesKeys(packed), max_lse, sum));
    if (col == 0 && sink.has_lse()) sink.StoreOutputLse(packed, row, max_lse, sum);
  }
}

// MergeCluster for the launch's cluster size n (2 to kMaxClusterSplits).
template <typename T, int kSplits = 2>
__device__ __forceinline__ void MergeClusterOf(const MlaParams& p, const Work& w, const Smem<T>& s,
                                               int tid, const RowSink& sink, int n) {
  if constexpr (kSplits < kMaxClusterSplits) {
    if (n != kSplits) return MergeClusterOf<T, kSplits + 1>(p, w, s, tid, sink, n);
  }
  MergeCluster<T, kSplits>(p, w, s, tid, sink);
}

// Item `index` of the plan as a CTA runs it.
template <typename T>
__device__ __forceinline__ Work WorkOf(const MlaParams& p, const DeviceWorkItem* items, int index) {
  Work w;
  w.index = index;
  const DeviceWorkItem& planned = items[static_cast<uint32_t>(index)];  // never negative
  w.item = planned.item;
  w.seq = ExtentOf(planned, p.batch);
  w.num_rows = w.seq.q_len * p.num_heads;
  w.num_tiles = max(0, (w.item.kv_end - w.item.kv_begin + T::kBlockN - 1) / T::kBlockN);
  return w;
}

// Persistent kernels (T::kPersistent): a grid of at most one CTA an SM, each running item
// blockIdx.x and then items gridDim.x + n for the tickets n it draws from the plan's counter
// (DevicePlan::schedule), in the plan's longest-first order, until none is left; so a CTA's next
// Q and first key tiles load while its consumers finish the last tiles of the item before and
// store its rows, where a CTA an item paid for them (and for its start) between items. The
// producer's thread 0 draws a ticket once it has issued an item's copies and hands the index to
// every thread of the CTA through WorkSlot (-1: none left); the last CTA to finish sets the
// counter back to zero.
template <typename T>
struct ItemQueue {
  const Smem<T>& s;
  int num_items;
  uint32_t* schedule;

  // Thread 0: the next ticket's item index.
  __device__ __forceinline__ int Draw() const {
    return static_cast<int>(gridDim.x + atomicAdd(&schedule[0], 1u));
  }

  // Thread 0: publishes the CTA's item k >= 1, `index` (past the last item: none, -1); with
  // T::kNextItem, its whole Work (index -1: none).
  __device__ __forceinline__ void Publish(const MlaParams& p, const DeviceWorkItem* items, int k,
                                          int index) const {
    const int slot = (k - 1) % 2, use = (k - 1) / 2;
    if (use > 0) BarrierWait(s.WorkEmpty(slot), (use - 1) & 1);
    if constexpr (T::kNextItem != 0) {
      Work w;
      w.index = -1;
      if (index < num_items) w = WorkOf<T>(p, items, index);
      const int words[] = {w.index,          w.item.seq,         w.item.row_begin, w.item.kv_begin,
                           w.item.kv_end,    w.item.partial_row, w.seq.q_begin,    w.seq.q_len,
                           w.seq.page_begin, w.seq.num_pages,    w.seq.kv_len,     w.seq.layer,
                           w.num_rows,       w.num_tiles};
      static_assert(sizeof(words) == 4 * T::kWorkWords);
#pragma unroll
      for (int i = 0; i < T::kWorkWords; ++i) s.WorkSlot(slot)[i] = words[i];
    } else {
      *s.WorkSlot(slot) = index < num_items ? index : -1;
    }
    BarrierArrive(s.WorkFull(slot));
  }

  // Every thread, once for each k >= 1 in order: the index of the CTA's item k, or -1. The same
  // in every lane of a warp, as the compiler sees (so that it takes what depends on it for
  // uniform, as it does blockIdx.x).
  __device__ __forceinline__ int Read(int k) const {
    const int slot = (k - 1) % 2, use = (k - 1) / 2;
    BarrierWait(s.WorkFull(slot), use & 1);
    const int index = *s.WorkSlot(slot);
    BarrierArrive(s.WorkEmpty(slot));
    return __shfl_sync(0xffffffffu, index, 0);
  }

  // T::kNextItem, the consumers: Read's, the CTA's item k as a whole Work (index -1: none).
  __device__ __forceinline__ Work ReadWork(int k) const {
    const int slot = (k - 1) % 2, use = (k - 1) / 2;
    BarrierWait(s.WorkFull(slot), use & 1);
    int words[T::kWorkWords];
#pragma unroll
    for (int i = 0; i < T::kWorkWords; ++i) words[i] = s.WorkSlot(slot)[i];
    BarrierArrive(s.WorkEmpty(slot));
#pragma unroll
    for (int i = 0; i < T::kWorkWords; ++i) words[i] = __shfl_sync(0xffffffffu, words[i], 0);
    Work w;
    w.index = words[0];
    w.item = {words[1], words[2], words[3], words[4], words[5]};
    w.seq = {words[6], words[7], words[8], words[9], words[10], words[11]};
    w.num_rows = words[12];
    w.num_tiles = words[13];
    return w;
  }

  // Thread 0, once it drew past the last item: the last CTA to get here zeroes the counter.
  __device__ __forceinline__ void Finish() const {
    __threadfence();
    if (atomicAdd(&schedule[1], 1u) == gridDim.x - 1) {
      schedule[0] = 0;
      schedule[1] = 0;
    }
  }
};

// Runs fn(w) on each item of the CTA: `first` (item blockIdx.x) alone, or (T::kPersistent) it and
// then those of the queue. kProducer: the calling warpgroup is the producer, whose thread 0 draws
// and publishes the items.
template <typename T, bool kProducer, typename Fn>
__device__ __forceinline__ void ForEachItem(const MlaParams& p, const DeviceWorkItem* items,
                                            const ItemQueue<T>& queue, const Work& first, Fn&& fn) {
  if constexpr (!T::kPersistent) {
    fn(first);
  } else {
    const bool drawer = kProducer && threadIdx.x == 0;
    int tiles = 0, q_loads = 0;
    Work w = first;
    for (int k = 1;; ++k) {
      fn(w);
      tiles += w.num_tiles;
      q_loads += w.num_tiles > 0 ? 1 : 0;
      __syncwarp();  // converge each warp before the next item's GEMMs (file comment)
      // Drawn once the producer has issued the item's copies: its next Q waits for the item's
      // last S anyway, about a tile later.
      if (drawer) queue.Publish(p, items, k, queue.Draw());
      if constexpr (T::kNextItem != 0 && !kProducer) {
        w = queue.ReadWork(k);
        if (w.index < 0) break;
      } else {
        const int index = queue.Read(k);
        if (index < 0) break;
        w = WorkOf<T>(p, items, index);
      }
      w.tiles_before = tiles;
      w.q_loads_before = q_loads;
    }
    if (drawer) queue.Finish();
  }
}

// `clustered`: the launch runs the plan's row tiles as clusters of their chunks (kClusterMerge).
template <typename T>
__global__ void __launch_bounds__(T::kThreads, 1)
    MlaSm90Kernel(const MlaParams p, const DeviceWorkItem* __restrict__ items, int num_items,
                  uint32_t* schedule, RowSink sink, const __grid_constant__ CUtensorMap kv_map,
                  bool use_tma, bool clustered) {
  static_assert(!(T::kPersistent && T::kClusterMerge));
  extern __shared__ __align__(1024) unsigned char smem[];
  const uint32_t raw = SharedAddress(smem);
  const uint32_t base = (raw + 1023u) & ~1023u;
  const Smem<T> s{base, smem + (base - raw)};
  const ItemQueue<T> queue{s, num_items, schedule};
  const Work first = WorkOf<T>(p, items, blockIdx.x);

  const int tid = threadIdx.x;
  if (tid == 0) {
    // Copies of the 128 producer lanes (kSplitQ: one barrier a column block).
    for (int cb = 0; cb < T::kQBarriers; ++cb) BarrierInit(s.QFull(cb), 128);
    for (int i = 0; i < T::kStages; ++i) {
      for (int cb = 0; cb < kColumnBlocks; ++cb) BarrierInit(s.KvFull(i, cb), 128);
      // One arrival per consumer warp (kLateRight: of the warpgroup that finishes the half).
      for (int h = 0; h < T::kReleases; ++h) {
        BarrierInit(s.KvEmpty(i, h), T::kConsumerWarps / T::kReleases);
      }
    }
    if constexpr (T::kPersistent) {
      BarrierInit(s.QEmpty(), 4);  // the score warpgroup's warps
      for (int slot = 0; slot < 2; ++slot) {
        BarrierInit(s.WorkFull(slot), 1);
        BarrierInit(s.WorkEmpty(slot), T::kThreads);
      }
    }
  }
  __syncthreads();

  if (tid < 128) {
    if constexpr (!T::kNarrow) ReleaseRegisters<T::kProducerRegisters>();
    ForEachItem<T, true>(p, items, queue, first,
                         [&](const Work& w) { Produce<T>(p, w, s, kv_map, use_tma, tid); });
    if constexpr (T::kPersistent) WaitAllCopies();
  } else if constexpr (T::kNarrow) {
    ConsumeNarrow<T>(p, first, s, tid - 128, sink, clustered);
  } else if (tid < 256) {
    ClaimRegisters<T::kFirstRegisters>();
    ForEachItem<T, false>(p, items, queue, first,
                          [&](const Work& w) { ConsumeScores<T>(p, w, s, tid - 128, sink); });
  } else {
    ClaimRegisters<T::kSecondRegisters>();
    ForEachItem<T, false>(p, items, queue, first,
                          [&](const Work& w) { ConsumeSecond<T>(p, w, s, tid - 256, sink); });
  }
  if constexpr (T::kClusterMerge) {
    if (clustered) {
      // Every thread of the cluster, the producers' too: each CTA's chunk is staged, then no CTA
      // leaves while another may still read its shared memory.
      cooperative_groups::this_cluster().sync();
      MergeClusterOf<T>(p, first, s, tid, sink,
                        static_cast<int>(cooperative_groups::this_cluster().num_blocks()));
      cooperative_groups::this_cluster().sync();
    }
  }
}

// The cache as a TMA tensor map: rows of 576 bf16 (every layer's pages in order), boxes of 64
// rows x 64 columns (one 128-byte column block of a key tile) in the 128-byte swizzle the tiles
// use (hopper.cuh's TensorMapEncoder: the driver's entry point, looked up once).
cudaError_t EncodeKvMap(const MlaCache& cache, CUtensorMap* map) {
  const TensorMapEncodeTiled encode = TensorMapEncoder();
  if (encode == nullptr) return cudaErrorNotSupported;
  const cuuint64_t dims[2] = {
      kMlaTokenDim, static_cast<cuuint64_t>(cache.num_layers) * cache.num_pages * cache.page_size};
  const cuuint64_t strides[1] = {kMlaTokenDim * sizeof(bf16)};
  const cuuint32_t box[2] = {64, 64};
  const cuuint32_t element_strides[2] = {1, 1};
  const CUresult r =
      encode(map, CU_TENSOR_MAP_DATA_TYPE_BFLOAT16, 2, cache.data, dims, strides, box,
             element_strides, CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_128B,
             CU_TENSOR_MAP_L2_PROMOTION_L2_256B, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
  return r == CUDA_SUCCESS ? cudaSuccess : cudaErrorInvalidValue;
}

template <typename T>
struct Config {
  static constexpr auto kKernel = MlaSm90Kernel<T>;

  static cudaError_t Launch(const MlaParams& p, const DevicePlan& plan, cudaStream_t stream) {
    if (T::kNarrow && p.num_heads > kMlaSm90NarrowMaxHeads) return cudaErrorInvalidValue;
    ATTN_CUDA_RETURN_IF_ERROR(AllowSharedMemory(kKernel, T::kSmemBytes));
    const RowSink sink = RowSink::ForMla(p, plan);
    // TMA where whole tiles lie in pages and the map's row coordinates fit its 32 bits.
    CUtensorMap kv_map{};
    const bool use_tma =
        T::kTma && p.cache.page_size % T::kBlockN == 0 &&
        int64_t{p.cache.num_layers} * p.cache.num_pages * p.cache.page_size <= INT32_MAX;
    if (use_tma) ATTN_CUDA_RETURN_IF_ERROR(EncodeKvMap(p.cache, &kv_map));
    const bool clustered = plan.cluster_splits > 1;
    if (clustered && (!T::kClusterMerge || plan.cluster_splits > kMaxClusterSplits ||
                      plan.num_items % plan.cluster_splits != 0)) {
      return cudaErrorInvalidValue;
    }
    if (T::kPersistent && (plan.schedule == nullptr || plan.cta_slots <= 0)) {
      return cudaErrorInvalidValue;
    }
    // A persistent launch: as many CTAs as the device holds at once (one an SM), or fewer items.
    const int grid = T::kPersistent ? std::min(plan.num_items, plan.cta_slots) : plan.num_items;
    cudaLaunchConfig_t config{};
    config.gridDim = dim3(grid);
    config.blockDim = dim3(T::kThreads);
    config.dynamicSmemBytes = T::kSmemBytes;
    config.stream = stream;
    cudaLaunchAttribute cluster{};  // the plan's chunk groups, where it has them
    cluster.id = cudaLaunchAttributeClusterDimension;
    cluster.val.clusterDim.x = static_cast<unsigned>(plan.cluster_splits);
    cluster.val.clusterDim.y = 1;
    cluster.val.clusterDim.z = 1;
    config.attrs = &cluster;
    config.numAttrs = clustered ? 1 : 0;
    ATTN_CUDA_RETURN_IF_ERROR(cudaLaunchKernelEx(&config, kKernel, p, plan.items, plan.num_items,
                                                 plan.schedule, sink, kv_map, use_tma, clustered));
    ATTN_CUDA_RETURN_IF_LAUNCH_FAILED();
    return cudaSuccess;
  }

  static cudaError_t Tiling(int num_heads, bool decode, KernelTiling* tiling) {
    if (T::kNarrow && num_heads > kMlaSm90NarrowMaxHeads) return cudaErrorNotSupported;
    // The register split assumes the compiler gave the kernel the whole launch bound.
    cudaFuncAttributes attributes;
    ATTN_CUDA_RETURN_IF_ERROR(cudaFuncGetAttributes(&attributes, kKernel));
    if (attributes.numRegs * T::kThreads < T::kPoolRegisters) return cudaErrorNotSupported;
    if constexpr (T::kNarrow) {
      // Memory-bound: one wave of CTAs keeps HBM busy, and a second wave would only add each
      // CTA's start (Q and the first tile's latency). So a decode is split into about one wave
      // of chunks, none shorter than 512 keys (a chunk's kN x 512 float partials are 1/18 of
      // its keys' bytes at 16 heads). b64 x 4096 at 16 heads: 2 chunks of 2048, 128 CTAs.
      tiling->min_chunk_len = 512;
      if (decode) {
        tiling->waves_before_split = 1.0;
        tiling->target_waves = 1.0;
        if (T::kClusterMerge) tiling->cluster_splits = kMaxClusterSplits;
      }
    } else {
      // As the portable kernel: a chunk's 64 x 512 float partials cost little next to 1024 keys.
      tiling->min_chunk_len = 1024;
      // One CTA an SM, bound by its tensor work: a decode's split is the planner's cost model's
      // (PlanConfig::cta_start_keys), fitted on an H100 to the 128-head decode at 8-96 x 4096
      // keys whole and in chunks of 512, 1024 and 2048 (bench/RESULTS.md, 2026-12-07): a CTA ran
      // ~0.029 us a key and ~3.5 us to start, and a split added ~13 us plus ~2 ns a partial row
      // (its floats written and merged). On those shapes it picks what ran fastest, and
      // 32 x 3000 and 20 x 8192 ran 25-28% faster on its equal chunks than on the split tests'
      // 1024-key ones. Chunks down to 512 keys: 8 x 4096 ran 42.6 us in 512-key chunks (128
      // CTAs), 52.1 in 1024-key ones.
      if (decode) {
        tiling->min_chunk_len = 512;
        tiling->cta_start_keys = 120;
        tiling->merge_keys = 450;
        tiling->merge_keys_per_row = 0.068;
      }
    }
    return DescribeKernel(kKernel, T::kThreads, T::kSmemBytes, T::kBlockM, T::kBlockN, tiling);
  }
};

template <typename Fn>
cudaError_t WithConfig(int variant, Fn&& fn) {
  switch (variant) {
    case kMlaSm90Narrow16:
      return fn(Config<NarrowTraits<16>>());
    case kMlaSm90Narrow32:
      return fn(Config<NarrowTraits<32>>());
    case kMlaSm90LateRightTmaLazy:
      return fn(Config<Traits<>>());
    case kMlaSm90LateRightTmaTouch2Lazy:
      return fn(Config<Traits<2>>());
    case kMlaSm90LateRightTmaLazyLean:
      return fn(Config<Traits<0, true>>());
    case kMlaSm90LateRightTmaTouch2LazyLean:
      return fn(Config<Traits<2, true>>());
    case kMlaSm90PersistentLean:
      return fn(Config<Traits<0, true, true>>());
    case kMlaSm90PersistentTouch2Lean:
      return fn(Config<Traits<2, true, true>>());
    case kMlaSm90Stamped:  // an instrument
      return fn(Config<Traits<2, true, true, true>>());
    case kMlaSm90PersistentLeanNext:  // trials
      return fn(Config<Traits<0, true, true, false, 1>>());
    case kMlaSm90PersistentTouch2LeanNext:
      return fn(Config<Traits<2, true, true, false, 1>>());
    case kMlaSm90PersistentTouch2LeanNextTouched:
      return fn(Config<Traits<2, true, true, false, 3>>());
    case kMlaSm90PersistentLeanSplitQ:
      return fn(Config<Traits<0, true, true, false, 5>>());
    case kMlaSm90PersistentTouch2LeanSplitQ:
      return fn(Config<Traits<2, true, true, false, 7>>());
    case kMlaSm90StampedSplitQ:  // an instrument
      return fn(Config<Traits<2, true, true, true, 7>>());
    default:
      return cudaErrorInvalidValue;
  }
}

}  // namespace
}  // namespace sm90

cudaError_t LaunchMlaSm90(const MlaParams& p, const DevicePlan& plan, cudaStream_t stream,
                          int variant) {
  return sm90::WithConfig(variant, [&](auto config) { return config.Launch(p, plan, stream); });
}

cudaError_t SetMlaPhaseStamps(const PhaseStampBuffer& buffer) {
  return cudaMemcpyToSymbol(sm90::g_mla_phase_stamps, &buffer, sizeof(buffer));
}

cudaError_t MlaSm90Tiling(int variant, int num_heads, bool decode, KernelTiling* tiling) {
  return sm90::WithConfig(variant,
                          [&](auto config) { return config.Tiling(num_heads, decode, tiling); });
}

}  // namespace attn::cuda
