#include "server/backends/cuda_backend.h"

#include <cuda_runtime_api.h>

#include <algorithm>
#include <atomic>
#include <cstring>
#include <mutex>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/synchronization/mutex.h"
#include "kernels/cuda/api.h"
#include "kernels/cuda/plan.h"
#include "server/backends/merged_batch.h"

namespace attn {
namespace {

// Errors after which the context is unusable: every later call fails too.
bool IsSticky(cudaError_t err) {
  switch (err) {
    case cudaErrorIllegalAddress:
    case cudaErrorLaunchFailure:
    case cudaErrorIllegalInstruction:
    case cudaErrorMisalignedAddress:
    case cudaErrorInvalidAddressSpace:
    case cudaErrorInvalidPc:
    case cudaErrorHardwareStackError:
    case cudaErrorAssert:
    case cudaErrorUnknown:
    case cudaErrorECCUncorrectable:
      return true;
    default:
      return false;
  }
}

// Shared by the backend and its lanes: the context's health and the fatal-error callback.
class DeviceState {
 public:
  explicit DeviceState(std::function<void(const absl::Status&)> on_fatal)
      : on_fatal_(std::move(on_fatal)) {}

  // OK, or the error to return for `err` from `what` (sticky errors poison the state).
  absl::Status Check(cudaError_t err, const char* what) {
    if (err == cudaSuccess) return poisoned_.load() ? Poisoned() : absl::OkStatus();
    const std::string message = absl::StrCat("CUDA error in ", what, ": ", cudaGetErrorName(err),
                                             " (", cudaGetErrorString(err), ")");
    if (err == cudaErrorMemoryAllocation) return absl::ResourceExhaustedError(message);
    if (IsSticky(err) && !poisoned_.exchange(true)) {
      const absl::Status fatal = absl::InternalError(message);
      if (on_fatal_) on_fatal_(fatal);
      return fatal;
    }
    return absl::InternalError(message);
  }

  absl::Status Poisoned() const {
    return absl::InternalError("the CUDA context failed earlier; the server is restarting");
  }
  bool poisoned() const { return poisoned_.load(); }

 private:
  std::function<void(const absl::Status&)> on_fatal_;
  std::atomic<bool> poisoned_{false};
};

#define RETURN_IF_CUDA_ERROR(state, expr)                                  \
  do {                                                                      \
    if (absl::Status _st = (state).Check((expr), #expr); !_st.ok()) {       \
      return _st;                                                           \
    }                                                                       \
  } while (0)

constexpr size_t kAlign = 256;
size_t AlignUp(size_t n) { return (n + kAlign - 1) / kAlign * kAlign; }

// A pinned host buffer and a device buffer of the same capacity, grown on demand (growth is
// rare: capacity doubles, so a lane reallocates a handful of times in its life).
class StagingPair {
 public:
  ~StagingPair() { Release(); }
  absl::Status Reserve(size_t bytes, DeviceState& state) {
    if (bytes <= capacity_) return absl::OkStatus();
    Release();
    capacity_ = std::max(bytes, 2 * capacity_);
    RETURN_IF_CUDA_ERROR(state, cudaHostAlloc(&host_, capacity_, cudaHostAllocDefault));
    RETURN_IF_CUDA_ERROR(state, cudaMalloc(&device_, capacity_));
    return absl::OkStatus();
  }
  char* host() const { return static_cast<char*>(host_); }
  char* device() const { return static_cast<char*>(device_); }
  // Gives the buffers back when they grew past `bytes` (a large launch), so one large call does
  // not hold pinned and device memory for the life of the process.
  void Trim(size_t bytes) {
    if (capacity_ > bytes) Release();
  }

 private:
  void Release() {
    if (host_) cudaFreeHost(host_);
    if (device_) cudaFree(device_);
    host_ = device_ = nullptr;
    capacity_ = 0;
  }
  void* host_ = nullptr;
  void* device_ = nullptr;
  size_t capacity_ = 0;
};

// Sections of one launch's staging buffer, at kAlign-aligned offsets.
class Layout {
 public:
  size_t Add(size_t bytes) {
    const size_t at = size_;
    size_ = AlignUp(size_ + bytes);
    return at;
  }
  size_t size() const { return size_; }

 private:
  size_t size_ = 0;
};

struct CudaPool {
  PoolGeometry geometry;
  void* storage = nullptr;  // one allocation for every layer and page
  int32_t* scrub_ids = nullptr;  // [num_pages] device: the ids of one ScrubPages call
};

class CudaLane final : public Lane {
 public:
  // `shared_stream`: run on it instead of a stream of the lane's own.
  CudaLane(const CudaPool& pool, Op op, DeviceState& state, int device, int64_t workspace_bytes,
           cudaStream_t shared_stream)
      : pool_(pool),
        op_(op),
        state_(state),
        device_(device),
        workspace_bytes_(workspace_bytes),
        owns_stream_(shared_stream == nullptr),
        stream_(shared_stream) {}

  ~CudaLane() override {
    if (workspace_) cudaFree(workspace_);
    if (start_) cudaEventDestroy(start_);
    if (stop_) cudaEventDestroy(stop_);
    if (stream_ && owns_stream_) cudaStreamDestroy(stream_);
  }

  absl::Status Init() {
    if (owns_stream_) {
      int least = 0, greatest = 0;
      RETURN_IF_CUDA_ERROR(state_, cudaDeviceGetStreamPriorityRange(&least, &greatest));
      // Numerically lower is higher priority: decodes go first.
      RETURN_IF_CUDA_ERROR(state_,
                           cudaStreamCreateWithPriority(&stream_, cudaStreamNonBlocking,
                                                        op_ == Op::kDecode ? greatest : least));
    }
    RETURN_IF_CUDA_ERROR(state_, cudaEventCreate(&start_));
    RETURN_IF_CUDA_ERROR(state_, cudaEventCreate(&stop_));
    RETURN_IF_CUDA_ERROR(state_, cudaMalloc(&workspace_, workspace_bytes_));
    const PoolGeometry& g = pool_.geometry;
    const bool decode = op_ == Op::kDecode;
    RETURN_IF_CUDA_ERROR(state_, g.kind == PoolKind::kGqa
                                     ? cuda::GetGqaTiling(g.head_dim, decode, &tiling_)
                                     : cuda::GetMlaTiling(g.num_qo_heads, decode, &tiling_));
    return absl::OkStatus();
  }

  absl::StatusOr<LaunchStats> Run(absl::Span<AttentionCall* const> calls) override {
    if (state_.poisoned()) return state_.Poisoned();
    RETURN_IF_CUDA_ERROR(state_, cudaSetDevice(device_));  // the current device is per thread
    LaunchStats stats;
    StageTimer timer;
    const PoolGeometry& g = pool_.geometry;
    const bool gqa = g.kind == PoolKind::kGqa;
    merged_.Build(calls);
    const int batch = merged_.batch_size();
    const int64_t rows = merged_.total_q();
    const bool appends = calls.front()->appends();
    const bool want_lse = std::any_of(calls.begin(), calls.end(),
                                      [](const AttentionCall* c) { return c->return_lse; });

    // Plan on the host from the sequences' lengths.
    const PagedBatch view = merged_.View(op_);
    q_lens_.resize(batch);
    kv_lens_.resize(batch);
    for (int b = 0; b < batch; ++b) {
      const SeqExtent e = GetSeqExtent(view, g.page_size, b);
      q_lens_[b] = e.q_len;
      kv_lens_[b] = e.kv_len;
    }
    const int out_dim = gqa ? g.head_dim : kMlaCkvDim;
    const int64_t max_partial_rows = workspace_bytes_ / (int64_t{out_dim + 1} * sizeof(float));
    PlanConfig config;
    if (gqa) {
      GqaParams shape;
      shape.cache = g.GqaView(nullptr);
      shape.num_qo_heads = g.num_qo_heads;
      config = cuda::GqaPlanConfig(shape, tiling_, max_partial_rows);
    } else {
      MlaParams shape;
      shape.num_heads = g.num_qo_heads;
      config = cuda::MlaPlanConfig(shape, tiling_, max_partial_rows);
    }
    plan_ = PlanAttention(config, q_lens_.data(), kv_lens_.data(), batch);

    // Inputs: one staging buffer, one copy.
    const int64_t heads = g.num_qo_heads;
    const int64_t q_row = heads * (gqa ? g.head_dim : kMlaCkvDim);
    const int64_t pe_row = gqa ? 0 : heads * kMlaKpeDim;
    const int64_t k_row = gqa ? int64_t{g.num_kv_heads} * g.head_dim : kMlaCkvDim;
    const int64_t v_row = gqa ? k_row : kMlaKpeDim;
    Layout in;
    const size_t q_at = in.Add(rows * q_row * 2);
    const size_t pe_at = in.Add(rows * pe_row * 2);
    const size_t k_at = in.Add(appends ? rows * k_row * 2 : 0);
    const size_t v_at = in.Add(appends ? rows * v_row * 2 : 0);
    auto add_ints = [&](const std::vector<int32_t>& v) { return in.Add(v.size() * 4); };
    const size_t qo_at = add_ints(merged_.qo_indptr());
    const size_t kvp_at = add_ints(merged_.kv_indptr());
    const size_t idx_at = add_ints(merged_.kv_indices());
    const size_t last_at = add_ints(merged_.kv_last_page_len());
    const size_t layer_at = add_ints(merged_.seq_layer());
    const size_t items_at = in.Add(plan_.items.size() * sizeof(WorkItem));
    const size_t merges_at = in.Add(plan_.merges.size() * sizeof(MergeRow));
    if (absl::Status st = inputs_.Reserve(in.size(), state_); !st.ok()) return st;

    char* h = inputs_.host();
    GatherRows(calls, merged_, &AttentionCall::q, q_row, reinterpret_cast<bf16*>(h + q_at));
    if (!gqa) {
      GatherRows(calls, merged_, &AttentionCall::q_pe, pe_row, reinterpret_cast<bf16*>(h + pe_at));
    }
    if (appends) {
      GatherRows(calls, merged_, &AttentionCall::k_new, k_row, reinterpret_cast<bf16*>(h + k_at));
      GatherRows(calls, merged_, &AttentionCall::v_new, v_row, reinterpret_cast<bf16*>(h + v_at));
    }
    auto put = [&](size_t at, const auto& v) {
      std::memcpy(h + at, v.data(), v.size() * sizeof(v[0]));
    };
    put(qo_at, merged_.qo_indptr());
    put(kvp_at, merged_.kv_indptr());
    put(idx_at, merged_.kv_indices());
    put(last_at, merged_.kv_last_page_len());
    put(layer_at, merged_.seq_layer());
    put(items_at, plan_.items);
    put(merges_at, plan_.merges);

    // Outputs: out then lse, one buffer, one copy back.
    Layout out;
    const size_t out_at = out.Add(rows * heads * out_dim * 2);
    const size_t lse_at = out.Add(want_lse ? rows * heads * 4 : 0);
    if (absl::Status st = outputs_.Reserve(out.size(), state_); !st.ok()) return st;

    char* d = inputs_.device();
    auto dptr = [&](size_t at) { return reinterpret_cast<const int32_t*>(d + at); };
    PagedBatch dbatch = view;
    dbatch.qo_indptr = op_ == Op::kPrefill ? dptr(qo_at) : nullptr;
    dbatch.kv_indptr = dptr(kvp_at);
    dbatch.kv_indices = dptr(idx_at);
    dbatch.kv_last_page_len = dptr(last_at);
    dbatch.seq_layer = dptr(layer_at);
    cuda::DevicePlan dplan;
    dplan.items = reinterpret_cast<const WorkItem*>(d + items_at);
    dplan.num_items = static_cast<int>(plan_.items.size());
    dplan.merges = reinterpret_cast<const MergeRow*>(d + merges_at);
    dplan.num_merges = static_cast<int>(plan_.merges.size());
    dplan.max_splits = plan_.max_splits;
    dplan.partial_out = static_cast<float*>(workspace_);
    dplan.partial_lse = dplan.partial_out + max_partial_rows * out_dim;
    dplan.variant = tiling_.variant;
    bf16* dout = reinterpret_cast<bf16*>(outputs_.device() + out_at);
    float* dlse = want_lse ? reinterpret_cast<float*>(outputs_.device() + lse_at) : nullptr;
    auto din = [&](size_t at) { return reinterpret_cast<const bf16*>(d + at); };

    timer.Next(&stats.prepare);
    RETURN_IF_CUDA_ERROR(state_, cudaMemcpyAsync(d, h, in.size(), cudaMemcpyHostToDevice, stream_));
    RETURN_IF_CUDA_ERROR(state_, cudaEventRecord(start_, stream_));
    const float sm_scale = calls.front()->sm_scale;
    if (gqa) {
      GqaParams p;
      p.cache = g.GqaView(static_cast<bf16*>(pool_.storage));
      p.batch = dbatch;
      p.num_qo_heads = g.num_qo_heads;
      p.q = din(q_at);
      p.k_new = appends ? din(k_at) : nullptr;
      p.v_new = appends ? din(v_at) : nullptr;
      p.out = dout;
      p.lse = dlse;
      p.sm_scale = sm_scale;
      RETURN_IF_CUDA_ERROR(state_, cuda::GqaAppendKv(p, stream_));
      RETURN_IF_CUDA_ERROR(state_, cuda::GqaAttention(p, dplan, stream_));
    } else {
      MlaParams p;
      p.cache = g.MlaView(static_cast<bf16*>(pool_.storage));
      p.batch = dbatch;
      p.num_heads = g.num_qo_heads;
      p.q_nope = din(q_at);
      p.q_pe = din(pe_at);
      p.ckv_new = appends ? din(k_at) : nullptr;
      p.kpe_new = appends ? din(v_at) : nullptr;
      p.out = dout;
      p.lse = dlse;
      p.sm_scale = sm_scale;
      RETURN_IF_CUDA_ERROR(state_, cuda::MlaAppendKv(p, stream_));
      RETURN_IF_CUDA_ERROR(state_, cuda::MlaAttention(p, dplan, stream_));
    }
    RETURN_IF_CUDA_ERROR(state_, cudaEventRecord(stop_, stream_));
    RETURN_IF_CUDA_ERROR(state_, cudaMemcpyAsync(outputs_.host(), outputs_.device(), out.size(),
                                                 cudaMemcpyDeviceToHost, stream_));
    RETURN_IF_CUDA_ERROR(state_, cudaStreamSynchronize(stream_));
    timer.Next(&stats.execute);

    ScatterOutputs(calls, merged_, outputs_.host() + out_at, heads * out_dim * 2,
                   reinterpret_cast<const float*>(outputs_.host() + lse_at),
                   static_cast<int>(heads));
    timer.Next(&stats.finish);
    float ms = 0.f;
    RETURN_IF_CUDA_ERROR(state_, cudaEventElapsedTime(&ms, start_, stop_));
    stats.compute = absl::Microseconds(static_cast<int64_t>(ms * 1e3));
    stats.bytes_in = static_cast<int64_t>(in.size());
    stats.bytes_out = static_cast<int64_t>(out.size());
    constexpr size_t kRetainedStagingBytes = size_t{64} << 20;
    inputs_.Trim(kRetainedStagingBytes);
    outputs_.Trim(kRetainedStagingBytes);
    return stats;
  }

 private:
  const CudaPool& pool_;
  const Op op_;
  DeviceState& state_;
  const int device_;
  const int64_t workspace_bytes_;
  const bool owns_stream_;
  cudaStream_t stream_ = nullptr;
  cudaEvent_t start_ = nullptr, stop_ = nullptr;
  void* workspace_ = nullptr;
  cuda::KernelTiling tiling_;
  // Reused across launches.
  MergedBatch merged_;
  AttentionPlan plan_;
  std::vector<int32_t> q_lens_, kv_lens_;
  StagingPair inputs_, outputs_;
};

class CudaBackend final : public Backend {
 public:
  explicit CudaBackend(CudaBackendOptions options)
      : options_(std::move(options)), state_(options_.on_fatal_error) {}

  ~CudaBackend() override {
    for (auto& pool : pools_) {
      cudaFree(pool->storage);
      cudaFree(pool->scrub_ids);
    }
    if (shared_stream_) cudaStreamDestroy(shared_stream_);
    if (scrub_stream_) cudaStreamDestroy(scrub_stream_);
  }

  absl::Status Init() {
    RETURN_IF_CUDA_ERROR(state_, cudaSetDevice(options_.device));
    RETURN_IF_CUDA_ERROR(state_, cudaGetDeviceProperties(&props_, options_.device));
    if (options_.single_stream) {
      RETURN_IF_CUDA_ERROR(state_, cudaStreamCreateWithFlags(&shared_stream_,
                                                             cudaStreamNonBlocking));
    }
    RETURN_IF_CUDA_ERROR(state_, cudaStreamCreateWithFlags(&scrub_stream_, cudaStreamNonBlocking));
    return absl::OkStatus();
  }

  std::string name() const override { return "cuda"; }
  std::string device() const override {
    return absl::StrFormat("%s (sm_%d%d, %d SMs, %.0f GiB)", props_.name, props_.major,
                           props_.minor, props_.multiProcessorCount,
                           props_.totalGlobalMem / double{1 << 30});
  }

  absl::Status AddPool(const PoolGeometry& geometry) override {
    auto pool = std::make_unique<CudaPool>();
    pool->geometry = geometry;
    RETURN_IF_CUDA_ERROR(state_, cudaMalloc(&pool->storage, geometry.TotalBytes()));
    // Zeroed once, so attending over a slot nothing was appended to reads zeros, not garbage.
    RETURN_IF_CUDA_ERROR(state_, cudaMemset(pool->storage, 0, geometry.TotalBytes()));
    RETURN_IF_CUDA_ERROR(state_, cudaMalloc(reinterpret_cast<void**>(&pool->scrub_ids),
                                            geometry.num_pages * sizeof(int32_t)));
    pools_.push_back(std::move(pool));
    return absl::OkStatus();
  }

  // One copy of the ids and one launch for the whole list, on a stream of its own, then a
  // synchronize of that stream: a later launch on any lane, enqueued after this returns, runs
  // after the zeros landed. Calls are serialized (one id buffer per pool); the H200 cost is in
  // bench/RESULTS.md (scrub_bench).
  absl::Status ScrubPages(int pool, absl::Span<const int32_t> pages) override {
    if (pool < 0 || pool >= static_cast<int>(pools_.size())) {
      return absl::InvalidArgumentError(absl::StrCat("no pool number ", pool));
    }
    if (pages.empty()) return absl::OkStatus();
    const CudaPool& p = *pools_[pool];
    const PoolGeometry& g = p.geometry;
    absl::MutexLock lock(&scrub_mu_);
    RETURN_IF_CUDA_ERROR(state_, cudaSetDevice(options_.device));
    RETURN_IF_CUDA_ERROR(state_,
                         cudaMemcpyAsync(p.scrub_ids, pages.data(), pages.size() * sizeof(int32_t),
                                         cudaMemcpyHostToDevice, scrub_stream_));
    RETURN_IF_CUDA_ERROR(state_, cuda::ZeroPages(p.storage, g.num_layers, g.num_pages,
                                                 g.BytesPerPage() / g.num_layers, p.scrub_ids,
                                                 static_cast<int>(pages.size()), scrub_stream_));
    RETURN_IF_CUDA_ERROR(state_, cudaStreamSynchronize(scrub_stream_));
    return absl::OkStatus();
  }

  absl::StatusOr<std::unique_ptr<Lane>> CreateLane(int pool, Op op) override {
    if (pool < 0 || pool >= static_cast<int>(pools_.size())) {
      return absl::InvalidArgumentError(absl::StrCat("no pool number ", pool));
    }
    RETURN_IF_CUDA_ERROR(state_, cudaSetDevice(options_.device));
    auto lane = std::make_unique<CudaLane>(*pools_[pool], op, state_, options_.device,
                                           options_.workspace_bytes, shared_stream_);
    if (absl::Status st = lane->Init(); !st.ok()) return st;
    return std::unique_ptr<Lane>(std::move(lane));
  }

 private:
  CudaBackendOptions options_;
  DeviceState state_;
  cudaDeviceProp props_{};
  cudaStream_t shared_stream_ = nullptr;  // only with options_.single_stream
  absl::Mutex scrub_mu_;                  // one ScrubPages at a time
  cudaStream_t scrub_stream_ = nullptr;
  std::vector<std::unique_ptr<CudaPool>> pools_;
};

}  // namespace

int CudaDeviceCount() {
  int count = 0;
  return cudaGetDeviceCount(&count) == cudaSuccess ? count : 0;
}

absl::StatusOr<std::unique_ptr<Backend>> CreateCudaBackend(CudaBackendOptions options) {
  if (options.device >= CudaDeviceCount()) {
    return absl::UnavailableError(absl::StrCat("no CUDA device ", options.device));
  }
  auto backend = std::make_unique<CudaBackend>(std::move(options));
  if (absl::Status st = backend->Init(); !st.ok()) return st;
  return std::unique_ptr<Backend>(std::move(backend));
}

}  // namespace attn
