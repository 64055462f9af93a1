// Online softmax (FlashAttention), the one every attention kernel uses, in log2 units: raw scores
// s = q.k become s' = s * scale_log2 (scale_log2 = sm_scale * log2(e)), probabilities are
// p = 2^(s' - m) against the running maximum m of s', and a row's base-2 lse is m + log2(sum p).
//
// The roles, from a key tile to the row's result:
//   OnlineSoftmax       the running (m, sum) of the two rows a lane holds in an mma.sync tile:
//                       Update() for a tile whose whole row is in this warp; TileMax, Rescale
//                       and Exponentiate for a row whose keys are spread over several warps
//                       (their maxima are combined between TileMax and Rescale).
//   RescaleAccumulator  applies Rescale's factor to the row's output accumulator.
//   SoftmaxExchange     the cross-warp merge: warps that hold states of the same rows (over
//                       different keys) combine them through shared memory.
//   InverseSum, FinalLse, ChunkInverseSum, PartialLse
//                       finishing a row: the output's normalizer and its lse, by the contract's
//                       rule for rows that see no key and for logits that overflowed
//                       (kernels/attention.h).
// The split-KV merge (merge_states.cu) combines chunks with the same ExpBase and FinalLse.
//
// Overflow reaches the finished state, although fmaxf drops NaN (a NaN logit never becomes m):
// - a NaN logit (an mma sum of +inf and -inf products) has p = Exp2(NaN) = NaN, and every sum it
//   enters is NaN from then on: alpha * NaN, weight * NaN (for weight 0 too) and the parts' sums;
// - a +inf logit, or a scaled maximum past float's range (sm_scale near 1e38), makes m +inf:
//   the key's p is 2^(inf - inf) = NaN, or every p is 2^(finite - inf) = 0 with the sum 0; any
//   later rescale is 2^(inf - inf) = NaN, and so is the weight SoftmaxExchange::Merge gives a
//   part whose m is +inf;
// - every visible logit -inf leaves m = -inf and the sum 0.
// The finishing helpers turn each of these into NaN for a row that sees keys (FiniteState).
#pragma once

#include <cmath>

#include "kernels/attention.h"
#include "kernels/cuda/common/math.cuh"
#include "kernels/cuda/common/mma.cuh"

namespace attn::cuda {

// The offset probabilities are taken against for a row whose running maximum is m: m itself, or 0
// while the row has seen only masked keys (m = -inf), so that 2^(-inf - 0) = 0 instead of NaN.
__device__ __forceinline__ float ExpBase(float m) { return m == -INFINITY ? 0.f : m; }

// A finished row's state (m, sum) gives a result: m finite and sum positive and finite. Otherwise
// the row's float32 logits overflowed (see above), or the row saw no key.
__device__ __forceinline__ bool FiniteState(float m, float sum) {
  return fabsf(m) < INFINITY && sum > 0.f && sum < INFINITY;
}

// The factor that normalizes a final row's output accumulator: 0 for a row that sees no key
// (`sees_keys`: the geometry's answer, RowSink::SeesKeys; the accumulator is 0 as well, so the
// output is the contract's 0), 1 / sum for a finite state, and NaN for a row whose logits
// overflowed, so that its output is NaN whatever the accumulator holds (with m = +inf every p may
// have been 0).
__device__ __forceinline__ float InverseSum(bool sees_keys, float m, float sum) {
  if (!sees_keys) return 0.f;
  return FiniteState(m, sum) ? 1.f / sum : NAN;
}

// The lse of a finished row, by the same rule: kEmptyRowLse, m + log2(sum), or NaN.
__device__ __forceinline__ float FinalLse(bool sees_keys, float m, float sum) {
  if (!sees_keys) return kEmptyRowLse;
  return FiniteState(m, sum) ? m + Log2(sum) : NAN;
}

// The factor for a split-KV chunk's partial columns: 1 / sum, or 0 for a sum that is 0 (the chunk
// saw no key of the row) or NaN. The columns need not carry the NaN: the chunk's PartialLse does,
// and it makes the merged row NaN.
__device__ __forceinline__ float ChunkInverseSum(float sum) { return sum > 0.f ? 1.f / sum : 0.f; }

// The lse of a split-KV chunk's partial row. -inf for a sum of 0, which gives the chunk weight 0
// in the merge: the chunk saw no key of the row, or only -inf logits (right while another chunk
// has a finite one; when none has, every weight is 0 and the merged row is NaN). Otherwise
// m + log2(sum), so that a NaN sum, or m = +inf, reaches the merge as NaN or +inf and makes the
// merged row NaN. m = +inf with a sum of 0 (every p 2^(finite - inf) = 0) is NaN, not weight 0:
// weight 0 would leave the merge the other chunks' keys, whose logits are smaller.
__device__ __forceinline__ float PartialLse(float m, float sum) {
  if (sum == 0.f) return m == INFINITY ? NAN : -INFINITY;
  return m + Log2(sum);
}

// The running state of rows g and g + 8 (g = lane / 4) of a 16-row mma tile; a row's scores are
// spread over the 4 lanes of its quad (kNTiles 8-column tiles, mma C layout: s[j][0..1] row g,
// s[j][2..3] row g + 8). x in 0, 1 selects the row.
template <int kNTiles>
struct OnlineSoftmax {
  float m[2] = {-INFINITY, -INFINITY};  // running max of s' per row
  float d[2] = {0.f, 0.f};              // this lane's share of the running sum of p

  // This lane's maximum of row x's scores in s' units (masked entries are -inf). For a positive
  // scale that is the raw maximum times the scale (and Exponentiate folds the scale into one FFMA
  // per score). Other scales (negative or zero: legal, if unusual) scale s in place first, keeping
  // masked -inf entries at -inf, then take the maximum.
  __device__ __forceinline__ static float TileMax(float (&s)[kNTiles][4], int x, float scale_log2) {
    float tile_max = -INFINITY;
    if (scale_log2 > 0.f) {
#pragma unroll
      for (int j = 0; j < kNTiles; ++j) {
        tile_max = fmaxf(tile_max, fmaxf(s[j][2 * x], s[j][2 * x + 1]));
      }
      return tile_max * scale_log2;
    }
#pragma unroll
    for (int j = 0; j < kNTiles; ++j) {
#pragma unroll
      for (int c = 2 * x; c < 2 * x + 2; ++c) {
        // -inf (masked) times a non-positive scale must stay -inf, not +inf or NaN.
        s[j][c] = s[j][c] == -INFINITY ? -INFINITY : s[j][c] * scale_log2;
        tile_max = fmaxf(tile_max, s[j][c]);
      }
    }
    return tile_max;
  }

  // What Rescale hands to Exponentiate.
  struct Rescaled {
    float alpha;  // 2^(m_old - m_new): the factor for the row's sum and output accumulator
    float base;   // ExpBase(m_new)
  };

  // Folds the tile's maximum of row x (over all of the row's columns, in s' units) into m.
  __device__ __forceinline__ Rescaled Rescale(int x, float tile_max) {
    const float m_new = fmaxf(m[x], tile_max);
    const float base = ExpBase(m_new);
    const Rescaled r{Exp2(m[x] - base), base};
    m[x] = m_new;
    return r;
  }
  // How far (log2 units) a row's maximum may lag its tiles' under kLazy: p then reaches 2^8 at
  // most, well inside bf16's and float's range, and the lse, m + log2(sum), is the same.
  static constexpr float kLazyRescaleLog2 = 8.f;

  // Rescale, but m moves only where tile_max passes it by more than kLazyRescaleLog2; otherwise
  // alpha is exactly 1 and the tile's p are taken against the old m. The test is on the
  // difference, so that for huge logits (m + 8 == m in float) every p stays within 2^8; where m
  // is -inf (no key seen yet) any finite or infinite tile maximum moves it, and the non-finite
  // cases reach the same (m, base) as in Rescale, with the same NaN or 0 p.
  __device__ __forceinline__ Rescaled RescaleLazy(int x, float tile_max) {
    const bool move = tile_max - m[x] > kLazyRescaleLog2;  // false for NaN (-inf - -inf)
    const float m_new = move ? tile_max : m[x];
    const float base = ExpBase(m_new);
    const Rescaled r{move ? Exp2(m[x] - base) : 1.f, base};
    m[x] = m_new;
    return r;
  }

  // Turns row x's scores into p = 2^(s' - m) in place (r from this tile's Rescale of the row) and
  // adds them to the row's sum, after scaling the sum by r.alpha.
  __device__ __forceinline__ void Exponentiate(float (&s)[kNTiles][4], int x, float scale_log2,
                                               const Rescaled& r) {
    const float scale = scale_log2 > 0.f ? scale_log2 : 1.f;  // TileMax applied it otherwise
    const float base = r.base;
    float sum = 0.f;
#pragma unroll
    for (int j = 0; j < kNTiles; ++j) {
      s[j][2 * x] = Exp2(fmaf(s[j][2 * x], scale, -base));
      s[j][2 * x + 1] = Exp2(fmaf(s[j][2 * x + 1], scale, -base));
      sum += s[j][2 * x] + s[j][2 * x + 1];
    }
    d[x] = d[x] * r.alpha + sum;
  }

  // One tile whose rows are whole in this warp: raw scores s (masked entries already -inf) become
  // p. alpha[x] is the factor row x's output accumulator must be multiplied by.
  // kLazy: RescaleLazy instead of Rescale (see UpdatePositiveScale).
  template <bool kLazy = false>
  __device__ __forceinline__ void Update(float (&s)[kNTiles][4], float scale_log2,
                                         float (&alpha)[2]) {
#pragma unroll
    for (int x = 0; x < 2; ++x) {
      const float tile_max = QuadMax(TileMax(s, x, scale_log2));
      const Rescaled r = kLazy ? RescaleLazy(x, tile_max) : Rescale(x, tile_max);
      Exponentiate(s, x, scale_log2, r);
      alpha[x] = r.alpha;
    }
  }

  // Update() for a positive scale_log2 (the caller checks), with the same results bit for bit,
  // but as one straight-line pass over both rows. Update() takes the rows one after the other,
  // each behind TileMax's branch on the scale's sign, so the compiler cannot overlap one row's
  // latency chain (a 17-deep chain of maxima, two quad shuffles, the rescale) with the other
  // row's work: with one consumer warp of each warpgroup per SM sub-partition, little else
  // hides it. Here the maxima are trees (5 deep; the maximum is exact in any order) and both
  // rows' chains run side by side, so the exponentials start sooner and issue back to back.
  // kLazy: the running maximum moves only where a tile's maximum passes it by more than
  // kLazyRescaleLog2 (Rescale's lazy form, RescaleLazy), so that after a row's first tiles its
  // factor is almost always exactly 1 and the caller may skip O's rescale (a warp's vote).
  template <bool kLazy = false>
  __device__ __forceinline__ void UpdatePositiveScale(float (&s)[kNTiles][4], float scale_log2,
                                                      float (&alpha)[2]) {
    static_assert((kNTiles & (kNTiles - 1)) == 0, "tree over a power of two of column tiles");
    float tile_max[2];
#pragma unroll
    for (int x = 0; x < 2; ++x) {
      float v[kNTiles];
#pragma unroll
      for (int j = 0; j < kNTiles; ++j) v[j] = fmaxf(s[j][2 * x], s[j][2 * x + 1]);
      FoldMax<kNTiles / 2>(v);
      tile_max[x] = v[0] * scale_log2;
    }
    auto rescale = [&](int x) {
      const float row_max = QuadMax(tile_max[x]);
      return kLazy ? RescaleLazy(x, row_max) : Rescale(x, row_max);
    };
    const Rescaled r[2] = {rescale(0), rescale(1)};
    float sum[2] = {0.f, 0.f};
#pragma unroll
    for (int j = 0; j < kNTiles; ++j) {
#pragma unroll
      for (int x = 0; x < 2; ++x) {
        s[j][2 * x] = Exp2(fmaf(s[j][2 * x], scale_log2, -r[x].base));
        s[j][2 * x + 1] = Exp2(fmaf(s[j][2 * x + 1], scale_log2, -r[x].base));
        sum[x] += s[j][2 * x] + s[j][2 * x + 1];  // Exponentiate's order
      }
    }
#pragma unroll
    for (int x = 0; x < 2; ++x) {
      d[x] = d[x] * r[x].alpha + sum[x];
      alpha[x] = r[x].alpha;
    }
  }

  // v[0] = the maximum of v[0 .. 2 kWidth), level by level (a template recursion, so that every
  // index is a constant: a loop halving a runtime width left v in local memory).
  template <int kWidth>
  __device__ __forceinline__ static void FoldMax(float (&v)[kNTiles]) {
    if constexpr (kWidth > 0) {
#pragma unroll
      for (int j = 0; j < kWidth; ++j) v[j] = fmaxf(v[j], v[j + kWidth]);
      FoldMax<kWidth / 2>(v);
    }
  }

  // Row x's sum of p over the keys this warp saw (reduced over the quad).
  __device__ __forceinline__ float RowSum(int x) const { return QuadSum(d[x]); }
};

// Multiplies the output accumulator fragments of rows g (o[j][0..1]) and g + 8 (o[j][2..3]) by
// their alpha. kSkipOnes (a lazy rescale's caller, whose factors are almost always exactly 1):
// the whole warp skips the multiplies where every lane's factors are 1 (one vote).
template <bool kSkipOnes = false, int kDTiles>
__device__ __forceinline__ void RescaleAccumulator(float (&o)[kDTiles][4],
                                                   const float (&alpha)[2]) {
  if constexpr (kSkipOnes) {
    if (!__any_sync(0xffffffffu, alpha[0] != 1.f || alpha[1] != 1.f)) return;
  }
#pragma unroll
  for (int j = 0; j < kDTiles; ++j) {
    o[j][0] *= alpha[0];
    o[j][1] *= alpha[0];
    o[j][2] *= alpha[1];
    o[j][3] *= alpha[1];
  }
}

// The cross-warp merge. kParts warps hold states of the same kRows rows: each over different keys
// of the rows (GQA decode: the warps split every key tile), or over the same keys with different
// output columns (MLA: the warps share each tile's maximum, so their m agree). Each publishes its
// (m, sum) per row; after a barrier any thread merges a row. Views two [kParts][kRows] float
// arrays of shared memory.
template <int kParts, int kRows>
struct SoftmaxExchange {
  static constexpr int kBytes = 2 * kParts * kRows * static_cast<int>(sizeof(float));

  float* m;    // [kParts][kRows]
  float* sum;  // [kParts][kRows]

  __device__ __forceinline__ static SoftmaxExchange At(void* smem) {
    float* f = static_cast<float*>(smem);
    return {f, f + kParts * kRows};
  }

  // One value per row and part, for MaxOf (a tile's maximum, combined before Rescale).
  __device__ __forceinline__ void PublishMax(int part, int row, float value) const {
    m[part * kRows + row] = value;
  }
  __device__ __forceinline__ float MaxOf(int row) const {
    float v = -INFINITY;
#pragma unroll
    for (int p = 0; p < kParts; ++p) v = fmaxf(v, m[p * kRows + row]);
    return v;
  }

  // A part's state of a row: its running max and its full (quad-reduced) sum.
  __device__ __forceinline__ void Publish(int part, int row, float row_max, float row_sum) const {
    m[part * kRows + row] = row_max;
    sum[part * kRows + row] = row_sum;
  }

  // The sum of a row whose parts' maxima agree (MLA: every warp folded the same tile maxima into
  // its m), in part order, so every thread that asks gets the same value.
  __device__ __forceinline__ float SumOf(int row) const {
    float v = 0.f;
#pragma unroll
    for (int p = 0; p < kParts; ++p) v += sum[p * kRows + row];
    return v;
  }

  struct Merged {
    float m;    // the row's max over all parts
    float sum;  // the row's sum of p against m
  };
  // The merged state of `row`; weight[p] = 2^(m_p - m) is what part p's unnormalized output
  // accumulator is multiplied by before the parts' accumulators are added.
  __device__ __forceinline__ Merged Merge(int row, float (&weight)[kParts]) const {
    Merged r;
    r.m = MaxOf(row);
    const float base = ExpBase(r.m);
    r.sum = 0.f;
#pragma unroll
    for (int p = 0; p < kParts; ++p) {
      weight[p] = Exp2(m[p * kRows + row] - base);
      r.sum += weight[p] * sum[p * kRows + row];
    }
    return r;
  }
};

// Masks (sets to -inf) the scores of keys at or past each row's limit. Column c of 8-column tile j
// is key first_key + 8 j + 2 (lane % 4) + (c % 2); c < 2 is row g, c >= 2 row g + 8.
template <int kNTiles>
__device__ __forceinline__ void MaskScores(float (&s)[kNTiles][4], int first_key, int lane,
                                           int limit_g, int limit_g8) {
#pragma unroll
  for (int j = 0; j < kNTiles; ++j) {
#pragma unroll
    for (int c = 0; c < 4; ++c) {
      const int key = first_key + 8 * j + 2 * (lane & 3) + (c & 1);
      if (key >= (c < 2 ? limit_g : limit_g8)) s[j][c] = -INFINITY;
    }
  }
}

// P as mma A fragments: 16-key k-step ks is made of score tiles 2 ks and 2 ks + 1.
template <int kNTiles>
__device__ __forceinline__ void ScoresToA(const float (&p)[kNTiles][4],
                                          uint32_t (&a)[kNTiles / 2][4]) {
#pragma unroll
  for (int ks = 0; ks < kNTiles / 2; ++ks) {
    a[ks][0] = PackBf16(p[2 * ks][0], p[2 * ks][1]);
    a[ks][1] = PackBf16(p[2 * ks][2], p[2 * ks][3]);
    a[ks][2] = PackBf16(p[2 * ks + 1][0], p[2 * ks + 1][1]);
    a[ks][3] = PackBf16(p[2 * ks + 1][2], p[2 * ks + 1][3]);
  }
}

}  // namespace attn::cuda
