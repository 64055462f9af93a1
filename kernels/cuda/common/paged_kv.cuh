// Device-side addressing of one sequence's token rows in a paged cache.
#pragma once

#include <cstdint>

#include "kernels/attention.h"
#include "kernels/cuda/common/async_copy.cuh"

namespace attn::cuda {

// log2(n) when n is a power of two, else -1 (host or device).
ATTN_HOST_DEVICE int PowerOfTwoShift(int n) {
  if (n <= 0 || (n & (n - 1)) != 0) return -1;
  int shift = 0;
  while ((1 << shift) < n) ++shift;
  return shift;
}

// The token rows of one sequence in a paged cache, the one addressing every kernel uses: the
// attention kernels read rows through it (Elem = const bf16) and the append kernel writes them
// (Elem = bf16). Token `key` lives in page pages[key / page_size], slot key % page_size; its row
// starts `Offset(key)` elements after `base`, which already includes the layer, the KV head (GQA)
// and, for V rows, the K block before them (GqaValueOffset).
template <typename Elem>
struct PagedRowsOf {
  Elem* base;
  const int32_t* pages;  // the sequence's kv_indices
  int64_t page_stride;   // elements
  int token_stride;      // elements
  int page_size;
  int page_shift;  // log2(page_size) when it is a power of two, else -1

  // The index into `pages` of token `key`'s page, and its slot there.
  __device__ __forceinline__ void PageSlot(int key, int* page, int* slot) const {
    if (page_shift >= 0) {
      *page = key >> page_shift;
      *slot = key & (page_size - 1);
    } else {
      *page = key / page_size;
      *slot = key - *page * page_size;
    }
  }

  // Elements from `base` to slot `slot` of page id `page_id`.
  __device__ __forceinline__ int64_t OffsetIn(int32_t page_id, int slot) const {
    return page_id * page_stride + static_cast<int64_t>(slot) * token_stride;
  }

  // Elements from `base` to the row of token `key`.
  __device__ __forceinline__ int64_t Offset(int key) const {
    int page, slot;
    PageSlot(key, &page, &slot);
    return OffsetIn(pages[page], slot);
  }

  __device__ __forceinline__ Elem* Row(int key) const { return base + Offset(key); }
};

// Rows the attention kernels read.
using PagedRows = PagedRowsOf<const bf16>;

// Row offsets of the key tiles a CTA is about to load, kept in shared memory: a tile's page-table
// reads are issued while the CTA still computes an earlier tile, and only stored (Store) once
// that math is done, so their latency hides behind it instead of delaying the tile's copies (page
// size 1 reads one page id per row). A tile's offsets are read once, when its copies are issued,
// so two slots suffice however deep the copy pipeline is: tile T uses slot T % 2.
//
// Rows at or past the key range's end (never their slots: a NaN there would survive a zero
// softmax weight) get offset -1, which SwizzledTile::LoadRows zero-fills; or, with
// kRepeatLastKey, the offset of the range's last key: real, finite data the kernel masks, so that
// every copy is a plain one (SwizzledTile::LoadRowPairs). A range with no key gets 0 there (none
// of its tiles is copied).
template <int kRows, bool kRepeatLastKey = false>
struct RowOffsetRing {
  int64_t slot[2][kRows];

  // Starts the lookup of tile `first_key`'s rows (threads tid < kRows, one row each); the result
  // is stored by Store() once the caller has done other work.
  __device__ __forceinline__ static int64_t Lookup(const PagedRows& rows, int first_key,
                                                   int end_key, int tid) {
    if constexpr (kRepeatLastKey) {
      const int key = min(first_key + tid, end_key - 1);
      return tid < kRows && key >= 0 ? rows.Offset(key) : 0;
    } else {
      const int key = first_key + tid;
      return tid < kRows && key < end_key ? rows.Offset(key) : -1;
    }
  }
  __device__ __forceinline__ void Store(int tile, int64_t offset, int tid) {
    if (tid < kRows) slot[tile & 1][tid] = offset;
  }
  __device__ __forceinline__ const int64_t* Offsets(int tile) const { return slot[tile & 1]; }
};

// The page ids of key tiles a CTA loads later, copied into shared memory by cp.async in an
// earlier tile's copy group, so that a tile's row offsets come from shared memory instead of a
// page-table read from global memory whose latency each tile would wait for (page size 1 reads
// one id per key, and after the first tile of a sequence every such read misses L2). Tile T's ids
// live in slot T % kSlots; a tile's ids span at most kKeys pages (page size 1).
template <int kKeys, int kSlots>
struct PageIdStage {
  int32_t ids[kSlots][kKeys];

  // Issues the copies of the ids of the pages that keys [first_key, min(first_key + kKeys,
  // end_key)) live in (threads tid < kKeys, one id each); nothing when first_key >= end_key.
  __device__ __forceinline__ void Fetch(const PagedRows& rows, int tile, int first_key, int end_key,
                                        int tid) {
    if (tid >= kKeys || first_key >= end_key) return;
    int first_page, last_page, slot;
    rows.PageSlot(first_key, &first_page, &slot);
    rows.PageSlot(min(first_key + kKeys, end_key) - 1, &last_page, &slot);
    if (tid <= last_page - first_page) {
      CopyAsync4(&ids[tile % kSlots][tid], rows.pages + first_page + tid);
    }
  }

  // The row offset of key first_key + tid (threads tid < kKeys) from the ids Fetch copied for
  // this tile (complete and synchronized before), as RowOffsetRing<kKeys, true>::Lookup computes
  // it (keys at or past end_key as key end_key - 1; 0 for a tile past the range, never copied).
  __device__ __forceinline__ int64_t Lookup(const PagedRows& rows, int tile, int first_key,
                                            int end_key, int tid) const {
    if (tid >= kKeys || first_key >= end_key) return 0;
    const int key = min(first_key + tid, end_key - 1);
    int first_page, page, slot;
    rows.PageSlot(first_key, &first_page, &slot);
    rows.PageSlot(key, &page, &slot);
    return rows.OffsetIn(ids[tile % kSlots][page - first_page], slot);
  }
};

// K rows of one KV head of a sequence in a GQA cache; its V rows start GqaValueOffset(cache)
// elements later. With kv_head 0 a row spans the K of every KV head of the token (the heads of a
// token are adjacent), which is what an append writes.
template <typename Elem = const bf16>
__device__ __forceinline__ PagedRowsOf<Elem> GqaKeyRows(const GqaCache& cache,
                                                        const PagedBatch& batch,
                                                        const SeqExtent& seq, int kv_head) {
  PagedRowsOf<Elem> rows;
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

// The 576-wide rows (ckv then kpe) of a sequence in an MLA cache.
template <typename Elem = const bf16>
__device__ __forceinline__ PagedRowsOf<Elem> MlaRows(const MlaCache& cache, const PagedBatch& batch,
                                                     const SeqExtent& seq) {
  PagedRowsOf<Elem> rows;
  rows.base = cache.data + seq.layer * cache.LayerStride();
  rows.pages = batch.kv_indices + seq.page_begin;
  rows.page_stride = cache.PageStride();
  rows.token_stride = kMlaTokenDim;
  rows.page_size = cache.page_size;
  rows.page_shift = PowerOfTwoShift(cache.page_size);
  return rows;
}

}  // namespace attn::cuda
