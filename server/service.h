// The gRPC edge: AttentionService over an Engine. Handlers validate, enqueue and return without
// blocking; the batcher thread finishes each call.
#pragma once

#include <string>

#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"

#include "attnserve/v1/attention.grpc.pb.h"
#include "server/auth.h"
#include "server/engine.h"
#include "server/metrics.h"

namespace attn {

namespace v1 = ::attnserve::v1;

inline constexpr char kVersion[] = "0.1.0";

class AttentionServiceImpl final : public v1::AttentionService::CallbackService {
 public:
  // `engine`, `metrics` and `auth` must outlive the service.
  AttentionServiceImpl(Engine* engine, Metrics* metrics, const Authorizer* auth,
                       int64_t max_message_bytes);

  // Graceful drain: from now on Prefill, Decode and AllocatePages answer UNAVAILABLE (FreePages
  // and GetServerInfo keep working so clients can give their pages back); calls already accepted
  // run to completion.
  void StartDrain();
  // Waits until every accepted Prefill/Decode has finished, or until `deadline`. True if idle.
  bool WaitForIdle(absl::Time deadline);

  grpc::ServerUnaryReactor* GetServerInfo(grpc::CallbackServerContext* ctx,
                                          const v1::GetServerInfoRequest* req,
                                          v1::GetServerInfoResponse* resp) override;
  grpc::ServerUnaryReactor* AllocatePages(grpc::CallbackServerContext* ctx,
                                          const v1::AllocatePagesRequest* req,
                                          v1::AllocatePagesResponse* resp) override;
  grpc::ServerUnaryReactor* FreePages(grpc::CallbackServerContext* ctx,
                                      const v1::FreePagesRequest* req,
                                      v1::FreePagesResponse* resp) override;
  grpc::ServerUnaryReactor* Prefill(grpc::CallbackServerContext* ctx,
                                    const v1::PrefillRequest* req,
                                    v1::AttentionResponse* resp) override;
  grpc::ServerUnaryReactor* Decode(grpc::CallbackServerContext* ctx,
                                   const v1::DecodeRequest* req,
                                   v1::AttentionResponse* resp) override;
  grpc::ServerUnaryReactor* OpenSession(grpc::CallbackServerContext* ctx,
                                        const v1::OpenSessionRequest* req,
                                        v1::OpenSessionResponse* resp) override;
  grpc::ServerUnaryReactor* CloseSession(grpc::CallbackServerContext* ctx,
                                         const v1::CloseSessionRequest* req,
                                         v1::CloseSessionResponse* resp) override;

 private:
  template <typename Request>
  grpc::ServerUnaryReactor* Attention(Op op, grpc::CallbackServerContext* ctx,
                                      const Request& req, v1::AttentionResponse* resp);

  // Finishes a call and records it (method, status, server-side duration since `arrived`).
  void Finish(grpc::ServerUnaryReactor* reactor, const char* method, absl::Time arrived,
              const absl::Status& status);
  grpc::ServerUnaryReactor* FinishNow(grpc::CallbackServerContext* ctx, const char* method,
                                      absl::Time arrived, const absl::Status& status);
  void UpdatePoolGauges(const Engine::Pool& pool);

  // Starts a call: counts it in flight and checks its token may call `method`.
  absl::Status Begin(grpc::CallbackServerContext* ctx, const char* method);

  // The session a call names, or its connection's implicit one; renews the lease.
  absl::StatusOr<SessionId> Session(grpc::CallbackServerContext* ctx, const std::string& handle);

  // Counts an accepted attention call, or returns UNAVAILABLE while draining.
  absl::Status Admit();
  void Release();

  Engine* const engine_;
  Metrics* const metrics_;
  const Authorizer* const auth_;
  absl::Mutex mu_;
  bool draining_ ABSL_GUARDED_BY(mu_) = false;
  int active_calls_ ABSL_GUARDED_BY(mu_) = 0;  // accepted Prefill/Decode not yet finished
  const int64_t max_message_bytes_;
};

}  // namespace attn
