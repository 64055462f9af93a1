// The fault-injection decorator changes launches only: every other part of the backend it wraps
// (regions, the finiteness check, idle release, scrubbing) is the inner backend's.
#include "server/backends/fault_injection.h"

#include <memory>
#include <string>
#include <utility>

#include "gtest/gtest.h"

namespace attn {
namespace {

struct Calls {
  int map_region = 0, release_idle = 0, scrub = 0, run = 0;
};

class RecordingLane final : public Lane {
 public:
  explicit RecordingLane(Calls* calls) : calls_(calls) {}
  absl::StatusOr<LaunchStats> Run(absl::Span<AttentionCall* const>) override {
    ++calls_->run;
    return LaunchStats{};
  }
  void ReleaseIdle() override { ++calls_->release_idle; }

 private:
  Calls* calls_;
};

class RecordingBackend final : public Backend {
 public:
  explicit RecordingBackend(Calls* calls) : calls_(calls) {}
  std::string name() const override { return "recording"; }
  std::string device() const override { return "none"; }
  bool ChecksFiniteInputs() const override { return true; }
  absl::Status AddPool(const PoolGeometry&) override { return absl::OkStatus(); }
  absl::StatusOr<std::unique_ptr<Lane>> CreateLane(int, Op) override {
    return std::unique_ptr<Lane>(new RecordingLane(calls_));
  }
  absl::StatusOr<std::unique_ptr<MappedMemory>> MapRegion(const RegionSpec&,
                                                          absl::string_view prefix) override {
    ++calls_->map_region;
    return absl::FailedPreconditionError(std::string(prefix));
  }
  absl::Status ScrubPages(int, absl::Span<const int32_t>) override {
    ++calls_->scrub;
    return absl::OkStatus();
  }

 private:
  Calls* calls_;
};

TEST(FaultInjectionTest, EverythingButLaunchesIsTheInnerBackends) {
  for (const char* plan : {"delay:1", "alloc:5", "sticky:5"}) {
    SCOPED_TRACE(plan);
    Calls calls;
    absl::StatusOr<FaultPlan> parsed = ParseFaultPlan(plan);
    ASSERT_TRUE(parsed.ok()) << parsed.status();
    std::unique_ptr<Backend> b =
        InjectFaults(std::make_unique<RecordingBackend>(&calls), *parsed, nullptr);
    EXPECT_TRUE(b->ChecksFiniteInputs());
    // The inner backend's answer, not the base class's UNIMPLEMENTED.
    EXPECT_EQ(b->MapRegion(RegionSpec{}, "/prefix").status().message(), "/prefix");
    EXPECT_TRUE(b->ScrubPages(0, {}).ok());
    absl::StatusOr<std::unique_ptr<Lane>> lane = b->CreateLane(0, Op::kDecode);
    ASSERT_TRUE(lane.ok());
    EXPECT_TRUE((*lane)->Run({}).ok());
    (*lane)->ReleaseIdle();
    EXPECT_EQ(calls.map_region, 1);
    EXPECT_EQ(calls.scrub, 1);
    EXPECT_EQ(calls.run, 1);
    EXPECT_EQ(calls.release_idle, 1);
  }
}

}  // namespace
}  // namespace attn
