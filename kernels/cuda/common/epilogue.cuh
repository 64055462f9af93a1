// Writing an attention CTA's results: the final bf16 output (+ base-2 lse) or, for a split-KV
// chunk, float32 partial (output, lse) rows for the merge pass (kernels/cuda/merge_states.cu).
#pragma once

#include <cuda_bf16.h>

#include <cmath>
#include <cstdint>

#include "kernels/attention.h"
#include "kernels/cuda/common/softmax_state.cuh"

namespace attn::cuda {

// Destination of a CTA's rows. Packed row p of the sequence is token p / group, query head
// head_base + p % group.
struct RowSink {
  bf16* out;            // [total_q, num_heads, out_dim]
  float* lse;           // [total_q, num_heads] or null
  float* partial_out;   // [partial_rows, out_dim]
  float* partial_lse;   // [partial_rows]
  int32_t partial_row;  // -1: final output; else the chunk's row of (token 0, head 0)
  int q_begin;
  int num_heads;
  int out_dim;
  int group;
  int head_base;

  __device__ __forceinline__ int64_t Row(int packed_row) const {
    const int token = packed_row / group;
    const int head = head_base + packed_row % group;
    return partial_row >= 0 ? int64_t{partial_row} + int64_t{token} * num_heads + head
                            : (int64_t{q_begin} + token) * num_heads + head;
  }
};

// Stores one warp's accumulator fragments: rows (row0 + lane/4) and (+8) of 16, columns
// col0 + 8 j + 2 (lane % 4) + {0, 1}, normalized by the rows' softmax sums (m, sum: running max
// and full sum of 2^(s' - m) of rows g and g + 8). Rows at or past `num_rows` (tile padding) are
// skipped. A row that saw no key is written as 0 with lse kEmptyRowLse (final) or -inf (partial:
// the merge never reads it).
template <int kDTiles>
__device__ __forceinline__ void StoreRows(const RowSink& sink, const float (&o)[kDTiles][4],
                                          const float (&m)[2], const float (&sums)[2], int row0,
                                          int num_rows, int col0, int lane, bool write_lse) {
#pragma unroll
  for (int x = 0; x < 2; ++x) {
    const float sum = sums[x];
    const int p = row0 + (lane >> 2) + 8 * x;
    if (p >= num_rows) continue;
    const float inv = sum > 0.f ? 1.f / sum : 0.f;
    const int64_t row = sink.Row(p);
    const int col = col0 + 2 * (lane & 3);
    if (sink.partial_row >= 0) {
      float* dst = sink.partial_out + row * sink.out_dim + col;
#pragma unroll
      for (int j = 0; j < kDTiles; ++j) {
        *reinterpret_cast<float2*>(dst + 8 * j) =
            make_float2(o[j][2 * x] * inv, o[j][2 * x + 1] * inv);
      }
      if ((lane & 3) == 0) sink.partial_lse[row] = sum > 0.f ? m[x] + Log2(sum) : -INFINITY;
    } else {
      __nv_bfloat16* dst = reinterpret_cast<__nv_bfloat16*>(sink.out) + row * sink.out_dim + col;
#pragma unroll
      for (int j = 0; j < kDTiles; ++j) {
        *reinterpret_cast<__nv_bfloat162*>(dst + 8 * j) =
            __floats2bfloat162_rn(o[j][2 * x] * inv, o[j][2 * x + 1] * inv);
      }
      if (write_lse && sink.lse != nullptr && (lane & 3) == 0) {
        sink.lse[row] = sum > 0.f ? m[x] + Log2(sum) : kEmptyRowLse;
      }
    }
  }
}

}  // namespace attn::cuda
