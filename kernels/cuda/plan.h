// Host-side work planning for the paged attention kernels: which CTA computes which query rows
// over which key range, and how split-KV partial results are merged. Pure functions, unit-tested
// on the CPU (kernels/cuda/plan_test.cc); the CUDA launchers only execute a plan.
//
// Rows are "packed": for a sequence with q_len query tokens and `group` query heads per KV head
// (GQA: num_qo_heads / num_kv_heads; MLA: all heads), packed row p is query token p / group, head
// p % group of the CTA's KV head. A CTA (one work item, one KV head) takes block_m consecutive
// packed rows of one sequence, so every K/V tile it loads serves all of them.
//
// Split-KV: when the unsplit items cannot fill the GPU, a sequence's keys are cut into chunks of
// chunk_len keys; each (row tile, chunk) becomes its own item writing float32 partial (output,
// lse) rows to a workspace, and a merge pass combines the chunks each query token can see.
// A kernel that merges inside a thread-block cluster (PlanConfig::cluster_splits) instead gets
// every row tile in exactly that many consecutive items, which write the final rows together.
#pragma once

#include <cstdint>
#include <vector>

#include "kernels/attention.h"

namespace attn {

// Most chunks one token's keys are split into (the merge keeps one weight per chunk in shared
// memory).
inline constexpr int kMaxSplits = 4096;

// One work item; the launch runs it once per KV head (kernels/cuda/common/launch.h, ItemHeadGrid).
struct WorkItem {
  int32_t seq;        // sequence index in the batch
  int32_t row_begin;  // first packed row (the tile is [row_begin, row_begin + block_m))
  int32_t kv_begin;   // keys [kv_begin, kv_end) of the sequence
  int32_t kv_end;
  // -1: write the final output. Otherwise the workspace row of (token 0, head 0) of this item's
  // chunk; token i, query head h goes to partial row partial_row + i * num_qo_heads + h.
  int32_t partial_row;
};

// Combines the split-KV partials of one query token (all heads).
struct MergeRow {
  int32_t out_row;       // query row in the batch's q / out
  int32_t partial_row;   // workspace row of chunk 0, head 0 for this token
  int32_t split_stride;  // workspace rows between consecutive chunks (q_len * num_qo_heads)
  int32_t num_splits;    // chunks this token sees (0: the token sees no key)
};

struct PlanConfig {
  int group = 1;         // packed rows per query token
  int num_kv_heads = 1;  // CTAs per item (one per KV head)
  int num_qo_heads = 1;  // heads per query token in q / out
  int block_m = 64;      // packed rows per CTA
  int block_n = 64;      // key tile; chunk lengths are multiples of it
  int cta_slots = 132;   // CTAs the GPU runs at once (SMs * CTAs per SM)
  bool causal = true;
  // Split only when the unsplit plan has fewer than cta_slots * waves_before_split CTAs, and aim
  // for cta_slots * target_waves CTAs when splitting.
  double waves_before_split = 2.0;
  double target_waves = 4.0;
  // Nor when the unsplit plan keeps at least this share of the slots busy until its last CTA ends
  // (CTAs taken longest first by the first free slot, each as long as its keys; 0: off). A
  // memory-bound kernel saturates memory with about one wave of CTAs, so a second, full wave
  // costs it nothing, nor do the few slots a nearly full single wave leaves idle, while a split
  // costs partial outputs and a merge.
  double no_split_fill = 0;
  // The same test, at this lower share, for a launch that fits in one wave (0: no_split_fill's):
  // its CTAs all run from the start, so the idle slots are idle SMs' second slots, or idle SMs,
  // rather than a tail; a memory-bound kernel keeps most of its bandwidth there.
  double no_split_fill_one_wave = 0;
  // For a kernel whose CTAs run one an SM, each bound by its own work (the 64-row MLA decode),
  // a model of the launch's time chooses the split instead of the tests above: the plan of whole
  // sequences, and for n = 2, 3, ... the plan that cuts a sequence's keys into chunks of about
  // max_visible / n (whole key tiles, min_chunk_len at least), each timed as its CTAs run in the
  // plan's order, each on the first free slot and lasting its keys plus cta_start_keys, with a
  // split plan's merge after them: merge_keys plus merge_keys_per_row for each partial row. The
  // fastest wins, and of equals the one with fewer chunks. Times in keys (a CTA's time for one
  // key tile's worth of keys, divided by block_n); cta_start_keys 0: off.
  double cta_start_keys = 0;
  double merge_keys = 0;
  double merge_keys_per_row = 0;
  int min_chunk_len = 256;             // a shorter chunk costs more in merging than it gains
  int64_t max_partial_rows = 1 << 22;  // workspace capacity, in (token, head) rows
  // 0: split sequences are merged by the merge pass. n > 1: the kernel can merge the chunks of a
  // row tile within a cluster of up to n CTAs. A plan that splits its longest tile into k <= n
  // chunks then cuts every row tile into exactly k items (AttentionPlan::cluster_splits:
  // consecutive, chunk s of the tile at index s of its group, whole key tiles of about equal
  // length, the last ones possibly empty), with partial_row -1, no merges and no workspace.
  int cluster_splits = 0;
};

struct AttentionPlan {
  std::vector<WorkItem> items;   // longest first
  std::vector<MergeRow> merges;  // empty when nothing was split
  int chunk_len = 0;             // 0: no split
  int max_splits = 0;            // most chunks any merge row combines
  int64_t partial_rows = 0;      // workspace rows the items write
  int cluster_splits = 0;        // k > 0: the items are row tiles' groups of k chunks (PlanConfig)
};

// Plans a batch of sequences with the given query and key counts (host arrays of batch_size).
AttentionPlan PlanAttention(const PlanConfig& config, const int32_t* q_lens, const int32_t* kv_lens,
                            int batch_size);

}  // namespace attn
