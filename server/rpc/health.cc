#include "server/rpc/health.h"

#include "absl/time/clock.h"
#include "server/engine/client_text.h"

namespace attn {

using grpc::health::v1::HealthCheckResponse;

void HealthStatus::Set(const std::string& service, bool serving) {
  absl::MutexLock lock(&mu_);
  if (shut_down_) return;
  auto [it, inserted] = serving_.try_emplace(service, serving);
  if (!inserted && it->second == serving) return;
  it->second = serving;
  ++version_;
}

void HealthStatus::Shutdown() {
  absl::MutexLock lock(&mu_);
  for (auto& [name, serving] : serving_) serving = false;
  shut_down_ = true;
  ++version_;
}

HealthStatus::Status HealthStatus::Get(const std::string& service) const {
  auto it = serving_.find(service);
  if (it == serving_.end()) return HealthCheckResponse::SERVICE_UNKNOWN;
  return it->second ? HealthCheckResponse::SERVING : HealthCheckResponse::NOT_SERVING;
}

grpc::Status HealthService::Check(grpc::ServerContext*,
                                  const grpc::health::v1::HealthCheckRequest* req,
                                  HealthCheckResponse* resp) {
  absl::ReaderMutexLock lock(&status_->mu_);
  const HealthStatus::Status status = status_->Get(req->service());
  if (status == HealthCheckResponse::SERVICE_UNKNOWN) {
    return grpc::Status(grpc::StatusCode::NOT_FOUND,
                        "no service '" + ShownClientString(req->service()) + "' here");
  }
  resp->set_status(status);
  return grpc::Status::OK;
}

grpc::Status HealthService::Watch(grpc::ServerContext* ctx,
                                  const grpc::health::v1::HealthCheckRequest* req,
                                  grpc::ServerWriter<HealthCheckResponse>* writer) {
  struct Changed {
    const HealthStatus* status;
    const int64_t* seen;
  };
  int64_t seen = -1;
  const Changed changed{status_, &seen};
  bool first = true;
  HealthStatus::Status last = HealthCheckResponse::UNKNOWN;
  for (;;) {
    HealthStatus::Status now;
    bool shut_down;
    {
      absl::MutexLock lock(&status_->mu_);
      // Wake on a change, or every second to notice a client that went away.
      status_->mu_.AwaitWithTimeout(absl::Condition(
                                        +[](const Changed* c) ABSL_NO_THREAD_SAFETY_ANALYSIS {
                                          return c->status->version_ != *c->seen;
                                        },
                                        &changed),
                                    absl::Seconds(1));
      if (ctx->IsCancelled()) return grpc::Status::CANCELLED;
      if (status_->version_ == seen) continue;
      seen = status_->version_;
      now = status_->Get(req->service());
      shut_down = status_->shut_down_;
    }
    if (first || now != last) {
      HealthCheckResponse resp;
      resp.set_status(now);
      if (!writer->Write(resp)) return grpc::Status::OK;
      first = false;
      last = now;
    }
    if (shut_down) return grpc::Status::OK;
  }
}

}  // namespace attn
