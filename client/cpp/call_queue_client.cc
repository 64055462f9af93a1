#include "client/cpp/call_queue_client.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/random.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <thread>

#include "proto/attnserve/v1/call_queue.h"

namespace attn::client {
namespace {

namespace cq = ::attnserve::v1::call_queue;
using Clock = std::chrono::steady_clock;

constexpr int kUnavailable = 14, kDeadlineExceeded = 4, kResourceExhausted = 8;

void Pause() {
#if defined(__x86_64__)
  __builtin_ia32_pause();
#endif
}

}  // namespace

std::chrono::nanoseconds CallTimes::Expected(uint32_t method, size_t request_bytes) const {
  std::lock_guard<std::mutex> lock(mu_);
  for (const Shape& s : shapes_) {
    if (s.average_ns > 0 && s.method == method && s.request_bytes == request_bytes) {
      return std::chrono::nanoseconds(s.average_ns);
    }
  }
  return std::chrono::nanoseconds(0);
}

void CallTimes::Record(uint32_t method, size_t request_bytes, std::chrono::nanoseconds took) {
  const int64_t ns = std::max<int64_t>(1, took.count());
  std::lock_guard<std::mutex> lock(mu_);
  ++uses_;
  Shape* oldest = &shapes_[0];
  for (Shape& s : shapes_) {
    if (s.average_ns > 0 && s.method == method && s.request_bytes == request_bytes) {
      // An average over about the last 8 calls: it follows a change of load within a few calls,
      // and one slow call moves it by an eighth.
      s.average_ns = std::max<int64_t>(1, s.average_ns + (ns - s.average_ns) / 8);
      s.last_use = uses_;
      return;
    }
    if (s.last_use < oldest->last_use) oldest = &s;
  }
  *oldest = Shape{method, request_bytes, ns, uses_};
}

std::chrono::nanoseconds CallTimes::SleepBeforePolling(std::chrono::nanoseconds expected,
                                                       std::chrono::nanoseconds spin) {
  if (spin.count() <= 0) return std::chrono::nanoseconds(0);  // a caller that never polls
  const std::chrono::nanoseconds margin = std::max(spin, expected / 4);
  return expected > margin ? expected - margin : std::chrono::nanoseconds(0);
}

std::unique_ptr<CallQueueClient> CallQueueClient::Create(const Options& options,
                                                         std::string* error) {
  static std::atomic<int> counter{0};
  std::unique_ptr<CallQueueClient> q(new CallQueueClient());
  q->options_ = options;
  q->bytes_ = cq::SegmentBytes(options.slots, options.request_bytes, options.response_bytes);
  q->shm_name_ = options.shm_prefix + "-q-" + std::to_string(getpid()) + "-" +
                 std::to_string(counter.fetch_add(1));
  q->key_.resize(32);
  if (getrandom(q->key_.data(), q->key_.size(), 0) != static_cast<ssize_t>(q->key_.size())) {
    *error = std::string("getrandom: ") + std::strerror(errno);
    return nullptr;
  }
  const int fd = shm_open(q->shm_name_.c_str(), O_RDWR | O_CREAT | O_EXCL, 0600);
  if (fd < 0) {
    *error = "shm_open(" + q->shm_name_ + "): " + std::strerror(errno);
    return nullptr;
  }
  void* base = MAP_FAILED;
  if (ftruncate(fd, static_cast<off_t>(q->bytes_)) == 0) {
    base = mmap(nullptr, q->bytes_, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  }
  const int err = errno;
  close(fd);
  if (base == MAP_FAILED) {
    shm_unlink(q->shm_name_.c_str());
    *error = "ftruncate/mmap of " + q->shm_name_ + ": " + std::strerror(err);
    return nullptr;
  }
  q->base_ = static_cast<char*>(base);
  std::memcpy(q->base_, "attnserve.region", 16);
  std::memcpy(q->base_ + 16, q->key_.data(), q->key_.size());
  q->abandoned_ = std::make_unique<std::atomic<bool>[]>(options.slots);
  for (int i = 0; i < options.slots; ++i) q->abandoned_[i].store(false);
  return q;
}

CallQueueClient::~CallQueueClient() {
  if (base_ != nullptr) munmap(base_, bytes_);
  Unlink();
}

void CallQueueClient::Unlink() {
  if (!unlinked_ && !shm_name_.empty()) shm_unlink(shm_name_.c_str());
  unlinked_ = true;
}

bool CallQueueClient::closed() const {
  return cq::Word(base_, cq::kClosed).load(std::memory_order_acquire) != 0;
}

char* CallQueueClient::Slot(int i) const {
  return base_ + cq::kSlots +
         static_cast<size_t>(i) * cq::SlotStride(options_.request_bytes, options_.response_bytes);
}

int CallQueueClient::Acquire(Clock::time_point give_up) {
  constexpr uint32_t kWriting = cq::kClientPrivate;
  for (int round = 0;; ++round) {
    for (int i = 0; i < options_.slots; ++i) {
      auto state = cq::Word(Slot(i), cq::kState);
      uint32_t expected = cq::kFree;
      if (state.compare_exchange_strong(expected, kWriting, std::memory_order_acquire)) return i;
      // A slot whose caller gave up is free once the server answered it.
      expected = cq::kDone;
      if (abandoned_[i].load(std::memory_order_acquire) &&
          state.compare_exchange_strong(expected, kWriting, std::memory_order_acquire)) {
        abandoned_[i].store(false, std::memory_order_relaxed);
        return i;
      }
    }
    if (closed() || Clock::now() > give_up) return -1;
    if (round > 64) std::this_thread::yield();
  }
}

CallQueueClient::Answer CallQueueClient::Call(uint32_t method, std::string_view request,
                                              std::chrono::microseconds timeout) {
  const Clock::time_point start = Clock::now();
  const Clock::time_point give_up =
      timeout.count() > 0 ? start + timeout : Clock::time_point::max();
  if (request.size() > static_cast<size_t>(options_.request_bytes)) {
    return {kResourceExhausted,
            "the request (" + std::to_string(request.size()) + " bytes) does not fit a slot of " +
                std::to_string(options_.request_bytes),
            0};
  }
  if (closed()) return {kUnavailable, "the server closed the call queue", 0};
  const int i = Acquire(give_up);
  if (i < 0) {
    return closed() ? Answer{kUnavailable, "the server closed the call queue", 0}
                    : Answer{kDeadlineExceeded, "no free slot before the timeout", 0};
  }
  char* slot = Slot(i);
  std::memcpy(slot + cq::kSlotHeaderBytes, request.data(), request.size());
  cq::Word(slot, cq::kMethod).store(method, std::memory_order_relaxed);
  cq::Word(slot, cq::kRequestLen)
      .store(static_cast<uint32_t>(request.size()), std::memory_order_relaxed);
  cq::Word64(slot, cq::kTimeoutUs).store(timeout.count(), std::memory_order_relaxed);
  cq::Word(slot, cq::kCancel).store(0, std::memory_order_relaxed);
  cq::Word(slot, cq::kClientWaiting).store(0, std::memory_order_relaxed);
  auto state = cq::Word(slot, cq::kState);
  // Publish, then ring (call_queue.h, "Ordering").
  state.store(cq::kSubmitted, std::memory_order_seq_cst);
  cq::Word(base_, cq::kDoorbell).fetch_add(1, std::memory_order_seq_cst);
  if (cq::Word(base_, cq::kServerSleeping).load(std::memory_order_seq_cst) != 0) {
    cq::FutexWake(base_ + cq::kDoorbell, 1);
  }
  const Clock::time_point published = Clock::now();
  const std::chrono::nanoseconds expected =
      options_.predict ? times_.Expected(method, request.size()) : std::chrono::nanoseconds(0);
  Answer failure;
  if (!Await(i, expected, give_up, &failure)) return failure;
  Answer answer;
  answer.code = static_cast<int>(cq::Word(slot, cq::kStatus).load(std::memory_order_relaxed));
  const uint32_t len =
      std::min<uint32_t>(cq::Word(slot, cq::kResponseLen).load(std::memory_order_relaxed),
                         static_cast<uint32_t>(options_.response_bytes));
  answer.retry_after_ms = cq::Word(slot, cq::kRetryAfterMs).load(std::memory_order_relaxed);
  const char* area = slot + cq::kSlotHeaderBytes + options_.request_bytes;
  answer.bytes.assign(area, len);
  state.store(cq::kFree, std::memory_order_release);
  if (answer.code == 0) times_.Record(method, request.size(), Clock::now() - published);
  return answer;
}

bool CallQueueClient::Await(int i, std::chrono::nanoseconds expected, Clock::time_point give_up,
                            Answer* failure) {
  char* slot = Slot(i);
  auto state = cq::Word(slot, cq::kState);
  auto waiting = cq::Word(slot, cq::kClientWaiting);
  const Clock::time_point start = Clock::now();
  uint32_t v = state.load(std::memory_order_acquire);
  // A long call of a known shape: sleep through most of it (woken if the answer lands first),
  // then poll for the rest of the expected time and the spin window.
  std::chrono::nanoseconds poll = options_.spin;
  if (const auto nap = CallTimes::SleepBeforePolling(expected, options_.spin); nap.count() > 0) {
    const Clock::time_point wake = std::min(give_up, start + nap);
    waiting.store(1, std::memory_order_seq_cst);
    v = state.load(std::memory_order_seq_cst);
    for (Clock::time_point now = Clock::now(); v != cq::kDone && now < wake && !closed();
         now = Clock::now()) {
      cq::FutexWait(slot + cq::kState, v,
                    std::chrono::duration_cast<std::chrono::nanoseconds>(wake - now).count());
      v = state.load(std::memory_order_acquire);
    }
    waiting.store(0, std::memory_order_relaxed);
    poll += expected - nap;
  }
  // Poll for the spin window, then sleep on the slot's state.
  const Clock::time_point spin_end =
      Clock::now() + std::min<Clock::duration>(poll, give_up - Clock::now());
  while (v != cq::kDone && Clock::now() < spin_end) {
    Pause();
    v = state.load(std::memory_order_acquire);
  }
  while (v != cq::kDone) {
    waiting.store(1, std::memory_order_seq_cst);
    v = state.load(std::memory_order_seq_cst);
    if (v == cq::kDone) break;
    const Clock::time_point now = Clock::now();
    // The server answers every slot it took, and those still waiting when it closes; a slot
    // published after its last scan is taken back here.
    if (closed() && v == cq::kSubmitted) {
      uint32_t expected_state = cq::kSubmitted;
      if (state.compare_exchange_strong(expected_state, cq::kFree, std::memory_order_seq_cst)) {
        *failure = {kUnavailable, "the server closed the call queue", 0};
        return false;
      }
      continue;
    }
    if (now >= give_up) {
      cq::Word(slot, cq::kCancel).store(1, std::memory_order_relaxed);
      uint32_t expected_state = cq::kSubmitted;
      if (!state.compare_exchange_strong(expected_state, cq::kFree, std::memory_order_seq_cst)) {
        abandoned_[i].store(true, std::memory_order_release);  // taken: the answer comes later
      }
      *failure = {kDeadlineExceeded, "no answer before the timeout", 0};
      return false;
    }
    const auto left = std::min<Clock::duration>(give_up - now, std::chrono::milliseconds(100));
    cq::FutexWait(slot + cq::kState, v,
                  std::chrono::duration_cast<std::chrono::nanoseconds>(left).count());
    v = state.load(std::memory_order_acquire);
  }
  waiting.store(0, std::memory_order_relaxed);
  return true;
}

}  // namespace attn::client
