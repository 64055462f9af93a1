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
// Split variant (kSplitS): S accumulates even and odd k-steps into two accumulators, two
// independent chains of 18 wgmmas instead of one of 36, added once the GEMM is done.
// Measured and dropped (bench/RESULTS.md): 32-key tiles in four stages (deeper prefetch, but the
// narrower S reads Q twice as often), and cluster pairs that copied each tile from L2 once for
// both halves of a 128-head decode: both slower.
// Rows past kv_end in a tile copy the range's last key again (real, finite data the mask hides;
// never the slot itself, which may hold NaN). Causal block skipping is the planner's; masking
// runs only on tiles that cross a row's limit. Split-KV items write float32 partials through the
// common epilogue for the merge kernel.
#include <cuda_runtime.h>

#include <type_traits>

#include "kernels/cuda/common/cuda_check.h"
#include "kernels/cuda/common/epilogue.cuh"
#include "kernels/cuda/common/launch.h"
#include "kernels/cuda/common/paged_kv.cuh"
#include "kernels/cuda/common/softmax_state.cuh"
#include "kernels/cuda/sm90/hopper.cuh"
#include "kernels/cuda/sm90/launchers_sm90.h"
#include "kernels/cuda/sm90/wgmma.cuh"

namespace attn::cuda {
namespace sm90 {
namespace {

constexpr int kBlockM = 64;  // packed rows per CTA
constexpr int kThreads = 384;
constexpr int kHalfCols = kMlaCkvDim / 2;              // output columns per consumer warpgroup
constexpr int kDTiles = kHalfCols / 8;                 // 32 accumulator fragments of 8 columns
constexpr int kKSteps = kMlaTokenDim / 16;             // 36 k-steps of S
constexpr int kColumnBlocks = kMlaTokenDim / 64;       // 9 swizzled 128-byte column blocks
constexpr int kQBlockBytes = kBlockM * 128;            // one column block of Q
constexpr int kQBytes = kColumnBlocks * kQBlockBytes;  // 72 KiB
constexpr int kPBytes = kBlockM * 64 * 2;              // P, bf16, one column block (up to 64 keys)
constexpr int kRowsPerPass = 128 / 8;                  // 8 producer lanes per row
constexpr int kQPasses = kBlockM / kRowsPerPass;
constexpr int kRowFloats = 3 * kBlockM;  // per row: rescale factor, final max, final sum

// Registers per lane at launch (the most __launch_bounds__(kThreads, 1) leaves), which setmaxnreg
// redistributes: 128 x (56 + 240 + 208) = 384 x 168.
constexpr int kLaunchRegisters = 65536 / kThreads / 8 * 8;
constexpr int kProducerRegisters = 56;
constexpr int kScoreRegisters = 240;
constexpr int kSecondRegisters = 208;
constexpr int kPoolRegisters = 128 * (kProducerRegisters + kScoreRegisters + kSecondRegisters);
static_assert(kPoolRegisters <= kThreads * kLaunchRegisters);

// Named barriers between the consumers (each counts both warpgroups' 256 threads).
constexpr int kPFullBarrier = 1;   // P and the rescale factors of a tile are in shared memory
constexpr int kPEmptyBarrier = 2;  // warpgroup 2 is done reading them
constexpr int kFinalBarrier = 3;   // the rows' final (max, sum) are in shared memory

// One kernel instance: the key tile, the ring's depth and how S accumulates.
template <int kBlockN_, int kStages_, bool kSplitS_>
struct Traits {
  static constexpr int kBlockN = kBlockN_;
  static constexpr int kStages = kStages_;
  static constexpr bool kSplitS = kSplitS_;
  static constexpr int kNTiles = kBlockN / 8;        // score fragments
  static constexpr int kPSteps = kBlockN / 16;       // k-steps of P V
  static constexpr int kBlockBytes = kBlockN * 128;  // one column block of a key tile
  static constexpr int kTileBytes = kColumnBlocks * kBlockBytes;
  static constexpr int kKvPasses = kBlockN / kRowsPerPass;
  // Q's, one per column block of each stage (S starts on a tile's first block while the others
  // are in flight), and each stage's release.
  static constexpr int kBarriers = 1 + kStages * kColumnBlocks + kStages;
  // 1 KiB of slack to start the tiles on the swizzle pattern's 1024-byte period.
  static constexpr int kSmemBytes =
      1024 + kQBytes + kStages * kTileBytes + kPBytes + kRowFloats * 4 + 8 * kBarriers;
  static_assert(kSmemBytes <= 227 * 1024, "shared memory of one CTA");
};

// Shared-memory map: Q, the key stages, P, the row floats, then the mbarriers. Addresses for the
// PTX instructions (32-bit shared window) and a generic pointer for ordinary loads and stores.
template <typename T>
struct Smem {
  uint32_t base;       // 1024-byte aligned
  unsigned char* ptr;  // the same byte, generic

  __device__ uint32_t Q() const { return base; }
  __device__ uint32_t Kv(int stage) const { return base + kQBytes + stage * T::kTileBytes; }
  __device__ uint32_t P() const { return base + kQBytes + T::kStages * T::kTileBytes; }
  __device__ unsigned char* PPtr() const { return ptr + (P() - base); }
  __device__ float* Rows() const { return reinterpret_cast<float*>(PPtr() + kPBytes); }
  __device__ float* Alpha() const { return Rows(); }
  __device__ float* FinalMax() const { return Rows() + kBlockM; }
  __device__ float* FinalSum() const { return Rows() + 2 * kBlockM; }
  __device__ uint32_t Barrier(int i) const { return P() + kPBytes + kRowFloats * 4 + 8 * i; }
  __device__ uint32_t QFull() const { return Barrier(0); }
  __device__ uint32_t KvFull(int stage, int cb) const {
    return Barrier(1 + stage * kColumnBlocks + cb);
  }
  __device__ uint32_t KvEmpty(int stage) const {
    return Barrier(1 + T::kStages * kColumnBlocks + stage);
  }
};

struct Work {
  WorkItem item;
  SeqExtent seq;
  int num_rows;   // packed rows of the sequence
  int num_tiles;  // key tiles of the item
};

// Warpgroup 0: all copies into shared memory.
template <typename T>
__device__ __forceinline__ void Produce(const MlaParams& p, const Work& w, const Smem<T>& s,
                                        int tid) {
  constexpr int kBlockN = T::kBlockN;
  const int chunk = tid % 8;  // this lane's 16 bytes of each 128-byte column block
  const int row0 = tid / 8;   // its rows: row0 + 16 i, all with the same swizzle phase
  const uint32_t lane_offset = row0 * 128 + ((chunk ^ (row0 & 7)) << 4);
  const int heads = p.num_heads;

#pragma unroll
  for (int i = 0; i < kQPasses; ++i) {
    const int packed = w.item.row_begin + row0 + i * kRowsPerPass;
    const bool valid = packed < w.num_rows;  // tile padding is zero-filled
    const int64_t qrow = (int64_t{w.seq.q_begin} + packed / heads) * heads + packed % heads;
    const bf16* nope = p.q_nope + qrow * kMlaCkvDim + chunk * 8;
    const bf16* pe = p.q_pe + qrow * kMlaKpeDim + chunk * 8;
#pragma unroll
    for (int cb = 0; cb < kColumnBlocks; ++cb) {
      const bf16* src = cb < kColumnBlocks - 1 ? nope + cb * 64 : pe;
      CopyAsync16(s.Q() + cb * kQBlockBytes + i * kRowsPerPass * 128 + lane_offset,
                  valid ? src : p.q_nope, valid);
    }
  }
  BarrierArriveOnCopies(s.QFull());

  const PagedRows rows = MlaRows(p.cache, p.batch, w.seq);
  auto lookup = [&](int t, int64_t(&offset)[T::kKvPasses]) {
#pragma unroll
    for (int i = 0; i < T::kKvPasses; ++i) {
      const int key = w.item.kv_begin + t * kBlockN + row0 + i * kRowsPerPass;
      offset[i] = t < w.num_tiles ? rows.Offset(min(key, w.item.kv_end - 1)) : 0;
    }
  };
  int64_t offset[T::kKvPasses];
  lookup(0, offset);
  for (int t = 0; t < w.num_tiles; ++t) {
    const int stage = t % T::kStages;
    int64_t next[T::kKvPasses];
    lookup(t + 1, next);  // the page-table reads fly while this tile is issued
    BarrierWait(s.KvEmpty(stage), ((t / T::kStages) & 1) ^ 1);
    const uint32_t dst = s.Kv(stage) + lane_offset;
#pragma unroll
    for (int cb = 0; cb < kColumnBlocks; ++cb) {
#pragma unroll
      for (int i = 0; i < T::kKvPasses; ++i) {
        CopyAsync16(dst + cb * T::kBlockBytes + i * kRowsPerPass * 128,
                    rows.base + offset[i] + chunk * 8 + cb * 64);
      }
      BarrierArriveOnCopies(s.KvFull(stage, cb));  // block cb, in the order S reads them
    }

#pragma unroll
    for (int i = 0; i < T::kKvPasses; ++i) offset[i] = next[i];
  }
  WaitAllCopies();
}

// What both consumers do with a key stage: wait for column block cb of tile t.
template <typename T>
__device__ __forceinline__ void WaitFull(const Smem<T>& s, int t, int cb) {
  BarrierWait(s.KvFull(t % T::kStages, cb), (t / T::kStages) & 1);
  FenceProxyAsync();  // the cp.async data, seen through the barrier, before wgmma reads it
}

template <typename T>
__device__ __forceinline__ void Release(const Smem<T>& s, int t, int lane) {
  if (lane == 0) BarrierArrive(s.KvEmpty(t % T::kStages));  // one arrival per consumer warp
}

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

// Warpgroup 1: scores, softmax, P for both consumers, and output columns [0, 256).
template <typename T>
__device__ __forceinline__ void ConsumeScores(const MlaParams& p, const Work& w, const Smem<T>& s,
                                              int ctid, const RowSink& sink) {
  constexpr int kBlockN = T::kBlockN;
  const int warp = ctid / 32, lane = ctid % 32;
  const int row_g = 16 * warp + lane / 4;  // this lane's rows: row_g and row_g + 8
  auto limit = [&](int r) {
    return min(VisibleKeys(w.seq, (w.item.row_begin + r) / p.num_heads, p.causal), w.item.kv_end);
  };
  const int limit_g = limit(row_g), limit_g8 = limit(row_g + 8);
  const int warp_min_limit = limit(16 * warp);  // rows further down see more keys
  const float scale_log2 = p.sm_scale * kLog2e;

  float o[kDTiles][4] = {};
  float acc[T::kNTiles][4];
  float acc_odd[T::kSplitS ? T::kNTiles : 1][4];  // kSplitS: the odd k-steps' share of S
  uint32_t pf[T::kPSteps][4];
  float alpha[2];
  OnlineSoftmax<T::kNTiles> softmax;

  // S = Q K^T: k-step ks reads column block ks / 4 of Q and of the key tile, each waited for
  // just before its k-steps are issued. The k-steps' descriptors are the tile's first plus the
  // step's offset (>> 4, the start address field's unit). Q's are the same every tile: hoisted
  // out of the loop, all 36 of them would stay live (and spill), so the base is laundered
  // through an opaque move each tile.
  const uint64_t q_desc0 = KMajorDescriptor(s.Q());
  auto issue_qk = [&](int t) {
    const uint64_t q_desc = Opaque(q_desc0);
    const uint64_t k_desc = KMajorDescriptor(s.Kv(t % T::kStages));
#pragma unroll
    for (int ks = 0; ks < kKSteps; ++ks) {
      if (ks % 4 == 0) WaitFull(s, t, ks / 4);
      const uint32_t in_block = (ks % 4) * 32;
      const uint64_t a = q_desc + (((ks / 4) * kQBlockBytes + in_block) >> 4);
      const uint64_t b = k_desc + (((ks / 4) * T::kBlockBytes + in_block) >> 4);
      if constexpr (T::kSplitS) {
        if (ks % 2 == 0) {
          Wgmma<kBlockN>::SS(acc, a, b, ks > 0 ? 1u : 0u);
        } else {
          Wgmma<kBlockN>::SS(acc_odd, a, b, ks > 1 ? 1u : 0u);
        }
      } else {
        Wgmma<kBlockN>::SS(acc, a, b, ks > 0 ? 1u : 0u);
      }
    }
  };
  // Once S's GEMM is done: its accumulators are the compiler's again, and (kSplitS) one.
  auto finish_qk = [&] {
    PinRegisters(acc);
    if constexpr (T::kSplitS) {
      PinRegisters(acc_odd);
#pragma unroll
      for (int j = 0; j < T::kNTiles; ++j) {
#pragma unroll
        for (int c = 0; c < 4; ++c) acc[j][c] += acc_odd[j][c];
      }
    }
  };
  auto softmax_tile = [&](int t) {
    const int n0 = w.item.kv_begin + t * kBlockN;
    if (n0 + kBlockN > warp_min_limit) MaskScores(acc, n0, lane, limit_g, limit_g8);
    softmax.Update(acc, scale_log2, alpha);
  };
  // P (bf16, swizzled K-major like Q) and the rows' factors for warpgroup 2.
  auto publish_p = [&] {
    unsigned char* tile = s.PPtr();
#pragma unroll
    for (int x = 0; x < 2; ++x) {
      const int r = row_g + 8 * x;
#pragma unroll
      for (int ks = 0; ks < T::kPSteps; ++ks) {
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          const int c = 2 * ks + h;  // 8-key chunk
          *reinterpret_cast<uint32_t*>(tile + r * 128 + ((c ^ (r & 7)) << 4) + (lane & 3) * 4) =
              pf[ks][2 * h + x];
        }
      }
      if ((lane & 3) == 0) s.Alpha()[r] = alpha[x];
    }
    FenceProxyAsync();  // P's ordinary stores before warpgroup 2's wgmma reads them
  };

  if (w.num_tiles > 0) {
    BarrierWait(s.QFull(), 0);
    WgmmaFence();
    issue_qk(0);
    WgmmaCommit();
    WgmmaWait<0>();
    finish_qk();
    softmax_tile(0);  // O is still 0: its factor changes nothing
    ScoresToA(acc, pf);
    // One key tile: P V of tile t, then (kMore) S of tile t + 1, whose softmax runs once P V is
    // done. P V goes first so that tile t's stage is released (and refilled) before S of tile
    // t + 1 runs: issued the other way round, both stages would be in use until tile t + 1's S
    // had to wait for tile t + 2's copies. The last tile is peeled off so that no GEMM is issued
    // conditionally: ptxas serializes every wgmma of a kernel whose in-flight groups it cannot
    // count.
    auto step = [&](int t, auto more) {
      constexpr bool kMore = decltype(more)::value;
      RescaleAccumulator(o, alpha);
      NamedBarrierSync(kPEmptyBarrier, 256);
      publish_p();
      NamedBarrierArrive(kPFullBarrier, 256);
      WgmmaFence();
#pragma unroll
      for (int ks = 0; ks < T::kPSteps; ++ks) {
        Wgmma<kHalfCols>::RSTransB(o, pf[ks], ValueDescriptor(s, t % T::kStages, 0, ks));
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
      Release(s, t, lane);
      if constexpr (kMore) {
        WgmmaWait<0>();
        finish_qk();
        softmax_tile(t + 1);
        ScoresToA(acc, pf);
      }
    };
    for (int t = 0; t + 1 < w.num_tiles; ++t) step(t, std::true_type());
    step(w.num_tiles - 1, std::false_type());
  }

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
      for (int cb = kHalfCols / 64; cb < kMlaCkvDim / 64; ++cb) WaitFull(s, t, cb);
      NamedBarrierSync(kPFullBarrier, 256);
      const float alpha[2] = {s.Alpha()[row_g], s.Alpha()[row_g + 8]};
      RescaleAccumulator(o, alpha);
      WgmmaFence();
#pragma unroll
      for (int ks = 0; ks < T::kPSteps; ++ks) {
        Wgmma<kHalfCols>::SSTransB(o, KMajorDescriptor(s.P() + ks * 32),
                                   ValueDescriptor(s, t % T::kStages, kHalfCols, ks));
      }
      WgmmaCommit();
      WgmmaWait<0>();
      PinRegisters(o);
      Release(s, t, lane);
      // The last tile's P is not refilled: the arrivals match the score warpgroup's waits.
      if (t + 1 < w.num_tiles) NamedBarrierArrive(kPEmptyBarrier, 256);
    }
  }

  NamedBarrierSync(kFinalBarrier, 256);
  const float m[2] = {s.FinalMax()[row_g], s.FinalMax()[row_g + 8]};
  const float sums[2] = {s.FinalSum()[row_g], s.FinalSum()[row_g + 8]};
  const RowSink cta_sink = sink.ForItem(w.item.partial_row, w.seq, p.causal, 0);
  StoreRows(cta_sink, o, m, sums, w.item.row_begin + 16 * warp, w.num_rows, kHalfCols, lane, false);
}

template <typename T>
__global__ void __launch_bounds__(kThreads, 1)
    MlaSm90Kernel(const MlaParams p, const WorkItem* __restrict__ items, RowSink sink) {
  extern __shared__ __align__(1024) unsigned char smem[];
  const uint32_t raw = SharedAddress(smem);
  const uint32_t base = (raw + 1023u) & ~1023u;
  const Smem<T> s{base, smem + (base - raw)};

  Work w;
  w.item = items[blockIdx.x];
  w.seq = GetSeqExtent(p.batch, p.cache.page_size, w.item.seq);
  w.num_rows = w.seq.q_len * p.num_heads;
  w.num_tiles = max(0, (w.item.kv_end - w.item.kv_begin + T::kBlockN - 1) / T::kBlockN);

  const int tid = threadIdx.x;
  if (tid == 0) {
    BarrierInit(s.QFull(), 128);  // copies of the 128 producer lanes
    for (int i = 0; i < T::kStages; ++i) {
      for (int cb = 0; cb < kColumnBlocks; ++cb) BarrierInit(s.KvFull(i, cb), 128);
      BarrierInit(s.KvEmpty(i), 8);  // one arrival per consumer warp
    }
  }
  __syncthreads();

  if (tid < 128) {
    ReleaseRegisters<kProducerRegisters>();
    Produce<T>(p, w, s, tid);
  } else if (tid < 256) {
    ClaimRegisters<kScoreRegisters>();
    ConsumeScores<T>(p, w, s, tid - 128, sink);
  } else {
    ClaimRegisters<kSecondRegisters>();
    ConsumeSecond<T>(p, w, s, tid - 256, sink);
  }
}

template <typename T>
struct Config {
  static constexpr auto kKernel = MlaSm90Kernel<T>;

  static cudaError_t Launch(const MlaParams& p, const DevicePlan& plan, cudaStream_t stream) {
    ATTN_CUDA_RETURN_IF_ERROR(AllowSharedMemory(kKernel, T::kSmemBytes));
    const RowSink sink = RowSink::ForMla(p, plan);
    kKernel<<<plan.num_items, kThreads, T::kSmemBytes, stream>>>(p, plan.items, sink);
    ATTN_CUDA_RETURN_IF_LAUNCH_FAILED();
    return cudaSuccess;
  }

  static cudaError_t Tiling(bool decode, KernelTiling* tiling) {
    // The register split assumes the compiler gave the kernel the whole launch bound.
    cudaFuncAttributes attributes;
    ATTN_CUDA_RETURN_IF_ERROR(cudaFuncGetAttributes(&attributes, kKernel));
    if (attributes.numRegs * kThreads < kPoolRegisters) return cudaErrorNotSupported;
    // As the portable kernel: a chunk's 64 x 512 float partials cost little next to 1024 keys.
    tiling->min_chunk_len = 1024;
    // One CTA per SM, each streaming a whole sequence: a decode of 128 heads x 128 sequences is
    // 256 CTAs, two full waves, which splitting would only cut into more waves plus a merge.
    if (decode) tiling->waves_before_split = 1.0;
    return DescribeKernel(kKernel, kThreads, T::kSmemBytes, kBlockM, T::kBlockN, tiling);
  }
};

template <typename Fn>
cudaError_t WithConfig(int variant, Fn&& fn) {
  switch (variant) {
    case kMlaSm90:
      return fn(Config<Traits<64, 2, false>>());
    case kMlaSm90SplitS:
      return fn(Config<Traits<64, 2, true>>());
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

cudaError_t MlaSm90Tiling(int variant, bool decode, KernelTiling* tiling) {
  return sm90::WithConfig(variant, [&](auto config) { return config.Tiling(decode, tiling); });
}

}  // namespace attn::cuda
