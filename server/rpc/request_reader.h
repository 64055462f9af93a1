// Reads a Prefill or Decode request from the bytes of a gRPC message without copying its tensors
// (tensor_message.h): the data of each Tensor field is left where it arrived (HostBytes pieces
// pointing into the slices), everything else goes through protobuf's own parser.
//
// Protobuf's parser copies every `bytes` field into a string of its own (about 85 ms for an
// 8192-token prefill's q on the H200 host, bench/RESULTS.md), and the backend then copies the
// string again into its staging. The Tensor messages in the parsed request carry dtype, shape
// and region; their data is empty and `tensors` holds it instead.
#pragma once

#include <vector>

#include "absl/status/status.h"
#include "absl/strings/string_view.h"
#include "absl/types/span.h"
#include "attnserve/v1/attention.pb.h"
#include "grpcpp/support/byte_buffer.h"
#include "grpcpp/support/slice.h"
#include "server/api/inline_tensors.h"

namespace attn {

namespace v1 = ::attnserve::v1;

// Parses `in` into `request` and `tensors`. `slices` receives the message's slices, which the
// HostBytes point into: keep it alive as long as they are used. INVALID_ARGUMENT for bytes that
// are not a valid message of the type.
absl::Status ReadAttentionRequest(const grpc::ByteBuffer& in, std::vector<grpc::Slice>* slices,
                                  v1::PrefillRequest* request, InlineTensors* tensors);
absl::Status ReadAttentionRequest(const grpc::ByteBuffer& in, std::vector<grpc::Slice>* slices,
                                  v1::DecodeRequest* request, InlineTensors* tensors);

// The same over bytes already in memory (one slice); for tests and the fuzzer.
absl::Status ReadAttentionRequest(absl::Span<const absl::string_view> pieces,
                                  google::protobuf::Message* request, InlineTensors* tensors);

}  // namespace attn
