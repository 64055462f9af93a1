#include "server/engine/page_pool.h"

#include <algorithm>
#include <map>
#include <random>
#include <set>
#include <thread>

#include "gtest/gtest.h"

namespace attn {
namespace {

constexpr SessionId kA = 1, kB = 2;

void ExpectInvariant(const PagePool& pool) {
  EXPECT_EQ(pool.free_pages() + pool.used_pages(), pool.total_pages());
}

TEST(PagePoolTest, AllocatesDistinctIdsInRange) {
  PagePool pool(10);
  auto a = pool.Allocate(4, kA);
  auto b = pool.Allocate(6, kB);
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
  ASSERT_TRUE(pool.Allocate(5, kA).ok());
  EXPECT_EQ(pool.Allocate(4, kA).status().code(), absl::StatusCode::kResourceExhausted);
  EXPECT_EQ(pool.free_pages(), 3);
  EXPECT_TRUE(pool.Allocate(3, kB).ok());
  EXPECT_EQ(pool.Allocate(1, kB).status().code(), absl::StatusCode::kResourceExhausted);
  ExpectInvariant(pool);
}

TEST(PagePoolTest, RejectsBadCounts) {
  PagePool pool(8);
  EXPECT_EQ(pool.Allocate(0, kA).status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(pool.Allocate(-3, kA).status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(pool.Allocate(9, kA).status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(pool.free_pages(), 8);
}

TEST(PagePoolTest, FreeReturnsPagesForReuse) {
  PagePool pool(4);
  auto ids = pool.Allocate(4, kA);
  ASSERT_TRUE(ids.ok());
  ASSERT_TRUE(pool.Free({(*ids)[1], (*ids)[3]}, kA).ok());
  EXPECT_EQ(pool.free_pages(), 2);
  auto again = pool.Allocate(2, kB);
  ASSERT_TRUE(again.ok());
  EXPECT_EQ(std::set<int32_t>(again->begin(), again->end()),
            (std::set<int32_t>{(*ids)[1], (*ids)[3]}));
  ExpectInvariant(pool);
}

TEST(PagePoolTest, DoubleFreeChangesNothing) {
  PagePool pool(4);
  auto ids = pool.Allocate(2, kA);
  ASSERT_TRUE(ids.ok());
  ASSERT_TRUE(pool.Free({(*ids)[0]}, kA).ok());
  // The second free of (*ids)[0] fails, and (*ids)[1], listed with it, stays allocated.
  EXPECT_EQ(pool.Free({(*ids)[1], (*ids)[0]}, kA).code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(pool.free_pages(), 3);
  EXPECT_TRUE(pool.Pin({(*ids)[1]}, kA, "ids").ok());
}

TEST(PagePoolTest, FreeRejectsDuplicatesAndOutOfRange) {
  PagePool pool(4);
  auto ids = pool.Allocate(3, kA);
  ASSERT_TRUE(ids.ok());
  EXPECT_EQ(pool.Free({(*ids)[0], (*ids)[0]}, kA).code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(pool.Free({(*ids)[0], 4}, kA).code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(pool.Free({-1}, kA).code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(pool.free_pages(), 1);
  EXPECT_TRUE(pool.Free({}, kA).ok());
  ExpectInvariant(pool);
}

TEST(PagePoolTest, PagesOfAnotherSessionCannotBeUsedOrFreed) {
  PagePool pool(4);
  auto mine = pool.Allocate(2, kA);
  ASSERT_TRUE(mine.ok());
  const absl::Status pin = pool.Pin(*mine, kB, "kv_indices");
  EXPECT_EQ(pin.code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_NE(pin.message().find("another session"), std::string::npos) << pin;
  EXPECT_EQ(pool.Free(*mine, kB).code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(pool.free_pages(), 2);
}

TEST(PagePoolTest, PinNamesTheFieldAndPosition) {
  PagePool pool(4);
  auto ids = pool.Allocate(1, kA);
  ASSERT_TRUE(ids.ok());
  const absl::Status st = pool.Pin({(*ids)[0], 3}, kA, "kv_indices");
  EXPECT_EQ(st.code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_NE(st.message().find("kv_indices[1] = 3"), std::string::npos) << st;
  EXPECT_EQ(pool.Pin({7}, kA, "kv_indices").code(), absl::StatusCode::kInvalidArgument);
  // A failed pin pins nothing: the page can still be freed.
  EXPECT_TRUE(pool.Free(*ids, kA).ok());
}

TEST(PagePoolTest, PinnedPagesAreNotFreedUntilTheirCallsFinish) {
  PagePool pool(4);
  auto ids = pool.Allocate(2, kA);
  ASSERT_TRUE(ids.ok());
  ASSERT_TRUE(pool.Pin(*ids, kA, "kv_indices").ok());
  ASSERT_TRUE(pool.Pin({(*ids)[0]}, kA, "kv_indices").ok());  // a second call on one page
  EXPECT_EQ(pool.Free(*ids, kA).code(), absl::StatusCode::kFailedPrecondition);

  // The session goes away: the pages are released but stay used while pinned.
  EXPECT_EQ(pool.ReleaseOwner(kA), 2);
  EXPECT_EQ(pool.free_pages(), 2);
  pool.Unpin(*ids);
  EXPECT_EQ(pool.free_pages(), 3);  // (*ids)[1] had one pin
  pool.Unpin({(*ids)[0]});
  EXPECT_EQ(pool.free_pages(), 4);
  // Released pages belong to nobody: the old owner cannot use them.
  EXPECT_EQ(pool.Pin({(*ids)[0]}, kA, "x").code(), absl::StatusCode::kFailedPrecondition);
  ExpectInvariant(pool);
}

TEST(AppendLocksTest, OneAppendingCallPerPageAndLayer) {
  AppendLocks locks;
  const std::vector<int64_t> first{AppendKey(3, 0), AppendKey(4, 0)};
  ASSERT_TRUE(locks.Acquire(first).ok());
  // Another layer of the same page is another set of rows.
  EXPECT_TRUE(locks.Acquire(std::vector<int64_t>{AppendKey(3, 1)}).ok());
  // Overlapping the first call: refused, and nothing of it taken.
  const absl::Status st = locks.Acquire(std::vector<int64_t>{AppendKey(5, 0), AppendKey(4, 0)});
  EXPECT_EQ(st.code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_NE(st.message().find("page 4 (layer 0)"), std::string::npos) << st;
  EXPECT_TRUE(locks.Acquire(std::vector<int64_t>{AppendKey(5, 0)}).ok());
  // Once the first call finishes its pages can be appended to again.
  locks.Release(first);
  EXPECT_TRUE(locks.Acquire(std::vector<int64_t>{AppendKey(4, 0)}).ok());
  EXPECT_TRUE(locks.Acquire({}).ok());
}

TEST(PagePoolTest, ReleaseOwnerLeavesOtherSessionsAlone) {
  PagePool pool(6);
  auto a = pool.Allocate(2, kA);
  auto b = pool.Allocate(3, kB);
  ASSERT_TRUE(a.ok() && b.ok());
  EXPECT_EQ(pool.ReleaseOwner(kA), 2);
  EXPECT_EQ(pool.free_pages(), 3);
  EXPECT_TRUE(pool.Pin(*b, kB, "x").ok());
  EXPECT_EQ(pool.ReleaseOwner(kA), 0);
}

TEST(PagePoolTest, ReleaseOwnersReleasesSeveralSessionsInOnePass) {
  constexpr SessionId kC = 3;
  PagePool pool(8);
  ASSERT_TRUE(pool.Allocate(2, kA).ok() && pool.Allocate(3, kB).ok() && pool.Allocate(1, kC).ok());
  EXPECT_EQ(pool.ReleaseOwners({kA, kC, 99}, PageEvent::kReclaimed), 3);
  EXPECT_EQ(pool.pages_of(kA) + pool.pages_of(kC), 0);
  EXPECT_EQ(pool.pages_of(kB), 3);
  EXPECT_EQ(pool.free_pages(), 5);
  EXPECT_EQ(pool.ReleaseOwners({}, PageEvent::kReclaimed), 0);
}

// Records every report, and checks that each one matches the pool it came from at that moment.
class RecordingObserver final : public PageObserver {
 public:
  struct Report {
    std::string pool;
    PageEvent event;
    int pages, free_pages, total_pages;
    bool operator==(const Report&) const = default;
  };
  void OnPoolAdded(const std::string&, int) override {}
  void OnPageChange(const PageChange& c) override {
    reports.push_back(Report{c.pool, c.event, c.pages, c.free_pages, c.total_pages});
  }
  void OnAllocationFailure(const std::string&) override {}
  std::vector<Report> reports;
};

TEST(PagePoolTest, ReportsEveryChangeOfItsCounts) {
  RecordingObserver observer;
  PagePool pool(10, "p", &observer);
  auto a = pool.Allocate(3, kA);
  auto b = pool.Allocate(2, kB);
  ASSERT_TRUE(a.ok() && b.ok());
  ASSERT_TRUE(pool.Pin({(*a)[0]}, kA, "x").ok());
  EXPECT_EQ(pool.Allocate(6, kB).status().code(), absl::StatusCode::kResourceExhausted);
  ASSERT_TRUE(pool.Free({(*b)[1]}, kB).ok());
  EXPECT_EQ(pool.ReleaseOwner(kA, PageEvent::kReclaimed), 3);  // one of them pinned
  pool.Unpin({(*a)[0]});
  EXPECT_EQ(pool.ReleaseOwner(kB), 1);
  using R = RecordingObserver::Report;
  const std::vector<R> want{
      R{"p", PageEvent::kAllocated, 3, 7, 10}, R{"p", PageEvent::kAllocated, 2, 5, 10},
      R{"p", PageEvent::kFreed, 1, 6, 10},     R{"p", PageEvent::kReclaimed, 3, 8, 10},
      R{"p", PageEvent::kUnpinned, 1, 9, 10},  R{"p", PageEvent::kClosed, 1, 10, 10}};
  EXPECT_EQ(observer.reports, want);  // failures, pins and unpins that free nothing: no report
}

TEST(PagePoolTest, ConcurrentAllocateFreeKeepsInvariant) {
  PagePool pool(256);
  std::vector<std::thread> threads;
  for (int t = 0; t < 8; ++t) {
    threads.emplace_back([&pool, t] {
      std::mt19937 rng(t);
      const SessionId me = t + 1;
      std::vector<int32_t> mine;
      for (int i = 0; i < 2000; ++i) {
        if (rng() % 2 == 0) {
          auto ids = pool.Allocate(1 + rng() % 8, me);
          if (ids.ok()) mine.insert(mine.end(), ids->begin(), ids->end());
        } else if (!mine.empty()) {
          const size_t n = 1 + rng() % mine.size();
          ASSERT_TRUE(pool.Pin(absl::MakeConstSpan(mine).last(n), me, "x").ok());
          pool.Unpin(absl::MakeConstSpan(mine).last(n));
          ASSERT_TRUE(pool.Free(absl::MakeConstSpan(mine).last(n), me).ok());
          mine.resize(mine.size() - n);
        }
      }
      if (t % 2 == 0) {
        ASSERT_TRUE(pool.Free(mine, me).ok());
      } else {
        ASSERT_EQ(pool.ReleaseOwner(me), static_cast<int>(mine.size()));
      }
    });
  }
  for (auto& t : threads) t.join();
  EXPECT_EQ(pool.free_pages(), 256);
  ExpectInvariant(pool);
}

// Model-based test: random operations on the pool and on a trivially correct model (a map from
// page to owner and pin count); every result and every count must agree.
TEST(PagePoolTest, MatchesASimpleModelUnderRandomOperations) {
  constexpr int kPages = 48;
  std::mt19937 rng(20261130);
  for (int round = 0; round < 20; ++round) {
    PagePool pool(kPages);
    struct Page {
      SessionId owner = 0;  // -1 released while pinned
      int pins = 0;
    };
    std::map<int32_t, Page> model;
    for (int32_t id = 0; id < kPages; ++id) model[id] = Page{};
    auto model_free = [&] {
      int n = 0;
      for (auto& [id, p] : model) n += p.owner == 0;
      return n;
    };
    auto random_ids = [&] {
      std::vector<int32_t> ids;
      const int n = rng() % 5;
      for (int i = 0; i < n; ++i) ids.push_back(static_cast<int32_t>(rng() % (kPages + 2)) - 1);
      return ids;
    };
    std::vector<std::vector<int32_t>> pinned;
    for (int step = 0; step < 400; ++step) {
      const SessionId who = 1 + rng() % 3;
      switch (rng() % 5) {
        case 0: {
          const int n = 1 + rng() % 6;
          auto got = pool.Allocate(n, who);
          ASSERT_EQ(got.ok(), n <= model_free()) << got.status();
          if (got.ok()) {
            for (int32_t id : *got) {
              ASSERT_EQ(model[id].owner, 0);
              model[id].owner = who;
            }
          }
          break;
        }
        case 1: {
          const std::vector<int32_t> ids = random_ids();
          std::set<int32_t> unique(ids.begin(), ids.end());
          bool ok = unique.size() == ids.size();
          for (int32_t id : ids) {
            ok = ok && id >= 0 && id < kPages && model[id].owner == who && model[id].pins == 0;
          }
          ASSERT_EQ(pool.Free(ids, who).ok(), ok);
          if (ok) for (int32_t id : ids) model[id].owner = 0;
          break;
        }
        case 2: {
          const std::vector<int32_t> ids = random_ids();
          bool ok = true;
          for (int32_t id : ids) ok = ok && id >= 0 && id < kPages && model[id].owner == who;
          ASSERT_EQ(pool.Pin(ids, who, "x").ok(), ok);
          if (ok) {
            for (int32_t id : ids) ++model[id].pins;
            pinned.push_back(ids);
          }
          break;
        }
        case 3:
          if (!pinned.empty()) {
            const size_t k = rng() % pinned.size();
            pool.Unpin(pinned[k]);
            for (int32_t id : pinned[k]) {
              if (--model[id].pins == 0 && model[id].owner == -1) model[id].owner = 0;
            }
            pinned.erase(pinned.begin() + k);
          }
          break;
        case 4: {
          int expect = 0;
          for (auto& [id, p] : model) {
            if (p.owner != who) continue;
            ++expect;
            p.owner = p.pins > 0 ? -1 : 0;
          }
          ASSERT_EQ(pool.ReleaseOwner(who), expect);
          break;
        }
      }
      ASSERT_EQ(pool.free_pages(), model_free()) << "step " << step;
      ExpectInvariant(pool);
    }
  }
}

}  // namespace
}  // namespace attn
