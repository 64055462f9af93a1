// The one public header of the kernels library: cache layouts, batch descriptions and the
// parameter structs shared by every backend (CPU, CUDA) and by the reference. Nothing here knows
// about gRPC, protobuf or absl.
//
// Semantics (docs/design.md, "Attention semantics"): bottom-right aligned causal mask, natural-exp
// softmax over the visible keys, float32 accumulation, bf16 output, base-2 log-sum-exp of the
// scaled logits.
//
// Which rows are empty is decided by the geometry (VisibleKeys below), never by a softmax state:
// - a row that sees no key (VisibleKeys == 0): output 0, lse kEmptyRowLse;
// - a row that sees keys: out = acc / sum and lse = m + log2(sum) while the running max m is
//   finite and sum is positive and finite; otherwise its float32 logits overflowed (a logit +inf
//   or NaN, or every visible logit -inf) and output and lse are NaN. Inputs are refused when not
//   finite, so only overflow gets there (q or sm_scale near float's range). A key whose logit is
//   -inf while another key's is finite simply gets probability 0.
// - split-KV: a chunk's partial lse is -inf when its sum is 0 (weight 0 in the merge: a chunk may
//   see no key of a row, or only -inf logits), else m + log2(sum), so NaN and +inf reach the
//   merge, whose row follows the rule above with "sees keys" = the row has a chunk.
#pragma once

#include <cstdint>

#include "kernels/bf16.h"

#if defined(__CUDACC__)
#define ATTN_HOST_DEVICE __host__ __device__ __forceinline__
#else
#define ATTN_HOST_DEVICE inline
#endif

namespace attn {

// lse written for a row that sees no key: finite, and small enough that exp2(lse - x) is 0 for
// any real lse x, so merging such a row's state with another one leaves the other unchanged.
inline constexpr float kEmptyRowLse = -1.0e30f;

// MLA (DeepSeek-style, absorbed) dimensions.
inline constexpr int kMlaCkvDim = 512;
inline constexpr int kMlaKpeDim = 64;
inline constexpr int kMlaTokenDim = kMlaCkvDim + kMlaKpeDim;

// A batch of sequences over a paged cache, CSR as in FlashInfer. All arrays are in the memory
// space of the entry point they are passed to (host for the CPU backend, device for CUDA).
struct PagedBatch {
  int batch_size = 0;
  int total_q = 0;
  // [batch_size + 1] query row offsets; nullptr means one query row per sequence (decode).
  const int32_t* qo_indptr = nullptr;
  // [batch_size + 1] page offsets into kv_indices.
  const int32_t* kv_indptr = nullptr;
  // [kv_indptr[batch_size]] page ids, in token order per sequence.
  const int32_t* kv_indices = nullptr;
  // [batch_size] tokens in each sequence's last page, 1..page_size (ignored without pages).
  const int32_t* kv_last_page_len = nullptr;
  // [batch_size] the layer each sequence's call reads and writes; nullptr means layer 0 for all.
  // (Lets one launch serve calls for different layers.)
  const int32_t* seq_layer = nullptr;
};

// GQA cache of one pool: pages of K and V for every layer, one allocation.
// Element layout: [num_layers, num_pages, 2 (K, V), page_size, num_kv_heads, head_dim].
struct GqaCache {
  bf16* data = nullptr;
  int num_layers = 0;
  int num_pages = 0;
  int page_size = 0;
  int num_kv_heads = 0;
  int head_dim = 0;

  ATTN_HOST_DEVICE int64_t TokenStride() const { return int64_t{num_kv_heads} * head_dim; }
  // A page holds its K block, then its V block.
  ATTN_HOST_DEVICE int64_t PageStride() const { return 2 * page_size * TokenStride(); }
  ATTN_HOST_DEVICE int64_t LayerStride() const { return num_pages * PageStride(); }
  ATTN_HOST_DEVICE int64_t NumElements() const { return num_layers * LayerStride(); }
};

// MLA cache of one pool: per token a 576-wide row, the 512-wide latent ckv followed by the
// 64-wide rope part kpe, shared by all query heads.
// Element layout: [num_layers, num_pages, page_size, kMlaTokenDim].
struct MlaCache {
  bf16* data = nullptr;
  int num_layers = 0;
  int num_pages = 0;
  int page_size = 0;

  ATTN_HOST_DEVICE int64_t PageStride() const { return int64_t{page_size} * kMlaTokenDim; }
  ATTN_HOST_DEVICE int64_t LayerStride() const { return num_pages * PageStride(); }
  ATTN_HOST_DEVICE int64_t NumElements() const { return num_layers * LayerStride(); }
};

// One GQA prefill or decode launch: optional append of new K/V, then attention.
struct GqaParams {
  GqaCache cache;
  PagedBatch batch;
  int num_qo_heads = 0;         // a multiple of cache.num_kv_heads
  const bf16* q = nullptr;      // [total_q, num_qo_heads, head_dim]
  const bf16* k_new = nullptr;  // [total_q, num_kv_heads, head_dim] or nullptr (no append)
  const bf16* v_new = nullptr;  // [total_q, num_kv_heads, head_dim] or nullptr
  bf16* out = nullptr;          // [total_q, num_qo_heads, head_dim]
  float* lse = nullptr;         // [total_q, num_qo_heads] base-2, or nullptr
  float sm_scale = 0.f;
  bool causal = true;  // bottom-right aligned; decode rows see every key either way
};

// One MLA prefill or decode launch.
struct MlaParams {
  MlaCache cache;
  PagedBatch batch;
  int num_heads = 0;
  const bf16* q_nope = nullptr;   // [total_q, num_heads, kMlaCkvDim]
  const bf16* q_pe = nullptr;     // [total_q, num_heads, kMlaKpeDim]
  const bf16* ckv_new = nullptr;  // [total_q, kMlaCkvDim] or nullptr (no append)
  const bf16* kpe_new = nullptr;  // [total_q, kMlaKpeDim] or nullptr
  bf16* out = nullptr;            // [total_q, num_heads, kMlaCkvDim]
  float* lse = nullptr;           // [total_q, num_heads] base-2, or nullptr
  float sm_scale = 0.f;
  bool causal = true;
};

// Sequence geometry derived from a PagedBatch (host or device code).
struct SeqExtent {
  int q_begin;  // first query row
  int q_len;
  int page_begin;  // offset into kv_indices
  int num_pages;
  int kv_len;
  int layer;
};

ATTN_HOST_DEVICE SeqExtent GetSeqExtent(const PagedBatch& b, int page_size, int seq) {
  SeqExtent e;
  e.q_begin = b.qo_indptr ? b.qo_indptr[seq] : seq;
  e.q_len = b.qo_indptr ? b.qo_indptr[seq + 1] - e.q_begin : 1;
  e.page_begin = b.kv_indptr[seq];
  e.num_pages = b.kv_indptr[seq + 1] - e.page_begin;
  e.kv_len = e.num_pages == 0 ? 0 : (e.num_pages - 1) * page_size + b.kv_last_page_len[seq];
  e.layer = b.seq_layer ? b.seq_layer[seq] : 0;
  return e;
}

// The causal rule (bottom-right aligned): query row `row` (0-based within a sequence of q_len
// query rows and kv_len keys) sees keys [0, VisibleKeys), i.e. key j iff j <= row + kv_len - q_len;
// without the mask, every key. Rows of a q_len > kv_len sequence that come before its first key
// see none. The planners, the CUDA kernels and the CPU backend all ask this one function.
ATTN_HOST_DEVICE int VisibleKeys(const SeqExtent& e, int row, bool causal) {
  if (!causal) return e.kv_len;
  const int v = row + 1 + e.kv_len - e.q_len;
  return v < 0 ? 0 : (v > e.kv_len ? e.kv_len : v);
}

// The same from the lengths alone (host planners and tests).
ATTN_HOST_DEVICE int VisibleKeys(int q_len, int kv_len, int row, bool causal) {
  SeqExtent e{};
  e.q_len = q_len;
  e.kv_len = kv_len;
  return VisibleKeys(e, row, causal);
}

// Where an appended row goes: the new rows are the last q_len tokens of their sequence, so query
// row `row` (0-based within the sequence) is written at token position kv_len - q_len + row.
// Negative when q_len > kv_len and the row falls before the sequence's first token: such a row has
// no cache slot and is not written.
ATTN_HOST_DEVICE int AppendPosition(const SeqExtent& e, int row) {
  return e.kv_len - e.q_len + row;
}

}  // namespace attn
