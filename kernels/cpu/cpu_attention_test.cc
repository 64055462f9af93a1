// The CPU backend against the naive reference over a sweep of page sizes, group sizes, head dims,
// ragged / empty / q_len > kv_len sequences, mixed layers, append, lse and causal on and off.
// Every cache slot without a real token is NaN and outputs start as NaN, so an unmasked read or a
// missed write shows up. Inputs are fresh each run; set ATTN_TEST_SEED to replay a failure.
#include "kernels/cpu/cpu_attention.h"

#include <gtest/gtest.h>

#include <cstdlib>
#include <cstring>
#include <ostream>
#include <random>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "kernels/cpu/float_env.h"
#include "kernels/cpu/work_plan.h"
#include "kernels/reference/reference.h"
#include "kernels/testing/paged_batch_builder.h"

namespace attn::cpu {
namespace {

using ::attn::testing::BatchOptions;
using ::attn::testing::GqaGeometry;
using ::attn::testing::GqaHostBatch;
using ::attn::testing::HostPageTable;
using ::attn::testing::MlaGeometry;
using ::attn::testing::MlaHostBatch;
using ::attn::testing::SeqSpec;

uint64_t FreshSeed() {
  if (const char* env = std::getenv("ATTN_TEST_SEED")) return std::strtoull(env, nullptr, 10);
  std::random_device rd;
  return (uint64_t{rd()} << 32) | rd();
}

std::string Describe(const std::vector<SeqSpec>& seqs, const BatchOptions& o) {
  std::ostringstream s;
  s << (o.decode ? "decode" : "prefill") << " append=" << o.append << " lse=" << o.with_lse
    << " causal=" << o.causal << " seqs(q,kv,layer)=";
  for (const SeqSpec& q : seqs) s << "(" << q.q_len << "," << q.kv_len << "," << q.layer << ")";
  return s.str();
}

// Rows that see no key must be exactly 0 with lse == kEmptyRowLse.
void ExpectEmptyRowsZero(const HostPageTable& t, int page_size, bool causal, int num_heads,
                         int v_dim, const std::vector<bf16>& out, const std::vector<float>& lse,
                         const char* who) {
  const PagedBatch b = t.View();
  for (int seq = 0; seq < b.batch_size; ++seq) {
    const SeqExtent e = GetSeqExtent(b, page_size, seq);
    for (int i = 0; i < e.q_len; ++i) {
      if (VisibleKeys(e, i, causal) > 0) continue;
      for (int h = 0; h < num_heads; ++h) {
        const int64_t vec = (int64_t{e.q_begin} + i) * num_heads + h;
        for (int d = 0; d < v_dim; ++d) {
          ASSERT_EQ(Bf16ToFloat(out[vec * v_dim + d]), 0.f)
              << who << " empty row " << e.q_begin + i << " head " << h << " dim " << d;
        }
        if (!lse.empty()) {
          ASSERT_EQ(lse[vec], kEmptyRowLse) << who << " row " << e.q_begin + i;
        }
      }
    }
  }
}

template <typename HostBatch>
void ExpectResultsMatch(const HostBatch& got, const HostBatch& ref, int page_size, int num_heads,
                        int v_dim) {
  ASSERT_EQ(got.cache.size(), ref.cache.size());
  EXPECT_EQ(std::memcmp(got.cache.data(), ref.cache.data(), got.cache.size() * sizeof(bf16)), 0)
      << "caches differ after append";
  std::string report;
  EXPECT_EQ(testing::CompareBf16("out", got.out.data(), ref.out.data(),
                                 static_cast<int64_t>(ref.out.size()), &report),
            0)
      << report;
  ASSERT_EQ(got.lse.size(), ref.lse.size());
  report.clear();
  EXPECT_EQ(testing::CompareFloat("lse", got.lse.data(), ref.lse.data(),
                                  static_cast<int64_t>(ref.lse.size()), &report),
            0)
      << report;
  ExpectEmptyRowsZero(got.table, page_size, got.causal, num_heads, v_dim, got.out, got.lse, "cpu");
  ExpectEmptyRowsZero(ref.table, page_size, ref.causal, num_heads, v_dim, ref.out, ref.lse, "ref");
}

void CheckGqa(const GqaGeometry& g, const std::vector<SeqSpec>& seqs, const BatchOptions& o,
              ThreadPool& pool) {
  const uint64_t seed = FreshSeed();
  SCOPED_TRACE("seed=" + std::to_string(seed) + " (ATTN_TEST_SEED) qo/kv/dim/page=" +
               std::to_string(g.num_qo_heads) + "/" + std::to_string(g.num_kv_heads) + "/" +
               std::to_string(g.head_dim) + "/" + std::to_string(g.page_size) +
               " layers=" + std::to_string(g.num_layers) + " " + Describe(seqs, o));
  std::mt19937_64 rng(seed);
  GqaHostBatch cpu = testing::MakeGqaBatch(g, seqs, o, rng);
  GqaHostBatch ref = cpu;
  const GqaParams pc = cpu.Params();
  const GqaParams pr = ref.Params();
  GqaAppendKv(pc, pool);
  reference::GqaAppendKv(pr);
  GqaAttention(pc, pool);
  reference::GqaAttention(pr);
  ExpectResultsMatch(cpu, ref, g.page_size, g.num_qo_heads, g.head_dim);
}

void CheckMla(const MlaGeometry& g, const std::vector<SeqSpec>& seqs, const BatchOptions& o,
              ThreadPool& pool) {
  const uint64_t seed = FreshSeed();
  SCOPED_TRACE("seed=" + std::to_string(seed) + " (ATTN_TEST_SEED) heads/page=" +
               std::to_string(g.num_heads) + "/" + std::to_string(g.page_size) +
               " layers=" + std::to_string(g.num_layers) + " " + Describe(seqs, o));
  std::mt19937_64 rng(seed);
  MlaHostBatch cpu = testing::MakeMlaBatch(g, seqs, o, rng);
  MlaHostBatch ref = cpu;
  const MlaParams pc = cpu.Params();
  const MlaParams pr = ref.Params();
  MlaAppendKv(pc, pool);
  reference::MlaAppendKv(pr);
  MlaAttention(pc, pool);
  reference::MlaAttention(pr);
  ExpectResultsMatch(cpu, ref, g.page_size, g.num_heads, kMlaCkvDim);
}

// Ragged prefill sequences for a page size: lengths 1, exact page multiples, q_len > kv_len,
// an empty sequence (no pages), a sequence without query rows, and one spanning several pages.
std::vector<SeqSpec> PrefillSeqs(int page_size, bool mixed_layers) {
  std::vector<SeqSpec> s = {
      {1, 1}, {7, 2 * page_size}, {6, 3}, {3, 0}, {0, 9}, {13, page_size + 11}, {4, 4},
  };
  if (mixed_layers) {
    for (size_t i = 0; i < s.size(); ++i) s[i].layer = static_cast<int>(i % 3);
  }
  return s;
}

std::vector<SeqSpec> DecodeSeqs(int page_size, bool mixed_layers) {
  std::vector<SeqSpec> s = {{1, 1}, {1, 3 * page_size}, {1, 0}, {1, 77}, {1, 130}, {1, 2}};
  if (mixed_layers) {
    for (size_t i = 0; i < s.size(); ++i) s[i].layer = static_cast<int>((i + 1) % 3);
  }
  return s;
}

// Option combinations cycled through by the sweeps so each one meets several shapes.
BatchOptions Variant(int i, bool decode) {
  BatchOptions o;
  o.decode = decode;
  o.append = (i & 1) != 0;
  o.with_lse = (i & 2) == 0;
  o.causal = (i % 3) != 2;
  o.pad_last_page_len = (i & 4) != 0;
  o.query_scale = (i & 8) ? 4.f : 1.f;  // sharper softmax: larger logits
  return o;
}

struct GqaCase {
  int page_size;
  int num_qo_heads;
  int num_kv_heads;
  int head_dim;
};

std::string GqaCaseName(const ::testing::TestParamInfo<GqaCase>& info) {
  const GqaCase& c = info.param;
  return "Page" + std::to_string(c.page_size) + "_Qo" + std::to_string(c.num_qo_heads) + "Kv" +
         std::to_string(c.num_kv_heads) + "_D" + std::to_string(c.head_dim);
}

void PrintTo(const GqaCase& c, std::ostream* os) {
  *os << "page " << c.page_size << " qo/kv " << c.num_qo_heads << "/" << c.num_kv_heads << " d "
      << c.head_dim;
}

std::vector<GqaCase> GqaCases() {
  // Group sizes 1, 3, 4, 5, 6, 8, 16 (num_qo / num_kv), head_dim alternating 64 / 128.
  const int heads[][2] = {{2, 2}, {6, 2}, {8, 2}, {5, 1}, {6, 1}, {8, 1}, {16, 1}};
  std::vector<GqaCase> cases;
  int i = 0;
  for (int page_size : {1, 5, 16, 64}) {
    for (const auto& h : heads) cases.push_back({page_size, h[0], h[1], (i++ % 2) ? 128 : 64});
  }
  cases.push_back({16, 8, 1, 256});
  cases.push_back({5, 8, 2, 256});
  cases.push_back({16, 6, 3, 40});  // head_dim not a multiple of 16 (padded internally)
  return cases;
}

// Every SIMD width runs on every machine (kAuto would pick one).
SimdWidth WidthFor(int variant) {
  constexpr SimdWidth kWidths[] = {SimdWidth::k16, SimdWidth::k8, SimdWidth::k4};
  return kWidths[variant % 3];
}

class GqaSweepTest : public ::testing::TestWithParam<GqaCase> {
 protected:
  void TearDown() override { SetSimdWidthForTesting(SimdWidth::kAuto); }
  ThreadPool pool_{3};
};

TEST_P(GqaSweepTest, PrefillAndDecodeMatchReference) {
  const GqaCase& c = GetParam();
  // A per-case offset so different cases start the option cycle at different points.
  const int base = c.page_size + c.num_qo_heads * 3 + c.head_dim / 64;
  for (int v = 0; v < 4; ++v) {
    SetSimdWidthForTesting(WidthFor(v));
    const bool mixed = (v & 1) != 0;
    GqaGeometry g{mixed ? 3 : 1, c.page_size, c.num_qo_heads, c.num_kv_heads, c.head_dim};
    CheckGqa(g, PrefillSeqs(c.page_size, mixed), Variant(base + v, false), pool_);
    CheckGqa(g, DecodeSeqs(c.page_size, mixed), Variant(base + v + 1, true), pool_);
  }
}

INSTANTIATE_TEST_SUITE_P(Sweep, GqaSweepTest, ::testing::ValuesIn(GqaCases()), GqaCaseName);

struct MlaCase {
  int page_size;
  int num_heads;
};

std::string MlaCaseName(const ::testing::TestParamInfo<MlaCase>& info) {
  return "Page" + std::to_string(info.param.page_size) + "_H" +
         std::to_string(info.param.num_heads);
}

void PrintTo(const MlaCase& c, std::ostream* os) {
  *os << "page " << c.page_size << " heads " << c.num_heads;
}

class MlaSweepTest : public ::testing::TestWithParam<MlaCase> {
 protected:
  void TearDown() override { SetSimdWidthForTesting(SimdWidth::kAuto); }
  ThreadPool pool_{3};
};

TEST_P(MlaSweepTest, PrefillAndDecodeMatchReference) {
  const MlaCase& c = GetParam();
  const int base = c.page_size + c.num_heads;
  for (int v = 0; v < 3; ++v) {
    SetSimdWidthForTesting(WidthFor(v + 1));
    const bool mixed = v == 1;
    MlaGeometry g{mixed ? 3 : 1, c.page_size, c.num_heads};
    BatchOptions o = Variant(base + v, false);
    o.sm_scale = (v == 2) ? 0.1352337747812271f : 0.f;  // DeepSeek-V3's scale, and the default
    CheckMla(g, PrefillSeqs(c.page_size, mixed), o, pool_);
    o = Variant(base + v + 1, true);
    CheckMla(g, DecodeSeqs(c.page_size, mixed), o, pool_);
  }
}

INSTANTIATE_TEST_SUITE_P(Sweep, MlaSweepTest,
                         ::testing::Values(MlaCase{1, 16}, MlaCase{5, 8}, MlaCase{16, 16},
                                           MlaCase{64, 16}, MlaCase{64, 8}),
                         MlaCaseName);

// Few sequences with long KV: the plan splits keys into chunks and merges the partial states.
TEST(CpuAttentionSplitKvTest, GqaDecodeLongContext) {
  ThreadPool pool(3);
  BatchOptions o;
  o.decode = true;
  o.append = true;
  CheckGqa({1, 16, 8, 2, 128}, {{1, 3000}, {1, 700}}, o, pool);
  o.with_lse = false;
  CheckGqa({2, 64, 32, 8, 64}, {{1, 1500, 1}}, o, pool);
}

// Decode items cover as many KV heads as fit their tile budget: here 8 of 16 (head_dim 256).
TEST(CpuAttentionTest, DecodeItemsSpanSeveralKvHeads) {
  ASSERT_EQ(ChooseKvHeadsPerItem(true, 16, kKeyTileGqaDecode, 2 * 256), 8);
  ThreadPool pool(1);
  BatchOptions o;
  o.decode = true;
  o.append = true;
  for (SimdWidth w : {SimdWidth::k16, SimdWidth::k8, SimdWidth::k4}) {
    SetSimdWidthForTesting(w);
    CheckGqa({1, 16, 32, 16, 256}, {{1, 70}, {1, 0}, {1, 33}}, o, pool);
  }
  SetSimdWidthForTesting(SimdWidth::kAuto);
}

TEST(CpuAttentionSplitKvTest, GqaPrefillLongContext) {
  ThreadPool pool(3);
  BatchOptions o;
  o.append = true;
  // One item before splitting (8 rows x group 8 = 64 query vectors); causal rows end mid-chunk.
  CheckGqa({1, 16, 8, 1, 128}, {{8, 2000}}, o, pool);
  // q_len > kv_len: the first rows see nothing, in a split sequence.
  CheckGqa({1, 5, 16, 1, 64}, {{4, 0}, {20, 900}, {0, 0}}, o, pool);
  o.causal = false;
  CheckGqa({1, 16, 8, 1, 128}, {{8, 2000}}, o, pool);
}

TEST(CpuAttentionSplitKvTest, MlaDecodeLongContext) {
  ThreadPool pool(3);
  BatchOptions o;
  o.decode = true;
  o.append = true;
  o.sm_scale = 0.1352337747812271f;
  CheckMla({1, 64, 16}, {{1, 1500}, {1, 40}}, o, pool);
  o.decode = false;
  CheckMla({1, 64, 8}, {{3, 1000}}, o, pool);
}

// Logits past float32's range come back NaN in every row that sees a key, never as the empty-row
// encoding; rows that see no key stay 0 / kEmptyRowLse. Each batch runs with q = 1e38, with
// sm_scale = 1e38 and with every logit -inf (MakeLogitsOverflow).
template <typename HostBatch, typename Geometry, typename MakeBatch, typename Attend>
void CheckOverflow(const Geometry& g, int num_heads, int v_dim, const std::vector<SeqSpec>& seqs,
                   const BatchOptions& o, MakeBatch make_batch, Attend attend) {
  for (testing::Overflow how : {testing::Overflow::kHugeQuery, testing::Overflow::kHugeScale,
                                testing::Overflow::kMinusInf}) {
    const uint64_t seed = FreshSeed();
    SCOPED_TRACE("seed=" + std::to_string(seed) + " (ATTN_TEST_SEED) overflow=" +
                 std::to_string(static_cast<int>(how)) + " " + Describe(seqs, o));
    std::mt19937_64 rng(seed);
    HostBatch b = make_batch(g, seqs, o, rng);
    testing::MakeLogitsOverflow(how, &b);
    attend(b.Params());
    std::string report;
    EXPECT_EQ(testing::CheckOverflowRows(b.table, g.page_size, b.causal, num_heads, v_dim, b.out,
                                         b.lse, &report),
              0)
        << report;
  }
}

void CheckGqaOverflow(const GqaGeometry& g, const std::vector<SeqSpec>& seqs, const BatchOptions& o,
                      ThreadPool& pool) {
  CheckOverflow<GqaHostBatch>(g, g.num_qo_heads, g.head_dim, seqs, o, testing::MakeGqaBatch,
                              [&](const GqaParams& p) {
                                GqaAppendKv(p, pool);
                                GqaAttention(p, pool);
                              });
}

void CheckMlaOverflow(const MlaGeometry& g, const std::vector<SeqSpec>& seqs, const BatchOptions& o,
                      ThreadPool& pool) {
  CheckOverflow<MlaHostBatch>(g, g.num_heads, kMlaCkvDim, seqs, o, testing::MakeMlaBatch,
                              [&](const MlaParams& p) {
                                MlaAppendKv(p, pool);
                                MlaAttention(p, pool);
                              });
}

TEST(CpuAttentionOverflowTest, GqaPrefillAndDecode) {
  ThreadPool pool(3);
  BatchOptions prefill;
  prefill.append = true;
  BatchOptions decode = prefill;
  decode.decode = true;
  for (SimdWidth w : {SimdWidth::k16, SimdWidth::k8, SimdWidth::k4}) {
    SetSimdWidthForTesting(w);
    // Ragged, with q_len > kv_len rows that see no key and an empty sequence.
    CheckGqaOverflow({1, 16, 8, 2, 128}, PrefillSeqs(16, false), prefill, pool);
    CheckGqaOverflow({1, 5, 6, 2, 64}, DecodeSeqs(5, false), decode, pool);
  }
  SetSimdWidthForTesting(SimdWidth::kAuto);
  // Split-KV (as in CpuAttentionSplitKvTest): one long sequence of few rows, the merge included.
  CheckGqaOverflow({1, 16, 8, 1, 128}, {{8, 2000}}, prefill, pool);
  CheckGqaOverflow({1, 5, 16, 1, 64}, {{4, 0}, {20, 900}, {0, 0}}, prefill, pool);
  CheckGqaOverflow({1, 16, 8, 2, 128}, {{1, 3000}, {1, 700}}, decode, pool);
  prefill.causal = false;
  prefill.with_lse = false;
  CheckGqaOverflow({1, 16, 8, 1, 128}, {{8, 2000}}, prefill, pool);
}

TEST(CpuAttentionOverflowTest, MlaPrefillAndDecode) {
  ThreadPool pool(3);
  BatchOptions prefill;
  prefill.append = true;
  prefill.sm_scale = 0.1352337747812271f;
  BatchOptions decode = prefill;
  decode.decode = true;
  CheckMlaOverflow({1, 16, 8}, PrefillSeqs(16, false), prefill, pool);
  CheckMlaOverflow({1, 16, 16}, DecodeSeqs(16, false), decode, pool);
  // Split-KV.
  CheckMlaOverflow({1, 64, 16}, {{1, 1500}, {1, 40}}, decode, pool);
  CheckMlaOverflow({1, 64, 8}, {{3, 1000}}, prefill, pool);
}

// Subnormals count as zero inside the kernels (they made inputs with tiny values run 7-9x slower):
// queries of 2^-133 against keys of +-2^126 score +-0.125 (base 2) exactly, but 0 when flushed, so
// the softmax is uniform and lse is log2(4). The caller's floating-point mode is left alone.
TEST(CpuAttentionTest, SubnormalsCountAsZero) {
  ThreadPool pool(1);
  std::mt19937_64 rng(FreshSeed());
  BatchOptions o;
  o.decode = true;
  const GqaGeometry g{1, 16, 1, 1, 128};
  GqaHostBatch b = testing::MakeGqaBatch(g, {{1, 4}}, o, rng);
  for (bf16& x : b.q) x = bf16{0x0001};  // the smallest positive subnormal bf16, 2^-133
  const int page = b.table.kv_indices[0];
  auto row = [&](int kv, int token) {  // [layer 0][page][kv][token][head 0]
    return b.cache.data() + ((int64_t{page} * 2 + kv) * g.page_size + token) * g.head_dim;
  };
  for (int t = 0; t < 4; ++t) {
    std::fill(row(0, t), row(0, t) + g.head_dim, bf16{t % 2 ? uint16_t{0xfe80} : uint16_t{0x7e80}});
  }
  ASSERT_FALSE(SubnormalsFlushed());
  GqaAttention(b.Params(), pool);
  EXPECT_FALSE(SubnormalsFlushed());
  EXPECT_FLOAT_EQ(b.lse[0], 2.f);
  for (int d = 0; d < g.head_dim; ++d) {
    float mean = 0;
    for (int t = 0; t < 4; ++t) mean += Bf16ToFloat(row(1, t)[d]) / 4;
    EXPECT_NEAR(Bf16ToFloat(b.out[d]), mean, 1e-2) << "d=" << d;
  }
}

TEST(FloatEnvTest, ScopedFlushSubnormalsRestoresTheMode) {
  if (kFlushSubnormalBits == 0) GTEST_SKIP() << "no flush-to-zero control on this target";
  volatile float tiny = 1e-39f;  // volatile: multiplied at run time, not folded
  ASSERT_FALSE(SubnormalsFlushed());
  {
    const ScopedFlushSubnormals flush;
    EXPECT_TRUE(SubnormalsFlushed());
    EXPECT_EQ(tiny * 1.f, 0.f);
    {
      const ScopedFlushSubnormals nested;
      EXPECT_TRUE(SubnormalsFlushed());
    }
    EXPECT_TRUE(SubnormalsFlushed());
  }
  EXPECT_FALSE(SubnormalsFlushed());
  EXPECT_EQ(tiny * 1.f, 1e-39f);
}

TEST(CpuAttentionTest, SingleThreadedPool) {
  ThreadPool pool(0);
  BatchOptions o;
  o.append = true;
  CheckGqa({1, 16, 8, 2, 128}, PrefillSeqs(16, false), o, pool);
  o.decode = true;
  CheckMla({1, 16, 16}, DecodeSeqs(16, false), o, pool);
}

TEST(CpuAttentionTest, EmptyBatchAndOnlyEmptySequences) {
  ThreadPool pool(2);
  BatchOptions o;
  CheckGqa({1, 16, 8, 2, 64}, {}, o, pool);
  CheckGqa({1, 16, 8, 2, 64}, {{3, 0}, {1, 0}}, o, pool);
  o.decode = true;
  CheckMla({1, 64, 16}, {{1, 0}}, o, pool);
}

TEST(CpuAttentionTest, LargerPrefill) {
  ThreadPool pool(3);
  BatchOptions o;
  o.append = true;
  CheckGqa({1, 16, 32, 8, 128}, {{100, 300}, {37, 37}, {64, 129}}, o, pool);
  CheckMla({1, 64, 16}, {{48, 200}, {9, 64}}, o, pool);
}

// The server runs prefill and decode batches from different threads on one pool at once.
TEST(CpuAttentionTest, ConcurrentCallsOnOnePool) {
  ThreadPool pool(3);
  std::vector<std::thread> threads;
  for (int t = 0; t < 3; ++t) {
    threads.emplace_back([&pool, t] {
      for (int iter = 0; iter < 3; ++iter) {
        BatchOptions o;
        o.decode = (t + iter) % 2 == 1;
        o.append = true;
        if (t == 2) {
          CheckMla({1, 16, 8}, o.decode ? DecodeSeqs(16, false) : PrefillSeqs(16, false), o, pool);
        } else {
          CheckGqa({1, 16, 8, 2, 64}, o.decode ? DecodeSeqs(16, false) : PrefillSeqs(16, false), o,
                   pool);
        }
      }
    });
  }
  for (std::thread& t : threads) t.join();
}

TEST(WorkPlanTest, RowsPerItem) {
  EXPECT_EQ(ChooseRowsPerItem(1), 64);
  EXPECT_EQ(ChooseRowsPerItem(4), 16);
  EXPECT_EQ(ChooseRowsPerItem(5), 12);
  EXPECT_EQ(ChooseRowsPerItem(16), 4);
  EXPECT_EQ(ChooseRowsPerItem(128), 1);
}

TEST(WorkPlanTest, KvHeadsPerItem) {
  // Prefill: always one KV head.
  EXPECT_EQ(ChooseKvHeadsPerItem(false, 8, 64, 256), 1);
  // Decode, head_dim 128: 32 keys x 256 floats x 4 bytes = 32 KiB per head; 16 fit in 512 KiB.
  EXPECT_EQ(ChooseKvHeadsPerItem(true, 8, 32, 256), 8);
  EXPECT_EQ(ChooseKvHeadsPerItem(true, 32, 32, 256), 16);
  // A head larger than the budget still gets an item.
  EXPECT_EQ(ChooseKvHeadsPerItem(true, 4, 1024, 1024), 1);
}

TEST(WorkPlanTest, KvChunkLen) {
  // No split on one thread, or with >= 2 items per thread.
  EXPECT_EQ(ChooseKvChunkLen(1, 1, 100000, 100000), 0);
  EXPECT_EQ(ChooseKvChunkLen(16, 32, 32 * 4096, 4096), 0);
  // Decode, batch 1, 8 KV heads x 32768 keys on 16 threads: 64 items of 4096 keys.
  EXPECT_EQ(ChooseKvChunkLen(16, 8, 8 * 32768, 32768), 4096);
  // MLA decode, batch 1 x 2048 keys on 16 threads: ceil(2048 / 64) = 32, raised to the minimum.
  EXPECT_EQ(ChooseKvChunkLen(16, 1, 2048, 2048), kMinChunkLen);
  // Rounded up to kChunkGranularity: ceil(2 * 3000 / 16) = 375 -> 384.
  EXPECT_EQ(ChooseKvChunkLen(4, 2, 6000, 3000), 384);
  // Nothing longer than a chunk: no split.
  EXPECT_EQ(ChooseKvChunkLen(16, 1, 200, 200), 0);
}

}  // namespace
}  // namespace attn::cpu
