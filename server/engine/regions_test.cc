#include "server/engine/regions.h"

#include <atomic>
#include <cstdint>
#include <limits>
#include <memory>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "gtest/gtest.h"

namespace attn {
namespace {

// Host memory standing in for a backend's mapping; counts live mappings so tests see unmaps.
class HeapMemory final : public MappedMemory {
 public:
  HeapMemory(int64_t size, std::atomic<int>* live) : bytes_(size), live_(live) { ++*live_; }
  ~HeapMemory() override { --*live_; }
  RegionKind kind() const override { return RegionKind::kSharedMemory; }
  char* data() const override { return const_cast<char*>(bytes_.data()); }
  int64_t size() const override { return static_cast<int64_t>(bytes_.size()); }
  bool broken() const override { return broken_; }
  void Break() { broken_ = true; }

 private:
  std::vector<char> bytes_;
  std::atomic<int>* live_;
  bool broken_ = false;
};

// A registration of shared-memory object `shm` (the fields RegionTable compares for a retry).
RegistrationFields Of(const std::string& shm, const std::string& slots = "") {
  RegistrationFields what = {{"shared_memory.shm_name", shm}, {"size", "1024"}, {"key", "k"}};
  if (!slots.empty()) what.push_back({"call_queue.slots", slots});
  return what;
}

class RegionTableTest : public ::testing::Test {
 protected:
  // Registers `name` of `size` bytes for `session`; returns the mapping (owned by the table).
  HeapMemory* Register(SessionId session, const std::string& name, int64_t size) {
    EXPECT_TRUE(table_.Reserve(session, name, size).ok());
    auto memory = std::make_unique<HeapMemory>(size, &live_);
    HeapMemory* raw = memory.get();
    EXPECT_TRUE(table_.Commit(session, name, std::move(memory)).ok());
    return raw;
  }

  std::atomic<int> live_{0};
  RegionTable table_{RegionLimits{.max_regions_per_session = 3, .max_bytes_per_session = 4096}};
};

TEST_F(RegionTableTest, ResolvesSlicesInsideTheRegion) {
  HeapMemory* m = Register(1, "arena", 1024);
  const SliceRef slices[] = {{"arena", 0, 64, "q"}, {"arena", 1008, 16, "k"}};
  absl::StatusOr<RegionUse> use = table_.Resolve(1, slices);
  ASSERT_TRUE(use.ok()) << use.status();
  ASSERT_EQ(use->size(), 2u);
  EXPECT_EQ(use->data(0), m->data());
  EXPECT_EQ(use->data(1), m->data() + 1008);
  EXPECT_EQ(table_.List(1)[0].calls_in_flight, 1);  // one call, however many slices
}

TEST_F(RegionTableTest, RefusesSlicesOutsideOrMisaligned) {
  Register(1, "arena", 1024);
  const int64_t big = std::numeric_limits<int64_t>::max();
  const struct {
    SliceRef slice;
    absl::StatusCode code;
  } cases[] = {
      {{"arena", 1008, 32, "q"}, absl::StatusCode::kInvalidArgument},  // past the end
      {{"arena", 1024, 1, "q"}, absl::StatusCode::kInvalidArgument},   // starts at the end
      {{"arena", 2048, 0, "q"}, absl::StatusCode::kInvalidArgument},   // starts past the end
      {{"arena", 16, big, "q"}, absl::StatusCode::kInvalidArgument},   // offset + bytes wraps
      {{"arena", big - 15, 32, "q"}, absl::StatusCode::kInvalidArgument},
      {{"arena", -16, 16, "q"}, absl::StatusCode::kInvalidArgument},  // negative offset
      {{"arena", 0, -1, "q"}, absl::StatusCode::kInvalidArgument},    // negative size
      {{"arena", 8, 16, "q"}, absl::StatusCode::kInvalidArgument},    // misaligned
      {{"other", 0, 16, "q"}, absl::StatusCode::kNotFound},           // not registered
  };
  for (const auto& c : cases) {
    absl::StatusOr<RegionUse> use = table_.Resolve(1, {c.slice});
    EXPECT_EQ(use.status().code(), c.code) << c.slice.offset << " + " << c.slice.bytes;
  }
  EXPECT_EQ(table_.List(1)[0].calls_in_flight, 0);  // nothing stays counted
}

TEST_F(RegionTableTest, AnotherSessionsRegionIsNotFound) {
  Register(1, "arena", 1024);
  EXPECT_EQ(table_.Resolve(2, {{"arena", 0, 16, "q"}}).status().code(),
            absl::StatusCode::kNotFound);
  EXPECT_EQ(table_.Remove(2, "arena").code(), absl::StatusCode::kNotFound);
  EXPECT_TRUE(table_.List(2).empty());
  EXPECT_EQ(table_.size(), 1);
}

TEST_F(RegionTableTest, AFailedResolveReleasesWhatItCounted) {
  Register(1, "a", 1024);
  const SliceRef slices[] = {{"a", 0, 16, "q"}, {"missing", 0, 16, "k"}};
  EXPECT_FALSE(table_.Resolve(1, slices).ok());
  EXPECT_TRUE(table_.Remove(1, "a").ok());  // not in use
}

TEST_F(RegionTableTest, AssigningOverAUseStopsIt) {
  Register(1, "a", 1024);
  absl::StatusOr<RegionUse> use = table_.Resolve(1, {{"a", 0, 16, "q"}});
  ASSERT_TRUE(use.ok());
  EXPECT_EQ(table_.List(1)[0].calls_in_flight, 1);
  *use = RegionUse();  // as an admission does once its call is over
  EXPECT_EQ(table_.List(1)[0].calls_in_flight, 0);
  RegionUse moved = *table_.Resolve(1, {{"a", 0, 16, "q"}});
  RegionUse target = std::move(moved);
  EXPECT_EQ(table_.List(1)[0].calls_in_flight, 1);  // moved, not copied
  target = RegionUse();
  EXPECT_TRUE(table_.Remove(1, "a").ok());
}

TEST_F(RegionTableTest, InUseRegionsCannotBeUnregistered) {
  Register(1, "arena", 1024);
  {
    absl::StatusOr<RegionUse> use = table_.Resolve(1, {{"arena", 0, 16, "q"}});
    ASSERT_TRUE(use.ok());
    EXPECT_EQ(table_.Remove(1, "arena").code(), absl::StatusCode::kFailedPrecondition);
  }
  EXPECT_TRUE(table_.Remove(1, "arena").ok());
  EXPECT_EQ(live_, 0);
  EXPECT_EQ(table_.Remove(1, "arena").code(), absl::StatusCode::kNotFound);
}

TEST_F(RegionTableTest, LimitsCountRegionsAndBytesPerSession) {
  Register(1, "a", 1024);
  Register(1, "b", 1024);
  EXPECT_EQ(table_.Reserve(1, "big", 4096).status().code(), absl::StatusCode::kResourceExhausted);
  Register(1, "c", 2048);  // exactly the byte limit
  EXPECT_EQ(table_.Reserve(1, "d", 64).status().code(), absl::StatusCode::kResourceExhausted);
  EXPECT_EQ(table_.Reserve(1, "a", 64).status().code(), absl::StatusCode::kAlreadyExists);
  Register(2, "a", 4096);  // another session has limits of its own
  ASSERT_TRUE(table_.Remove(1, "c").ok());
  Register(1, "d", 2048);  // the removed region's bytes are free again
}

TEST_F(RegionTableTest, RefusesBadNamesAndSizes) {
  for (const char* name : {"", "a/b", "a b", "\xff", "x\n"}) {
    EXPECT_EQ(table_.Reserve(1, name, 1024).status().code(), absl::StatusCode::kInvalidArgument)
        << name;
  }
  EXPECT_EQ(table_.Reserve(1, std::string(65, 'a'), 1024).status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(table_.Reserve(1, "small", kRegionHeaderBytes - 1).status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(table_.size(), 0);
}

TEST_F(RegionTableTest, ARetriedRegistrationGetsTheSameRegion) {
  ASSERT_TRUE(table_.Reserve(1, "a", 1024, Of("/x")).ok());
  ASSERT_TRUE(table_.Commit(1, "a", std::make_unique<HeapMemory>(1024, &live_)).ok());
  absl::StatusOr<std::optional<RegionInfo>> again = table_.Reserve(1, "a", 1024, Of("/x"));
  ASSERT_TRUE(again.ok());
  ASSERT_TRUE(again->has_value());  // nothing to map again
  EXPECT_EQ((*again)->size, 1024);
  EXPECT_FALSE((*again)->held);
  absl::StatusOr<RegionHold> hold = table_.Hold(1, "a", [](RegionGone) {});
  ASSERT_TRUE(hold.ok());
  again = table_.Reserve(1, "a", 1024, Of("/x"));
  ASSERT_TRUE(again.ok() && again->has_value());
  EXPECT_TRUE((*again)->held);  // a call queue serves it: the retry says so
  // The name, for other memory, or for the same memory asked of otherwise: no retry, and the
  // refusal names what differs.
  for (const auto& [what, field] :
       {std::pair{Of("/y"), "shared_memory.shm_name"}, {Of("/x", "4"), "call_queue.slots"}}) {
    const absl::Status st = table_.Reserve(1, "a", 1024, what).status();
    EXPECT_EQ(st.code(), absl::StatusCode::kAlreadyExists);
    EXPECT_NE(st.message().find(absl::StrCat("another ", field, ";")), std::string::npos) << st;
  }
  EXPECT_EQ(table_.List(1).size(), 1u);
  EXPECT_EQ(live_, 1);
}

TEST_F(RegionTableTest, AbandonedReservationsFreeTheirShare) {
  ASSERT_TRUE(table_.Reserve(1, "a", 4096).ok());
  EXPECT_EQ(table_.Reserve(1, "b", 64).status().code(), absl::StatusCode::kResourceExhausted);
  table_.Abandon(1, "a");
  Register(1, "b", 4096);
  EXPECT_TRUE(table_.List(1).size() == 1);
}

TEST_F(RegionTableTest, ReleasedSessionsUnmapWhenTheLastCallEnds) {
  Register(1, "a", 1024);
  Register(1, "b", 1024);
  absl::StatusOr<RegionUse> use = table_.Resolve(1, {{"a", 0, 16, "q"}});
  ASSERT_TRUE(use.ok());
  {
    std::vector<std::shared_ptr<void>> unmap;
    EXPECT_EQ(table_.ReleaseSession(1, &unmap), 2);
    EXPECT_EQ(live_, 2);  // nothing is unmapped under the table's lock
  }
  EXPECT_EQ(live_, 1);            // b once `unmap` went, a when its call ends
  EXPECT_EQ(use->data(0)[0], 0);  // still mapped for the running call
  *use = RegionUse();
  EXPECT_EQ(live_, 0);
  EXPECT_EQ(table_.size(), 0);
}

TEST_F(RegionTableTest, CommitAfterTheSessionWasReleasedUnmaps) {
  ASSERT_TRUE(table_.Reserve(1, "a", 1024).ok());
  std::vector<std::shared_ptr<void>> unmap;
  EXPECT_EQ(table_.ReleaseSession(1, &unmap), 0);  // reserved only
  EXPECT_EQ(table_.Commit(1, "a", std::make_unique<HeapMemory>(1024, &live_)).status().code(),
            absl::StatusCode::kNotFound);
  EXPECT_EQ(live_, 0);
  EXPECT_EQ(table_.size(), 0);
}

TEST_F(RegionTableTest, BrokenMemoryFailsCalls) {
  HeapMemory* m = Register(1, "a", 1024);
  absl::StatusOr<RegionUse> use = table_.Resolve(1, {{"a", 0, 16, "q"}});
  ASSERT_TRUE(use.ok());
  EXPECT_TRUE(use->CheckIntact().ok());
  m->Break();
  EXPECT_EQ(use->CheckIntact().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(table_.Resolve(1, {{"a", 0, 16, "q"}}).status().code(),
            absl::StatusCode::kFailedPrecondition);
}

// A region whose memory went away stays registered (until unregistered) but is no longer found
// by a retried registration, nor held by a call queue.
TEST_F(RegionTableTest, BrokenMemoryIsNotRegisteredOrHeldAgain) {
  ASSERT_TRUE(table_.Reserve(1, "a", 1024, Of("/x")).ok());
  auto memory = std::make_unique<HeapMemory>(1024, &live_);
  HeapMemory* m = memory.get();
  ASSERT_TRUE(table_.Commit(1, "a", std::move(memory)).ok());
  m->Break();
  EXPECT_EQ(table_.Reserve(1, "a", 1024, Of("/x")).status().code(),
            absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(table_.Hold(1, "a", [](RegionGone) {}).status().code(),
            absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(table_.List(1).size(), 1u);
  EXPECT_TRUE(table_.Remove(1, "a").ok());
  EXPECT_EQ(live_, 0);
}

TEST_F(RegionTableTest, ConcurrentCallsAndReleasesKeepCountsExact) {
  for (int round = 0; round < 200; ++round) {
    Register(1, "a", 1024);
    std::vector<std::thread> callers;
    for (int t = 0; t < 4; ++t) {
      callers.emplace_back([&] {
        for (int i = 0; i < 20; ++i) {
          absl::StatusOr<RegionUse> use = table_.Resolve(1, {{"a", 0, 16, "q"}});
          if (!use.ok()) {
            EXPECT_EQ(use.status().code(), absl::StatusCode::kNotFound);
          }
        }
      });
    }
    {
      std::vector<std::shared_ptr<void>> unmap;
      table_.ReleaseSession(1, &unmap);
    }
    for (auto& t : callers) t.join();
    ASSERT_EQ(live_, 0);
    ASSERT_EQ(table_.size(), 0);
  }
}

}  // namespace
}  // namespace attn
