#include "server/engine/batcher.h"

#include <algorithm>
#include <limits>
#include <utility>

#include "absl/container/flat_hash_map.h"
#include "absl/strings/str_cat.h"

namespace attn {
namespace {

// Calls merge when one kernel launch can serve both: the same softmax scale and both appending
// (or both not). Pool and op are the batcher's own.
bool Mergeable(const AttentionCall& a, const AttentionCall& b) {
  return a.sm_scale == b.sm_scale && a.appends() == b.appends();
}

void Complete(PendingCall& call, const absl::Status& status, CallReport report) {
  report.finished = absl::Now();
  if (status.ok()) {
    report.out = std::move(call.call.out.result);
    report.lse = std::move(call.call.lse.result);
  }
  call.done(status, report);
}

// Completes a call that never reached the backend.
void Drop(PendingCall& call, const absl::Status& status) {
  CallReport report;
  report.enqueued = call.enqueued;
  Complete(call, status, report);
}

}  // namespace

Batcher::Batcher(std::string pool, Op op, std::unique_ptr<Lane> lane, BatchingOptions options,
                 BatchObserver* observer)
    : pool_(std::move(pool)),
      op_(op),
      name_(absl::StrCat(pool_, "/", OpName(op))),
      lane_(std::move(lane)),
      options_(options),
      observer_(observer),
      thread_([this] { Loop(); }) {}

Batcher::~Batcher() { Stop(); }

absl::Status Batcher::Submit(std::unique_ptr<PendingCall> call) {
  absl::MutexLock lock(&mu_);
  if (stopping_) return absl::UnavailableError("the server is shutting down");
  if (static_cast<int>(queue_.size()) >= options_.max_queue_requests) {
    return absl::ResourceExhaustedError(absl::StrCat(
        name_, " queue is full (", options_.max_queue_requests, " calls); retry later"));
  }
  if (!queue_.empty() && queued_bytes_ + call->bytes > options_.max_queue_bytes) {
    return absl::ResourceExhaustedError(absl::StrCat(
        name_, " queue is full: its calls hold ", queued_bytes_, " bytes, this one ", call->bytes,
        ", the limit (max_queue_bytes) is ", options_.max_queue_bytes, "; retry later"));
  }
  queued_tokens_ += call->call.total_q;
  queued_bytes_ += call->bytes;
  queued_work_ += call->work;
  call->enqueued = absl::Now();
  queue_.push_back(std::move(call));
  return absl::OkStatus();
}

void Batcher::Stop() {
  {
    absl::MutexLock lock(&mu_);
    if (stopping_ && !thread_.joinable()) return;
    stopping_ = true;
  }
  if (thread_.joinable()) thread_.join();
}

int Batcher::queued() const {
  absl::MutexLock lock(&mu_);
  return static_cast<int>(queue_.size());
}

int64_t Batcher::launches() const {
  absl::MutexLock lock(&mu_);
  return launches_;
}

int Batcher::CancelQueued(const absl::Status& why) {
  absl::MutexLock lock(&mu_);
  return FailQueued(why);
}

absl::Duration Batcher::RetryHint() const {
  absl::MutexLock lock(&mu_);
  double per_work = seconds_per_work_;
  double elapsed = 0;
  if (running_work_ > 0) {
    elapsed = absl::ToDoubleSeconds(absl::Now() - running_since_);
    // The running launch has taken at least this long per unit so far.
    per_work = std::max(per_work, elapsed / static_cast<double>(running_work_));
  }
  const double ahead = static_cast<double>(queued_work_ + running_work_) * per_work - elapsed;
  return std::max(absl::Milliseconds(1), absl::Seconds(ahead));
}

bool Batcher::WaitForBatch() {
  mu_.Await(absl::Condition(this, &Batcher::HasWorkOrStop));
  if (queue_.empty()) return false;
  if (stopping_) return true;
  // Hold the oldest call at most max_queue_delay, less when a full batch is already queued.
  const absl::Time due = queue_.front()->enqueued + options_.max_queue_delay;
  // A timed wait whose deadline has already passed still sleeps (for the thread's timer slack,
  // 50 us by default): with no delay left, launch at once.
  if (absl::Now() >= due) return true;
  mu_.AwaitWithDeadline(absl::Condition(
                            +[](Batcher* b) ABSL_NO_THREAD_SAFETY_ANALYSIS {
                              return b->stopping_ ||
                                     static_cast<int>(b->queue_.size()) >=
                                         b->options_.max_batch_requests ||
                                     b->queued_tokens_ >= b->options_.max_batch_tokens;
                            },
                            this),
                        due);
  return true;
}

std::vector<std::unique_ptr<PendingCall>> Batcher::PopBatch() {
  std::vector<std::unique_ptr<PendingCall>> batch;
  int64_t tokens = 0;
  // The merged page table is indexed with int32 (kernels/attention.h): one call's fits (validation
  // bounds it), several large ones together might not.
  int64_t pages = 0;
  constexpr int64_t kMaxMergedPages = std::numeric_limits<int32_t>::max();
  // The work budget bounds a launch as it bounds a call: a lane is never held longer than one
  // budget's worth (or one call's, which admission bounded), however many calls merge.
  int64_t work = 0;
  while (!queue_.empty() && static_cast<int>(batch.size()) < options_.max_batch_requests) {
    PendingCall& next = *queue_.front();
    const int64_t next_pages = static_cast<int64_t>(next.call.kv_indices.size());
    if (!batch.empty() &&
        (!Mergeable(batch.front()->call, next.call) ||
         tokens + next.call.total_q > options_.max_batch_tokens ||
         pages + next_pages > kMaxMergedPages || work + next.work > options_.max_call_key_reads)) {
      break;
    }
    tokens += next.call.total_q;
    pages += next_pages;
    work += next.work;
    queued_tokens_ -= next.call.total_q;
    queued_bytes_ -= next.bytes;
    queued_work_ -= next.work;
    batch.push_back(std::move(queue_.front()));
    queue_.pop_front();
  }
  return batch;
}

int Batcher::FailQueued(const absl::Status& why) {
  const int n = static_cast<int>(queue_.size());
  for (std::unique_ptr<PendingCall>& p : queue_) Drop(*p, why);
  queue_.clear();
  queued_tokens_ = queued_bytes_ = queued_work_ = 0;
  return n;
}

bool Batcher::StaysIdle(absl::Duration how_long) {
  absl::MutexLock lock(&mu_);
  return !mu_.AwaitWithTimeout(absl::Condition(this, &Batcher::HasWorkOrStop), how_long);
}

void Batcher::Loop() {
  bool holding = false;  // a launch ran since the lane last gave back what it keeps
  for (;;) {
    if (holding && options_.idle_release > absl::ZeroDuration() &&
        StaysIdle(options_.idle_release)) {
      lane_->ReleaseIdle();
      holding = false;
    }
    std::vector<std::unique_ptr<PendingCall>> batch;
    {
      absl::MutexLock lock(&mu_);
      if (!WaitForBatch()) return;
      if (stopping_) {
        // What is still queued never reaches the backend.
        FailQueued(absl::UnavailableError("the server is shutting down"));
        return;
      }
      batch = PopBatch();
    }
    Launch(std::move(batch));
    holding = true;
  }
}

void Batcher::Launch(std::vector<std::unique_ptr<PendingCall>> batch) {
  const absl::Time now = absl::Now();
  std::vector<AttentionCall*> calls;
  std::vector<std::unique_ptr<PendingCall>> live;
  for (std::unique_ptr<PendingCall>& p : batch) {
    if (p->is_cancelled && p->is_cancelled()) {
      Drop(*p, absl::CancelledError("the client cancelled the call before it ran"));
    } else if (p->deadline <= now) {
      Drop(*p, absl::DeadlineExceededError("the deadline passed while the call was queued"));
    } else {
      calls.push_back(&p->call);
      live.push_back(std::move(p));
    }
  }
  if (calls.empty()) return;

  int tokens = 0;
  int64_t work = 0;
  absl::flat_hash_map<int64_t, int> per_session;  // calls of each session in the launch
  for (const auto& p : live) {
    tokens += p->call.total_q;
    work += p->work;
    ++per_session[p->session];
  }
  if (observer_) {
    for (const auto& p : live) observer_->OnQueueWait(pool_, op_, now - p->enqueued);
  }
  {
    absl::MutexLock lock(&mu_);
    running_work_ = std::max<int64_t>(work, 1);
    running_since_ = now;
  }
  absl::StatusOr<LaunchStats> stats = lane_->Run(absl::MakeConstSpan(calls));
  {
    absl::MutexLock lock(&mu_);
    ++launches_;
    const double per_work =
        absl::ToDoubleSeconds(absl::Now() - now) / static_cast<double>(running_work_);
    seconds_per_work_ =
        seconds_per_work_ == 0 ? per_work : 0.75 * seconds_per_work_ + 0.25 * per_work;
    running_work_ = 0;
  }
  if (stats.ok() && observer_) {
    observer_->OnLaunch(pool_, op_, static_cast<int>(calls.size()), tokens, *stats);
  }
  for (const auto& p : live) {
    CallReport report;
    report.enqueued = p->enqueued;
    report.launched = now;
    if (stats.ok()) report.launch = *stats;
    report.batch_requests = per_session[p->session];
    report.batch_tokens = tokens;
    Complete(*p, stats.ok() ? p->call.refused : stats.status(), report);
  }
}

}  // namespace attn
