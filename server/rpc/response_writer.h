// Serializes an AttentionResponse whose output and lse bytes live in a backend's buffers
// (SharedBytes) as slices that point into those buffers (tensor_message.h), so the tensors are
// not copied into the response message and again into the gRPC buffer.
#pragma once

#include "attnserve/v1/attention.pb.h"
#include "grpcpp/support/byte_buffer.h"
#include "server/engine/host_bytes.h"

namespace attn {

namespace v1 = ::attnserve::v1;

// `response` with output.data = `output` and lse.data = `lse` (each only when the response has
// that Tensor; the Tensor's own data field is ignored), as the bytes protobuf would write.
grpc::ByteBuffer WriteAttentionResponse(const v1::AttentionResponse& response,
                                        const SharedBytes& output, const SharedBytes& lse);

}  // namespace attn
