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
