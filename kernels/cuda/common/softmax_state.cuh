// Online softmax (FlashAttention) for the two rows one lane of an mma tile holds: rows g and g+8
// of a 16-row tile, columns spread over the 4 lanes of the quad. All values are in log2 units:
// s' = sm_scale * log2(e) * q.k, so p = 2^(s' - m) and the base-2 lse is m + log2(sum p).
#pragma once

#include <cmath>

#include "kernels/cuda/common/math.cuh"
#include "kernels/cuda/common/mma.cuh"

namespace attn::cuda {

template <int kNTiles>  // 8-column tiles of the score block
struct OnlineSoftmax {
  float m[2] = {-INFINITY, -INFINITY};  // running max of s' per row
  float d[2] = {0.f, 0.f};              // this lane's share of the running sum of p

  // Turns raw scores s (masked entries already -inf) into p = 2^(s * scale_log2 - m_new),
  // updating m and d. alpha[x] is the factor the row's output accumulator must be multiplied by.
  __device__ __forceinline__ void Update(float (&s)[kNTiles][4], float scale_log2,
                                         float (&alpha)[2]) {
#pragma unroll
    for (int x = 0; x < 2; ++x) {
      // For a positive scale the scaled maximum is the raw maximum times the scale, and each
      // score below costs one FFMA. Other scales (negative or zero: legal, if unusual) scale
      // first, keeping masked -inf entries at -inf, then take the maximum.
      float tile_max = -INFINITY;
      if (scale_log2 > 0.f) {
#pragma unroll
        for (int j = 0; j < kNTiles; ++j) {
          tile_max = fmaxf(tile_max, fmaxf(s[j][2 * x], s[j][2 * x + 1]));
        }
        tile_max *= scale_log2;
      } else {
#pragma unroll
        for (int j = 0; j < kNTiles; ++j) {
#pragma unroll
          for (int c = 2 * x; c < 2 * x + 2; ++c) {
            // -inf (masked) times a non-positive scale must stay -inf, not +inf or NaN.
            s[j][c] = s[j][c] == -INFINITY ? -INFINITY : s[j][c] * scale_log2;
            tile_max = fmaxf(tile_max, s[j][c]);
          }
        }
      }
      const float scale = scale_log2 > 0.f ? scale_log2 : 1.f;  // already applied otherwise
      const float m_new = fmaxf(m[x], QuadMax(tile_max));
      // A row that has seen only masked keys keeps m = -inf; subtract 0 then so 2^(-inf) = 0
      // instead of NaN.
      const float base = m_new == -INFINITY ? 0.f : m_new;
      alpha[x] = Exp2(m[x] - base);
      m[x] = m_new;
      float sum = 0.f;
#pragma unroll
      for (int j = 0; j < kNTiles; ++j) {
        s[j][2 * x] = Exp2(fmaf(s[j][2 * x], scale, -base));
        s[j][2 * x + 1] = Exp2(fmaf(s[j][2 * x + 1], scale, -base));
        sum += s[j][2 * x] + s[j][2 * x + 1];
      }
      d[x] = d[x] * alpha[x] + sum;
    }
  }

  // The row's full sum of p (reduced over the quad).
  __device__ __forceinline__ float RowSum(int x) const { return QuadSum(d[x]); }
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
