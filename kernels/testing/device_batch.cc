#include "kernels/testing/device_batch.h"

#include "kernels/cuda/common/cuda_check.h"

namespace attn::testing {

DeviceBuffer::~DeviceBuffer() {
  if (ptr_ != nullptr) cudaFree(ptr_);
}

cudaError_t DeviceBuffer::Allocate(size_t bytes) {
  if (ptr_ != nullptr) cudaFree(ptr_);
  ptr_ = nullptr;
  bytes_ = bytes;
  return bytes == 0 ? cudaSuccess : cudaMalloc(&ptr_, bytes);
}

bool CudaDeviceAvailable() {
  int count = 0;
  return cudaGetDeviceCount(&count) == cudaSuccess && count > 0;
}

cudaError_t DeviceBatch::UploadTable(const HostPageTable& t) {
  ATTN_CUDA_RETURN_IF_ERROR(qo_indptr_.Upload(t.qo_indptr));
  ATTN_CUDA_RETURN_IF_ERROR(kv_indptr_.Upload(t.kv_indptr));
  ATTN_CUDA_RETURN_IF_ERROR(kv_indices_.Upload(t.kv_indices));
  ATTN_CUDA_RETURN_IF_ERROR(kv_last_page_len_.Upload(t.kv_last_page_len));
  ATTN_CUDA_RETURN_IF_ERROR(seq_layer_.Upload(t.seq_layer));
  return cudaSuccess;
}

// Device view of the table: the host view's layout with the device copies' pointers.
static PagedBatch DeviceView(const HostPageTable& t, const DeviceBuffer& qo, const DeviceBuffer& kv,
                             const DeviceBuffer& idx, const DeviceBuffer& last,
                             const DeviceBuffer& layer) {
  PagedBatch b = t.View();
  b.qo_indptr = b.qo_indptr ? qo.get<int32_t>() : nullptr;
  b.kv_indptr = kv.get<int32_t>();
  b.kv_indices = idx.get<int32_t>();
  b.kv_last_page_len = last.get<int32_t>();
  b.seq_layer = b.seq_layer ? layer.get<int32_t>() : nullptr;
  return b;
}

cudaError_t DeviceBatch::UploadPlan(PlanConfig config, const PlanOverrides& overrides,
                                    const HostPageTable& t) {
  if (overrides.min_chunk_len > 0) config.min_chunk_len = overrides.min_chunk_len;
  if (overrides.target_waves > 0) config.target_waves = overrides.target_waves;
  std::vector<int32_t> q_lens, kv_lens;
  for (const SeqSpec& s : t.seqs) {
    q_lens.push_back(t.decode ? 1 : s.q_len);
    kv_lens.push_back(s.kv_len);
  }
  plan_ = PlanAttention(config, q_lens.data(), kv_lens.data(), static_cast<int>(q_lens.size()));
  ATTN_CUDA_RETURN_IF_ERROR(items_.Upload(plan_.items));
  ATTN_CUDA_RETURN_IF_ERROR(merges_.Upload(plan_.merges));
  const int out_dim = mla_ ? kMlaCkvDim : gqa_.cache.head_dim;
  ATTN_CUDA_RETURN_IF_ERROR(partial_out_.Allocate(plan_.partial_rows * out_dim * sizeof(float)));
  ATTN_CUDA_RETURN_IF_ERROR(partial_lse_.Allocate(plan_.partial_rows * sizeof(float)));
  device_plan_.items = items_.get<WorkItem>();
  device_plan_.num_items = static_cast<int>(plan_.items.size());
  device_plan_.merges = merges_.get<MergeRow>();
  device_plan_.num_merges = static_cast<int>(plan_.merges.size());
  device_plan_.max_splits = plan_.max_splits;
  device_plan_.partial_out = partial_out_.get<float>();
  device_plan_.partial_lse = partial_lse_.get<float>();
  return cudaSuccess;
}

cudaError_t DeviceBatch::Create(GqaHostBatch& host, std::unique_ptr<DeviceBatch>* out, int variant,
                                PlanOverrides overrides) {
  std::unique_ptr<DeviceBatch> d(new DeviceBatch());
  ATTN_CUDA_RETURN_IF_ERROR(d->cache_.Upload(host.cache));
  ATTN_CUDA_RETURN_IF_ERROR(d->q_.Upload(host.q));
  ATTN_CUDA_RETURN_IF_ERROR(d->k_new_.Upload(host.k_new));
  ATTN_CUDA_RETURN_IF_ERROR(d->v_new_.Upload(host.v_new));
  ATTN_CUDA_RETURN_IF_ERROR(d->out_.Allocate(host.out.size() * sizeof(bf16)));
  ATTN_CUDA_RETURN_IF_ERROR(d->lse_.Allocate(host.lse.size() * sizeof(float)));
  ATTN_CUDA_RETURN_IF_ERROR(d->UploadTable(host.table));

  GqaParams& p = d->gqa_;
  p = host.Params();  // geometry and scalars; the pointers are replaced below
  p.cache.data = d->cache_.get<bf16>();
  p.batch = DeviceView(host.table, d->qo_indptr_, d->kv_indptr_, d->kv_indices_,
                       d->kv_last_page_len_, d->seq_layer_);
  p.q = d->q_.get<bf16>();
  p.k_new = host.k_new.empty() ? nullptr : d->k_new_.get<bf16>();
  p.v_new = host.v_new.empty() ? nullptr : d->v_new_.get<bf16>();
  p.out = d->out_.get<bf16>();
  p.lse = host.lse.empty() ? nullptr : d->lse_.get<float>();

  cuda::KernelTiling tiling;
  tiling.variant = variant;
  ATTN_CUDA_RETURN_IF_ERROR(cuda::GetGqaTiling(p.cache.head_dim, host.table.decode, &tiling));
  d->device_plan_.variant = tiling.variant;
  ATTN_CUDA_RETURN_IF_ERROR(
      d->UploadPlan(cuda::GqaPlanConfig(p, tiling, kTestPartialRows), overrides, host.table));
  *out = std::move(d);
  return cudaSuccess;
}

cudaError_t DeviceBatch::Create(MlaHostBatch& host, std::unique_ptr<DeviceBatch>* out,
                                PlanOverrides overrides) {
  std::unique_ptr<DeviceBatch> d(new DeviceBatch());
  d->mla_ = true;
  ATTN_CUDA_RETURN_IF_ERROR(d->cache_.Upload(host.cache));
  ATTN_CUDA_RETURN_IF_ERROR(d->q_.Upload(host.q_nope));
  ATTN_CUDA_RETURN_IF_ERROR(d->q_pe_.Upload(host.q_pe));
  ATTN_CUDA_RETURN_IF_ERROR(d->k_new_.Upload(host.ckv_new));
  ATTN_CUDA_RETURN_IF_ERROR(d->v_new_.Upload(host.kpe_new));
  ATTN_CUDA_RETURN_IF_ERROR(d->out_.Allocate(host.out.size() * sizeof(bf16)));
  ATTN_CUDA_RETURN_IF_ERROR(d->lse_.Allocate(host.lse.size() * sizeof(float)));
  ATTN_CUDA_RETURN_IF_ERROR(d->UploadTable(host.table));

  MlaParams& p = d->mla_params_;
  p = host.Params();
  p.cache.data = d->cache_.get<bf16>();
  p.batch = DeviceView(host.table, d->qo_indptr_, d->kv_indptr_, d->kv_indices_,
                       d->kv_last_page_len_, d->seq_layer_);
  p.q_nope = d->q_.get<bf16>();
  p.q_pe = d->q_pe_.get<bf16>();
  p.ckv_new = host.ckv_new.empty() ? nullptr : d->k_new_.get<bf16>();
  p.kpe_new = host.kpe_new.empty() ? nullptr : d->v_new_.get<bf16>();
  p.out = d->out_.get<bf16>();
  p.lse = host.lse.empty() ? nullptr : d->lse_.get<float>();

  cuda::KernelTiling tiling;
  ATTN_CUDA_RETURN_IF_ERROR(cuda::GetMlaTiling(p.num_heads, host.table.decode, &tiling));
  ATTN_CUDA_RETURN_IF_ERROR(
      d->UploadPlan(cuda::MlaPlanConfig(p, tiling, kTestPartialRows), overrides, host.table));
  *out = std::move(d);
  return cudaSuccess;
}

cudaError_t DeviceBatch::Run(cudaStream_t stream) {
  ATTN_CUDA_RETURN_IF_ERROR(mla_ ? cuda::MlaAppendKv(mla_params_, stream)
                                 : cuda::GqaAppendKv(gqa_, stream));
  return RunAttention(stream);
}

cudaError_t DeviceBatch::RunAttention(cudaStream_t stream) {
  return mla_ ? cuda::MlaAttention(mla_params_, device_plan_, stream)
              : cuda::GqaAttention(gqa_, device_plan_, stream);
}

cudaError_t DeviceBatch::PoisonOutputs(cudaStream_t stream) {
  ATTN_CUDA_RETURN_IF_ERROR(cudaMemsetAsync(out_.get<void>(), 0xff, out_.bytes(), stream));
  return cudaMemsetAsync(lse_.get<void>(), 0xff, lse_.bytes(), stream);
}

cudaError_t DeviceBatch::Download(std::vector<bf16>* out, std::vector<float>* lse,
                                  std::vector<bf16>* cache) const {
  ATTN_CUDA_RETURN_IF_ERROR(cudaDeviceSynchronize());
  out->resize(out_.bytes() / sizeof(bf16));
  lse->resize(lse_.bytes() / sizeof(float));
  cache->resize(cache_.bytes() / sizeof(bf16));
  ATTN_CUDA_RETURN_IF_ERROR(
      cudaMemcpy(out->data(), out_.get<void>(), out_.bytes(), cudaMemcpyDeviceToHost));
  if (lse_.bytes() > 0) {
    ATTN_CUDA_RETURN_IF_ERROR(
        cudaMemcpy(lse->data(), lse_.get<void>(), lse_.bytes(), cudaMemcpyDeviceToHost));
  }
  return cudaMemcpy(cache->data(), cache_.get<void>(), cache_.bytes(), cudaMemcpyDeviceToHost);
}

}  // namespace attn::testing
