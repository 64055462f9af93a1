// The gRPC edge: AttentionService over an Engine. Handlers check the caller's token, validate,
// enqueue and return without blocking; the batcher thread finishes Prefill and Decode calls.
//
// Every method is registered "raw" (the request arrives as bytes): the service parses it itself,
// so bytes that are not a valid request get INVALID_ARGUMENT with a message, where gRPC's own
// parsing would answer UNIMPLEMENTED with none. Prefill and Decode are read without copying
// their tensors (server/rpc/request_reader.h), and their outputs are sent from the backend's
// buffers (server/rpc/response_writer.h).
#pragma once

#include <string>

#include "attnserve/v1/attention.grpc.pb.h"
#include "server/api/inline_tensors.h"
#include "server/engine/engine.h"
#include "server/metrics/metrics.h"
#include "server/rpc/allocator_trim.h"
#include "server/rpc/auth.h"
#include "server/rpc/call_queue.h"

namespace attn {

namespace v1 = ::attnserve::v1;

inline constexpr char kVersion[] = "0.1.0";

// AttentionService with every method taking the request as raw bytes.
using RawAttentionService = v1::AttentionService::WithRawCallbackMethod_GetServerInfo<
    v1::AttentionService::WithRawCallbackMethod_AllocatePages<
        v1::AttentionService::WithRawCallbackMethod_FreePages<
            v1::AttentionService::WithRawCallbackMethod_Prefill<
                v1::AttentionService::WithRawCallbackMethod_Decode<
                    v1::AttentionService::WithRawCallbackMethod_OpenSession<
                        v1::AttentionService::WithRawCallbackMethod_CloseSession<
                            v1::AttentionService::WithRawCallbackMethod_RegisterRegion<
                                v1::AttentionService::WithRawCallbackMethod_UnregisterRegion<
                                    v1::AttentionService::WithRawCallbackMethod_ListRegions<
                                        v1::AttentionService::WithRawCallbackMethod_CreatePlan<
                                            v1::AttentionService::WithRawCallbackMethod_ReleasePlan<
                                                v1::AttentionService::Service>>>>>>>>>>>>;

class AttentionServiceImpl final : public RawAttentionService {
 public:
  // `engine`, `metrics` and `auth` must outlive the service. The engine decides; the service
  // converts requests into engine calls and their results into responses and statuses.
  AttentionServiceImpl(Engine* engine, Metrics* metrics, const Authorizer* auth,
                       int64_t max_message_bytes, CallQueueOptions call_queue_options = {});
  ~AttentionServiceImpl() override;

  // Stops every call queue (their waiting slots are answered UNAVAILABLE) and waits for their
  // calls: before the engine goes away.
  void StopCallQueues();

  grpc::ServerUnaryReactor* GetServerInfo(grpc::CallbackServerContext* ctx,
                                          const grpc::ByteBuffer* in,
                                          grpc::ByteBuffer* out) override;
  grpc::ServerUnaryReactor* AllocatePages(grpc::CallbackServerContext* ctx,
                                          const grpc::ByteBuffer* in,
                                          grpc::ByteBuffer* out) override;
  grpc::ServerUnaryReactor* FreePages(grpc::CallbackServerContext* ctx, const grpc::ByteBuffer* in,
                                      grpc::ByteBuffer* out) override;
  grpc::ServerUnaryReactor* Prefill(grpc::CallbackServerContext* ctx, const grpc::ByteBuffer* in,
                                    grpc::ByteBuffer* out) override;
  grpc::ServerUnaryReactor* Decode(grpc::CallbackServerContext* ctx, const grpc::ByteBuffer* in,
                                   grpc::ByteBuffer* out) override;
  grpc::ServerUnaryReactor* OpenSession(grpc::CallbackServerContext* ctx,
                                        const grpc::ByteBuffer* in, grpc::ByteBuffer* out) override;
  grpc::ServerUnaryReactor* CloseSession(grpc::CallbackServerContext* ctx,
                                         const grpc::ByteBuffer* in,
                                         grpc::ByteBuffer* out) override;
  grpc::ServerUnaryReactor* RegisterRegion(grpc::CallbackServerContext* ctx,
                                           const grpc::ByteBuffer* in,
                                           grpc::ByteBuffer* out) override;
  grpc::ServerUnaryReactor* UnregisterRegion(grpc::CallbackServerContext* ctx,
                                             const grpc::ByteBuffer* in,
                                             grpc::ByteBuffer* out) override;
  grpc::ServerUnaryReactor* ListRegions(grpc::CallbackServerContext* ctx,
                                        const grpc::ByteBuffer* in, grpc::ByteBuffer* out) override;
  grpc::ServerUnaryReactor* CreatePlan(grpc::CallbackServerContext* ctx, const grpc::ByteBuffer* in,
                                       grpc::ByteBuffer* out) override;
  grpc::ServerUnaryReactor* ReleasePlan(grpc::CallbackServerContext* ctx,
                                        const grpc::ByteBuffer* in, grpc::ByteBuffer* out) override;

 private:
  // One call: its parsed request, its response, and how it finishes (service.cc).
  template <typename Request, typename Response>
  class Call;
  template <typename Request, typename Response>
  using Handler = void (AttentionServiceImpl::*)(Call<Request, Response>&);

  // Parses the request, checks the token, runs `handle`, which finishes the call (now or later).
  template <typename Request, typename Response>
  grpc::ServerUnaryReactor* Serve(const char* method, grpc::CallbackServerContext* ctx,
                                  const grpc::ByteBuffer* in, grpc::ByteBuffer* out,
                                  Handler<Request, Response> handle);

  void HandleGetServerInfo(Call<v1::GetServerInfoRequest, v1::GetServerInfoResponse>& call);
  void HandleAllocatePages(Call<v1::AllocatePagesRequest, v1::AllocatePagesResponse>& call);
  void HandleFreePages(Call<v1::FreePagesRequest, v1::FreePagesResponse>& call);
  void HandleOpenSession(Call<v1::OpenSessionRequest, v1::OpenSessionResponse>& call);
  void HandleCloseSession(Call<v1::CloseSessionRequest, v1::CloseSessionResponse>& call);
  void HandleRegisterRegion(Call<v1::RegisterRegionRequest, v1::RegisterRegionResponse>& call);
  void HandleUnregisterRegion(
      Call<v1::UnregisterRegionRequest, v1::UnregisterRegionResponse>& call);
  void HandleListRegions(Call<v1::ListRegionsRequest, v1::ListRegionsResponse>& call);
  void HandleCreatePlan(Call<v1::CreatePlanRequest, v1::CreatePlanResponse>& call);
  void HandleReleasePlan(Call<v1::ReleasePlanRequest, v1::ReleasePlanResponse>& call);
  template <typename Request>
  void HandleAttention(Call<Request, v1::AttentionResponse>& call);

  // What the gRPC handlers and the call queues share for Prefill and Decode: validates `req`
  // against its pool, admits it for `caller` and submits it. `done` runs once (here when the
  // call is refused, on the batcher thread otherwise); on success `*response` then has the
  // outputs' shapes (and region slices) and the timings, and the report the outputs left for the
  // response. Outputs not in a region must fit `max_inline_output_bytes` (INVALID_ARGUMENT).
  using AttentionDone = std::function<void(const absl::Status&, const CallReport&)>;
  template <typename Request>
  void RunAttention(const Request& req, const InlineTensors& tensors, const Caller& caller,
                    absl::Time arrived, absl::Time deadline, std::function<bool()> is_cancelled,
                    int64_t max_inline_output_bytes, v1::AttentionResponse* response,
                    AttentionDone done);

  // Call queues: registration (a RegisterRegion with call_queue set) and the calls taken out of
  // a queue's slots.
  struct QueueOwner;
  void RegisterCallQueue(Call<v1::RegisterRegionRequest, v1::RegisterRegionResponse>& call,
                         const RegionSpec& spec);
  void ServeQueued(const std::shared_ptr<const QueueOwner>& owner,
                   std::unique_ptr<QueuedCall> call);
  template <typename Request>
  void ServeQueuedAs(const std::shared_ptr<const QueueOwner>& owner,
                     std::unique_ptr<QueuedCall> call);

  // Who makes the call: the principal of its bearer token (UNAUTHENTICATED / PERMISSION_DENIED
  // when it may not call `method`), or without tokens that of its client certificate, or
  // anonymous.
  absl::StatusOr<Principal> Authenticate(grpc::CallbackServerContext* ctx,
                                         const char* method) const;

  Engine* const engine_;
  Metrics* const metrics_;
  const Authorizer* const auth_;
  const int64_t max_message_bytes_;
  const CallQueueOptions call_queue_options_;
  AllocatorTrimmer trimmer_;
  CallQueues call_queues_;
};

}  // namespace attn
