#include "kernels/testing/device_batch.h"

#include <cstring>

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

namespace {

cuda::LaunchOptions Options(bool append, bool lse, float sm_scale, bool causal,
                            const cuda::KernelTiling& tiling, const PlanOverrides& overrides) {
  cuda::LaunchOptions o;
  o.append = append;
  o.lse = lse;
  o.sm_scale = sm_scale;
  o.causal = causal;
  o.tiling = tiling;
  o.max_partial_rows = kTestPartialRows;
  o.min_chunk_len = overrides.min_chunk_len;
  o.target_waves = overrides.target_waves;
  o.waves_before_split = overrides.waves_before_split;
  o.no_split_fill = overrides.no_split_fill;
  o.output_chunk_bytes = overrides.output_chunk_bytes;
  return o;
}

void Put(std::vector<char>& staging, const cuda::StagingSection& s, const void* src) {
  if (s.bytes > 0) std::memcpy(staging.data() + s.offset, src, s.bytes);
}

}  // namespace

cudaError_t DeviceBatch::Stage(const void* q, const void* q_pe, const void* k_new,
                               const void* v_new) {
  const cuda::InputLayout& in = launch_.inputs();
  std::vector<char> staging(in.bytes);
  Put(staging, in.q, q);
  Put(staging, in.q_pe, q_pe);
  Put(staging, in.k_new, k_new);
  Put(staging, in.v_new, v_new);
  launch_.WriteIndices(staging.data());
  ATTN_CUDA_RETURN_IF_ERROR(inputs_.Upload(staging));
  ATTN_CUDA_RETURN_IF_ERROR(outputs_.Allocate(launch_.outputs().bytes));
  ATTN_CUDA_RETURN_IF_ERROR(workspace_.Allocate(launch_.WorkspaceBytes()));
  return launch_.Bind(inputs_.get<void>(), outputs_.get<void>(), workspace_.get<void>(),
                      workspace_.bytes());
}

cudaError_t DeviceBatch::Create(GqaHostBatch& host, std::unique_ptr<DeviceBatch>* out, int variant,
                                PlanOverrides overrides) {
  std::unique_ptr<DeviceBatch> d(new DeviceBatch());
  ATTN_CUDA_RETURN_IF_ERROR(d->cache_.Upload(host.cache));
  GqaCache cache = host.Params().cache;
  cache.data = d->cache_.get<bf16>();
  cuda::KernelTiling tiling;
  tiling.variant = variant;
  ATTN_CUDA_RETURN_IF_ERROR(cuda::GetGqaTiling(cache.head_dim, host.table.decode, &tiling));
  cuda::LaunchOptions options = Options(!host.k_new.empty(), !host.lse.empty(), host.sm_scale,
                                        host.causal, tiling, overrides);
  if (variant < 0 && !host.table.decode) {  // the default picks kernels as the server does
    ATTN_CUDA_RETURN_IF_ERROR(
        cuda::GetGqaShortPrefillTiling(cache.head_dim, &options.short_prefill));
  }
  d->launch_.PlanGqa(cache, host.geometry.num_qo_heads, host.table.View(), options);
  ATTN_CUDA_RETURN_IF_ERROR(d->Stage(host.q.data(), nullptr, host.k_new.data(), host.v_new.data()));
  *out = std::move(d);
  return cudaSuccess;
}

cudaError_t DeviceBatch::Create(MlaHostBatch& host, std::unique_ptr<DeviceBatch>* out, int variant,
                                PlanOverrides overrides) {
  std::unique_ptr<DeviceBatch> d(new DeviceBatch());
  ATTN_CUDA_RETURN_IF_ERROR(d->cache_.Upload(host.cache));
  MlaCache cache = host.Params().cache;
  cache.data = d->cache_.get<bf16>();
  cuda::KernelTiling tiling;
  tiling.variant = variant;
  ATTN_CUDA_RETURN_IF_ERROR(
      cuda::GetMlaTiling(host.geometry.num_heads, cache.page_size, host.table.decode, &tiling));
  d->launch_.PlanMla(cache, host.geometry.num_heads, host.table.View(),
                     Options(!host.ckv_new.empty(), !host.lse.empty(), host.sm_scale, host.causal,
                             tiling, overrides));
  ATTN_CUDA_RETURN_IF_ERROR(
      d->Stage(host.q_nope.data(), host.q_pe.data(), host.ckv_new.data(), host.kpe_new.data()));
  *out = std::move(d);
  return cudaSuccess;
}

cudaError_t DeviceBatch::RunChunked(cudaStream_t stream, const std::vector<int>& order) {
  ATTN_CUDA_RETURN_IF_ERROR(launch_.EnqueueCheck(stream));
  ATTN_CUDA_RETURN_IF_ERROR(launch_.EnqueueAppend(stream));
  const int n = static_cast<int>(launch_.output_chunks().size());
  for (int i = 0; i < (order.empty() ? n : static_cast<int>(order.size())); ++i) {
    ATTN_CUDA_RETURN_IF_ERROR(launch_.EnqueueAttentionChunk(stream, order.empty() ? i : order[i]));
  }
  return cudaSuccess;
}

cudaError_t DeviceBatch::PoisonOutputs(cudaStream_t stream, int byte) {
  return cudaMemsetAsync(outputs_.get<void>(), byte, outputs_.bytes(), stream);
}

cudaError_t DeviceBatch::Download(std::vector<bf16>* out, std::vector<float>* lse,
                                  std::vector<bf16>* cache) const {
  ATTN_CUDA_RETURN_IF_ERROR(cudaDeviceSynchronize());
  const cuda::OutputLayout& layout = launch_.outputs();
  std::vector<char> outputs(layout.bytes);
  if (!outputs.empty()) {
    ATTN_CUDA_RETURN_IF_ERROR(
        cudaMemcpy(outputs.data(), outputs_.get<void>(), layout.bytes, cudaMemcpyDeviceToHost));
  }
  out->resize(layout.out.bytes / sizeof(bf16));
  lse->resize(layout.lse.bytes / sizeof(float));
  if (!out->empty()) std::memcpy(out->data(), outputs.data() + layout.out.offset, layout.out.bytes);
  if (!lse->empty()) std::memcpy(lse->data(), outputs.data() + layout.lse.offset, layout.lse.bytes);
  cache->resize(cache_.bytes() / sizeof(bf16));
  return cudaMemcpy(cache->data(), cache_.get<void>(), cache_.bytes(), cudaMemcpyDeviceToHost);
}

}  // namespace attn::testing
