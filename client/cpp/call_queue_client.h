// The caller's side of a call queue (attention.proto, "Call queues"; layout in
// proto/attnserve/v1/call_queue.h): a POSIX shared-memory segment of call slots this process
// creates, registers with RegisterRegion (call_queue set: the fields are below), and then calls
// Decode and Prefill through, without gRPC and without a thread wake-up per call while the
// server polls. It knows nothing of gRPC or protobuf: requests and answers are the serialized
// messages, so any C++ caller (attn_loadgen, a model runner) can use it. Thread safe: concurrent
// calls take different slots.
#pragma once

#include <array>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <memory>
#include <mutex>
#include <string>
#include <string_view>
#include <vector>

namespace attn::client {

// How long calls of each shape took: the call queue's guess of when an answer will land, so a
// caller can sleep through most of a long call and poll for its end instead of being woken (a
// futex wake-up costs tens of microseconds on a VM, more after a long sleep). A shape is the
// method and the request's size: a scheduler's calls of one step and layer repeat both. Keeps
// the last kShapes shapes. Thread safe.
class CallTimes {
 public:
  static constexpr int kShapes = 16;

  // The expected time of a call of this shape (an average that weighs recent calls most), or 0
  // when none of its shape has been recorded.
  std::chrono::nanoseconds Expected(uint32_t method, size_t request_bytes) const;
  // Adds one answered call's time, from publishing the request to seeing the answer.
  void Record(uint32_t method, size_t request_bytes, std::chrono::nanoseconds took);

  // How long a call expected to take `expected` sleeps before it polls, when it polls for
  // `spin` at least: none for calls the spin window covers (and none when spin is 0: a caller
  // that never polls); else all but a margin of a quarter of the call (its variation) and at
  // least `spin` (the sleep's own lateness: the timer's slack and the thread's wake-up).
  // Answers that land during the sleep wake the caller, as without the guess.
  static std::chrono::nanoseconds SleepBeforePolling(std::chrono::nanoseconds expected,
                                                     std::chrono::nanoseconds spin);

 private:
  struct Shape {
    uint32_t method = 0;
    size_t request_bytes = 0;
    int64_t average_ns = 0;  // 0: unused
    uint64_t last_use = 0;
  };
  mutable std::mutex mu_;
  std::array<Shape, kShapes> shapes_;  // guarded by mu_
  uint64_t uses_ = 0;                  // guarded by mu_
};

class CallQueueClient {
 public:
  struct Options {
    int slots = 4;
    int request_bytes = 64 << 10;   // largest serialized request
    int response_bytes = 16 << 10;  // largest serialized AttentionResponse
    // Must start with the server's DataPlane.shm_name_prefix.
    std::string shm_prefix = "/attnserve";
    // How long a call polls its slot for the answer before it sleeps on the slot's futex.
    std::chrono::nanoseconds spin = std::chrono::microseconds(200);
    // Calls longer than `spin` sleep through most of the time calls of their shape took
    // (CallTimes), then poll for the answer: it is seen as it lands instead of after a
    // wake-up, for at most a quarter of the call's time (and `spin`) of polling. Off: poll for
    // `spin`, then sleep until woken.
    bool predict = true;
  };

  // The answer written into the slot: a canonical status code (0: OK), and the serialized
  // AttentionResponse (OK) or the status message.
  struct Answer {
    int code = 0;
    std::string bytes;
    uint32_t retry_after_ms = 0;
  };

  // Creates the segment (name: prefix + "-q-" + pid + "-" + a counter) with the region header
  // and an empty ring. nullptr and `error` set on failure.
  static std::unique_ptr<CallQueueClient> Create(const Options& options, std::string* error);
  ~CallQueueClient();  // unmaps (and unlinks, if Unlink was not called)
  CallQueueClient(const CallQueueClient&) = delete;
  CallQueueClient& operator=(const CallQueueClient&) = delete;

  // What RegisterRegionRequest needs: shared_memory.shm_name, size, key, call_queue.
  const std::string& shm_name() const { return shm_name_; }
  int64_t size() const { return static_cast<int64_t>(bytes_); }
  const std::string& key() const { return key_; }
  const Options& options() const { return options_; }
  // Removes the name once the server mapped the segment (it never opens it again).
  void Unlink();

  // Sends one call (method: call_queue::kDecode or kPrefill) and waits for its answer, at most
  // `timeout` (0: the server's answer, however long). Codes of its own: RESOURCE_EXHAUSTED (8)
  // for a request larger than a slot, UNAVAILABLE (14) when the server closed the queue,
  // DEADLINE_EXCEEDED (4) when `timeout` passed (the slot is then given up: the call may still
  // run, and the slot is reused once the server answered it).
  Answer Call(uint32_t method, std::string_view request,
              std::chrono::microseconds timeout = std::chrono::microseconds(0));

  bool closed() const;  // the server stopped serving the queue

  // The times of the calls answered so far, by shape (Options::predict). A caller that knows
  // what its calls take may record that before the first.
  CallTimes& call_times() { return times_; }

 private:
  CallQueueClient() = default;
  char* Slot(int i) const;
  int Acquire(std::chrono::steady_clock::time_point give_up);
  // Waits for slot i's answer: true once it is there; false with `failure` set when the queue
  // closed or give_up passed first.
  bool Await(int i, std::chrono::nanoseconds expected,
             std::chrono::steady_clock::time_point give_up, Answer* failure);

  Options options_;
  std::string shm_name_, key_;
  char* base_ = nullptr;
  size_t bytes_ = 0;
  bool unlinked_ = false;
  // Slots whose caller gave up: reused once the server's answer arrives.
  std::unique_ptr<std::atomic<bool>[]> abandoned_;
  CallTimes times_;
};

}  // namespace attn::client
