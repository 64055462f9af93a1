#include "server/backends/merged_batch.h"

#include <algorithm>

namespace attn {

void MergedBatch::Build(absl::Span<AttentionCall* const> calls) {
  qo_indptr_.assign(1, 0);
  kv_indptr_.assign(1, 0);
  kv_indices_.clear();
  kv_last_page_len_.clear();
  seq_layer_.clear();
  call_rows_.assign(1, 0);
  total_q_ = 0;
  for (const AttentionCall* c : calls) {
    const int32_t page_base = kv_indptr_.back();
    for (int b = 0; b < c->batch_size; ++b) {
      const int32_t q_end = c->qo_indptr.empty() ? b + 1 : c->qo_indptr[b + 1];
      qo_indptr_.push_back(total_q_ + q_end);
      kv_indptr_.push_back(page_base + c->kv_indptr[b + 1]);
      seq_layer_.push_back(c->layer);
    }
    if (calls.size() > 1) {
      kv_indices_.insert(kv_indices_.end(), c->kv_indices.begin(), c->kv_indices.end());
    }
    kv_last_page_len_.insert(kv_last_page_len_.end(), c->kv_last_page_len.begin(),
                             c->kv_last_page_len.end());
    total_q_ += c->total_q;
    call_rows_.push_back(total_q_);
  }
  indices_ = calls.size() == 1 ? calls.front()->kv_indices.data() : kv_indices_.data();
}

PagedBatch MergedBatch::View(Op op) const {
  PagedBatch b;
  b.batch_size = batch_size();
  b.total_q = total_q_;
  b.qo_indptr = op == Op::kPrefill ? qo_indptr_.data() : nullptr;
  b.kv_indptr = kv_indptr_.data();
  b.kv_indices = indices_;
  b.kv_last_page_len = kv_last_page_len_.data();
  b.seq_layer = seq_layer_.data();
  return b;
}

void HostRun::CopyRange(char* dst, size_t lo, size_t hi) const {
  // The first part that ends after lo (parts are in offset order).
  auto it = std::upper_bound(parts_.begin(), parts_.end(), lo, [](size_t at, const Part& p) {
    return at < p.offset + p.bytes->size();
  });
  for (; it != parts_.end() && it->offset < hi; ++it) {
    const size_t from = std::max(lo, it->offset);
    const size_t to = std::min(hi, it->offset + it->bytes->size());
    if (to > from) it->bytes->CopyTo(dst + from, from - it->offset, to - from);
  }
}

void CopyRun(const HostRun& run, char* dst, size_t lo, size_t hi, int threads,
             const ParallelFor& parallel_for) {
  if (hi <= lo) return;
  const size_t bytes = hi - lo;
  const int64_t pieces =
      parallel_for ? std::min<int64_t>(std::max(threads, 1), bytes / kParallelCopyMinBytes) : 1;
  if (pieces <= 1) return run.CopyRange(dst, lo, hi);
  // Pieces of whole cache lines, the last one taking the remainder.
  const size_t step = (bytes / pieces + 63) / 64 * 64;
  parallel_for(pieces, [&](int64_t i) {
    const size_t from = lo + static_cast<size_t>(i) * step;
    run.CopyRange(dst, std::min(from, hi), i + 1 == pieces ? hi : std::min(from + step, hi));
  });
}

void GatherRows(absl::Span<AttentionCall* const> calls, const MergedBatch& merged,
                CallInput AttentionCall::*field, int64_t row_bytes, char* dst, int threads,
                const ParallelFor& parallel_for) {
  HostRun run;
  for (size_t i = 0; i < calls.size(); ++i) {
    const CallInput& in = calls[i]->*field;
    // A call may have no query rows (every sequence with q_len 0): nothing to copy.
    if (in.bytes == 0) continue;
    const size_t at = static_cast<size_t>(merged.row_begin(i) * row_bytes);
    // The calls' rows are adjacent; a gap (none today) only starts a run of its own.
    if (!run.empty() && run.end() != at) {
      CopyRun(run, dst, run.begin(), run.end(), threads, parallel_for);
      run.Clear();
    }
    run.Add(at, &in.host);
  }
  CopyRun(run, dst, run.begin(), run.end(), threads, parallel_for);
}

namespace {

// Rows [row, row + rows) of `rows_base` for one output of a call.
void Deliver(CallOutput& out, const std::shared_ptr<char>& buffer, const char* rows_base,
             int64_t row, int64_t rows, int64_t row_bytes) {
  const char* begin = rows_base + row * row_bytes;
  const size_t bytes = static_cast<size_t>(rows * row_bytes);
  if (out.host != nullptr) {
    if (bytes > 0) std::memcpy(out.host, begin, bytes);
  } else {
    out.result = SharedBytes{buffer, begin, bytes};
  }
}

}  // namespace

void ScatterOutputs(absl::Span<AttentionCall* const> calls, const MergedBatch& merged,
                    const std::shared_ptr<char>& buffer, const char* out, int64_t out_row_bytes,
                    const char* lse, int64_t lse_row_bytes) {
  for (size_t i = 0; i < calls.size(); ++i) {
    AttentionCall& c = *calls[i];
    const int64_t row = merged.row_begin(i);
    Deliver(c.out, buffer, out, row, c.total_q, out_row_bytes);
    if (c.return_lse) Deliver(c.lse, buffer, lse, row, c.total_q, lse_row_bytes);
  }
}

}  // namespace attn
