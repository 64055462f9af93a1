// Concatenation of several calls into one CSR batch for a single launch.
#pragma once

#include <cstdint>
#include <cstring>
#include <functional>
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

 private:
  int total_q_ = 0;
  std::vector<int32_t> call_rows_;
  std::vector<int32_t> qo_indptr_, kv_indptr_, kv_indices_, kv_last_page_len_, seq_layer_;
  // The merged kv_indices: a lone call's own (not copied: the largest array, a page id per page
  // of every sequence, read once more where the launch stages it), or kv_indices_.
  const int32_t* indices_ = nullptr;
};

// Runs fn(i) for every i in [0, n), possibly on several threads at once, and returns when all
// have returned (cpu::ThreadPool::ParallelFor's contract).
using ParallelFor = std::function<void(int64_t n, const std::function<void(int64_t)>& fn)>;

// Host bytes bound for one contiguous range of a buffer, added in order of their offsets. Any
// part of the range can be copied on its own, so a large gather can be split over threads and
// into chunks that a device copy follows chunk by chunk. Holds pointers to the HostBytes: they
// must outlive the run's use.
class HostRun {
 public:
  void Clear() { parts_.clear(); }
  // `bytes` go to [offset, offset + bytes->size()) of the buffer; offset == end() unless empty().
  void Add(size_t offset, const HostBytes* bytes) { parts_.push_back({offset, bytes}); }
  bool empty() const { return parts_.empty(); }
  size_t begin() const { return parts_.empty() ? 0 : parts_.front().offset; }
  size_t end() const {
    return parts_.empty() ? 0 : parts_.back().offset + parts_.back().bytes->size();
  }
  // Copies the run's bytes that fall in [lo, hi) of the buffer to dst + lo (dst: the buffer).
  void CopyRange(char* dst, size_t lo, size_t hi) const;

 private:
  struct Part {
    size_t offset;
    const HostBytes* bytes;
  };
  std::vector<Part> parts_;
};

// Below this many bytes per thread, waking another thread costs more than it saves: a copy of
// 1 MiB takes 100-200 us at the 5-10 GB/s one core copies cold memory, a wake-up some tens of
// us (bench/RESULTS.md, "Gathering inputs on several threads").
inline constexpr size_t kParallelCopyMinBytes = size_t{1} << 20;

// Copies [lo, hi) of `run` to dst + lo: in up to `threads` pieces of at least
// kParallelCopyMinBytes each through `parallel_for`, or on the calling thread alone when the
// range is too small to split (or parallel_for is empty).
void CopyRun(const HostRun& run, char* dst, size_t lo, size_t hi, int threads,
             const ParallelFor& parallel_for);

// Copies one per-call host input (rows of `row_bytes`, selected by `field`, e.g.
// &AttentionCall::q) of every call into `dst` at the call's merged row offset, on up to
// `threads` threads of `parallel_for` when it is large (CopyRun). The inputs must be in host
// memory.
void GatherRows(absl::Span<AttentionCall* const> calls, const MergedBatch& merged,
                CallInput AttentionCall::*field, int64_t row_bytes, char* dst, int threads = 1,
                const ParallelFor& parallel_for = {});

// Hands each call its rows of the launch's outputs: `out` rows of `out_row_bytes` and `lse` rows
// of `lse_row_bytes` (for calls that asked), both in `buffer`. A call with output regions in host
// memory gets its rows copied there; the others get SharedBytes pointing into `buffer`.
void ScatterOutputs(absl::Span<AttentionCall* const> calls, const MergedBatch& merged,
                    const std::shared_ptr<char>& buffer, const char* out, int64_t out_row_bytes,
                    const char* lse, int64_t lse_row_bytes);

}  // namespace attn
