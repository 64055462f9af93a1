#include "server/rpc/allocator_trim.h"

#include <atomic>

#include "absl/synchronization/notification.h"
#include "gtest/gtest.h"

namespace attn {
namespace {

TEST(AllocatorTrimmerTest, TrimsOnceLargeCallsHaveStopped) {
  absl::Notification trimmed;
  AllocatorTrimmer trimmer(absl::ZeroDuration(), [&] {
    if (!trimmed.HasBeenNotified()) trimmed.Notify();
  });
  trimmer.LargeCallEnded();
  trimmed.WaitForNotification();
}

// While the quiet moment has not come, nothing is trimmed, however many calls end.
TEST(AllocatorTrimmerTest, NoTrimBeforeTheQuietMoment) {
  std::atomic<int> trims{0};
  {
    AllocatorTrimmer trimmer(absl::InfiniteDuration(), [&] { ++trims; });
    for (int i = 0; i < 3; ++i) trimmer.LargeCallEnded();
  }
  EXPECT_EQ(trims.load(), 0);
}

TEST(AllocatorTrimmerTest, NoCallNoTrim) {
  std::atomic<int> trims{0};
  {
    AllocatorTrimmer trimmer(absl::ZeroDuration(), [&] { ++trims; });
  }
  EXPECT_EQ(trims.load(), 0);
}

}  // namespace
}  // namespace attn
