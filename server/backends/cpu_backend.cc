#include "server/backends/cpu_backend.h"

#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <fstream>

#include "absl/strings/str_cat.h"
#include "absl/strings/strip.h"
#include "kernels/cpu/cpu_attention.h"
#include "kernels/cpu/thread_pool.h"
#include "server/backends/merged_batch.h"
#include "server/backends/output_buffers.h"
#include "server/backends/shared_memory.h"

namespace attn {
namespace {

// Zero-filled anonymous mapping: pages cost memory only once written.
class HostBuffer {
 public:
  static absl::StatusOr<std::unique_ptr<HostBuffer>> Create(size_t bytes) {
    void* p = mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (p == MAP_FAILED) {
      return absl::ResourceExhaustedError(
          absl::StrCat("cannot map ", bytes, " bytes for a pool: ", std::strerror(errno)));
    }
    return std::unique_ptr<HostBuffer>(new HostBuffer(p, bytes));
  }
  ~HostBuffer() { munmap(data_, bytes_); }
  bf16* data() const { return static_cast<bf16*>(data_); }

  // Zeroes bytes [at, at + n): whole OS pages inside the range are dropped (the mapping reads
  // zeros there again, and the process gives the memory back), the ragged ends are memset.
  void Zero(size_t at, size_t n) {
    static const size_t os_page = static_cast<size_t>(sysconf(_SC_PAGESIZE));
    char* const begin = static_cast<char*>(data_) + at;
    char* const end = begin + n;
    const uintptr_t lo = (reinterpret_cast<uintptr_t>(begin) + os_page - 1) / os_page * os_page;
    const uintptr_t hi = reinterpret_cast<uintptr_t>(end) / os_page * os_page;
    if (hi > lo && madvise(reinterpret_cast<void*>(lo), hi - lo, MADV_DONTNEED) == 0) {
      std::memset(begin, 0, reinterpret_cast<char*>(lo) - begin);
      std::memset(reinterpret_cast<char*>(hi), 0, end - reinterpret_cast<char*>(hi));
    } else {
      std::memset(begin, 0, n);
    }
  }

 private:
  HostBuffer(void* data, size_t bytes) : data_(data), bytes_(bytes) {}
  void* data_;
  size_t bytes_;
};

// Scratch a lane keeps after a launch (more is returned): the inputs and outputs of a decode
// batch of a few hundred sequences, or a prefill of a few thousand tokens.
constexpr int64_t kRetainedScratchBytes = int64_t{64} << 20;

struct CpuPool {
  PoolGeometry geometry;
  std::unique_ptr<HostBuffer> storage;
};

class CpuLane final : public Lane {
 public:
  CpuLane(const CpuPool& pool, Op op, cpu::ThreadPool& workers)
      : pool_(pool), op_(op), workers_(workers), outputs_(OutputBuffers::Host()) {}

  absl::StatusOr<LaunchStats> Run(absl::Span<AttentionCall* const> calls) override {
    LaunchStats stats;
    StageTimer timer;
    merged_.Build(calls);
    const PoolGeometry& g = pool_.geometry;
    const bool appends = calls.front()->appends();
    const bool want_lse = std::any_of(calls.begin(), calls.end(),
                                      [](const AttentionCall* c) { return c->return_lse; });
    const int64_t rows = merged_.total_q();
    const RowShapes& shape = g.rows();
    // out then lse, in one buffer the responses are sent from.
    const int64_t out_row_bytes = shape.out.elements() * int64_t{sizeof(bf16)};
    const int64_t lse_row_bytes = want_lse ? shape.lse * int64_t{sizeof(float)} : 0;
    const int64_t lse_at = (rows * out_row_bytes + 63) / 64 * 64;
    absl::StatusOr<std::shared_ptr<char>> buffer =
        outputs_->Get(static_cast<size_t>(lse_at + rows * lse_row_bytes));
    if (!buffer.ok()) return buffer.status();
    bf16* const out = reinterpret_cast<bf16*>(buffer->get());
    float* const lse = want_lse ? reinterpret_cast<float*>(buffer->get() + lse_at) : nullptr;
    int64_t in_elems = 0;  // bf16 inputs gathered for the launch
    // Gathers one per-call input into a merged scratch buffer; returns the buffer.
    auto gather = [&](CallInput AttentionCall::*field, const RowShape& row,
                      std::vector<bf16>& dst) {
      dst.resize(rows * row.elements());
      GatherRows(calls, merged_, field, row.elements() * int64_t{sizeof(bf16)},
                 reinterpret_cast<char*>(dst.data()), workers_.MaxParallelism(), parallel_for_);
      in_elems += rows * row.elements();
      return dst.data();
    };
    const bf16* q = gather(&AttentionCall::q, shape.q, q_);
    const bf16* q_pe =
        shape.q_pe.present() ? gather(&AttentionCall::q_pe, shape.q_pe, q_pe_) : nullptr;
    const bf16* k_new = appends ? gather(&AttentionCall::k_new, shape.k_new, k_) : nullptr;
    const bf16* v_new = appends ? gather(&AttentionCall::v_new, shape.v_new, v_) : nullptr;

    if (g.kind == PoolKind::kGqa) {
      GqaParams p;
      p.cache = g.GqaView(pool_.storage->data());
      p.batch = merged_.View(op_);
      p.num_qo_heads = g.num_qo_heads;
      p.q = q;
      p.k_new = k_new;
      p.v_new = v_new;
      p.out = out;
      p.lse = lse;
      p.sm_scale = calls.front()->sm_scale;
      timer.Next(&stats.prepare);
      cpu::GqaAppendKv(p, workers_);
      cpu::GqaAttention(p, workers_);
    } else {
      MlaParams p;
      p.cache = g.MlaView(pool_.storage->data());
      p.batch = merged_.View(op_);
      p.num_heads = g.num_qo_heads;
      p.q_nope = q;
      p.q_pe = q_pe;
      p.ckv_new = k_new;
      p.kpe_new = v_new;
      p.out = out;
      p.lse = lse;
      p.sm_scale = calls.front()->sm_scale;
      timer.Next(&stats.prepare);
      cpu::MlaAppendKv(p, workers_);
      cpu::MlaAttention(p, workers_);
    }
    timer.Next(&stats.execute);
    stats.compute = stats.execute;
    ScatterOutputs(calls, merged_, *buffer, reinterpret_cast<const char*>(out), out_row_bytes,
                   reinterpret_cast<const char*>(lse), lse_row_bytes);
    timer.Next(&stats.finish);
    stats.bytes_in = in_elems * static_cast<int64_t>(sizeof(bf16));
    stats.bytes_out = rows * (out_row_bytes + lse_row_bytes);
    TrimScratch();
    return stats;
  }

  // Scratch the lane keeps between launches, in bytes.
  int64_t retained_bytes() const {
    return static_cast<int64_t>(
        (q_.capacity() + q_pe_.capacity() + k_.capacity() + v_.capacity()) * sizeof(bf16));
  }

 private:
  const CpuPool& pool_;
  const Op op_;
  cpu::ThreadPool& workers_;
  // Large gathers run on the workers too (GatherRows).
  const ParallelFor parallel_for_ = [this](int64_t n, const std::function<void(int64_t)>& fn) {
    workers_.ParallelFor(n, fn);
  };
  // Scratch a large launch grew is given back after it, so one large call does not keep its
  // memory for the life of the process (OutputBuffers does the same for the outputs); the steady
  // state of ordinary calls allocates nothing.
  void TrimScratch() {
    if (retained_bytes() <= kRetainedScratchBytes) return;
    for (std::vector<bf16>* v : {&q_, &q_pe_, &k_, &v_}) std::vector<bf16>().swap(*v);
  }

  // Scratch reused across launches: the lane's steady state allocates nothing.
  MergedBatch merged_;
  std::vector<bf16> q_, q_pe_, k_, v_;
  std::unique_ptr<OutputBuffers> outputs_;  // the launches' outputs, sent from where they are
};

std::string CpuModelName() {
  std::ifstream cpuinfo("/proc/cpuinfo");
  std::string line;
  while (std::getline(cpuinfo, line)) {
    if (absl::StartsWith(line, "model name")) {
      const size_t colon = line.find(':');
      if (colon != std::string::npos) return std::string(absl::StripLeadingAsciiWhitespace(
                                                  absl::string_view(line).substr(colon + 1)));
    }
  }
  return "unknown CPU";
}

class CpuBackend final : public Backend {
 public:
  explicit CpuBackend(int threads)
      : workers_(threads > 0 ? threads - 1 : cpu::ThreadPool::DefaultNumWorkers()) {}

  std::string name() const override { return "cpu"; }
  std::string device() const override {
    return absl::StrCat(CpuModelName(), " (", workers_.MaxParallelism(), " threads)");
  }

  absl::Status AddPool(const PoolGeometry& geometry) override {
    auto storage = HostBuffer::Create(geometry.TotalBytes());
    if (!storage.ok()) return storage.status();
    pools_.push_back(std::make_unique<CpuPool>(CpuPool{geometry, std::move(*storage)}));
    return absl::OkStatus();
  }

  absl::StatusOr<std::unique_ptr<Lane>> CreateLane(int pool, Op op) override {
    if (pool < 0 || pool >= static_cast<int>(pools_.size())) {
      return absl::InvalidArgumentError(absl::StrCat("no pool number ", pool));
    }
    return std::unique_ptr<Lane>(new CpuLane(*pools_[pool], op, workers_));
  }

  absl::StatusOr<std::unique_ptr<MappedMemory>> MapRegion(
      const RegionSpec& spec, absl::string_view shm_name_prefix) override {
    if (spec.kind != RegionKind::kSharedMemory) {
      return absl::UnimplementedError("the CPU backend cannot map CUDA memory");
    }
    absl::StatusOr<std::unique_ptr<SharedMemoryMapping>> mapping =
        MapSharedMemory(spec, shm_name_prefix);
    if (!mapping.ok()) return mapping.status();
    return std::unique_ptr<MappedMemory>(*std::move(mapping));
  }

  absl::Status ScrubPages(int pool, absl::Span<const int32_t> pages) override {
    if (pool < 0 || pool >= static_cast<int>(pools_.size())) {
      return absl::InvalidArgumentError(absl::StrCat("no pool number ", pool));
    }
    const PoolGeometry& g = pools_[pool]->geometry;
    // Layout [layers, pages, page bytes]: runs of consecutive ids are one range per layer.
    const size_t page_bytes = static_cast<size_t>(g.BytesPerPage() / g.num_layers);
    const size_t layer_bytes = page_bytes * g.num_pages;
    std::vector<int32_t> ids(pages.begin(), pages.end());
    std::sort(ids.begin(), ids.end());
    for (size_t i = 0; i < ids.size();) {
      size_t j = i + 1;
      while (j < ids.size() && ids[j] == ids[j - 1] + 1) ++j;
      for (int layer = 0; layer < g.num_layers; ++layer) {
        pools_[pool]->storage->Zero(layer * layer_bytes + ids[i] * page_bytes,
                                    (j - i) * page_bytes);
      }
      i = j;
    }
    return absl::OkStatus();
  }

 private:
  cpu::ThreadPool workers_;
  std::vector<std::unique_ptr<CpuPool>> pools_;
};

}  // namespace

std::unique_ptr<Backend> CreateCpuBackend(int threads) {
  return std::make_unique<CpuBackend>(threads);
}

}  // namespace attn
