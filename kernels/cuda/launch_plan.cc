#include "kernels/cuda/launch_plan.h"

#include <algorithm>
#include <cstring>
#include <numeric>
#include <tuple>

#include "kernels/cuda/common/cuda_check.h"

namespace attn::cuda {
namespace {

// Appends sections to a buffer at kStagingAlign-aligned offsets.
class Sections {
 public:
  StagingSection Add(size_t bytes) {
    const StagingSection s{size_, bytes};
    size_ = (size_ + bytes + kStagingAlign - 1) / kStagingAlign * kStagingAlign;
    return s;
  }
  size_t size() const { return size_; }

 private:
  size_t size_ = 0;
};

size_t Int32s(int64_t n) { return static_cast<size_t>(n) * sizeof(int32_t); }
size_t Bf16Rows(int64_t rows, int64_t width) { return static_cast<size_t>(rows * width) * 2; }

void Put(char* base, const StagingSection& s, const void* src) {
  if (s.bytes > 0) std::memcpy(base + s.offset, src, s.bytes);
}

template <typename T>
const T* InputAt(const void* base, const StagingSection& s) {
  return reinterpret_cast<const T*>(static_cast<const char*>(base) + s.offset);
}

template <typename T>
T* OutputAt(void* base, const StagingSection& s) {
  return reinterpret_cast<T*>(static_cast<char*>(base) + s.offset);
}

// The params' geometry and scalars; the device pointers are bound later.
template <typename Params, typename Cache>
Params Unbound(const Cache& cache, const LaunchOptions& o) {
  Params p;
  p.cache = cache;
  p.sm_scale = o.sm_scale;
  p.causal = o.causal;
  return p;
}

// Whether every sequence of a prefill batch fits one CTA of `tiling` (at most block_m packed rows).
bool FitsShortPrefill(const PagedBatch& batch, int group, const KernelTiling& tiling) {
  if (batch.qo_indptr == nullptr || tiling.block_m <= 0) return false;
  for (int b = 0; b < batch.batch_size; ++b) {
    const int64_t rows = int64_t{batch.qo_indptr[b + 1] - batch.qo_indptr[b]} * group;
    if (rows > tiling.block_m) return false;
  }
  return true;
}

}  // namespace

RowWidths GqaRowWidths(const GqaCache& cache, int num_qo_heads) {
  RowWidths w;
  w.q = int64_t{num_qo_heads} * cache.head_dim;
  w.k_new = w.v_new = cache.TokenStride();
  w.out = w.q;
  w.lse = num_qo_heads;
  return w;
}

RowWidths MlaRowWidths(int num_heads) {
  RowWidths w;
  w.q = int64_t{num_heads} * kMlaCkvDim;
  w.q_pe = int64_t{num_heads} * kMlaKpeDim;
  w.k_new = kMlaCkvDim;
  w.v_new = kMlaKpeDim;
  w.out = w.q;
  w.lse = num_heads;
  return w;
}

bool LaunchPlan::PlanKey::operator==(const PlanKey& other) const {
  // PlanConfig is shared with device code (C++17: no defaulted comparison); a field added to it
  // must join the tuple.
  static_assert(sizeof(PlanConfig) == 112, "compare PlanConfig's new field here");
  auto fields = [](const PlanKey& k) {
    const PlanConfig& c = k.config;
    return std::tie(k.table_id, k.mla, k.page_size, k.variant, c.group, c.num_kv_heads,
                    c.num_qo_heads, c.block_m, c.block_n, c.cta_slots, c.causal,
                    c.waves_before_split, c.target_waves, c.no_split_fill, c.no_split_fill_one_wave,
                    c.cta_start_keys, c.merge_keys, c.merge_keys_per_row, c.min_chunk_len,
                    c.max_partial_rows, c.cluster_splits, k.output_chunk_bytes);
  };
  return fields(*this) == fields(other);
}

void LaunchPlan::PlanGqa(const GqaCache& cache, int num_qo_heads, const PagedBatch& batch,
                         const LaunchOptions& options) {
  mla_ = false;
  gqa_ = Unbound<GqaParams>(cache, options);
  gqa_.num_qo_heads = num_qo_heads;
  widths_ = GqaRowWidths(cache, num_qo_heads);
  const KernelTiling& tiling =
      FitsShortPrefill(batch, num_qo_heads / cache.num_kv_heads, options.short_prefill)
          ? options.short_prefill
          : options.tiling;
  Plan(batch, cache.page_size, GqaPlanConfig(gqa_, tiling, options.max_partial_rows), tiling,
       options);
}

void LaunchPlan::PlanMla(const MlaCache& cache, int num_heads, const PagedBatch& batch,
                         const LaunchOptions& options) {
  mla_ = true;
  mla_params_ = Unbound<MlaParams>(cache, options);
  mla_params_.num_heads = num_heads;
  widths_ = MlaRowWidths(num_heads);
  Plan(batch, cache.page_size, MlaPlanConfig(mla_params_, options.tiling, options.max_partial_rows),
       options.tiling, options);
}

void LaunchPlan::Plan(const PagedBatch& batch, int page_size, PlanConfig config,
                      const KernelTiling& tiling, const LaunchOptions& options) {
  host_batch_ = batch;
  append_ = options.append;
  lse_ = options.lse;
  call_rows_ = options.call_rows;
  num_calls_ = options.call_rows ? options.num_calls : 0;
  num_sms_ = tiling.num_sms;
  const int n = batch.batch_size;
  if (options.min_chunk_len > 0) config.min_chunk_len = options.min_chunk_len;
  // An override of the split tests plans by them, not by the kernel's cost model.
  if (options.target_waves > 0 || options.waves_before_split > 0 || options.no_split_fill > 0) {
    config.cta_start_keys = 0;
  }
  if (options.target_waves > 0) config.target_waves = options.target_waves;
  if (options.waves_before_split > 0) {
    config.waves_before_split = options.waves_before_split;
    config.no_split_fill = 0;
    config.no_split_fill_one_wave = 0;
  }
  if (options.no_split_fill > 0) {
    config.no_split_fill = options.no_split_fill;
    config.no_split_fill_one_wave = 0;
  }
  const PlanKey key{options.table_id, mla_,   page_size,
                    tiling.variant,   config, options.output_chunk_bytes};
  plan_reused_ = options.table_id != 0 && key == planned_;
  planned_ = key;
  if (!plan_reused_) {
    q_lens_.resize(n);
    kv_lens_.resize(n);
    for (int b = 0; b < n; ++b) {
      const SeqExtent e = GetSeqExtent(batch, page_size, b);
      q_lens_[b] = e.q_len;
      kv_lens_[b] = e.kv_len;
    }
    plan_ = PlanAttention(config, q_lens_.data(), kv_lens_.data(), n);
    ChunkOutputs(batch, config, options.output_chunk_bytes);
  }
  device_plan_ = DevicePlan{};
  device_plan_.variant = tiling.variant;
  device_plan_.cta_slots = tiling.ctas_per_sm * tiling.num_sms;

  const int64_t rows = batch.total_q;
  Sections in;
  inputs_.q = in.Add(Bf16Rows(rows, widths_.q));
  inputs_.q_pe = in.Add(Bf16Rows(rows, widths_.q_pe));
  inputs_.k_new = in.Add(append_ ? Bf16Rows(rows, widths_.k_new) : 0);
  inputs_.v_new = in.Add(append_ ? Bf16Rows(rows, widths_.v_new) : 0);
  inputs_.qo_indptr = in.Add(batch.qo_indptr ? Int32s(n + 1) : 0);
  inputs_.kv_indptr = in.Add(Int32s(n + 1));
  inputs_.kv_indices = in.Add(Int32s(batch.kv_indptr[n]));
  inputs_.kv_last_page_len = in.Add(Int32s(n));
  inputs_.seq_layer = in.Add(batch.seq_layer ? Int32s(n) : 0);
  inputs_.items = in.Add(plan_.items.size() * sizeof(DeviceWorkItem));
  inputs_.schedule = in.Add(2 * sizeof(uint32_t));
  inputs_.merges = in.Add(plan_.merges.size() * sizeof(MergeRow));
  inputs_.call_rows = in.Add(num_calls_ > 0 ? Int32s(num_calls_ + 1) : 0);
  inputs_.bytes = in.size();

  Sections out;
  outputs_.out = out.Add(Bf16Rows(rows, widths_.out));
  outputs_.lse = out.Add(lse_ ? static_cast<size_t>(rows * widths_.lse) * sizeof(float) : 0);
  outputs_.refused = out.Add(static_cast<size_t>(num_calls_) * sizeof(uint32_t));
  outputs_.bytes = out.size();
}

// A chunk boundary inside a sequence must not cut a work item's rows: item tiles start at
// multiples of block_m packed rows, so token offsets that are multiples of block_m / gcd(block_m,
// group) qualify, as does every sequence's first row. Chunks take whole runs of such boundaries,
// each at least 1 / want of the rows, so there are at most `want`.
void LaunchPlan::ChunkOutputs(const PagedBatch& batch, const PlanConfig& config,
                              size_t chunk_bytes) {
  chunks_.clear();
  const int64_t total = batch.total_q;
  const int64_t row_bytes = widths_.out * int64_t{sizeof(bf16)};
  if (chunk_bytes == 0 || batch.qo_indptr == nullptr || !plan_.merges.empty() ||
      plan_.cluster_splits > 0 || total == 0) {
    return;
  }
  const int64_t want =
      std::min<int64_t>(kMaxOutputChunks, total * row_bytes / static_cast<int64_t>(chunk_bytes));
  if (want < 2) return;
  const int64_t target = (total + want - 1) / want;
  const int step = config.block_m / std::gcd(config.block_m, config.group);
  std::vector<int32_t> bounds{0};
  for (int b = 0; b < batch.batch_size; ++b) {
    const int32_t q_begin = batch.qo_indptr[b], q_end = batch.qo_indptr[b + 1];
    for (int64_t row = q_begin; row < q_end; row += step) {
      if (row - bounds.back() >= target) bounds.push_back(static_cast<int32_t>(row));
    }
  }
  if (bounds.size() < 2) return;
  bounds.push_back(static_cast<int32_t>(total));
  const int num_chunks = static_cast<int>(bounds.size()) - 1;
  // The chunk of each item (that of its first row), then the items grouped by chunk, keeping
  // the plan's longest-first order within each.
  auto chunk_of = [&](const WorkItem& w) {
    const int32_t row = batch.qo_indptr[w.seq] + w.row_begin / config.group;
    return static_cast<int>(std::upper_bound(bounds.begin(), bounds.end(), row) - bounds.begin()) -
           1;
  };
  chunks_.resize(num_chunks);
  for (int c = 0; c < num_chunks; ++c) {
    chunks_[c].row_begin = bounds[c];
    chunks_[c].row_end = bounds[c + 1];
  }
  for (const WorkItem& w : plan_.items) ++chunks_[chunk_of(w)].item_end;
  int32_t begin = 0;
  for (OutputChunk& c : chunks_) {
    c.item_begin = begin;
    begin += c.item_end;
    c.item_end = c.item_begin;  // the fill position below; the end once filled
  }
  std::vector<WorkItem> grouped(plan_.items.size());
  for (const WorkItem& w : plan_.items) grouped[chunks_[chunk_of(w)].item_end++] = w;
  plan_.items = std::move(grouped);
}

size_t LaunchPlan::WorkspaceBytes() const {
  return static_cast<size_t>(plan_.partial_rows) * (out_dim() + 1) * sizeof(float);
}

void LaunchPlan::WriteIndices(void* host_inputs, bool per_launch_only) const {
  char* h = static_cast<char*>(host_inputs);
  Put(h, inputs_.seq_layer, host_batch_.seq_layer);
  if (per_launch_only) return;
  Put(h, inputs_.qo_indptr, host_batch_.qo_indptr);
  Put(h, inputs_.kv_indptr, host_batch_.kv_indptr);
  Put(h, inputs_.kv_indices, host_batch_.kv_indices);
  Put(h, inputs_.kv_last_page_len, host_batch_.kv_last_page_len);
  for (size_t i = 0; i < plan_.items.size(); ++i) {
    const WorkItem& w = plan_.items[i];
    DeviceWorkItem item{w, GetSeqExtent(host_batch_, planned_.page_size, w.seq)};
    item.seq.layer = 0;  // read per launch (DeviceWorkItem)
    std::memcpy(h + inputs_.items.offset + i * sizeof(item), &item, sizeof(item));
  }
  std::memset(h + inputs_.schedule.offset, 0, inputs_.schedule.bytes);
  Put(h, inputs_.merges, plan_.merges.data());
  Put(h, inputs_.call_rows, call_rows_);
}

cudaError_t LaunchPlan::Bind(const void* device_inputs, void* device_outputs, void* workspace,
                             size_t workspace_bytes) {
  if (workspace_bytes < WorkspaceBytes()) return cudaErrorInvalidValue;
  const void* d = device_inputs;
  PagedBatch batch = host_batch_;
  batch.qo_indptr = batch.qo_indptr ? InputAt<int32_t>(d, inputs_.qo_indptr) : nullptr;
  batch.kv_indptr = InputAt<int32_t>(d, inputs_.kv_indptr);
  batch.kv_indices = InputAt<int32_t>(d, inputs_.kv_indices);
  batch.kv_last_page_len = InputAt<int32_t>(d, inputs_.kv_last_page_len);
  batch.seq_layer = batch.seq_layer ? InputAt<int32_t>(d, inputs_.seq_layer) : nullptr;

  const bf16* q = InputAt<bf16>(d, inputs_.q);
  const bf16* k_new = append_ ? InputAt<bf16>(d, inputs_.k_new) : nullptr;
  const bf16* v_new = append_ ? InputAt<bf16>(d, inputs_.v_new) : nullptr;
  bf16* out = OutputAt<bf16>(device_outputs, outputs_.out);
  float* lse = lse_ ? OutputAt<float>(device_outputs, outputs_.lse) : nullptr;
  if (mla_) {
    MlaParams& p = mla_params_;
    p.batch = batch;
    p.q_nope = q;
    p.q_pe = InputAt<bf16>(d, inputs_.q_pe);
    p.ckv_new = k_new;
    p.kpe_new = v_new;
    p.out = out;
    p.lse = lse;
  } else {
    GqaParams& p = gqa_;
    p.batch = batch;
    p.q = q;
    p.k_new = k_new;
    p.v_new = v_new;
    p.out = out;
    p.lse = lse;
  }

  device_plan_.items = InputAt<DeviceWorkItem>(d, inputs_.items);
  device_plan_.num_items = static_cast<int>(plan_.items.size());
  device_plan_.merges = InputAt<MergeRow>(d, inputs_.merges);
  device_plan_.num_merges = static_cast<int>(plan_.merges.size());
  device_plan_.max_splits = plan_.max_splits;
  device_plan_.cluster_splits = plan_.cluster_splits;
  // The only input the kernels write (DevicePlan::schedule): they leave it as they found it.
  device_plan_.schedule = const_cast<uint32_t*>(InputAt<uint32_t>(d, inputs_.schedule));
  device_plan_.partial_out = static_cast<float*>(workspace);
  device_plan_.partial_lse = device_plan_.partial_out + plan_.partial_rows * out_dim();

  checks_ = CallChecks{};
  if (num_calls_ > 0) {
    checks_.rows = InputAt<int32_t>(d, inputs_.call_rows);
    checks_.refused = OutputAt<uint32_t>(device_outputs, outputs_.refused);
    checks_.num_calls = num_calls_;
  }
  return cudaSuccess;
}

void LaunchPlan::WriteOutputsTo(void* out, void* lse) {
  bf16*& out_ptr = mla_ ? mla_params_.out : gqa_.out;
  float*& lse_ptr = mla_ ? mla_params_.lse : gqa_.lse;
  if (out != nullptr) out_ptr = static_cast<bf16*>(out);
  if (lse != nullptr && lse_) lse_ptr = static_cast<float*>(lse);
}

cudaError_t LaunchPlan::EnqueueCheck(cudaStream_t stream) const {
  if (checks_.num_calls == 0) return cudaSuccess;
  ATTN_CUDA_RETURN_IF_ERROR(cudaMemsetAsync(checks_.refused, 0, outputs_.refused.bytes, stream));
  const int64_t rows = host_batch_.total_q;
  CheckedInput in[4];
  if (mla_) {
    const MlaParams& p = mla_params_;
    in[0] = {p.q_nope, rows, widths_.q, kFiniteQ};
    in[1] = {p.q_pe, rows, widths_.q_pe, kFiniteQPe};
    in[2] = {p.ckv_new, rows, widths_.k_new, kFiniteKNew};
    in[3] = {p.kpe_new, rows, widths_.v_new, kFiniteVNew};
  } else {
    in[0] = {gqa_.q, rows, widths_.q, kFiniteQ};
    in[1] = {gqa_.k_new, rows, widths_.k_new, kFiniteKNew};
    in[2] = {gqa_.v_new, rows, widths_.v_new, kFiniteVNew};
  }
  return CheckFinite(in, mla_ ? 4 : 3, checks_, num_sms_, stream);
}

cudaError_t LaunchPlan::EnqueueAppend(cudaStream_t stream) const {
  return mla_ ? MlaAppendKv(mla_params_, checks_, stream) : GqaAppendKv(gqa_, checks_, stream);
}

cudaError_t LaunchPlan::EnqueueAttention(cudaStream_t stream) const {
  return mla_ ? MlaAttention(mla_params_, device_plan_, stream)
              : GqaAttention(gqa_, device_plan_, stream);
}

cudaError_t LaunchPlan::EnqueueAttentionChunk(cudaStream_t stream, int chunk) const {
  if (chunk < 0 || chunk >= static_cast<int>(chunks_.size())) return cudaErrorInvalidValue;
  DevicePlan part = device_plan_;
  part.items += chunks_[chunk].item_begin;
  part.num_items = chunks_[chunk].item_end - chunks_[chunk].item_begin;
  part.num_merges = 0;  // chunked launches split nothing
  return mla_ ? MlaAttention(mla_params_, part, stream) : GqaAttention(gqa_, part, stream);
}

cudaError_t LaunchPlan::Enqueue(cudaStream_t stream) const {
  ATTN_CUDA_RETURN_IF_ERROR(EnqueueCheck(stream));
  ATTN_CUDA_RETURN_IF_ERROR(EnqueueAppend(stream));
  return EnqueueAttention(stream);
}

}  // namespace attn::cuda
