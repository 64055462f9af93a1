#include "kernels/cpu/thread_pool.h"

#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <thread>
#include <vector>

namespace attn::cpu {
namespace {

TEST(ThreadPoolTest, ZeroAndNegativeCountsCallNothing) {
  ThreadPool pool(2);
  std::atomic<int> calls{0};
  pool.ParallelFor(0, [&](int64_t) { ++calls; });
  pool.ParallelFor(-3, [&](int64_t) { ++calls; });
  EXPECT_EQ(calls.load(), 0);
}

TEST(ThreadPoolTest, OneIndexRunsOnTheCaller) {
  ThreadPool pool(2);
  std::thread::id ran_on;
  pool.ParallelFor(1, [&](int64_t i) {
    EXPECT_EQ(i, 0);
    ran_on = std::this_thread::get_id();
  });
  EXPECT_EQ(ran_on, std::this_thread::get_id());
}

TEST(ThreadPoolTest, EveryIndexExactlyOnce) {
  for (int workers : {0, 1, 3, 8}) {
    ThreadPool pool(workers);
    EXPECT_EQ(pool.MaxParallelism(), workers + 1);
    for (int64_t n : {2, 3, 17, 1000}) {
      std::vector<std::atomic<int>> hits(n);
      pool.ParallelFor(n, [&](int64_t i) { hits[i].fetch_add(1); });
      for (int64_t i = 0; i < n; ++i) ASSERT_EQ(hits[i].load(), 1) << workers << " " << n;
    }
  }
}

TEST(ThreadPoolTest, ConcurrentCallersAllComplete) {
  ThreadPool pool(3);
  constexpr int kCallers = 4;
  constexpr int kRounds = 200;
  std::vector<std::thread> callers;
  std::vector<int64_t> totals(kCallers, 0);
  for (int c = 0; c < kCallers; ++c) {
    callers.emplace_back([&, c] {
      for (int r = 0; r < kRounds; ++r) {
        const int64_t n = 1 + (r * 7 + c) % 50;
        std::vector<int> out(n, 0);
        pool.ParallelFor(n, [&](int64_t i) { out[i] = static_cast<int>(i) + 1; });
        // Writes made by workers are visible once ParallelFor returns.
        for (int64_t i = 0; i < n; ++i) totals[c] += out[i];
        totals[c] -= n * (n + 1) / 2;
      }
    });
  }
  for (std::thread& t : callers) t.join();
  for (int c = 0; c < kCallers; ++c) EXPECT_EQ(totals[c], 0) << "caller " << c;
}

TEST(ThreadPoolTest, NestedCallsComplete) {
  ThreadPool pool(2);
  std::atomic<int> calls{0};
  pool.ParallelFor(4, [&](int64_t) { pool.ParallelFor(5, [&](int64_t) { ++calls; }); });
  EXPECT_EQ(calls.load(), 20);
}

// Two indices that each wait for the other to start can only finish if a worker runs one of them
// while the caller runs the other.
TEST(ThreadPoolTest, WorkersRunConcurrentlyWithTheCaller) {
  ThreadPool pool(3);
  std::atomic<int> started{0};
  std::atomic<int> met{0};
  pool.ParallelFor(2, [&](int64_t) {
    started.fetch_add(1);
    const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(10);
    while (started.load() < 2 && std::chrono::steady_clock::now() < deadline) {
      std::this_thread::yield();
    }
    if (started.load() == 2) met.fetch_add(1);
  });
  EXPECT_EQ(met.load(), 2);
}

TEST(ThreadPoolTest, DestroyIdlePoolRepeatedly) {
  for (int i = 0; i < 20; ++i) {
    ThreadPool pool(4);
    if (i % 2) pool.ParallelFor(10, [](int64_t) {});
  }
}

}  // namespace
}  // namespace attn::cpu
