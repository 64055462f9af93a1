#include "kernels/cuda/plan.h"

#include <algorithm>
#include <limits>
#include <map>
#include <random>
#include <set>
#include <tuple>

#include "gtest/gtest.h"

namespace attn {
namespace {

// Checks that executing `plan` would compute exactly the contract: every (token, head) sees each
// of its visible keys once, partial rows are distinct and inside the workspace, and every split
// token is merged from exactly the chunks that hold its keys.
void ExpectPlanCovers(const PlanConfig& c, const AttentionPlan& plan,
                      const std::vector<int32_t>& q_lens, const std::vector<int32_t>& kv_lens) {
  const int batch = static_cast<int>(q_lens.size());
  std::vector<int32_t> q_begin(batch + 1, 0);
  for (int b = 0; b < batch; ++b) q_begin[b + 1] = q_begin[b] + q_lens[b];

  // keys_seen[(seq, packed row)] and the partial rows written per (seq, token, head-in-group).
  std::map<std::pair<int, int>, int64_t> keys_seen;
  std::map<std::tuple<int, int, int>, std::vector<int32_t>> partials;
  std::set<int64_t> partial_rows_written;
  for (const WorkItem& it : plan.items) {
    ASSERT_GE(it.kv_begin, 0);
    ASSERT_LE(it.kv_begin, it.kv_end);
    if (plan.chunk_len > 0 && it.partial_row >= 0) {
      EXPECT_EQ(it.kv_begin % plan.chunk_len, 0);
      EXPECT_LE(it.kv_end - it.kv_begin, plan.chunk_len);
    }
    const int rows = q_lens[it.seq] * c.group;
    ASSERT_LT(it.row_begin, std::max(rows, 1));
    EXPECT_EQ(it.row_begin % c.block_m, 0);
    for (int p = it.row_begin; p < std::min(it.row_begin + c.block_m, rows); ++p) {
      const int token = p / c.group;
      const int vis = VisibleKeys(q_lens[it.seq], kv_lens[it.seq], token, c.causal);
      const int seen = std::max(0, std::min(it.kv_end, vis) - it.kv_begin);
      keys_seen[{it.seq, p}] += seen;
      if (it.partial_row >= 0) {
        for (int kvh = 0; kvh < c.num_kv_heads; ++kvh) {
          const int64_t row =
              it.partial_row + int64_t{token} * c.num_qo_heads + kvh * c.group + p % c.group;
          EXPECT_LT(row, plan.partial_rows);
          EXPECT_TRUE(partial_rows_written.insert(row).second) << "partial row written twice";
        }
        if (seen > 0) partials[{it.seq, token, p % c.group}].push_back(it.partial_row);
      }
    }
  }
  for (int b = 0; b < batch; ++b) {
    for (int p = 0; p < q_lens[b] * c.group; ++p) {
      const int vis = VisibleKeys(q_lens[b], kv_lens[b], p / c.group, c.causal);
      EXPECT_EQ((keys_seen[{b, p}]), vis) << "seq " << b << " packed row " << p;
    }
  }
  // Merges: one per token of each split sequence, naming the chunks that hold its keys.
  for (const MergeRow& m : plan.merges) {
    const int b = static_cast<int>(std::upper_bound(q_begin.begin(), q_begin.end(), m.out_row) -
                                   q_begin.begin()) -
                  1;
    const int token = m.out_row - q_begin[b];
    EXPECT_EQ(m.split_stride, q_lens[b] * c.num_qo_heads);
    for (int g = 0; g < c.group; ++g) {
      std::vector<int32_t> expected;
      for (int s = 0; s < m.num_splits; ++s) {
        expected.push_back(m.partial_row + s * m.split_stride - token * c.num_qo_heads);
      }
      auto got = partials[{b, token, g}];
      std::sort(got.begin(), got.end());
      EXPECT_EQ(got, expected) << "seq " << b << " token " << token;
    }
  }
  EXPECT_LE(plan.partial_rows, c.max_partial_rows);
  int max_splits = 0;
  for (const MergeRow& m : plan.merges) max_splits = std::max(max_splits, m.num_splits);
  EXPECT_EQ(plan.max_splits, max_splits);
  // A cluster plan: groups of n consecutive items, one row tile's chunks in order, each chunk
  // whole key tiles but the last one that holds keys; the order below is the groups'.
  std::vector<WorkItem> units;
  const size_t n = plan.cluster_splits > 1 ? plan.cluster_splits : 1;
  ASSERT_EQ(plan.items.size() % n, 0u);
  for (size_t g = 0; g < plan.items.size(); g += n) {
    WorkItem unit = plan.items[g];
    for (size_t s = 1; s < n; ++s) {
      const WorkItem& w = plan.items[g + s];
      EXPECT_EQ(w.seq, unit.seq) << "item " << g + s;
      EXPECT_EQ(w.row_begin, unit.row_begin) << "item " << g + s;
      EXPECT_EQ(w.kv_begin, unit.kv_end) << "item " << g + s;
      if (w.kv_end > w.kv_begin) {
        EXPECT_EQ(unit.kv_end % c.block_n, 0) << "item " << g + s;
      }
      unit.kv_end = w.kv_end;
    }
    if (n > 1) {
      EXPECT_EQ(unit.kv_begin, 0);
      EXPECT_EQ(unit.partial_row, -1);
    }
    units.push_back(unit);
  }
  // Sequence by sequence, in the order of their longest items, each one's items longest first.
  const auto keys = [](const WorkItem& w) { return w.kv_end - w.kv_begin; };
  std::set<int> done;
  int32_t group_longest = std::numeric_limits<int32_t>::max();
  for (size_t i = 0; i < units.size(); ++i) {
    const WorkItem& w = units[i];
    if (i > 0 && w.seq == units[i - 1].seq) {
      EXPECT_GE(keys(units[i - 1]), keys(w)) << "item " << i * n;
      continue;
    }
    if (i > 0) done.insert(units[i - 1].seq);
    EXPECT_FALSE(done.contains(w.seq)) << "sequence " << w.seq << " comes back at item " << i * n;
    EXPECT_LE(keys(w), group_longest) << "item " << i * n;
    group_longest = keys(w);
  }
}

PlanConfig DecodeConfig(int group, int kv_heads) {
  PlanConfig c;
  c.group = group;
  c.num_kv_heads = kv_heads;
  c.num_qo_heads = group * kv_heads;
  c.block_m = 16;
  c.block_n = 64;
  c.cta_slots = 264;
  return c;
}

TEST(PlanTest, VisibleKeysAreBottomRightAligned) {
  EXPECT_EQ(VisibleKeys(3, 10, 0, true), 8);
  EXPECT_EQ(VisibleKeys(3, 10, 2, true), 10);
  EXPECT_EQ(VisibleKeys(5, 3, 0, true), 0);  // q_len > kv_len: early rows see nothing
  EXPECT_EQ(VisibleKeys(5, 3, 4, true), 3);
  EXPECT_EQ(VisibleKeys(5, 3, 0, false), 3);
  EXPECT_EQ(VisibleKeys(1, 0, 0, true), 0);
}

TEST(PlanTest, AppendedRowsAreTheLastTokens) {
  SeqExtent e{};
  e.q_len = 3;
  e.kv_len = 10;
  EXPECT_EQ(AppendPosition(e, 0), 7);
  EXPECT_EQ(AppendPosition(e, 2), 9);
  e.q_len = 5;
  e.kv_len = 3;  // the first two rows have no slot
  EXPECT_EQ(AppendPosition(e, 1), -1);
  EXPECT_EQ(AppendPosition(e, 2), 0);
}

TEST(PlanTest, LargeDecodeBatchSplitsOnlyToFillTheGpu) {
  // 64 x 4096, 32/8 heads: 512 unsplit CTAs < 2 waves of 264 -> split into 2048-key chunks.
  PlanConfig c = DecodeConfig(4, 8);
  std::vector<int32_t> q(64, 1), kv(64, 4096);
  const AttentionPlan plan = PlanAttention(c, q.data(), kv.data(), 64);
  EXPECT_EQ(plan.chunk_len, 2048);
  EXPECT_EQ(plan.items.size(), 128u);
  EXPECT_EQ(plan.merges.size(), 64u);
  ExpectPlanCovers(c, plan, q, kv);

  // Twice the batch fills two waves on its own: no split, no merge.
  std::vector<int32_t> q2(128, 1), kv2(128, 4096);
  const AttentionPlan whole = PlanAttention(c, q2.data(), kv2.data(), 128);
  EXPECT_EQ(whole.chunk_len, 0);
  EXPECT_TRUE(whole.merges.empty());
  ExpectPlanCovers(c, whole, q2, kv2);
}

// `batch` sequences of `keys` keys each, one query token: planned whole.
void ExpectWhole(const PlanConfig& c, int batch, int keys) {
  std::vector<int32_t> q(batch, 1), kv(batch, keys);
  const AttentionPlan whole = PlanAttention(c, q.data(), kv.data(), batch);
  EXPECT_EQ(whole.chunk_len, 0) << batch << " x " << keys;
  EXPECT_TRUE(whole.merges.empty());
  ExpectPlanCovers(c, whole, q, kv);
}

// The chunk length of the same decode's plan (0: whole).
int ChunkLen(const PlanConfig& c, int batch, int keys) {
  std::vector<int32_t> q(batch, 1), kv(batch, keys);
  return PlanAttention(c, q.data(), kv.data(), batch).chunk_len;
}

TEST(PlanTest, FullWavesStayUnsplitWhenTheKernelSaysSo) {
  PlanConfig c = DecodeConfig(4, 8);
  c.no_split_fill = 0.9;
  // 64 x 4096 at 32/8 heads: 512 CTAs keep 97% of 2 waves of 264 slots busy.
  ExpectWhole(c, 64, 4096);
  // 37 sequences: 296 CTAs leave the second wave nearly empty (56% busy): split.
  EXPECT_GT(ChunkLen(c, 37, 4096), 0);
  // 32 x 8192: 256 CTAs keep 97% of one wave busy, the same bytes as 64 x 4096: no split either.
  ExpectWhole(c, 32, 8192);
  // 28 x 8192: 224 CTAs keep 85% of the wave busy: split.
  EXPECT_GT(ChunkLen(c, 28, 8192), 0);

  // As many CTAs as the first case, but one sequence of 16384 keys among short ones: its 8 CTAs
  // would run alone long after the rest (9% busy): split.
  std::vector<int32_t> q(64, 1), kv_long(64, 512);
  kv_long[0] = 16384;
  const AttentionPlan split = PlanAttention(c, q.data(), kv_long.data(), 64);
  EXPECT_GT(split.chunk_len, 0);
  ExpectPlanCovers(c, split, q, kv_long);
}

// The GQA decode's settings (kernels/cuda/gqa_decode.cu): a launch within one wave stays whole
// down to 80% of the slots busy, a longer one down to 90%.
TEST(PlanTest, OneWaveStaysUnsplitAtALowerFill) {
  PlanConfig c = DecodeConfig(4, 8);
  c.no_split_fill = 0.9;
  c.no_split_fill_one_wave = 0.8;
  ExpectWhole(c, 28, 8192);             // 224 CTAs of 264: 85%
  ExpectWhole(c, 32, 8192);             // 97%, as before
  ExpectWhole(c, 64, 4096);             // two waves, 97%
  EXPECT_GT(ChunkLen(c, 24, 8192), 0);  // 192 CTAs: 73%
  EXPECT_GT(ChunkLen(c, 16, 8192), 0);  // 128 CTAs: 48%
  EXPECT_GT(ChunkLen(c, 56, 4096), 0);  // 448 CTAs, 1.7 waves: 85% is not enough past one wave
  EXPECT_GT(ChunkLen(c, 40, 4096), 0);  // 320: 61%

  // Without a one-wave share, no_split_fill decides there too.
  c.no_split_fill_one_wave = 0;
  EXPECT_GT(ChunkLen(c, 28, 8192), 0);
}

// The Hopper MLA decodes' common settings: `heads` query heads over one latent KV head,
// `block_m` packed rows a CTA, one CTA per SM of 132, no split once a launch fills a wave.
PlanConfig MlaDecodeConfig(int heads, int block_m) {
  PlanConfig c;
  c.group = heads;
  c.num_qo_heads = heads;
  c.block_m = block_m;
  c.block_n = 64;
  c.cta_slots = 132;
  c.causal = false;
  c.waves_before_split = 1.0;
  return c;
}

// The transposed MLA decode's settings (kernels/cuda/sm90/mla_sm90.cu, NarrowTraits): 16 heads in
// one 16-row item per sequence, target_waves 1, 512-key chunks at least.
PlanConfig NarrowMlaDecodeConfig() {
  PlanConfig c = MlaDecodeConfig(16, 16);
  c.target_waves = 1.0;
  c.min_chunk_len = 512;
  return c;
}

// The 64-row MLA decode's settings (kernels/cuda/sm90/mla_sm90.cu, Traits): 128 heads in two
// 64-row items a sequence, one CTA an SM, and a cost model in place of the split tests
// (PlanConfig::cta_start_keys): each CTA lasting its keys plus 120, a split's merge 450 plus
// 0.068 a partial row.
PlanConfig CostModelConfig() {
  PlanConfig c = MlaDecodeConfig(128, 64);
  c.min_chunk_len = 512;
  c.cta_start_keys = 120;
  c.merge_keys = 450;
  c.merge_keys_per_row = 0.068;
  return c;
}

TEST(PlanTest, CostModelCutsSequencesIntoEqualChunks) {
  const PlanConfig c = CostModelConfig();
  // 32 x 4096 at 128 heads: 64 CTAs whole (4216); two chunks of 2048 fill 128 SMs once (2168 and
  // a merge of 8192 rows, 1007); four of 1024, 256 CTAs in two waves (2288 and 1564), are slower.
  std::vector<int32_t> q(32, 1), kv(32, 4096);
  const AttentionPlan plan = PlanAttention(c, q.data(), kv.data(), 32);
  EXPECT_EQ(plan.chunk_len, 2048);
  EXPECT_EQ(plan.items.size(), 128u);
  ExpectPlanCovers(c, plan, q, kv);
  // Keys that no chunk count divides: two chunks of whole key tiles, 1536 and 1464 keys.
  std::vector<int32_t> kv3000(32, 3000);
  const AttentionPlan uneven = PlanAttention(c, q.data(), kv3000.data(), 32);
  EXPECT_EQ(uneven.chunk_len, 1536);
  ExpectPlanCovers(c, uneven, q, kv3000);
  // 16 sequences: four chunks, 128 CTAs (1144 and a merge, 1007); 8: eight, 128 CTAs again.
  EXPECT_EQ(ChunkLen(c, 16, 4096), 1024);
  EXPECT_EQ(ChunkLen(c, 8, 4096), 512);
  // A longer context at about a wave: 20 x 8192, three chunks of 2752 keys and fewer (120 CTAs).
  EXPECT_EQ(ChunkLen(c, 20, 8192), 2752);
}

TEST(PlanTest, CostModelKeepsWavesWholeThatASplitCannotShorten) {
  const PlanConfig c = CostModelConfig();
  ExpectWhole(c, 48, 4096);   // 96 CTAs: four chunks would make three waves of 1144 and a merge
  ExpectWhole(c, 64, 4096);   // 128 CTAs: one wave
  ExpectWhole(c, 128, 4096);  // two full waves
  ExpectWhole(c, 8, 512);     // no chunk of 512 keys shorter than the sequences
  ExpectWhole(c, 0, 4096);    // nothing to plan
  // Without the model the same config splits 64 x 4096 (waves_before_split 1, no fill test).
  PlanConfig tests = c;
  tests.cta_start_keys = 0;
  EXPECT_EQ(ChunkLen(tests, 64, 4096), 1024);
}

TEST(PlanTest, CostModelSplitsALongSequenceAmongShortOnes) {
  // One sequence of 65536 keys among 63 of 1024: whole, its two CTAs end ~60000 keys after the
  // rest; cut into chunks of 2048 (32 a tile, every CTA within one wave), the launch is one
  // chunk long plus the merge of its 32 x 128 partial rows (the short ones stay whole).
  const PlanConfig c = CostModelConfig();
  std::vector<int32_t> q(64, 1), kv(64, 1024);
  kv[5] = 65536;
  const AttentionPlan plan = PlanAttention(c, q.data(), kv.data(), 64);
  EXPECT_GT(plan.chunk_len, 0);
  EXPECT_LE(plan.chunk_len, 4096);
  EXPECT_EQ(plan.merges.size(), 1u);  // the long sequence's token
  ExpectPlanCovers(c, plan, q, kv);
  // The workspace caps the chunks: room for 8 partial rows of 128 heads leaves the long
  // sequence at most 8 chunks (8192 keys at least).
  PlanConfig small = c;
  small.max_partial_rows = 8 * 128;
  const AttentionPlan capped = PlanAttention(small, q.data(), kv.data(), 64);
  EXPECT_GE(capped.chunk_len, 8192);
  ExpectPlanCovers(small, capped, q, kv);
}

TEST(PlanTest, OneWaveTargetSplitsIntoAboutOneWave) {
  // 64 x 4096: 64 CTAs < 1 wave -> 262144 keys / 132 items -> 1986 -> 2048-key chunks,
  // 128 CTAs in one wave (4 target waves would make 4 chunks and two waves).
  const PlanConfig c = NarrowMlaDecodeConfig();
  std::vector<int32_t> q(64, 1), kv(64, 4096);
  const AttentionPlan plan = PlanAttention(c, q.data(), kv.data(), 64);
  EXPECT_EQ(plan.chunk_len, 2048);
  EXPECT_EQ(plan.items.size(), 128u);
  ExpectPlanCovers(c, plan, q, kv);

  // 16 x 4096: 65536 / 132 -> 512-key chunks, 8 per sequence, 128 CTAs again.
  std::vector<int32_t> q16(16, 1), kv16(16, 4096);
  const AttentionPlan small = PlanAttention(c, q16.data(), kv16.data(), 16);
  EXPECT_EQ(small.chunk_len, 512);
  EXPECT_EQ(small.items.size(), 128u);
  ExpectPlanCovers(c, small, q16, kv16);
}

TEST(PlanTest, SingleLongSequenceSpreadsOverTheGpu) {
  PlanConfig c = DecodeConfig(4, 8);
  std::vector<int32_t> q{1}, kv{16384};
  const AttentionPlan plan = PlanAttention(c, q.data(), kv.data(), 1);
  // 16384 keys over 264 * 4 / 8 = 132 items per head: 124-key chunks, raised to the 256 minimum.
  EXPECT_EQ(plan.chunk_len, 256);
  EXPECT_EQ(plan.items.size(), 64u);
  EXPECT_GE(plan.items.size() * c.num_kv_heads, static_cast<size_t>(c.cta_slots));
  ExpectPlanCovers(c, plan, q, kv);
}

TEST(PlanTest, ShortQueryOnLongContextIsSplit) {
  // The 1117-new-on-71488-cached chunk, 20/4 heads, 64 packed rows per CTA: 88 tiles x 4 heads =
  // 352 CTAs < 2 waves, so the keys are split and every chunk is merged.
  PlanConfig c;
  c.group = 5;
  c.num_kv_heads = 4;
  c.num_qo_heads = 20;
  c.block_m = 64;
  c.cta_slots = 264;
  std::vector<int32_t> q{1117}, kv{71488 + 1117};
  const AttentionPlan plan = PlanAttention(c, q.data(), kv.data(), 1);
  EXPECT_GT(plan.chunk_len, 0);
  EXPECT_EQ(plan.merges.size(), 1117u);
  ExpectPlanCovers(c, plan, q, kv);
}

TEST(PlanTest, LongCausalPrefillIsNotSplitAndRunsLongestFirst) {
  PlanConfig c;
  c.group = 4;
  c.num_kv_heads = 8;
  c.num_qo_heads = 32;
  c.block_m = 128;
  std::vector<int32_t> q{8192}, kv{8192};
  const AttentionPlan plan = PlanAttention(c, q.data(), kv.data(), 1);
  EXPECT_EQ(plan.chunk_len, 0);
  ASSERT_EQ(plan.items.size(), 256u);
  EXPECT_EQ(plan.items.front().kv_end, 8192);  // the last tile sees every key
  EXPECT_EQ(plan.items.back().kv_end, 32);     // the first tile: tokens 0..31
  ExpectPlanCovers(c, plan, q, kv);
}

// Equal causal sequences: each one's items together (its keys stay in L2 for all its query
// tiles), longest first within it; the sequences keep their order.
TEST(PlanTest, CausalPrefillItemsRunSequenceBySequence) {
  PlanConfig c;
  c.group = 4;
  c.num_kv_heads = 10;
  c.num_qo_heads = 40;
  c.block_m = 128;
  c.causal = true;
  std::vector<int32_t> q(8, 512), kv(8, 1536);
  const AttentionPlan plan = PlanAttention(c, q.data(), kv.data(), 8);
  ASSERT_EQ(plan.items.size(), 8u * 16u);  // 512 x 4 packed rows = 16 tiles per sequence
  for (size_t i = 0; i < plan.items.size(); ++i) {
    EXPECT_EQ(plan.items[i].seq, static_cast<int>(i / 16)) << i;
    if (i % 16 != 0) {
      EXPECT_LE(plan.items[i].kv_end - plan.items[i].kv_begin,
                plan.items[i - 1].kv_end - plan.items[i - 1].kv_begin);
    }
  }
  // A longer sequence goes first.
  kv[5] = 2048;
  const AttentionPlan ragged = PlanAttention(c, q.data(), kv.data(), 8);
  EXPECT_EQ(ragged.items.front().seq, 5);
  ExpectPlanCovers(c, ragged, q, kv);
}

TEST(PlanTest, WorkspaceCapWidensChunks) {
  PlanConfig c = DecodeConfig(4, 8);
  c.max_partial_rows = 16 * 32 * 2;  // 16 tokens x 32 heads x two chunks
  std::vector<int32_t> q(16, 1), kv(16, 8192);
  const AttentionPlan plan = PlanAttention(c, q.data(), kv.data(), 16);
  EXPECT_GE(plan.chunk_len, 4096);
  ExpectPlanCovers(c, plan, q, kv);
}

TEST(PlanTest, ClusterSplitsCutEveryTileIntoOneGroup) {
  // The transposed MLA decode merging in clusters of up to 8 CTAs: 64 x 4096 splits into
  // 2048-key chunks (64 CTAs < 1 wave), so every sequence becomes two adjacent items that write
  // the final rows together.
  PlanConfig c = NarrowMlaDecodeConfig();
  c.cluster_splits = 8;
  // Three short sequences beside them: 64 + 36 keys; one partial tile, so that the second chunk
  // is empty; no key at all.
  std::vector<int32_t> q(67, 1), kv(64, 4096);
  kv.insert(kv.end(), {100, 40, 0});
  const AttentionPlan plan = PlanAttention(c, q.data(), kv.data(), 67);
  EXPECT_EQ(plan.cluster_splits, 2);
  EXPECT_EQ(plan.items.size(), 134u);
  EXPECT_TRUE(plan.merges.empty());
  EXPECT_EQ(plan.partial_rows, 0);
  EXPECT_EQ(plan.chunk_len, 2048);
  ExpectPlanCovers(c, plan, q, kv);
  // (seq, kv_begin, kv_end) of each group's two chunks.
  const auto chunks = [&](size_t i) {
    const WorkItem& a = plan.items[i];
    const WorkItem& b = plan.items[i + 1];
    return std::vector<int>{a.kv_begin, a.kv_end, b.kv_begin, b.kv_end};
  };
  for (size_t i = 0; i < plan.items.size(); i += 2) {
    switch (plan.items[i].seq) {
      case 64:
        EXPECT_EQ(chunks(i), (std::vector<int>{0, 64, 64, 100}));
        break;
      case 65:
        EXPECT_EQ(chunks(i), (std::vector<int>{0, 40, 40, 40}));
        break;
      case 66:
        EXPECT_EQ(chunks(i), (std::vector<int>{0, 0, 0, 0}));
        break;
      default:
        EXPECT_EQ(chunks(i), (std::vector<int>{0, 2048, 2048, 4096}));
    }
  }

  // 16 x 4096: 512-key chunks, so clusters of 8.
  std::vector<int32_t> q16(16, 1), kv16(16, 4096);
  const AttentionPlan eights = PlanAttention(c, q16.data(), kv16.data(), 16);
  EXPECT_EQ(eights.cluster_splits, 8);
  EXPECT_EQ(eights.items.size(), 128u);
  ExpectPlanCovers(c, eights, q16, kv16);

  // One sequence of 16384 keys takes 32 chunks, more than a cluster: the merge pass does it.
  std::vector<int32_t> q1{1}, kv1{16384};
  const AttentionPlan merged = PlanAttention(c, q1.data(), kv1.data(), 1);
  EXPECT_EQ(merged.cluster_splits, 0);
  EXPECT_EQ(merged.merges.size(), 1u);
  EXPECT_EQ(merged.max_splits, 32);
  ExpectPlanCovers(c, merged, q1, kv1);

  // A batch that fills the GPU unsplit stays one item per tile, with no clusters.
  std::vector<int32_t> q_big(200, 1), kv_big(200, 4096);
  const AttentionPlan whole = PlanAttention(c, q_big.data(), kv_big.data(), 200);
  EXPECT_EQ(whole.cluster_splits, 0);
  EXPECT_EQ(whole.items.size(), 200u);
  ExpectPlanCovers(c, whole, q_big, kv_big);
}

TEST(PlanTest, RaggedBatchesWithEmptyAndUnseeingRows) {
  std::mt19937 rng(7);
  for (int trial = 0; trial < 200; ++trial) {
    PlanConfig c;
    c.group = 1 + rng() % 8;
    c.num_kv_heads = 1 + rng() % 4;
    c.num_qo_heads = c.group * c.num_kv_heads;
    c.block_m = 16 << (rng() % 3);
    c.block_n = 32;
    c.min_chunk_len = 32;
    c.cta_slots = 8 + rng() % 64;
    c.causal = rng() % 4 != 0;
    c.cluster_splits = trial % 3 == 0 ? 2 << (rng() % 3) : 0;
    const int batch = 1 + rng() % 6;
    std::vector<int32_t> q(batch), kv(batch);
    for (int b = 0; b < batch; ++b) {
      q[b] = rng() % 40;
      kv[b] = rng() % 3 == 0 ? static_cast<int>(rng() % 8) : static_cast<int>(rng() % 700);
    }
    const AttentionPlan plan = PlanAttention(c, q.data(), kv.data(), batch);
    SCOPED_TRACE(testing::Message() << "trial " << trial);
    ExpectPlanCovers(c, plan, q, kv);
  }
}

}  // namespace
}  // namespace attn
