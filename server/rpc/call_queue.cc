#include "server/rpc/call_queue.h"

#include <algorithm>
#include <cstring>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "proto/attnserve/v1/call_queue.h"

namespace attn {

namespace cq = ::attnserve::v1::call_queue;

absl::Status CheckCallQueueGeometry(const CallQueueGeometry& g, int64_t region_bytes) {
  if (g.slots < 1 || g.slots > cq::kMaxSlots) {
    return absl::InvalidArgumentError(
        absl::StrCat("call_queue.slots = ", g.slots, " is outside [1, ", cq::kMaxSlots, "]"));
  }
  for (const auto& [field, bytes] : {std::pair<const char*, int>{"request_bytes", g.request_bytes},
                                     {"response_bytes", g.response_bytes}}) {
    if (bytes < cq::kMinAreaBytes || bytes > cq::kMaxAreaBytes || bytes % cq::kAreaAlignment) {
      return absl::InvalidArgumentError(absl::StrCat(
          "call_queue.", field, " = ", bytes, " must be a multiple of ", cq::kAreaAlignment,
          " in [", cq::kMinAreaBytes, ", ", cq::kMaxAreaBytes, "]"));
    }
  }
  const size_t need = cq::SegmentBytes(g.slots, g.request_bytes, g.response_bytes);
  if (region_bytes < 0 || static_cast<size_t>(region_bytes) < need) {
    return absl::InvalidArgumentError(absl::StrCat("size = ", region_bytes, " is below the ", need,
                                                   " bytes the call queue's slots take"));
  }
  return absl::OkStatus();
}

RegistrationFields RegistrationFieldsOf(const CallQueueGeometry& g) {
  return {{"call_queue", "set"},
          {"call_queue.slots", absl::StrCat(g.slots)},
          {"call_queue.request_bytes", absl::StrCat(g.request_bytes)},
          {"call_queue.response_bytes", absl::StrCat(g.response_bytes)}};
}

// What the queue's thread and its calls share. The segment stays mapped while any call is in
// flight (the thread waits for them before it lets the region go).
struct QueuedCall::Shared {
  char* base = nullptr;
  CallQueueGeometry geometry;
  std::unique_ptr<std::atomic<bool>[]> serving;  // per slot: a call of it is in flight
  absl::Mutex mu;
  int in_flight ABSL_GUARDED_BY(mu) = 0;
  // Server-private wake-ups of the thread (an answer written: poll again for the caller's next
  // call). Kept out of the segment, where the caller could clear them.
  std::atomic<uint32_t> answers{0};
  std::atomic<bool> sleeping{false};
  std::atomic<bool> stop{false};
  std::function<void(int)> after_answer;  // CallQueueOptions::after_answer

  char* slot(int i) const {
    return base + cq::kSlots +
           static_cast<size_t>(i) * cq::SlotStride(geometry.request_bytes, geometry.response_bytes);
  }
  // Wakes the thread if it sleeps (or is about to): the doorbell moves so its wait returns.
  void WakeThread() {
    if (sleeping.load(std::memory_order_seq_cst)) {
      cq::Word(base, cq::kDoorbell).fetch_add(1, std::memory_order_seq_cst);
      cq::FutexWake(base + cq::kDoorbell, 1);
    }
  }
};

QueuedCall::~QueuedCall() {
  if (!finished_) Finish(absl::InternalError("the call was dropped without an answer"));
}

bool QueuedCall::cancelled() const {
  return cq::Word(queue_->slot(slot_), cq::kCancel).load(std::memory_order_relaxed) != 0;
}

size_t QueuedCall::response_capacity() const {
  return static_cast<size_t>(queue_->geometry.response_bytes);
}

void QueuedCall::Finish(const absl::Status& status, const std::string& response,
                        absl::Duration retry_after) {
  if (finished_) return;
  finished_ = true;
  Shared& q = *queue_;
  char* slot = q.slot(slot_);
  char* area = slot + cq::kSlotHeaderBytes + q.geometry.request_bytes;
  absl::Status st = status;
  if (st.ok() && response.size() > response_capacity()) {
    st = absl::InternalError(absl::StrCat("the response (", response.size(),
                                          " bytes) does not fit the slot's ", response_capacity()));
  }
  std::string message;
  const std::string* body = &response;
  if (!st.ok()) {
    message =
        std::string(st.message().substr(0, std::min(cq::kMaxMessageBytes, response_capacity())));
    body = &message;
  }
  std::memcpy(area, body->data(), body->size());
  cq::Word(slot, cq::kStatus).store(static_cast<uint32_t>(st.code()), std::memory_order_relaxed);
  cq::Word(slot, cq::kResponseLen)
      .store(static_cast<uint32_t>(body->size()), std::memory_order_relaxed);
  const int64_t retry_ms = absl::ToInt64Milliseconds(retry_after);
  cq::Word(slot, cq::kRetryAfterMs)
      .store(static_cast<uint32_t>(std::clamp<int64_t>(retry_ms, 0, UINT32_MAX)),
             std::memory_order_relaxed);
  // Publishes the answer (the stores above happen before it), then wakes a sleeping caller.
  cq::Word(slot, cq::kState).store(cq::kDone, std::memory_order_seq_cst);
  if (cq::Word(slot, cq::kClientWaiting).load(std::memory_order_seq_cst) != 0) {
    cq::FutexWake(slot + cq::kState, INT32_MAX);
  }
  if (q.after_answer) q.after_answer(slot_);
  // From here the slot may be taken again (a caller may have published its next call already).
  q.serving[slot_].store(false, std::memory_order_release);
  q.answers.fetch_add(1, std::memory_order_seq_cst);
  q.WakeThread();
  // Last: once the count reaches 0 the thread may let the segment go.
  absl::MutexLock lock(&q.mu);
  --q.in_flight;
}

CallQueueServer::CallQueueServer(std::string name, CallQueueGeometry geometry,
                                 CallQueueOptions options, Handler handler)
    : name_(std::move(name)),
      geometry_(geometry),
      options_(std::move(options)),
      handler_(std::move(handler)),
      shared_(std::make_shared<QueuedCall::Shared>()) {
  shared_->geometry = geometry_;
  shared_->after_answer = options_.after_answer;
  shared_->serving = std::make_unique<std::atomic<bool>[]>(geometry_.slots);
  for (int i = 0; i < geometry_.slots; ++i) shared_->serving[i].store(false);
}

CallQueueServer::~CallQueueServer() {
  Stop(absl::UnavailableError("the server is shutting down"));
  if (thread_.joinable()) thread_.join();
}

void CallQueueServer::Start(RegionHold hold) {
  hold_ = std::move(hold);
  shared_->base = hold_.data();
  {
    absl::MutexLock lock(&why_mu_);
    mapped_ = true;
  }
  thread_ = std::thread([this] { Loop(); });
}

void CallQueueServer::Stop(const absl::Status& why) {
  absl::MutexLock lock(&why_mu_);
  if (why_.ok()) why_ = why.ok() ? absl::UnavailableError("the call queue stopped") : why;
  shared_->stop.store(true, std::memory_order_seq_cst);
  if (mapped_) {
    cq::Word(shared_->base, cq::kDoorbell).fetch_add(1, std::memory_order_seq_cst);
    cq::FutexWake(shared_->base + cq::kDoorbell, 1);
  }
}

void CallQueueServer::OnStopped(std::function<void()> f) {
  {
    absl::MutexLock lock(&mu_);
    if (!stopped_) {
      on_stopped_.push_back(std::move(f));
      return;
    }
  }
  f();
}

bool CallQueueServer::stopped() const {
  absl::MutexLock lock(&mu_);
  return stopped_;
}

bool CallQueueServer::Scan() {
  bool took = false;
  for (int i = 0; i < geometry_.slots; ++i) {
    if (shared_->serving[i].load(std::memory_order_acquire)) continue;
    auto state = cq::Word(shared_->slot(i), cq::kState);
    uint32_t expected = cq::kSubmitted;
    if (state.load(std::memory_order_seq_cst) != cq::kSubmitted) continue;
    if (!state.compare_exchange_strong(expected, cq::kTaken, std::memory_order_seq_cst)) continue;
    Take(i);
    took = true;
  }
  return took;
}

std::unique_ptr<QueuedCall> CallQueueServer::Claim(int i) {
  shared_->serving[i].store(true, std::memory_order_relaxed);
  {
    absl::MutexLock lock(&shared_->mu);
    ++shared_->in_flight;
  }
  return std::unique_ptr<QueuedCall>(new QueuedCall(shared_, i));
}

void CallQueueServer::Take(int i) {
  std::unique_ptr<QueuedCall> call = Claim(i);
  char* slot = shared_->slot(i);
  // Each word once, into our own copy: the caller may change them at any moment from here on.
  call->method_ = cq::Word(slot, cq::kMethod).load(std::memory_order_relaxed);
  const uint32_t len = cq::Word(slot, cq::kRequestLen).load(std::memory_order_relaxed);
  const int64_t timeout_us = cq::Word64(slot, cq::kTimeoutUs).load(std::memory_order_relaxed);
  call->taken_ = absl::Now();
  if (len > static_cast<uint32_t>(geometry_.request_bytes)) {
    return call->Finish(absl::InvalidArgumentError(
        absl::StrCat("request_len = ", len, " is past the slot's request area of ",
                     geometry_.request_bytes, " bytes")));
  }
  if (call->method_ != cq::kDecode && call->method_ != cq::kPrefill) {
    return call->Finish(absl::InvalidArgumentError(
        absl::StrCat("method = ", call->method_, ": expected ", cq::kDecode, " (Decode) or ",
                     cq::kPrefill, " (Prefill)")));
  }
  if (timeout_us < 0) {
    return call->Finish(absl::InvalidArgumentError(
        absl::StrCat("timeout_us = ", timeout_us, " must not be negative (0: none)")));
  }
  if (timeout_us > 0) call->deadline_ = call->taken_ + absl::Microseconds(timeout_us);
  call->request_.assign(slot + cq::kSlotHeaderBytes, len);
  handler_(std::move(call));
}

void CallQueueServer::Loop() {
  QueuedCall::Shared& q = *shared_;
  char* const base = q.base;
  absl::Time spin_until = absl::Now() + options_.spin;
  uint32_t answers_seen = q.answers.load();
  while (!q.stop.load(std::memory_order_acquire)) {
    if (hold_.broken()) {
      Stop(absl::FailedPreconditionError(
          absl::StrCat("call queue '", name_,
                       "': its memory went away (the shared-memory object was "
                       "truncated)")));
      break;
    }
    if (Scan()) {
      spin_until = absl::Now() + options_.spin;
      continue;
    }
    if (const uint32_t a = q.answers.load(std::memory_order_seq_cst); a != answers_seen) {
      answers_seen = a;  // an answer went out: the caller's next call comes soon
      spin_until = absl::Now() + options_.spin;
    }
    if (absl::Now() < spin_until) {
#if defined(__x86_64__)
      __builtin_ia32_pause();
#endif
      continue;
    }
    // Sleep: announce it, look once more, then wait on the doorbell value read before the
    // announcement (call_queue.h, "Ordering").
    const uint32_t bell = cq::Word(base, cq::kDoorbell).load(std::memory_order_seq_cst);
    q.sleeping.store(true, std::memory_order_seq_cst);
    cq::Word(base, cq::kServerSleeping).store(1, std::memory_order_seq_cst);
    if (options_.before_sleep) options_.before_sleep();
    const bool quiet = !q.stop.load(std::memory_order_seq_cst) &&
                       q.answers.load(std::memory_order_seq_cst) == answers_seen && !Scan();
    if (quiet) {
      cq::FutexWait(base + cq::kDoorbell, bell, absl::ToInt64Nanoseconds(options_.max_sleep));
    }
    cq::Word(base, cq::kServerSleeping).store(0, std::memory_order_seq_cst);
    q.sleeping.store(false, std::memory_order_seq_cst);
    // Woken by a call, an answer or a stop: poll again. A timeout with nothing to do sleeps
    // again at once.
    if (cq::Word(base, cq::kDoorbell).load(std::memory_order_relaxed) != bell || !quiet) {
      spin_until = absl::Now() + options_.spin;
    }
  }
  Shutdown();
}

void CallQueueServer::AnswerWaiting(const absl::Status& why) {
  QueuedCall::Shared& q = *shared_;
  for (int i = 0; i < geometry_.slots; ++i) {
    if (q.serving[i].load(std::memory_order_acquire)) continue;
    // kSubmitted: published and not taken. kTaken on a slot with no call in flight can only be
    // the caller's own write (Finish stores kDone before it frees the slot); a caller waiting on
    // it is told too.
    auto state = cq::Word(q.slot(i), cq::kState);
    uint32_t expected = state.load(std::memory_order_seq_cst);
    if (expected != cq::kSubmitted && expected != cq::kTaken) continue;
    if (state.compare_exchange_strong(expected, cq::kTaken, std::memory_order_seq_cst)) {
      Claim(i)->Finish(why);
    }
  }
}

void CallQueueServer::Shutdown() {
  QueuedCall::Shared& q = *shared_;
  absl::Status why;
  {
    absl::MutexLock lock(&why_mu_);
    why = why_;
  }
  if (why.ok()) why = absl::UnavailableError("the call queue stopped");
  cq::Word(q.base, cq::kClosed).store(1, std::memory_order_seq_cst);
  // Slots still waiting get the reason; calls in flight end as they would have.
  AnswerWaiting(why);
  {
    absl::MutexLock lock(&q.mu);
    q.mu.Await(absl::Condition(
        +[](QueuedCall::Shared* s) ABSL_NO_THREAD_SAFETY_ANALYSIS { return s->in_flight == 0; },
        &q));
  }
  // Again, now that no call is in flight: the pass above skipped the slots it found in flight,
  // and a caller may have published its next call into one of them as soon as its answer was
  // out (before Finish freed the slot). A call published after this pass is the caller's to
  // take back: `closed` is set.
  AnswerWaiting(why);
  // A caller sleeping on a slot that will never be answered (it was never submitted) learns
  // of the close when it wakes.
  for (int i = 0; i < geometry_.slots; ++i) cq::FutexWake(q.slot(i) + cq::kState, INT32_MAX);
  {
    absl::MutexLock lock(&why_mu_);
    mapped_ = false;
  }
  hold_.Reset();  // the region may be unmapped here
  std::vector<std::function<void()>> callbacks;
  {
    absl::MutexLock lock(&mu_);
    stopped_ = true;
    callbacks.swap(on_stopped_);
  }
  for (auto& f : callbacks) f();
}

// --- CallQueues

CallQueues::~CallQueues() { StopAll(absl::UnavailableError("the server is shutting down")); }

absl::Status CallQueues::Reserve(const std::string& session, const std::string& name) {
  Reap();
  absl::MutexLock lock(&mu_);
  if (queues_.contains(Key(session, name))) {
    return absl::AlreadyExistsError(
        absl::StrCat("the session already has a call queue '", name, "'"));
  }
  int of_session = 0;
  for (const auto& [key, queue] : queues_) of_session += key.first == session;
  if (of_session >= max_per_session_) {
    return absl::ResourceExhaustedError(absl::StrCat(
        "the session has ", of_session, " call queues; the server allows ", max_per_session_));
  }
  if (static_cast<int>(queues_.size()) >= max_queues_) {
    return absl::ResourceExhaustedError(absl::StrCat("the server serves ", queues_.size(),
                                                     " call queues, its most (max_call_queues)"));
  }
  queues_.emplace(Key(session, name), nullptr);
  return absl::OkStatus();
}

void CallQueues::Commit(const std::string& session, const std::string& name,
                        std::unique_ptr<CallQueueServer> queue) {
  absl::MutexLock lock(&mu_);
  queues_[Key(session, name)] = std::move(queue);
}

void CallQueues::Abandon(const std::string& session, const std::string& name) {
  absl::MutexLock lock(&mu_);
  auto it = queues_.find(Key(session, name));
  if (it != queues_.end() && it->second == nullptr) queues_.erase(it);
}

void CallQueues::WhenStopped(const std::string& session, const std::string& name,
                             std::function<void()> f) {
  {
    absl::MutexLock lock(&mu_);
    auto it = queues_.find(Key(session, name));
    if (it != queues_.end() && it->second != nullptr) {
      it->second->OnStopped(std::move(f));
      return;
    }
  }
  f();
}

void CallQueues::StopAll(const absl::Status& why) {
  absl::flat_hash_map<Key, std::unique_ptr<CallQueueServer>> all;
  {
    absl::MutexLock lock(&mu_);
    for (auto& [key, queue] : queues_) {
      if (queue != nullptr) all.emplace(key, std::move(queue));
    }
    absl::erase_if(queues_, [](const auto& kv) { return kv.second == nullptr; });
  }
  for (auto& [key, queue] : all) queue->Stop(why);
  all.clear();  // joins
}

void CallQueues::Reap() {
  std::vector<std::unique_ptr<CallQueueServer>> done;
  {
    absl::MutexLock lock(&mu_);
    for (auto it = queues_.begin(); it != queues_.end();) {
      if (it->second != nullptr && it->second->stopped()) {
        done.push_back(std::move(it->second));
        queues_.erase(it++);
      } else {
        ++it;
      }
    }
  }
  done.clear();  // joins the finished threads
}

int CallQueues::size() const {
  absl::MutexLock lock(&mu_);
  return static_cast<int>(queues_.size());
}

}  // namespace attn
