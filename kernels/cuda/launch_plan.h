// One launch of the CUDA attention kernels, from the host's description of a batch to the device
// pointers the kernels read: the single binding that the CUDA backend and the kernel tests and
// benchmark share (the idea of FlashInfer's plan info, here with the inputs in the same buffer).
//
// Everything a launch reads besides the pool's cache and the split-KV workspace travels in one
// staging buffer, laid out by the plan at kStagingAlign-aligned offsets, with one host-to-device
// copy; everything it writes comes back from one output buffer:
//
//   inputs:  q | q_pe (MLA) | k_new | v_new (appends) | qo_indptr (prefill) | kv_indptr |
//            kv_indices | kv_last_page_len | seq_layer (when given) | work items | schedule |
//            merge rows | call rows (when checked)
//   outputs: out | lse (when asked) | refused calls (when checked)
//
// Per launch (one LaunchPlan per stream, reused: its vectors keep their capacity):
//   plan.PlanGqa(cache, num_qo_heads, host_batch, options);  // lengths, plan, layout (host)
//   // write each tensor's rows at inputs().q.offset, ... of a host buffer of inputs().bytes
//   plan.WriteIndices(host_inputs);                          // page table, items, merges
//   // copy the inputs().bytes of host_inputs to device_inputs
//   plan.Bind(device_inputs, device_outputs, workspace, workspace_bytes);
//   plan.Enqueue(stream);                         // finiteness check, append, attention, merge
//   // copy the outputs().bytes back: out at outputs().out.offset, lse at outputs().lse.offset
//
// Not thread-safe: one object per lane (or test batch).
#pragma once

#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>
#include <vector>

#include "kernels/attention.h"
#include "kernels/cuda/api.h"
#include "kernels/cuda/plan.h"

namespace attn::cuda {

// Offsets of the staging sections (bytes; device buffers from cudaMalloc are at least this
// aligned, so every section is aligned for 16-byte vector access on both sides).
inline constexpr size_t kStagingAlign = 256;

// One section of a staging buffer. bytes == 0: the section is empty (or absent; absent optional
// tensors are bound as nullptr).
struct StagingSection {
  size_t offset = 0;
  size_t bytes = 0;

  bool operator==(const StagingSection&) const = default;
};

struct InputLayout {
  StagingSection q;                 // bf16 [total_q, RowWidths::q]
  StagingSection q_pe;              // bf16 [total_q, RowWidths::q_pe] (MLA)
  StagingSection k_new;             // bf16 [total_q, RowWidths::k_new] (appends)
  StagingSection v_new;             // bf16 [total_q, RowWidths::v_new] (appends)
  StagingSection qo_indptr;         // int32 [batch_size + 1] (prefill)
  StagingSection kv_indptr;         // int32 [batch_size + 1]
  StagingSection kv_indices;        // int32 [kv_indptr[batch_size]]
  StagingSection kv_last_page_len;  // int32 [batch_size] (a trailing extra entry is dropped)
  StagingSection seq_layer;         // int32 [batch_size] (when the batch has one)
  StagingSection items;             // DeviceWorkItem [plan().items.size()]
  StagingSection schedule;          // uint32 [2], written as 0: DevicePlan::schedule
  StagingSection merges;            // MergeRow [plan().merges.size()]
  StagingSection call_rows;         // int32 [num_calls + 1] (LaunchOptions::call_rows)
  size_t bytes = 0;                 // the whole buffer

  bool operator==(const InputLayout&) const = default;
};

struct OutputLayout {
  StagingSection out;  // bf16 [total_q, RowWidths::out]
  StagingSection lse;  // float [total_q, RowWidths::lse] (when asked)
  // uint32 [num_calls]: CallChecks::refused, kFinite* bits of call c's inputs that hold a NaN
  // or Inf (when LaunchOptions::call_rows is given).
  StagingSection refused;
  size_t bytes = 0;
};

// Elements per query row of a launch's tensors (the pool's row shapes).
struct RowWidths {
  int64_t q = 0;      // GQA: num_qo_heads * head_dim; MLA: q_nope, num_heads * kMlaCkvDim
  int64_t q_pe = 0;   // MLA: num_heads * kMlaKpeDim; GQA: 0
  int64_t k_new = 0;  // GQA: num_kv_heads * head_dim; MLA: ckv, kMlaCkvDim
  int64_t v_new = 0;  // GQA: as k_new; MLA: kpe, kMlaKpeDim
  int64_t out = 0;    // num_qo_heads * out_dim (head_dim; MLA kMlaCkvDim)
  int64_t lse = 0;    // num_qo_heads (floats)
};

RowWidths GqaRowWidths(const GqaCache& cache, int num_qo_heads);
RowWidths MlaRowWidths(int num_heads);

struct LaunchOptions {
  bool append = false;  // new K/V (ckv/kpe) rows are staged and written into the cache first
  bool lse = false;     // the launch writes lse
  float sm_scale = 0.f;
  bool causal = true;
  KernelTiling tiling;  // of the kernel that serves the launch (GetGqaTiling / GetMlaTiling)
  // GQA prefill: when set (GetGqaShortPrefillTiling; block_m > 0), a launch whose sequences each
  // have at most short_prefill.block_m packed rows (q_len x group) runs on it instead of `tiling`.
  KernelTiling short_prefill;
  // The split-KV workspace's capacity, in (token, head) rows (WorkspaceBytes() <= capacity *
  // (out_dim + 1) * 4 bytes).
  int64_t max_partial_rows = 0;
  // Planner settings to override (benchmarks sweep them); 0 keeps the kernel's own. Any of the
  // last three plans by the split tests, not by a kernel's cost model (KernelTiling's
  // cta_start_keys).
  int min_chunk_len = 0;
  double target_waves = 0;
  // Splits keys whenever the unsplit plan has fewer CTAs than this many waves (and ignores the
  // kernel's fill test).
  double waves_before_split = 0;
  // Keeps a plan unsplit that fills at least this share of the CTA slots
  // (PlanConfig::no_split_fill, one wave or more alike), instead of the kernel's own tests or
  // waves_before_split's none.
  double no_split_fill = 0;
  // When given, the launch checks its inputs for NaN and Inf call by call (CallChecks): query
  // rows [call_rows[c], call_rows[c + 1]) are call c's, and a call with a non-finite input has
  // nothing appended and its kFinite* bits in outputs().refused. Host memory, read by Plan* and
  // WriteIndices.
  const int32_t* call_rows = nullptr;  // [num_calls + 1]
  int num_calls = 0;
  // Prefill: when the launch's output rows hold at least twice this many bytes and nothing is
  // split, they are cut into up to kMaxOutputChunks chunks of at least this many bytes, each
  // computed by a launch of its own (output_chunks()), so a caller can copy a chunk's rows out
  // while the next is computed. 0: one launch.
  size_t output_chunk_bytes = 0;
  // Nonzero: an id of the batch's page table (its qo_indptr, kv_* arrays and call rows) that no
  // other table ever has. A launch with the id of the last one planned, on the same pool and
  // tiling, keeps that launch's plan (plan_reused()) instead of planning again.
  uint64_t table_id = 0;
};

// Most chunks a launch's outputs are cut into (LaunchOptions::output_chunk_bytes).
inline constexpr int kMaxOutputChunks = 8;

// Query rows [row_begin, row_end) of a launch, written by its work items [item_begin, item_end)
// and by no other.
struct OutputChunk {
  int32_t row_begin = 0;
  int32_t row_end = 0;
  int32_t item_begin = 0;
  int32_t item_end = 0;

  bool operator==(const OutputChunk&) const = default;
};

class LaunchPlan {
 public:
  // Plans a GQA launch of `batch` over `cache`: cache.data is the pool's device storage; the
  // batch's arrays are host memory, validated (kernels/attention.h), and are read here and by
  // WriteIndices, so they must stay valid until then. Decode when batch.qo_indptr is null.
  void PlanGqa(const GqaCache& cache, int num_qo_heads, const PagedBatch& batch,
               const LaunchOptions& options);
  // The same for MLA (`num_heads` query heads).
  void PlanMla(const MlaCache& cache, int num_heads, const PagedBatch& batch,
               const LaunchOptions& options);

  const InputLayout& inputs() const { return inputs_; }
  const OutputLayout& outputs() const { return outputs_; }
  const RowWidths& widths() const { return widths_; }
  const AttentionPlan& plan() const { return plan_; }
  // Split-KV workspace bytes this launch uses: partial outputs, then their lse.
  size_t WorkspaceBytes() const;

  // Copies the page table, the work items and the merge rows into their sections of
  // `host_inputs` (inputs().bytes); the caller writes the tensors' sections. `per_launch_only`:
  // just the sections that differ between launches over one table (seq_layer), for a caller that
  // still holds the last launch's device copy of the others, same layout (plan_reused()).
  void WriteIndices(void* host_inputs, bool per_launch_only = false) const;
  // True when this launch kept the last one's plan (LaunchOptions::table_id): its page table,
  // work items, merge rows and call rows are those of the last launch.
  bool plan_reused() const { return plan_reused_; }

  // Points the launch's params and device plan into `device_inputs` (holding the staged inputs
  // once the copy has run), `device_outputs` (outputs().bytes) and `workspace`.
  // cudaErrorInvalidValue when the workspace is smaller than WorkspaceBytes().
  cudaError_t Bind(const void* device_inputs, void* device_outputs, void* workspace,
                   size_t workspace_bytes);
  // After Bind: the kernels write the output rows to `out` and the lse to `lse` (each when not
  // null; the lse only when the launch writes it), device-accessible memory laid out as those
  // sections, instead of the output buffer, whose refused-calls section stays in use. For a
  // caller that hands the kernels its destination: page-locked host memory mapped for the device.
  void WriteOutputsTo(void* out, void* lse);

  // Enqueued on `stream` after Bind: the append (when the launch appends), then attention and the
  // split-KV merge. The attention alone is what a benchmark times once the cache holds the rows.
  cudaError_t Enqueue(cudaStream_t stream) const;
  cudaError_t EnqueueCheck(cudaStream_t stream) const;  // a no-op without call_rows
  cudaError_t EnqueueAppend(cudaStream_t stream) const;
  cudaError_t EnqueueAttention(cudaStream_t stream) const;
  // The chunks of the launch's outputs, in row order (LaunchOptions::output_chunk_bytes); empty
  // when they are not cut. Their items are the plan's, grouped by chunk, longest first in each.
  const std::vector<OutputChunk>& output_chunks() const { return chunks_; }
  // The attention of output_chunks()[chunk] alone: enqueued for every chunk, in any order, they
  // do what EnqueueAttention does (a chunked launch has no split-KV merge).
  cudaError_t EnqueueAttentionChunk(cudaStream_t stream, int chunk) const;

  bool mla() const { return mla_; }
  // Valid after Bind: the kernels' view of the launch.
  const GqaParams& gqa_params() const { return gqa_; }
  const MlaParams& mla_params() const { return mla_params_; }
  const DevicePlan& device_plan() const { return device_plan_; }
  const CallChecks& checks() const { return checks_; }

 private:
  void Plan(const PagedBatch& batch, int page_size, PlanConfig config, const KernelTiling& tiling,
            const LaunchOptions& options);
  // Cuts the planned prefill's output rows into chunks (LaunchOptions::output_chunk_bytes) and
  // groups plan_.items by chunk.
  void ChunkOutputs(const PagedBatch& batch, const PlanConfig& config, size_t chunk_bytes);
  int out_dim() const { return mla_ ? kMlaCkvDim : gqa_.cache.head_dim; }

  bool mla_ = false;
  // What the last plan was made from (LaunchOptions::table_id).
  struct PlanKey {
    uint64_t table_id = 0;
    bool mla = false;
    int page_size = 0;
    int variant = -1;
    PlanConfig config;
    size_t output_chunk_bytes = 0;
    bool operator==(const PlanKey& other) const;
  };
  PlanKey planned_;
  bool plan_reused_ = false;
  bool append_ = false;
  bool lse_ = false;
  const int32_t* call_rows_ = nullptr;  // LaunchOptions::call_rows, until WriteIndices
  int num_calls_ = 0;
  int num_sms_ = 0;        // the serving tiling's, for the check's grid
  PagedBatch host_batch_;  // the caller's host arrays, until WriteIndices
  RowWidths widths_;
  InputLayout inputs_;
  OutputLayout outputs_;
  AttentionPlan plan_;
  std::vector<OutputChunk> chunks_;
  std::vector<int32_t> q_lens_, kv_lens_;
  // Geometry and scalars from Plan*; device pointers from Bind.
  GqaParams gqa_;
  MlaParams mla_params_;
  DevicePlan device_plan_;
  CallChecks checks_;
};

}  // namespace attn::cuda
