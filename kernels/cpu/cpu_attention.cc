#include "kernels/cpu/cpu_attention.h"

#include <algorithm>
#include <atomic>
#include <cfloat>
#include <cmath>
#include <cstring>
#include <limits>
#include <vector>

#include "kernels/cpu/float_env.h"
#include "kernels/cpu/work_plan.h"

// How a launch runs:
// 1. MakePlan cuts the batch into work items (work_plan.h): a sequence, one or more KV heads, a
//    block of query rows and a range of keys. Long KV ranges are split into chunks when there are
//    too few items for the threads; their partial softmax states are merged at the end.
// 2. ProcessItem converts the item's queries to float once (pre-scaled by sm_scale * log2(e), so
//    scores are base-2 logits), then walks its keys in tiles: each tile's K/V rows are converted
//    from bf16 once and used by every query vector of the item (all query heads of the KV head,
//    all rows of the block). Per tile: scores, online-softmax update, P x V, each a small
//    register-blocked matrix product over contiguous float rows.
// 3. The item writes bf16 output and lse, or its chunk's partial state; MergeRow combines chunks.
// Everything is float32; nothing is allocated per element (per-thread scratch grows to the
// largest item seen and is reused).

// The hot per-item functions are compiled for three x86-64 levels and the best one is picked once
// at load time (GNU ifunc), so the binary runs on any x86-64 machine and still gets AVX2+FMA or
// AVX-512 where present. Everything they call is force-inlined so it is compiled for the same
// level. ThreadSanitizer instruments the ifunc resolvers, which run before it is initialized and
// crash the process at load, so TSan builds (and ATTN_CPU_NO_MULTIVERSION ones) compile one
// version, for the target the compiler was given.
#if defined(__SANITIZE_THREAD__)
#define ATTN_CPU_TSAN 1
#elif defined(__has_feature)
#if __has_feature(thread_sanitizer)
#define ATTN_CPU_TSAN 1
#endif
#endif
#if defined(__x86_64__) && defined(__GNUC__) && defined(__linux__) && \
    !defined(ATTN_CPU_NO_MULTIVERSION) && !defined(ATTN_CPU_TSAN)
#define ATTN_CPU_MULTIVERSIONED 1
#define ATTN_CPU_MULTIVERSION \
  __attribute__((target_clones("default", "arch=x86-64-v3", "arch=x86-64-v4")))
#else
#define ATTN_CPU_MULTIVERSION
#endif
#define ATTN_CPU_INLINE [[gnu::always_inline]] inline

namespace attn::cpu {
namespace {

// Inner loops work on GNU vectors (GCC and Clang) of W floats, W = 16, 8 or 4: one AVX-512, AVX2
// or SSE register. Each width is used only by the clone whose ISA holds it natively (wider generic
// vectors would be split through memory); the choice is made once per process (SimdWidth). Row
// buffers are padded with zeros to a multiple of kMaxLanes so no width needs loop tails.
constexpr int kMaxLanes = 16;

template <int W>
struct Vec;
template <>
struct Vec<16> {
  typedef float F __attribute__((vector_size(64)));
  typedef int32_t I __attribute__((vector_size(64)));
  typedef uint16_t H __attribute__((vector_size(32)));
  typedef uint32_t U __attribute__((vector_size(64)));
};
template <>
struct Vec<8> {
  typedef float F __attribute__((vector_size(32)));
  typedef int32_t I __attribute__((vector_size(32)));
  typedef uint16_t H __attribute__((vector_size(16)));
  typedef uint32_t U __attribute__((vector_size(32)));
};
template <>
struct Vec<4> {
  typedef float F __attribute__((vector_size(16)));
  typedef int32_t I __attribute__((vector_size(16)));
  typedef uint16_t H __attribute__((vector_size(8)));
  typedef uint32_t U __attribute__((vector_size(16)));
};
template <int W>
using VecF = typename Vec<W>::F;

// Register blocking of the two matrix products: QB query vectors x KB keys of score accumulators,
// QB query vectors x DV output vectors of P x V accumulators. Sized to the register file: 32
// AVX-512 registers take 4 x 4 blocks, 16 AVX2 or SSE registers 2 x 4 (scores: QB * KB == W, so
// one transposing reduction yields W scores).
template <int W>
struct Blocking;
template <>
struct Blocking<16> {
  static constexpr int kQ = 4, kK = 4, kV = 4;
};
template <>
struct Blocking<8> {
  static constexpr int kQ = 2, kK = 4, kV = 4;
};
template <>
struct Blocking<4> {
  static constexpr int kQ = 2, kK = 2, kV = 4;
};

constexpr float kLog2e = 1.44269504088896340736f;
constexpr float kLn2 = 0.69314718055994530942f;
// Running max before any key is seen. Finite on purpose: differences with it never give inf - inf.
constexpr float kNoMax = -FLT_MAX;
// Bytes of K/V requested ahead of the key being converted (at least one key, at most
// kPrefetchMaxKeys): a few KiB keep enough misses in flight without flooding the fill buffers.
constexpr int kPrefetchBytes = 4096;
constexpr int kPrefetchMaxKeys = 16;
// Rows appended per work item (the append is a memcpy per row; items only amortize scheduling).
constexpr int kAppendRowsPerItem = 64;

int RoundUp(int x, int m) { return (x + m - 1) / m * m; }

std::atomic<int> g_simd_width{static_cast<int>(SimdWidth::kAuto)};

// Lanes of the kernels this process runs: with multiversioning, the same CPU test the ifunc
// resolver applies to pick the clone, so the width is always native to the clone that runs it;
// without, the widest the compilation target has.
int LanesInUse() {
  switch (static_cast<SimdWidth>(g_simd_width.load(std::memory_order_relaxed))) {
    case SimdWidth::k4:
      return 4;
    case SimdWidth::k8:
      return 8;
    case SimdWidth::k16:
      return 16;
    case SimdWidth::kAuto:
      break;
  }
#if defined(ATTN_CPU_MULTIVERSIONED)
  static const int lanes = __builtin_cpu_supports("x86-64-v4")   ? 16
                           : __builtin_cpu_supports("x86-64-v3") ? 8
                                                                 : 4;
  return lanes;
#elif defined(__AVX512F__)
  return 16;
#elif defined(__AVX2__)
  return 8;
#else
  return 4;
#endif
}

// ----------------------------------------------------------------------------------------------
// Vector helpers (force-inlined into the multiversioned functions).

template <int W>
ATTN_CPU_INLINE VecF<W> Load(const float* p) {
  VecF<W> v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}

template <int W>
ATTN_CPU_INLINE void Store(float* p, VecF<W> v) {
  std::memcpy(p, &v, sizeof(v));
}

template <int W>
ATTN_CPU_INLINE VecF<W> Splat(float x) {
  return VecF<W>{} + x;
}

// W bf16 values to float: bf16 is the high half of a float's bits.
template <int W>
ATTN_CPU_INLINE VecF<W> LoadBf16(const bf16* p) {
  typename Vec<W>::H h;
  std::memcpy(&h, p, sizeof(h));
  const typename Vec<W>::U w = __builtin_convertvector(h, typename Vec<W>::U) << 16;
  VecF<W> f;
  std::memcpy(&f, &w, sizeof(f));
  return f;
}

template <int W>
ATTN_CPU_INLINE float ReduceAdd(VecF<W> v) {
  float s = 0.f;
  for (int l = 0; l < W; ++l) s += v[l];
  return s;
}

template <int W>
ATTN_CPU_INLINE float ReduceMax(VecF<W> v) {
  float m = v[0];
  for (int l = 1; l < W; ++l) m = v[l] > m ? v[l] : m;
  return m;
}

// Lane j of the result is the sum of the lanes of a[j]: log2(W) levels of "interleave the halves
// of two vectors and add", W - 1 shuffle pairs in all, instead of W separate reductions.
template <int W>
ATTN_CPU_INLINE VecF<W> TransposeReduce(const VecF<W> (&a)[W]) {
  if constexpr (W == 16) {
    VecF<16> l1[8], l2[4], l3[2];
    for (int i = 0; i < 8; ++i) {
      l1[i] = __builtin_shufflevector(a[2 * i], a[2 * i + 1], 0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18,
                                      19, 20, 21, 22, 23) +
              __builtin_shufflevector(a[2 * i], a[2 * i + 1], 8, 9, 10, 11, 12, 13, 14, 15, 24, 25,
                                      26, 27, 28, 29, 30, 31);
    }
    for (int i = 0; i < 4; ++i) {
      l2[i] = __builtin_shufflevector(l1[2 * i], l1[2 * i + 1], 0, 1, 2, 3, 8, 9, 10, 11, 16, 17,
                                      18, 19, 24, 25, 26, 27) +
              __builtin_shufflevector(l1[2 * i], l1[2 * i + 1], 4, 5, 6, 7, 12, 13, 14, 15, 20, 21,
                                      22, 23, 28, 29, 30, 31);
    }
    for (int i = 0; i < 2; ++i) {
      l3[i] = __builtin_shufflevector(l2[2 * i], l2[2 * i + 1], 0, 1, 4, 5, 8, 9, 12, 13, 16, 17,
                                      20, 21, 24, 25, 28, 29) +
              __builtin_shufflevector(l2[2 * i], l2[2 * i + 1], 2, 3, 6, 7, 10, 11, 14, 15, 18, 19,
                                      22, 23, 26, 27, 30, 31);
    }
    return __builtin_shufflevector(l3[0], l3[1], 0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26,
                                   28, 30) +
           __builtin_shufflevector(l3[0], l3[1], 1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27,
                                   29, 31);
  } else if constexpr (W == 8) {
    VecF<8> l1[4], l2[2];
    for (int i = 0; i < 4; ++i) {
      l1[i] = __builtin_shufflevector(a[2 * i], a[2 * i + 1], 0, 1, 2, 3, 8, 9, 10, 11) +
              __builtin_shufflevector(a[2 * i], a[2 * i + 1], 4, 5, 6, 7, 12, 13, 14, 15);
    }
    for (int i = 0; i < 2; ++i) {
      l2[i] = __builtin_shufflevector(l1[2 * i], l1[2 * i + 1], 0, 1, 4, 5, 8, 9, 12, 13) +
              __builtin_shufflevector(l1[2 * i], l1[2 * i + 1], 2, 3, 6, 7, 10, 11, 14, 15);
    }
    return __builtin_shufflevector(l2[0], l2[1], 0, 2, 4, 6, 8, 10, 12, 14) +
           __builtin_shufflevector(l2[0], l2[1], 1, 3, 5, 7, 9, 11, 13, 15);
  } else {
    static_assert(W == 4);
    const VecF<4> l1a = __builtin_shufflevector(a[0], a[1], 0, 1, 4, 5) +
                        __builtin_shufflevector(a[0], a[1], 2, 3, 6, 7);
    const VecF<4> l1b = __builtin_shufflevector(a[2], a[3], 0, 1, 4, 5) +
                        __builtin_shufflevector(a[2], a[3], 2, 3, 6, 7);
    return __builtin_shufflevector(l1a, l1b, 0, 2, 4, 6) +
           __builtin_shufflevector(l1a, l1b, 1, 3, 5, 7);
  }
}

// dst[0, n) = scale * src[0, n), dst[n, padded) = 0; padded is a multiple of kMaxLanes.
template <int W>
ATTN_CPU_INLINE void ConvertRow(const bf16* __restrict__ src, int n, int padded, float scale,
                                float* __restrict__ dst) {
  int i = 0;
  for (; i + W <= n; i += W) Store<W>(dst + i, LoadBf16<W>(src + i) * scale);
  for (; i < n; ++i) dst[i] = scale * Bf16ToFloat(src[i]);
  for (; i < padded; ++i) dst[i] = 0.f;
}

// 2^x for x <= 0 (including -inf), lane-wise, relative error < 3e-7; results below 2^-125 flush
// to 0, which is what a probability that small contributes to a float sum anyway.
template <int W>
ATTN_CPU_INLINE VecF<W> Exp2NonPositive(VecF<W> x) {
  const typename Vec<W>::I underflow = x < -125.f;
  x = underflow ? Splat<W>(-125.f) : x;
  const VecF<W> r = (x + 12582912.f) - 12582912.f;  // round to nearest integer: 1.5 * 2^23 trick
  const VecF<W> y = (x - r) * kLn2;                 // 2^(x - r) = e^y, |y| <= ln2 / 2
  // Taylor series of e^y to degree 6: truncation error < |y|^7 / 7! < 1.3e-7.
  VecF<W> p = Splat<W>(1.f / 720.f);
  p = p * y + 1.f / 120.f;
  p = p * y + 1.f / 24.f;
  p = p * y + 1.f / 6.f;
  p = p * y + 0.5f;
  p = p * y + 1.f;
  p = p * y + 1.f;
  const typename Vec<W>::I bits = (__builtin_convertvector(r, typename Vec<W>::I) + 127) << 23;
  VecF<W> pow2;  // 2^r
  std::memcpy(&pow2, &bits, sizeof(pow2));
  return underflow ? Splat<W>(0.f) : p * pow2;
}

ATTN_CPU_INLINE float Exp2NonPositive(float x) { return Exp2NonPositive<4>(Splat<4>(x))[0]; }

// max(init, x[0, n)).
template <int W>
ATTN_CPU_INLINE float Max(const float* __restrict__ x, int n, float init) {
  VecF<W> m = Splat<W>(init);
  int i = 0;
  for (; i + W <= n; i += W) {
    const VecF<W> v = Load<W>(x + i);
    m = v > m ? v : m;
  }
  float r = ReduceMax<W>(m);
  for (; i < n; ++i) r = x[i] > r ? x[i] : r;
  return r;
}

// x[i] = 2^(x[i] - max) for i < n; returns the sum of the new values.
template <int W>
ATTN_CPU_INLINE float ExpAndSum(float* __restrict__ x, int n, float max) {
  VecF<W> sum{};
  int i = 0;
  for (; i + W <= n; i += W) {
    const VecF<W> p = Exp2NonPositive<W>(Load<W>(x + i) - max);
    Store<W>(x + i, p);
    sum += p;
  }
  float r = ReduceAdd<W>(sum);
  for (; i < n; ++i) {
    x[i] = Exp2NonPositive(x[i] - max);
    r += x[i];
  }
  return r;
}

// s[i * s_stride + t] = dot(q_i, k_t) for the QB query rows q_i = q + i * q_stride and keys
// t < n (k_t = k + t * k_stride); len is a multiple of kMaxLanes. Each pass loads KB key vectors
// and QB query vectors for QB * KB independent FMA chains.
template <int W, int QB, int KB>
ATTN_CPU_INLINE void ScoreBlock(const float* __restrict__ q, int64_t q_stride,
                                const float* __restrict__ k, int64_t k_stride, int n, int len,
                                float* __restrict__ s, int64_t s_stride) {
  int t = 0;
  for (; t + KB <= n; t += KB) {
    VecF<W> acc[QB * KB] = {};  // acc[i * KB + j]: query i, key t + j
    for (int d = 0; d < len; d += W) {
      VecF<W> kv[KB];
      for (int j = 0; j < KB; ++j) kv[j] = Load<W>(k + (t + j) * k_stride + d);
      for (int i = 0; i < QB; ++i) {
        const VecF<W> x = Load<W>(q + i * q_stride + d);
        for (int j = 0; j < KB; ++j) acc[i * KB + j] += x * kv[j];
      }
    }
    if constexpr (QB * KB == W) {
      const VecF<W> sums = TransposeReduce<W>(acc);
      for (int i = 0; i < QB; ++i) {
        for (int j = 0; j < KB; ++j) s[i * s_stride + t + j] = sums[i * KB + j];
      }
    } else {
      for (int i = 0; i < QB; ++i) {
        for (int j = 0; j < KB; ++j) s[i * s_stride + t + j] = ReduceAdd<W>(acc[i * KB + j]);
      }
    }
  }
  for (; t < n; ++t) {
    VecF<W> acc[QB] = {};
    for (int d = 0; d < len; d += W) {
      const VecF<W> kv = Load<W>(k + t * k_stride + d);
      for (int i = 0; i < QB; ++i) acc[i] += Load<W>(q + i * q_stride + d) * kv;
    }
    for (int i = 0; i < QB; ++i) s[i * s_stride + t] = ReduceAdd<W>(acc[i]);
  }
}

// o_i[0, len) += sum_t p_i[t] * v_t for the QB rows p_i = p + i * p_stride, o_i = o + i * o_stride
// and keys t < n (v_t = v + t * v_stride); len is a multiple of W. QB x DV accumulators stay in
// registers while the keys stream past; each V load feeds QB FMAs.
template <int W, int QB, int DV>
ATTN_CPU_INLINE void PvBlock(const float* __restrict__ p, int64_t p_stride,
                             const float* __restrict__ v, int64_t v_stride, int n, int len,
                             float* __restrict__ o, int64_t o_stride) {
  int d = 0;
  for (; d + DV * W <= len; d += DV * W) {
    VecF<W> acc[QB][DV];
    for (int i = 0; i < QB; ++i) {
      for (int j = 0; j < DV; ++j) acc[i][j] = Load<W>(o + i * o_stride + d + j * W);
    }
    for (int t = 0; t < n; ++t) {
      VecF<W> vv[DV];
      for (int j = 0; j < DV; ++j) vv[j] = Load<W>(v + t * v_stride + d + j * W);
      for (int i = 0; i < QB; ++i) {
        const VecF<W> pi = Splat<W>(p[i * p_stride + t]);
        for (int j = 0; j < DV; ++j) acc[i][j] += pi * vv[j];
      }
    }
    for (int i = 0; i < QB; ++i) {
      for (int j = 0; j < DV; ++j) Store<W>(o + i * o_stride + d + j * W, acc[i][j]);
    }
  }
  if constexpr (DV > 1) {
    if (d < len) PvBlock<W, QB, 1>(p, p_stride, v + d, v_stride, n, len - d, o + d, o_stride);
  }
}

// ----------------------------------------------------------------------------------------------
// One launch, described uniformly for GQA and MLA.

struct Launch {
  const PagedBatch* batch;
  const bf16* cache;
  int64_t layer_stride, page_stride, token_stride;
  int page_size;
  // The K row of a token for KV head h starts at token + k_offset + h * head_stride; V likewise.
  // MLA has no separate V: it is the first v_dim elements of the K row (v_in_k).
  int64_t k_offset, v_offset, head_stride;
  bool v_in_k;
  int qk_dim, v_dim;
  int qk_pad, v_pad;  // rounded up to kMaxLanes
  int group;          // query heads per KV head: query vectors per row in one item
  int num_heads;      // query heads per row
  int num_kv_heads;
  int heads_per_item;  // KV heads one work item covers (more than 1 only for decode)
  int tile;            // keys per tile
  // Query vector (row, head) = q0[(row * num_heads + head) * q0_len ..][0, q0_len) followed by the
  // same from q1 (MLA: q_nope then q_pe; GQA: q1_len = 0).
  const bf16* q0;
  int q0_len;
  const bf16* q1;
  int q1_len;
  bf16* out;         // [total_q, num_heads, v_dim]
  float* lse;        // [total_q, num_heads] or nullptr
  float scale_log2;  // sm_scale * log2(e): scores come out in the base-2 domain
  bool causal;
};

// One work item of the CPU plan, run by one thread of the pool (not the CUDA planner's WorkItem,
// kernels/cuda/plan.h, which is one CTA's share). Query vectors of an item are ordered (KV head,
// row, head within the group): m = ((kv_head - kv_head_begin) * rows + (row - row_begin)) * group
// + g.
struct CpuTask {
  int seq;
  int kv_head_begin, kv_head_end;
  int row_begin, row_end;  // query rows within the sequence
  int key_begin, key_end;  // key chunk; a whole-sequence item has [0, kv_len)
  int chunk;               // index of the chunk, -1 when the sequence is not split
  int64_t cost;            // estimated multiply-adds, for ordering only
};

// Split-KV partial results: per (chunk, row, head) of a split sequence, the unnormalized output
// accumulator plus running max and sum. Sequence b's states start at base[b] and are indexed
// (chunk * q_len + row) * num_heads + head.
struct Partials {
  std::vector<int64_t> base;  // per sequence; -1 when not split
  int chunk_len = 0;
  std::vector<float> o;   // [num_states, v_dim]
  std::vector<float> ml;  // [num_states, 2]: max (base 2), sum
};

struct Plan {
  std::vector<SeqExtent> seqs;
  std::vector<CpuTask> items;
  Partials partials;
  std::vector<int> split_seqs;  // sequences whose rows need a merge
};

// Per-thread buffers, grown on demand and reused across calls and launches.
struct Scratch {
  std::vector<float> q;           // [M, qk_pad] scaled query vectors
  std::vector<float> k;           // [heads_per_item, tile, qk_pad]
  std::vector<float> v;           // [heads_per_item, tile, v_pad] (unused when v_in_k)
  std::vector<float> s;           // [M, tile] scores, then probabilities
  std::vector<float> o;           // [M, v_pad] output accumulators
  std::vector<float> max;         // [M]
  std::vector<float> sum;         // [M]
  std::vector<int> visible_end;   // [M] end of the keys each query vector sees in this item
  std::vector<int> tile_visible;  // [M] keys of the current tile each query vector sees

  template <typename T>
  static T* Grow(std::vector<T>& v, size_t n) {
    if (v.size() < n) v.resize(n);
    return v.data();
  }
};

Scratch& ThreadScratch() {
  thread_local Scratch scratch;
  return scratch;
}

// ----------------------------------------------------------------------------------------------
// Planning.

Plan MakePlan(const Launch& L, ThreadPool& pool) {
  const PagedBatch& b = *L.batch;
  Plan plan;
  plan.seqs.resize(b.batch_size);
  const int rows_per_item = ChooseRowsPerItem(L.group);
  int64_t total_keys = 0;  // summed over items
  int64_t max_keys = 0;
  for (int seq = 0; seq < b.batch_size; ++seq) {
    const SeqExtent e = GetSeqExtent(b, L.page_size, seq);
    plan.seqs[seq] = e;
    for (int r0 = 0; r0 < e.q_len; r0 += rows_per_item) {
      const int r1 = std::min(r0 + rows_per_item, e.q_len);
      // The last row of a block sees the most keys.
      const int keys = VisibleKeys(e, r1 - 1, L.causal);
      for (int h0 = 0; h0 < L.num_kv_heads; h0 += L.heads_per_item) {
        const int h1 = std::min(h0 + L.heads_per_item, L.num_kv_heads);
        const int64_t cost = int64_t{r1 - r0} * (h1 - h0) * (keys + 1);
        plan.items.push_back({seq, h0, h1, r0, r1, 0, keys, -1, cost});
        total_keys += keys;
      }
      max_keys = std::max<int64_t>(max_keys, keys);
    }
  }

  const int chunk_len = ChooseKvChunkLen(
      pool.MaxParallelism(), static_cast<int64_t>(plan.items.size()), total_keys, max_keys);
  if (chunk_len > 0) {
    Partials& part = plan.partials;
    part.chunk_len = chunk_len;
    part.base.assign(b.batch_size, -1);
    int64_t num_states = 0;
    for (int seq = 0; seq < b.batch_size; ++seq) {
      const SeqExtent& e = plan.seqs[seq];
      if (e.kv_len <= chunk_len) continue;
      part.base[seq] = num_states;
      const int num_chunks = (e.kv_len + chunk_len - 1) / chunk_len;
      num_states += int64_t{num_chunks} * e.q_len * L.num_heads;
      plan.split_seqs.push_back(seq);
    }
    part.o.resize(num_states * L.v_dim);
    part.ml.resize(num_states * 2);

    // Replace each item of a split sequence by one item per chunk it reaches into. A row's merge
    // later reads exactly the chunks that start below its visible end, all of which exist here.
    std::vector<CpuTask> split;
    split.reserve(plan.items.size() * 2);
    for (const CpuTask& it : plan.items) {
      if (part.base[it.seq] < 0) {
        split.push_back(it);
        continue;
      }
      for (int c = 0; c * chunk_len < it.key_end; ++c) {
        CpuTask piece = it;
        piece.chunk = c;
        piece.key_begin = c * chunk_len;
        piece.key_end = std::min(it.key_end, (c + 1) * chunk_len);
        piece.cost = int64_t{it.row_end - it.row_begin} * (it.kv_head_end - it.kv_head_begin) *
                     (piece.key_end - piece.key_begin + 1);
        split.push_back(piece);
      }
    }
    plan.items = std::move(split);
  }
  // Largest items first, so that the dynamic schedule ends with small ones and threads finish
  // together.
  std::stable_sort(plan.items.begin(), plan.items.end(),
                   [](const CpuTask& a, const CpuTask& b) { return a.cost > b.cost; });
  return plan;
}

// ----------------------------------------------------------------------------------------------
// Work item: all query vectors of (rows, KV heads) against one key range, streamed in tiles with
// an online softmax (running max and sum per query vector, accumulators rescaled when the max
// grows).

// Row (within the sequence) and query head of query vector m of an item.
struct VecPos {
  int row;
  int head;
};

ATTN_CPU_INLINE VecPos PositionOf(const Launch& L, const CpuTask& it, int m) {
  const int rows = it.row_end - it.row_begin;
  const int rest = m / L.group;
  return {it.row_begin + rest % rows, (it.kv_head_begin + rest / rows) * L.group + m % L.group};
}

template <int W>
ATTN_CPU_INLINE void LoadQueries(const Launch& L, const SeqExtent& e, const CpuTask& it,
                                 int num_vecs, float* __restrict__ q) {
  for (int m = 0; m < num_vecs; ++m) {
    const VecPos pos = PositionOf(L, it, m);
    const int64_t vec = (int64_t{e.q_begin} + pos.row) * L.num_heads + pos.head;
    float* dst = q + int64_t{m} * L.qk_pad;
    ConvertRow<W>(L.q0 + vec * L.q0_len, L.q0_len, L.q0_len, L.scale_log2, dst);
    if (L.q1_len > 0) {
      ConvertRow<W>(L.q1 + vec * L.q1_len, L.q1_len, L.q1_len, L.scale_log2, dst + L.q0_len);
    }
    for (int d = L.qk_dim; d < L.qk_pad; ++d) dst[d] = 0.f;
  }
}

// Position of a key in the paged cache: walks a sequence's keys page by page without a division
// per key.
struct KeyCursor {
  const bf16* layer;     // the sequence's layer of the cache
  const int32_t* pages;  // the sequence's page ids
  int page, slot;

  KeyCursor(const Launch& L, const SeqExtent& e, int key)
      : layer(L.cache + e.layer * L.layer_stride),
        pages(L.batch->kv_indices + e.page_begin),
        page(key / L.page_size),
        slot(key % L.page_size) {}

  const bf16* Token(const Launch& L) const {
    return layer + pages[page] * L.page_stride + slot * L.token_stride;
  }
  void Next(const Launch& L) {
    if (++slot == L.page_size) {
      slot = 0;
      ++page;
    }
  }
};

ATTN_CPU_INLINE void PrefetchRange(const bf16* begin, const bf16* end) {
  constexpr uintptr_t kLine = 64;
  for (uintptr_t a = reinterpret_cast<uintptr_t>(begin) & ~(kLine - 1);
       a < reinterpret_cast<uintptr_t>(end); a += kLine) {
    __builtin_prefetch(reinterpret_cast<const void*>(a), /*rw=*/0, /*locality=*/3);
  }
}

// Converts keys [t0, t0 + n) of the sequence, KV heads [h0, h1), to float tiles (head h's K rows
// at k + (h - h0) * tile * qk_pad), and prefetches the keys that follow, up to prefetch_end.
// Pages are scattered, so the hardware prefetchers lose the stream at every page boundary (and,
// with one KV head per item, at every row); software prefetch keeps the loads from waiting.
template <int W>
ATTN_CPU_INLINE void LoadKeyTile(const Launch& L, const SeqExtent& e, int h0, int h1, int t0, int n,
                                 int prefetch_end, float* __restrict__ k, float* __restrict__ v) {
  const int64_t k_tile = int64_t{L.tile} * L.qk_pad;
  const int64_t v_tile = int64_t{L.tile} * L.v_pad;
  const int64_t heads_begin = int64_t{h0} * L.head_stride;
  const int64_t heads_end = int64_t{h1 - 1} * L.head_stride;
  const int key_bytes = (h1 - h0) * (L.qk_dim + (L.v_in_k ? 0 : L.v_dim)) * int{sizeof(bf16)};
  const int ahead = std::clamp(kPrefetchBytes / key_bytes, 1, kPrefetchMaxKeys);
  KeyCursor cur(L, e, t0);
  KeyCursor pre(L, e, std::min(t0 + ahead, prefetch_end));
  for (int t = 0; t < n; ++t) {
    if (t0 + t + ahead < prefetch_end) {
      const bf16* token = pre.Token(L);
      PrefetchRange(token + L.k_offset + heads_begin, token + L.k_offset + heads_end + L.qk_dim);
      if (!L.v_in_k) {
        PrefetchRange(token + L.v_offset + heads_begin, token + L.v_offset + heads_end + L.v_dim);
      }
      pre.Next(L);
    }
    const bf16* token = cur.Token(L);
    for (int h = h0; h < h1; ++h) {
      const int64_t head_off = int64_t{h} * L.head_stride;
      ConvertRow<W>(token + L.k_offset + head_off, L.qk_dim, L.qk_pad, 1.f,
                    k + (h - h0) * k_tile + int64_t{t} * L.qk_pad);
      if (!L.v_in_k) {
        ConvertRow<W>(token + L.v_offset + head_off, L.v_dim, L.v_pad, 1.f,
                      v + (h - h0) * v_tile + int64_t{t} * L.v_pad);
      }
    }
    cur.Next(L);
  }
}

// Folds keys [t0, t0 + n) into the running state of every query vector, in three passes so that
// one of the K and V tiles at a time is being read from L1/L2: scores for all query vectors, the
// online-softmax update, then P x V. Query vectors go in blocks of QB sharing each K/V load.
template <int W>
ATTN_CPU_INLINE void ProcessTile(const Launch& L, Scratch& s, int m_begin, int m_end, int t0, int n,
                                 const float* k, const float* v, int64_t v_stride) {
  int* __restrict__ nvis = s.tile_visible.data();
  for (int m = m_begin; m < m_end; ++m) {
    // Causal rows of a block see different prefixes of the tile.
    nvis[m] = std::clamp(s.visible_end[m] - t0, 0, n);
  }
  // Keys a block of query vectors has to touch: the most any of them sees.
  auto block_keys = [&](int m0, int qb) {
    int nb = 0;
    for (int i = 0; i < qb; ++i) nb = std::max(nb, nvis[m0 + i]);
    return nb;
  };
  const int64_t tile = L.tile;
  constexpr int QB = Blocking<W>::kQ, KB = Blocking<W>::kK, DV = Blocking<W>::kV;

  for (int m0 = m_begin; m0 < m_end; m0 += QB) {
    const int qb = std::min(QB, m_end - m0);
    const int nb = block_keys(m0, qb);
    if (nb == 0) continue;
    const float* q = s.q.data() + int64_t{m0} * L.qk_pad;
    float* scores = s.s.data() + m0 * tile;
    if (qb == QB) {
      ScoreBlock<W, QB, KB>(q, L.qk_pad, k, L.qk_pad, nb, L.qk_pad, scores, tile);
    } else {
      for (int i = 0; i < qb; ++i) {
        ScoreBlock<W, 1, KB>(q + i * L.qk_pad, L.qk_pad, k, L.qk_pad, nvis[m0 + i], L.qk_pad,
                             scores + i * tile, tile);
      }
    }
  }

  for (int m = m_begin; m < m_end; ++m) {
    float* __restrict__ scores = s.s.data() + m * tile;
    const int nm = nvis[m];
    if (nm > 0) {
      const float old_max = s.max[m];
      const float new_max = Max<W>(scores, nm, old_max);
      const float alpha = Exp2NonPositive(old_max - new_max);
      s.sum[m] = s.sum[m] * alpha + ExpAndSum<W>(scores, nm, new_max);
      s.max[m] = new_max;
      if (alpha != 1.f) {
        float* __restrict__ o = s.o.data() + int64_t{m} * L.v_pad;
        for (int d = 0; d < L.v_pad; d += W) Store<W>(o + d, Load<W>(o + d) * alpha);
      }
    }
    // Keys this vector does not see get probability 0: its block may run P x V over them.
    std::fill(scores + nm, scores + n, 0.f);
  }

  for (int m0 = m_begin; m0 < m_end; m0 += QB) {
    const int qb = std::min(QB, m_end - m0);
    const int nb = block_keys(m0, qb);
    if (nb == 0) continue;
    const float* p = s.s.data() + m0 * tile;
    float* o = s.o.data() + int64_t{m0} * L.v_pad;
    if (qb == QB) {
      PvBlock<W, QB, DV>(p, tile, v, v_stride, nb, L.v_pad, o, L.v_pad);
    } else {
      for (int i = 0; i < qb; ++i) {
        PvBlock<W, 1, DV>(p + i * tile, tile, v, v_stride, nvis[m0 + i], L.v_pad, o + i * L.v_pad,
                          L.v_pad);
      }
    }
  }
}

// Normalizes one query vector's state into out / lse, by the contract's rule (kernels/attention.h):
// a vector that saw no key (sees_keys is the geometry's answer, VisibleKeys > 0, never the
// state's) gets 0 / kEmptyRowLse; one that saw keys gets acc / sum when its max is finite and sum
// positive and finite, and NaN otherwise: its float32 logits overflowed (a +inf logit makes the
// max +inf and the sum NaN, a NaN logit the sum NaN; every logit -inf leaves the sum 0).
ATTN_CPU_INLINE void WriteOutput(const Launch& L, int64_t vec, const float* o, float max, float sum,
                                 bool sees_keys) {
  bf16* out = L.out + vec * L.v_dim;
  if (!sees_keys) {
    std::fill(out, out + L.v_dim, bf16{0});
    if (L.lse) L.lse[vec] = kEmptyRowLse;
  } else if (std::isfinite(max) && std::isfinite(sum) && sum > 0.f) {
    const float inv = 1.f / sum;
    for (int d = 0; d < L.v_dim; ++d) out[d] = FloatToBf16(o[d] * inv);
    if (L.lse) L.lse[vec] = max + std::log2(sum);
  } else {
    std::fill(out, out + L.v_dim, kBf16QuietNan);
    if (L.lse) L.lse[vec] = std::numeric_limits<float>::quiet_NaN();
  }
}

// Writes the item's results: final outputs, or the chunk's partial states for the merge.
ATTN_CPU_INLINE void StoreResults(const Launch& L, const SeqExtent& e, const CpuTask& it,
                                  int num_vecs, const Scratch& s, Partials& partials) {
  for (int m = 0; m < num_vecs; ++m) {
    const VecPos pos = PositionOf(L, it, m);
    const float* o = s.o.data() + int64_t{m} * L.v_pad;
    if (it.chunk >= 0) {
      const int64_t state =
          partials.base[it.seq] + (int64_t{it.chunk} * e.q_len + pos.row) * L.num_heads + pos.head;
      std::memcpy(partials.o.data() + state * L.v_dim, o, sizeof(float) * L.v_dim);
      partials.ml[2 * state] = s.max[m];
      partials.ml[2 * state + 1] = s.sum[m];
    } else {
      WriteOutput(L, (int64_t{e.q_begin} + pos.row) * L.num_heads + pos.head, o, s.max[m], s.sum[m],
                  VisibleKeys(e, pos.row, L.causal) > 0);
    }
  }
}

template <int W>
ATTN_CPU_INLINE void RunItem(const Launch& L, const SeqExtent& e, const CpuTask& it,
                             Partials& partials) {
  Scratch& s = ThreadScratch();
  const int num_kv = it.kv_head_end - it.kv_head_begin;
  const int vecs_per_head = (it.row_end - it.row_begin) * L.group;
  const int num_vecs = vecs_per_head * num_kv;
  Scratch::Grow(s.q, size_t(num_vecs) * L.qk_pad);
  Scratch::Grow(s.k, size_t(num_kv) * L.tile * L.qk_pad);
  if (!L.v_in_k) Scratch::Grow(s.v, size_t(num_kv) * L.tile * L.v_pad);
  Scratch::Grow(s.s, size_t(num_vecs) * L.tile);
  float* o = Scratch::Grow(s.o, size_t(num_vecs) * L.v_pad);
  Scratch::Grow(s.max, num_vecs);
  Scratch::Grow(s.sum, num_vecs);
  Scratch::Grow(s.visible_end, num_vecs);
  Scratch::Grow(s.tile_visible, num_vecs);

  int key_end = it.key_begin;
  for (int m = 0; m < num_vecs; ++m) {
    const int row = PositionOf(L, it, m).row;
    s.visible_end[m] = std::min(VisibleKeys(e, row, L.causal), it.key_end);
    key_end = std::max(key_end, s.visible_end[m]);
    s.max[m] = kNoMax;
    s.sum[m] = 0.f;
  }
  std::fill(o, o + int64_t{num_vecs} * L.v_pad, 0.f);
  if (key_end > it.key_begin) LoadQueries<W>(L, e, it, num_vecs, s.q.data());

  const int64_t k_tile = int64_t{L.tile} * L.qk_pad;
  const int64_t v_tile = L.v_in_k ? k_tile : int64_t{L.tile} * L.v_pad;
  const int64_t v_stride = L.v_in_k ? L.qk_pad : L.v_pad;
  for (int t0 = it.key_begin; t0 < key_end; t0 += L.tile) {
    const int n = std::min(L.tile, key_end - t0);
    LoadKeyTile<W>(L, e, it.kv_head_begin, it.kv_head_end, t0, n, key_end, s.k.data(), s.v.data());
    for (int h = 0; h < num_kv; ++h) {
      const float* k = s.k.data() + h * k_tile;
      const float* v = (L.v_in_k ? s.k.data() : s.v.data()) + h * v_tile;
      const int m0 = h * vecs_per_head;
      const int m1 = m0 + vecs_per_head;
      ProcessTile<W>(L, s, m0, m1, t0, n, k, v, v_stride);
    }
  }
  StoreResults(L, e, it, num_vecs, s, partials);
}

// One work item, with the vector width of this process (see LanesInUse).
ATTN_CPU_MULTIVERSION void ProcessItem(const Launch& L, const SeqExtent& e, const CpuTask& it,
                                       Partials& partials) {
  switch (LanesInUse()) {
    case 16:
      RunItem<16>(L, e, it, partials);
      break;
    case 8:
      RunItem<8>(L, e, it, partials);
      break;
    default:
      RunItem<4>(L, e, it, partials);
      break;
  }
}

// Combines the chunk states of one query row of a split sequence (all heads) into the output:
// max* = max_c max_c, sum* = sum_c sum_c 2^(max_c - max*), out = sum_c o_c 2^(max_c - max*) / sum*.
// A chunk whose logits overflowed carries a +inf max or a NaN sum into max* or sum* (w * NaN is
// NaN even where w is 0), so WriteOutput turns the row into NaN; a chunk whose visible logits were
// all -inf has sum 0 and adds nothing, which is right while another chunk has a finite one.
ATTN_CPU_MULTIVERSION void MergeRow(const Launch& L, const Plan& plan, int seq, int row) {
  const SeqExtent& e = plan.seqs[seq];
  const Partials& part = plan.partials;
  // Only chunks that start below the row's visible end were computed for it.
  const int visible = VisibleKeys(e, row, L.causal);
  const int num_chunks = (visible + part.chunk_len - 1) / part.chunk_len;
  Scratch& s = ThreadScratch();
  float* __restrict__ acc = Scratch::Grow(s.o, L.v_dim);
  for (int head = 0; head < L.num_heads; ++head) {
    auto state = [&](int c) {
      return part.base[seq] + (int64_t{c} * e.q_len + row) * L.num_heads + head;
    };
    float max = kNoMax;
    for (int c = 0; c < num_chunks; ++c) max = std::max(max, part.ml[2 * state(c)]);
    float sum = 0.f;
    std::fill(acc, acc + L.v_dim, 0.f);
    for (int c = 0; c < num_chunks; ++c) {
      const float w = Exp2NonPositive(part.ml[2 * state(c)] - max);
      sum += w * part.ml[2 * state(c) + 1];
      const float* __restrict__ o = part.o.data() + state(c) * L.v_dim;
      for (int d = 0; d < L.v_dim; ++d) acc[d] += w * o[d];
    }
    WriteOutput(L, (int64_t{e.q_begin} + row) * L.num_heads + head, acc, max, sum, visible > 0);
  }
}

void RunAttention(const Launch& L, ThreadPool& pool) {
  Plan plan = MakePlan(L, pool);
  // Per item (a few microseconds at least), so the mode never outlives the kernels' own code.
  pool.ParallelFor(static_cast<int64_t>(plan.items.size()), [&](int64_t i) {
    const ScopedFlushSubnormals flush;
    const CpuTask& it = plan.items[i];
    ProcessItem(L, plan.seqs[it.seq], it, plan.partials);
  });
  if (plan.split_seqs.empty()) return;
  // One merge unit per (split sequence, row).
  std::vector<int64_t> first_unit(plan.split_seqs.size() + 1, 0);
  for (size_t i = 0; i < plan.split_seqs.size(); ++i) {
    first_unit[i + 1] = first_unit[i] + plan.seqs[plan.split_seqs[i]].q_len;
  }
  pool.ParallelFor(first_unit.back(), [&](int64_t unit) {
    const size_t i =
        std::upper_bound(first_unit.begin(), first_unit.end(), unit) - first_unit.begin() - 1;
    const ScopedFlushSubnormals flush;
    MergeRow(L, plan, plan.split_seqs[i], static_cast<int>(unit - first_unit[i]));
  });
}

// ----------------------------------------------------------------------------------------------
// Append.

// Calls copy(row, layer, page, slot) for every query row that has a cache position (rows of a
// sequence whose kv_len < q_len would land before position 0 and are skipped).
template <typename CopyFn>
void ForEachAppendRow(const PagedBatch& b, int page_size, ThreadPool& pool, const CopyFn& copy) {
  const int64_t num_items = (int64_t{b.total_q} + kAppendRowsPerItem - 1) / kAppendRowsPerItem;
  pool.ParallelFor(num_items, [&](int64_t item) {
    const int r0 = static_cast<int>(item * kAppendRowsPerItem);
    const int r1 = std::min(r0 + kAppendRowsPerItem, b.total_q);
    // The sequence of row r0: the last one whose first row is <= r0 (empty ones are skipped).
    int seq =
        b.qo_indptr
            ? static_cast<int>(std::upper_bound(b.qo_indptr, b.qo_indptr + b.batch_size + 1, r0) -
                               b.qo_indptr) -
                  1
            : r0;
    SeqExtent e = GetSeqExtent(b, page_size, seq);
    for (int row = r0; row < r1; ++row) {
      while (row >= e.q_begin + e.q_len) e = GetSeqExtent(b, page_size, ++seq);
      const int pos = AppendPosition(e, row - e.q_begin);
      if (pos < 0) continue;
      copy(row, e.layer, b.kv_indices[e.page_begin + pos / page_size], pos % page_size);
    }
  });
}

Launch MakeGqaLaunch(const GqaParams& p) {
  const GqaCache& c = p.cache;
  Launch L{};
  L.batch = &p.batch;
  L.cache = c.data;
  L.layer_stride = c.LayerStride();
  L.page_stride = c.PageStride();
  L.token_stride = c.TokenStride();
  L.page_size = c.page_size;
  L.k_offset = 0;
  L.v_offset = int64_t{c.page_size} * c.TokenStride();
  L.head_stride = c.head_dim;
  L.v_in_k = false;
  L.qk_dim = L.v_dim = c.head_dim;
  L.qk_pad = L.v_pad = RoundUp(c.head_dim, kMaxLanes);
  L.group = p.num_qo_heads / c.num_kv_heads;
  L.num_heads = p.num_qo_heads;
  L.num_kv_heads = c.num_kv_heads;
  const bool decode = p.batch.qo_indptr == nullptr;
  L.tile = decode ? kKeyTileGqaDecode : kKeyTileGqaPrefill;
  L.heads_per_item = ChooseKvHeadsPerItem(decode, c.num_kv_heads, L.tile, L.qk_pad + L.v_pad);
  L.q0 = p.q;
  L.q0_len = c.head_dim;
  L.q1 = nullptr;
  L.q1_len = 0;
  L.out = p.out;
  L.lse = p.lse;
  L.scale_log2 = p.sm_scale * kLog2e;
  L.causal = p.causal;
  return L;
}

Launch MakeMlaLaunch(const MlaParams& p) {
  const MlaCache& c = p.cache;
  Launch L{};
  L.batch = &p.batch;
  L.cache = c.data;
  L.layer_stride = c.LayerStride();
  L.page_stride = c.PageStride();
  L.token_stride = kMlaTokenDim;
  L.page_size = c.page_size;
  L.k_offset = 0;
  L.v_offset = 0;
  L.head_stride = 0;
  L.v_in_k = true;
  L.qk_dim = kMlaTokenDim;
  L.v_dim = kMlaCkvDim;
  L.qk_pad = RoundUp(kMlaTokenDim, kMaxLanes);
  L.v_pad = RoundUp(kMlaCkvDim, kMaxLanes);
  static_assert(kMlaCkvDim % kMaxLanes == 0, "V is read in place from the padded K rows");
  L.group = p.num_heads;
  L.num_heads = p.num_heads;
  L.num_kv_heads = 1;
  L.heads_per_item = 1;
  L.tile = kKeyTileMla;
  L.q0 = p.q_nope;
  L.q0_len = kMlaCkvDim;
  L.q1 = p.q_pe;
  L.q1_len = kMlaKpeDim;
  L.out = p.out;
  L.lse = p.lse;
  L.scale_log2 = p.sm_scale * kLog2e;
  L.causal = p.causal;
  return L;
}

}  // namespace

void GqaAppendKv(const GqaParams& p, ThreadPool& pool) {
  if (p.k_new == nullptr) return;
  const GqaCache& c = p.cache;
  const int64_t token = c.TokenStride();
  ForEachAppendRow(p.batch, c.page_size, pool, [&](int row, int layer, int page, int slot) {
    bf16* k = c.data + layer * c.LayerStride() + page * c.PageStride() + slot * token;
    bf16* v = k + c.page_size * token;
    std::memcpy(k, p.k_new + row * token, sizeof(bf16) * token);
    std::memcpy(v, p.v_new + row * token, sizeof(bf16) * token);
  });
}

void MlaAppendKv(const MlaParams& p, ThreadPool& pool) {
  if (p.ckv_new == nullptr) return;
  const MlaCache& c = p.cache;
  ForEachAppendRow(p.batch, c.page_size, pool, [&](int row, int layer, int page, int slot) {
    bf16* dst =
        c.data + layer * c.LayerStride() + page * c.PageStride() + int64_t{slot} * kMlaTokenDim;
    std::memcpy(dst, p.ckv_new + int64_t{row} * kMlaCkvDim, sizeof(bf16) * kMlaCkvDim);
    std::memcpy(dst + kMlaCkvDim, p.kpe_new + int64_t{row} * kMlaKpeDim, sizeof(bf16) * kMlaKpeDim);
  });
}

void SetSimdWidthForTesting(SimdWidth width) {
  g_simd_width.store(static_cast<int>(width), std::memory_order_relaxed);
}

void GqaAttention(const GqaParams& p, ThreadPool& pool) { RunAttention(MakeGqaLaunch(p), pool); }

void MlaAttention(const MlaParams& p, ThreadPool& pool) { RunAttention(MakeMlaLaunch(p), pool); }

}  // namespace attn::cpu
