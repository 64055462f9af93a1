// Device-side addressing of one sequence's token rows in a paged cache.
#pragma once

#include <cstdint>

#include "kernels/attention.h"

namespace attn::cuda {

// log2(n) when n is a power of two, else -1 (host or device).
ATTN_HOST_DEVICE int PowerOfTwoShift(int n) {
  if (n <= 0 || (n & (n - 1)) != 0) return -1;
  int shift = 0;
  while ((1 << shift) < n) ++shift;
  return shift;
}

// Token `key` of a sequence lives in page pages[key / page_size], slot key % page_size. Row
// pointers are `base + page * page_stride + slot * token_stride`; base already includes the layer,
// the KV head and (for V) the offset of the V block.
struct PagedRows {
  const bf16* base;
  const int32_t* pages;  // the sequence's kv_indices
  int64_t page_stride;   // elements
  int token_stride;      // elements
  int page_size;
  int page_shift;        // log2(page_size) when it is a power of two, else -1

  // Elements from `base` to the row of token `key`.
  __device__ __forceinline__ int64_t Offset(int key) const {
    int page, slot;
    if (page_shift >= 0) {
      page = key >> page_shift;
      slot = key & (page_size - 1);
    } else {
      page = key / page_size;
      slot = key - page * page_size;
    }
    return pages[page] * page_stride + static_cast<int64_t>(slot) * token_stride;
  }

  __device__ __forceinline__ const bf16* Row(int key) const { return base + Offset(key); }
};

// Row offsets of the key tiles a CTA is about to load, looked up one tile ahead and kept in
// shared memory: the page-table read of a tile is issued early and its latency hides behind the
// math of the current tile instead of delaying the tile's copies (page size 1 reads one page id
// per row). Two slots: tile T uses slot T % 2.
template <int kRows>
struct RowOffsetRing {
  int64_t slot[2][kRows];  // -1: the row is past the key range (zero-filled, never read)

  // Starts the lookup of tile `first_key`'s rows (threads tid < kRows, one row each); the result
  // is stored by Store() once the caller has done other work.
  __device__ __forceinline__ static int64_t Lookup(const PagedRows& rows, int first_key,
                                                   int end_key, int tid) {
    const int key = first_key + tid;
    return tid < kRows && key < end_key ? rows.Offset(key) : -1;
  }
  __device__ __forceinline__ void Store(int tile, int64_t offset, int tid) {
    if (tid < kRows) slot[tile & 1][tid] = offset;
  }
  __device__ __forceinline__ const int64_t* Offsets(int tile) const { return slot[tile & 1]; }
};

// K rows of one KV head of a sequence in a GQA cache (V rows: base + VOffset(cache)).
__device__ __forceinline__ PagedRows GqaKeyRows(const GqaCache& cache, const PagedBatch& batch,
                                                const SeqExtent& seq, int kv_head) {
  PagedRows rows;
  rows.base = cache.data + seq.layer * cache.LayerStride() + kv_head * cache.head_dim;
  rows.pages = batch.kv_indices + seq.page_begin;
  rows.page_stride = cache.PageStride();
  rows.token_stride = static_cast<int>(cache.TokenStride());
  rows.page_size = cache.page_size;
  rows.page_shift = PowerOfTwoShift(cache.page_size);
  return rows;
}

// Elements from a page's K block to its V block.
__device__ __forceinline__ int64_t GqaValueOffset(const GqaCache& cache) {
  return cache.page_size * cache.TokenStride();
}

// The 576-wide rows of a sequence in an MLA cache.
__device__ __forceinline__ PagedRows MlaRows(const MlaCache& cache, const PagedBatch& batch,
                                             const SeqExtent& seq) {
  PagedRows rows;
  rows.base = cache.data + seq.layer * cache.LayerStride();
  rows.pages = batch.kv_indices + seq.page_begin;
  rows.page_stride = cache.PageStride();
  rows.token_stride = kMlaTokenDim;
  rows.page_size = cache.page_size;
  rows.page_shift = PowerOfTwoShift(cache.page_size);
  return rows;
}


}  // namespace attn::cuda
