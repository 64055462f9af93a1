#include "server/rpc/response_writer.h"

#include <memory>

#include "server/rpc/tensor_message.h"

namespace attn {
namespace {

// A slice over a backend's buffer that holds a reference to it until gRPC is done with it.
grpc::Slice SliceOf(const SharedBytes& bytes) {
  if (bytes.size == 0) return grpc::Slice();
  auto* owner = new std::shared_ptr<const void>(bytes.owner);
  return grpc::Slice(
      const_cast<char*>(bytes.data), bytes.size,
      [](void* p) { delete static_cast<std::shared_ptr<const void>*>(p); }, owner);
}

}  // namespace

grpc::ByteBuffer WriteAttentionResponse(const v1::AttentionResponse& response,
                                        const SharedBytes& output, const SharedBytes& lse) {
  const TensorSlice tensors[] = {{v1::AttentionResponse::kOutputFieldNumber, SliceOf(output)},
                                 {v1::AttentionResponse::kLseFieldNumber, SliceOf(lse)}};
  return WriteTensorMessage(response, tensors);
}

}  // namespace attn
