// Dynamic batcher: merges concurrent calls of one (pool, op) into single backend launches.
//
// One thread per Batcher takes calls from a bounded FIFO queue, waits at most max_queue_delay
// after the oldest queued call arrived for more to merge with, and launches up to
// max_batch_requests calls / max_batch_tokens query tokens at once on its Lane. Calls whose
// client cancelled or whose deadline passed are completed before launch (CANCELLED /
// DEADLINE_EXCEEDED) and never touch the pool. The leader/group-commit shape follows LevelDB's
// write path; the policy knobs follow Triton's dynamic batcher.
#pragma once

#include <deque>
#include <functional>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "server/engine/attention_call.h"
#include "server/engine/backend.h"

namespace attn {

struct BatchingOptions {
  // 0: a call launches as soon as its lane is free; calls that arrive while a launch runs merge
  // into the next one. A positive delay trades latency for fuller batches at low load.
  absl::Duration max_queue_delay = absl::ZeroDuration();
  int max_batch_requests = 64;
  int max_batch_tokens = 16384;  // a call with more tokens still runs, alone
  int max_queue_requests = 1024;
};

// What the batcher reports about a finished call.
struct CallReport {
  absl::Time enqueued;
  absl::Time launched = absl::InfinitePast();  // InfinitePast: never reached the backend
  absl::Time finished;
  LaunchStats launch;  // zero when the launch failed or never ran
  int batch_requests = 0;
  int batch_tokens = 0;
  // Set when the call was refused because its queue was full: how long the caller should wait
  // before retrying (Batcher::RetryHint).
  absl::Duration retry_after = absl::ZeroDuration();
  // The call's outputs when it succeeded and they were left for the response (not written into
  // a region): AttentionCall::out.result and lse.result.
  SharedBytes out, lse;
};

// Observes every launch (metrics); called on the batcher thread. `pool` is the batcher's pool
// name (one of the configured pools, so a bounded label).
class BatchObserver {
 public:
  virtual ~BatchObserver() = default;
  virtual void OnLaunch(const std::string& pool, Op op, int requests, int tokens,
                        const LaunchStats& stats) = 0;
  virtual void OnQueueWait(const std::string& pool, Op op, absl::Duration wait) = 0;
};

struct PendingCall {
  AttentionCall call;
  absl::Time deadline = absl::InfiniteFuture();
  // Polled just before launch; true drops the call with CANCELLED.
  std::function<bool()> is_cancelled;
  // Called exactly once, on the batcher thread, for every call Submit accepted.
  std::function<void(const absl::Status&, const CallReport&)> done;
  absl::Time enqueued;  // set by Submit
};

class Batcher {
 public:
  // Serves calls of `op` on pool `pool`. `observer` may be null; it must outlive the batcher.
  Batcher(std::string pool, Op op, std::unique_ptr<Lane> lane, BatchingOptions options,
          BatchObserver* observer);
  ~Batcher();  // Stop()s

  Batcher(const Batcher&) = delete;
  Batcher& operator=(const Batcher&) = delete;

  // Queues a call. RESOURCE_EXHAUSTED (call.done not called) when the queue is full, UNAVAILABLE
  // after Stop(). Never blocks on the backend.
  absl::Status Submit(std::unique_ptr<PendingCall> call);

  // Completes the queued calls with UNAVAILABLE, waits for the running launch, joins the thread.
  void Stop();

  int queued() const;
  int64_t launches() const;  // backend launches so far (merging makes this < calls)

  // How long a caller refused with RESOURCE_EXHAUSTED should wait before retrying: the time the
  // launches ahead of it should take, at least a millisecond.
  absl::Duration RetryHint() const;

 private:
  void Loop();
  // Waits until a batch is due; returns false when stopping with an empty queue.
  bool WaitForBatch() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Pops the next batch: a FIFO prefix of mutually mergeable calls within the limits.
  std::vector<std::unique_ptr<PendingCall>> PopBatch() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void Launch(std::vector<std::unique_ptr<PendingCall>> batch);
  void FailQueued() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  const std::string pool_;
  const Op op_;
  const std::string name_;  // "pool/op", for messages
  const std::unique_ptr<Lane> lane_;
  const BatchingOptions options_;
  BatchObserver* const observer_;

  mutable absl::Mutex mu_;
  std::deque<std::unique_ptr<PendingCall>> queue_ ABSL_GUARDED_BY(mu_);
  int64_t queued_tokens_ ABSL_GUARDED_BY(mu_) = 0;
  bool stopping_ ABSL_GUARDED_BY(mu_) = false;
  int64_t launches_ ABSL_GUARDED_BY(mu_) = 0;
  absl::Duration last_launch_ ABSL_GUARDED_BY(mu_);  // wall time of the latest launch
  std::thread thread_;
};

}  // namespace attn
