#include "server/rpc/grpc_status.h"

#include <string>

namespace attn {

// absl::StatusCode and grpc::StatusCode share the canonical code numbering. A message over
// kMaxMessageBytes is cut: it travels in a trailer, and one larger than the client's metadata
// limit would reach it as RESOURCE_EXHAUSTED instead of the real error (messages quote parts of
// the request, which a hostile client makes long).
grpc::Status ToGrpcStatus(const absl::Status& status) {
  if (status.ok()) return grpc::Status::OK;
  constexpr size_t kMaxMessageBytes = 1024;
  std::string message(status.message().substr(0, kMaxMessageBytes));
  if (status.message().size() > kMaxMessageBytes) {
    message += "... (" + std::to_string(status.message().size()) + " bytes)";
  }
  return grpc::Status(static_cast<grpc::StatusCode>(status.code()), std::move(message));
}

absl::Status FromGrpcStatus(const grpc::Status& status) {
  return absl::Status(static_cast<absl::StatusCode>(status.error_code()), status.error_message());
}

}  // namespace attn
