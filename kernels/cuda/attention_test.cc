// kernel_tests: every CUDA kernel against the double-precision reference, with fresh random
// inputs, NaN-poisoned unused cache slots and NaN-poisoned outputs. Skips without a GPU.
//
// Small batches are checked in full. Large ones (published workload shapes) are checked on a
// sample of query rows: each sampled row is re-run through the reference as a one-token sequence
// over the prefix of its sequence it can see, which is the same attention for that row.
#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <sstream>
#include <string>
#include <type_traits>
#include <vector>

#include "gtest/gtest.h"
#include "kernels/cuda/api.h"
#include "kernels/cuda/plan.h"
#include "kernels/reference/reference.h"
#include "kernels/testing/device_batch.h"
#include "kernels/testing/paged_batch_builder.h"

namespace attn::testing {
namespace {

#define ASSERT_CUDA_OK(expr)                                                   \
  do {                                                                         \
    const cudaError_t _err = (expr);                                           \
    ASSERT_EQ(_err, cudaSuccess) << #expr << ": " << cudaGetErrorString(_err); \
  } while (0)

struct Case {
  std::string name;
  std::vector<SeqSpec> seqs;
  BatchOptions options;
  int sample_rows = 0;  // 0: check every row
};

std::vector<SeqSpec> Decode(std::vector<int> kv_lens) {
  std::vector<SeqSpec> seqs;
  for (int kv : kv_lens) seqs.push_back({1, kv, 0});
  return seqs;
}

// Rows (sequence, row in sequence) to check: all of them, or a sample that always includes the
// first and last row of the first and last sequence.
std::vector<std::pair<int, int>> RowsToCheck(const HostPageTable& t, int sample,
                                             std::mt19937_64& rng) {
  std::vector<std::pair<int, int>> rows;
  for (int b = 0; b < static_cast<int>(t.seqs.size()); ++b) {
    const int q_len = t.decode ? 1 : t.seqs[b].q_len;
    for (int i = 0; i < q_len; ++i) rows.push_back({b, i});
  }
  if (sample == 0 || static_cast<int>(rows.size()) <= sample) return rows;
  std::vector<std::pair<int, int>> picked{rows.front(), rows.back()};
  std::uniform_int_distribution<size_t> pick(0, rows.size() - 1);
  while (static_cast<int>(picked.size()) < sample) picked.push_back(rows[pick(rng)]);
  return picked;
}

// A decode batch whose sequence j is row rows[j] seen as a one-token query over the keys it sees.
HostPageTable SampledTable(const HostPageTable& t, int page_size,
                           const std::vector<std::pair<int, int>>& rows, bool causal) {
  HostPageTable s;
  s.decode = true;
  s.num_pages = t.num_pages;
  s.kv_indptr.push_back(0);
  for (auto [b, i] : rows) {
    const int q_len = t.decode ? 1 : t.seqs[b].q_len;
    const int vis = VisibleKeys(q_len, t.seqs[b].kv_len, i, causal);
    const int pages = (vis + page_size - 1) / page_size;
    for (int k = 0; k < pages; ++k) s.kv_indices.push_back(t.kv_indices[t.kv_indptr[b] + k]);
    s.kv_indptr.push_back(static_cast<int32_t>(s.kv_indices.size()));
    s.kv_last_page_len.push_back(pages == 0 ? 0 : vis - (pages - 1) * page_size);
    s.seq_layer.push_back(t.seq_layer.empty() ? 0 : t.seq_layer[b]);
    s.seqs.push_back({1, vis, s.seq_layer.back()});
    ++s.total_q;
  }
  return s;
}

// Copies row `row` (of width `width`) of every sampled row into a dense array.
template <typename T>
std::vector<T> Gather(const std::vector<T>& src, const HostPageTable& t,
                      const std::vector<std::pair<int, int>>& rows, int64_t width) {
  std::vector<T> out;
  for (auto [b, i] : rows) {
    const int64_t r = t.QBegin(b) + i;
    out.insert(out.end(), src.begin() + r * width, src.begin() + (r + 1) * width);
  }
  return out;
}

void ExpectSameCache(const std::vector<bf16>& got, const std::vector<bf16>& ref) {
  ASSERT_EQ(got.size(), ref.size());
  int64_t diffs = 0;
  for (size_t i = 0; i < got.size(); ++i) diffs += got[i].bits != ref[i].bits;
  EXPECT_EQ(diffs, 0) << "cache slots differ from the reference after append";
}

void ExpectResults(const std::vector<bf16>& out, const std::vector<float>& lse,
                   const std::vector<bf16>& ref_out, const std::vector<float>& ref_lse) {
  std::string report;
  const int64_t bad_out =
      CompareBf16("out", out.data(), ref_out.data(), static_cast<int64_t>(ref_out.size()), &report);
  const int64_t bad_lse = ref_lse.empty()
                              ? 0
                              : CompareFloat("lse", lse.data(), ref_lse.data(),
                                             static_cast<int64_t>(ref_lse.size()), &report);
  EXPECT_EQ(bad_out + bad_lse, 0) << report;
}

uint64_t Seed() {
  const uint64_t seed = std::random_device{}();
  std::printf("seed %llu\n", static_cast<unsigned long long>(seed));
  return seed;
}

// The GQA prefill variants every run checks: the portable kernel, the sm_90a kernels (the default
// is one of them) and the decode kernel, which the default takes for short prefills (checked here
// on every prefill case, long ones included); or those ATTN_TEST_PREFILL_VARIANTS lists ("20": the
// decode kernel alone, after a change to it).
const std::vector<int> kAllPrefillVariants = {0,
                                              cuda::kGqaPrefillSm90LeanOverlapSolo3,
                                              cuda::kGqaPrefillSm90Solo3Tma,
                                              cuda::kGqaPrefillSm90Solo3TmaLeanTiles,
                                              cuda::kGqaPrefillSm90TmaLeanLazyRescale,
                                              cuda::kGqaPrefillOnDecodeKernel};

// Those of `candidates` the entry points accept on this device (the portable kernels
// everywhere, the sm_90a kernels on Hopper): get_tiling(&tiling) with tiling.variant set.
template <typename GetTiling>
std::vector<int> AcceptedVariants(const std::vector<int>& candidates, GetTiling get_tiling) {
  std::vector<int> variants;
  for (int v : candidates) {
    cuda::KernelTiling tiling;
    tiling.variant = v;
    if (get_tiling(&tiling) == cudaSuccess) variants.push_back(v);
  }
  return variants;
}

// The integers of a comma-separated list.
std::vector<int> ParseList(const char* list) {
  std::vector<int> out;
  std::stringstream in(list);
  for (std::string v; std::getline(in, v, ',');) out.push_back(std::stoi(v));
  return out;
}

// A listed number that names no variant (-1 for the default, the portable kernel, the decode
// kernel or a Hopper one) fails the test: the entry points would refuse it everywhere, and the test
// would pass without running it.
std::vector<int> CheckedPrefillVariants() {
  const char* list = std::getenv("ATTN_TEST_PREFILL_VARIANTS");
  if (list == nullptr) return kAllPrefillVariants;
  const std::vector<int> variants = ParseList(list);
  for (int v : variants) {
    const bool known = v == -1 || v == 0 || v == cuda::kGqaPrefillOnDecodeKernel ||
                       cuda::IsGqaPrefillSm90Variant(v);
    EXPECT_TRUE(known) << "ATTN_TEST_PREFILL_VARIANTS names " << v
                       << ", no GQA prefill variant of kernels/cuda/api.h";
  }
  return variants;
}

std::vector<int> PrefillVariants(int head_dim, const std::vector<int>& candidates) {
  return AcceptedVariants(
      candidates, [&](cuda::KernelTiling* t) { return cuda::GetGqaTiling(head_dim, false, t); });
}

// The GQA decode variants every run checks (the default resolves to kGqaDecodeAdaptive).
std::vector<int> DecodeVariants(int head_dim) {
  return AcceptedVariants(
      {cuda::kGqaDecodePageIdsPerTile, cuda::kGqaDecodeStagedPageIds, cuda::kGqaDecodeAdaptive},
      [&](cuda::KernelTiling* t) { return cuda::GetGqaTiling(head_dim, true, t); });
}

// The MLA kernels every run checks on a geometry of num_heads: the portable one and the sm_90a
// ones where they run and take that many heads, or those ATTN_TEST_MLA_VARIANTS lists ("0,41": to
// bisect a failing variant on the GPU). A listed number that names no variant fails the test, as
// in CheckedPrefillVariants.
std::vector<int> MlaVariants(const MlaGeometry& g) {
  std::vector<int> candidates = {cuda::kMlaPortable,
                                 cuda::kMlaSm90Narrow16,
                                 cuda::kMlaSm90Narrow32,
                                 cuda::kMlaSm90LateRightTmaLazy,
                                 cuda::kMlaSm90LateRightTmaTouch2Lazy,
                                 cuda::kMlaSm90LateRightTmaLazyLean,
                                 cuda::kMlaSm90LateRightTmaTouch2LazyLean,
                                 cuda::kMlaSm90PersistentLean,
                                 cuda::kMlaSm90PersistentTouch2Lean};
  if (const char* list = std::getenv("ATTN_TEST_MLA_VARIANTS")) {
    candidates = ParseList(list);
    for (int v : candidates) {
      EXPECT_TRUE(v == -1 || v == cuda::kMlaPortable || cuda::IsMlaSm90Variant(v))
          << "ATTN_TEST_MLA_VARIANTS names " << v << ", no MLA variant of kernels/cuda/api.h";
    }
  }
  return AcceptedVariants(candidates, [&](cuda::KernelTiling* t) {
    return cuda::GetMlaTiling(g.num_heads, g.page_size, false, t);
  });
}

// One kernel variant's results for a batch.
struct Got {
  int variant;
  std::vector<bf16> out, cache;
  std::vector<float> lse;
};

// Runs the batch (GQA or MLA) through each kernel variant, outputs poisoned before each.
template <typename HostBatch>
void RunVariants(HostBatch& host, const std::vector<int>& variants, std::vector<Got>* got) {
  for (int v : variants) {
    std::unique_ptr<DeviceBatch> device;
    ASSERT_CUDA_OK(DeviceBatch::Create(host, &device, v));
    ASSERT_CUDA_OK(device->PoisonOutputs(nullptr));
    ASSERT_CUDA_OK(device->Run(nullptr));
    Got r{v, {}, {}, {}};
    ASSERT_CUDA_OK(device->Download(&r.out, &r.lse, &r.cache));
    got->push_back(std::move(r));
  }
}

// Runs the batch through each kernel variant and checks them all against one reference run.
void RunGqa(const GqaGeometry& g, const Case& c, const std::vector<int>& variants = {-1}) {
  std::mt19937_64 rng(Seed());
  GqaHostBatch host = MakeGqaBatch(g, c.seqs, c.options, rng);
  std::vector<Got> got;
  ASSERT_NO_FATAL_FAILURE(RunVariants(host, variants, &got));

  // The reference appends into the host cache, then attends over the sampled rows.
  reference::GqaAppendKv(host.Params());
  const auto rows = RowsToCheck(host.table, c.sample_rows, rng);
  const int64_t q_width = int64_t{g.num_qo_heads} * g.head_dim;
  GqaHostBatch ref = host;
  ref.table = SampledTable(host.table, g.page_size, rows, c.options.causal);
  ref.q = Gather(host.q, host.table, rows, q_width);
  ref.k_new.clear();
  ref.v_new.clear();
  ref.out.assign(rows.size() * q_width, kBf16QuietNan);
  ref.lse.assign(host.lse.empty() ? 0 : rows.size() * g.num_qo_heads, 0.f);
  reference::GqaAttention(ref.Params());
  for (const Got& r : got) {
    SCOPED_TRACE(::testing::Message() << "variant " << r.variant);
    ExpectSameCache(r.cache, host.cache);
    ExpectResults(Gather(r.out, host.table, rows, q_width),
                  Gather(r.lse, host.table, rows, host.lse.empty() ? 0 : g.num_qo_heads), ref.out,
                  ref.lse);
  }
}

void RunMla(const MlaGeometry& g, const Case& c) {
  const std::vector<int> variants = MlaVariants(g);
  std::mt19937_64 rng(Seed());
  MlaHostBatch host = MakeMlaBatch(g, c.seqs, c.options, rng);
  std::vector<Got> got;
  ASSERT_NO_FATAL_FAILURE(RunVariants(host, variants, &got));

  reference::MlaAppendKv(host.Params());
  const auto rows = RowsToCheck(host.table, c.sample_rows, rng);
  MlaHostBatch ref = host;
  ref.table = SampledTable(host.table, g.page_size, rows, c.options.causal);
  ref.q_nope = Gather(host.q_nope, host.table, rows, int64_t{g.num_heads} * kMlaCkvDim);
  ref.q_pe = Gather(host.q_pe, host.table, rows, int64_t{g.num_heads} * kMlaKpeDim);
  ref.ckv_new.clear();
  ref.kpe_new.clear();
  ref.out.assign(rows.size() * g.num_heads * kMlaCkvDim, kBf16QuietNan);
  ref.lse.assign(host.lse.empty() ? 0 : rows.size() * g.num_heads, 0.f);
  reference::MlaAttention(ref.Params());
  const int64_t out_width = int64_t{g.num_heads} * kMlaCkvDim;
  for (const Got& r : got) {
    SCOPED_TRACE(::testing::Message() << "variant " << r.variant);
    ExpectSameCache(r.cache, host.cache);
    ExpectResults(Gather(r.out, host.table, rows, out_width),
                  Gather(r.lse, host.table, rows, host.lse.empty() ? 0 : g.num_heads), ref.out,
                  ref.lse);
  }
}

// Ragged prefill: a one-token query, exact page multiples, q_len > kv_len rows (with and without
// append), an empty sequence and mixed layers.
std::vector<Case> PrefillCases(int page_size) {
  const int ps = page_size;
  std::vector<Case> cases;
  BatchOptions append;
  append.append = true;
  cases.push_back({"append_ragged",
                   {{1, 1, 0}, {37, 37, 1}, {20, 20 + 3 * ps, 0}, {5, 2 * ps + 7, 1}, {64, 200, 0}},
                   append});
  // Rows appended before the sequence's first token (q_len > kv_len) have no slot: the append
  // skips them instead of writing in front of the sequence's first page.
  cases.push_back({"append_before_first_token", {{6, 2, 0}, {3, 3, 1}, {9, 4, 0}}, append});
  BatchOptions attend;
  attend.pad_last_page_len = true;
  cases.push_back({"attend_unseeing_rows",
                   {{9, 4, 0}, {0, 0, 0}, {3, ps, 1}, {70, 130, 0}, {1, 1, 0}},
                   attend});
  BatchOptions no_lse = append;
  no_lse.with_lse = false;
  cases.push_back({"no_lse", {{48, 300, 0}, {17, 17, 0}}, no_lse});
  BatchOptions full = attend;
  full.causal = false;
  cases.push_back({"non_causal", {{12, 90, 0}, {4, 2, 0}}, full});
  BatchOptions negative = append;
  negative.sm_scale = -0.07f;  // legal: masked keys must stay masked whatever the sign
  cases.push_back({"negative_scale", {{40, 100, 0}, {3, 3, 0}}, negative});
  // Several key tiles per item (the Hopper kernels' 2-stage ring wraps), checked on sampled rows.
  cases.push_back({"long_ragged", {{130, 1000, 0}, {1, 517, 1}, {300, 300, 0}}, append, 48});
  return cases;
}

std::vector<Case> DecodeCases() {
  std::vector<Case> cases;
  BatchOptions append;
  append.decode = true;
  append.append = true;
  cases.push_back({"append", Decode({1, 16, 17, 64, 333, 1000}), append});
  BatchOptions attend;
  attend.decode = true;
  attend.force_seq_layer = true;
  cases.push_back({"attend_with_empty", Decode({0, 5, 129, 2048}), attend});
  return cases;
}

struct GqaShape {
  int qo, kv, dim;
};

// Real-model geometries (docs/design.md, "Attention semantics") plus group sizes 3, 5 and 7.
const GqaShape kGqaShapes[] = {
    {32, 8, 128},  {32, 4, 128},  {16, 2, 128}, {20, 4, 128}, {24, 8, 128}, {24, 4, 128},
    {32, 16, 128}, {40, 10, 128}, {48, 8, 128}, {5, 1, 128},  {6, 1, 128},  {16, 1, 128},
    {8, 1, 128},   {28, 4, 128},  {32, 8, 64},  {16, 2, 64},  {64, 8, 64},  {6, 2, 64},
    {10, 2, 64},   {7, 1, 64},    {8, 1, 256},  {12, 2, 256}, {14, 2, 256}};

class KernelTest : public ::testing::Test {
 protected:
  void SetUp() override {
    if (!CudaDeviceAvailable()) GTEST_SKIP() << "no CUDA device";
  }
};

void GqaPrefillSweep(const std::vector<int>& candidates) {
  for (const GqaShape& s : kGqaShapes) {
    const std::vector<int> variants = PrefillVariants(s.dim, candidates);
    if (variants.empty()) continue;
    for (int page_size : {1, 3, 16, 64}) {
      const GqaGeometry g{2, page_size, s.qo, s.kv, s.dim};
      for (const Case& c : PrefillCases(page_size)) {
        SCOPED_TRACE(::testing::Message() << s.qo << "/" << s.kv << " d" << s.dim << " page "
                                          << page_size << " " << c.name);
        RunGqa(g, c, variants);
      }
    }
  }
}

TEST_F(KernelTest, GqaPrefillSweep) { GqaPrefillSweep(CheckedPrefillVariants()); }

TEST_F(KernelTest, GqaDecodeSweep) {
  for (const GqaShape& s : kGqaShapes) {
    for (int page_size : {1, 16, 64, 5}) {
      const GqaGeometry g{2, page_size, s.qo, s.kv, s.dim};
      for (const Case& c : DecodeCases()) {
        SCOPED_TRACE(::testing::Message() << s.qo << "/" << s.kv << " d" << s.dim << " page "
                                          << page_size << " " << c.name);
        RunGqa(g, c, DecodeVariants(s.dim));
      }
    }
  }
}

// The default variant depends on the page size, which comes from a pool's geometry: none is
// chosen for a cache without pages (no device needed).
TEST(MlaTilingTest, RejectsPagesWithoutKeys) {
  for (int page_size : {0, -64}) {
    cuda::KernelTiling tiling;
    EXPECT_EQ(cuda::GetMlaTiling(16, page_size, false, &tiling), cudaErrorInvalidValue);
  }
}

TEST_F(KernelTest, MlaSweep) {
  for (int heads : {8, 16, 32, 64, 128}) {
    for (int page_size : {1, 16, 64, 5}) {
      const MlaGeometry g{2, page_size, heads};
      std::vector<Case> cases = DecodeCases();
      if (heads <= 16 || page_size == 64) {
        for (const Case& c : PrefillCases(page_size)) cases.push_back(c);
      }
      for (Case& c : cases) {
        if (c.options.sm_scale == 0.f) c.options.sm_scale = 0.1352337747812271f;
      }
      for (const Case& c : cases) {
        SCOPED_TRACE(::testing::Message()
                     << "mla h" << heads << " page " << page_size << " " << c.name);
        RunMla(g, c);
      }
    }
  }
}

// Logits past float32's range (kernels/attention.h; MakeLogitsOverflow builds them: q = 1e38,
// sm_scale = 1e38, every logit -inf): every row that sees a key comes back NaN, never as the
// empty-row encoding, and rows that see none stay 0 / kEmptyRowLse, through every kernel, split
// and unsplit. Outputs start finite (0x3f bytes: about 0.75 in bf16 and float32), so a row no
// kernel writes fails as well.
constexpr Overflow kOverflows[] = {Overflow::kHugeQuery, Overflow::kHugeScale, Overflow::kMinusInf};
constexpr int kFiniteBytes = 0x3f;
// Short chunks for the split cases, so that they split on any GPU (the others keep the kernels'
// own minimum, longer than any of their sequences, and do not split).
PlanOverrides OverflowPlan(bool split) { return split ? PlanOverrides{64, 0} : PlanOverrides{}; }

struct OverflowCase {
  std::string name;
  std::vector<SeqSpec> seqs;
  BatchOptions options;
  bool split;  // the plan must split KV (and merge), or must not
};

void ExpectOverflowRows(DeviceBatch& device, const HostPageTable& t, int page_size, bool causal,
                        int num_heads, int v_dim, bool split) {
  ASSERT_EQ(!device.plan().merges.empty(), split)
      << (split ? "the plan does not split" : "the plan splits");
  ASSERT_CUDA_OK(device.PoisonOutputs(nullptr, kFiniteBytes));
  ASSERT_CUDA_OK(device.Run(nullptr));
  std::vector<bf16> out, cache;
  std::vector<float> lse;
  ASSERT_CUDA_OK(device.Download(&out, &lse, &cache));
  std::string report;
  EXPECT_EQ(CheckOverflowRows(t, page_size, causal, num_heads, v_dim, out, lse, &report), 0)
      << report;
}

void RunGqaOverflow(const GqaGeometry& g, const OverflowCase& c, const std::vector<int>& variants) {
  for (Overflow how : kOverflows) {
    std::mt19937_64 rng(Seed());
    GqaHostBatch host = MakeGqaBatch(g, c.seqs, c.options, rng);
    MakeLogitsOverflow(how, &host);
    for (int v : variants) {
      SCOPED_TRACE(::testing::Message()
                   << c.name << " overflow " << static_cast<int>(how) << " variant " << v);
      std::unique_ptr<DeviceBatch> device;
      ASSERT_CUDA_OK(DeviceBatch::Create(host, &device, v, OverflowPlan(c.split)));
      ExpectOverflowRows(*device, host.table, g.page_size, host.causal, g.num_qo_heads, g.head_dim,
                         c.split);
    }
  }
}

void RunMlaOverflow(const MlaGeometry& g, const OverflowCase& c) {
  for (Overflow how : kOverflows) {
    std::mt19937_64 rng(Seed());
    MlaHostBatch host = MakeMlaBatch(g, c.seqs, c.options, rng);
    MakeLogitsOverflow(how, &host);
    for (int v : MlaVariants(g)) {
      SCOPED_TRACE(::testing::Message()
                   << c.name << " overflow " << static_cast<int>(how) << " variant " << v);
      std::unique_ptr<DeviceBatch> device;
      ASSERT_CUDA_OK(DeviceBatch::Create(host, &device, v, OverflowPlan(c.split)));
      ExpectOverflowRows(*device, host.table, g.page_size, host.causal, g.num_heads, kMlaCkvDim,
                         c.split);
    }
  }
}

// Prefill and decode batches: ragged with q_len > kv_len rows and empty sequences, unsplit; one
// long sequence next to short ones, split (q_len > kv_len rows inside a split sequence too).
std::vector<OverflowCase> OverflowCases(bool decode) {
  BatchOptions append;
  append.append = true;
  append.decode = decode;
  BatchOptions attend;
  attend.decode = decode;
  if (decode) {
    return {{"decode_ragged", Decode({1, 16, 333, 0}), append, false},
            {"decode_split", Decode({4096, 0, 3}), append, true},
            {"decode_split_attend", Decode({2000, 1}), attend, true}};
  }
  BatchOptions full = attend;
  full.causal = false;
  full.with_lse = false;
  return {{"prefill_ragged",
           {{1, 1, 0}, {37, 37, 0}, {9, 4, 0}, {0, 0, 0}, {3, 16, 0}, {70, 130, 0}},
           append,
           false},
          {"prefill_non_causal", {{12, 90, 0}, {4, 2, 0}}, full, false},
          {"prefill_split", {{8, 4096, 0}, {6, 3, 0}}, append, true},
          // Longer than two of the sm_90a kernels' 128-key tiles, so that every variant splits.
          {"prefill_split_unseeing_rows", {{300, 290, 0}}, attend, true}};
}

TEST_F(KernelTest, GqaOverflowIsNaN) {
  for (const GqaShape& s : {GqaShape{32, 8, 128}, GqaShape{16, 2, 64}, GqaShape{8, 1, 256}}) {
    const GqaGeometry g{1, 16, s.qo, s.kv, s.dim};
    SCOPED_TRACE(::testing::Message() << s.qo << "/" << s.kv << " d" << s.dim);
    std::vector<int> variants = PrefillVariants(s.dim, CheckedPrefillVariants());
    std::erase(variants, cuda::kGqaPrefillOnDecodeKernel);
    for (OverflowCase c : OverflowCases(false)) {
      RunGqaOverflow(g, c, variants);
      // The decode kernel's 16-row CTAs fill the GPU with 300 rows unsplit; 100 rows on 90 keys
      // leave it room to split (into two 64-key chunks).
      if (c.name == "prefill_split_unseeing_rows") c.seqs = {{100, 90, 0}};
      RunGqaOverflow(g, c, {cuda::kGqaPrefillOnDecodeKernel});
    }
    for (const OverflowCase& c : OverflowCases(true)) RunGqaOverflow(g, c, DecodeVariants(s.dim));
  }
}

TEST_F(KernelTest, MlaOverflowIsNaN) {
  for (int heads : {16, 128}) {
    const MlaGeometry g{1, 16, heads};
    SCOPED_TRACE(::testing::Message() << "mla h" << heads);
    for (bool decode : {false, true}) {
      for (OverflowCase c : OverflowCases(decode)) {
        c.options.sm_scale = 0.1352337747812271f;
        // MLA's 64-key tiles split 90 keys, and 100 rows x 128 heads still leave the GPU room
        // to (300 rows at 128 heads fill it unsplit; seen on the H200).
        if (c.name == "prefill_split_unseeing_rows") c.seqs = {{100, 90, 0}};
        RunMlaOverflow(g, c);
      }
    }
  }
}

// Shapes of the published workloads, checked on sampled rows.
TEST_F(KernelTest, GqaWorkloadShapes) {
  BatchOptions decode;
  decode.decode = true;
  decode.append = true;
  std::mt19937 rng(1);
  std::vector<int> lens64;
  for (int i = 0; i < 64; ++i) lens64.push_back(200 + rng() % 1600);  // ~64K tokens in all
  const GqaGeometry g16{1, 16, 32, 8, 128};
  const std::vector<int> decode_variants = DecodeVariants(128);
  RunGqa(g16, {"decode_b1_16k", Decode({16384}), decode, 16}, decode_variants);
  RunGqa(g16, {"decode_b16", Decode(std::vector<int>(16, 3800)), decode, 32}, decode_variants);
  RunGqa({1, 1, 32, 8, 128}, {"decode_b64_page1", Decode(lens64), decode, 32}, decode_variants);
  RunGqa({1, 64, 32, 8, 128}, {"decode_b64_page64", Decode(lens64), decode, 32}, decode_variants);
  // 32 chunks of 512 keys at head_dim 256: more than the wide merge loads at once (2 groups of 8).
  RunGqa({1, 16, 8, 1, 256}, {"decode_b1_16k_dim256", Decode({16384}), decode},
         DecodeVariants(256));

  BatchOptions prefill;
  prefill.append = true;
  const std::vector<int> variants = PrefillVariants(128, CheckedPrefillVariants());
  RunGqa(g16, {"prefill_16384", {{16384, 16384, 0}}, prefill, 24}, variants);
  RunGqa({1, 64, 20, 4, 128}, {"chunk_1117_on_71488", {{1117, 71488 + 1117, 0}}, prefill, 6},
         variants);
  std::vector<SeqSpec> ragged;
  for (int i = 0; i < 8; ++i) ragged.push_back({512, 1536, 0});
  RunGqa({1, 16, 40, 10, 128}, {"prefill_8x512_on_1024", ragged, prefill, 24}, variants);
}

// A stamped prefill computes what its unstamped variant does, bit for bit, and writes one sane
// record per work (a CTA of the GQA prefill, an item of the persistent MLA kernel): within the
// buffer, on a real SM, its phases in order.
template <typename HostBatch>
void ExpectStamped(HostBatch& host, int variant, int stamped) {
  constexpr bool kMla = std::is_same_v<HostBatch, MlaHostBatch>;
  SCOPED_TRACE(::testing::Message() << "variant " << stamped);
  std::vector<Got> got;
  ASSERT_NO_FATAL_FAILURE(RunVariants(host, {variant}, &got));
  std::unique_ptr<DeviceBatch> device;
  ASSERT_CUDA_OK(DeviceBatch::Create(host, &device, stamped));
  int works = static_cast<int>(device->plan().items.size());
  if constexpr (!kMla) works *= host.geometry.num_kv_heads;
  const auto set = kMla ? cuda::SetMlaPhaseStamps : cuda::SetGqaPrefillPhaseStamps;
  const int capacity = works + 8;  // the slack must stay untouched
  const size_t bytes = sizeof(uint64_t) * capacity * cuda::kPhaseStampSlots;
  void* buffer = nullptr;
  ASSERT_CUDA_OK(cudaMalloc(&buffer, bytes));
  auto* records = static_cast<uint64_t*>(buffer);
  ASSERT_CUDA_OK(cudaMemset(records, 0, bytes));
  ASSERT_CUDA_OK(set({records, capacity}));
  ASSERT_CUDA_OK(device->PoisonOutputs(nullptr));
  ASSERT_CUDA_OK(device->Run(nullptr));
  ASSERT_CUDA_OK(set({}));
  Got r{stamped, {}, {}, {}};
  ASSERT_CUDA_OK(device->Download(&r.out, &r.lse, &r.cache));
  std::vector<uint64_t> host_records(bytes / sizeof(uint64_t));
  ASSERT_CUDA_OK(cudaMemcpy(host_records.data(), records, bytes, cudaMemcpyDeviceToHost));
  ASSERT_CUDA_OK(cudaFree(records));
  EXPECT_EQ(0, std::memcmp(r.out.data(), got[0].out.data(), r.out.size() * sizeof(bf16)));
  EXPECT_EQ(r.lse, got[0].lse);

  int sms = 0;
  ASSERT_CUDA_OK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));
  using cuda::PhaseSlot;
  int with_tiles = 0;
  for (int c = 0; c < capacity; ++c) {
    SCOPED_TRACE(::testing::Message() << "work " << c);
    const uint64_t* rec = &host_records[static_cast<size_t>(c) * cuda::kPhaseStampSlots];
    auto at = [&](PhaseSlot slot) { return rec[static_cast<int>(slot)]; };
    if (c >= works) {
      EXPECT_EQ(at(PhaseSlot::kStartNs), 0u);
      continue;
    }
    EXPECT_LT(at(PhaseSlot::kSmAndTiles) & 0xffffffffu, static_cast<uint64_t>(sms));
    EXPECT_GT(at(PhaseSlot::kStartNs), 0u);
    if ((at(PhaseSlot::kSmAndTiles) >> 32) == 0) continue;  // a work without keys ends early
    ++with_tiles;
    // Stamps of one thread are in program order, and the CTA's start stamps come before the
    // barrier every thread passes; the producer's and warpgroup 1's are otherwise only written
    // (nothing orders them against warpgroup 0's).
    EXPECT_LE(at(PhaseSlot::kStartNs), at(PhaseSlot::kEndNs0));
    EXPECT_LT(at(PhaseSlot::kStartClock), at(PhaseSlot::kQReadyClock));
    EXPECT_LT(at(PhaseSlot::kQReadyClock), at(PhaseSlot::kFirstSClock));
    EXPECT_LE(at(PhaseSlot::kFirstSClock), at(PhaseSlot::kLoopEndClock));
    EXPECT_LT(at(PhaseSlot::kLoopEndClock), at(PhaseSlot::kStoredClock0));
    EXPECT_LT(at(PhaseSlot::kQIssuedClock), at(PhaseSlot::kProducedClock));
    EXPECT_GT(at(PhaseSlot::kEndNs1), 0u);
    EXPECT_GT(at(PhaseSlot::kStoredClock1), 0u);
  }
  EXPECT_GT(with_tiles, 0);
}

// The stamped MLA kernels are 46 and the trial 60, persistent: many items a CTA (three sequences an
// SM), an empty sequence among them, on cp.async tiles (page 1) and TMA ones (page 64).
TEST_F(KernelTest, MlaPhaseStamps) {
  int sms = 0;
  ASSERT_CUDA_OK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));
  std::mt19937_64 rng(Seed());
  std::vector<SeqSpec> seqs;
  for (int i = 0; i < 3 * sms; ++i) {
    const int q = 1 + static_cast<int>(rng() % 12);
    seqs.push_back(i == 5 ? SeqSpec{0, 0, 0} : SeqSpec{q, q + static_cast<int>(rng() % 400), 0});
  }
  BatchOptions options;
  options.pad_last_page_len = true;
  for (int page_size : {1, 64}) {
    SCOPED_TRACE(::testing::Message() << "page " << page_size);
    if (AcceptedVariants({cuda::kMlaSm90Stamped}, [&](cuda::KernelTiling* t) {
          return cuda::GetMlaTiling(16, page_size, false, t);
        }).empty()) {
      GTEST_SKIP() << "no sm_90a kernels here";
    }
    MlaHostBatch host = MakeMlaBatch({1, page_size, 16}, seqs, options, rng);
    for (int stamped : {cuda::kMlaSm90Stamped, cuda::kMlaSm90StampedSplitQ}) {
      ExpectStamped(host, cuda::kMlaSm90LateRightTmaTouch2LazyLean, stamped);
    }
  }
}

// The stamped variant is the default's kernel: its TMA tiles at page size 16, its copying twin at
// page size 3.
TEST_F(KernelTest, GqaPrefillPhaseStamps) {
  if (PrefillVariants(128, {cuda::kGqaPrefillSm90Stamped}).empty()) {
    GTEST_SKIP() << "no sm_90a kernels here";
  }
  std::mt19937_64 rng(Seed());
  BatchOptions options;
  options.append = true;
  std::vector<SeqSpec> seqs = {{300, 1000, 0}, {130, 130, 0}, {0, 7, 0}};
  for (int i = 0; i < 12; ++i) seqs.push_back({100 + 40 * i, 600, 0});
  for (int page_size : {16, 3}) {
    SCOPED_TRACE(::testing::Message() << "page " << page_size);
    GqaHostBatch host = MakeGqaBatch({1, page_size, 40, 10, 128}, seqs, options, rng);
    ExpectStamped(host, cuda::kGqaPrefillSm90TmaLeanLazyRescale, cuda::kGqaPrefillSm90Stamped);
  }
}

// A prefill launched chunk by chunk (LaunchOptions::output_chunk_bytes), in any order, computes
// what the one launch does, bit for bit: the same items, each run once.
template <typename HostBatch>
void ExpectChunkedSame(HostBatch& host, int variant, size_t out_bytes) {
  SCOPED_TRACE(::testing::Message() << "variant " << variant);
  std::vector<Got> whole;
  ASSERT_NO_FATAL_FAILURE(RunVariants(host, {variant}, &whole));
  for (const bool reversed : {false, true}) {
    SCOPED_TRACE(reversed ? "last chunk first" : "in order");
    std::unique_ptr<DeviceBatch> device;
    PlanOverrides chunks;
    chunks.output_chunk_bytes = out_bytes / 5;
    ASSERT_CUDA_OK(DeviceBatch::Create(host, &device, variant, chunks));
    const int n = static_cast<int>(device->output_chunks().size());
    ASSERT_GE(n, 4);
    std::vector<int> order;
    for (int i = 0; i < n; ++i) order.push_back(reversed ? n - 1 - i : i);
    ASSERT_CUDA_OK(device->PoisonOutputs(nullptr));
    ASSERT_CUDA_OK(device->RunChunked(nullptr, order));
    Got r{variant, {}, {}, {}};
    ASSERT_CUDA_OK(device->Download(&r.out, &r.lse, &r.cache));
    EXPECT_EQ(0, std::memcmp(r.out.data(), whole[0].out.data(), r.out.size() * sizeof(bf16)));
    EXPECT_EQ(0, std::memcmp(r.lse.data(), whole[0].lse.data(), r.lse.size() * sizeof(float)));
    EXPECT_EQ(0, std::memcmp(r.cache.data(), whole[0].cache.data(), r.cache.size() * sizeof(bf16)));
  }
}

TEST_F(KernelTest, ChunkedPrefillComputesTheSame) {
  std::mt19937_64 rng(Seed());
  BatchOptions options;
  options.append = true;
  // Enough CTAs that nothing is split; a sequence of one row and one with more rows than keys.
  const std::vector<SeqSpec> seqs = {{1500, 2500, 0}, {400, 400, 0}, {1, 50, 0},
                                     {37, 900, 0},    {300, 200, 0}, {200, 1200, 0}};
  const GqaGeometry gqa{1, 16, 32, 8, 128};
  GqaHostBatch g = MakeGqaBatch(gqa, seqs, options, rng);
  for (int variant : PrefillVariants(128, CheckedPrefillVariants())) {
    ExpectChunkedSame(g, variant, g.out.size() * sizeof(bf16));
  }
  const GqaGeometry group5{1, 16, 40, 8, 64};
  GqaHostBatch g5 = MakeGqaBatch(group5, seqs, options, rng);
  ExpectChunkedSame(g5, -1, g5.out.size() * sizeof(bf16));
  MlaHostBatch m = MakeMlaBatch({1, 64, 16}, seqs, options, rng);
  ExpectChunkedSame(m, -1, m.out.size() * sizeof(bf16));
}

// Logits spread over tens of log2 units (queries 40 times the sweeps' scale): rows' maxima move
// by more than the lazy rescale's 8 after O already holds weight, and tiles whose maxima stay
// within 8 of the row's give p up to 2^8 (kLazyRescale in kernels/cuda/sm90/gqa_prefill_sm90.cu
// and mla_sm90.cu; the sweeps' logits stay within a few units, where the maximum rarely moves
// after the first tile).
TEST_F(KernelTest, WideLogitRange) {
  BatchOptions prefill;
  prefill.append = true;
  prefill.query_scale = 40.f;
  BatchOptions decode = prefill;
  decode.decode = true;
  const GqaGeometry g{1, 16, 32, 8, 128};
  const std::vector<SeqSpec> seqs = {{1024, 3072, 0}, {700, 700, 0}, {37, 5000, 0}};
  RunGqa(g, {"gqa_prefill", seqs, prefill, 64}, PrefillVariants(128, CheckedPrefillVariants()));
  RunGqa(g, {"gqa_decode", Decode({4096, 900, 1}), decode}, DecodeVariants(128));
  prefill.sm_scale = decode.sm_scale = 0.1352337747812271f;
  RunMla({1, 64, 16}, {"mla_prefill", seqs, prefill, 64});
  RunMla({1, 1, 16}, {"mla_prefill_page1", seqs, prefill, 64});
  RunMla({1, 64, 128}, {"mla_decode_128_heads", Decode({4096, 900}), decode});
}

// The persistent MLA kernels (45, 46) run each CTA over many items taken from the plan's counter
// (DevicePlan::schedule): on a batch of several items an SM, empty sequences and rows that see no
// key among them, they compute what their one-item-a-CTA siblings (43, 44) do, bit for bit, and
// again on a second launch of the same plan (the counter is left at zero for it).
TEST_F(KernelTest, PersistentMlaRunsEveryItemOnce) {
  int device = 0, sms = 0;
  ASSERT_CUDA_OK(cudaGetDevice(&device));
  ASSERT_CUDA_OK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device));
  std::mt19937_64 rng(Seed());
  std::vector<SeqSpec> seqs;
  for (int i = 0; i < 3 * sms; ++i) {
    const int q = 1 + static_cast<int>(rng() % 12);
    const int kv = i % 17 == 0 ? q / 2 : q + static_cast<int>(rng() % 400);  // some q_len > kv_len
    seqs.push_back(i % 29 == 0 ? SeqSpec{0, 0, 0} : SeqSpec{q, kv, 0});
  }
  BatchOptions options;
  options.pad_last_page_len = true;
  options.sm_scale = 0.1352337747812271f;
  const std::pair<int, int> pairs[] = {
      {cuda::kMlaSm90PersistentLean, cuda::kMlaSm90LateRightTmaLazyLean},
      {cuda::kMlaSm90PersistentTouch2Lean, cuda::kMlaSm90LateRightTmaTouch2LazyLean},
      {cuda::kMlaSm90PersistentLeanNext, cuda::kMlaSm90LateRightTmaLazyLean},
      {cuda::kMlaSm90PersistentTouch2LeanNext, cuda::kMlaSm90LateRightTmaTouch2LazyLean},
      {cuda::kMlaSm90PersistentTouch2LeanNextTouched, cuda::kMlaSm90LateRightTmaTouch2LazyLean},
      {cuda::kMlaSm90PersistentLeanSplitQ, cuda::kMlaSm90LateRightTmaLazyLean},
      {cuda::kMlaSm90PersistentTouch2LeanSplitQ, cuda::kMlaSm90LateRightTmaTouch2LazyLean}};
  for (int page_size : {64, 1}) {
    MlaHostBatch host = MakeMlaBatch({1, page_size, 16}, seqs, options, rng);
    for (const auto& [persistent, sibling] : pairs) {
      SCOPED_TRACE(::testing::Message() << "page " << page_size << " variant " << persistent);
      if (AcceptedVariants({persistent}, [&](cuda::KernelTiling* t) {
            return cuda::GetMlaTiling(16, page_size, false, t);
          }).empty()) {
        GTEST_SKIP() << "no persistent MLA kernel on this device";
      }
      std::vector<Got> want;
      ASSERT_NO_FATAL_FAILURE(RunVariants(host, {sibling}, &want));
      std::unique_ptr<DeviceBatch> d;
      ASSERT_CUDA_OK(DeviceBatch::Create(host, &d, persistent));
      ASSERT_GT(d->plan().items.size(), static_cast<size_t>(2 * sms));
      for (int launch = 0; launch < 2; ++launch) {
        SCOPED_TRACE(::testing::Message() << "launch " << launch);
        ASSERT_CUDA_OK(d->PoisonOutputs(nullptr));
        ASSERT_CUDA_OK(d->Run(nullptr));
        Got r{persistent, {}, {}, {}};
        ASSERT_CUDA_OK(d->Download(&r.out, &r.lse, &r.cache));
        EXPECT_EQ(0, std::memcmp(r.out.data(), want[0].out.data(), r.out.size() * sizeof(bf16)));
        EXPECT_EQ(0, std::memcmp(r.lse.data(), want[0].lse.data(), r.lse.size() * sizeof(float)));
      }
    }
  }
}

TEST_F(KernelTest, MlaWorkloadShapes) {
  BatchOptions decode;
  decode.decode = true;
  decode.append = true;
  decode.sm_scale = 0.1352337747812271f;
  RunMla({1, 64, 16}, {"decode_b64", Decode(std::vector<int>(64, 1024)), decode, 32});
  RunMla({1, 64, 128}, {"decode_128_heads", Decode(std::vector<int>(8, 4096)), decode, 8});
  BatchOptions prefill = decode;
  prefill.decode = false;
  std::vector<SeqSpec> seqs;
  std::mt19937 rng(2);
  int total = 0;
  for (int i = 0; i < 11; ++i) {
    const int q = i == 10 ? 6053 - total : 300 + static_cast<int>(rng() % 250);  // sums to 6053
    total += q;
    seqs.push_back({q, q + static_cast<int>(rng() % 2000), 0});
  }
  RunMla({1, 64, 16}, {"prefill_6053_11_seqs", seqs, prefill, 24});
}

}  // namespace
}  // namespace attn::testing
