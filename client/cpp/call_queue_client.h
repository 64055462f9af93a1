// The caller's side of a call queue (attention.proto, "Call queues"; layout in
// proto/attnserve/v1/call_queue.h): a POSIX shared-memory segment of call slots this process
// creates, registers with RegisterRegion (call_queue set: the fields are below), and then calls
// Decode and Prefill through, without gRPC and without a thread wake-up per call while the
// server polls. It knows nothing of gRPC or protobuf: requests and answers are the serialized
// messages, so any C++ caller (attn_loadgen, a model runner) can use it. Thread safe: concurrent
// calls take different slots.
#pragma once

#include <atomic>
#include <chrono>
#include <cstdint>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

namespace attn::client {

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

 private:
  CallQueueClient() = default;
  char* Slot(int i) const;
  int Acquire(std::chrono::steady_clock::time_point give_up);

  Options options_;
  std::string shm_name_, key_;
  char* base_ = nullptr;
  size_t bytes_ = 0;
  bool unlinked_ = false;
  // Slots whose caller gave up: reused once the server's answer arrives.
  std::unique_ptr<std::atomic<bool>[]> abandoned_;
};

}  // namespace attn::client
