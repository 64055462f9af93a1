// Concatenation of several calls into one CSR batch for a single launch.
#pragma once

#include <cstdint>
#include <cstring>
#include <memory>
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
  int row_begin(size_t i) const { return call_rows_[i]; }
  // [calls + 1]: call i's merged query rows are [call_rows()[i], call_rows()[i + 1]).
  const std::vector<int32_t>& call_rows() const { return call_rows_; }

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
  std::vector<int32_t> call_rows_;
  std::vector<int32_t> qo_indptr_, kv_indptr_, kv_indices_, kv_last_page_len_, seq_layer_;
};

// Copies one per-call host input (rows of `row_bytes`, selected by `field`, e.g.
// &AttentionCall::q) of every call into `dst` at the call's merged row offset. The inputs must be
// in host memory.
void GatherRows(absl::Span<AttentionCall* const> calls, const MergedBatch& merged,
                CallInput AttentionCall::*field, int64_t row_bytes, char* dst);

// Hands each call its rows of the launch's outputs: `out` rows of `out_row_bytes` and `lse` rows
// of `lse_row_bytes` (for calls that asked), both in `buffer`. A call with output regions in host
// memory gets its rows copied there; the others get SharedBytes pointing into `buffer`.
void ScatterOutputs(absl::Span<AttentionCall* const> calls, const MergedBatch& merged,
                    const std::shared_ptr<char>& buffer, const char* out, int64_t out_row_bytes,
                    const char* lse, int64_t lse_row_bytes);

}  // namespace attn
