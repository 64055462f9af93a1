#include "server/backends/merged_batch.h"

namespace attn {

void MergedBatch::Build(absl::Span<AttentionCall* const> calls) {
  qo_indptr_.assign(1, 0);
  kv_indptr_.assign(1, 0);
  kv_indices_.clear();
  kv_last_page_len_.clear();
  seq_layer_.clear();
  row_begin_.clear();
  total_q_ = 0;
  for (const AttentionCall* c : calls) {
    row_begin_.push_back(total_q_);
    const int32_t page_base = kv_indptr_.back();
    for (int b = 0; b < c->batch_size; ++b) {
      const int32_t q_end = c->qo_indptr.empty() ? b + 1 : c->qo_indptr[b + 1];
      qo_indptr_.push_back(total_q_ + q_end);
      kv_indptr_.push_back(page_base + c->kv_indptr[b + 1]);
      seq_layer_.push_back(c->layer);
    }
    kv_indices_.insert(kv_indices_.end(), c->kv_indices.begin(), c->kv_indices.end());
    kv_last_page_len_.insert(kv_last_page_len_.end(), c->kv_last_page_len.begin(),
                             c->kv_last_page_len.end());
    total_q_ += c->total_q;
  }
}

PagedBatch MergedBatch::View(Op op) const {
  PagedBatch b;
  b.batch_size = batch_size();
  b.total_q = total_q_;
  b.qo_indptr = op == Op::kPrefill ? qo_indptr_.data() : nullptr;
  b.kv_indptr = kv_indptr_.data();
  b.kv_indices = kv_indices_.data();
  b.kv_last_page_len = kv_last_page_len_.data();
  b.seq_layer = seq_layer_.data();
  return b;
}

void ScatterOutputs(absl::Span<AttentionCall* const> calls, const MergedBatch& merged,
                    const void* out, int64_t out_row_bytes, const float* lse, int lse_row_elems) {
  const auto* out_bytes = static_cast<const char*>(out);
  for (size_t i = 0; i < calls.size(); ++i) {
    AttentionCall& c = *calls[i];
    const int64_t row = merged.row_begin(i);
    c.out->assign(out_bytes + row * out_row_bytes, c.total_q * out_row_bytes);
    if (c.return_lse) {
      c.lse->assign(reinterpret_cast<const char*>(lse + row * lse_row_elems),
                    c.total_q * lse_row_elems * sizeof(float));
    }
  }
}

}  // namespace attn
