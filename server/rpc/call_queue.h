// The server side of call queues (attention.proto, "Call queues"; the layout is
// proto/attnserve/v1/call_queue.h): a thread per registered queue takes calls out of its slots and
// hands them to a handler (the service's, which runs them exactly as the gRPC handlers do), and
// the handler's answer is written back into the slot by whichever thread finishes the call (the
// batcher's, for calls that ran), with no hop through another thread.
//
// The segment is the caller's memory: hostile until checked, and changing at any moment. The
// server copies each request out of its slot before anything reads it, reads every header word
// once, keeps its own record of which slots it is serving (a caller flipping a state back to
// kSubmitted cannot get a running call taken twice), and never waits for the caller: a futex wait
// on the segment always has a time limit, and a caller that dies or never reads its answer only
// loses its own slots. A truncated segment reads as zeros (server/backends/shared_memory.h) and
// stops the queue.
#pragma once

#include <atomic>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "absl/status/status.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "server/engine/regions.h"

namespace attn {

// The slots' geometry, from the registration (RegisterRegionRequest.call_queue), never from the
// segment.
struct CallQueueGeometry {
  int slots = 0;
  int request_bytes = 0;
  int response_bytes = 0;
};

// INVALID_ARGUMENT unless the geometry is within CallQueue's limits and fits `region_bytes`.
absl::Status CheckCallQueueGeometry(const CallQueueGeometry& g, int64_t region_bytes);

// The geometry as fields of the region's registration (Engine::RegisterRegion's `use`), so that
// only a registration of the same geometry is taken for a retry. The first, "call_queue", tells
// it from a registration of the same memory as a plain region.
RegistrationFields RegistrationFieldsOf(const CallQueueGeometry& g);

struct CallQueueOptions {
  // How long the thread polls after its last call (taken or answered) before it sleeps.
  absl::Duration spin = absl::Microseconds(100);
  // The longest futex sleep: how soon a queue whose caller never rings notices that it stopped.
  absl::Duration max_sleep = absl::Milliseconds(50);
  // Testing hook: runs after the thread announced that it sleeps and before its last scan, the
  // window a caller's publish must not be lost in.
  std::function<void()> before_sleep;
  // Testing hook: runs in QueuedCall::Finish after the answer is published (kDone) and before the
  // slot counts as free again, the window in which a quick caller's next call is already in it.
  std::function<void(int slot)> after_answer;
};

// One call taken out of a slot. The handler must call Finish exactly once, from any thread.
class QueuedCall {
 public:
  QueuedCall(const QueuedCall&) = delete;
  QueuedCall& operator=(const QueuedCall&) = delete;
  ~QueuedCall();  // a call dropped without Finish is answered INTERNAL

  uint32_t method() const { return method_; }
  // The request, copied out of the slot.
  const std::string& request() const { return request_; }
  absl::Time taken() const { return taken_; }
  absl::Time deadline() const { return deadline_; }
  // The caller's cancel word (it may set it while the call waits for its launch).
  bool cancelled() const;
  // Bytes an OK answer may have.
  size_t response_capacity() const;

  // Writes the answer into the slot and wakes the caller if it sleeps. On success `response` is
  // the serialized AttentionResponse (INTERNAL instead when it does not fit); otherwise the
  // status's message, cut at call_queue::kMaxMessageBytes, and `retry_after` for a full queue.
  void Finish(const absl::Status& status, const std::string& response = "",
              absl::Duration retry_after = absl::ZeroDuration());

 private:
  friend class CallQueueServer;
  struct Shared;
  QueuedCall(std::shared_ptr<Shared> queue, int slot) : queue_(std::move(queue)), slot_(slot) {}

  std::shared_ptr<Shared> queue_;
  int slot_;
  uint32_t method_ = 0;
  std::string request_;
  absl::Time taken_, deadline_ = absl::InfiniteFuture();
  bool finished_ = false;
};

// Serves one queue: a thread of its own from construction until it stops. It stops when asked
// (Stop), when its region leaves its session's table (UnregisterRegion, session closed or
// expired: the RegionHold's on_gone calls Stop), or when its memory goes away; it then sets the
// segment's `closed` word, answers the slots still waiting, waits for the calls it handed out to
// finish, answers the slots waiting by then (a caller's next call published as its last answer
// went out), lets the region go and runs the `on_stopped` callbacks. Thread safe.
class CallQueueServer {
 public:
  using Handler = std::function<void(std::unique_ptr<QueuedCall>)>;

  // `memory` is the segment (SegmentBytes(geometry) bytes at least, checked by the caller);
  // `handler` gets every call taken, on the queue's thread, and must not block.
  CallQueueServer(std::string name, CallQueueGeometry geometry, CallQueueOptions options,
                  Handler handler);
  ~CallQueueServer();  // Stop(UNAVAILABLE) and join

  // Starts serving `hold`'s memory.
  void Start(RegionHold hold);

  // Asks the thread to stop; slots still waiting are answered with `why`. Returns at once.
  // Thread safe and callable from a RegionHold's on_gone (it only stores and wakes).
  void Stop(const absl::Status& why);
  // Runs `f` once the queue has stopped (now, when it already has), on the stopping thread.
  void OnStopped(std::function<void()> f);
  bool stopped() const;
  const std::string& name() const { return name_; }

 private:
  void Loop();
  // Takes every submitted slot; true if it took one.
  bool Scan();
  void Take(int slot);
  // The call of a slot the thread moved to kTaken, counted as in flight.
  std::unique_ptr<QueuedCall> Claim(int slot);
  // Answers `why` into every slot that waits and has no call in flight (Shutdown).
  void AnswerWaiting(const absl::Status& why);
  void Shutdown();

  const std::string name_;
  const CallQueueGeometry geometry_;
  const CallQueueOptions options_;
  const Handler handler_;
  std::shared_ptr<QueuedCall::Shared> shared_;
  RegionHold hold_;
  std::thread thread_;

  // Why it stops, and whether the segment is still mapped (Stop rings its doorbell only then).
  // Never held while a region's lock is taken: Stop runs under one (RegionHold's on_gone).
  absl::Mutex why_mu_;
  absl::Status why_ ABSL_GUARDED_BY(why_mu_);
  bool mapped_ ABSL_GUARDED_BY(why_mu_) = false;

  mutable absl::Mutex mu_;
  bool stopped_ ABSL_GUARDED_BY(mu_) = false;
  std::vector<std::function<void()>> on_stopped_ ABSL_GUARDED_BY(mu_);
};

// The call queues of a server: bounded in number over the server and per session. Keys are
// (session handle, region name). Thread safe.
class CallQueues {
 public:
  CallQueues(int max_queues, int max_per_session)
      : max_queues_(max_queues), max_per_session_(max_per_session) {}
  ~CallQueues();  // stops every queue (UNAVAILABLE: the server shuts down) and joins them

  // Reserves a place for a new queue (RESOURCE_EXHAUSTED past a limit); then exactly one of
  // Commit or Abandon.
  absl::Status Reserve(const std::string& session, const std::string& name);
  void Commit(const std::string& session, const std::string& name,
              std::unique_ptr<CallQueueServer> queue);
  void Abandon(const std::string& session, const std::string& name);
  // Runs `f` once the queue (session, name) has stopped, or now when there is none.
  void WhenStopped(const std::string& session, const std::string& name, std::function<void()> f);
  // Stops every queue, answering waiting slots with `why`, and waits for them.
  void StopAll(const absl::Status& why);
  int size() const;

 private:
  using Key = std::pair<std::string, std::string>;
  // Forgets queues that stopped (joining their threads, outside the lock).
  void Reap();

  const int max_queues_;
  const int max_per_session_;
  mutable absl::Mutex mu_;
  // nullptr: reserved.
  absl::flat_hash_map<Key, std::unique_ptr<CallQueueServer>> queues_ ABSL_GUARDED_BY(mu_);
};

}  // namespace attn
