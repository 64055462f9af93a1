// The epilogue every attention kernel ends with: writing a CTA's finished rows, either the final
// bf16 output (+ base-2 lse) or, for a split-KV chunk, float32 partial (output, lse) rows for the
// merge pass (kernels/cuda/merge_states.cu). Rows are normalized and their lse finished with the
// softmax helpers (softmax_state.cuh), so the rules for rows that see no key and for overflowed
// logits live in one place; whether a final row sees a key is the sequence's geometry
// (RowSink::SeesKeys), never read off the softmax state.
#pragma once

#include <cuda_bf16.h>

#include <cstdint>

#include "kernels/attention.h"
#include "kernels/cuda/api.h"
#include "kernels/cuda/common/mma.cuh"
#include "kernels/cuda/common/softmax_state.cuh"

namespace attn::cuda {

// Where a CTA's rows go. Made on the host for the launch (ForGqa / ForMla), passed to the kernel
// by value, and narrowed to one CTA's work item in the kernel (ForItem). Packed row p of the item
// (kernels/cuda/plan.h) is token p / group of the sequence, query head head_base + p % group.
class RowSink {
 public:
  // The launch's sink: final rows into params.out / params.lse, partial rows into the plan's
  // workspace.
  static RowSink ForGqa(const GqaParams& p, const DevicePlan& plan) {
    return Launch(p.out, p.lse, plan, p.num_qo_heads, p.cache.head_dim,
                  p.num_qo_heads / p.cache.num_kv_heads);
  }
  static RowSink ForMla(const MlaParams& p, const DevicePlan& plan) {
    return Launch(p.out, p.lse, plan, p.num_heads, kMlaCkvDim, p.num_heads);
  }

  // One CTA's rows: those of a work item with WorkItem::partial_row `partial_row` (-1: final
  // output), of sequence `seq` (masked causally or not, as the launch), for query heads from
  // head_base.
  __device__ __forceinline__ RowSink ForItem(int32_t partial_row, const SeqExtent& seq, bool causal,
                                             int head_base) const {
    RowSink s = *this;
    s.partial_row_ = partial_row;
    s.seq_ = seq;
    s.causal_ = causal;
    s.head_base_ = head_base;
    return s;
  }

  // True when the rows are a split-KV chunk's partials.
  __device__ __forceinline__ bool partial() const { return partial_row_ >= 0; }

  // The output (or workspace) row of packed row p: index into out / lse (or partial_out /
  // partial_lse) in rows of out_dim.
  __device__ __forceinline__ int64_t Row(int packed_row) const {
    const int token = packed_row / group_;
    const int head = head_base_ + packed_row % group_;
    return partial() ? int64_t{partial_row_} + int64_t{token} * num_heads_ + head
                     : (int64_t{seq_.q_begin} + token) * num_heads_ + head;
  }

  // True when packed row p's token sees at least one key of its sequence. A final row's item
  // covers every key its rows see, so this is also whether the row's state saw a key.
  __device__ __forceinline__ bool SeesKeys(int packed_row) const {
    return VisibleKeys(seq_, packed_row / group_, causal_) > 0;
  }

  // The factor packed row p's columns are multiplied by, from the row's final (max, sum):
  // ChunkInverseSum for a partial, InverseSum for a final row.
  __device__ __forceinline__ float Inverse(int packed_row, float m, float sum) const {
    return partial() ? ChunkInverseSum(sum) : InverseSum(SeesKeys(packed_row), m, sum);
  }

  // Columns [col, col + kCols) of `row` (Row()), multiplied by inv (Inverse()): float32 into the
  // workspace for a partial, bf16 (round to nearest even) into out otherwise. The two halves are
  // there for a caller that stores several fragments of one row and tests partial() once.
  template <int kCols>
  __device__ __forceinline__ void StorePartialColumns(int64_t row, int col, const float (&v)[kCols],
                                                      float inv) const {
    static_assert(kCols == 2 || kCols == 4);
    float* dst = partial_out_ + row * out_dim_ + col;
    if constexpr (kCols == 2) {
      *reinterpret_cast<float2*>(dst) = make_float2(v[0] * inv, v[1] * inv);
    } else {
      *reinterpret_cast<float4*>(dst) = make_float4(v[0] * inv, v[1] * inv, v[2] * inv, v[3] * inv);
    }
  }
  template <int kCols>
  __device__ __forceinline__ void StoreOutputColumns(int64_t row, int col, const float (&v)[kCols],
                                                     float inv) const {
    static_assert(kCols == 2 || kCols == 4);
    bf16* dst = out_ + row * out_dim_ + col;
    if constexpr (kCols == 2) {
      *reinterpret_cast<uint32_t*>(dst) = PackBf16(v[0] * inv, v[1] * inv);
    } else {
      *reinterpret_cast<uint2*>(dst) =
          make_uint2(PackBf16(v[0] * inv, v[1] * inv), PackBf16(v[2] * inv, v[3] * inv));
    }
  }
  // Eight bf16 columns [col, col + 8) of `row`, already normalized and packed (16 bytes; out and
  // its rows are 16-byte aligned).
  __device__ __forceinline__ void StoreOutputPacked(int64_t row, int col, const uint4& v) const {
    *reinterpret_cast<uint4*>(out_ + row * out_dim_ + col) = v;
  }
  template <int kCols>
  __device__ __forceinline__ void StoreColumns(int64_t row, int col, const float (&v)[kCols],
                                               float inv) const {
    if (partial()) {
      StorePartialColumns(row, col, v, inv);
    } else {
      StoreOutputColumns(row, col, v, inv);
    }
  }

  // True when the launch writes lse.
  __device__ __forceinline__ bool has_lse() const { return lse_ != nullptr; }

  // The lse of packed row p, at `row` (Row(p)), from its final (max, sum): PartialLse into the
  // workspace, or FinalLse into lse when the launch asked for it (has_lse(): the caller of
  // StoreOutputLse checks). One thread per row calls it; the halves as above.
  __device__ __forceinline__ void StorePartialLse(int64_t row, float m, float sum) const {
    partial_lse_[row] = PartialLse(m, sum);
  }
  __device__ __forceinline__ void StoreOutputLse(int packed_row, int64_t row, float m,
                                                 float sum) const {
    lse_[row] = FinalLse(SeesKeys(packed_row), m, sum);
  }
  __device__ __forceinline__ void StoreLse(int packed_row, int64_t row, float m, float sum) const {
    if (partial()) {
      StorePartialLse(row, m, sum);
    } else if (has_lse()) {
      StoreOutputLse(packed_row, row, m, sum);
    }
  }

 private:
  RowSink() = default;

  static RowSink Launch(bf16* out, float* lse, const DevicePlan& plan, int num_heads, int out_dim,
                        int group) {
    RowSink s;
    s.out_ = out;
    s.lse_ = lse;
    s.partial_out_ = plan.partial_out;
    s.partial_lse_ = plan.partial_lse;
    s.num_heads_ = num_heads;
    s.out_dim_ = out_dim;
    s.group_ = group;
    return s;
  }

  bf16* out_ = nullptr;           // [total_q, num_heads, out_dim]
  float* lse_ = nullptr;          // [total_q, num_heads] or null
  float* partial_out_ = nullptr;  // [partial_rows, out_dim]
  float* partial_lse_ = nullptr;  // [partial_rows]
  int num_heads_ = 0;             // query heads per token in out
  int out_dim_ = 0;               // columns per (token, head) row
  int group_ = 1;                 // packed rows per token
  // Set per CTA by ForItem.
  int32_t partial_row_ = -1;  // -1: final output; else the chunk's row of (token 0, head 0)
  SeqExtent seq_ = {};        // the item's sequence
  bool causal_ = true;
  int head_base_ = 0;
};

// Four fragments' bf16 words of one row, w[k] the lane's two columns 8 k + 2 (lane % 4) of the
// four, transposed within the lane's quad (the four lanes that hold the row, `quad` their mask):
// afterwards w[r] is lane r's word of fragment lane % 4, so the lane holds that fragment's eight
// columns in order. Two rounds of exchanges with the lane whose quad index differs in bit m, each
// lane sending the two words it replaces.
__device__ __forceinline__ uint4 TransposeQuad(uint32_t (&w)[4], int lane, uint32_t quad) {
#pragma unroll
  for (int m = 1; m <= 2; m <<= 1) {
    const bool hi = (lane & m) != 0;
#pragma unroll
    for (int k0 = 0; k0 < 4; ++k0) {
      if (k0 & m) continue;
      const int k1 = k0 | m;
      const uint32_t recv = __shfl_xor_sync(quad, hi ? w[k0] : w[k1], m);
      if (hi) {
        w[k0] = recv;
      } else {
        w[k1] = recv;
      }
    }
  }
  return make_uint4(w[0], w[1], w[2], w[3]);
}

// Stores one warp's accumulator fragments (mma C layout): rows row0 + lane / 4 and + 8 of a
// 16-row tile, columns col0 + 8 j + 2 (lane % 4) + {0, 1}, normalized by the rows' softmax state
// (m: running max, sums: full sum of 2^(s' - m) of rows g and g + 8). Rows at or past `num_rows`
// (tile padding) are skipped. `write_lse`: this warp writes the rows' lse (of several warps that
// hold different columns of the same rows, one does).
template <int kDTiles>
__device__ __forceinline__ void StoreRows(const RowSink& sink, const float (&o)[kDTiles][4],
                                          const float (&m)[2], const float (&sums)[2], int row0,
                                          int num_rows, int col0, int lane, bool write_lse) {
#pragma unroll
  for (int x = 0; x < 2; ++x) {
    const int p = row0 + (lane >> 2) + 8 * x;
    if (p >= num_rows) continue;
    const float inv = sink.Inverse(p, m[x], sums[x]);
    const int64_t row = sink.Row(p);
    const int col = col0 + 2 * (lane & 3);
    if (sink.partial()) {
#pragma unroll
      for (int j = 0; j < kDTiles; ++j) {
        sink.StorePartialColumns<2>(row, col + 8 * j, {o[j][2 * x], o[j][2 * x + 1]}, inv);
      }
      if (write_lse && (lane & 3) == 0) sink.StorePartialLse(row, m[x], sums[x]);
    } else {
      if constexpr (kDTiles % 4 == 0) {
        // 16 bytes a lane: each group of four fragments transposed within the quad, so that a
        // warp's store writes 64 contiguous bytes of each of its 8 rows (rather than 4 bytes a
        // lane, 16 of each row, and 4x the store instructions).
        const uint32_t quad = 0xfu << (lane & ~3);
#pragma unroll
        for (int g = 0; g < kDTiles / 4; ++g) {
          uint32_t w[4];
#pragma unroll
          for (int k = 0; k < 4; ++k) {
            w[k] = PackBf16(o[4 * g + k][2 * x] * inv, o[4 * g + k][2 * x + 1] * inv);
          }
          sink.StoreOutputPacked(row, col0 + 8 * (4 * g + (lane & 3)),
                                 TransposeQuad(w, lane, quad));
        }
      } else {
#pragma unroll
        for (int j = 0; j < kDTiles; ++j) {
          sink.StoreOutputColumns<2>(row, col + 8 * j, {o[j][2 * x], o[j][2 * x + 1]}, inv);
        }
      }
      if (write_lse && sink.has_lse() && (lane & 3) == 0) {
        sink.StoreOutputLse(p, row, m[x], sums[x]);
      }
    }
  }
}

}  // namespace attn::cuda
