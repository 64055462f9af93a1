// scrub_bench: what zeroing reused pages costs AllocatePages on the GPU. Times the CUDA
// backend's ScrubPages (one id copy, one ZeroPages launch, one stream synchronize: what the
// call waits for) for lists of pages of a Llama-3-70B-like pool, against one cudaMemset of the
// same number of bytes in the same run (the bandwidth ceiling). That exactly the listed pages
// are zeroed is kernel_tests' ZeroPagesTest.
//
//   scrub_bench [--layers N] [--pages N] [--runs N]
//
// Prints one line per list: pages, bytes, median and p90 microseconds, GB/s, and the memset's
// median for the same bytes.
#include <cuda_runtime_api.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "server/backends/cuda_backend.h"
#include "server/engine/pool_geometry.h"

namespace attn::bench {
namespace {

#define CHECK_CUDA(expr)                                                                      \
  do {                                                                                        \
    const cudaError_t _err = (expr);                                                          \
    if (_err != cudaSuccess) {                                                                \
      std::fprintf(stderr, "%s:%d %s: %s\n", __FILE__, __LINE__, #expr,                       \
                   cudaGetErrorString(_err));                                                 \
      std::exit(1);                                                                           \
    }                                                                                         \
  } while (0)

double Percentile(std::vector<double> v, double p) {
  std::sort(v.begin(), v.end());
  return v[static_cast<size_t>(p * (v.size() - 1))];
}

template <typename F>
std::vector<double> TimeUs(int runs, F&& f) {
  std::vector<double> us;
  for (int i = 0; i < runs; ++i) {
    const auto start = std::chrono::steady_clock::now();
    f();
    us.push_back(
        std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now() - start)
            .count());
  }
  return us;
}

int Main(int argc, char** argv) {
  int layers = 80, pages = 8192, runs = 50;
  for (int i = 1; i + 1 < argc; i += 2) {
    const std::string flag = argv[i];
    const int value = std::atoi(argv[i + 1]);
    if (flag == "--layers") layers = value;
    if (flag == "--pages") pages = value;
    if (flag == "--runs") runs = value;
  }
  // Llama-3-70B: 8 KV heads of 128, page size 16: 64 KiB per page and layer.
  const PoolGeometry g = PoolGeometry::Gqa("bench", layers, 16, 64, 8, 128, pages);
  absl::StatusOr<std::unique_ptr<Backend>> backend = CreateCudaBackend(CudaBackendOptions{});
  if (!backend.ok()) {
    std::fprintf(stderr, "%s\n", backend.status().ToString().c_str());
    return 1;
  }
  if (absl::Status st = (*backend)->AddPool(g); !st.ok()) {
    std::fprintf(stderr, "%s\n", st.ToString().c_str());
    return 1;
  }
  std::printf("%s; pool: %d layers x %d pages of %lld KiB per layer (%.1f GiB)\n",
              (*backend)->device().c_str(), layers, pages,
              static_cast<long long>(g.BytesPerPage() / layers / 1024),
              g.TotalBytes() / double(1 << 30));
  void* scratch = nullptr;  // the memset peer
  CHECK_CUDA(cudaMalloc(&scratch, g.TotalBytes()));

  std::mt19937 rng(1);
  std::vector<int32_t> all(pages);
  std::iota(all.begin(), all.end(), 0);
  std::printf("%8s %8s %12s %10s %10s %8s %12s\n", "pages", "order", "MiB", "p50 us", "p90 us",
              "GB/s", "memset us");
  for (int n : {1, 16, 256, 2048, pages}) {
    if (n > pages) continue;
    for (bool shuffled : {false, true}) {
      std::vector<int32_t> ids = all;
      if (shuffled) std::shuffle(ids.begin(), ids.end(), rng);
      ids.resize(n);
      const int64_t bytes = n * g.BytesPerPage();
      const std::vector<double> us = TimeUs(runs, [&] {
        if (absl::Status st = (*backend)->ScrubPages(0, ids); !st.ok()) {
          std::fprintf(stderr, "%s\n", st.ToString().c_str());
          std::exit(1);
        }
      });
      const std::vector<double> peer = TimeUs(runs, [&] {
        CHECK_CUDA(cudaMemset(scratch, 0, bytes));
        CHECK_CUDA(cudaDeviceSynchronize());
      });
      const double p50 = Percentile(us, 0.5);
      std::printf("%8d %8s %12.1f %10.1f %10.1f %8.0f %12.1f\n", n,
                  shuffled ? "random" : "runs", bytes / double(1 << 20), p50,
                  Percentile(us, 0.9), bytes / p50 / 1e3, Percentile(peer, 0.5));
    }
  }
  CHECK_CUDA(cudaFree(scratch));
  return 0;
}

}  // namespace
}  // namespace attn::bench

int main(int argc, char** argv) { return attn::bench::Main(argc, argv); }
