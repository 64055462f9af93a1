// kernel_bench: times the CUDA attention kernels on the named shapes of the published workloads,
// with the L2 flushed before every run, and reports median time, TFLOP/s, TB/s and the fraction
// of the device-to-device copy bandwidth measured in the same run. bench/anchors.py measures the
// same shapes with torch's SDPA backends (and the cuBLAS GEMM ceiling); bench/report.py joins the
// two JSON files into bench/RESULTS.md's table.
//
//   kernel_bench [--json FILE] [--filter REGEX] [--runs N] [--prefill_variants 0,26]
//                [--mla_variants 0,41] [--decode_variants 0,1] [--min_chunk KEYS] [--waves W]
//                [--split_waves W] [--no_split_fill F] [--sequential_pages] [--page_size P]
//                [--stamps DIR] [--decode_shapes [QO/KV:|mlaH:]BxKEYSpPAGE,...]
//
// --filter keeps the shapes whose name the regular expression (ECMAScript) matches a part of, so
// one start (~20 s of setup on the H200) can measure several families: 'gqa_prefill|seed_'.
//
// --min_chunk takes a list too (0: the kernel's own), measured for every variant. --waves sets the
// planner's target waves when it splits keys, --split_waves the waves below which it splits
// (ignoring the kernel's fill test): with `--split_waves 1000 --waves 1000 --min_chunk 512,1024`
// every sequence longer than the chunk is split into chunks of that many keys. --no_split_fill
// keeps whole a plan whose CTAs keep at least that share of the slots busy to the end
// (PlanConfig::no_split_fill) in place of the kernel's own tests, one wave or more alike: with
// `--no_split_fill 0.9` the GQA decode plans as it did before its one-wave test.
//
// The variant lists name kernels (KernelTiling::variant) to measure side by side on each shape of
// their family; each shape's batch is built once for all of them.
//
// --sequential_pages hands every sequence contiguous pages instead of shuffled ones: the
// difference is what scattered page reads cost a kernel. --page_size P runs every selected shape
// on pages of P keys instead of its own (named <shape>_at_p<P>): the page-1 MLA seed at page 64
// is its queries and keys on the page-64 prefill's key tiles.
//
// --decode_shapes adds head_dim-128 GQA decodes of the given heads (32/8 unless named), batch,
// keys and page size, named gqa_decode_<QO>/<KV>_b<B>x<KEYS>_p<PAGE> like the standard ones, which
// --filter still selects among. `32x8192p16,128x2048p16`: the bytes of b64 x 4096 in half and
// twice the CTAs; `4/1:512x4096p4096`: its CTAs and bytes with each CTA's K and V contiguous (one
// KV head, one page a sequence), as SDPA's head-major tensors lay them out. `mla<H>:` makes it an
// MLA decode of H heads (mla_decode_<H>h_b<B>x<KEYS>_p<PAGE>): `mla128:64x4096p64`.
//
// --stamps DIR runs the stamped GQA prefill (kGqaPrefillSm90Stamped: the default's kernel with
// phase stamps) once more on every GQA prefill shape of head_dim 128, and the stamped persistent
// MLA kernels (kMlaSm90Stamped, and the split-Q trial's kMlaSm90StampedSplitQ) on every MLA
// prefill shape, after a flush, and writes their phase
// stamps to DIR/<shape>_v<variant>.stamps (one work a line: a CTA of the GQA prefill, an item of
// the MLA kernel; the kPhaseStampSlots slots of kernels/cuda/api.h's PhaseSlot); bench/stamps.py
// says where the time went.
#include <cuda_runtime_api.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <functional>
#include <future>
#include <memory>
#include <optional>
#include <random>
#include <regex>
#include <sstream>
#include <string>
#include <vector>

#include "kernels/cuda/api.h"
#include "kernels/cuda/plan.h"
#include "kernels/testing/device_batch.h"
#include "kernels/testing/paged_batch_builder.h"

namespace attn::bench {
namespace {

using testing::BatchOptions;
using testing::DeviceBatch;
using testing::SeqSpec;

#define CHECK_CUDA(expr)                                                                           \
  do {                                                                                             \
    const cudaError_t _err = (expr);                                                               \
    if (_err != cudaSuccess) {                                                                     \
      std::fprintf(stderr, "%s:%d %s: %s\n", __FILE__, __LINE__, #expr, cudaGetErrorString(_err)); \
      std::exit(1);                                                                                \
    }                                                                                              \
  } while (0)

struct Shape {
  std::string name;
  bool mla = false;
  int qo_heads = 0, kv_heads = 1, head_dim = 128, page_size = 16;
  bool decode = false;
  std::vector<SeqSpec> seqs;  // kv_len includes the query tokens (the cache after the append)
};

struct Result {
  Shape shape;
  int variant = -1;  // GQA prefill tile shape, GQA decode variant or MLA kernel (-1: default)
  double median_us = 0, tflops = 0, tbps = 0;
  size_t items = 0;
  int chunk_len = 0;
};

std::vector<SeqSpec> Uniform(int batch, int q_len, int kv_len) {
  return std::vector<SeqSpec>(batch, SeqSpec{q_len, kv_len, 0});
}

Shape GqaDecode(int qo_heads, int kv_heads, int batch, int keys, int page) {
  const std::string name = "gqa_decode_" + std::to_string(qo_heads) + "/" +
                           std::to_string(kv_heads) + "_b" + std::to_string(batch) + "x" +
                           std::to_string(keys) + "_p" + std::to_string(page);
  return {name, false, qo_heads, kv_heads, 128, page, true, Uniform(batch, 1, keys)};
}

Shape MlaDecode(int heads, int batch, int keys, int page) {
  const std::string name = "mla_decode_" + std::to_string(heads) + "h_b" + std::to_string(batch) +
                           "x" + std::to_string(keys) + "_p" + std::to_string(page);
  return {name, true, heads, 1, 0, page, true, Uniform(batch, 1, keys)};
}

// One --decode_shapes entry, [QO/KV:|mlaH:]BxKEYSpPAGE, or nullopt if it is not one.
std::optional<Shape> ParseDecodeShape(const std::string& spec) {
  int qo = 32, kv = 8, mla_heads = 0, batch = 0, keys = 0, page = 0, used = 0;
  const bool mla = spec.rfind("mla", 0) == 0;
  if (mla) {
    std::sscanf(spec.c_str(), "mla%d:%n", &mla_heads, &used);
    if (used == 0 || mla_heads < 1) return std::nullopt;
  } else if (std::sscanf(spec.c_str(), "%d/%d:%n", &qo, &kv, &used) < 2 || used == 0) {
    qo = 32, kv = 8, used = 0;  // the heads are optional
  }
  char x = 0, p = 0;
  int end = 0;
  if (std::sscanf(spec.c_str() + used, "%d%c%d%c%d%n", &batch, &x, &keys, &p, &page, &end) != 5 ||
      used + end != static_cast<int>(spec.size()) || x != 'x' || p != 'p' || batch < 1 ||
      keys < 1 || page < 1 || kv < 1 || qo < kv || qo % kv != 0) {
    return std::nullopt;
  }
  return mla ? MlaDecode(mla_heads, batch, keys, page) : GqaDecode(qo, kv, batch, keys, page);
}

std::vector<Shape> Shapes() {
  std::vector<Shape> s;
  for (int page : {1, 16, 64}) s.push_back(GqaDecode(32, 8, 64, 4096, page));
  for (int page : {1, 16, 64}) s.push_back(GqaDecode(32, 8, 1, 16384, page));
  s.push_back(GqaDecode(40, 10, 128, 2048, 16));
  s.push_back(
      {"gqa_prefill_32/8_8192_causal_p16", false, 32, 8, 128, 16, false, Uniform(1, 8192, 8192)});
  s.push_back(
      {"gqa_prefill_32/8_4096_causal_p16", false, 32, 8, 128, 16, false, Uniform(1, 4096, 4096)});
  s.push_back({"gqa_prefill_40/10_8x512_on_1024_p16", false, 40, 10, 128, 16, false,
               Uniform(8, 512, 1536)});
  s.push_back({"gqa_prefill_20/4_1117_on_71488_p64", false, 20, 4, 128, 64, false,
               Uniform(1, 1117, 71488 + 1117)});
  s.push_back(MlaDecode(16, 64, 4096, 64));
  s.push_back(MlaDecode(128, 128, 4096, 64));
  // MLA prefill: 6053 new tokens over 11 sequences (the published shape's token count).
  std::vector<SeqSpec> mla_prefill;
  std::mt19937 rng(11);
  int total = 0;
  for (int i = 0; i < 11; ++i) {
    const int q = i == 10 ? 6053 - total : 300 + static_cast<int>(rng() % 250);  // sums to 6053
    total += q;
    mla_prefill.push_back({q, q + static_cast<int>(rng() % 4000), 0});
  }
  s.push_back({"mla_prefill_16h_6053_11seqs_p64", true, 16, 1, 0, 64, false, mla_prefill});
  // The published seed shapes (names as ../shared/tools/flashinfer measures them): one query on
  // one key at 40/10 heads and page size 1, the pure cost of a launch; and MLA at page size 1,
  // the prefill's 6053 queries on 6091 keys (38 cached keys over the 11 sequences: the first 5
  // get 4, the rest 3).
  s.push_back({"seed_gqa_h40kv10_ps1_q1", false, 40, 10, 128, 1, false, Uniform(1, 1, 1)});
  std::vector<SeqSpec> mla_seed = mla_prefill;
  for (int i = 0; i < 11; ++i) mla_seed[i].kv_len = mla_seed[i].q_len + (i < 5 ? 4 : 3);
  s.push_back({"seed_mla_h16_ps1_6053_on_6091", true, 16, 1, 0, 1, false, mla_seed});
  return s;
}

// FLOPs (QK^T and PV, causal) and the fewest bytes a launch must move (KV read once, Q read,
// output written).
void Count(const Shape& s, double* flops, double* bytes) {
  const int q_dim = s.mla ? kMlaTokenDim : s.head_dim;
  const int v_dim = s.mla ? kMlaCkvDim : s.head_dim;
  const double kv_row_bytes = s.mla ? kMlaTokenDim * 2.0 : 2.0 * s.kv_heads * s.head_dim * 2;
  *flops = 0;
  *bytes = 0;
  for (const SeqSpec& q : s.seqs) {
    for (int i = 0; i < q.q_len; ++i) {
      *flops += 2.0 * s.qo_heads * (q_dim + v_dim) * VisibleKeys(q.q_len, q.kv_len, i, true);
    }
    *bytes += q.kv_len * kv_row_bytes + q.q_len * s.qo_heads * (q_dim + v_dim) * 2.0;
  }
}

// Median of `runs` timings of fn, each after the L2 was overwritten.
double TimeMedianUs(const std::function<void()>& fn, int runs, void* flush, size_t flush_bytes) {
  cudaEvent_t start, stop;
  CHECK_CUDA(cudaEventCreate(&start));
  CHECK_CUDA(cudaEventCreate(&stop));
  for (int i = 0; i < 3; ++i) fn();  // warm-up: module load, first-touch
  std::vector<float> ms;
  for (int i = 0; i < runs; ++i) {
    CHECK_CUDA(cudaMemsetAsync(flush, i & 0xff, flush_bytes));
    CHECK_CUDA(cudaEventRecord(start));
    fn();
    CHECK_CUDA(cudaEventRecord(stop));
    CHECK_CUDA(cudaEventSynchronize(stop));
    float t = 0;
    CHECK_CUDA(cudaEventElapsedTime(&t, start, stop));
    ms.push_back(t);
  }
  CHECK_CUDA(cudaEventDestroy(start));
  CHECK_CUDA(cudaEventDestroy(stop));
  std::sort(ms.begin(), ms.end());
  return ms[ms.size() / 2] * 1e3;
}

// Device-to-device copy bandwidth, counting bytes read plus bytes written.
double CopyTbps(void* flush, size_t flush_bytes) {
  const size_t bytes = size_t{2} << 30;
  void *a, *b;
  CHECK_CUDA(cudaMalloc(&a, bytes));
  CHECK_CUDA(cudaMalloc(&b, bytes));
  CHECK_CUDA(cudaMemset(a, 1, bytes));
  const double us =
      TimeMedianUs([&] { CHECK_CUDA(cudaMemcpyAsync(b, a, bytes, cudaMemcpyDeviceToDevice)); }, 10,
                   flush, flush_bytes);
  CHECK_CUDA(cudaFree(a));
  CHECK_CUDA(cudaFree(b));
  return 2.0 * bytes / (us * 1e-6) / 1e12;
}

// A shape's host batch, built once for every variant measured on it.
struct HostBatch {
  testing::GqaHostBatch gqa;
  testing::MlaHostBatch mla;
};

HostBatch MakeBatch(const Shape& s, bool shuffle_pages) {
  std::mt19937_64 rng(42);
  BatchOptions o;
  o.decode = s.decode;
  o.with_lse = true;
  o.extra_pages = 0;
  o.shuffle_pages = shuffle_pages;
  HostBatch h;
  if (s.mla) {
    o.sm_scale = 0.1352337747812271f;
    h.mla = testing::MakeMlaBatch({1, s.page_size, s.qo_heads}, s.seqs, o, rng);
  } else {
    h.gqa =
        testing::MakeGqaBatch({1, s.page_size, s.qo_heads, s.kv_heads, s.head_dim}, s.seqs, o, rng);
  }
  return h;
}

Result Measure(const Shape& s, HostBatch& h, int variant, const testing::PlanOverrides& overrides,
               int runs, void* flush, size_t flush_bytes) {
  std::unique_ptr<DeviceBatch> d;
  if (s.mla) {
    CHECK_CUDA(DeviceBatch::Create(h.mla, &d, variant, overrides));
  } else {
    CHECK_CUDA(DeviceBatch::Create(h.gqa, &d, variant, overrides));
  }
  Result r;
  r.shape = s;
  r.variant = variant;
  r.items = d->plan().items.size();
  r.chunk_len = d->plan().chunk_len;
  r.median_us =
      TimeMedianUs([&] { CHECK_CUDA(d->RunAttention(nullptr)); }, runs, flush, flush_bytes);
  double flops, bytes;
  Count(s, &flops, &bytes);
  r.tflops = flops / (r.median_us * 1e-6) / 1e12;
  r.tbps = bytes / (r.median_us * 1e-6) / 1e12;
  return r;
}

// One run of a stamped prefill on `h` (timed by the stamps themselves), its records written to
// DIR/<shape>_v<variant>.stamps.
void WriteStamps(const Shape& s, HostBatch& h, int variant, const std::string& dir, void* flush,
                 size_t flush_bytes) {
  std::unique_ptr<DeviceBatch> d;
  if (s.mla) {
    CHECK_CUDA(DeviceBatch::Create(h.mla, &d, variant));
  } else {
    CHECK_CUDA(DeviceBatch::Create(h.gqa, &d, variant));
  }
  // A record a CTA of the GQA prefill, a record an item of the persistent MLA kernel.
  const int ctas = static_cast<int>(d->plan().items.size()) * (s.mla ? 1 : s.kv_heads);
  const size_t bytes = sizeof(uint64_t) * ctas * cuda::kPhaseStampSlots;
  void* buffer;
  CHECK_CUDA(cudaMalloc(&buffer, bytes));
  auto* records = static_cast<uint64_t*>(buffer);
  const auto set = s.mla ? cuda::SetMlaPhaseStamps : cuda::SetGqaPrefillPhaseStamps;
  CHECK_CUDA(set({records, ctas}));
  for (int i = 0; i < 3; ++i) CHECK_CUDA(d->RunAttention(nullptr));  // warm-up
  CHECK_CUDA(cudaMemset(records, 0, bytes));
  CHECK_CUDA(cudaMemsetAsync(flush, 1, flush_bytes));
  CHECK_CUDA(d->RunAttention(nullptr));
  std::vector<uint64_t> host(bytes / sizeof(uint64_t));
  CHECK_CUDA(cudaMemcpy(host.data(), records, bytes, cudaMemcpyDeviceToHost));
  CHECK_CUDA(set({}));
  CHECK_CUDA(cudaFree(records));
  std::string file = s.name + "_v" + std::to_string(variant);
  std::replace(file.begin(), file.end(), '/', '-');
  std::ofstream f(dir + "/" + file + ".stamps");
  for (int c = 0; c < ctas; ++c) {
    for (int i = 0; i < cuda::kPhaseStampSlots; ++i) {
      f << (i ? " " : "") << host[static_cast<size_t>(c) * cuda::kPhaseStampSlots + i];
    }
    f << "\n";
  }
  std::printf("%-40s stamps of %d works in %s/%s.stamps\n", s.name.c_str(), ctas, dir.c_str(),
              file.c_str());
}

int Main(int argc, char** argv) {
  std::string json, filter, stamps_dir;
  int runs = 30;
  bool shuffle_pages = true;
  int page_size = 0;  // 0: each shape's own
  std::vector<int> variants{-1}, mla_variants{-1}, decode_variants{-1};
  auto parse_list = [](const char* arg) {
    std::vector<int> list;
    std::stringstream in(arg);
    for (std::string v; std::getline(in, v, ',');) list.push_back(std::stoi(v));
    return list;
  };
  testing::PlanOverrides overrides;
  std::vector<int> min_chunks{0};  // 0: the kernel's own
  std::vector<Shape> all_shapes = Shapes();
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    if (a == "--json" && i + 1 < argc)
      json = argv[++i];
    else if (a == "--filter" && i + 1 < argc)
      filter = argv[++i];
    else if (a == "--runs" && i + 1 < argc)
      runs = std::atoi(argv[++i]);
    else if (a == "--sequential_pages")
      shuffle_pages = false;
    else if (a == "--page_size" && i + 1 < argc)
      page_size = std::atoi(argv[++i]);
    else if (a == "--stamps" && i + 1 < argc)
      stamps_dir = argv[++i];
    else if (a == "--min_chunk" && i + 1 < argc)
      min_chunks = parse_list(argv[++i]);
    else if (a == "--waves" && i + 1 < argc)
      overrides.target_waves = std::atof(argv[++i]);
    else if (a == "--split_waves" && i + 1 < argc)
      overrides.waves_before_split = std::atof(argv[++i]);
    else if (a == "--no_split_fill" && i + 1 < argc)
      overrides.no_split_fill = std::atof(argv[++i]);
    else if (a == "--prefill_variants" && i + 1 < argc)
      variants = parse_list(argv[++i]);
    else if (a == "--mla_variants" && i + 1 < argc)
      mla_variants = parse_list(argv[++i]);
    else if (a == "--decode_variants" && i + 1 < argc)
      decode_variants = parse_list(argv[++i]);
    else if (a == "--decode_shapes" && i + 1 < argc) {
      std::stringstream in(argv[++i]);
      for (std::string spec; std::getline(in, spec, ',');) {
        const std::optional<Shape> shape = ParseDecodeShape(spec);
        if (!shape) {
          std::fprintf(stderr,
                       "kernel_bench: --decode_shapes wants [QO/KV:|mlaH:]BxKEYSpPAGE, got '%s'\n",
                       spec.c_str());
          return 2;
        }
        all_shapes.push_back(*shape);
      }
    } else {
      std::fprintf(stderr,
                   "usage: kernel_bench [--json FILE] [--filter REGEX] [--runs N] "
                   "[--prefill_variants 0,26] [--mla_variants 0,41] [--decode_variants 0,1] "
                   "[--min_chunk KEYS] [--waves W] [--split_waves W] [--no_split_fill F] "
                   "[--sequential_pages] [--page_size P] [--stamps DIR] "
                   "[--decode_shapes [QO/KV:|mlaH:]BxKEYSpPAGE,...]\n");
      return 2;
    }
  }
  if (!testing::CudaDeviceAvailable()) {
    std::fprintf(stderr, "kernel_bench: no CUDA device\n");
    return 1;
  }
  cudaDeviceProp prop;
  CHECK_CUDA(cudaGetDeviceProperties(&prop, 0));
  const size_t flush_bytes = size_t{2} * prop.l2CacheSize;
  void* flush;
  CHECK_CUDA(cudaMalloc(&flush, flush_bytes));

  const double copy_tbps = CopyTbps(flush, flush_bytes);
  std::printf("device %s, %d SMs, L2 %d MiB; copy ceiling %.2f TB/s (read + write)\n", prop.name,
              prop.multiProcessorCount, prop.l2CacheSize >> 20, copy_tbps);
  std::printf("%-40s %10s %8s %7s %7s %7s %6s\n", "shape", "median_us", "TFLOP/s", "TB/s",
              "of_copy", "items", "chunk");
  std::vector<Shape> shapes;
  for (Shape s : all_shapes) {
    if (!filter.empty() && !std::regex_search(s.name, std::regex(filter))) continue;
    if (page_size > 0) {
      s.page_size = page_size;
      s.name += "_at_p" + std::to_string(page_size);
    }
    shapes.push_back(s);
  }
  // The host batches of the next kBuildAhead shapes are built on threads of their own (a 1 GiB
  // cache takes seconds to fill) while the GPU measures the current one; few enough that the
  // launching thread keeps a core.
  constexpr size_t kBuildAhead = 6;
  std::vector<std::future<HostBatch>> batches(shapes.size());
  std::vector<Result> results;
  for (size_t si = 0; si < shapes.size(); ++si) {
    for (size_t b = si; b < std::min(si + kBuildAhead, shapes.size()); ++b) {
      if (!batches[b].valid()) {
        batches[b] = std::async(std::launch::async, MakeBatch, shapes[b], shuffle_pages);
      }
    }
    const Shape& s = shapes[si];
    const bool has_variants = !s.mla && !s.decode && s.head_dim <= 128;
    const std::vector<int>& list = s.mla          ? mla_variants
                                   : s.decode     ? decode_variants
                                   : has_variants ? variants
                                                  : std::vector<int>{-1};
    HostBatch h = batches[si].get();
    for (int v : list) {
      for (int min_chunk : min_chunks) {
        overrides.min_chunk_len = min_chunk;
        Result r = Measure(s, h, v, overrides, runs, flush, flush_bytes);
        if (v > 0 || (v == 0 && (s.mla || s.decode))) r.shape.name += "_v" + std::to_string(v);
        if (min_chunks.size() > 1) r.shape.name += "_c" + std::to_string(min_chunk);
        std::printf("%-40s %10.1f %8.1f %7.2f %6.0f%% %7zu %6d\n", r.shape.name.c_str(),
                    r.median_us, r.tflops, r.tbps, 100.0 * r.tbps / copy_tbps, r.items,
                    r.chunk_len);
        std::fflush(stdout);
        results.push_back(r);
      }
    }
    if (!stamps_dir.empty() && has_variants && s.head_dim == 128) {
      WriteStamps(s, h, cuda::kGqaPrefillSm90Stamped, stamps_dir, flush, flush_bytes);
    }
    if (!stamps_dir.empty() && s.mla && !s.decode) {
      for (int stamped : {cuda::kMlaSm90Stamped, cuda::kMlaSm90StampedSplitQ}) {
        WriteStamps(s, h, stamped, stamps_dir, flush, flush_bytes);
      }
    }
  }
  if (!json.empty()) {
    std::ofstream f(json);
    f << "{\"device\": \"" << prop.name << "\", \"copy_tbps\": " << copy_tbps << ", \"shapes\": [";
    for (size_t i = 0; i < results.size(); ++i) {
      const Result& r = results[i];
      f << (i ? ", " : "") << "{\"name\": \"" << r.shape.name
        << "\", \"median_us\": " << r.median_us << ", \"tflops\": " << r.tflops
        << ", \"tbps\": " << r.tbps << ", \"items\": " << r.items
        << ", \"chunk_len\": " << r.chunk_len << ", \"variant\": " << r.variant << "}";
    }
    f << "]}\n";
  }
  CHECK_CUDA(cudaFree(flush));
  return 0;
}

}  // namespace
}  // namespace attn::bench

int main(int argc, char** argv) { return attn::bench::Main(argc, argv); }
