#include "client/cpp/call_queue_client.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <unistd.h>

#include <cstring>
#include <string>
#include <thread>

#include "gtest/gtest.h"
#include "proto/attnserve/v1/call_queue.h"

namespace attn::client {
namespace {

namespace cq = ::attnserve::v1::call_queue;
using std::chrono::microseconds;
using std::chrono::milliseconds;
using std::chrono::nanoseconds;
using std::chrono::seconds;

TEST(CallTimesTest, LearnsEachShapeOnItsOwn) {
  CallTimes times;
  EXPECT_EQ(times.Expected(cq::kDecode, 100).count(), 0);
  times.Record(cq::kDecode, 100, microseconds(1000));
  EXPECT_EQ(times.Expected(cq::kDecode, 100), microseconds(1000));
  // An eighth of the way to each new time.
  times.Record(cq::kDecode, 100, microseconds(1800));
  EXPECT_EQ(times.Expected(cq::kDecode, 100), microseconds(1100));
  // Another size or method is another shape.
  EXPECT_EQ(times.Expected(cq::kDecode, 101).count(), 0);
  EXPECT_EQ(times.Expected(cq::kPrefill, 100).count(), 0);
}

TEST(CallTimesTest, ForgetsTheShapeUsedLeastRecently) {
  CallTimes times;
  for (int i = 0; i < CallTimes::kShapes; ++i) times.Record(cq::kDecode, i, microseconds(10 + i));
  times.Record(cq::kDecode, 0, microseconds(10));   // shape 0 is now the most recent
  times.Record(cq::kPrefill, 0, microseconds(99));  // takes shape 1's place
  EXPECT_EQ(times.Expected(cq::kDecode, 0), microseconds(10));
  EXPECT_EQ(times.Expected(cq::kDecode, 1).count(), 0);
  EXPECT_EQ(times.Expected(cq::kDecode, 2), microseconds(12));
  EXPECT_EQ(times.Expected(cq::kPrefill, 0), microseconds(99));
}

TEST(CallTimesTest, SleepsThroughAllButAMarginOfLongCalls) {
  const nanoseconds spin = microseconds(200);
  // Calls the spin window covers, or unknown ones, are polled from the start.
  EXPECT_EQ(CallTimes::SleepBeforePolling(nanoseconds(0), spin).count(), 0);
  EXPECT_EQ(CallTimes::SleepBeforePolling(microseconds(150), spin).count(), 0);
  EXPECT_EQ(CallTimes::SleepBeforePolling(microseconds(200), spin).count(), 0);
  // Longer ones keep max(spin, a quarter) for polling.
  EXPECT_EQ(CallTimes::SleepBeforePolling(microseconds(300), spin), microseconds(100));
  EXPECT_EQ(CallTimes::SleepBeforePolling(microseconds(1200), spin), microseconds(900));
  // A caller that never polls never sleeps to poll.
  EXPECT_EQ(CallTimes::SleepBeforePolling(microseconds(1200), nanoseconds(0)).count(), 0);
}

// The server's side of one slot, played by a thread of the test over the client's segment.
class FakeServer {
 public:
  explicit FakeServer(const CallQueueClient& q) : bytes_(static_cast<size_t>(q.size())) {
    const int fd = shm_open(q.shm_name().c_str(), O_RDWR, 0);
    EXPECT_GE(fd, 0);
    base_ = static_cast<char*>(mmap(nullptr, bytes_, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0));
    close(fd);
    EXPECT_NE(base_, MAP_FAILED);
    slot_ = base_ + cq::kSlots;
  }
  ~FakeServer() { munmap(base_, bytes_); }

  // Waits for a submitted call whose caller announced that it sleeps, then answers it.
  void AnswerOnceTheCallerSleeps(int request_bytes) {
    auto state = cq::Word(slot_, cq::kState);
    while (state.load() != cq::kSubmitted || cq::Word(slot_, cq::kClientWaiting).load() == 0) {
      std::this_thread::yield();
    }
    state.store(cq::kTaken);
    char* area = slot_ + cq::kSlotHeaderBytes + request_bytes;
    std::memcpy(area, "ok", 2);
    cq::Word(slot_, cq::kStatus).store(0);
    cq::Word(slot_, cq::kResponseLen).store(2);
    state.store(cq::kDone, std::memory_order_seq_cst);
    if (cq::Word(slot_, cq::kClientWaiting).load(std::memory_order_seq_cst) != 0) {
      cq::FutexWake(slot_ + cq::kState, 1);
    }
  }

 private:
  size_t bytes_;
  char* base_ = nullptr;
  char* slot_ = nullptr;
};

CallQueueClient::Options OneSlot() {
  CallQueueClient::Options options;
  options.slots = 1;
  options.request_bytes = 4096;
  options.response_bytes = 4096;
  options.spin = microseconds(50);
  return options;
}

constexpr char kRequest[] = "request";

// One call of `method` whose answer the fake server sends once the caller sleeps.
CallQueueClient::Answer CallAnsweredOnceTheCallerSleeps(CallQueueClient& q, uint32_t method) {
  FakeServer server(q);
  std::thread answer([&] { server.AnswerOnceTheCallerSleeps(q.options().request_bytes); });
  CallQueueClient::Answer a = q.Call(method, kRequest, seconds(30));
  answer.join();
  return a;
}

// A caller sleeping through the expected time of a long call says so in the slot, so an answer
// that lands early wakes it: with the wake-up missed, this call would sleep past its timeout.
TEST(CallQueueClientTest, AnAnswerBeforeTheExpectedTimeWakesTheCaller) {
  std::string error;
  auto q = CallQueueClient::Create(OneSlot(), &error);
  ASSERT_NE(q, nullptr) << error;
  q->call_times().Record(cq::kDecode, sizeof(kRequest) - 1, seconds(600));
  const CallQueueClient::Answer a = CallAnsweredOnceTheCallerSleeps(*q, cq::kDecode);
  EXPECT_EQ(a.code, 0) << a.bytes;
  EXPECT_EQ(a.bytes, "ok");
}

TEST(CallQueueClientTest, LearnsTheTimeOfEachAnsweredShape) {
  std::string error;
  auto q = CallQueueClient::Create(OneSlot(), &error);
  ASSERT_NE(q, nullptr) << error;
  const CallQueueClient::Answer a = CallAnsweredOnceTheCallerSleeps(*q, cq::kPrefill);
  ASSERT_EQ(a.code, 0) << a.bytes;
  EXPECT_GT(q->call_times().Expected(cq::kPrefill, sizeof(kRequest) - 1).count(), 0);
  EXPECT_EQ(q->call_times().Expected(cq::kDecode, sizeof(kRequest) - 1).count(), 0);
}

TEST(CallQueueClientTest, WithoutPredictionTheCallerPollsThenSleeps) {
  std::string error;
  CallQueueClient::Options options = OneSlot();
  options.predict = false;
  auto q = CallQueueClient::Create(options, &error);
  ASSERT_NE(q, nullptr) << error;
  q->call_times().Record(cq::kDecode, sizeof(kRequest) - 1, seconds(600));
  const CallQueueClient::Answer a = CallAnsweredOnceTheCallerSleeps(*q, cq::kDecode);
  EXPECT_EQ(a.code, 0) << a.bytes;
}

}  // namespace
}  // namespace attn::client
