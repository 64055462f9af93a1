#include "server/rpc/service.h"

#include <string>
#include <type_traits>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "grpc/grpc_security_constants.h"
#include "grpcpp/support/proto_buffer_reader.h"
#include "grpcpp/support/proto_buffer_writer.h"
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
                                           int64_t max_message_bytes)
    : engine_(engine), metrics_(metrics), auth_(auth), max_message_bytes_(max_message_bytes) {}

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
  absl::StatusOr<RegionInfo> region =
      engine_->RegisterRegion(call.CallerOf(req.session()), req.name(), spec);
  if (!region.ok()) return call.Complete(region.status());
  *call.response.mutable_region() = ToProto(*region);
  call.Complete(absl::OkStatus());
}

void AttentionServiceImpl::HandleUnregisterRegion(
    Call<v1::UnregisterRegionRequest, v1::UnregisterRegionResponse>& call) {
  call.Complete(
      engine_->UnregisterRegion(call.CallerOf(call.request.session()), call.request.name()));
}

void AttentionServiceImpl::HandleListRegions(
    Call<v1::ListRegionsRequest, v1::ListRegionsResponse>& call) {
  absl::StatusOr<std::vector<RegionInfo>> regions =
      engine_->ListRegions(call.CallerOf(call.request.session()));
  if (!regions.ok()) return call.Complete(regions.status());
  for (const RegionInfo& r : *regions) *call.response.add_regions() = ToProto(r);
  call.Complete(absl::OkStatus());
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
  const Request& req = call.request;
  absl::StatusOr<Engine::Pool*> pool = engine_->FindPool(req.pool());
  if (!pool.ok()) return call.Complete(pool.status());
  const PoolGeometry& g = (*pool)->geometry;

  const Caller caller = call.CallerOf(req.session());
  const RegionResolver regions = [this, &caller](absl::Span<const SliceRef> slices) {
    return engine_->ResolveRegions(caller, slices);
  };
  const FiniteCheck finite =
      engine_->backend().ChecksFiniteInputs() ? FiniteCheck::kBackend : FiniteCheck::kHost;
  absl::StatusOr<ValidatedCall> valid;
  if constexpr (std::is_same_v<Request, v1::PrefillRequest>) {
    valid = ValidatePrefill(req, call.tensors, g, regions, finite);
  } else {
    valid = ValidateDecode(req, call.tensors, g, regions, finite);
  }
  if (!valid.ok()) return call.Complete(valid.status());
  const int total_q = valid->call.total_q;
  const bool return_lse = valid->call.return_lse;
  absl::StatusOr<Admission> admitted =
      engine_->Admit(**pool, caller, std::move(valid->call), std::move(valid->regions));
  if (!admitted.ok()) return call.Complete(admitted.status());

  // The outputs' shapes; their bytes are the backend's (sent from its buffer) or in the regions
  // the request named.
  const RowShapes& rows = g.rows();
  v1::Tensor* out = call.response.mutable_output();
  out->set_dtype(v1::DTYPE_BF16);
  out->add_shape(total_q);
  out->add_shape(rows.out.heads);
  out->add_shape(rows.out.dim);
  if (req.has_output_to()) *out->mutable_region() = req.output_to();
  if (return_lse) {
    v1::Tensor* lse = call.response.mutable_lse();
    lse->set_dtype(v1::DTYPE_FP32);
    lse->add_shape(total_q);
    lse->add_shape(rows.lse);
    if (req.has_lse_to()) *lse->mutable_region() = req.lse_to();
  }

  grpc::CallbackServerContext* ctx = call.ctx;
  engine_->Submit(
      *std::move(admitted), ToAbslTime(ctx->deadline()), [ctx] { return ctx->IsCancelled(); },
      [&call](const absl::Status& st, const CallReport& report) {
        if (st.ok()) {
          v1::Timings* t = call.response.mutable_timings();
          t->set_queue_us(Micros(report.launched - report.enqueued));
          t->set_compute_us(Micros(report.launch.compute));
          t->set_prepare_us(Micros(report.launch.prepare));
          t->set_execute_us(Micros(report.launch.execute));
          t->set_finish_us(Micros(report.launch.finish));
          t->set_total_us(Micros(report.finished - call.arrived));
          t->set_batch_requests(report.batch_requests);
          call.out = report.out;
          call.lse = report.lse;
        }
        if (report.retry_after > absl::ZeroDuration()) {
          // The standard gRPC retry-pushback trailer: clients with a retry policy wait this long.
          call.ctx->AddTrailingMetadata(
              "grpc-retry-pushback-ms",
              absl::StrCat(absl::ToInt64Milliseconds(report.retry_after)));
        }
        call.Complete(st);
      });
}

}  // namespace attn
