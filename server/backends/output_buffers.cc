#include "server/backends/output_buffers.h"

#include <cstdlib>
#include <utility>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"

namespace attn {

struct OutputBuffers::State {
  Allocate allocate;
  Free free;
  int max_idle;
  size_t max_idle_bytes;
  absl::Mutex mu;
  std::vector<std::pair<char*, size_t>> idle ABSL_GUARDED_BY(mu);

  // A buffer back from its last user: kept for reuse, or freed.
  void Return(char* buffer, size_t bytes) {
    {
      absl::MutexLock lock(&mu);
      if (bytes <= max_idle_bytes && static_cast<int>(idle.size()) < max_idle) {
        idle.emplace_back(buffer, bytes);
        return;
      }
    }
    free(buffer);
  }
};

void OutputBuffers::ReleaseIdle(size_t keep) {
  std::vector<std::pair<char*, size_t>> large;
  {
    absl::MutexLock lock(&state_->mu);
    auto& idle = state_->idle;
    for (size_t i = 0; i < idle.size();) {
      if (idle[i].second > keep) {
        large.push_back(idle[i]);
        idle.erase(idle.begin() + static_cast<std::ptrdiff_t>(i));
      } else {
        ++i;
      }
    }
  }
  for (const auto& [buffer, bytes] : large) state_->free(buffer);
}

OutputBuffers::OutputBuffers(Allocate allocate, Free free, int max_idle, size_t max_idle_bytes)
    : state_(std::make_shared<State>()) {
  state_->allocate = std::move(allocate);
  state_->free = std::move(free);
  state_->max_idle = max_idle;
  state_->max_idle_bytes = max_idle_bytes;
}

OutputBuffers::~OutputBuffers() {
  std::vector<std::pair<char*, size_t>> idle;
  {
    absl::MutexLock lock(&state_->mu);
    idle.swap(state_->idle);
    state_->max_idle = 0;  // buffers still in use are freed when they come back
  }
  for (const auto& [buffer, bytes] : idle) state_->free(buffer);
}

absl::StatusOr<std::shared_ptr<char>> OutputBuffers::Get(size_t bytes) {
  bytes = std::max<size_t>(bytes, 64);
  char* buffer = nullptr;
  size_t capacity = 0;
  {
    absl::MutexLock lock(&state_->mu);
    // The smallest idle buffer that fits.
    size_t best = state_->idle.size();
    for (size_t i = 0; i < state_->idle.size(); ++i) {
      if (state_->idle[i].second >= bytes &&
          (best == state_->idle.size() || state_->idle[i].second < state_->idle[best].second)) {
        best = i;
      }
    }
    if (best < state_->idle.size()) {
      std::tie(buffer, capacity) = state_->idle[best];
      state_->idle.erase(state_->idle.begin() + static_cast<std::ptrdiff_t>(best));
    }
  }
  if (buffer == nullptr) {
    buffer = static_cast<char*>(state_->allocate(bytes));
    capacity = bytes;
    if (buffer == nullptr) {
      return absl::ResourceExhaustedError(
          absl::StrCat("cannot allocate ", bytes, " bytes for a launch's outputs"));
    }
  }
  std::shared_ptr<State> state = state_;
  return std::shared_ptr<char>(buffer, [state, capacity](char* b) { state->Return(b, capacity); });
}

std::unique_ptr<OutputBuffers> OutputBuffers::Host() {
  return std::make_unique<OutputBuffers>([](size_t bytes) { return std::malloc(bytes); },
                                         [](void* buffer) { std::free(buffer); });
}

}  // namespace attn
