#include "server/service.h"

#include <memory>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "server/grpc_status.h"
#include "server/validate.h"

namespace attn {
namespace {

absl::Time ToAbslTime(std::chrono::system_clock::time_point t) {
  if (t == std::chrono::system_clock::time_point::max()) return absl::InfiniteFuture();
  return absl::FromChrono(t);
}

int64_t Micros(absl::Duration d) { return absl::ToInt64Microseconds(d); }

constexpr char kGetServerInfo[] = "GetServerInfo";
constexpr char kAllocatePages[] = "AllocatePages";
constexpr char kFreePages[] = "FreePages";
constexpr char kPrefill[] = "Prefill";
constexpr char kDecode[] = "Decode";
constexpr char kOpenSession[] = "OpenSession";
constexpr char kCloseSession[] = "CloseSession";

}  // namespace

AttentionServiceImpl::AttentionServiceImpl(Engine* engine, Metrics* metrics,
                                           const Authorizer* auth, int64_t max_message_bytes)
    : engine_(engine), metrics_(metrics), auth_(auth), max_message_bytes_(max_message_bytes) {
  for (const auto& pool : engine_->pools()) {
    metrics_->AddPool(pool->geometry.name, pool->pages.total_pages());
  }
}

void AttentionServiceImpl::Finish(grpc::ServerUnaryReactor* reactor, const char* method,
                                  absl::Time arrived, const absl::Status& status) {
  metrics_->OnRpc(method, status, absl::Now() - arrived);
  metrics_->OnRpcFinished();
  reactor->Finish(ToGrpcStatus(status));
}

grpc::ServerUnaryReactor* AttentionServiceImpl::FinishNow(grpc::CallbackServerContext* ctx,
                                                          const char* method, absl::Time arrived,
                                                          const absl::Status& status) {
  grpc::ServerUnaryReactor* reactor = ctx->DefaultReactor();
  Finish(reactor, method, arrived, status);
  return reactor;
}

void AttentionServiceImpl::StartDrain() {
  absl::MutexLock lock(&mu_);
  draining_ = true;
}

bool AttentionServiceImpl::WaitForIdle(absl::Time deadline) {
  absl::MutexLock lock(&mu_);
  return mu_.AwaitWithDeadline(
      absl::Condition(
          +[](int* active) { return *active == 0; }, &active_calls_),
      deadline);
}

absl::Status AttentionServiceImpl::Begin(grpc::CallbackServerContext* ctx, const char* method) {
  metrics_->OnRpcStarted();
  if (!auth_->enabled()) return absl::OkStatus();
  const auto& metadata = ctx->client_metadata();
  auto it = metadata.find("authorization");
  const absl::string_view token =
      it == metadata.end() ? absl::string_view() : absl::string_view(it->second.data(),
                                                                     it->second.size());
  return auth_->Check(token, method);
}

absl::StatusOr<SessionId> AttentionServiceImpl::Session(grpc::CallbackServerContext* ctx,
                                                        const std::string& handle) {
  return engine_->sessions().Resolve(handle, ctx->peer(), absl::Now());
}

absl::Status AttentionServiceImpl::Admit() {
  absl::MutexLock lock(&mu_);
  if (draining_) return absl::UnavailableError("the server is draining; retry on another server");
  ++active_calls_;
  return absl::OkStatus();
}

void AttentionServiceImpl::Release() {
  absl::MutexLock lock(&mu_);
  --active_calls_;
}

void AttentionServiceImpl::UpdatePoolGauges(const Engine::Pool& pool) {
  metrics_->SetPoolPages(pool.geometry.name, pool.pages.free_pages(), pool.pages.total_pages());
}

grpc::ServerUnaryReactor* AttentionServiceImpl::GetServerInfo(grpc::CallbackServerContext* ctx,
                                                              const v1::GetServerInfoRequest* req,
                                                              v1::GetServerInfoResponse* resp) {
  const absl::Time arrived = absl::Now();
  if (absl::Status st = Begin(ctx, kGetServerInfo); !st.ok()) {
    return FinishNow(ctx, kGetServerInfo, arrived, st);
  }
  if (!req->session().empty()) {
    if (absl::StatusOr<SessionId> id = Session(ctx, req->session()); !id.ok()) {
      return FinishNow(ctx, kGetServerInfo, arrived, id.status());
    }
  }
  resp->set_version(kVersion);
  resp->set_epoch(engine_->sessions().epoch());
  resp->set_default_lease_ms(
      static_cast<int32_t>(absl::ToInt64Milliseconds(engine_->sessions().default_lease())));
  resp->set_backend(engine_->backend().name());
  resp->set_device(engine_->backend().device());
  resp->set_max_message_bytes(max_message_bytes_);
  for (const auto& pool : engine_->pools()) {
    v1::PoolInfo* info = resp->add_pools();
    *info = ToPoolInfo(pool->geometry);
    info->set_free_pages(pool->pages.free_pages());
  }
  return FinishNow(ctx, kGetServerInfo, arrived, absl::OkStatus());
}

grpc::ServerUnaryReactor* AttentionServiceImpl::AllocatePages(grpc::CallbackServerContext* ctx,
                                                              const v1::AllocatePagesRequest* req,
                                                              v1::AllocatePagesResponse* resp) {
  const absl::Time arrived = absl::Now();
  if (absl::Status st = Begin(ctx, kAllocatePages); !st.ok()) {
    return FinishNow(ctx, kAllocatePages, arrived, st);
  }
  {
    absl::MutexLock lock(&mu_);
    if (draining_) {
      return FinishNow(ctx, kAllocatePages, arrived,
                       absl::UnavailableError("the server is draining; allocate elsewhere"));
    }
  }
  absl::StatusOr<Engine::Pool*> pool = engine_->FindPool(req->pool());
  if (!pool.ok()) return FinishNow(ctx, kAllocatePages, arrived, pool.status());
  absl::StatusOr<SessionId> owner = Session(ctx, req->session());
  if (!owner.ok()) return FinishNow(ctx, kAllocatePages, arrived, owner.status());
  // The quota first (other sessions' pages are never touched), then the pool.
  SessionTable& sessions = engine_->sessions();
  absl::StatusOr<std::vector<int32_t>> ids = absl::UnknownError("unset");
  if (absl::Status quota = sessions.Charge(*owner, req->num_pages()); !quota.ok()) {
    ids = quota;
  } else {
    ids = (*pool)->pages.Allocate(req->num_pages(), *owner);
    if (!ids.ok()) sessions.Refund(*owner, req->num_pages());
  }
  if (!ids.ok()) {
    if (absl::IsResourceExhausted(ids.status())) {
      metrics_->OnAllocationFailure((*pool)->geometry.name);
    }
    return FinishNow(ctx, kAllocatePages, arrived, ids.status());
  }
  resp->mutable_page_ids()->Assign(ids->begin(), ids->end());
  UpdatePoolGauges(**pool);
  return FinishNow(ctx, kAllocatePages, arrived, absl::OkStatus());
}

grpc::ServerUnaryReactor* AttentionServiceImpl::FreePages(grpc::CallbackServerContext* ctx,
                                                          const v1::FreePagesRequest* req,
                                                          v1::FreePagesResponse* resp) {
  const absl::Time arrived = absl::Now();
  if (absl::Status st = Begin(ctx, kFreePages); !st.ok()) {
    return FinishNow(ctx, kFreePages, arrived, st);
  }
  absl::StatusOr<Engine::Pool*> pool = engine_->FindPool(req->pool());
  if (!pool.ok()) return FinishNow(ctx, kFreePages, arrived, pool.status());
  absl::StatusOr<SessionId> owner = Session(ctx, req->session());
  if (!owner.ok()) return FinishNow(ctx, kFreePages, arrived, owner.status());
  if (absl::Status st = (*pool)->pages.Free(req->page_ids(), *owner); !st.ok()) {
    return FinishNow(ctx, kFreePages, arrived, st);
  }
  engine_->sessions().Refund(*owner, req->page_ids_size());
  resp->set_free_pages((*pool)->pages.free_pages());
  UpdatePoolGauges(**pool);
  return FinishNow(ctx, kFreePages, arrived, absl::OkStatus());
}

grpc::ServerUnaryReactor* AttentionServiceImpl::Prefill(grpc::CallbackServerContext* ctx,
                                                        const v1::PrefillRequest* req,
                                                        v1::AttentionResponse* resp) {
  return Attention(Op::kPrefill, ctx, *req, resp);
}

grpc::ServerUnaryReactor* AttentionServiceImpl::Decode(grpc::CallbackServerContext* ctx,
                                                       const v1::DecodeRequest* req,
                                                       v1::AttentionResponse* resp) {
  return Attention(Op::kDecode, ctx, *req, resp);
}

grpc::ServerUnaryReactor* AttentionServiceImpl::OpenSession(grpc::CallbackServerContext* ctx,
                                                            const v1::OpenSessionRequest* req,
                                                            v1::OpenSessionResponse* resp) {
  const absl::Time arrived = absl::Now();
  if (absl::Status st = Begin(ctx, kOpenSession); !st.ok()) {
    return FinishNow(ctx, kOpenSession, arrived, st);
  }
  if (req->lease_ms() < 0 || req->max_pages() < 0) {
    return FinishNow(ctx, kOpenSession, arrived,
                     absl::InvalidArgumentError(absl::StrCat(
                         "lease_ms = ", req->lease_ms(), " and max_pages = ", req->max_pages(),
                         " must not be negative (0 takes the server's default)")));
  }
  const OpenedSession s =
      engine_->sessions().Open(absl::Milliseconds(req->lease_ms()), req->max_pages(), arrived);
  resp->set_session(s.handle);
  resp->set_epoch(engine_->sessions().epoch());
  resp->set_lease_ms(static_cast<int32_t>(absl::ToInt64Milliseconds(s.lease)));
  resp->set_max_pages(s.max_pages);
  return FinishNow(ctx, kOpenSession, arrived, absl::OkStatus());
}

grpc::ServerUnaryReactor* AttentionServiceImpl::CloseSession(grpc::CallbackServerContext* ctx,
                                                             const v1::CloseSessionRequest* req,
                                                             v1::CloseSessionResponse* resp) {
  const absl::Time arrived = absl::Now();
  if (absl::Status st = Begin(ctx, kCloseSession); !st.ok()) {
    return FinishNow(ctx, kCloseSession, arrived, st);
  }
  absl::StatusOr<int> freed = engine_->CloseSession(req->session());
  if (!freed.ok()) return FinishNow(ctx, kCloseSession, arrived, freed.status());
  resp->set_freed_pages(*freed);
  for (const auto& pool : engine_->pools()) UpdatePoolGauges(*pool);
  return FinishNow(ctx, kCloseSession, arrived, absl::OkStatus());
}

template <typename Request>
grpc::ServerUnaryReactor* AttentionServiceImpl::Attention(Op op,
                                                          grpc::CallbackServerContext* ctx,
                                                          const Request& req,
                                                          v1::AttentionResponse* resp) {
  const absl::Time arrived = absl::Now();
  const char* method = op == Op::kPrefill ? kPrefill : kDecode;
  if (absl::Status st = Begin(ctx, method); !st.ok()) return FinishNow(ctx, method, arrived, st);
  absl::StatusOr<Engine::Pool*> pool = engine_->FindPool(req.pool());
  if (!pool.ok()) return FinishNow(ctx, method, arrived, pool.status());
  const PoolGeometry& g = (*pool)->geometry;

  absl::StatusOr<AttentionCall> call;
  if constexpr (std::is_same_v<Request, v1::PrefillRequest>) {
    call = ValidatePrefill(req, g);
  } else {
    call = ValidateDecode(req, g);
  }
  if (!call.ok()) return FinishNow(ctx, method, arrived, call.status());
  absl::StatusOr<SessionId> owner = Session(ctx, req.session());
  if (!owner.ok()) return FinishNow(ctx, method, arrived, owner.status());

  const int out_dim = g.kind == PoolKind::kGqa ? g.head_dim : kMlaCkvDim;
  v1::Tensor* out = resp->mutable_output();
  out->set_dtype(v1::DTYPE_BF16);
  out->add_shape(call->total_q);
  out->add_shape(g.num_qo_heads);
  out->add_shape(out_dim);
  call->out = out->mutable_data();
  if (call->return_lse) {
    v1::Tensor* lse = resp->mutable_lse();
    lse->set_dtype(v1::DTYPE_FP32);
    lse->add_shape(call->total_q);
    lse->add_shape(g.num_qo_heads);
    call->lse = lse->mutable_data();
  }

  if (absl::Status st = Admit(); !st.ok()) return FinishNow(ctx, method, arrived, st);
  // Pinned pages cannot be freed or reclaimed until the call finishes.
  PagePool& pages = (*pool)->pages;
  const absl::Span<const int32_t> pinned = call->kv_indices;
  if (absl::Status st = pages.Pin(pinned, *owner, "kv_indices"); !st.ok()) {
    Release();
    return FinishNow(ctx, method, arrived, st);
  }
  grpc::ServerUnaryReactor* reactor = ctx->DefaultReactor();
  auto pending = std::make_unique<PendingCall>();
  pending->call = *std::move(call);
  pending->deadline = ToAbslTime(ctx->deadline());
  pending->is_cancelled = [ctx] { return ctx->IsCancelled(); };
  pending->done = [this, reactor, resp, arrived, method, &pages, pinned](
                      const absl::Status& st, const CallReport& report) {
    if (st.ok()) {
      v1::Timings* t = resp->mutable_timings();
      t->set_queue_us(Micros(report.launched - report.enqueued));
      t->set_compute_us(Micros(report.compute));
      t->set_total_us(Micros(report.finished - arrived));
      t->set_batch_requests(report.batch_requests);
    }
    pages.Unpin(pinned);
    Finish(reactor, method, arrived, st);
    Release();
  };
  Batcher& batcher = (*pool)->batcher(op);
  if (absl::Status st = batcher.Submit(std::move(pending)); !st.ok()) {
    if (absl::IsResourceExhausted(st)) {
      // The standard gRPC retry-pushback trailer: clients with a retry policy wait this long.
      ctx->AddTrailingMetadata("grpc-retry-pushback-ms",
                               absl::StrCat(absl::ToInt64Milliseconds(batcher.RetryHint())));
    }
    pages.Unpin(pinned);
    Finish(reactor, method, arrived, st);
    Release();
  }
  return reactor;
}

}  // namespace attn
