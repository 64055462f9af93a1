// The real AttentionServiceImpl on an in-process gRPC server, over an Engine with the CPU backend,
// driven through the generated C++ stubs: what a client sees of the engine's rules (codes,
// responses, trailers, metrics), without a socket.
#include "server/rpc/service.h"

#include <cstring>
#include <limits>
#include <memory>
#include <string>
#include <vector>

#include "absl/synchronization/notification.h"
#include "attnserve/v1/attention.grpc.pb.h"
#include "grpcpp/generic/generic_stub.h"
#include "grpcpp/grpcpp.h"
#include "gtest/gtest.h"
#include "kernels/bf16.h"
#include "server/backends/cpu_backend.h"
#include "server/rpc/test_tensors.h"

namespace attn {
namespace {

using ::grpc::StatusCode;

constexpr int kPages = 16;
constexpr int kHeads = 4, kKvHeads = 2, kDim = 64;

bool Has(const std::string& text, const std::string& part) {
  return text.find(part) != std::string::npos;
}

// One sequence that appends its first token to `page`: q = 0 (every logit 0), k = 1, and v rows of
// 1 for KV head 0 and 2 for KV head 1, so the output is v, per query head's KV head.
v1::DecodeRequest DecodeOnto(int32_t page, const std::string& session) {
  v1::DecodeRequest r;
  r.set_pool("gqa");
  r.set_session(session);
  r.set_layer(1);
  FillBf16(r.mutable_q(), {1, kHeads, kDim}, 0.f);
  FillBf16(r.mutable_k_new(), {1, kKvHeads, kDim}, 1.f);
  FillBf16(r.mutable_v_new(), {1, kKvHeads, kDim}, 1.f);
  std::string& v = *r.mutable_v_new()->mutable_data();
  for (int i = kDim; i < 2 * kDim; ++i) {
    const bf16 two = FloatToBf16(2.f);
    std::memcpy(&v[i * sizeof(bf16)], &two, sizeof(bf16));
  }
  r.add_kv_indptr(0);
  r.add_kv_indptr(1);
  r.add_kv_indices(page);
  r.add_kv_last_page_len(1);
  r.set_return_lse(true);
  return r;
}

class ServiceTest : public ::testing::Test {
 protected:
  void SetUp() override { Start({}); }

  void Start(const std::vector<v1::AccessToken>& tokens) {
    Stop();
    metrics_ = std::make_unique<Metrics>(kVersion, "cpu", "test");
    SessionOptions sessions;
    sessions.default_lease = absl::Minutes(10);
    sessions.max_pages = 6;
    auto engine =
        Engine::Create(CreateCpuBackend(1),
                       {PoolGeometry::Gqa("gqa", 2, 4, kHeads, kKvHeads, kDim, kPages),
                        PoolGeometry::Mla("mla", 1, 4, 2, 8)},
                       BatchingOptions{}, sessions, /*epoch=*/0x5e, metrics_.get(), metrics_.get());
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
    channel_ = server_->InProcessChannel(grpc::ChannelArguments());
    stub_ = v1::AttentionService::NewStub(channel_);
  }

  void Stop() {
    if (server_) server_->Shutdown();
    server_.reset();
    service_.reset();
    engine_.reset();
  }
  void TearDown() override { Stop(); }

  std::string OpenSession(int lease_ms = 0, int max_pages = 0, const std::string& token = "") {
    grpc::ClientContext ctx;
    if (!token.empty()) ctx.AddMetadata("authorization", "Bearer " + token);
    v1::OpenSessionRequest req;
    req.set_lease_ms(lease_ms);
    req.set_max_pages(max_pages);
    v1::OpenSessionResponse resp;
    const grpc::Status st = stub_->OpenSession(&ctx, req, &resp);
    EXPECT_TRUE(st.ok()) << st.error_message();
    return resp.session();
  }
  grpc::Status Allocate(const std::string& session, int n, std::vector<int32_t>* ids = nullptr,
                        const std::string& pool = "gqa") {
    grpc::ClientContext ctx;
    v1::AllocatePagesRequest req;
    req.set_pool(pool);
    req.set_session(session);
    req.set_num_pages(n);
    v1::AllocatePagesResponse resp;
    const grpc::Status st = stub_->AllocatePages(&ctx, req, &resp);
    if (ids) ids->assign(resp.page_ids().begin(), resp.page_ids().end());
    return st;
  }
  grpc::Status Free(const std::string& session, const std::vector<int32_t>& ids,
                    v1::FreePagesResponse* resp) {
    grpc::ClientContext ctx;
    v1::FreePagesRequest req;
    req.set_pool("gqa");
    req.set_session(session);
    for (int32_t id : ids) req.add_page_ids(id);
    return stub_->FreePages(&ctx, req, resp);
  }
  grpc::Status Decode(const v1::DecodeRequest& req, v1::AttentionResponse* resp,
                      const std::string& token = "") {
    grpc::ClientContext ctx;
    if (!token.empty()) ctx.AddMetadata("authorization", "Bearer " + token);
    return stub_->Decode(&ctx, req, resp);
  }
  int FreePagesOf(const std::string& pool) {
    grpc::ClientContext ctx;
    v1::GetServerInfoResponse info;
    EXPECT_TRUE(stub_->GetServerInfo(&ctx, v1::GetServerInfoRequest(), &info).ok());
    for (const v1::PoolInfo& p : info.pools()) {
      if (p.name() == pool) return p.free_pages();
    }
    return -1;
  }

  std::unique_ptr<Metrics> metrics_;
  std::unique_ptr<Engine> engine_;
  std::unique_ptr<Authorizer> auth_;
  std::unique_ptr<AttentionServiceImpl> service_;
  std::unique_ptr<grpc::Server> server_;
  std::shared_ptr<grpc::Channel> channel_;
  std::unique_ptr<v1::AttentionService::Stub> stub_;
};

TEST_F(ServiceTest, GetServerInfoDescribesTheEngine) {
  grpc::ClientContext ctx;
  v1::GetServerInfoResponse info;
  ASSERT_TRUE(stub_->GetServerInfo(&ctx, v1::GetServerInfoRequest(), &info).ok());
  EXPECT_EQ(info.version(), kVersion);
  EXPECT_EQ(info.epoch(), 0x5eu);
  EXPECT_EQ(info.backend(), "cpu");
  EXPECT_EQ(info.default_lease_ms(), 600'000);
  ASSERT_EQ(info.pools_size(), 2);
  EXPECT_EQ(info.pools(0).name(), "gqa");
  EXPECT_EQ(info.pools(0).free_pages(), kPages);
  EXPECT_EQ(info.pools(1).ckv_dim(), kMlaCkvDim);
}

TEST_F(ServiceTest, ADecodeAppendsAndAnswersWithItsOutputs) {
  const std::string session = OpenSession();
  std::vector<int32_t> ids;
  ASSERT_TRUE(Allocate(session, 2, &ids).ok());
  EXPECT_EQ(FreePagesOf("gqa"), kPages - 2);
  v1::AttentionResponse resp;
  const grpc::Status st = Decode(DecodeOnto(ids[1], session), &resp);
  ASSERT_TRUE(st.ok()) << st.error_message();
  ASSERT_EQ(resp.output().shape_size(), 3);
  EXPECT_EQ(resp.output().shape(0), 1);
  EXPECT_EQ(resp.output().shape(1), kHeads);
  EXPECT_EQ(resp.output().shape(2), kDim);
  ASSERT_EQ(resp.output().data().size(), size_t{kHeads} * kDim * sizeof(bf16));
  const auto* out = reinterpret_cast<const bf16*>(resp.output().data().data());
  for (int h = 0; h < kHeads; ++h) {
    const float want = h < kHeads / 2 ? 1.f : 2.f;  // heads 0, 1 read KV head 0
    EXPECT_EQ(Bf16ToFloat(out[h * kDim]), want) << "head " << h;
    EXPECT_EQ(Bf16ToFloat(out[h * kDim + kDim - 1]), want) << "head " << h;
  }
  ASSERT_EQ(resp.lse().data().size(), size_t{kHeads} * sizeof(float));
  EXPECT_EQ(resp.lse().shape(1), kHeads);
  EXPECT_EQ(resp.timings().batch_requests(), 1);
  EXPECT_GE(resp.timings().total_us(), resp.timings().queue_us());

  // The call's pages were unpinned before the answer: they can be freed at once.
  v1::FreePagesResponse freed;
  ASSERT_TRUE(Free(session, ids, &freed).ok());
  EXPECT_EQ(freed.free_pages(), kPages);
}

TEST_F(ServiceTest, EngineRefusalsBecomeTheirStatusCodes) {
  const std::string a = OpenSession(), b = OpenSession();
  std::vector<int32_t> mine, theirs;
  ASSERT_TRUE(Allocate(a, 2, &mine).ok());
  ASSERT_TRUE(Allocate(b, 1, &theirs).ok());
  v1::AttentionResponse resp;
  EXPECT_EQ(Decode(DecodeOnto(theirs[0], a), &resp).error_code(), StatusCode::FAILED_PRECONDITION);
  v1::DecodeRequest bad = DecodeOnto(mine[0], a);
  bad.mutable_q()->set_shape(2, 65);
  EXPECT_EQ(Decode(bad, &resp).error_code(), StatusCode::INVALID_ARGUMENT);
  bad = DecodeOnto(mine[0], a);
  bad.set_pool("nope");
  EXPECT_EQ(Decode(bad, &resp).error_code(), StatusCode::NOT_FOUND);
  EXPECT_EQ(Decode(DecodeOnto(mine[0], "005e-1"), &resp).error_code(),
            StatusCode::INVALID_ARGUMENT);
  EXPECT_EQ(
      Decode(DecodeOnto(mine[0], "000000000000005f-" + std::string(32, '1')), &resp).error_code(),
      StatusCode::FAILED_PRECONDITION);  // an earlier epoch
  EXPECT_EQ(Allocate(a, kPages + 1).error_code(), StatusCode::INVALID_ARGUMENT);
  // The default quota of sessions opened without one is 6 pages.
  EXPECT_EQ(Allocate(a, 5).error_code(), StatusCode::RESOURCE_EXHAUSTED);
  EXPECT_TRUE(Has(metrics_->Scrape(), R"(attn_page_alloc_failures_total{pool="gqa"} 1)"));
  v1::FreePagesResponse freed;
  EXPECT_EQ(Free(a, theirs, &freed).error_code(), StatusCode::FAILED_PRECONDITION);
  EXPECT_EQ(Free(a, {mine[0], mine[0]}, &freed).error_code(), StatusCode::INVALID_ARGUMENT);
  EXPECT_TRUE(Has(metrics_->Scrape(),
                  R"(attn_rpc_requests_total{code="failed_precondition",method="Decode"} 2)"));
}

TEST_F(ServiceTest, DrainingRefusesWorkButTakesPagesBack) {
  const std::string a = OpenSession();
  std::vector<int32_t> ids;
  ASSERT_TRUE(Allocate(a, 1, &ids).ok());
  engine_->StartDrain();
  v1::AttentionResponse resp;
  EXPECT_EQ(Decode(DecodeOnto(ids[0], a), &resp).error_code(), StatusCode::UNAVAILABLE);
  EXPECT_EQ(Allocate(a, 1).error_code(), StatusCode::UNAVAILABLE);
  v1::FreePagesResponse freed;
  EXPECT_TRUE(Free(a, ids, &freed).ok());
  EXPECT_TRUE(engine_->WaitForIdle(absl::Now()));
}

// attn_kv_pages{state="used"} used to keep a reclaimed session's pages: only the reclaim counter
// moved, so the pool-nearly-full alert fired on an empty pool.
TEST_F(ServiceTest, ALeaseReclaimMovesThePoolGauges) {
  const std::string a = OpenSession(/*lease_ms=*/1000, /*max_pages=*/0);
  ASSERT_TRUE(Allocate(a, 5).ok());
  ASSERT_TRUE(Allocate(a, 1, nullptr, "mla").ok());
  std::string text = metrics_->Scrape();
  EXPECT_TRUE(Has(text, R"(attn_kv_pages{pool="gqa",state="used"} 5)")) << text;
  engine_->ExpireSessions(absl::Now() + absl::Seconds(2));
  text = metrics_->Scrape();
  EXPECT_TRUE(Has(text, R"(attn_kv_pages{pool="gqa",state="used"} 0)")) << text;
  EXPECT_TRUE(Has(text, R"(attn_kv_pages{pool="gqa",state="free"} 16)"));
  EXPECT_TRUE(Has(text, R"(attn_kv_pages{pool="mla",state="used"} 0)"));
  EXPECT_TRUE(Has(text, R"(attn_pages_reclaimed_total{pool="gqa"} 5)"));
  EXPECT_EQ(FreePagesOf("gqa"), kPages);
  v1::AttentionResponse resp;
  EXPECT_EQ(Decode(DecodeOnto(0, a), &resp).error_code(), StatusCode::NOT_FOUND);
}

TEST_F(ServiceTest, CloseSessionFreesItsPages) {
  const std::string a = OpenSession();
  ASSERT_TRUE(Allocate(a, 4).ok());
  grpc::ClientContext ctx;
  v1::CloseSessionRequest req;
  req.set_session(a);
  v1::CloseSessionResponse resp;
  ASSERT_TRUE(stub_->CloseSession(&ctx, req, &resp).ok());
  EXPECT_EQ(resp.freed_pages(), 4);
  EXPECT_TRUE(Has(metrics_->Scrape(), R"(attn_kv_pages{pool="gqa",state="used"} 0)"));
  grpc::ClientContext again;
  EXPECT_EQ(stub_->CloseSession(&again, req, &resp).error_code(), StatusCode::NOT_FOUND);
}

TEST_F(ServiceTest, OpenSessionRefusesNegativeSettings) {
  grpc::ClientContext ctx;
  v1::OpenSessionRequest req;
  req.set_max_pages(-1);
  v1::OpenSessionResponse resp;
  EXPECT_EQ(stub_->OpenSession(&ctx, req, &resp).error_code(), StatusCode::INVALID_ARGUMENT);
}

TEST_F(ServiceTest, BytesThatAreNotARequestAreInvalidArgument) {
  grpc::GenericStub generic(channel_);
  grpc::ClientContext ctx;
  const std::string garbage = "\xff\xff\xff\xff";
  grpc::Slice slice(garbage);
  grpc::ByteBuffer request(&slice, 1), response;
  grpc::Status status;
  absl::Notification done;
  generic.UnaryCall(&ctx, "/attnserve.v1.AttentionService/Decode", grpc::StubOptions(), &request,
                    &response, [&](grpc::Status st) {
                      status = std::move(st);
                      done.Notify();
                    });
  done.WaitForNotification();
  EXPECT_EQ(status.error_code(), StatusCode::INVALID_ARGUMENT);
  EXPECT_TRUE(Has(status.error_message(), "attnserve.v1.DecodeRequest")) << status.error_message();
}

TEST_F(ServiceTest, TokensAreCheckedBeforeTheEngineIsAsked) {
  v1::AccessToken token;
  token.set_token("sesame");
  token.add_methods("GetServerInfo");
  Start({token});
  grpc::ClientContext anonymous;
  v1::GetServerInfoResponse info;
  EXPECT_EQ(stub_->GetServerInfo(&anonymous, v1::GetServerInfoRequest(), &info).error_code(),
            StatusCode::UNAUTHENTICATED);
  grpc::ClientContext known;
  known.AddMetadata("authorization", "Bearer sesame");
  EXPECT_TRUE(stub_->GetServerInfo(&known, v1::GetServerInfoRequest(), &info).ok());
  grpc::ClientContext not_allowed;
  not_allowed.AddMetadata("authorization", "Bearer sesame");
  v1::AllocatePagesRequest req;
  req.set_num_pages(1);
  req.set_pool("gqa");
  v1::AllocatePagesResponse resp;
  EXPECT_EQ(stub_->AllocatePages(&not_allowed, req, &resp).error_code(),
            StatusCode::PERMISSION_DENIED);
  EXPECT_EQ(engine_->pools().front()->free_pages(), kPages);
}

// A freed page keeps its rows in storage; the next owner used to read them (LIFO reuse gives it
// exactly those pages). Now they are zeroed first: q = 0 gives the mean of V over the page, which
// must be 0, not the previous owner's 1 and 2.
TEST_F(ServiceTest, AReusedPageReadsZerosNotItsLastOwnersRows) {
  const std::string a = OpenSession(), b = OpenSession();
  std::vector<int32_t> mine;
  ASSERT_TRUE(Allocate(a, 1, &mine).ok());
  v1::AttentionResponse resp;
  ASSERT_TRUE(Decode(DecodeOnto(mine[0], a), &resp).ok());
  v1::FreePagesResponse freed;
  ASSERT_TRUE(Free(a, mine, &freed).ok());
  std::vector<int32_t> theirs;
  ASSERT_TRUE(Allocate(b, 1, &theirs).ok());
  ASSERT_EQ(theirs, mine);  // the same page, as the pool hands out freed ids
  v1::DecodeRequest peek = DecodeOnto(theirs[0], b);
  peek.clear_k_new();
  peek.clear_v_new();
  ASSERT_TRUE(Decode(peek, &resp).ok());
  const auto* out = reinterpret_cast<const bf16*>(resp.output().data().data());
  for (int i = 0; i < kHeads * kDim; ++i) ASSERT_EQ(Bf16ToFloat(out[i]), 0.f) << "element " << i;
}

// Sessions belong to the token that opened them: another token holding the handle is refused
// (and renews nothing), an admin token is not; a quota cannot be raised past the server's.
TEST_F(ServiceTest, SessionsAreBoundToTheirTokens) {
  v1::AccessToken alice, bob, ops;
  alice.set_name("alice");
  alice.set_token("alice-secret");
  alice.add_methods("*");
  bob.set_name("bob");
  bob.set_token("bob-secret");
  bob.add_methods("*");
  ops.set_name("ops");
  ops.set_token("ops-secret");
  ops.add_methods("*");
  ops.set_admin(true);
  Start({alice, bob, ops});
  const std::string session = OpenSession(0, 0, "alice-secret");
  std::vector<int32_t> ids;
  {
    grpc::ClientContext ctx;
    ctx.AddMetadata("authorization", "Bearer alice-secret");
    v1::AllocatePagesRequest req;
    req.set_pool("gqa");
    req.set_session(session);
    req.set_num_pages(1);
    v1::AllocatePagesResponse resp;
    ASSERT_TRUE(stub_->AllocatePages(&ctx, req, &resp).ok());
    ids.assign(resp.page_ids().begin(), resp.page_ids().end());
  }
  v1::AttentionResponse resp;
  const grpc::Status stolen = Decode(DecodeOnto(ids[0], session), &resp, "bob-secret");
  EXPECT_EQ(stolen.error_code(), StatusCode::PERMISSION_DENIED);
  EXPECT_FALSE(Has(stolen.error_message(), "alice")) << stolen.error_message();
  {
    grpc::ClientContext ctx;
    ctx.AddMetadata("authorization", "Bearer bob-secret");
    v1::CloseSessionRequest req;
    req.set_session(session);
    v1::CloseSessionResponse closed;
    EXPECT_EQ(stub_->CloseSession(&ctx, req, &closed).error_code(), StatusCode::PERMISSION_DENIED);
  }
  EXPECT_TRUE(Decode(DecodeOnto(ids[0], session), &resp, "alice-secret").ok());
  EXPECT_TRUE(Decode(DecodeOnto(ids[0], session), &resp, "ops-secret").ok());
  // max_pages beyond the server's limit (6) is granted as the limit.
  grpc::ClientContext ctx;
  ctx.AddMetadata("authorization", "Bearer bob-secret");
  v1::OpenSessionRequest req;
  req.set_max_pages(std::numeric_limits<int32_t>::max());
  v1::OpenSessionResponse opened;
  ASSERT_TRUE(stub_->OpenSession(&ctx, req, &opened).ok());
  EXPECT_EQ(opened.max_pages(), 6);
}

// Errors quote what the client sent only in part: a 100 kB pool name used to come back whole,
// and the client got RESOURCE_EXHAUSTED (metadata too large) instead of NOT_FOUND.
TEST_F(ServiceTest, ErrorsQuoteClientStringsInPart) {
  const std::string a = OpenSession();
  v1::DecodeRequest req = DecodeOnto(0, a);
  req.set_pool(std::string(100000, 'p'));
  v1::AttentionResponse resp;
  const grpc::Status st = Decode(req, &resp);
  EXPECT_EQ(st.error_code(), StatusCode::NOT_FOUND) << st.error_message().size();
  EXPECT_LT(st.error_message().size(), 300u);
  EXPECT_TRUE(Has(st.error_message(), "(100000 bytes)")) << st.error_message();
}

TEST_F(ServiceTest, TheRequestIdIsEchoed) {
  grpc::ClientContext ctx;
  ctx.AddMetadata("x-request-id", "req-42");
  v1::AllocatePagesRequest req;  // no session: refused
  req.set_pool("gqa");
  req.set_num_pages(1);
  v1::AllocatePagesResponse resp;
  EXPECT_EQ(stub_->AllocatePages(&ctx, req, &resp).error_code(), StatusCode::INVALID_ARGUMENT);
  const auto& echoed = ctx.GetServerInitialMetadata();
  auto it = echoed.find("x-request-id");
  ASSERT_NE(it, echoed.end());
  EXPECT_EQ(std::string(it->second.data(), it->second.size()), "req-42");
}

// A call naming a plan answers as the same call with the table in its fields would, and it
// appends the same way; the plan keeps its pages from FreePages until it is released.
TEST_F(ServiceTest, ADecodeOnAPlanAnswersAsOneWithItsTable) {
  const std::string session = OpenSession();
  std::vector<int32_t> ids;
  ASSERT_TRUE(Allocate(session, 2, &ids).ok());
  v1::AttentionResponse with_table;
  ASSERT_TRUE(Decode(DecodeOnto(ids[0], session), &with_table).ok());

  grpc::ClientContext ctx;
  v1::CreatePlanRequest plan;
  plan.set_pool("gqa");
  plan.set_session(session);
  plan.set_name("step-1");
  plan.add_kv_indptr(0);
  plan.add_kv_indptr(1);
  plan.add_kv_indices(ids[1]);
  plan.add_kv_last_page_len(1);
  v1::CreatePlanResponse planned;
  grpc::Status st = stub_->CreatePlan(&ctx, plan, &planned);
  ASSERT_TRUE(st.ok()) << st.error_message();
  EXPECT_EQ(planned.batch(), 1);
  EXPECT_EQ(planned.total_q(), 1);
  EXPECT_EQ(planned.num_pages(), 1);
  v1::DecodeRequest on_plan = DecodeOnto(ids[1], session);
  on_plan.clear_kv_indptr();
  on_plan.clear_kv_indices();
  on_plan.clear_kv_last_page_len();
  on_plan.set_plan("step-1");
  v1::AttentionResponse planned_resp;
  st = Decode(on_plan, &planned_resp);
  ASSERT_TRUE(st.ok()) << st.error_message();
  EXPECT_EQ(planned_resp.output().data(), with_table.output().data());
  EXPECT_EQ(planned_resp.lse().data(), with_table.lse().data());

  v1::FreePagesResponse freed;
  EXPECT_EQ(Free(session, {ids[1]}, &freed).error_code(), StatusCode::FAILED_PRECONDITION);
  grpc::ClientContext release_ctx;
  v1::ReleasePlanRequest release;
  release.set_session(session);
  release.set_name("step-1");
  v1::ReleasePlanResponse released;
  ASSERT_TRUE(stub_->ReleasePlan(&release_ctx, release, &released).ok());
  EXPECT_TRUE(Free(session, {ids[1]}, &freed).ok());
  // The plan is gone: a call naming it is NOT_FOUND and appends nothing.
  v1::AttentionResponse gone;
  EXPECT_EQ(Decode(on_plan, &gone).error_code(), StatusCode::NOT_FOUND);
}

TEST_F(ServiceTest, PlanRefusalsAreTheirStatusCodes) {
  const std::string session = OpenSession();
  const std::string other = OpenSession();
  std::vector<int32_t> ids, theirs;
  ASSERT_TRUE(Allocate(session, 1, &ids).ok());
  ASSERT_TRUE(Allocate(other, 1, &theirs).ok());
  const auto create = [&](const std::string& s, const std::vector<int32_t>& pages,
                          std::vector<int32_t> indptr, bool prefill = false) {
    grpc::ClientContext ctx;
    v1::CreatePlanRequest req;
    req.set_pool("gqa");
    req.set_session(s);
    req.set_name("p");
    req.set_prefill(prefill);
    for (int32_t i : indptr) req.add_kv_indptr(i);
    for (int32_t p : pages) req.add_kv_indices(p);
    req.add_kv_last_page_len(1);
    v1::CreatePlanResponse resp;
    return stub_->CreatePlan(&ctx, req, &resp);
  };
  EXPECT_EQ(create(session, ids, {0, 2}).error_code(), StatusCode::INVALID_ARGUMENT);  // indptr
  EXPECT_EQ(create(session, theirs, {0, 1}).error_code(), StatusCode::FAILED_PRECONDITION);
  EXPECT_EQ(create(session, {kPages}, {0, 1}).error_code(), StatusCode::INVALID_ARGUMENT);
  EXPECT_EQ(create(session, ids, {0, 1}, /*prefill=*/true).error_code(),
            StatusCode::INVALID_ARGUMENT);                    // a Prefill plan without qo_indptr
  EXPECT_EQ(engine_->pools()[0]->pages().pinned_pages(), 0);  // none of them pinned anything
  ASSERT_TRUE(create(session, ids, {0, 1}).ok());

  v1::DecodeRequest call = DecodeOnto(ids[0], session);
  call.set_plan("p");  // and the table in the fields too
  v1::AttentionResponse resp;
  grpc::Status st = Decode(call, &resp);
  EXPECT_EQ(st.error_code(), StatusCode::INVALID_ARGUMENT);
  EXPECT_TRUE(Has(st.error_message(), "only one")) << st.error_message();
  call.clear_kv_indptr();
  call.clear_kv_indices();
  call.clear_kv_last_page_len();
  call.set_session(other);  // another session's plan of that name does not exist
  EXPECT_EQ(Decode(call, &resp).error_code(), StatusCode::NOT_FOUND);
  call.set_session(session);
  call.set_pool("mla");
  EXPECT_EQ(Decode(call, &resp).error_code(), StatusCode::INVALID_ARGUMENT);
  // A Prefill naming a Decode plan.
  grpc::ClientContext ctx;
  v1::PrefillRequest prefill;
  prefill.set_pool("gqa");
  prefill.set_session(session);
  prefill.set_plan("p");
  FillBf16(prefill.mutable_q(), {1, kHeads, kDim}, 0.f);
  EXPECT_EQ(stub_->Prefill(&ctx, prefill, &resp).error_code(), StatusCode::INVALID_ARGUMENT);
}

}  // namespace
}  // namespace attn
