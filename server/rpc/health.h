// grpc.health.v1 (proto/grpc/health/v1/health.proto), with a status per service name: Check and
// Watch over one table that both the main port and the plaintext health port serve.
//
// gRPC's built-in health service is not used: in the gRPC this builds against it needs a
// synchronously polled server (a port serving health alone fails to start), it carries no
// descriptor for reflection, and it knows only one status per name, with no notion of live and
// ready. Thread safe.
#pragma once

#include <map>
#include <memory>
#include <string>

#include "absl/base/thread_annotations.h"
#include "absl/synchronization/mutex.h"
#include "grpc/health/v1/health.grpc.pb.h"

namespace attn {

// The statuses, by service name ("" is the whole server).
class HealthStatus {
 public:
  void Set(const std::string& service, bool serving);
  // Every status NOT_SERVING for good, and every Watch ends: the process is going away.
  void Shutdown();

 private:
  friend class HealthService;
  using Status = grpc::health::v1::HealthCheckResponse::ServingStatus;
  // The status of `service` (SERVICE_UNKNOWN for a name never set).
  Status Get(const std::string& service) const ABSL_SHARED_LOCKS_REQUIRED(mu_);

  mutable absl::Mutex mu_;
  std::map<std::string, bool> serving_ ABSL_GUARDED_BY(mu_);
  int64_t version_ ABSL_GUARDED_BY(mu_) = 0;  // counts changes, for Watch
  bool shut_down_ ABSL_GUARDED_BY(mu_) = false;
};

// The service of one server over a shared table (a grpc::Service belongs to one server).
class HealthService final : public grpc::health::v1::Health::Service {
 public:
  explicit HealthService(HealthStatus* status) : status_(status) {}

  // NOT_FOUND for a name the server does not report.
  grpc::Status Check(grpc::ServerContext* ctx, const grpc::health::v1::HealthCheckRequest* req,
                     grpc::health::v1::HealthCheckResponse* resp) override;
  // The status now, then each change, until the client cancels or the server shuts down.
  grpc::Status Watch(grpc::ServerContext* ctx, const grpc::health::v1::HealthCheckRequest* req,
                     grpc::ServerWriter<grpc::health::v1::HealthCheckResponse>* writer) override;

 private:
  HealthStatus* const status_;
};

}  // namespace attn
