#include "server/rpc/service.h"

#include <limits>
#include <string>
#include <type_traits>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "grpc/grpc_security_constants.h"
#include "grpcpp/support/proto_buffer_reader.h"
#include "grpcpp/support/proto_buffer_writer.h"
#include "proto/attnserve/v1/call_queue.h"
#include "server/api/pool_config.h"
#include "server/api/validate.h"
#include "server/rpc/call_log.h"
#include "server/rpc/grpc_status.h"
#include "server/rpc/request_reader.h"
#include "server/rpc/response_writer.h"

namespace attn {
namespace {

absl::Time ToAbslTime(std::chrono::system_clock::time_point t) {
  if (t == std::chrono::system_clock::time_point::max()) return absl::InfiniteFuture();
  return absl::FromChrono(t);
}

int64_t Micros(absl::Duration d) { return absl::ToInt64Microseconds(d); }

// The principal of a call on a connection with a verified client certificate (mutual TLS):
// "cert:" and the certificate's subject. Empty without one.
std::string CertificatePrincipal(const grpc::CallbackServerContext* ctx) {
  const std::shared_ptr<const grpc::AuthContext> auth = ctx->auth_context();
  if (auth == nullptr || !auth->IsPeerAuthenticated()) return "";
  for (const grpc::string_ref& subject :
       auth->FindPropertyValues(GRPC_X509_SUBJECT_PROPERTY_NAME)) {
    return absl::StrCat("cert:", absl::string_view(subject.data(), subject.size()));
  }
  return "";
}

// The caller's x-request-id (empty when none), at most 128 bytes of it: echoed in the response
// and written into the log line of a failed call.
std::string RequestId(const grpc::CallbackServerContext* ctx) {
  const auto& metadata = ctx->client_metadata();
  auto it = metadata.find("x-request-id");
  if (it == metadata.end()) return "";
  return std::string(it->second.data(), std::min<size_t>(it->second.size(), 128));
}

// Calls at least this large have the allocator trimmed after them (Call::OnDone).
constexpr size_t kLargeCallBytes = size_t{16} << 20;

constexpr char kGetServerInfo[] = "GetServerInfo";
constexpr char kAllocatePages[] = "AllocatePages";
constexpr char kFreePages[] = "FreePages";
constexpr char kPrefill[] = "Prefill";
constexpr char kDecode[] = "Decode";
constexpr char kOpenSession[] = "OpenSession";
constexpr char kCloseSession[] = "CloseSession";
constexpr char kRegisterRegion[] = "RegisterRegion";
constexpr char kUnregisterRegion[] = "UnregisterRegion";
constexpr char kListRegions[] = "ListRegions";
constexpr char kCreatePlan[] = "CreatePlan";
constexpr char kReleasePlan[] = "ReleasePlan";

template <typename Request>
constexpr bool kIsAttention =
    std::is_same_v<Request, v1::PrefillRequest> || std::is_same_v<Request, v1::DecodeRequest>;

v1::RegionInfo ToProto(const RegionInfo& r) {
  v1::RegionInfo info;
  info.set_name(r.name);
  info.set_kind(r.kind == RegionKind::kSharedMemory ? v1::RegionInfo::KIND_SHARED_MEMORY
                                                    : v1::RegionInfo::KIND_CUDA_IPC);
  info.set_size(r.size);
  info.set_calls_in_flight(r.calls_in_flight);
  info.set_call_queue(r.held);
  return info;
}

}  // namespace

// The reactor of one call. It owns the parsed request and the response; Complete() records the
// call's metrics, serializes the response into the raw reply when the call succeeded, and
// finishes it. gRPC deletes it (OnDone) once the reply is sent.
template <typename Request, typename Response>
class AttentionServiceImpl::Call final : public grpc::ServerUnaryReactor {
 public:
  Call(Metrics* metrics, AllocatorTrimmer* trimmer, const char* method,
       grpc::CallbackServerContext* ctx, grpc::ByteBuffer* reply)
      : ctx(ctx),
        method(method),
        request_id(RequestId(ctx)),
        metrics_(metrics),
        trimmer_(trimmer),
        reply_(reply) {
    if (!request_id.empty()) ctx->AddInitialMetadata("x-request-id", request_id);
  }

  // The caller of the session the request names.
  Caller CallerOf(const std::string& session) const { return Caller{session, principal}; }

  void Complete(const absl::Status& status) {
    metrics_->OnRpc(method, status, absl::Now() - arrived);
    if (!status.ok()) LogFailedCall(method, status, request_id, ctx->peer());
    metrics_->OnRpcFinished();
    if (status.ok()) {
      if constexpr (std::is_same_v<Response, v1::AttentionResponse>) {
        *reply_ = WriteAttentionResponse(response, out, lse);
      } else {
        bool own_buffer = false;
        const grpc::Status wrote =
            grpc::SerializationTraits<Response>::Serialize(response, reply_, &own_buffer);
        if (!wrote.ok()) {
          Finish(wrote);
          return;
        }
      }
    }
    Finish(ToGrpcStatus(status));
  }

  // A large call's memory goes back to the system a moment after it ends (allocator_trim.h).
  void OnDone() override {
    // Tensors stay in the slices and outputs in the backend's buffers, outside the messages.
    if (in_bytes + out.size + lse.size + response.ByteSizeLong() > kLargeCallBytes) {
      trimmer_->LargeCallEnded();
    }
    delete this;
  }

  grpc::CallbackServerContext* const ctx;
  const char* const method;
  const std::string request_id;
  Principal principal;  // set once the call is authenticated
  const absl::Time arrived = absl::Now();
  Request request;
  Response response;
  // Prefill and Decode: the message's slices, which `tensors` points into, and the outputs the
  // response is sent with (AttentionResponse's data, when not in a region).
  std::vector<grpc::Slice> slices;
  InlineTensors tensors;
  SharedBytes out, lse;
  size_t in_bytes = 0;  // the request as it arrived

 private:
  Metrics* const metrics_;
  AllocatorTrimmer* const trimmer_;
  grpc::ByteBuffer* const reply_;
};

AttentionServiceImpl::AttentionServiceImpl(Engine* engine, Metrics* metrics, const Authorizer* auth,
                                           int64_t max_message_bytes,
                                           CallQueueOptions call_queue_options)
    : engine_(engine),
      metrics_(metrics),
      auth_(auth),
      max_message_bytes_(max_message_bytes),
      call_queue_options_(std::move(call_queue_options)),
      call_queues_(engine->data_plane().max_call_queues,
                   engine->data_plane().max_call_queues_per_session) {}

AttentionServiceImpl::~AttentionServiceImpl() { StopCallQueues(); }

void AttentionServiceImpl::StopCallQueues() {
  call_queues_.StopAll(absl::UnavailableError("the server is shutting down; retry on another"));
}

template <typename Request, typename Response>
grpc::ServerUnaryReactor* AttentionServiceImpl::Serve(const char* method,
                                                      grpc::CallbackServerContext* ctx,
                                                      const grpc::ByteBuffer* in,
                                                      grpc::ByteBuffer* out,
                                                      Handler<Request, Response> handle) {
  auto* call = new Call<Request, Response>(metrics_, &trimmer_, method, ctx, out);
  call->in_bytes = in->Length();
  metrics_->OnRpcStarted();
  absl::Status parsed;
  if constexpr (kIsAttention<Request>) {
    parsed = ReadAttentionRequest(*in, &call->slices, &call->request, &call->tensors);
  } else {
    grpc::ByteBuffer bytes(*in);  // parsing consumes the buffer; this copy shares its slices
    if (!grpc::SerializationTraits<Request>::Deserialize(&bytes, &call->request).ok()) {
      parsed = absl::InvalidArgumentError(
          absl::StrCat("the request is not a valid ", Request::descriptor()->full_name(), " (",
                       in->Length(), " bytes): truncated or corrupt protobuf"));
    }
  }
  if (!parsed.ok()) {
    call->Complete(parsed);
  } else if (absl::StatusOr<Principal> who = Authenticate(ctx, method); !who.ok()) {
    call->Complete(who.status());
  } else {
    call->principal = *std::move(who);
    (this->*handle)(*call);
  }
  return call;
}

grpc::ServerUnaryReactor* AttentionServiceImpl::GetServerInfo(grpc::CallbackServerContext* ctx,
                                                              const grpc::ByteBuffer* in,
                                                              grpc::ByteBuffer* out) {
  return Serve(kGetServerInfo, ctx, in, out, &AttentionServiceImpl::HandleGetServerInfo);
}

grpc::ServerUnaryReactor* AttentionServiceImpl::AllocatePages(grpc::CallbackServerContext* ctx,
                                                              const grpc::ByteBuffer* in,
                                                              grpc::ByteBuffer* out) {
  return Serve(kAllocatePages, ctx, in, out, &AttentionServiceImpl::HandleAllocatePages);
}

grpc::ServerUnaryReactor* AttentionServiceImpl::FreePages(grpc::CallbackServerContext* ctx,
                                                          const grpc::ByteBuffer* in,
                                                          grpc::ByteBuffer* out) {
  return Serve(kFreePages, ctx, in, out, &AttentionServiceImpl::HandleFreePages);
}

grpc::ServerUnaryReactor* AttentionServiceImpl::Prefill(grpc::CallbackServerContext* ctx,
                                                        const grpc::ByteBuffer* in,
                                                        grpc::ByteBuffer* out) {
  return Serve(kPrefill, ctx, in, out, &AttentionServiceImpl::HandleAttention<v1::PrefillRequest>);
}

grpc::ServerUnaryReactor* AttentionServiceImpl::Decode(grpc::CallbackServerContext* ctx,
                                                       const grpc::ByteBuffer* in,
                                                       grpc::ByteBuffer* out) {
  return Serve(kDecode, ctx, in, out, &AttentionServiceImpl::HandleAttention<v1::DecodeRequest>);
}

grpc::ServerUnaryReactor* AttentionServiceImpl::OpenSession(grpc::CallbackServerContext* ctx,
                                                            const grpc::ByteBuffer* in,
                                                            grpc::ByteBuffer* out) {
  return Serve(kOpenSession, ctx, in, out, &AttentionServiceImpl::HandleOpenSession);
}

grpc::ServerUnaryReactor* AttentionServiceImpl::CloseSession(grpc::CallbackServerContext* ctx,
                                                             const grpc::ByteBuffer* in,
                                                             grpc::ByteBuffer* out) {
  return Serve(kCloseSession, ctx, in, out, &AttentionServiceImpl::HandleCloseSession);
}

grpc::ServerUnaryReactor* AttentionServiceImpl::RegisterRegion(grpc::CallbackServerContext* ctx,
                                                               const grpc::ByteBuffer* in,
                                                               grpc::ByteBuffer* out) {
  return Serve(kRegisterRegion, ctx, in, out, &AttentionServiceImpl::HandleRegisterRegion);
}

grpc::ServerUnaryReactor* AttentionServiceImpl::UnregisterRegion(grpc::CallbackServerContext* ctx,
                                                                 const grpc::ByteBuffer* in,
                                                                 grpc::ByteBuffer* out) {
  return Serve(kUnregisterRegion, ctx, in, out, &AttentionServiceImpl::HandleUnregisterRegion);
}

grpc::ServerUnaryReactor* AttentionServiceImpl::ListRegions(grpc::CallbackServerContext* ctx,
                                                            const grpc::ByteBuffer* in,
                                                            grpc::ByteBuffer* out) {
  return Serve(kListRegions, ctx, in, out, &AttentionServiceImpl::HandleListRegions);
}

grpc::ServerUnaryReactor* AttentionServiceImpl::CreatePlan(grpc::CallbackServerContext* ctx,
                                                           const grpc::ByteBuffer* in,
                                                           grpc::ByteBuffer* out) {
  return Serve(kCreatePlan, ctx, in, out, &AttentionServiceImpl::HandleCreatePlan);
}

grpc::ServerUnaryReactor* AttentionServiceImpl::ReleasePlan(grpc::CallbackServerContext* ctx,
                                                            const grpc::ByteBuffer* in,
                                                            grpc::ByteBuffer* out) {
  return Serve(kReleasePlan, ctx, in, out, &AttentionServiceImpl::HandleReleasePlan);
}

absl::StatusOr<Principal> AttentionServiceImpl::Authenticate(grpc::CallbackServerContext* ctx,
                                                             const char* method) const {
  // Without tokens, a verified client certificate names the caller; with neither, every caller
  // is the same anonymous principal (there is no one to tell apart).
  if (!auth_->enabled()) return Principal{CertificatePrincipal(ctx), false};
  const auto& metadata = ctx->client_metadata();
  auto it = metadata.find("authorization");
  const absl::string_view token = it == metadata.end()
                                      ? absl::string_view()
                                      : absl::string_view(it->second.data(), it->second.size());
  return auth_->Authenticate(token, method);
}

void AttentionServiceImpl::HandleGetServerInfo(
    Call<v1::GetServerInfoRequest, v1::GetServerInfoResponse>& call) {
  if (!call.request.session().empty()) {
    if (absl::Status st = engine_->RenewLease(call.CallerOf(call.request.session())); !st.ok()) {
      return call.Complete(st);
    }
  }
  v1::GetServerInfoResponse& resp = call.response;
  resp.set_version(kVersion);
  resp.set_epoch(engine_->epoch());
  resp.set_default_lease_ms(
      static_cast<int32_t>(absl::ToInt64Milliseconds(engine_->default_lease())));
  resp.set_backend(engine_->backend().name());
  resp.set_device(engine_->backend().device());
  resp.set_max_message_bytes(max_message_bytes_);
  const DataPlaneOptions& plane = engine_->data_plane();
  v1::DataPlane* dp = resp.mutable_data_plane();
  dp->set_shared_memory(plane.shared_memory);
  dp->set_cuda_ipc(plane.cuda_ipc && engine_->backend().name() == "cuda");
  dp->set_max_regions_per_session(plane.limits.max_regions_per_session);
  dp->set_max_region_bytes_per_session(plane.limits.max_bytes_per_session);
  dp->set_shm_name_prefix(plane.shm_name_prefix);
  dp->set_call_queue(plane.shared_memory);
  dp->set_max_call_queues_per_session(plane.max_call_queues_per_session);
  dp->set_call_queue_spin_us(
      static_cast<int32_t>(absl::ToInt64Microseconds(call_queue_options_.spin)));
  dp->set_max_plans_per_session(plane.max_plans_per_session);
  for (const auto& pool : engine_->pools()) {
    v1::PoolInfo* info = resp.add_pools();
    *info = ToPoolInfo(pool->geometry);
    info->set_free_pages(pool->free_pages());
  }
  call.Complete(absl::OkStatus());
}

void AttentionServiceImpl::HandleAllocatePages(
    Call<v1::AllocatePagesRequest, v1::AllocatePagesResponse>& call) {
  const v1::AllocatePagesRequest& req = call.request;
  absl::StatusOr<std::vector<int32_t>> ids =
      engine_->AllocatePages(req.pool(), call.CallerOf(req.session()), req.num_pages());
  if (!ids.ok()) return call.Complete(ids.status());
  call.response.mutable_page_ids()->Assign(ids->begin(), ids->end());
  call.Complete(absl::OkStatus());
}

void AttentionServiceImpl::HandleFreePages(
    Call<v1::FreePagesRequest, v1::FreePagesResponse>& call) {
  const v1::FreePagesRequest& req = call.request;
  absl::StatusOr<int> free =
      engine_->FreePages(req.pool(), call.CallerOf(req.session()), req.page_ids());
  if (!free.ok()) return call.Complete(free.status());
  call.response.set_free_pages(*free);
  call.Complete(absl::OkStatus());
}

void AttentionServiceImpl::HandleOpenSession(
    Call<v1::OpenSessionRequest, v1::OpenSessionResponse>& call) {
  const v1::OpenSessionRequest& req = call.request;
  if (req.lease_ms() < 0 || req.max_pages() < 0) {
    return call.Complete(absl::InvalidArgumentError(
        absl::StrCat("lease_ms = ", req.lease_ms(), " and max_pages = ", req.max_pages(),
                     " must not be negative (0 takes the server's default)")));
  }
  absl::StatusOr<OpenedSession> opened =
      engine_->OpenSession(absl::Milliseconds(req.lease_ms()), req.max_pages(), call.principal);
  if (!opened.ok()) return call.Complete(opened.status());
  const OpenedSession& s = *opened;
  call.response.set_session(s.handle);
  call.response.set_epoch(engine_->epoch());
  call.response.set_lease_ms(static_cast<int32_t>(absl::ToInt64Milliseconds(s.lease)));
  call.response.set_max_pages(s.max_pages);
  call.Complete(absl::OkStatus());
}

void AttentionServiceImpl::HandleRegisterRegion(
    Call<v1::RegisterRegionRequest, v1::RegisterRegionResponse>& call) {
  const v1::RegisterRegionRequest& req = call.request;
  RegionSpec spec;
  switch (req.memory_case()) {
    case v1::RegisterRegionRequest::kSharedMemory:
      spec.kind = RegionKind::kSharedMemory;
      spec.shm_name = req.shared_memory().shm_name();
      break;
    case v1::RegisterRegionRequest::kCudaIpc:
      spec.kind = RegionKind::kCudaIpc;
      spec.ipc_handle = req.cuda_ipc().handle();
      break;
    default:
      return call.Complete(absl::InvalidArgumentError("set shared_memory or cuda_ipc"));
  }
  spec.offset = req.offset();
  spec.size = req.size();
  spec.key = req.key();
  if (req.has_call_queue()) return RegisterCallQueue(call, spec);
  absl::StatusOr<RegionInfo> region =
      engine_->RegisterRegion(call.CallerOf(req.session()), req.name(), spec);
  if (!region.ok()) return call.Complete(region.status());
  *call.response.mutable_region() = ToProto(*region);
  call.Complete(absl::OkStatus());
}

void AttentionServiceImpl::HandleUnregisterRegion(
    Call<v1::UnregisterRegionRequest, v1::UnregisterRegionResponse>& call) {
  const v1::UnregisterRegionRequest& req = call.request;
  if (absl::Status st = engine_->UnregisterRegion(call.CallerOf(req.session()), req.name());
      !st.ok()) {
    return call.Complete(st);
  }
  // A call queue answers once its calls in flight are answered (on its thread, which stopped
  // when the region left the table): from then on nothing writes into its memory.
  call_queues_.WhenStopped(req.session(), req.name(), [&call] { call.Complete(absl::OkStatus()); });
}

void AttentionServiceImpl::HandleListRegions(
    Call<v1::ListRegionsRequest, v1::ListRegionsResponse>& call) {
  absl::StatusOr<std::vector<RegionInfo>> regions =
      engine_->ListRegions(call.CallerOf(call.request.session()));
  if (!regions.ok()) return call.Complete(regions.status());
  for (const RegionInfo& r : *regions) *call.response.add_regions() = ToProto(r);
  call.Complete(absl::OkStatus());
}

void AttentionServiceImpl::HandleCreatePlan(
    Call<v1::CreatePlanRequest, v1::CreatePlanResponse>& call) {
  const v1::CreatePlanRequest& req = call.request;
  absl::StatusOr<Engine::Pool*> pool = engine_->FindPool(req.pool());
  if (!pool.ok()) return call.Complete(pool.status());
  const Caller caller = call.CallerOf(req.session());
  const RegionResolver regions = [this, &caller](absl::Span<const SliceRef> slices) {
    return engine_->ResolveRegions(caller, slices);
  };
  absl::StatusOr<PlanTable> table = ValidatePlanTable(req, (*pool)->geometry, regions);
  if (!table.ok()) return call.Complete(table.status());
  const int batch = table->batch();
  const int total_q = table->op == Op::kPrefill ? table->qo_indptr.back() : batch;
  const int num_pages = static_cast<int>(table->kv_indices.size());
  if (absl::Status st = engine_->CreatePlan(**pool, caller, req.name(), *std::move(table));
      !st.ok()) {
    return call.Complete(st);
  }
  call.response.set_batch(batch);
  call.response.set_total_q(total_q);
  call.response.set_num_pages(num_pages);
  call.Complete(absl::OkStatus());
}

void AttentionServiceImpl::HandleReleasePlan(
    Call<v1::ReleasePlanRequest, v1::ReleasePlanResponse>& call) {
  call.Complete(engine_->ReleasePlan(call.CallerOf(call.request.session()), call.request.name()));
}

void AttentionServiceImpl::HandleCloseSession(
    Call<v1::CloseSessionRequest, v1::CloseSessionResponse>& call) {
  absl::StatusOr<int> freed = engine_->CloseSession(call.request.session(), call.principal);
  if (!freed.ok()) return call.Complete(freed.status());
  call.response.set_freed_pages(*freed);
  call.Complete(absl::OkStatus());
}

template <typename Request>
void AttentionServiceImpl::HandleAttention(Call<Request, v1::AttentionResponse>& call) {
  grpc::CallbackServerContext* ctx = call.ctx;
  RunAttention(
      call.request, call.tensors, call.CallerOf(call.request.session()), call.arrived,
      ToAbslTime(ctx->deadline()), [ctx] { return ctx->IsCancelled(); },
      std::numeric_limits<int64_t>::max(), &call.response,
      [&call](const absl::Status& st, const CallReport& report) {
        call.out = report.out;
        call.lse = report.lse;
        if (report.retry_after > absl::ZeroDuration()) {
          // The standard gRPC retry-pushback trailer: clients with a retry policy wait this long.
          call.ctx->AddTrailingMetadata(
              "grpc-retry-pushback-ms",
              absl::StrCat(absl::ToInt64Milliseconds(report.retry_after)));
        }
        call.Complete(st);
      });
}

template <typename Request>
void AttentionServiceImpl::RunAttention(const Request& req, const InlineTensors& tensors,
                                        const Caller& caller, absl::Time arrived,
                                        absl::Time deadline, std::function<bool()> is_cancelled,
                                        int64_t max_inline_output_bytes,
                                        v1::AttentionResponse* response, AttentionDone done) {
  const auto refuse = [&done](const absl::Status& st) {
    CallReport report;
    report.enqueued = report.finished = absl::Now();
    done(st, report);
  };
  absl::StatusOr<Engine::Pool*> pool = engine_->FindPool(req.pool());
  if (!pool.ok()) return refuse(pool.status());
  const PoolGeometry& g = (*pool)->geometry;

  const RegionResolver regions = [this, &caller](absl::Span<const SliceRef> slices) {
    return engine_->ResolveRegions(caller, slices);
  };
  const FiniteCheck finite =
      engine_->backend().ChecksFiniteInputs() ? FiniteCheck::kBackend : FiniteCheck::kHost;
  constexpr bool kPrefillCall = std::is_same_v<Request, v1::PrefillRequest>;
  // A plan's table was checked and pinned when it was made: the call only names it.
  std::shared_ptr<const Plan> plan;
  if (!req.plan().empty()) {
    absl::StatusOr<std::shared_ptr<const Plan>> found =
        engine_->FindPlan(**pool, caller, req.plan(), kPrefillCall ? Op::kPrefill : Op::kDecode);
    if (!found.ok()) return refuse(found.status());
    plan = *std::move(found);
  }
  const PlanTable* table = plan == nullptr ? nullptr : &plan->table();
  absl::StatusOr<ValidatedCall> valid;
  if constexpr (kPrefillCall) {
    valid = ValidatePrefill(req, tensors, g, regions, finite, table);
  } else {
    valid = ValidateDecode(req, tensors, g, regions, finite, table);
  }
  if (!valid.ok()) return refuse(valid.status());
  const int total_q = valid->call.total_q;
  const bool return_lse = valid->call.return_lse;
  const RowShapes& rows = g.rows();
  int64_t inline_bytes = 0;
  if (!valid->call.out.in_region()) inline_bytes += int64_t{total_q} * rows.out.elements() * 2;
  if (return_lse && !valid->call.lse.in_region()) inline_bytes += int64_t{total_q} * rows.lse * 4;
  if (inline_bytes > max_inline_output_bytes) {
    return refuse(absl::InvalidArgumentError(
        absl::StrCat("the outputs not written into a region take ", inline_bytes,
                     " bytes; a call queue's slot answers with at most ", max_inline_output_bytes,
                     ": name output_to (and lse_to) in a region")));
  }
  absl::StatusOr<Admission> admitted = engine_->Admit(**pool, caller, std::move(valid->call),
                                                      std::move(valid->regions), std::move(plan));
  if (!admitted.ok()) return refuse(admitted.status());

  // The outputs' shapes; their bytes are the backend's (sent from its buffer) or in the regions
  // the request named.
  v1::Tensor* out = response->mutable_output();
  out->set_dtype(v1::DTYPE_BF16);
  out->add_shape(total_q);
  out->add_shape(rows.out.heads);
  out->add_shape(rows.out.dim);
  if (req.has_output_to()) *out->mutable_region() = req.output_to();
  if (return_lse) {
    v1::Tensor* lse = response->mutable_lse();
    lse->set_dtype(v1::DTYPE_FP32);
    lse->add_shape(total_q);
    lse->add_shape(rows.lse);
    if (req.has_lse_to()) *lse->mutable_region() = req.lse_to();
  }

  engine_->Submit(*std::move(admitted), deadline, std::move(is_cancelled),
                  [response, arrived, done = std::move(done)](const absl::Status& st,
                                                              const CallReport& report) {
                    if (st.ok()) {
                      v1::Timings* t = response->mutable_timings();
                      t->set_queue_us(Micros(report.launched - report.enqueued));
                      t->set_compute_us(Micros(report.launch.compute));
                      t->set_prepare_us(Micros(report.launch.prepare));
                      t->set_execute_us(Micros(report.launch.execute));
                      t->set_finish_us(Micros(report.launch.finish));
                      t->set_total_us(Micros(report.finished - arrived));
                      t->set_batch_requests(report.batch_requests);
                    }
                    done(st, report);
                  });
}

// --- Call queues

// Who registered a queue: the principal and session its calls act for, and whether the
// registering token may call Decode and Prefill (checked then: tokens do not change while the
// server runs).
struct AttentionServiceImpl::QueueOwner {
  Principal principal;
  std::string session;
  std::string name;
  absl::Status decode_allowed, prefill_allowed;
};

void AttentionServiceImpl::RegisterCallQueue(
    Call<v1::RegisterRegionRequest, v1::RegisterRegionResponse>& call, const RegionSpec& spec) {
  const v1::RegisterRegionRequest& req = call.request;
  if (spec.kind != RegionKind::kSharedMemory) {
    return call.Complete(absl::InvalidArgumentError("a call queue must be in shared memory"));
  }
  const CallQueueGeometry geometry{req.call_queue().slots(), req.call_queue().request_bytes(),
                                   req.call_queue().response_bytes()};
  if (absl::Status st = CheckCallQueueGeometry(geometry, req.size()); !st.ok()) {
    return call.Complete(st);
  }
  const Caller caller = call.CallerOf(req.session());
  if (absl::Status st = call_queues_.Reserve(req.session(), req.name()); !st.ok()) {
    // A retry of a registration whose answer was lost finds its region; one of other memory or
    // another geometry is ALREADY_EXISTS.
    absl::StatusOr<RegionInfo> again =
        absl::IsAlreadyExists(st)
            ? engine_->RegisterRegion(caller, req.name(), spec, RegistrationFieldsOf(geometry))
            : st;
    if (!again.ok()) return call.Complete(again.status());
    *call.response.mutable_region() = ToProto(*again);
    return call.Complete(absl::OkStatus());
  }
  absl::StatusOr<RegionInfo> region =
      engine_->RegisterRegion(caller, req.name(), spec, RegistrationFieldsOf(geometry));
  if (!region.ok()) {
    call_queues_.Abandon(req.session(), req.name());
    return call.Complete(region.status());
  }
  auto owner = std::make_shared<QueueOwner>();
  owner->principal = call.principal;
  owner->session = req.session();
  owner->name = req.name();
  owner->decode_allowed = Authenticate(call.ctx, kDecode).status();
  owner->prefill_allowed = Authenticate(call.ctx, kPrefill).status();
  std::shared_ptr<const QueueOwner> shared_owner = owner;
  auto queue =
      std::make_unique<CallQueueServer>(req.name(), geometry, call_queue_options_,
                                        [this, shared_owner](std::unique_ptr<QueuedCall> queued) {
                                          ServeQueued(shared_owner, std::move(queued));
                                        });
  CallQueueServer* q = queue.get();
  const std::string name = req.name();
  absl::StatusOr<RegionHold> hold =
      engine_->HoldRegion(caller, req.name(), [q, name](RegionGone why) {
        q->Stop(why == RegionGone::kUnregistered
                    ? absl::FailedPreconditionError(
                          absl::StrCat("call queue '", name, "' was unregistered"))
                    : absl::NotFoundError(absl::StrCat("the session of call queue '", name,
                                                       "' was closed or expired")));
      });
  if (!hold.ok()) {
    call_queues_.Abandon(req.session(), req.name());
    engine_->UnregisterRegion(caller, req.name()).IgnoreError();
    return call.Complete(hold.status());
  }
  q->Start(*std::move(hold));
  call_queues_.Commit(req.session(), req.name(), std::move(queue));
  region->held = true;
  *call.response.mutable_region() = ToProto(*region);
  call.Complete(absl::OkStatus());
}

void AttentionServiceImpl::ServeQueued(const std::shared_ptr<const QueueOwner>& owner,
                                       std::unique_ptr<QueuedCall> call) {
  if (call->method() == ::attnserve::v1::call_queue::kPrefill) {
    ServeQueuedAs<v1::PrefillRequest>(owner, std::move(call));
  } else {
    ServeQueuedAs<v1::DecodeRequest>(owner, std::move(call));
  }
}

template <typename Request>
void AttentionServiceImpl::ServeQueuedAs(const std::shared_ptr<const QueueOwner>& owner,
                                         std::unique_ptr<QueuedCall> call) {
  constexpr bool kPrefillCall = std::is_same_v<Request, v1::PrefillRequest>;
  const char* const method = kPrefillCall ? kPrefill : kDecode;
  // Lives until the call is answered: the request's tensors point into the slot's copy.
  struct State {
    std::unique_ptr<QueuedCall> slot;
    Request request;
    InlineTensors tensors;
    v1::AttentionResponse response;
  };
  auto state = std::make_shared<State>();
  state->slot = std::move(call);
  const absl::Time arrived = state->slot->taken();
  metrics_->OnRpcStarted();
  const auto finish = [this, method, arrived, owner](State& s, const absl::Status& status,
                                                     absl::Duration retry_after) {
    metrics_->OnRpc(method, status, absl::Now() - arrived);
    if (!status.ok()) {
      LogFailedCall(method, status, "", absl::StrCat("call-queue:", owner->name));
    }
    metrics_->OnRpcFinished();
    std::string bytes;
    if (status.ok()) s.response.SerializeToString(&bytes);
    s.slot->Finish(status, bytes, retry_after);
  };
  const absl::string_view bytes = state->slot->request();
  absl::Status st =
      ReadAttentionRequest(absl::MakeConstSpan(&bytes, 1), &state->request, &state->tensors);
  if (st.ok()) st = kPrefillCall ? owner->prefill_allowed : owner->decode_allowed;
  if (st.ok() && state->request.session().empty()) state->request.set_session(owner->session);
  if (st.ok() && state->request.session() != owner->session) {
    st = absl::InvalidArgumentError(
        absl::StrCat("a call over call queue '", owner->name,
                     "' must name the queue's session (or none): its session is another one"));
  }
  if (!st.ok()) return finish(*state, st, absl::ZeroDuration());
  State* const s = state.get();
  // Room for the response's shapes, region slices and timings beside the outputs' bytes.
  constexpr int64_t kResponseFields = 1024;
  RunAttention(
      s->request, s->tensors, Caller{s->request.session(), owner->principal}, arrived,
      s->slot->deadline(), [s] { return s->slot->cancelled(); },
      static_cast<int64_t>(s->slot->response_capacity()) - kResponseFields, &s->response,
      [state, finish](const absl::Status& status, const CallReport& report) {
        if (status.ok()) {
          if (report.out.size > 0) {
            state->response.mutable_output()->set_data(report.out.data, report.out.size);
          }
          if (report.lse.size > 0) {
            state->response.mutable_lse()->set_data(report.lse.data, report.lse.size);
          }
        }
        finish(*state, status, report.retry_after);
      });
}

}  // namespace attn
