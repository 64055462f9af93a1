#include "server/backends/cuda_backend.h"

#include <cuda_runtime_api.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <mutex>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "absl/synchronization/mutex.h"
#include "kernels/cpu/thread_pool.h"
#include "kernels/cuda/api.h"
#include "kernels/cuda/launch_plan.h"
#include "server/backends/cuda_regions.h"
#include "server/backends/merged_batch.h"
#include "server/backends/output_buffers.h"
#include "server/engine/status_macros.h"

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

#define RETURN_IF_CUDA_ERROR(state, expr)                             \
  do {                                                                \
    if (absl::Status _st = (state).Check((expr), #expr); !_st.ok()) { \
      return _st;                                                     \
    }                                                                 \
  } while (0)

// A pinned host buffer and a device buffer of the same capacity (either may be left out),
// grown on demand (growth is rare: capacity doubles, so a lane reallocates a handful of times in
// its life).
class StagingPair {
 public:
  explicit StagingPair(bool with_host = true, bool with_device = true)
      : with_host_(with_host), with_device_(with_device) {}
  ~StagingPair() { Release(); }
  absl::Status Reserve(size_t bytes, DeviceState& state) {
    if (bytes <= capacity_) return absl::OkStatus();
    Release();
    ++generation_;
    capacity_ = std::max(bytes, 2 * capacity_);
    if (with_host_) {
      RETURN_IF_CUDA_ERROR(state, cudaHostAlloc(&host_, capacity_, cudaHostAllocDefault));
    }
    if (with_device_) RETURN_IF_CUDA_ERROR(state, cudaMalloc(&device_, capacity_));
    return absl::OkStatus();
  }
  char* host() const { return static_cast<char*>(host_); }
  char* device() const { return static_cast<char*>(device_); }
  // Changes whenever the buffers are given back or replaced: what was copied into them before is
  // there while it stays the same.
  uint64_t generation() const { return generation_; }
  // Gives the buffers back when they grew past `keep` and the launch that just ran used less
  // than a quarter of them: one large call does not hold pinned and device memory for the life of
  // the process, and a stream of large calls does not pay for pinning (tens of ms for 100 MB)
  // again on every call.
  void Trim(size_t used, size_t keep) {
    if (capacity_ > keep && used < capacity_ / 4) Release();
  }

 private:
  void Release() {
    if (host_) cudaFreeHost(host_);
    if (device_) cudaFree(device_);
    host_ = device_ = nullptr;
    capacity_ = 0;
    ++generation_;
  }
  const bool with_host_, with_device_;
  uint64_t generation_ = 0;
  void* host_ = nullptr;
  void* device_ = nullptr;
  size_t capacity_ = 0;
};

// Why a call's inputs were refused on the device: the kFinite* bits CheckFinite set.
absl::Status NonFiniteInputs(uint32_t bits, PoolKind kind) {
  const bool gqa = kind == PoolKind::kGqa;
  std::vector<const char*> fields;
  if (bits & cuda::kFiniteQ) fields.push_back("q");
  if (bits & cuda::kFiniteQPe) fields.push_back("q_pe");
  if (bits & cuda::kFiniteKNew) fields.push_back(gqa ? "k_new" : "ckv_new");
  if (bits & cuda::kFiniteVNew) fields.push_back(gqa ? "v_new" : "kpe_new");
  return absl::InvalidArgumentError(
      absl::StrCat(absl::StrJoin(fields, ", "), fields.size() == 1 ? " holds" : " hold",
                   " a NaN or Inf; inputs must be finite (nothing was appended)"));
}

// The device's address of page-locked host memory (mapped for the device under unified
// addressing), or null should the lookup fail.
void* DeviceAddress(void* host) {
  void* device = nullptr;
  if (cudaHostGetDevicePointer(&device, host, 0) != cudaSuccess) {
    cudaGetLastError();  // not sticky
    return nullptr;
  }
  return device;
}

// Pinned host memory for the outputs the responses are sent from.
std::unique_ptr<OutputBuffers> PinnedOutputBuffers() {
  return std::make_unique<OutputBuffers>(
      [](size_t bytes) -> void* {
        void* p = nullptr;
        if (cudaHostAlloc(&p, bytes, cudaHostAllocDefault) != cudaSuccess) {
          cudaGetLastError();  // an allocation failure is not sticky
          return nullptr;
        }
        return p;
      },
      [](void* p) { cudaFreeHost(p); },
      // Pinning is slow: keep up to two idle buffers as large as an 8192-token prefill's output.
      /*max_idle=*/2, /*max_idle_bytes=*/size_t{256} << 20);
}

struct CudaPool {
  PoolGeometry geometry;
  void* storage = nullptr;       // one allocation for every layer and page
  int32_t* scrub_ids = nullptr;  // [num_pages] device: the ids of one ScrubPages call
};

class CudaLane final : public Lane {
 public:
  // `shared_stream`: run on it instead of a stream of the lane's own.
  CudaLane(const CudaPool& pool, Op op, DeviceState& state, const CudaBackendOptions& options,
           cudaStream_t shared_stream, cpu::ThreadPool& gather)
      : pool_(pool),
        op_(op),
        state_(state),
        device_(options.device),
        workspace_bytes_(options.workspace_bytes),
        direct_output_min_bytes_(options.direct_output_min_bytes),
        output_chunk_bytes_(op == Op::kPrefill && shared_stream == nullptr
                                ? std::max<int64_t>(options.output_chunk_bytes, 0)
                                : 0),
        owns_stream_(shared_stream == nullptr),
        stream_(shared_stream),
        outputs_(/*with_host=*/false),
        responses_(PinnedOutputBuffers()),
        gather_threads_(gather.MaxParallelism()),
        parallel_for_([&gather](int64_t n, const std::function<void(int64_t)>& fn) {
          gather.ParallelFor(n, fn);
        }) {}

  ~CudaLane() override {
    if (workspace_) cudaFree(workspace_);
    if (start_) cudaEventDestroy(start_);
    if (stop_) cudaEventDestroy(stop_);
    if (checked_) cudaEventDestroy(checked_);
    for (cudaEvent_t e : chunk_done_) {
      if (e) cudaEventDestroy(e);
    }
    if (copy_stream_) cudaStreamDestroy(copy_stream_);
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
    RETURN_IF_CUDA_ERROR(state_, cudaEventCreateWithFlags(&checked_, cudaEventDisableTiming));
    if (output_chunk_bytes_ > 0) {
      int least = 0, greatest = 0;
      RETURN_IF_CUDA_ERROR(state_, cudaDeviceGetStreamPriorityRange(&least, &greatest));
      RETURN_IF_CUDA_ERROR(
          state_, cudaStreamCreateWithPriority(&copy_stream_, cudaStreamNonBlocking, least));
      for (cudaEvent_t& e : chunk_done_) {
        RETURN_IF_CUDA_ERROR(state_, cudaEventCreateWithFlags(&e, cudaEventDisableTiming));
      }
    }
    RETURN_IF_CUDA_ERROR(state_, cudaMalloc(&workspace_, workspace_bytes_));
    const PoolGeometry& g = pool_.geometry;
    const bool decode = op_ == Op::kDecode;
    RETURN_IF_CUDA_ERROR(state_,
                         g.kind == PoolKind::kGqa
                             ? cuda::GetGqaTiling(g.head_dim, decode, &tiling_)
                             : cuda::GetMlaTiling(g.num_qo_heads, g.page_size, decode, &tiling_));
    if (g.kind == PoolKind::kGqa && !decode) {
      RETURN_IF_CUDA_ERROR(state_, cuda::GetGqaShortPrefillTiling(g.head_dim, &short_prefill_));
    }
    const int64_t out_dim = g.kind == PoolKind::kGqa ? g.head_dim : kMlaCkvDim;
    max_partial_rows_ = workspace_bytes_ / ((out_dim + 1) * int64_t{sizeof(float)});
    return absl::OkStatus();
  }

  absl::StatusOr<LaunchStats> Run(absl::Span<AttentionCall* const> calls) override {
    if (state_.poisoned()) return state_.Poisoned();
    RETURN_IF_CUDA_ERROR(state_, cudaSetDevice(device_));  // the current device is per thread
    LaunchStats stats;
    StageTimer timer;
    const PoolGeometry& g = pool_.geometry;
    merged_.Build(calls);
    // Plan on the host from the merged page table; the plan lays out the staging buffers. Every
    // call's inputs are checked for NaN and Inf on the device (validation leaves them to the
    // backend: Backend::ChecksFiniteInputs); a refused call has nothing appended.
    cuda::LaunchOptions options;
    options.call_rows = merged_.call_rows().data();
    options.num_calls = static_cast<int>(calls.size());
    options.append = calls.front()->appends();
    options.lse = std::any_of(calls.begin(), calls.end(),
                              [](const AttentionCall* c) { return c->return_lse; });
    options.sm_scale = calls.front()->sm_scale;
    options.tiling = tiling_;
    options.short_prefill = short_prefill_;
    options.max_partial_rows = max_partial_rows_;
    options.output_chunk_bytes = static_cast<size_t>(output_chunk_bytes_);
    // A lone call on a plan's table: the last launch's plan, and its device copy, may still serve.
    options.table_id = calls.size() == 1 ? calls.front()->table_id : 0;
    const StagedTable last_staged = std::exchange(staged_table_, StagedTable{});
    bf16* storage = static_cast<bf16*>(pool_.storage);
    if (g.kind == PoolKind::kGqa) {
      launch_.PlanGqa(g.GqaView(storage), g.num_qo_heads, merged_.View(op_), options);
    } else {
      launch_.PlanMla(g.MlaView(storage), g.num_qo_heads, merged_.View(op_), options);
    }

    // Inputs: gathered into one pinned staging buffer (bytes of the messages) or copied straight
    // from the callers' regions; the page table and plan follow in the same buffer.
    const cuda::InputLayout& in = launch_.inputs();
    const cuda::RowWidths& w = launch_.widths();
    if (absl::Status st = inputs_.Reserve(in.bytes, state_); !st.ok()) return st;
    // The page table and plan in the device staging are still this table's when the plan was
    // kept, the layout is the same and the buffer has not been replaced: only seq_layer (the
    // layer of the call) is staged again. Per layer of a scheduler's step, that is all but one
    // call on the step's plan.
    const StagedTable staged{options.table_id, in, inputs_.generation()};
    const bool table_staged = launch_.plan_reused() && staged == last_staged;
    launch_.WriteIndices(inputs_.host(), table_staged);
    const cuda::OutputLayout& out = launch_.outputs();
    if (absl::Status st = outputs_.Reserve(out.bytes, state_); !st.ok()) return st;
    RETURN_IF_CUDA_ERROR(state_, launch_.Bind(inputs_.device(), outputs_.device(), workspace_,
                                              static_cast<size_t>(workspace_bytes_)));
    constexpr int64_t kBf16 = sizeof(bf16);
    int64_t bytes_in = 0;
    ATTN_RETURN_IF_ERROR(StageInput(calls, &AttentionCall::q, in.q, w.q * kBf16, &bytes_in));
    if (launch_.mla()) {
      ATTN_RETURN_IF_ERROR(
          StageInput(calls, &AttentionCall::q_pe, in.q_pe, w.q_pe * kBf16, &bytes_in));
    }
    if (options.append) {
      ATTN_RETURN_IF_ERROR(
          StageInput(calls, &AttentionCall::k_new, in.k_new, w.k_new * kBf16, &bytes_in));
      ATTN_RETURN_IF_ERROR(
          StageInput(calls, &AttentionCall::v_new, in.v_new, w.v_new * kBf16, &bytes_in));
    }
    timer.Next(&stats.prepare);
    // The tensors' copies are queued; the page table and plan are the buffer's tail.
    const size_t tail = in.qo_indptr.bytes > 0 ? in.qo_indptr.offset : in.kv_indptr.offset;
    const size_t from = table_staged ? in.seq_layer.offset : tail;
    const size_t to = table_staged ? in.seq_layer.offset + in.seq_layer.bytes : in.bytes;
    if (to > from) {
      RETURN_IF_CUDA_ERROR(state_, cudaMemcpyAsync(inputs_.device() + from, inputs_.host() + from,
                                                   to - from, cudaMemcpyHostToDevice, stream_));
    }
    bytes_in += static_cast<int64_t>(to - from);
    if (options.table_id != 0) staged_table_ = staged;
    RETURN_IF_CUDA_ERROR(state_, cudaEventRecord(start_, stream_));
    const int64_t out_row = w.out * kBf16, lse_row = w.lse * int64_t{sizeof(float)};
    // A refused call writes nothing into its regions, so outputs that go to regions (copied or
    // written by the kernels) wait for the finiteness verdicts, which then come back while the
    // append (which skips the refused calls) and the attention run. Without regions nothing
    // waits for them: they come back after the attention, and the stream's kernels run without
    // a device-to-host copy between them.
    const bool wants_direct = WantsDirectOutputs(calls, out_row);
    const bool any_region = std::any_of(calls.begin(), calls.end(), [](const AttentionCall* c) {
      return c->out.in_region() || (c->return_lse && c->lse.in_region());
    });
    const bool early_verdicts = wants_direct || any_region;
    if (absl::Status st = refused_.Reserve(out.refused.bytes, state_); !st.ok()) return st;
    const uint32_t* refused = reinterpret_cast<const uint32_t*>(refused_.host());
    auto copy_verdicts = [&]() -> absl::Status {
      RETURN_IF_CUDA_ERROR(state_,
                           cudaMemcpyAsync(refused_.host(), outputs_.device() + out.refused.offset,
                                           out.refused.bytes, cudaMemcpyDeviceToHost, stream_));
      RETURN_IF_CUDA_ERROR(state_, cudaEventRecord(checked_, stream_));
      return absl::OkStatus();
    };
    RETURN_IF_CUDA_ERROR(state_, launch_.EnqueueCheck(stream_));
    if (early_verdicts) ATTN_RETURN_IF_ERROR(copy_verdicts());
    RETURN_IF_CUDA_ERROR(state_, launch_.EnqueueAppend(stream_));
    int64_t bytes_out = 0;
    DirectOutputs direct;
    if (wants_direct) {
      RETURN_IF_CUDA_ERROR(state_, cudaEventSynchronize(checked_));
      if (refused[0] == 0) direct = DirectOutputsOf(*calls.front(), out_row, lse_row);
    }
    // Outputs the responses are sent from: a pinned buffer laid out as the output sections.
    std::shared_ptr<char> response;
    const bool response_out = std::any_of(
        calls.begin(), calls.end(), [](const AttentionCall* c) { return !c->out.in_region(); });
    const bool response_lse = std::any_of(calls.begin(), calls.end(), [](const AttentionCall* c) {
      return c->return_lse && !c->lse.in_region();
    });
    if (response_out || response_lse) {
      absl::StatusOr<std::shared_ptr<char>> buffer = responses_->Get(out.bytes);
      if (!buffer.ok()) return buffer.status();
      response = *std::move(buffer);
    }
    // A decode whose outputs all leave in responses has the kernels write them into that buffer
    // (ResponseDirectly): no copy after them, and no verdict to wait for.
    const bool response_direct = !any_region && ResponseDirectly(response, &direct);
    if (direct.out != nullptr || direct.lse != nullptr) {
      launch_.WriteOutputsTo(direct.out, direct.lse);
      bytes_out += direct.bytes;
    }
    // A chunked launch marks each chunk's rows done for the copies below.
    const std::vector<cuda::OutputChunk>& chunks = launch_.output_chunks();
    if (chunks.empty()) {
      RETURN_IF_CUDA_ERROR(state_, launch_.EnqueueAttention(stream_));
    }
    for (size_t k = 0; k < chunks.size(); ++k) {
      RETURN_IF_CUDA_ERROR(state_, launch_.EnqueueAttentionChunk(stream_, static_cast<int>(k)));
      RETURN_IF_CUDA_ERROR(state_, cudaEventRecord(chunk_done_[k], stream_));
    }
    RETURN_IF_CUDA_ERROR(state_, cudaEventRecord(stop_, stream_));
    if (!early_verdicts) ATTN_RETURN_IF_ERROR(copy_verdicts());

    // Outputs the kernels did not write where they go: copied into the callers' regions, once
    // the verdicts are in (before the attention is done, so the wait costs the GPU nothing), and
    // into the buffer the responses are sent from. A chunked launch's rows are copied on the copy
    // stream as each chunk is done.
    if (any_region) RETURN_IF_CUDA_ERROR(state_, cudaEventSynchronize(checked_));
    const cudaStream_t copy = chunks.empty() ? stream_ : copy_stream_;
    // Rows [lo, hi) of every output section that leaves the device by a copy, on `copy`.
    auto copy_rows = [&](int64_t lo, int64_t hi) -> absl::Status {
      auto enqueue = [&](void* dst, size_t section, int64_t row_bytes, int64_t from,
                         int64_t to) -> absl::Status {
        if (to <= from) return absl::OkStatus();
        const size_t bytes = static_cast<size_t>((to - from) * row_bytes);
        bytes_out += static_cast<int64_t>(bytes);
        RETURN_IF_CUDA_ERROR(
            state_, cudaMemcpyAsync(dst, outputs_.device() + section + from * row_bytes, bytes,
                                    cudaMemcpyDefault, copy));
        return absl::OkStatus();
      };
      if (response_out && !response_direct) {
        ATTN_RETURN_IF_ERROR(enqueue(response.get() + out.out.offset + lo * out_row, out.out.offset,
                                     out_row, lo, hi));
      }
      if (response_lse && !response_direct) {
        ATTN_RETURN_IF_ERROR(enqueue(response.get() + out.lse.offset + lo * lse_row, out.lse.offset,
                                     lse_row, lo, hi));
      }
      for (size_t i = 0; i < calls.size() && any_region; ++i) {
        AttentionCall& c = *calls[i];
        if (refused[i] != 0) continue;
        const int64_t first = merged_.row_begin(i);
        const int64_t from = std::max(lo, first), to = std::min(hi, first + c.total_q);
        auto to_region = [&](CallOutput& o, size_t section, int64_t row_bytes) -> absl::Status {
          if (!o.in_region()) return absl::OkStatus();
          char* dst = static_cast<char*>(o.host ? o.host : o.device);
          return enqueue(dst + (from - first) * row_bytes, section, row_bytes, from, to);
        };
        if (direct.out == nullptr) ATTN_RETURN_IF_ERROR(to_region(c.out, out.out.offset, out_row));
        if (c.return_lse && direct.lse == nullptr) {
          ATTN_RETURN_IF_ERROR(to_region(c.lse, out.lse.offset, lse_row));
        }
      }
      return absl::OkStatus();
    };
    if (chunks.empty()) ATTN_RETURN_IF_ERROR(copy_rows(0, merged_.total_q()));
    for (size_t k = 0; k < chunks.size(); ++k) {
      RETURN_IF_CUDA_ERROR(state_, cudaStreamWaitEvent(copy_stream_, chunk_done_[k]));
      ATTN_RETURN_IF_ERROR(copy_rows(chunks[k].row_begin, chunks[k].row_end));
    }
    if (!chunks.empty()) RETURN_IF_CUDA_ERROR(state_, cudaStreamSynchronize(copy_stream_));
    RETURN_IF_CUDA_ERROR(state_, cudaStreamSynchronize(stream_));
    timer.Next(&stats.execute);

    for (size_t i = 0; i < calls.size(); ++i) {
      AttentionCall& c = *calls[i];
      if (refused[i] != 0) {
        c.refused = NonFiniteInputs(refused[i], g.kind);
        continue;
      }
      const int64_t row = merged_.row_begin(i);
      if (!c.out.in_region()) {
        c.out.result = SharedBytes{response, response.get() + out.out.offset + row * out_row,
                                   static_cast<size_t>(c.total_q * out_row)};
      }
      if (c.return_lse && !c.lse.in_region()) {
        c.lse.result = SharedBytes{response, response.get() + out.lse.offset + row * lse_row,
                                   static_cast<size_t>(c.total_q * lse_row)};
      }
    }
    timer.Next(&stats.finish);
    float ms = 0.f;
    RETURN_IF_CUDA_ERROR(state_, cudaEventElapsedTime(&ms, start_, stop_));
    stats.compute = absl::Microseconds(static_cast<int64_t>(ms * 1e3));
    stats.bytes_in = bytes_in;
    stats.bytes_out = bytes_out;
    inputs_.Trim(in.bytes, kRetainedStagingBytes);
    outputs_.Trim(out.bytes, kRetainedStagingBytes);
    return stats;
  }

 private:
  // What the device staging's page-table and plan sections hold: those of the last launch on a
  // plan's table (LaunchOptions::table_id), with that layout, in that generation of the buffer.
  struct StagedTable {
    uint64_t table_id = 0;
    cuda::InputLayout layout;
    uint64_t generation = 0;
    bool operator==(const StagedTable&) const = default;
  };

  // Where the kernels write a launch's outputs themselves (null: the output buffer, copied after
  // them), and how many bytes that is.
  struct DirectOutputs {
    void* out = nullptr;
    void* lse = nullptr;
    int64_t bytes = 0;
  };

  // A decode launch of one call whose output goes to a shared-memory region of at least
  // direct_output_min_bytes_ has the kernels write it there, over the host link as they finish
  // rows, instead of a copy of all of it after them (the lse too, when it goes to one). A refused
  // call writes nothing into its regions, so Run waits for the verdict of the input check before
  // it queues the attention: a host round trip that the copy it saves must outweigh. Decode only:
  // its kernels write a row per ~4 MB of cache read, far below what their scattered stores reach
  // over PCIe, while a prefill writes at up to ~50 GB/s and was slowed 4.6x by it (8192 tokens:
  // 1.27 -> 5.86 ms; bench/RESULTS.md).
  bool WantsDirectOutputs(absl::Span<AttentionCall* const> calls, int64_t out_row) const {
    if (op_ != Op::kDecode || calls.size() != 1 || direct_output_min_bytes_ <= 0) return false;
    const AttentionCall& c = *calls.front();
    return c.out.host != nullptr && c.total_q * out_row >= direct_output_min_bytes_;
  }

  // The device's addresses of the call's shared-memory outputs (WantsDirectOutputs), for a call
  // the check passed. Registered shared memory is mapped for the device (unified addressing);
  // should the lookup fail, the copy after the kernels stays.
  DirectOutputs DirectOutputsOf(const AttentionCall& c, int64_t out_row, int64_t lse_row) {
    DirectOutputs direct;
    direct.out = DeviceAddress(c.out.host);
    if (direct.out == nullptr) return direct;
    direct.bytes = c.total_q * out_row;
    if (c.return_lse && c.lse.host != nullptr) {
      direct.lse = DeviceAddress(c.lse.host);
      if (direct.lse != nullptr) direct.bytes += c.total_q * lse_row;
    }
    return direct;
  }

  // Points `direct` at the response buffer's output sections, for a decode whose outputs all go
  // to responses; false (and `direct` left alone) for a prefill, or should the buffer's device
  // address not be found (the copy after the kernels then stays). The kernels write the rows
  // over the host link as they finish them, which a decode's kernels do at a row per ~4 MB of
  // cache read (WantsDirectOutputs). Unlike a region, the buffer is the server's own: a refused
  // call's rows are written and never sent, so nothing waits for the input check's verdict.
  // On the H200, a batch-64 decode's copies and waits around the kernels went 54-57 -> 44-47
  // us with its kernel time unchanged (bench/RESULTS.md).
  bool ResponseDirectly(const std::shared_ptr<char>& response, DirectOutputs* direct) const {
    if (op_ != Op::kDecode) return false;
    char* const base = static_cast<char*>(DeviceAddress(response.get()));
    if (base == nullptr) return false;
    const cuda::OutputLayout& out = launch_.outputs();
    direct->out = base + out.out.offset;
    direct->lse = out.lse.bytes > 0 ? base + out.lse.offset : nullptr;
    direct->bytes = static_cast<int64_t>(out.out.bytes + out.lse.bytes);
    return true;
  }

  // Large staging kept for a stream of large launches (Run's Trim) goes back once the lane is
  // idle, and so do large idle response buffers.
  void ReleaseIdle() override {
    inputs_.Trim(0, kRetainedStagingBytes);
    outputs_.Trim(0, kRetainedStagingBytes);
    responses_->ReleaseIdle(kRetainedStagingBytes);
  }

  // Brings one per-call input of every call into its device staging section: bytes of the
  // messages are gathered into pinned staging and copied in runs of adjacent calls; inputs in
  // regions are copied straight from the caller's memory (page-locked host memory, or device
  // memory of this or a peer GPU). Queued on the lane's stream.
  //
  // A run of adjacent calls' bytes is gathered and copied in chunks: each chunk's device copy
  // runs while the next chunk is gathered, and a large chunk is gathered on the backend's
  // gather threads (one core copies the slices at ~5 GB/s: 18 ms of an 8192-token prefill's
  // 96 MB on the H200 host, bench/RESULTS.md).
  absl::Status StageInput(absl::Span<AttentionCall* const> calls, CallInput AttentionCall::*field,
                          const cuda::StagingSection& section, int64_t row_bytes,
                          int64_t* bytes_in) {
    char* const host = inputs_.host() + section.offset;
    char* const device = inputs_.device() + section.offset;
    run_.Clear();
    auto flush = [&]() -> absl::Status {
      for (size_t lo = run_.begin(); lo < run_.end(); lo += kStagingChunkBytes) {
        const size_t hi = std::min(run_.end(), lo + kStagingChunkBytes);
        CopyRun(run_, host, lo, hi, gather_threads_, parallel_for_);
        RETURN_IF_CUDA_ERROR(state_, cudaMemcpyAsync(device + lo, host + lo, hi - lo,
                                                     cudaMemcpyHostToDevice, stream_));
      }
      run_.Clear();
      return absl::OkStatus();
    };
    for (size_t i = 0; i < calls.size(); ++i) {
      const CallInput& x = calls[i]->*field;
      const size_t at = static_cast<size_t>(merged_.row_begin(i) * row_bytes);
      if (x.bytes == 0) continue;
      *bytes_in += static_cast<int64_t>(x.bytes);
      if (x.on_device() || x.registered) {
        ATTN_RETURN_IF_ERROR(flush());
        const void* src = x.on_device() ? static_cast<const void*>(x.device)
                                        : static_cast<const void*>(x.host.contiguous());
        RETURN_IF_CUDA_ERROR(
            state_, cudaMemcpyAsync(device + at, src, x.bytes, cudaMemcpyDefault, stream_));
        continue;
      }
      if (!run_.empty() && run_.end() != at) ATTN_RETURN_IF_ERROR(flush());
      run_.Add(at, &x.host);
    }
    return flush();
  }

 private:
  // Staging up to this size stays between launches whatever they use.
  static constexpr size_t kRetainedStagingBytes = size_t{64} << 20;
  // Gathered bytes per device copy of a run (StageInput): small enough that the copies overlap
  // the gather, large enough that each copy runs near the host link's rate.
  static constexpr size_t kStagingChunkBytes = size_t{8} << 20;

  const CudaPool& pool_;
  const Op op_;
  DeviceState& state_;
  const int device_;
  const int64_t workspace_bytes_;
  const int64_t direct_output_min_bytes_;
  const int64_t output_chunk_bytes_;  // 0: launches are not chunked (CudaBackendOptions)
  const bool owns_stream_;
  cudaStream_t stream_ = nullptr;
  // A chunked launch's output copies, each after its chunk's event (output_chunk_bytes_ only).
  cudaStream_t copy_stream_ = nullptr;
  std::array<cudaEvent_t, cuda::kMaxOutputChunks> chunk_done_{};
  cudaEvent_t start_ = nullptr, stop_ = nullptr;
  cudaEvent_t checked_ = nullptr;  // the finiteness verdicts are on the host
  StagedTable staged_table_;       // none (table_id 0) after a launch that failed before its copy
  void* workspace_ = nullptr;
  cuda::KernelTiling tiling_;
  cuda::KernelTiling short_prefill_;  // GQA prefill lanes: one-CTA sequences on the decode kernel
  int64_t max_partial_rows_ = 0;      // rows of the workspace
  // Reused across launches.
  MergedBatch merged_;
  // The launch's CallChecks::refused (uint32 per call), copied back: pinned host memory only.
  StagingPair refused_{/*with_host=*/true, /*with_device=*/false};
  cuda::LaunchPlan launch_;
  StagingPair inputs_;
  StagingPair outputs_;  // device only: outputs go to regions or into `responses_`
  std::unique_ptr<OutputBuffers> responses_;
  HostRun run_;  // StageInput's run of message bytes
  // The backend's gather threads (shared by its lanes): threads one gather uses at most.
  const int gather_threads_;
  const ParallelFor parallel_for_;
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
      RETURN_IF_CUDA_ERROR(state_,
                           cudaStreamCreateWithFlags(&shared_stream_, cudaStreamNonBlocking));
    }
    RETURN_IF_CUDA_ERROR(state_, cudaStreamCreateWithFlags(&scrub_stream_, cudaStreamNonBlocking));
    return absl::OkStatus();
  }

  std::string name() const override { return "cuda"; }
  // On the device, in the launch (kernels/cuda/check_finite.cu): inputs in CUDA IPC regions
  // included, and at memory speed.
  bool ChecksFiniteInputs() const override { return true; }
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
    auto lane =
        std::make_unique<CudaLane>(*pools_[pool], op, state_, options_, shared_stream_, gather_);
    if (absl::Status st = lane->Init(); !st.ok()) return st;
    return std::unique_ptr<Lane>(std::move(lane));
  }

  absl::StatusOr<std::unique_ptr<MappedMemory>> MapRegion(
      const RegionSpec& spec, absl::string_view shm_name_prefix) override {
    if (state_.poisoned()) return state_.Poisoned();
    return MapCudaRegion(spec, options_.device, shm_name_prefix);
  }

 private:
  CudaBackendOptions options_;
  DeviceState state_;
  cudaDeviceProp props_{};
  cudaStream_t shared_stream_ = nullptr;  // only with options_.single_stream
  absl::Mutex scrub_mu_;                  // one ScrubPages at a time
  cudaStream_t scrub_stream_ = nullptr;
  std::vector<std::unique_ptr<CudaPool>> pools_;
  // Gathers message bytes into the lanes' pinned staging: the caller and up to three workers
  // (a few cores reach most of a host's copy bandwidth; more would take cores from gRPC).
  cpu::ThreadPool gather_{std::min(3, cpu::ThreadPool::DefaultNumWorkers())};
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
