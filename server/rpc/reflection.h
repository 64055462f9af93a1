// gRPC server reflection (grpc.reflection.v1 and its earlier name grpc.reflection.v1alpha) over
// the protobuf descriptors compiled into the binary: the services a server offers and the files
// that define them, which grpcurl and other tools ask for to call it without .proto files.
//
// gRPC's own reflection plugin serves only v1alpha in the gRPC this builds against, and it is a
// process-wide plugin: every server built in the process gets it, the plaintext health port
// included. This one is registered on the servers that should have it. The descriptors include
// grpc.health.v1 (proto/grpc/health/v1/health.proto), which gRPC's built-in health service does
// not carry. Thread safe; each stream is answered on its own handler thread.
#pragma once

#include <memory>
#include <string>
#include <vector>

#include "grpcpp/impl/codegen/service_type.h"

namespace attn {

class Reflection {
 public:
  // `services`: the fully qualified names list_services answers (reflection adds its own two).
  explicit Reflection(std::vector<std::string> services);
  ~Reflection();

  // The two services to register on a grpc::ServerBuilder; owned by this object.
  grpc::Service* v1() { return v1_.get(); }
  grpc::Service* v1alpha() { return v1alpha_.get(); }

 private:
  const std::vector<std::string> services_;
  std::unique_ptr<grpc::Service> v1_;
  std::unique_ptr<grpc::Service> v1alpha_;
};

}  // namespace attn
