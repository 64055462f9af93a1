// Conversion of absl::Status to grpc::Status at the RPC edge (and back, for tests).
#pragma once

#include "absl/status/status.h"
#include "grpcpp/support/status.h"

namespace attn {

grpc::Status ToGrpcStatus(const absl::Status& status);
absl::Status FromGrpcStatus(const grpc::Status& status);

}  // namespace attn
