// Shared-memory tiles of bf16 rows with an XOR swizzle, and the ldmatrix fragment loads the
// attention kernels use on them.
//
// A tile row of kCols bf16 is kCols / 8 chunks of 16 bytes; chunk c of row r is stored at chunk
// position c ^ (r % 8). Eight consecutive rows read at one logical chunk (what ldmatrix does) then
// hit eight different bank groups instead of one. kCols must be a multiple of 64.
#pragma once

#include "kernels/cuda/common/async_copy.cuh"
#include "kernels/cuda/common/mma.cuh"
#include "kernels/cuda/common/paged_kv.cuh"

namespace attn::cuda {

template <int kCols>
struct SwizzledTile {
  static_assert(kCols % 64 == 0, "rows must be whole groups of 8 chunks");
  static constexpr int kChunks = kCols / 8;

  // Element offset of (row, chunk).
  __device__ __forceinline__ static int Offset(int row, int chunk) {
    return row * kCols + ((chunk ^ (row & 7)) << 3);
  }

  // A fragment of rows [r0, r0 + 16) and columns [16 ks, 16 ks + 16) (row-major operand).
  __device__ __forceinline__ static void LoadA(uint32_t (&a)[4], const bf16* tile, int r0, int ks,
                                               int lane) {
    LdMatrixX4(a, tile + Offset(r0 + (lane & 15), 2 * ks + (lane >> 4)));
  }

  // B fragments for S = A * tile^T: keys (rows) [n0, n0 + 16), columns [16 ks, 16 ks + 16).
  // b[0], b[1]: n-tile n0; b[2], b[3]: n-tile n0 + 8.
  __device__ __forceinline__ static void LoadBT(uint32_t (&b)[4], const bf16* tile, int n0, int ks,
                                                int lane) {
    LdMatrixX4(b, tile + Offset(n0 + (lane & 7) + ((lane >> 4) << 3), 2 * ks + ((lane >> 3) & 1)));
  }

  // B fragments for S = A * tile^T over 8 keys [n0, n0 + 8) and two k-steps: b[0], b[1] for
  // columns [16 ks, 16 ks + 16), b[2], b[3] for the next 16.
  __device__ __forceinline__ static void LoadBT8(uint32_t (&b)[4], const bf16* tile, int n0,
                                                 int ks, int lane) {
    LdMatrixX4(b, tile + Offset(n0 + (lane & 7), 2 * ks + (lane >> 3)));
  }

  // B fragments for O = P * tile: rows (keys) [k0, k0 + 16), columns [n0, n0 + 16).
  // b[0], b[1]: n-tile n0; b[2], b[3]: n-tile n0 + 8.
  __device__ __forceinline__ static void LoadB(uint32_t (&b)[4], const bf16* tile, int k0, int n0,
                                               int lane) {
    LdMatrixX4Trans(b, tile + Offset(k0 + (lane & 7) + (((lane >> 3) & 1) << 3),
                                     (n0 >> 3) + (lane >> 4)));
  }

  // cp.async of a GQA query tile: packed row r is token (row_begin + r) / group, query head
  // kv_head * group + (row_begin + r) % group of the sequence; rows at or past num_rows are
  // zero-filled.
  template <int kRows, int kThreads>
  __device__ __forceinline__ static void LoadPackedQuery(bf16* tile, const GqaParams& p,
                                                         const SeqExtent& seq, int row_begin,
                                                         int num_rows, int kv_head, int group,
                                                         int tid) {
    for (int idx = tid; idx < kRows * kChunks; idx += kThreads) {
      const int r = idx / kChunks, c = idx % kChunks;
      const int packed = row_begin + r;
      const bool valid = packed < num_rows;
      const int token = packed / group, head = kv_head * group + packed % group;
      const bf16* src = p.q + ((int64_t{seq.q_begin} + token) * p.num_qo_heads + head) * kCols;
      CopyAsync16(tile + Offset(r, c), valid ? src + c * 8 : p.q, valid);
    }
  }

  // cp.async of rows [0, kRows) from base + offsets[r] (see RowOffsetRing); rows with offset -1
  // (past the key range) are zero-filled: never read, as a NaN there would survive a zero
  // softmax weight.
  template <int kRows, int kThreads>
  __device__ __forceinline__ static void LoadRows(bf16* tile, const bf16* base,
                                                  const int64_t* offsets, int tid) {
    constexpr int kTotal = kRows * kChunks;
#pragma unroll
    for (int i = 0; i < (kTotal + kThreads - 1) / kThreads; ++i) {
      const int idx = tid + i * kThreads;
      if (kTotal % kThreads != 0 && idx >= kTotal) break;
      const int r = idx / kChunks;
      const int c = idx % kChunks;
      const int64_t offset = offsets[r];
      CopyAsync16(tile + Offset(r, c), base + (offset >= 0 ? offset + c * 8 : 0), offset >= 0);
    }
  }

  // Plain copies of two tiles whose rows share their offsets (K and V: base and base +
  // pair_delta), each offset read once for both, from offsets of real rows only
  // (RowOffsetRing<kRows, true>); kHinted: the copies go under the L2 `policy`
  // (EvictFirstPolicy). A thread copies one 16-byte chunk of rows r0, r0 + kRowsPerPass, ...,
  // all on one swizzle phase where kRowsPerPass is a multiple of 8.
  template <int kRows, int kThreads, bool kHinted = false>
  __device__ __forceinline__ static void LoadRowPairs(bf16* tile, bf16* pair_tile, const bf16* base,
                                                      int64_t pair_delta, const int64_t* offsets,
                                                      int tid, uint64_t policy = 0) {
    static_assert(kThreads % kChunks == 0 && kRows % (kThreads / kChunks) == 0);
    constexpr int kRowsPerPass = kThreads / kChunks;
    const int r0 = tid / kChunks, c = tid % kChunks;
#pragma unroll
    for (int i = 0; i < kRows / kRowsPerPass; ++i) {
      const int r = r0 + i * kRowsPerPass;
      const int dst = Offset(r, c);
      const bf16* src = base + offsets[r] + c * 8;
      if constexpr (kHinted) {
        CopyAsync16Hinted(tile + dst, src, policy);
        CopyAsync16Hinted(pair_tile + dst, src + pair_delta, policy);
      } else {
        CopyAsync16(tile + dst, src);
        CopyAsync16(pair_tile + dst, src + pair_delta);
      }
    }
  }
};

// A small row-major bf16 tile padded by 8 elements per row: kCols + 8 elements is an odd number
// of 16-byte units, so ldmatrix's 8 rows fall in different bank groups without a swizzle.
template <int kCols>
struct PaddedTile {
  static constexpr int kStride = kCols + 8;
  static_assert((kStride / 8) % 2 == 1);

  __device__ __forceinline__ static int Offset(int row, int col) { return row * kStride + col; }

  __device__ __forceinline__ static void LoadA(uint32_t (&a)[4], const bf16* tile, int r0, int ks,
                                               int lane) {
    LdMatrixX4(a, tile + Offset(r0 + (lane & 15), 16 * ks + 8 * (lane >> 4)));
  }
};

}  // namespace attn::cuda
