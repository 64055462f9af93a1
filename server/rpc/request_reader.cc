#include "server/rpc/request_reader.h"

#include "absl/strings/str_cat.h"
#include "server/rpc/tensor_message.h"

namespace attn {
namespace {

absl::Status Named(absl::Status st) {
  if (st.ok()) return st;
  return absl::InvalidArgumentError(absl::StrCat("the request is ", st.message()));
}

}  // namespace

absl::Status ReadAttentionRequest(absl::Span<const absl::string_view> pieces,
                                  google::protobuf::Message* request, InlineTensors* tensors) {
  return Named(ReadTensorMessage(pieces, InlineTensors::kFirstField, InlineTensors::kLastField,
                                 request, tensors->mutable_all()));
}

absl::Status ReadAttentionRequest(const grpc::ByteBuffer& in, std::vector<grpc::Slice>* slices,
                                  v1::PrefillRequest* request, InlineTensors* tensors) {
  return Named(ReadTensorMessage(in, slices, InlineTensors::kFirstField, InlineTensors::kLastField,
                                 request, tensors->mutable_all()));
}

absl::Status ReadAttentionRequest(const grpc::ByteBuffer& in, std::vector<grpc::Slice>* slices,
                                  v1::DecodeRequest* request, InlineTensors* tensors) {
  return Named(ReadTensorMessage(in, slices, InlineTensors::kFirstField, InlineTensors::kLastField,
                                 request, tensors->mutable_all()));
}

}  // namespace attn
