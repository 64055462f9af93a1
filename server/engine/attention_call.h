// A validated Prefill or Decode call, as the batcher and the backends see it.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "absl/types/span.h"
#include "kernels/attention.h"

namespace attn {

enum class Op { kPrefill, kDecode };

inline const char* OpName(Op op) { return op == Op::kPrefill ? "prefill" : "decode"; }

// Views point into the request message and the response message of the RPC, both of which
// outlive the call (the RPC finishes only after the backend is done with it).
struct AttentionCall {
  Op op = Op::kPrefill;
  int layer = 0;
  int batch_size = 0;
  int total_q = 0;

  // Page table. qo_indptr is empty for Decode (one query row per sequence).
  absl::Span<const int32_t> qo_indptr;   // [batch_size + 1]
  absl::Span<const int32_t> kv_indptr;   // [batch_size + 1]
  absl::Span<const int32_t> kv_indices;  // [kv_indptr[batch_size]]
  std::vector<int32_t> kv_last_page_len;  // [batch_size], normalized: 0 for sequences w/o pages

  // bf16 inputs. GQA: q [total_q, H, D], k_new/v_new [total_q, H_kv, D].
  // MLA: q = q_nope [total_q, H, 512], q_pe [total_q, H, 64], k_new = ckv [total_q, 512],
  // v_new = kpe [total_q, 64]. k_new and v_new are both null when nothing is appended.
  const bf16* q = nullptr;
  const bf16* q_pe = nullptr;
  const bf16* k_new = nullptr;
  const bf16* v_new = nullptr;

  float sm_scale = 0.f;
  bool return_lse = false;

  // Outputs the backend fills: out with [total_q, H, out_dim] bf16 bytes, lse with [total_q, H]
  // float32 bytes when return_lse (out_dim: head_dim for GQA, 512 for MLA).
  std::string* out = nullptr;
  std::string* lse = nullptr;

  // The pages the appended rows land in, as AppendKey(page, layer); empty when nothing is
  // appended. Validation has checked that no two sequences of the call share one.
  std::vector<int64_t> append_pages;

  bool appends() const { return k_new != nullptr; }
};

// One page of one layer (a page id holds every layer's rows of its tokens).
inline int64_t AppendKey(int32_t page, int layer) {
  return (int64_t{page} << 32) | static_cast<uint32_t>(layer);
}
inline int32_t AppendKeyPage(int64_t key) { return static_cast<int32_t>(key >> 32); }
inline int AppendKeyLayer(int64_t key) { return static_cast<int>(key & 0xffffffff); }

}  // namespace attn
