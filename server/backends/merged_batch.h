// Concatenation of several calls into one CSR batch for a single launch.
#pragma once

#include <cstdint>
#include <cstring>
#include <vector>

#include "absl/types/span.h"
#include "kernels/attention.h"
#include "server/engine/attention_call.h"

namespace attn {

class MergedBatch {
 public:
  // Rebuilds the merged page table from `calls` (reusing this object's capacity).
  void Build(absl::Span<AttentionCall* const> calls);

  int batch_size() const { return static_cast<int>(kv_indptr_.size()) - 1; }
  int total_q() const { return total_q_; }
  // First merged query row of call i.
  int row_begin(size_t i) const { return row_begin_[i]; }

  // Host view of the merged table; qo_indptr is null for decode batches.
  PagedBatch View(Op op) const;

  // The merged arrays, for backends that copy them elsewhere (e.g. to the device).
  const std::vector<int32_t>& qo_indptr() const { return qo_indptr_; }
  const std::vector<int32_t>& kv_indptr() const { return kv_indptr_; }
  const std::vector<int32_t>& kv_indices() const { return kv_indices_; }
  const std::vector<int32_t>& kv_last_page_len() const { return kv_last_page_len_; }
  const std::vector<int32_t>& seq_layer() const { return seq_layer_; }

 private:
  int total_q_ = 0;
  std::vector<int> row_begin_;
  std::vector<int32_t> qo_indptr_, kv_indptr_, kv_indices_, kv_last_page_len_, seq_layer_;
};

// Copies the rows of one per-call input (rows of `row_elems` elements, selected by `field`, e.g.
// &AttentionCall::q) of every call into `dst` at the call's merged row offset.
template <typename T>
void GatherRows(absl::Span<AttentionCall* const> calls, const MergedBatch& merged,
                const bf16* AttentionCall::*field, int64_t row_elems, T* dst) {
  static_assert(sizeof(T) == sizeof(bf16));
  for (size_t i = 0; i < calls.size(); ++i) {
    const int64_t bytes = calls[i]->total_q * row_elems * int64_t{sizeof(bf16)};
    // A call may have no query rows (every sequence with q_len 0); dst is then null, and memcpy
    // of 0 bytes to null is still undefined.
    if (bytes == 0) continue;
    std::memcpy(dst + merged.row_begin(i) * row_elems, calls[i]->*field, bytes);
  }
}

// Copies each call's slice of the merged output (and lse, for calls that asked) into the call.
void ScatterOutputs(absl::Span<AttentionCall* const> calls, const MergedBatch& merged,
                    const void* out, int64_t out_row_bytes, const float* lse, int lse_row_elems);

}  // namespace attn
