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
  // Bytes the queued calls of one batcher may hold (their tensors and page tables); a call
  // larger than this is still accepted into an empty queue.
  int64_t max_queue_bytes = int64_t{512} << 20;
  // Work budget of one call and of one launch: keys read, summed over sequences of
  // q_len * kv_len (the causal mask not subtracted; a page named twice counts twice). The
  // Engine refuses a call past it with INVALID_ARGUMENT; the batcher merges calls only while
  // their sum stays within it. So one launch holds its lane for at most this much work.
  int64_t max_call_key_reads = int64_t{1} << 30;
  // A lane idle this long after a launch gives back what it keeps for large launches
  // (Lane::ReleaseIdle): a stream of large calls keeps its pinned staging, a pause returns it.
  // Zero: never.
  absl::Duration idle_release = absl::Milliseconds(200);
};

// What the batcher reports about a finished call.
struct CallReport {
  absl::Time enqueued;
  absl::Time launched = absl::InfinitePast();  // InfinitePast: never reached the backend
  absl::Time finished;
  LaunchStats launch;  // zero when the launch failed or never ran
  // Calls of the caller's own session merged into its launch (itself included): calls of other
  // sessions are other clients' business and are not counted.
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
  int64_t session = 0;  // the call's session: what CallReport::batch_requests counts
  int64_t work = 1;     // the call's cost, in any unit proportional to its time on the lane
  int64_t bytes = 0;    // memory the call holds while it waits (counted by max_queue_bytes)
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

  // Queues a call. RESOURCE_EXHAUSTED (call.done not called) when the queue is full, in calls
  // or in bytes; UNAVAILABLE after Stop(). Never blocks on the backend.
  absl::Status Submit(std::unique_ptr<PendingCall> call);

  // Completes the queued calls with UNAVAILABLE, waits for the running launch, joins the thread.
  void Stop();
  // Completes the queued calls with `why` now (the running launch goes on); returns how many.
  int CancelQueued(const absl::Status& why);

  int queued() const;
  int64_t launches() const;  // backend launches so far (merging makes this < calls)

  // How long a caller refused with RESOURCE_EXHAUSTED should wait before retrying: the time the
  // work ahead of it should take (the queued calls' and what is left of the running launch's),
  // from the lane's measured time per unit of work, at least a millisecond. A launch that has
  // run longer than its estimate raises the estimate: a lane busy for seconds says seconds.
  absl::Duration RetryHint() const;

 private:
  void Loop();
  // True when the queue holds a call or the batcher is stopping (what the thread waits for).
  bool HasWorkOrStop() const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    return stopping_ || !queue_.empty();
  }
  // Waits up to `how_long` for a call (or Stop); true when none came.
  bool StaysIdle(absl::Duration how_long) ABSL_LOCKS_EXCLUDED(mu_);
  // Waits until a batch is due; returns false when stopping with an empty queue.
  bool WaitForBatch() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Pops the next batch: a FIFO prefix of mutually mergeable calls within the limits.
  std::vector<std::unique_ptr<PendingCall>> PopBatch() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void Launch(std::vector<std::unique_ptr<PendingCall>> batch);
  int FailQueued(const absl::Status& why) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  const std::string pool_;
  const Op op_;
  const std::string name_;  // "pool/op", for messages
  const std::unique_ptr<Lane> lane_;
  const BatchingOptions options_;
  BatchObserver* const observer_;

  mutable absl::Mutex mu_;
  std::deque<std::unique_ptr<PendingCall>> queue_ ABSL_GUARDED_BY(mu_);
  int64_t queued_tokens_ ABSL_GUARDED_BY(mu_) = 0;
  int64_t queued_bytes_ ABSL_GUARDED_BY(mu_) = 0;
  int64_t queued_work_ ABSL_GUARDED_BY(mu_) = 0;
  bool stopping_ ABSL_GUARDED_BY(mu_) = false;
  int64_t launches_ ABSL_GUARDED_BY(mu_) = 0;
  int64_t running_work_ ABSL_GUARDED_BY(mu_) = 0;  // of the launch in progress; 0: none
  absl::Time running_since_ ABSL_GUARDED_BY(mu_);
  // Wall time per unit of work of the recent launches (a moving average); 0: none yet.
  double seconds_per_work_ ABSL_GUARDED_BY(mu_) = 0;
  std::thread thread_;
};

}  // namespace attn
