// Call queues through the real AttentionServiceImpl (in-process gRPC for the control plane,
// client/cpp's CallQueueClient for the calls) over an Engine with the CPU backend: calls over
// a queue answer what the RPCs answer, with the same codes, and the queue goes with its session.
// Launches can be held at a gate, so "a call in flight" is a state the test waits for, not a race.
#include <fcntl.h>
#include <sys/mman.h>
#include <unistd.h>

#include <cmath>
#include <cstring>
#include <memory>
#include <string>
#include <thread>
#include <tuple>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "absl/synchronization/notification.h"
#include "attnserve/v1/attention.grpc.pb.h"
#include "client/cpp/call_queue_client.h"
#include "grpcpp/grpcpp.h"
#include "gtest/gtest.h"
#include "kernels/bf16.h"
#include "proto/attnserve/v1/call_queue.h"
#include "server/backends/cpu_backend.h"
#include "server/backends/shared_memory.h"
#include "server/rpc/service.h"
#include "server/rpc/test_tensors.h"

namespace attn {
namespace {

namespace cq = ::attnserve::v1::call_queue;
using client::CallQueueClient;
using ::grpc::StatusCode;

constexpr int kPages = 16;
constexpr int kHeads = 4, kKvHeads = 2, kDim = 64;

// Holds every launch while closed.
struct Gate {
  absl::Mutex mu;
  bool hold ABSL_GUARDED_BY(mu) = false;
  int running ABSL_GUARDED_BY(mu) = 0;
  void Hold(bool h) {
    absl::MutexLock lock(&mu);
    hold = h;
  }
  void AwaitRunning() {
    absl::MutexLock lock(&mu);
    mu.Await(absl::Condition(
        +[](Gate* g) ABSL_NO_THREAD_SAFETY_ANALYSIS { return g->running > 0; }, this));
  }
};

class GatedLane final : public Lane {
 public:
  GatedLane(std::unique_ptr<Lane> inner, Gate* gate) : inner_(std::move(inner)), gate_(gate) {}
  absl::StatusOr<LaunchStats> Run(absl::Span<AttentionCall* const> calls) override {
    {
      absl::MutexLock lock(&gate_->mu);
      ++gate_->running;
      gate_->mu.Await(absl::Condition(
          +[](Gate* g) ABSL_NO_THREAD_SAFETY_ANALYSIS { return !g->hold; }, gate_));
      --gate_->running;
    }
    return inner_->Run(calls);
  }

 private:
  std::unique_ptr<Lane> inner_;
  Gate* gate_;
};

class GatedBackend final : public Backend {
 public:
  GatedBackend(std::unique_ptr<Backend> inner, Gate* gate)
      : inner_(std::move(inner)), gate_(gate) {}
  std::string name() const override { return inner_->name(); }
  std::string device() const override { return inner_->device(); }
  bool ChecksFiniteInputs() const override { return inner_->ChecksFiniteInputs(); }
  absl::Status AddPool(const PoolGeometry& g) override { return inner_->AddPool(g); }
  absl::StatusOr<std::unique_ptr<Lane>> CreateLane(int pool, Op op) override {
    absl::StatusOr<std::unique_ptr<Lane>> lane = inner_->CreateLane(pool, op);
    if (!lane.ok()) return lane.status();
    return std::unique_ptr<Lane>(new GatedLane(*std::move(lane), gate_));
  }
  absl::StatusOr<std::unique_ptr<MappedMemory>> MapRegion(const RegionSpec& spec,
                                                          absl::string_view prefix) override {
    return inner_->MapRegion(spec, prefix);
  }
  absl::Status ScrubPages(int pool, absl::Span<const int32_t> pages) override {
    return inner_->ScrubPages(pool, pages);
  }

 private:
  std::unique_ptr<Backend> inner_;
  Gate* gate_;
};

// Appends token 0 (k = 1, v = 1.5) to `page` and attends over it: every output element is 1.5.
v1::DecodeRequest DecodeOnto(int32_t page, const std::string& session) {
  v1::DecodeRequest r;
  r.set_pool("gqa");
  r.set_session(session);
  FillBf16(r.mutable_q(), {1, kHeads, kDim}, 0.5f);
  FillBf16(r.mutable_k_new(), {1, kKvHeads, kDim}, 1.f);
  FillBf16(r.mutable_v_new(), {1, kKvHeads, kDim}, 1.5f);
  r.add_kv_indptr(0);
  r.add_kv_indptr(1);
  r.add_kv_indices(page);
  r.add_kv_last_page_len(1);
  r.set_return_lse(true);
  return r;
}

class CallQueueServiceTest : public ::testing::Test {
 protected:
  void SetUp() override { Start({}); }
  void TearDown() override { Stop(); }

  void Start(const std::vector<v1::AccessToken>& tokens, int per_session = 4) {
    Stop();
    metrics_ = std::make_unique<Metrics>(kVersion, "cpu", "test");
    SessionOptions sessions;
    sessions.default_lease = absl::Minutes(10);
    DataPlaneOptions plane;
    plane.shared_memory = true;
    plane.max_call_queues_per_session = per_session;
    auto engine = Engine::Create(std::make_unique<GatedBackend>(CreateCpuBackend(1), &gate_),
                                 {PoolGeometry::Gqa("gqa", 2, 4, kHeads, kKvHeads, kDim, kPages)},
                                 BatchingOptions{}, sessions, /*epoch=*/0x5e, metrics_.get(),
                                 metrics_.get(), plane);
    ASSERT_TRUE(engine.ok()) << engine.status();
    engine_ = *std::move(engine);
    absl::StatusOr<Authorizer> auth = Authorizer::Create(tokens);
    ASSERT_TRUE(auth.ok()) << auth.status();
    auth_ = std::make_unique<Authorizer>(*std::move(auth));
    service_ = std::make_unique<AttentionServiceImpl>(engine_.get(), metrics_.get(), auth_.get(),
                                                      int64_t{64} << 20);
    grpc::ServerBuilder builder;
    builder.RegisterService(service_.get());
    server_ = builder.BuildAndStart();
    ASSERT_NE(server_, nullptr);
    stub_ = v1::AttentionService::NewStub(server_->InProcessChannel(grpc::ChannelArguments()));
  }
  void Stop() {
    gate_.Hold(false);
    if (server_) server_->Shutdown();
    server_.reset();
    service_.reset();
    engine_.reset();
  }

  void Authorize(grpc::ClientContext* ctx, const std::string& token) {
    if (!token.empty()) ctx->AddMetadata("authorization", "Bearer " + token);
  }
  std::string OpenSession(const std::string& token = "") {
    grpc::ClientContext ctx;
    Authorize(&ctx, token);
    v1::OpenSessionResponse resp;
    EXPECT_TRUE(stub_->OpenSession(&ctx, v1::OpenSessionRequest(), &resp).ok());
    return resp.session();
  }
  int32_t AllocatePage(const std::string& session, const std::string& token = "") {
    grpc::ClientContext ctx;
    Authorize(&ctx, token);
    v1::AllocatePagesRequest req;
    req.set_pool("gqa");
    req.set_session(session);
    req.set_num_pages(1);
    v1::AllocatePagesResponse resp;
    EXPECT_TRUE(stub_->AllocatePages(&ctx, req, &resp).ok());
    return resp.page_ids_size() == 1 ? resp.page_ids(0) : -1;
  }
  // A queue registered for `session` under `name`; nullptr and *status on failure.
  // What registers `queue` as the session's queue `name`.
  static v1::RegisterRegionRequest RegistrationOf(const CallQueueClient& queue,
                                                  const std::string& session,
                                                  const std::string& name) {
    v1::RegisterRegionRequest req;
    req.set_name(name);
    req.set_session(session);
    req.mutable_shared_memory()->set_shm_name(queue.shm_name());
    req.set_size(queue.size());
    req.set_key(queue.key());
    req.mutable_call_queue()->set_slots(queue.options().slots);
    req.mutable_call_queue()->set_request_bytes(queue.options().request_bytes);
    req.mutable_call_queue()->set_response_bytes(queue.options().response_bytes);
    return req;
  }
  grpc::Status SendRegistration(const v1::RegisterRegionRequest& req,
                                v1::RegisterRegionResponse* resp, const std::string& token = "") {
    grpc::ClientContext ctx;
    Authorize(&ctx, token);
    return stub_->RegisterRegion(&ctx, req, resp);
  }
  // The segment's name stays until the queue's Unlink when `unlink` is false.
  std::unique_ptr<CallQueueClient> Register(const std::string& session, const std::string& name,
                                            grpc::Status* status = nullptr,
                                            const std::string& token = "", bool unlink = true) {
    std::string error;
    auto queue = CallQueueClient::Create({}, &error);
    EXPECT_NE(queue, nullptr) << error;
    v1::RegisterRegionResponse resp;
    const grpc::Status st = SendRegistration(RegistrationOf(*queue, session, name), &resp, token);
    if (status != nullptr) *status = st;
    if (!st.ok()) return nullptr;
    EXPECT_TRUE(resp.region().call_queue());
    if (unlink) queue->Unlink();
    return queue;
  }
  grpc::Status Unregister(const std::string& session, const std::string& name) {
    grpc::ClientContext ctx;
    v1::UnregisterRegionRequest req;
    req.set_session(session);
    req.set_name(name);
    v1::UnregisterRegionResponse resp;
    return stub_->UnregisterRegion(&ctx, req, &resp);
  }
  // A decode through the queue: its code, and the response when OK.
  int QueueDecode(CallQueueClient& q, const v1::DecodeRequest& req,
                  v1::AttentionResponse* resp = nullptr) {
    CallQueueClient::Answer a = q.Call(cq::kDecode, req.SerializeAsString());
    if (a.code == 0 && resp != nullptr) {
      EXPECT_TRUE(resp->ParseFromString(a.bytes));
    }
    if (a.code != 0) last_message_ = a.bytes;
    return a.code;
  }
  // A decode over `page`'s token 0 without an append (DecodeOnto's, once appended).
  static v1::DecodeRequest ReadOf(int32_t page, const std::string& session) {
    v1::DecodeRequest r = DecodeOnto(page, session);
    r.clear_k_new();
    r.clear_v_new();
    return r;
  }
  // The first output element of ReadOf(page) over gRPC (NaN when the call fails).
  float ReadBack(int32_t page, const std::string& session) {
    grpc::ClientContext ctx;
    v1::AttentionResponse resp;
    const grpc::Status st = stub_->Decode(&ctx, ReadOf(page, session), &resp);
    EXPECT_TRUE(st.ok()) << st.error_message();
    if (!st.ok() || resp.output().data().size() < sizeof(bf16)) return std::nanf("");
    return Bf16ToFloat(reinterpret_cast<const bf16*>(resp.output().data().data())[0]);
  }
  // The session's region `name` as ListRegions shows it (an empty name when it has none).
  v1::RegionInfo Listed(const std::string& session, const std::string& name) {
    grpc::ClientContext ctx;
    v1::ListRegionsRequest req;
    req.set_session(session);
    v1::ListRegionsResponse resp;
    EXPECT_TRUE(stub_->ListRegions(&ctx, req, &resp).ok());
    for (const v1::RegionInfo& r : resp.regions()) {
      if (r.name() == name) return r;
    }
    return {};
  }
  // Waits until the queue `name` stopped serving: its region is no longer held as a queue. For
  // queues whose memory the test must not touch (closed() would read it).
  void AwaitStopped(const std::string& session, const std::string& name) {
    while (Listed(session, name).call_queue()) std::this_thread::yield();
  }
  static void AwaitClosed(const CallQueueClient& q) {
    while (!q.closed()) std::this_thread::yield();
  }

  Gate gate_;
  std::unique_ptr<Metrics> metrics_;
  std::unique_ptr<Engine> engine_;
  std::unique_ptr<Authorizer> auth_;
  std::unique_ptr<AttentionServiceImpl> service_;
  std::unique_ptr<grpc::Server> server_;
  std::unique_ptr<v1::AttentionService::Stub> stub_;
  std::string last_message_;
};

TEST_F(CallQueueServiceTest, ACallOverTheQueueAnswersWhatTheRpcAnswers) {
  const std::string s = OpenSession();
  const int32_t a = AllocatePage(s), b = AllocatePage(s);
  auto q = Register(s, "q");
  ASSERT_NE(q, nullptr);
  v1::AttentionResponse over_queue, over_rpc;
  ASSERT_EQ(QueueDecode(*q, DecodeOnto(a, s), &over_queue), 0) << last_message_;
  grpc::ClientContext ctx;
  ASSERT_TRUE(stub_->Decode(&ctx, DecodeOnto(b, s), &over_rpc).ok());
  EXPECT_EQ(over_queue.output().data(), over_rpc.output().data());
  EXPECT_EQ(over_queue.lse().data(), over_rpc.lse().data());
  const auto* out = reinterpret_cast<const bf16*>(over_queue.output().data().data());
  EXPECT_EQ(Bf16ToFloat(out[0]), 1.5f);
  EXPECT_EQ(over_queue.timings().batch_requests(), 1);
  // The session may be left out: it is the queue's.
  v1::DecodeRequest no_session = DecodeOnto(a, s);
  no_session.clear_session();
  no_session.clear_k_new();
  no_session.clear_v_new();
  EXPECT_EQ(QueueDecode(*q, no_session), 0) << last_message_;
  // Counted as Decode calls, as the RPCs are.
  EXPECT_NE(metrics_->Scrape().find(R"(attn_rpc_requests_total{code="ok",method="Decode"} 3)"),
            std::string::npos);
}

// A retry of a registration whose answer was lost finds the queue that serves, and says so.
TEST_F(CallQueueServiceTest, ARetriedRegistrationFindsTheServingQueue) {
  const std::string s = OpenSession();
  const int32_t page = AllocatePage(s);
  auto q = Register(s, "q");
  ASSERT_NE(q, nullptr);
  v1::RegisterRegionResponse resp;
  const grpc::Status st = SendRegistration(RegistrationOf(*q, s, "q"), &resp);
  ASSERT_TRUE(st.ok()) << st.error_message();
  EXPECT_TRUE(resp.region().call_queue());
  EXPECT_EQ(resp.region().size(), q->size());
  EXPECT_EQ(QueueDecode(*q, DecodeOnto(page, s)), 0) << last_message_;
}

// A registration that differs from the one registered only in what the memory is for (the
// queue's geometry, or being a queue at all) is no retry: answered OK, its caller would write
// slots at offsets the server does not read. ALREADY_EXISTS names the field, as for other
// memory, and the queue keeps serving with the geometry it was registered with.
TEST_F(CallQueueServiceTest, ARegistrationOfAnotherGeometryIsNoRetry) {
  const std::string s = OpenSession();
  const int32_t page = AllocatePage(s);
  auto q = Register(s, "q");
  ASSERT_NE(q, nullptr);
  // The message of a registration refused with ALREADY_EXISTS.
  const auto refused = [this](const v1::RegisterRegionRequest& req) {
    v1::RegisterRegionResponse resp;
    const grpc::Status st = SendRegistration(req, &resp);
    EXPECT_EQ(st.error_code(), StatusCode::ALREADY_EXISTS) << st.error_message();
    return st.error_message();
  };
  const CallQueueClient::Options& o = q->options();
  for (const auto& [field, slots, request_bytes, response_bytes] :
       {std::tuple{"call_queue.slots", o.slots - 1, o.request_bytes, o.response_bytes},
        {"call_queue.request_bytes", o.slots, o.request_bytes / 2, o.response_bytes},
        {"call_queue.response_bytes", o.slots, o.request_bytes, o.response_bytes / 2}}) {
    v1::RegisterRegionRequest other = RegistrationOf(*q, s, "q");
    other.mutable_call_queue()->set_slots(slots);
    other.mutable_call_queue()->set_request_bytes(request_bytes);
    other.mutable_call_queue()->set_response_bytes(response_bytes);
    const std::string message = refused(other);
    EXPECT_NE(message.find(absl::StrCat("another ", field, ";")), std::string::npos) << message;
  }
  v1::RegisterRegionRequest plain = RegistrationOf(*q, s, "q");
  plain.clear_call_queue();
  std::string message = refused(plain);
  EXPECT_NE(message.find("another call_queue;"), std::string::npos) << message;
  EXPECT_TRUE(Listed(s, "q").call_queue());
  EXPECT_EQ(QueueDecode(*q, DecodeOnto(page, s)), 0) << last_message_;
  // Nor does a region registered as plain memory become a queue by a "retry" as one.
  std::string error;
  auto segment = CallQueueClient::Create({}, &error);
  ASSERT_NE(segment, nullptr) << error;
  plain = RegistrationOf(*segment, s, "r");
  plain.clear_call_queue();
  v1::RegisterRegionResponse resp;
  ASSERT_TRUE(SendRegistration(plain, &resp).ok());
  message = refused(RegistrationOf(*segment, s, "r"));
  EXPECT_NE(message.find("another call_queue;"), std::string::npos) << message;
  EXPECT_FALSE(Listed(s, "r").call_queue());
}

TEST_F(CallQueueServiceTest, RefusalsComeBackWithTheRpcsCodes) {
  const std::string s = OpenSession(), other = OpenSession();
  const int32_t mine = AllocatePage(s), theirs = AllocatePage(other);
  auto q = Register(s, "q");
  ASSERT_NE(q, nullptr);
  EXPECT_EQ(QueueDecode(*q, DecodeOnto(theirs, s)), int(StatusCode::FAILED_PRECONDITION));
  v1::DecodeRequest bad = DecodeOnto(mine, s);
  bad.set_pool("nope");
  EXPECT_EQ(QueueDecode(*q, bad), int(StatusCode::NOT_FOUND));
  bad = DecodeOnto(mine, s);
  bad.mutable_q()->set_shape(2, 65);
  EXPECT_EQ(QueueDecode(*q, bad), int(StatusCode::INVALID_ARGUMENT));
  // Another session (of the same principal) is not the queue's.
  EXPECT_EQ(QueueDecode(*q, DecodeOnto(theirs, other)), int(StatusCode::INVALID_ARGUMENT));
  EXPECT_EQ(q->Call(cq::kDecode, "\xff\xff\xff\xff").code, int(StatusCode::INVALID_ARGUMENT));
  engine_->StartDrain();
  EXPECT_EQ(QueueDecode(*q, DecodeOnto(mine, s)), int(StatusCode::UNAVAILABLE));
}

TEST_F(CallQueueServiceTest, TheRegisteringTokenMustAllowTheMethod) {
  v1::AccessToken setup, full;
  setup.set_name("setup");
  setup.set_token("setup-secret");
  for (const char* m : {"OpenSession", "AllocatePages", "RegisterRegion"}) setup.add_methods(m);
  full.set_name("full");
  full.set_token("full-secret");
  full.add_methods("*");
  Start({setup, full});
  const std::string s = OpenSession("setup-secret");
  const int32_t page = AllocatePage(s, "setup-secret");
  grpc::Status st;
  auto q = Register(s, "q", &st, "setup-secret");
  ASSERT_NE(q, nullptr) << st.error_message();
  EXPECT_EQ(QueueDecode(*q, DecodeOnto(page, s)), int(StatusCode::PERMISSION_DENIED));
  // Without a token allowed to register, no queue.
  auto none = Register(s, "q2", &st, "");
  EXPECT_EQ(none, nullptr);
  EXPECT_EQ(st.error_code(), StatusCode::UNAUTHENTICATED);
  // Another principal's session: refused at registration.
  EXPECT_EQ(Register(s, "q3", &st, "full-secret"), nullptr);
  EXPECT_EQ(st.error_code(), StatusCode::PERMISSION_DENIED);
}

TEST_F(CallQueueServiceTest, QueuesCountAgainstTheSessionsLimits) {
  Start({}, /*per_session=*/1);
  const std::string s = OpenSession();
  auto q = Register(s, "q");
  ASSERT_NE(q, nullptr);
  grpc::Status st;
  EXPECT_EQ(Register(s, "q2", &st), nullptr);
  EXPECT_EQ(st.error_code(), StatusCode::RESOURCE_EXHAUSTED);
  // Unregistered, its place is free again.
  ASSERT_TRUE(Unregister(s, "q").ok());
  EXPECT_TRUE(q->closed());
  EXPECT_NE(Register(s, "q2"), nullptr);
  // A geometry that does not fit its size.
  std::string error;
  auto small = CallQueueClient::Create({}, &error);
  v1::RegisterRegionRequest req;
  req.set_name("q3");
  req.set_session(s);
  req.mutable_shared_memory()->set_shm_name(small->shm_name());
  req.set_size(small->size());
  req.set_key(small->key());
  req.mutable_call_queue()->set_slots(64);
  req.mutable_call_queue()->set_request_bytes(1 << 20);
  req.mutable_call_queue()->set_response_bytes(1 << 20);
  grpc::ClientContext ctx;
  v1::RegisterRegionResponse resp;
  EXPECT_EQ(stub_->RegisterRegion(&ctx, req, &resp).error_code(), StatusCode::INVALID_ARGUMENT);
}

TEST_F(CallQueueServiceTest, AQueueGoesWithItsSession) {
  const std::string closed = OpenSession(), expired = OpenSession();
  auto q1 = Register(closed, "q");
  auto q2 = Register(expired, "q");
  ASSERT_NE(q1, nullptr);
  ASSERT_NE(q2, nullptr);
  grpc::ClientContext ctx;
  v1::CloseSessionRequest req;
  req.set_session(closed);
  v1::CloseSessionResponse resp;
  ASSERT_TRUE(stub_->CloseSession(&ctx, req, &resp).ok());
  AwaitClosed(*q1);
  EXPECT_EQ(q1->Call(cq::kDecode, DecodeOnto(0, closed).SerializeAsString()).code,
            int(StatusCode::UNAVAILABLE));
  engine_->ExpireSessions(absl::Now() + absl::Hours(2));
  AwaitClosed(*q2);
}

// UnregisterRegion of a queue answers once the call in flight over it is answered; the call
// ends as it would have.
TEST_F(CallQueueServiceTest, UnregisteringWaitsForTheCallInFlight) {
  const std::string s = OpenSession();
  const int32_t page = AllocatePage(s);
  auto q = Register(s, "q");
  ASSERT_NE(q, nullptr);
  gate_.Hold(true);
  int code = -1;
  std::thread caller([&] { code = QueueDecode(*q, DecodeOnto(page, s)); });
  gate_.AwaitRunning();
  absl::Notification unregistered;
  grpc::Status unregister_status;
  std::thread unregisterer([&] {
    unregister_status = Unregister(s, "q");
    unregistered.Notify();
  });
  AwaitClosed(*q);  // the queue stopped taking calls; its call is still held at the gate
  EXPECT_FALSE(unregistered.HasBeenNotified());
  gate_.Hold(false);
  caller.join();
  unregisterer.join();
  EXPECT_EQ(code, 0) << last_message_;
  EXPECT_TRUE(unregister_status.ok()) << unregister_status.error_message();
}

// The caller's own view of its segment through the SIGBUS guard (server/backends/shared_memory.h),
// with the object's descriptor to truncate it: the test keeps running after the truncation
// however it touches the view (a CallQueueClient's mapping is not guarded: touching it after
// the truncation would kill the test).
struct CallerView {
  explicit CallerView(const CallQueueClient& q) {
    fd = shm_open(q.shm_name().c_str(), O_RDWR, 0);
    EXPECT_GE(fd, 0) << std::strerror(errno);
    RegionSpec spec;
    spec.shm_name = q.shm_name();
    spec.size = q.size();
    spec.key = q.key();
    absl::StatusOr<std::unique_ptr<SharedMemoryMapping>> m = MapSharedMemory(spec, "/attnserve");
    EXPECT_TRUE(m.ok()) << m.status();
    if (m.ok()) mapping = *std::move(m);
    geometry = q.options();
  }
  ~CallerView() {
    if (fd >= 0) close(fd);
  }
  char* Slot(int i) const {
    return mapping->data() + cq::kSlots +
           i * cq::SlotStride(geometry.request_bytes, geometry.response_bytes);
  }
  // Publishes a call into slot i as a caller does.
  void Publish(int i, uint32_t method, const std::string& request) const {
    char* slot = Slot(i);
    std::memcpy(slot + cq::kSlotHeaderBytes, request.data(), request.size());
    cq::Word(slot, cq::kMethod).store(method);
    cq::Word(slot, cq::kRequestLen).store(static_cast<uint32_t>(request.size()));
    cq::Word64(slot, cq::kTimeoutUs).store(0);
    cq::Word(slot, cq::kState).store(cq::kSubmitted);
    cq::Word(mapping->data(), cq::kDoorbell).fetch_add(1);
    cq::FutexWake(mapping->data() + cq::kDoorbell, 1);
  }
  void Truncate(int64_t bytes) const { ASSERT_EQ(ftruncate(fd, bytes), 0) << std::strerror(errno); }

  int fd = -1;
  std::unique_ptr<SharedMemoryMapping> mapping;
  CallQueueClient::Options geometry;
};

// A caller truncating its queue's segment (to nothing, or to half: the later slots' pages go)
// while the queue is idle: the queue stops (its region is no longer held), the region is
// refused as broken, and everything else goes on: the session's RPCs, another session's queue,
// unregistering the broken queue and registering a new one under its name.
class TruncatedCallQueueTest : public CallQueueServiceTest,
                               public ::testing::WithParamInterface<bool> {};

TEST_P(TruncatedCallQueueTest, AnIdleQueueStopsAndTheServerServesOn) {
  const bool to_half = GetParam();
  const std::string s = OpenSession(), other = OpenSession();
  const int32_t a = AllocatePage(s), b = AllocatePage(other);
  auto q = Register(s, "q", nullptr, "", /*unlink=*/false);
  auto q2 = Register(other, "q");
  ASSERT_NE(q, nullptr);
  ASSERT_NE(q2, nullptr);
  ASSERT_EQ(QueueDecode(*q, DecodeOnto(a, s)), 0) << last_message_;
  CallerView view(*q);
  ASSERT_NE(view.mapping, nullptr);
  q->Unlink();
  // Half, in whole pages: slot 0 keeps its pages, the last slot loses its.
  view.Truncate(to_half ? q->size() / 2 / 4096 * 4096 : 0);
  // From here on the test touches neither q's memory nor the view's.
  AwaitStopped(s, "q");
  EXPECT_EQ(Listed(s, "q").name(), "q");  // still registered, no longer served
  // The session's RPCs and the other session's queue are served.
  EXPECT_EQ(ReadBack(a, s), 1.5f);
  EXPECT_EQ(QueueDecode(*q2, DecodeOnto(b, other)), 0) << last_message_;
  // A tensor in the broken region is refused.
  v1::DecodeRequest in_region = ReadOf(a, s);
  v1::AttentionResponse resp;
  in_region.mutable_q()->clear_data();
  in_region.mutable_q()->mutable_region()->set_name("q");
  in_region.mutable_q()->mutable_region()->set_offset(4096);
  {
    grpc::ClientContext ctx;
    const grpc::Status st = stub_->Decode(&ctx, in_region, &resp);
    EXPECT_EQ(st.error_code(), StatusCode::FAILED_PRECONDITION) << st.error_message();
  }
  // A retry of the queue's registration (its answer lost, say) does not bring it back.
  {
    grpc::ClientContext ctx;
    v1::RegisterRegionResponse reg;
    const grpc::Status st = stub_->RegisterRegion(&ctx, RegistrationOf(*q, s, "q"), &reg);
    EXPECT_EQ(st.error_code(), StatusCode::FAILED_PRECONDITION) << st.error_message();
    EXPECT_FALSE(reg.region().call_queue());
  }
  EXPECT_EQ(Listed(s, "q").name(), "q");
  // The broken queue goes; a new one takes its name.
  ASSERT_TRUE(Unregister(s, "q").ok());
  auto again = Register(s, "q");
  ASSERT_NE(again, nullptr);
  EXPECT_EQ(QueueDecode(*again, ReadOf(a, s)), 0) << last_message_;
}

INSTANTIATE_TEST_SUITE_P(ToNothingOrHalf, TruncatedCallQueueTest, ::testing::Bool());

// The segment truncated while a call over it is held at its launch: the call ends as it would
// have (its request was copied out before it was handed on: its token is appended), its answer
// goes into the zero pages, and the queue stops once it is over.
TEST_F(CallQueueServiceTest, ACallInFlightEndsWhenItsSegmentIsTruncated) {
  const std::string s = OpenSession();
  const int32_t page = AllocatePage(s);
  auto q = Register(s, "q", nullptr, "", /*unlink=*/false);
  ASSERT_NE(q, nullptr);
  CallerView view(*q);
  ASSERT_NE(view.mapping, nullptr);
  q->Unlink();
  gate_.Hold(true);
  view.Publish(0, cq::kDecode, DecodeOnto(page, s).SerializeAsString());
  gate_.AwaitRunning();
  view.Truncate(0);
  EXPECT_TRUE(Listed(s, "q").call_queue());  // held until its call is over
  gate_.Hold(false);
  AwaitStopped(s, "q");
  EXPECT_NE(metrics_->Scrape().find(R"(attn_rpc_requests_total{code="ok",method="Decode"} 1)"),
            std::string::npos);
  EXPECT_EQ(ReadBack(page, s), 1.5f);  // the call appended its token
  EXPECT_TRUE(Unregister(s, "q").ok());
}

}  // namespace
}  // namespace attn
