#include "server/backends/fault_injection.h"

#include <atomic>
#include <utility>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/time/clock.h"

namespace attn {
namespace {

// Shared by the decorated backend's lanes: the launch count and whether the "device" is poisoned.
struct FaultState {
  FaultPlan plan;
  std::function<void(const absl::Status&)> on_fatal_error;
  std::atomic<int64_t> launches{0};
  std::atomic<bool> poisoned{false};
};

class FaultyLane final : public Lane {
 public:
  FaultyLane(std::unique_ptr<Lane> inner, FaultState& state)
      : inner_(std::move(inner)), state_(state) {}

  absl::StatusOr<LaunchStats> Run(absl::Span<AttentionCall* const> calls) override {
    if (state_.poisoned.load()) {
      return absl::InternalError("injected fault: the device failed earlier");
    }
    if (state_.plan.kind == FaultPlan::Kind::kDelay) {
      absl::SleepFor(absl::Milliseconds(state_.plan.delay_ms));
      return inner_->Run(calls);
    }
    if (++state_.launches != state_.plan.at_launch) return inner_->Run(calls);
    if (state_.plan.kind == FaultPlan::Kind::kAllocation) {
      return absl::ResourceExhaustedError(
          "injected fault: device memory allocation failed (cudaErrorMemoryAllocation)");
    }
    state_.poisoned = true;
    const absl::Status fatal = absl::InternalError(
        "injected fault: an illegal memory access was encountered (cudaErrorIllegalAddress)");
    if (state_.on_fatal_error) state_.on_fatal_error(fatal);
    return fatal;
  }
  void ReleaseIdle() override { inner_->ReleaseIdle(); }

 private:
  std::unique_ptr<Lane> inner_;
  FaultState& state_;
};

class FaultyBackend final : public Backend {
 public:
  FaultyBackend(std::unique_ptr<Backend> inner, FaultPlan plan,
                std::function<void(const absl::Status&)> on_fatal_error)
      : inner_(std::move(inner)) {
    state_.plan = plan;
    state_.on_fatal_error = std::move(on_fatal_error);
  }

  std::string name() const override { return inner_->name(); }
  std::string device() const override { return inner_->device(); }
  absl::Status AddPool(const PoolGeometry& geometry) override { return inner_->AddPool(geometry); }
  absl::Status ScrubPages(int pool, absl::Span<const int32_t> pages) override {
    return inner_->ScrubPages(pool, pages);
  }
  // Everything but the launches is the inner backend's, unchanged.
  bool ChecksFiniteInputs() const override { return inner_->ChecksFiniteInputs(); }
  absl::StatusOr<std::unique_ptr<MappedMemory>> MapRegion(
      const RegionSpec& spec, absl::string_view shm_name_prefix) override {
    return inner_->MapRegion(spec, shm_name_prefix);
  }

  absl::StatusOr<std::unique_ptr<Lane>> CreateLane(int pool, Op op) override {
    absl::StatusOr<std::unique_ptr<Lane>> lane = inner_->CreateLane(pool, op);
    if (!lane.ok()) return lane.status();
    return std::unique_ptr<Lane>(new FaultyLane(*std::move(lane), state_));
  }

 private:
  std::unique_ptr<Backend> inner_;
  FaultState state_;
};

}  // namespace

absl::StatusOr<FaultPlan> ParseFaultPlan(const std::string& text) {
  const std::vector<std::string> parts = absl::StrSplit(text, ':');
  FaultPlan plan;
  if (parts.size() == 2 && absl::SimpleAtoi(parts[1], &plan.at_launch) && plan.at_launch >= 1) {
    if (parts[0] == "sticky") return plan;
    if (parts[0] == "alloc") {
      plan.kind = FaultPlan::Kind::kAllocation;
      return plan;
    }
    if (parts[0] == "delay") {
      plan.kind = FaultPlan::Kind::kDelay;
      plan.delay_ms = plan.at_launch;
      return plan;
    }
  }
  return absl::InvalidArgumentError(absl::StrCat(
      "inject_fault = '", text, "'; expected sticky:N, alloc:N or delay:MS with N, MS >= 1"));
}

std::unique_ptr<Backend> InjectFaults(std::unique_ptr<Backend> backend, FaultPlan plan,
                                      std::function<void(const absl::Status&)> on_fatal_error) {
  return std::make_unique<FaultyBackend>(std::move(backend), plan, std::move(on_fatal_error));
}

}  // namespace attn
