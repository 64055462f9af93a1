// Throughput of the CPU attention backend on shapes from docs/design.md ("Attention semantics").
// Decode reports KV_GB/s (bf16 K/V bytes a call must read / time); prefill reports GFLOP/s
// (4 * head_dim flops per visible (query head, key) pair, causal). The thread count is the
// pool's workers plus the caller; pass --benchmark_filter to pick shapes.
#include <benchmark/benchmark.h>

#include <memory>
#include <random>
#include <vector>

#include "kernels/cpu/cpu_attention.h"
#include "kernels/testing/paged_batch_builder.h"

namespace attn::cpu {
namespace {

using ::attn::testing::BatchOptions;
using ::attn::testing::SeqSpec;

// One pool per thread count, shared by all benchmarks.
ThreadPool& Pool(int threads) {
  static std::vector<std::unique_ptr<ThreadPool>> pools(256);
  if (!pools[threads]) pools[threads] = std::make_unique<ThreadPool>(threads - 1);
  return *pools[threads];
}

int Threads(const benchmark::State& state) {
  return state.range(0) > 0 ? static_cast<int>(state.range(0))
                            : ThreadPool::DefaultNumWorkers() + 1;
}

// Visible (row, key) pairs of a causal sequence with q_len rows over kv_len keys.
double CausalPairs(int q_len, int kv_len) {
  double pairs = 0;
  for (int i = 0; i < q_len; ++i) pairs += std::max(0, std::min(kv_len, i + 1 + kv_len - q_len));
  return pairs;
}

void SetThroughput(benchmark::State& state, double per_call, const char* name, double unit) {
  state.counters[name] =
      benchmark::Counter(per_call * state.iterations() / unit, benchmark::Counter::kIsRate);
  state.counters["threads"] = Threads(state);
}

void GqaDecode(benchmark::State& state, int qo, int kv, int dim, int page, int batch, int len) {
  std::mt19937_64 rng(1);
  BatchOptions o;
  o.decode = true;
  auto hb =
      testing::MakeGqaBatch({1, page, qo, kv, dim}, std::vector<SeqSpec>(batch, {1, len}), o, rng);
  const GqaParams p = hb.Params();
  ThreadPool& pool = Pool(Threads(state));
  for (auto _ : state) GqaAttention(p, pool);
  SetThroughput(state, 2.0 * batch * len * kv * dim * sizeof(bf16), "KV_GB/s", 1e9);
}

void GqaPrefill(benchmark::State& state, int qo, int kv, int dim, int page, int q_len, int cached) {
  std::mt19937_64 rng(1);
  BatchOptions o;
  auto hb = testing::MakeGqaBatch({1, page, qo, kv, dim}, {{q_len, cached + q_len}}, o, rng);
  const GqaParams p = hb.Params();
  ThreadPool& pool = Pool(Threads(state));
  for (auto _ : state) GqaAttention(p, pool);
  SetThroughput(state, 4.0 * dim * qo * CausalPairs(q_len, cached + q_len), "GFLOP/s", 1e9);
}

void MlaDecode(benchmark::State& state, int heads, int page, int batch, int len) {
  std::mt19937_64 rng(1);
  BatchOptions o;
  o.decode = true;
  auto hb = testing::MakeMlaBatch({1, page, heads}, std::vector<SeqSpec>(batch, {1, len}), o, rng);
  const MlaParams p = hb.Params();
  ThreadPool& pool = Pool(Threads(state));
  for (auto _ : state) MlaAttention(p, pool);
  SetThroughput(state, static_cast<double>(batch) * len * kMlaTokenDim * sizeof(bf16), "KV_GB/s",
                1e9);
  state.counters["GFLOP/s"] = benchmark::Counter(
      2.0 * heads * (kMlaTokenDim + kMlaCkvDim) * batch * len * state.iterations() / 1e9,
      benchmark::Counter::kIsRate);
}

void MlaPrefill(benchmark::State& state, int heads, int page, int q_len, int cached) {
  std::mt19937_64 rng(1);
  BatchOptions o;
  auto hb = testing::MakeMlaBatch({1, page, heads}, {{q_len, cached + q_len}}, o, rng);
  const MlaParams p = hb.Params();
  ThreadPool& pool = Pool(Threads(state));
  for (auto _ : state) MlaAttention(p, pool);
  SetThroughput(state,
                2.0 * (kMlaTokenDim + kMlaCkvDim) * heads * CausalPairs(q_len, cached + q_len),
                "GFLOP/s", 1e9);
}

void GqaAppend(benchmark::State& state, int kv, int dim, int page, int batch, int len) {
  std::mt19937_64 rng(1);
  BatchOptions o;
  o.append = true;
  auto hb =
      testing::MakeGqaBatch({1, page, 8, kv, dim}, std::vector<SeqSpec>(batch, {len, len}), o, rng);
  const GqaParams p = hb.Params();
  ThreadPool& pool = Pool(Threads(state));
  for (auto _ : state) GqaAppendKv(p, pool);
  SetThroughput(state, 2.0 * batch * len * kv * dim * sizeof(bf16), "GB/s", 1e9);
}

// Arg: threads (0 = all hardware threads).
#define ATTN_THREAD_ARGS ->Arg(1)->Arg(0)->UseRealTime()->Unit(benchmark::kMillisecond)

// Llama-3.1-8B GQA 32/8 head_dim 128, page 16.
BENCHMARK_CAPTURE(GqaDecode, b16x4096_32_8_d128, 32, 8, 128, 16, 16, 4096) ATTN_THREAD_ARGS;
BENCHMARK_CAPTURE(GqaDecode, b1x32768_32_8_d128, 32, 8, 128, 16, 1, 32768) ATTN_THREAD_ARGS;
BENCHMARK_CAPTURE(GqaPrefill, q512_on_512_32_8_d128, 32, 8, 128, 16, 512, 512) ATTN_THREAD_ARGS;
// DeepSeek-V3 MLA at TP8: 16 heads, page 64.
BENCHMARK_CAPTURE(MlaDecode, b16x2048_h16, 16, 64, 16, 2048) ATTN_THREAD_ARGS;
BENCHMARK_CAPTURE(MlaPrefill, q512_on_512_h16, 16, 64, 512, 512) ATTN_THREAD_ARGS;
BENCHMARK_CAPTURE(GqaAppend, b16x512_8_d128, 8, 128, 16, 16, 512) ATTN_THREAD_ARGS;

}  // namespace
}  // namespace attn::cpu

BENCHMARK_MAIN();
