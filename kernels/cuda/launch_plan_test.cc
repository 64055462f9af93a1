// The launch binding's host side: layout, staged indices and bound pointers. Needs no GPU (it
// binds host buffers standing in for device ones and launches nothing).
#include "kernels/cuda/launch_plan.h"

#include <algorithm>
#include <cstring>
#include <vector>

#include "gtest/gtest.h"

namespace attn::cuda {
namespace {

KernelTiling Tiling(int block_m, int num_sms) {
  KernelTiling t;
  t.variant = 3;
  t.block_m = block_m;
  t.block_n = 64;
  t.ctas_per_sm = 1;
  t.num_sms = num_sms;
  t.min_chunk_len = 256;
  return t;
}

// Sections in buffer order; each must start at an aligned offset after the previous one's end.
void ExpectPacked(const std::vector<StagingSection>& sections, size_t total) {
  size_t end = 0;
  for (const StagingSection& s : sections) {
    EXPECT_EQ(s.offset % kStagingAlign, 0u);
    EXPECT_GE(s.offset, end);
    end = s.offset + s.bytes;
  }
  EXPECT_GE(total, end);
  EXPECT_EQ(total % kStagingAlign, 0u);
}

template <typename T>
std::vector<T> Read(const std::vector<char>& buffer, const StagingSection& s) {
  std::vector<T> v(s.bytes / sizeof(T));
  if (!v.empty()) std::memcpy(v.data(), buffer.data() + s.offset, s.bytes);
  return v;
}

// A decode batch (one query a sequence) over the page table given.
PagedBatch DecodeView(const std::vector<int32_t>& kv_indptr,
                      const std::vector<int32_t>& kv_indices, const std::vector<int32_t>& last) {
  PagedBatch b;
  b.batch_size = static_cast<int>(last.size());
  b.total_q = b.batch_size;
  b.kv_indptr = kv_indptr.data();
  b.kv_indices = kv_indices.data();
  b.kv_last_page_len = last.data();
  return b;
}

// Four decodes of 1024 keys each on pages of 64 (16 pages a sequence, in order).
struct FourDecodes {
  std::vector<int32_t> kv_indptr{0, 16, 32, 48, 64}, kv_indices, last{64, 64, 64, 64};
  FourDecodes() {
    for (int i = 0; i < 64; ++i) kv_indices.push_back(i);
  }
  PagedBatch View() const { return DecodeView(kv_indptr, kv_indices, last); }
};

// Two prefill sequences (3 tokens on 20 keys, 5 on 5), page size 4, 8/2 heads of 64.
struct GqaBatch {
  std::vector<int32_t> qo_indptr{0, 3, 8};
  std::vector<int32_t> kv_indptr{0, 5, 7};
  std::vector<int32_t> kv_indices{9, 2, 7, 4, 0, 3, 8};
  std::vector<int32_t> last{4, 1, 0};  // a trailing extra entry, which is not staged
  GqaCache cache{nullptr, 1, 10, 4, 2, 64};

  PagedBatch View() const {
    PagedBatch b;
    b.batch_size = 2;
    b.total_q = 8;
    b.qo_indptr = qo_indptr.data();
    b.kv_indptr = kv_indptr.data();
    b.kv_indices = kv_indices.data();
    b.kv_last_page_len = last.data();
    return b;
  }
};

// The options GqaBatch is planned with: appending, no lse.
LaunchOptions GqaOptions() {
  LaunchOptions o;
  o.append = true;
  o.lse = false;
  o.sm_scale = 0.125f;
  o.tiling = Tiling(64, 132);
  o.max_partial_rows = 1 << 20;
  return o;
}

// A prefill whose every sequence fits one CTA of the short-prefill tiling runs on it; one longer
// sequence keeps the whole launch on the prefill kernel.
TEST(LaunchPlanTest, ShortPrefillsRunOnTheShortTiling) {
  GqaBatch t;  // 3 x 4 = 12 and 5 x 4 = 20 packed rows
  LaunchOptions o = GqaOptions();
  for (const auto& [block_m, chosen] : {std::pair{16, false}, {20, true}, {32, true}}) {
    SCOPED_TRACE(block_m);
    o.short_prefill = Tiling(block_m, 132);
    o.short_prefill.variant = kGqaPrefillOnDecodeKernel;
    LaunchPlan plan;
    plan.PlanGqa(t.cache, 8, t.View(), o);
    EXPECT_EQ(plan.device_plan().variant, chosen ? kGqaPrefillOnDecodeKernel : 3);
  }
  // Decode launches never take it: their kernel is already the decode kernel.
  LaunchPlan decode;
  PagedBatch view = t.View();
  view.qo_indptr = nullptr;
  view.total_q = 2;
  decode.PlanGqa(t.cache, 8, view, o);
  EXPECT_EQ(decode.device_plan().variant, 3);
}

TEST(LaunchPlanTest, GqaPrefillLayoutAndBinding) {
  GqaBatch t;
  const LaunchOptions o = GqaOptions();
  LaunchPlan plan;
  plan.PlanGqa(t.cache, 8, t.View(), o);

  const RowWidths& w = plan.widths();
  EXPECT_EQ(w.q, 8 * 64);
  EXPECT_EQ(w.k_new, 2 * 64);
  EXPECT_EQ(w.v_new, 2 * 64);
  EXPECT_EQ(w.q_pe, 0);
  const InputLayout& in = plan.inputs();
  EXPECT_EQ(in.q.bytes, 8u * 8 * 64 * 2);
  EXPECT_EQ(in.q_pe.bytes, 0u);
  EXPECT_EQ(in.k_new.bytes, 8u * 2 * 64 * 2);
  EXPECT_EQ(in.qo_indptr.bytes, 3u * 4);
  EXPECT_EQ(in.kv_indices.bytes, 7u * 4);
  EXPECT_EQ(in.kv_last_page_len.bytes, 2u * 4);
  EXPECT_EQ(in.seq_layer.bytes, 0u);
  EXPECT_EQ(in.items.bytes, plan.plan().items.size() * sizeof(DeviceWorkItem));
  EXPECT_EQ(in.schedule.bytes, 2u * 4);
  ExpectPacked({in.q, in.q_pe, in.k_new, in.v_new, in.qo_indptr, in.kv_indptr, in.kv_indices,
                in.kv_last_page_len, in.seq_layer, in.items, in.schedule, in.merges},
               in.bytes);
  EXPECT_EQ(plan.outputs().out.bytes, 8u * 8 * 64 * 2);
  EXPECT_EQ(plan.outputs().lse.bytes, 0u);

  std::vector<char> host(in.bytes, 1);
  plan.WriteIndices(host.data());
  EXPECT_EQ(Read<uint32_t>(host, in.schedule), (std::vector<uint32_t>{0, 0}));
  EXPECT_EQ(Read<int32_t>(host, in.qo_indptr), t.qo_indptr);
  EXPECT_EQ(Read<int32_t>(host, in.kv_indptr), t.kv_indptr);
  EXPECT_EQ(Read<int32_t>(host, in.kv_indices), t.kv_indices);
  EXPECT_EQ(Read<int32_t>(host, in.kv_last_page_len), (std::vector<int32_t>{4, 1}));
  // Each item with its sequence's extent, as the kernels read them.
  const std::vector<DeviceWorkItem> items = Read<DeviceWorkItem>(host, in.items);
  ASSERT_EQ(items.size(), plan.plan().items.size());
  for (size_t i = 0; i < items.size(); ++i) {
    const WorkItem& want = plan.plan().items[i];
    EXPECT_EQ(std::memcmp(&items[i].item, &want, sizeof(WorkItem)), 0) << i;
    const SeqExtent e = GetSeqExtent(t.View(), t.cache.page_size, want.seq);
    EXPECT_EQ(items[i].seq.q_begin, e.q_begin) << i;
    EXPECT_EQ(items[i].seq.q_len, e.q_len) << i;
    EXPECT_EQ(items[i].seq.page_begin, e.page_begin) << i;
    EXPECT_EQ(items[i].seq.num_pages, e.num_pages) << i;
    EXPECT_EQ(items[i].seq.kv_len, e.kv_len) << i;
    EXPECT_EQ(items[i].seq.layer, 0) << i;
  }

  // Host buffers stand in for the device ones: Bind only computes pointers.
  std::vector<char> device_in(in.bytes), device_out(plan.outputs().bytes);
  ASSERT_EQ(plan.Bind(device_in.data(), device_out.data(), nullptr, 0), cudaSuccess);
  const GqaParams& p = plan.gqa_params();
  const char* d = device_in.data();
  EXPECT_EQ(reinterpret_cast<const char*>(p.q), d + in.q.offset);
  EXPECT_EQ(reinterpret_cast<const char*>(p.k_new), d + in.k_new.offset);
  EXPECT_EQ(reinterpret_cast<const char*>(p.v_new), d + in.v_new.offset);
  EXPECT_EQ(reinterpret_cast<const char*>(p.batch.qo_indptr), d + in.qo_indptr.offset);
  EXPECT_EQ(reinterpret_cast<const char*>(p.batch.kv_indices), d + in.kv_indices.offset);
  EXPECT_EQ(p.batch.seq_layer, nullptr);
  EXPECT_EQ(p.batch.batch_size, 2);
  EXPECT_EQ(p.batch.total_q, 8);
  EXPECT_EQ(reinterpret_cast<char*>(p.out), device_out.data() + plan.outputs().out.offset);
  EXPECT_EQ(p.lse, nullptr);
  EXPECT_EQ(p.cache.num_kv_heads, 2);
  EXPECT_EQ(p.num_qo_heads, 8);
  EXPECT_EQ(p.sm_scale, 0.125f);
  EXPECT_EQ(reinterpret_cast<const char*>(plan.device_plan().items), d + in.items.offset);
  EXPECT_EQ(plan.device_plan().num_items, static_cast<int>(items.size()));
  EXPECT_EQ(reinterpret_cast<const char*>(plan.device_plan().schedule), d + in.schedule.offset);
  EXPECT_EQ(plan.device_plan().variant, 3);
}

// With call rows the launch stages them, lays out a refused flag per call and binds both for the
// finiteness check; without, it checks nothing (num_calls 0).
TEST(LaunchPlanTest, CallChecksAreStagedAndBound) {
  GqaBatch t;
  LaunchOptions o = GqaOptions();
  LaunchPlan plan;
  plan.PlanGqa(t.cache, 8, t.View(), o);
  EXPECT_EQ(plan.inputs().call_rows.bytes, 0u);
  EXPECT_EQ(plan.outputs().refused.bytes, 0u);
  std::vector<char> device_in(plan.inputs().bytes), device_out(plan.outputs().bytes);
  ASSERT_EQ(plan.Bind(device_in.data(), device_out.data(), nullptr, 0), cudaSuccess);
  EXPECT_EQ(plan.checks().num_calls, 0);

  const std::vector<int32_t> rows{0, 3, 8};  // two calls: one sequence each
  o.call_rows = rows.data();
  o.num_calls = 2;
  plan.PlanGqa(t.cache, 8, t.View(), o);
  const InputLayout& in = plan.inputs();
  const OutputLayout& out = plan.outputs();
  EXPECT_EQ(in.call_rows.bytes, 3u * 4);
  EXPECT_EQ(out.refused.bytes, 2u * 4);
  ExpectPacked({in.items, in.merges, in.call_rows}, in.bytes);
  ExpectPacked({out.out, out.lse, out.refused}, out.bytes);
  std::vector<char> host(in.bytes, 0);
  plan.WriteIndices(host.data());
  EXPECT_EQ(Read<int32_t>(host, in.call_rows), rows);
  device_in.assign(in.bytes, 0);
  device_out.assign(out.bytes, 0);
  ASSERT_EQ(plan.Bind(device_in.data(), device_out.data(), nullptr, 0), cudaSuccess);
  const CallChecks& c = plan.checks();
  EXPECT_EQ(c.num_calls, 2);
  EXPECT_EQ(reinterpret_cast<const char*>(c.rows), device_in.data() + in.call_rows.offset);
  EXPECT_EQ(reinterpret_cast<char*>(c.refused), device_out.data() + out.refused.offset);
}

TEST(LaunchPlanTest, MlaDecodeSplitsIntoTheWorkspace) {
  // One decode sequence of 4096 keys on 4 SMs: split-KV, so the plan has merges and partials.
  std::vector<int32_t> kv_indptr{0, 64}, kv_indices(64), last{64}, layer{1};
  for (int i = 0; i < 64; ++i) kv_indices[i] = 63 - i;
  PagedBatch b = DecodeView(kv_indptr, kv_indices, last);
  b.seq_layer = layer.data();
  LaunchOptions o;
  o.lse = true;
  o.tiling = Tiling(16, 4);
  o.max_partial_rows = 1 << 20;
  LaunchPlan plan;
  plan.PlanMla(MlaCache{nullptr, 2, 64, 64}, 16, b, o);
  ASSERT_GT(plan.plan().chunk_len, 0);
  ASSERT_EQ(plan.plan().merges.size(), 1u);

  const InputLayout& in = plan.inputs();
  EXPECT_EQ(in.q.bytes, 16u * kMlaCkvDim * 2);
  EXPECT_EQ(in.q_pe.bytes, 16u * kMlaKpeDim * 2);
  EXPECT_EQ(in.k_new.bytes, 0u);
  EXPECT_EQ(in.qo_indptr.bytes, 0u);
  EXPECT_EQ(in.seq_layer.bytes, 4u);
  EXPECT_EQ(in.merges.bytes, sizeof(MergeRow));
  EXPECT_EQ(plan.outputs().lse.bytes, 16u * 4);
  const size_t need = plan.plan().partial_rows * (kMlaCkvDim + 1) * sizeof(float);
  EXPECT_EQ(plan.WorkspaceBytes(), need);

  std::vector<char> host(in.bytes, 0);
  plan.WriteIndices(host.data());
  EXPECT_EQ(Read<int32_t>(host, in.seq_layer), layer);
  const std::vector<MergeRow> merges = Read<MergeRow>(host, in.merges);
  EXPECT_EQ(merges[0].num_splits, plan.plan().merges[0].num_splits);

  std::vector<char> device_in(in.bytes), device_out(plan.outputs().bytes);
  std::vector<float> workspace(need / sizeof(float));
  EXPECT_EQ(plan.Bind(device_in.data(), device_out.data(), workspace.data(), need - 4),
            cudaErrorInvalidValue);
  ASSERT_EQ(plan.Bind(device_in.data(), device_out.data(), workspace.data(), need), cudaSuccess);
  const MlaParams& p = plan.mla_params();
  EXPECT_EQ(p.batch.qo_indptr, nullptr);
  EXPECT_EQ(reinterpret_cast<const char*>(p.batch.seq_layer),
            device_in.data() + in.seq_layer.offset);
  EXPECT_EQ(reinterpret_cast<const char*>(p.q_pe), device_in.data() + in.q_pe.offset);
  EXPECT_EQ(p.ckv_new, nullptr);
  EXPECT_EQ(reinterpret_cast<char*>(p.lse), device_out.data() + plan.outputs().lse.offset);
  const DevicePlan& dp = plan.device_plan();
  EXPECT_EQ(dp.partial_out, workspace.data());
  EXPECT_EQ(dp.partial_lse, workspace.data() + plan.plan().partial_rows * kMlaCkvDim);
  EXPECT_EQ(dp.num_merges, 1);
  EXPECT_EQ(dp.max_splits, plan.plan().max_splits);
  EXPECT_EQ(dp.cta_slots, 4);  // one CTA an SM on 4 SMs: a persistent kernel's grid
}

// The benchmarks' override of when to split: a decode that fills its CTA slots stays whole by the
// kernel's own settings, and is cut into chunks of min_chunk_len keys once waves_before_split
// exceeds its waves.
TEST(LaunchPlanTest, WavesBeforeSplitOverridesTheSplitDecision) {
  const FourDecodes t;
  const PagedBatch b = t.View();
  LaunchOptions o;
  o.tiling = Tiling(16, 2);  // 4 sequences, 2 CTA slots: two waves, not split
  o.max_partial_rows = 1 << 20;
  const MlaCache cache{nullptr, 1, 64, 64};
  LaunchPlan whole;
  whole.PlanMla(cache, 16, b, o);
  EXPECT_EQ(whole.plan().chunk_len, 0);
  EXPECT_TRUE(whole.plan().merges.empty());

  o.waves_before_split = 1000;
  o.target_waves = 1000;
  o.min_chunk_len = 256;
  LaunchPlan split;
  split.PlanMla(cache, 16, b, o);
  EXPECT_EQ(split.plan().chunk_len, 256);
  EXPECT_EQ(split.plan().merges.size(), 4u);       // one per query token
  EXPECT_EQ(split.plan().max_splits, 1024 / 256);  // 16 pages of 64 keys a sequence
}

// The benchmarks' override of the fill test: 4 sequences on 5 CTA slots split by the kernel's
// own settings (fewer than two waves, no fill test), and stay whole once 80% of one wave is enough.
TEST(LaunchPlanTest, NoSplitFillOverridesTheKernels) {
  const FourDecodes t;
  const PagedBatch b = t.View();
  LaunchOptions o;
  o.tiling = Tiling(16, 5);
  o.max_partial_rows = 1 << 20;
  const MlaCache cache{nullptr, 1, 64, 64};
  // The chunk length of o's plan (0: whole, and then no merges).
  auto chunk_len = [&] {
    LaunchPlan plan;
    plan.PlanMla(cache, 16, b, o);
    EXPECT_EQ(plan.plan().chunk_len == 0, plan.plan().merges.empty());
    return plan.plan().chunk_len;
  };
  EXPECT_GT(chunk_len(), 0);
  o.no_split_fill = 0.75;
  EXPECT_EQ(chunk_len(), 0);
  o.no_split_fill = 0.85;  // above the 80% the four CTAs keep busy
  EXPECT_GT(chunk_len(), 0);

  // It stands for the kernel's one-wave test too: whole by the kernel's 75%, split at 85%.
  o.tiling.no_split_fill_one_wave = 0.75;
  o.no_split_fill = 0;
  EXPECT_EQ(chunk_len(), 0);
  o.no_split_fill = 0.85;
  EXPECT_GT(chunk_len(), 0);
}

// A kernel's cost model (KernelTiling::cta_start_keys) plans where no split test is overridden;
// an override of any of them plans by the tests alone. 4 sequences of 1024 keys on 4 slots: one
// wave whole, which the model keeps (a split adds CTA starts and a merge and ends no sooner).
TEST(LaunchPlanTest, SplitOverridesTurnOffTheCostModel) {
  const FourDecodes t;
  const PagedBatch b = t.View();
  LaunchOptions o;
  o.tiling = Tiling(16, 4);
  o.tiling.waves_before_split = 2.0;  // the tests alone split a launch of one wave
  o.tiling.cta_start_keys = 100;
  o.tiling.merge_keys = 400;
  o.tiling.merge_keys_per_row = 0.1;
  o.max_partial_rows = 1 << 20;
  const MlaCache cache{nullptr, 1, 64, 64};
  auto chunk_len = [&] {
    LaunchPlan plan;
    plan.PlanMla(cache, 16, b, o);
    return plan.plan().chunk_len;
  };
  EXPECT_EQ(chunk_len(), 0);
  o.target_waves = 4;
  EXPECT_GT(chunk_len(), 0);
  o.target_waves = 0;
  o.no_split_fill = 0.5;  // the four CTAs keep all four slots busy
  EXPECT_EQ(chunk_len(), 0);
  o.no_split_fill = 0;
  o.waves_before_split = 2.0;
  EXPECT_GT(chunk_len(), 0);
}

// A launch over the table of the last one (LaunchOptions::table_id) keeps its plan, and its
// per-launch-only indices are seq_layer alone; another id, a new tiling, or no id plans again.
TEST(LaunchPlanTest, ATablesIdKeepsItsPlan) {
  GqaBatch t;
  std::vector<int32_t> layer0{0, 0}, layer1{1, 1};
  PagedBatch view = t.View();
  view.seq_layer = layer0.data();
  LaunchOptions o = GqaOptions();
  o.table_id = 7;
  LaunchPlan plan;
  plan.PlanGqa(t.cache, 8, view, o);
  EXPECT_FALSE(plan.plan_reused());
  const std::vector<WorkItem> first(plan.plan().items);
  const InputLayout layout = plan.inputs();

  view.seq_layer = layer1.data();
  plan.PlanGqa(t.cache, 8, view, o);
  EXPECT_TRUE(plan.plan_reused());
  EXPECT_EQ(plan.plan().items.size(), first.size());
  EXPECT_TRUE(plan.inputs() == layout);
  std::vector<char> host(layout.bytes, 0x5a);
  plan.WriteIndices(host.data(), /*per_launch_only=*/true);
  EXPECT_EQ(Read<int32_t>(host, layout.seq_layer), layer1);
  // Nothing else was written.
  std::vector<char> untouched(layout.bytes, 0x5a);
  std::memcpy(untouched.data() + layout.seq_layer.offset, layer1.data(), layout.seq_layer.bytes);
  EXPECT_TRUE(host == untouched);

  o.tiling = Tiling(64, 66);  // half the SMs: another plan
  plan.PlanGqa(t.cache, 8, view, o);
  EXPECT_FALSE(plan.plan_reused());
  plan.PlanGqa(t.cache, 8, view, o);
  EXPECT_TRUE(plan.plan_reused());
  o.table_id = 8;
  plan.PlanGqa(t.cache, 8, view, o);
  EXPECT_FALSE(plan.plan_reused());
  o.table_id = 0;  // no id: never kept
  plan.PlanGqa(t.cache, 8, view, o);
  EXPECT_FALSE(plan.plan_reused());
  plan.PlanGqa(t.cache, 8, view, o);
  EXPECT_FALSE(plan.plan_reused());
}

// Prefill sequences of the given query rows, each on `cached` more keys, page size 16, pages
// numbered in order; 8 query heads of 64 on 2 KV heads unless the test says otherwise.
struct LongPrefill {
  std::vector<int32_t> qo_indptr{0}, kv_indptr{0}, kv_indices, last;
  GqaCache cache{nullptr, 1, 1 << 16, 16, 2, 64};

  LongPrefill(const std::vector<int32_t>& q_lens, int cached) {
    for (int32_t q : q_lens) {
      const int32_t kv = q + cached, pages = (kv + 15) / 16;
      qo_indptr.push_back(qo_indptr.back() + q);
      for (int32_t i = 0; i < pages; ++i) kv_indices.push_back(kv_indptr.back() + i);
      kv_indptr.push_back(kv_indptr.back() + pages);
      last.push_back(kv - (pages - 1) * 16);
    }
  }
  PagedBatch View() const {
    PagedBatch b;
    b.batch_size = static_cast<int>(last.size());
    b.total_q = qo_indptr.back();
    b.qo_indptr = qo_indptr.data();
    b.kv_indptr = kv_indptr.data();
    b.kv_indices = kv_indices.data();
    b.kv_last_page_len = last.data();
    return b;
  }
};

// Chunks tile the rows in order; every item lies inside its chunk's rows; the items are the
// unchunked plan's, in its order within each chunk.
void ExpectChunked(const LaunchPlan& chunked, const LaunchPlan& whole, const PagedBatch& batch,
                   int group, int block_m) {
  const std::vector<OutputChunk>& chunks = chunked.output_chunks();
  ASSERT_GE(chunks.size(), 2u);
  ASSERT_LE(chunks.size(), static_cast<size_t>(kMaxOutputChunks));
  EXPECT_EQ(chunks.front().row_begin, 0);
  EXPECT_EQ(chunks.back().row_end, batch.total_q);
  EXPECT_EQ(chunks.front().item_begin, 0);
  EXPECT_EQ(chunks.back().item_end, static_cast<int>(chunked.plan().items.size()));
  const std::vector<WorkItem>& items = chunked.plan().items;
  std::vector<const WorkItem*> in_order;
  for (size_t c = 0; c < chunks.size(); ++c) {
    SCOPED_TRACE(c);
    const OutputChunk& k = chunks[c];
    EXPECT_LT(k.row_begin, k.row_end);
    EXPECT_LT(k.item_begin, k.item_end);
    if (c > 0) {
      EXPECT_EQ(k.row_begin, chunks[c - 1].row_end);
      EXPECT_EQ(k.item_begin, chunks[c - 1].item_end);
    }
    for (int i = k.item_begin; i < k.item_end; ++i) {
      const WorkItem& w = items[i];
      const int q_begin = batch.qo_indptr[w.seq];
      const int rows = (batch.qo_indptr[w.seq + 1] - q_begin) * group;
      const int first = q_begin + w.row_begin / group;
      const int last = q_begin + (std::min(w.row_begin + block_m, rows) - 1) / group;
      EXPECT_GE(first, k.row_begin);
      EXPECT_LT(last, k.row_end);
    }
  }
  // The same items: each chunk's are the whole plan's that fall in it, in the same order.
  std::vector<WorkItem> regrouped;
  for (const OutputChunk& k : chunks) {
    for (const WorkItem& w : whole.plan().items) {
      const int row = batch.qo_indptr[w.seq] + w.row_begin / group;
      if (row >= k.row_begin && row < k.row_end) regrouped.push_back(w);
    }
  }
  ASSERT_EQ(regrouped.size(), items.size());
  for (size_t i = 0; i < items.size(); ++i) {
    EXPECT_EQ(std::memcmp(&regrouped[i], &items[i], sizeof(WorkItem)), 0) << i;
  }
}

TEST(LaunchPlanTest, PrefillOutputsAreCutIntoChunksOfWholeItems) {
  const LongPrefill t({300, 37, 700, 1}, 200);
  const PagedBatch batch = t.View();  // 1038 rows of 8 x 64 bf16: 1 KiB each
  LaunchOptions o = GqaOptions();
  o.tiling = Tiling(64, 8);  // few SMs: nothing is split
  LaunchPlan whole;
  whole.PlanGqa(t.cache, 8, batch, o);
  ASSERT_TRUE(whole.plan().merges.empty());
  EXPECT_TRUE(whole.output_chunks().empty());
  for (const int want : {2, 3, 4, 8, 100}) {
    SCOPED_TRACE(want);
    o.output_chunk_bytes = size_t{1038} * 1024 / want;
    LaunchPlan chunked;
    chunked.PlanGqa(t.cache, 8, batch, o);
    ExpectChunked(chunked, whole, batch, /*group=*/4, /*block_m=*/64);
    EXPECT_LE(chunked.output_chunks().size(), static_cast<size_t>(std::min(want, 8)));
    // Boundaries inside a sequence fall on item boundaries: 64 rows of group 4, 16 tokens.
    for (const OutputChunk& k : chunked.output_chunks()) {
      const auto seq_start =
          std::upper_bound(t.qo_indptr.begin(), t.qo_indptr.end(), k.row_begin) - 1;
      EXPECT_EQ((k.row_begin - *seq_start) % 16, 0) << k.row_begin;
    }
  }
  // Less than two chunks' worth: one launch.
  o.output_chunk_bytes = size_t{1038} * 1024 / 2 + 1;
  LaunchPlan one;
  one.PlanGqa(t.cache, 8, batch, o);
  EXPECT_TRUE(one.output_chunks().empty());
  EXPECT_EQ(one.EnqueueAttentionChunk(nullptr, 0), cudaErrorInvalidValue);
}

// Group 5 (10 heads on 2): a token's heads may straddle two 64-row items, so boundaries inside a
// sequence are multiples of 64 tokens.
TEST(LaunchPlanTest, ChunkBoundariesKeepAGroupsHeadsTogether) {
  const LongPrefill t({1000}, 0);
  LaunchOptions o = GqaOptions();
  o.tiling = Tiling(64, 4);
  o.output_chunk_bytes = size_t{1000} * 10 * 64 * 2 / 5;
  LaunchPlan whole, chunked;
  const PagedBatch batch = t.View();
  chunked.PlanGqa(t.cache, 10, batch, o);
  o.output_chunk_bytes = 0;
  whole.PlanGqa(t.cache, 10, batch, o);
  ExpectChunked(chunked, whole, batch, /*group=*/5, /*block_m=*/64);
  for (const OutputChunk& k : chunked.output_chunks()) EXPECT_EQ(k.row_begin % 64, 0);
}

// A launch that splits keys (merges) or decodes is never chunked; a kept plan keeps its chunks.
TEST(LaunchPlanTest, SplitAndDecodeLaunchesAreNotChunked) {
  const LongPrefill t({600, 600}, 4000);
  LaunchOptions o = GqaOptions();
  o.tiling = Tiling(64, 132);  // 76 CTAs on 132 SMs: split
  o.output_chunk_bytes = 4096;
  LaunchPlan split;
  split.PlanGqa(t.cache, 8, t.View(), o);
  ASSERT_FALSE(split.plan().merges.empty());
  EXPECT_TRUE(split.output_chunks().empty());

  PagedBatch decode = t.View();
  decode.qo_indptr = nullptr;
  decode.total_q = 2;
  LaunchPlan d;
  d.PlanGqa(t.cache, 8, decode, o);
  EXPECT_TRUE(d.output_chunks().empty());

  o.tiling = Tiling(64, 4);
  o.table_id = 5;
  LaunchPlan kept;
  kept.PlanGqa(t.cache, 8, t.View(), o);
  const std::vector<OutputChunk> chunks = kept.output_chunks();
  ASSERT_GE(chunks.size(), 2u);
  kept.PlanGqa(t.cache, 8, t.View(), o);
  EXPECT_TRUE(kept.plan_reused());
  EXPECT_EQ(kept.output_chunks(), chunks);
  o.output_chunk_bytes = 0;  // another setting: planned again
  kept.PlanGqa(t.cache, 8, t.View(), o);
  EXPECT_FALSE(kept.plan_reused());
  EXPECT_TRUE(kept.output_chunks().empty());
}

}  // namespace
}  // namespace attn::cuda
