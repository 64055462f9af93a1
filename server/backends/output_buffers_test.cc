#include "server/backends/output_buffers.h"

#include <atomic>
#include <cstdlib>
#include <vector>

#include "gtest/gtest.h"

namespace attn {
namespace {

struct Counting {
  std::atomic<int> allocations{0}, live{0};
  std::unique_ptr<OutputBuffers> Make(int max_idle = 2, size_t max_idle_bytes = 1 << 20) {
    return std::make_unique<OutputBuffers>(
        [this](size_t n) {
          ++allocations;
          ++live;
          return std::malloc(n);
        },
        [this](void* p) {
          --live;
          std::free(p);
        },
        max_idle, max_idle_bytes);
  }
};

// An idle lane gives back its large idle buffers and keeps the small ones.
TEST(OutputBuffersTest, ReleaseIdleFreesOnlyTheLargeIdleBuffers) {
  Counting c;
  auto buffers = c.Make(/*max_idle=*/4);
  {
    auto small = buffers->Get(1000);
    auto large = buffers->Get(100000);
    auto busy_large = buffers->Get(200000);
    ASSERT_TRUE(small.ok() && large.ok() && busy_large.ok());
    {
      auto keep = std::move(*busy_large);  // still in use during the release
      small = absl::StatusOr<std::shared_ptr<char>>();
      large = absl::StatusOr<std::shared_ptr<char>>();
      EXPECT_EQ(c.live.load(), 3);
      buffers->ReleaseIdle(10000);
      EXPECT_EQ(c.live.load(), 2);  // the idle large one went, the small one and `keep` stay
    }
    EXPECT_EQ(c.live.load(), 2);  // `keep` came back idle
  }
  auto again = buffers->Get(1000);
  EXPECT_EQ(c.allocations.load(), 3);  // the small idle buffer was reused
}

TEST(OutputBuffersTest, BuffersAreReusedOnceTheirUsersAreDone) {
  Counting c;
  auto buffers = c.Make();
  char* first;
  {
    auto a = buffers->Get(1000);
    ASSERT_TRUE(a.ok());
    first = a->get();
    auto b = buffers->Get(1000);  // a is still in use
    ASSERT_TRUE(b.ok());
    EXPECT_NE(b->get(), first);
  }
  EXPECT_EQ(c.allocations, 2);
  auto again = buffers->Get(500);  // fits an idle one
  ASSERT_TRUE(again.ok());
  EXPECT_EQ(c.allocations, 2);
  EXPECT_EQ(c.live, 2);
}

TEST(OutputBuffersTest, OnlyAFewSmallBuffersStayIdle) {
  Counting c;
  auto buffers = c.Make(/*max_idle=*/2, /*max_idle_bytes=*/4096);
  {
    std::vector<std::shared_ptr<char>> held;
    for (int i = 0; i < 5; ++i) held.push_back(*buffers->Get(1024));
    held.push_back(*buffers->Get(1 << 20));  // too large to keep
  }
  EXPECT_EQ(c.live, 2);  // a large call does not keep its memory for good
}

TEST(OutputBuffersTest, BuffersMayOutliveThePool) {
  Counting c;
  auto buffers = c.Make();
  std::shared_ptr<char> kept = *buffers->Get(100);
  { auto idle = buffers->Get(100); }
  buffers.reset();
  EXPECT_EQ(c.live, 1);  // the idle one was freed with the pool
  kept.reset();
  EXPECT_EQ(c.live, 0);
}

TEST(OutputBuffersTest, AllocationFailureIsResourceExhausted) {
  OutputBuffers buffers([](size_t) { return nullptr; }, [](void*) {});
  EXPECT_EQ(buffers.Get(10).status().code(), absl::StatusCode::kResourceExhausted);
}

}  // namespace
}  // namespace attn
