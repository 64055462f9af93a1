// Messages whose Tensor fields' `bytes data` travel as their own gRPC slices, in both directions
// and on both ends of a call: the wire format stays exactly protobuf's, but the tensor bytes are
// neither copied into a std::string by protobuf's parser nor copied out of one by its serializer.
//
// The server reads requests (request_reader.h) and writes responses (response_writer.h) this way;
// a C++ client (bench/loadgen.cc) writes requests and reads responses the same way.
//
// Reading: the message's wire format is walked over its slices; the data of each Tensor field in
// [first_field, last_field] is left where it arrived (HostBytes pieces pointing into the slices),
// everything else -- a few hundred bytes of scalars, shapes and page-table ints -- goes through
// protobuf's own parser, so the message means exactly what protobuf would make of it (duplicate
// fields merge, the last `data` wins, unknown fields are kept, strings must be UTF-8). The Tensor
// messages of the parsed message carry dtype, shape and region; their data is empty.
//
// Writing: the bytes protobuf would write for the message with the given data in its Tensor
// fields, byte for byte, as small slices of serialized fields around the callers' data slices.
//
// Thread safety: plain functions over their arguments.
#pragma once

#include <vector>

#include "absl/status/status.h"
#include "absl/strings/string_view.h"
#include "absl/types/span.h"
#include "google/protobuf/message.h"
#include "grpcpp/support/byte_buffer.h"
#include "grpcpp/support/slice.h"
#include "server/engine/host_bytes.h"

namespace attn {

// Parses `pieces` into `message`; data[i] receives the data of the Tensor field numbered
// first_field + i (data.size() == last_field - first_field + 1; fields absent from the message
// leave theirs empty). INVALID_ARGUMENT for bytes that are not a valid message of the type.
absl::Status ReadTensorMessage(absl::Span<const absl::string_view> pieces, int first_field,
                               int last_field, google::protobuf::Message* message,
                               absl::Span<HostBytes> data);

// The same over a gRPC message: `slices` receives its slices, which the HostBytes point into
// (keep it alive as long as they are used).
absl::Status ReadTensorMessage(const grpc::ByteBuffer& in, std::vector<grpc::Slice>* slices,
                               int first_field, int last_field, google::protobuf::Message* message,
                               absl::Span<HostBytes> data);

// The data of one Tensor field of a message being written.
struct TensorSlice {
  int field;         // the field's number in the message; the field must hold an attnserve Tensor
  grpc::Slice data;  // its bytes; the slice's own reference keeps them alive while gRPC sends
};

// `message` as protobuf would serialize it (deterministically, fields in number order, unknown
// fields last) with each present Tensor field of `tensors` carrying that slice as its data
// instead of its own. A listed field the message does not have is not written (its slice is
// unused). Each listed field's own data is ignored.
grpc::ByteBuffer WriteTensorMessage(const google::protobuf::Message& message,
                                    absl::Span<const TensorSlice> tensors);

// A slice over memory the caller keeps alive and unchanged until gRPC is done with every
// message built from it (e.g. a request a client sends again and again).
grpc::Slice BorrowedSlice(const char* data, size_t size);

}  // namespace attn
