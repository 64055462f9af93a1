#include "server/backends/merged_batch.h"

#include <atomic>
#include <random>
#include <string>
#include <vector>

#include "gtest/gtest.h"
#include "kernels/cpu/thread_pool.h"

namespace attn {
namespace {

// Random bytes split into pieces of random sizes (1 byte included), as gRPC slices split them.
struct Pieces {
  std::string bytes;
  HostBytes host;
};

Pieces RandomPieces(size_t size, size_t max_piece, std::mt19937& rng) {
  Pieces p;
  for (size_t i = 0; i < size; ++i) p.bytes.push_back(static_cast<char>(rng()));
  // Separate allocations per piece, so they are not adjacent (HostBytes would merge them).
  static std::vector<std::unique_ptr<std::string>> keep;
  for (size_t at = 0; at < size;) {
    const size_t n = std::min<size_t>(size - at, 1 + rng() % max_piece);
    keep.push_back(std::make_unique<std::string>(p.bytes.substr(at, n)));
    p.host.Append(keep.back()->data(), n);
    at += n;
  }
  return p;
}

// A decode call of `lens.size()` sequences on layer `layer`, sequence b on pages `pages[b]`.
struct TableCall {
  std::vector<int32_t> indptr, indices;
  AttentionCall call;

  TableCall(int layer, const std::vector<std::vector<int32_t>>& pages) {
    indptr.push_back(0);
    for (const auto& p : pages) {
      indices.insert(indices.end(), p.begin(), p.end());
      indptr.push_back(static_cast<int32_t>(indices.size()));
    }
    call.op = Op::kDecode;
    call.layer = layer;
    call.batch_size = call.total_q = static_cast<int>(pages.size());
    call.kv_indptr = indptr;
    call.kv_indices = indices;
    call.kv_last_page_len.assign(pages.size(), 3);
  }
};

TEST(MergedBatchTest, ConcatenatesCallsAndReadsALoneCallsPagesInPlace) {
  TableCall a(0, {{5, 6}, {7}}), b(1, {{8, 9, 10}});
  std::vector<AttentionCall*> both = {&a.call, &b.call};
  MergedBatch merged;
  merged.Build(both);
  PagedBatch v = merged.View(Op::kDecode);
  ASSERT_EQ(v.batch_size, 3);
  EXPECT_EQ(std::vector<int32_t>(v.kv_indptr, v.kv_indptr + 4), (std::vector<int32_t>{0, 2, 3, 6}));
  EXPECT_EQ(std::vector<int32_t>(v.kv_indices, v.kv_indices + 6),
            (std::vector<int32_t>{5, 6, 7, 8, 9, 10}));
  EXPECT_EQ(std::vector<int32_t>(v.seq_layer, v.seq_layer + 3), (std::vector<int32_t>{0, 0, 1}));
  EXPECT_EQ(merged.row_begin(1), 2);

  // One call: its own page ids, where they are (the view must not outlive the call).
  std::vector<AttentionCall*> one = {&b.call};
  merged.Build(one);
  v = merged.View(Op::kDecode);
  ASSERT_EQ(v.batch_size, 1);
  EXPECT_EQ(v.kv_indices, b.indices.data());
  EXPECT_EQ(std::vector<int32_t>(v.kv_indptr, v.kv_indptr + 2), (std::vector<int32_t>{0, 3}));
  EXPECT_EQ(v.seq_layer[0], 1);
  // And back to several: concatenated again.
  merged.Build(both);
  v = merged.View(Op::kDecode);
  EXPECT_EQ(std::vector<int32_t>(v.kv_indices, v.kv_indices + 6),
            (std::vector<int32_t>{5, 6, 7, 8, 9, 10}));
}

TEST(HostRunTest, CopiesAnyRangeOfItsParts) {
  std::mt19937 rng(1);
  for (int round = 0; round < 200; ++round) {
    std::vector<Pieces> parts;
    HostRun run;
    std::string expected(64, '\0');  // the run starts at offset 64
    for (int i = 0, n = 1 + static_cast<int>(rng() % 4); i < n; ++i) {
      parts.push_back(RandomPieces(rng() % 3 == 0 ? 0 : 1 + rng() % 300, 1 + rng() % 40, rng));
    }
    for (const Pieces& p : parts) {
      run.Add(expected.size(), &p.host);
      expected += p.bytes;
    }
    const size_t lo = 64 + rng() % (expected.size() - 63);
    const size_t hi = lo + rng() % (expected.size() - lo + 1);
    std::string got(expected.size(), '\0');
    run.CopyRange(got.data(), lo, hi);
    std::string want(expected.size(), '\0');
    std::copy(expected.begin() + lo, expected.begin() + hi, want.begin() + lo);
    ASSERT_EQ(got, want) << round << ": [" << lo << ", " << hi << ")";
  }
}

TEST(CopyRunTest, SplitsOnlyRangesWorthSplitting) {
  std::mt19937 rng(2);
  cpu::ThreadPool pool(3);
  int64_t pieces = 0;
  const ParallelFor parallel_for = [&](int64_t n, const std::function<void(int64_t)>& fn) {
    pieces = n;
    pool.ParallelFor(n, fn);
  };
  for (const size_t size : {size_t{1000}, kParallelCopyMinBytes + 1, 3 * kParallelCopyMinBytes,
                            10 * kParallelCopyMinBytes + 12345}) {
    const Pieces a = RandomPieces(size / 3, 1 << 16, rng);
    const Pieces b = RandomPieces(size - size / 3, 1 << 20, rng);
    HostRun run;
    run.Add(0, &a.host);
    run.Add(a.bytes.size(), &b.host);
    for (const int threads : {1, 4, 16}) {
      pieces = 1;
      std::string got(size, '\0');
      CopyRun(run, got.data(), 0, size, threads, parallel_for);
      ASSERT_EQ(got, a.bytes + b.bytes) << size << " bytes on " << threads;
      EXPECT_EQ(pieces,
                std::max<int64_t>(1, std::min<int64_t>(threads, size / kParallelCopyMinBytes)));
    }
  }
}

TEST(CopyRunTest, NoParallelForMeansTheCallingThread) {
  std::mt19937 rng(3);
  const Pieces a = RandomPieces(4 * kParallelCopyMinBytes, 1 << 20, rng);
  HostRun run;
  run.Add(0, &a.host);
  std::string got(a.bytes.size(), '\0');
  CopyRun(run, got.data(), 0, got.size(), 8, ParallelFor());
  EXPECT_EQ(got, a.bytes);
}

TEST(GatherRowsTest, PlacesEachCallsRowsLikeASerialCopy) {
  std::mt19937 rng(4);
  constexpr int64_t kRowBytes = 4096;
  std::vector<AttentionCall> calls(4);
  std::vector<AttentionCall*> pointers;
  std::vector<Pieces> inputs;
  std::vector<std::vector<int32_t>> indptr;
  inputs.reserve(calls.size());
  indptr.reserve(calls.size());
  std::string expected;
  for (size_t i = 0; i < calls.size(); ++i) {
    AttentionCall& c = calls[i];
    c.op = Op::kDecode;
    c.total_q = c.batch_size = i == 2 ? 0 : 100 + static_cast<int>(rng() % 500);  // one empty
    indptr.emplace_back(c.batch_size + 1, 0);
    c.kv_indptr = indptr.back();
    c.kv_last_page_len.assign(c.batch_size, 0);
    inputs.push_back(RandomPieces(c.total_q * kRowBytes, 1 << 18, rng));
    c.q.present = true;
    c.q.host = inputs.back().host;
    c.q.bytes = inputs.back().bytes.size();
    expected += inputs.back().bytes;
    pointers.push_back(&c);
  }
  MergedBatch merged;
  merged.Build(pointers);
  cpu::ThreadPool pool(2);
  const ParallelFor parallel_for = [&](int64_t n, const std::function<void(int64_t)>& fn) {
    pool.ParallelFor(n, fn);
  };
  for (const int threads : {1, 3}) {
    std::string got(expected.size(), '\0');
    GatherRows(pointers, merged, &AttentionCall::q, kRowBytes, got.data(), threads, parallel_for);
    ASSERT_EQ(got, expected) << threads;
  }
}

}  // namespace
}  // namespace attn
