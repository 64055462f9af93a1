#include "server/page_pool.h"

#include <algorithm>
#include <random>
#include <set>
#include <thread>

#include "gtest/gtest.h"

namespace attn {
namespace {

void ExpectInvariant(const PagePool& pool) {
  EXPECT_EQ(pool.free_pages() + pool.used_pages(), pool.total_pages());
}

TEST(PagePoolTest, AllocatesDistinctIdsInRange) {
  PagePool pool(10);
  auto a = pool.Allocate(4);
  auto b = pool.Allocate(6);
  ASSERT_TRUE(a.ok() && b.ok());
  std::set<int32_t> ids(a->begin(), a->end());
  ids.insert(b->begin(), b->end());
  EXPECT_EQ(ids.size(), 10u);
  EXPECT_EQ(*ids.begin(), 0);
  EXPECT_EQ(*ids.rbegin(), 9);
  EXPECT_EQ(pool.free_pages(), 0);
  ExpectInvariant(pool);
}

TEST(PagePoolTest, ExhaustionIsAllOrNothing) {
  PagePool pool(8);
  ASSERT_TRUE(pool.Allocate(5).ok());
  auto too_many = pool.Allocate(4);
  EXPECT_EQ(too_many.status().code(), absl::StatusCode::kResourceExhausted);
  EXPECT_EQ(pool.free_pages(), 3);
  EXPECT_TRUE(pool.Allocate(3).ok());
  EXPECT_EQ(pool.Allocate(1).status().code(), absl::StatusCode::kResourceExhausted);
  ExpectInvariant(pool);
}

TEST(PagePoolTest, RejectsBadCounts) {
  PagePool pool(8);
  EXPECT_EQ(pool.Allocate(0).status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(pool.Allocate(-3).status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(pool.Allocate(9).status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(pool.free_pages(), 8);
}

TEST(PagePoolTest, FreeReturnsPagesForReuse) {
  PagePool pool(4);
  auto ids = pool.Allocate(4);
  ASSERT_TRUE(ids.ok());
  ASSERT_TRUE(pool.Free({(*ids)[1], (*ids)[3]}).ok());
  EXPECT_EQ(pool.free_pages(), 2);
  auto again = pool.Allocate(2);
  ASSERT_TRUE(again.ok());
  EXPECT_EQ(std::set<int32_t>(again->begin(), again->end()),
            (std::set<int32_t>{(*ids)[1], (*ids)[3]}));
  ExpectInvariant(pool);
}

TEST(PagePoolTest, DoubleFreeChangesNothing) {
  PagePool pool(4);
  auto ids = pool.Allocate(2);
  ASSERT_TRUE(ids.ok());
  ASSERT_TRUE(pool.Free({(*ids)[0]}).ok());
  // The second free of (*ids)[0] fails, and (*ids)[1], listed with it, stays allocated.
  EXPECT_EQ(pool.Free({(*ids)[1], (*ids)[0]}).code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(pool.free_pages(), 3);
  EXPECT_TRUE(pool.CheckAllocated({(*ids)[1]}, "ids").ok());
}

TEST(PagePoolTest, FreeRejectsDuplicatesAndOutOfRange) {
  PagePool pool(4);
  auto ids = pool.Allocate(3);
  ASSERT_TRUE(ids.ok());
  EXPECT_EQ(pool.Free({(*ids)[0], (*ids)[0]}).code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(pool.Free({(*ids)[0], 4}).code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(pool.Free({-1}).code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(pool.free_pages(), 1);
  EXPECT_TRUE(pool.Free({}).ok());
  ExpectInvariant(pool);
}

TEST(PagePoolTest, CheckAllocatedNamesTheField) {
  PagePool pool(4);
  auto ids = pool.Allocate(1);
  ASSERT_TRUE(ids.ok());
  const absl::Status st = pool.CheckAllocated({(*ids)[0], 3}, "kv_indices");
  EXPECT_EQ(st.code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_NE(st.message().find("kv_indices[1] = 3"), std::string::npos) << st;
}

TEST(PagePoolTest, ConcurrentAllocateFreeKeepsInvariant) {
  PagePool pool(256);
  std::vector<std::thread> threads;
  for (int t = 0; t < 8; ++t) {
    threads.emplace_back([&pool, t] {
      std::mt19937 rng(t);
      std::vector<int32_t> mine;
      for (int i = 0; i < 2000; ++i) {
        if (rng() % 2 == 0) {
          auto ids = pool.Allocate(1 + rng() % 8);
          if (ids.ok()) mine.insert(mine.end(), ids->begin(), ids->end());
        } else if (!mine.empty()) {
          const size_t n = 1 + rng() % mine.size();
          ASSERT_TRUE(pool.Free(absl::MakeConstSpan(mine).last(n)).ok());
          mine.resize(mine.size() - n);
        }
      }
      ASSERT_TRUE(pool.Free(mine).ok());
    });
  }
  for (auto& t : threads) t.join();
  EXPECT_EQ(pool.free_pages(), 256);
  ExpectInvariant(pool);
}

}  // namespace
}  // namespace attn
