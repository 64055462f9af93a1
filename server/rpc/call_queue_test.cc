// The slot protocol between CallQueueClient (client/cpp/) and CallQueueServer, over a real
// shared-memory segment mapped twice (as the server maps a caller's), with a handler standing in
// for the service. Hostile slot contents are written straight into the segment.
#include "server/rpc/call_queue.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <unistd.h>

#include <atomic>
#include <cstring>
#include <memory>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "absl/synchronization/mutex.h"
#include "absl/synchronization/notification.h"
#include "client/cpp/call_queue_client.h"
#include "gtest/gtest.h"
#include "proto/attnserve/v1/call_queue.h"
#include "server/backends/shared_memory.h"

namespace attn {
namespace {

namespace cq = ::attnserve::v1::call_queue;
using client::CallQueueClient;

constexpr SessionId kSession = 7;

// Calls the handler got, held until the test answers them (or answered at once when `echo`).
struct Calls {
  absl::Mutex mu;
  std::vector<std::unique_ptr<QueuedCall>> held ABSL_GUARDED_BY(mu);
  int taken ABSL_GUARDED_BY(mu) = 0;
  bool echo = true;

  void Take(std::unique_ptr<QueuedCall> call) {
    absl::MutexLock lock(&mu);
    ++taken;
    if (echo) {
      call->Finish(absl::OkStatus(), "echo:" + call->request());
    } else {
      held.push_back(std::move(call));
    }
  }
  void AwaitHeld(size_t n) {
    absl::MutexLock lock(&mu);
    want = n;
    mu.Await(absl::Condition(this, &Calls::Enough));
  }
  bool Enough() const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu) { return held.size() >= want; }
  size_t want ABSL_GUARDED_BY(mu) = 0;
  int Taken() {
    absl::MutexLock lock(&mu);
    return taken;
  }
};

class CallQueueTest : public ::testing::Test {
 protected:
  void Start(CallQueueOptions options = {}, CallQueueClient::Options client_options = {}) {
    std::string error;
    client_options.shm_prefix = "/attnserve-test";
    client_ = CallQueueClient::Create(client_options, &error);
    ASSERT_NE(client_, nullptr) << error;
    RegionSpec spec;
    spec.shm_name = client_->shm_name();
    spec.size = client_->size();
    spec.key = client_->key();
    absl::StatusOr<std::unique_ptr<SharedMemoryMapping>> mapped =
        MapSharedMemory(spec, "/attnserve-test");
    ASSERT_TRUE(mapped.ok()) << mapped.status();
    // The test's own view of the segment (the server's goes when the queue stops).
    const int fd = shm_open(spec.shm_name.c_str(), O_RDWR, 0);
    ASSERT_GE(fd, 0);
    void* view = mmap(nullptr, spec.size, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    close(fd);
    ASSERT_NE(view, MAP_FAILED);
    base_ = static_cast<char*>(view);
    view_bytes_ = spec.size;
    ASSERT_TRUE(table_.Reserve(kSession, "q", spec.size).ok());
    ASSERT_TRUE(table_.Commit(kSession, "q", *std::move(mapped)).ok());
    geometry_ = {client_options.slots, client_options.request_bytes, client_options.response_bytes};
    server_ = std::make_unique<CallQueueServer>(
        "q", geometry_, std::move(options),
        [this](std::unique_ptr<QueuedCall> call) { calls_.Take(std::move(call)); });
    CallQueueServer* q = server_.get();
    absl::StatusOr<RegionHold> hold = table_.Hold(
        kSession, "q", [q](RegionGone) { q->Stop(absl::FailedPreconditionError("unregistered")); });
    ASSERT_TRUE(hold.ok()) << hold.status();
    server_->Start(*std::move(hold));
  }

  void TearDown() override {
    server_.reset();
    if (base_ != nullptr) munmap(base_, view_bytes_);
  }

  // The server's view of slot i, to write what a hostile caller would.
  char* Slot(int i) {
    return base_ + cq::kSlots +
           i * cq::SlotStride(geometry_.request_bytes, geometry_.response_bytes);
  }
  // Publishes slot i as a caller would, with whatever header values are given.
  void Publish(int i, uint32_t method, uint32_t len, const std::string& bytes = "") {
    char* slot = Slot(i);
    std::memcpy(slot + cq::kSlotHeaderBytes, bytes.data(), bytes.size());
    cq::Word(slot, cq::kMethod).store(method);
    cq::Word(slot, cq::kRequestLen).store(len);
    cq::Word(slot, cq::kState).store(cq::kSubmitted);
    cq::Word(base_, cq::kDoorbell).fetch_add(1);
    cq::FutexWake(base_ + cq::kDoorbell, 1);
  }
  // Waits (without a time limit: a lost wake-up hangs the test) for slot i's answer.
  void AwaitDone(int i) {
    auto state = cq::Word(Slot(i), cq::kState);
    for (uint32_t v = state.load(); v != cq::kDone; v = state.load()) {
      cq::Word(Slot(i), cq::kClientWaiting).store(1);
      cq::FutexWait(Slot(i) + cq::kState, v, -1);
    }
  }
  int Status(int i) { return static_cast<int>(cq::Word(Slot(i), cq::kStatus).load()); }
  std::string Answer(int i) {
    return std::string(Slot(i) + cq::kSlotHeaderBytes + geometry_.request_bytes,
                       cq::Word(Slot(i), cq::kResponseLen).load());
  }

  RegionTable table_{RegionLimits{}};
  std::unique_ptr<CallQueueClient> client_;
  char* base_ = nullptr;
  size_t view_bytes_ = 0;
  CallQueueGeometry geometry_;
  Calls calls_;
  std::unique_ptr<CallQueueServer> server_;
};

TEST_F(CallQueueTest, CallsRoundTripThroughTheSlots) {
  Start();
  CallQueueClient::Answer a = client_->Call(cq::kDecode, "hello");
  EXPECT_EQ(a.code, 0);
  EXPECT_EQ(a.bytes, "echo:hello");
  // Concurrent callers take different slots.
  std::vector<std::thread> threads;
  std::atomic<int> good{0};
  for (int t = 0; t < 8; ++t) {
    threads.emplace_back([&, t] {
      for (int n = 0; n < 50; ++n) {
        const std::string req = std::to_string(t) + "/" + std::to_string(n);
        CallQueueClient::Answer got = client_->Call(cq::kPrefill, req);
        good += got.code == 0 && got.bytes == "echo:" + req;
      }
    });
  }
  for (auto& t : threads) t.join();
  EXPECT_EQ(good.load(), 400);
}

TEST_F(CallQueueTest, BadSlotContentsFailTheSlotNotTheServer) {
  Start();
  calls_.echo = true;
  // A state the protocol does not know: ignored.
  cq::Word(Slot(1), cq::kState).store(7);
  // A length past the request area, and a method that does not exist: answered, not handled.
  Publish(2, cq::kDecode, static_cast<uint32_t>(geometry_.request_bytes) + 1);
  AwaitDone(2);
  EXPECT_EQ(Status(2), static_cast<int>(absl::StatusCode::kInvalidArgument));
  EXPECT_NE(Answer(2).find("request_len"), std::string::npos) << Answer(2);
  Publish(3, 99, 4, "abcd");
  AwaitDone(3);
  EXPECT_EQ(Status(3), static_cast<int>(absl::StatusCode::kInvalidArgument));
  EXPECT_EQ(calls_.Taken(), 0);
  EXPECT_EQ(cq::Word(Slot(1), cq::kState).load(), 7u);
  // The queue still serves good calls (slot 0 is free).
  EXPECT_EQ(client_->Call(cq::kDecode, "ok").bytes, "echo:ok");
}

// The server copies the request before the handler sees it, and a caller flipping a slot back to
// kSubmitted while its call runs does not get it taken twice.
TEST_F(CallQueueTest, ARequestIsCopiedAndTakenOnce) {
  Start();
  calls_.echo = false;
  Publish(0, cq::kDecode, 8, "original");
  calls_.AwaitHeld(1);
  std::memcpy(Slot(0) + cq::kSlotHeaderBytes, "scribble", 8);
  cq::Word(Slot(0), cq::kState).store(cq::kSubmitted);
  Publish(1, cq::kDecode, 5, "other");
  calls_.AwaitHeld(2);  // slot 1 was taken after slot 0 was scanned again
  std::vector<std::unique_ptr<QueuedCall>> held;
  {
    absl::MutexLock lock(&calls_.mu);
    held.swap(calls_.held);
    EXPECT_EQ(calls_.taken, 2);
  }
  EXPECT_EQ(held[0]->request(), "original");
  held[0]->Finish(absl::OkStatus(), "done");
  held[1]->Finish(absl::OkStatus(), "done");
  AwaitDone(0);
  EXPECT_EQ(Answer(0), "done");
}

// A caller that never reads its answers leaves its slots kDone; the server serves the others
// and stops without waiting for it.
TEST_F(CallQueueTest, ACallerThatNeverReadsItsAnswerOnlyLosesItsSlot) {
  Start();
  Publish(0, cq::kDecode, 2, "hi");
  AwaitDone(0);
  Publish(1, cq::kDecode, 2, "ho");
  AwaitDone(1);
  EXPECT_EQ(client_->Call(cq::kDecode, "x").bytes, "echo:x");  // slots 2 and 3 remain
  server_.reset();                                             // joins: no wait on the unread slots
  EXPECT_TRUE(client_->closed());
}

// A call published in the window between the server's announcement that it sleeps and its
// sleep is not lost: the server sleeps without a time limit here, so a lost wake-up hangs the
// test. Once with the doorbell rung (the futex value moved), once without (the last scan).
TEST_F(CallQueueTest, ACallPublishedAsTheServerFallsAsleepIsServed) {
  CallQueueOptions options;
  options.spin = absl::ZeroDuration();
  options.max_sleep = absl::Hours(1);
  std::atomic<int> sleeps{0};
  options.before_sleep = [this, &sleeps] {
    const int n = ++sleeps;
    if (n == 1) Publish(0, cq::kDecode, 1, "a");  // rings the doorbell
    if (n == 2) {
      char* slot = Slot(1);
      cq::Word(slot, cq::kMethod).store(cq::kDecode);
      cq::Word(slot, cq::kRequestLen).store(1);
      cq::Word(slot, cq::kState).store(cq::kSubmitted);  // no ring: the last scan finds it
    }
  };
  Start(std::move(options));
  AwaitDone(0);
  EXPECT_EQ(Answer(0), "echo:a");
  // The thread announces its next sleep right after that answer; slot 1 comes in the window.
  AwaitDone(1);
  EXPECT_EQ(Status(1), 0);
}

// Unregistering stops the queue: slots still waiting are answered with the reason, the call in
// flight is answered when it ends, and OnStopped runs only after that.
TEST_F(CallQueueTest, UnregisteringAnswersWaitingSlotsAndWaitsForCallsInFlight) {
  Start();
  calls_.echo = false;
  Publish(0, cq::kDecode, 3, "run");
  calls_.AwaitHeld(1);
  absl::Notification stopped;
  server_->OnStopped([&] { stopped.Notify(); });
  ASSERT_TRUE(table_.Remove(kSession, "q").ok());  // the hold's on_gone stops the queue
  EXPECT_FALSE(stopped.HasBeenNotified());         // slot 0's call is still ours to answer
  std::unique_ptr<QueuedCall> call;
  {
    absl::MutexLock lock(&calls_.mu);
    call = std::move(calls_.held[0]);
  }
  call->Finish(absl::OkStatus(), "late");
  stopped.WaitForNotification();
  EXPECT_EQ(Answer(0), "late");
  EXPECT_TRUE(client_->closed());
  // A caller publishing after the close gets UNAVAILABLE from its own side.
  EXPECT_EQ(client_->Call(cq::kDecode, "after").code, 14);
}

// A caller's next call published in its slot as soon as the last answer is out, while the server
// still counts the slot as served, and the queue stopping in that window: the stop's first pass
// goes past the slot (a call in flight), and the slot must still be answered before the queue
// closes, not left kSubmitted for a caller that may wait without a timeout. A slot the caller
// set to kTaken itself (no call of the server in it) is answered too.
TEST_F(CallQueueTest, ANextCallPublishedAsTheLastAnswerGoesOutIsAnsweredAtStop) {
  CallQueueOptions options;
  options.spin = absl::ZeroDuration();
  std::atomic<bool> in_window{false};
  bool stopping = false;  // the queue's thread only
  options.before_sleep = [&] {
    if (!in_window.load() || std::exchange(stopping, true)) return;
    Publish(1, cq::kDecode, 1, "b");  // not scanned: the stop comes first
    server_->Stop(absl::UnavailableError("the call queue closed"));
  };
  std::atomic<int> answers_of_0{0};
  options.after_answer = [&](int slot) {
    if (slot != 0 || answers_of_0++ > 0) return;
    Publish(0, cq::kDecode, 4, "next");  // the caller's next call: scans skip it (in flight)
    in_window = true;
    AwaitDone(1);  // the stop's first pass answered slot 1: it went past slot 0
  };
  Start(std::move(options));
  calls_.echo = false;
  cq::Word(Slot(2), cq::kState).store(cq::kTaken);
  Publish(0, cq::kDecode, 5, "first");
  calls_.AwaitHeld(1);
  std::unique_ptr<QueuedCall> call;
  {
    absl::MutexLock lock(&calls_.mu);
    call = std::move(calls_.held[0]);
  }
  call->Finish(absl::OkStatus(), "answer");  // returns once the window above is over
  server_.reset();                           // joins the stopped thread
  EXPECT_EQ(calls_.Taken(), 1);
  for (int i : {0, 1, 2}) {
    EXPECT_EQ(cq::Word(Slot(i), cq::kState).load(), cq::kDone) << "slot " << i;
    EXPECT_EQ(Status(i), static_cast<int>(absl::StatusCode::kUnavailable)) << "slot " << i;
    EXPECT_EQ(Answer(i), "the call queue closed") << "slot " << i;
  }
  EXPECT_EQ(cq::Word(base_, cq::kClosed).load(), 1u);
}

TEST_F(CallQueueTest, TheCallersTimeoutBecomesTheDeadline) {
  Start();
  calls_.echo = false;
  std::thread caller([this] {
    CallQueueClient::Answer a = client_->Call(cq::kDecode, "t", std::chrono::seconds(30));
    EXPECT_EQ(a.code, 0);
  });
  calls_.AwaitHeld(1);
  std::unique_ptr<QueuedCall> call;
  {
    absl::MutexLock lock(&calls_.mu);
    call = std::move(calls_.held[0]);
  }
  EXPECT_GT(call->deadline(), call->taken() + absl::Seconds(29));
  EXPECT_LE(call->deadline(), call->taken() + absl::Seconds(30));
  EXPECT_FALSE(call->cancelled());
  call->Finish(absl::OkStatus(), "");
  caller.join();
}

TEST(CallQueueGeometryTest, LimitsAreChecked) {
  EXPECT_TRUE(CheckCallQueueGeometry({4, 1024, 1024}, 1 << 20).ok());
  EXPECT_FALSE(CheckCallQueueGeometry({0, 1024, 1024}, 1 << 20).ok());
  EXPECT_FALSE(CheckCallQueueGeometry({65, 1024, 1024}, 1 << 30).ok());
  EXPECT_FALSE(CheckCallQueueGeometry({4, 1000, 1024}, 1 << 20).ok());
  EXPECT_FALSE(CheckCallQueueGeometry({4, 128, 1024}, 1 << 20).ok());
  EXPECT_FALSE(CheckCallQueueGeometry({4, 1024, 1024}, 4096).ok());  // the slots do not fit
}

}  // namespace
}  // namespace attn
