#include "server/rpc/response_writer.h"

#include <string>
#include <vector>

#include "google/protobuf/io/coded_stream.h"
#include "google/protobuf/wire_format_lite.h"

namespace attn {
namespace {

using google::protobuf::internal::WireFormatLite;

void AppendVarint(uint64_t v, std::string* out) {
  char buf[10];
  const uint8_t* end = google::protobuf::io::CodedOutputStream::WriteVarint64ToArray(
      v, reinterpret_cast<uint8_t*>(buf));
  out->append(buf, reinterpret_cast<const char*>(end) - buf);
}

void AppendTag(int field, WireFormatLite::WireType type, std::string* out) {
  AppendVarint(WireFormatLite::MakeTag(field, type), out);
}

// Field `field` of AttentionResponse: the Tensor `t` (data empty) with `data` as its data.
void AppendTensor(int field, const v1::Tensor& t, const SharedBytes& data,
                  std::vector<grpc::Slice>* slices) {
  std::string head = t.SerializeAsString();
  std::string data_head;
  if (data.size > 0) {
    AppendTag(v1::Tensor::kDataFieldNumber, WireFormatLite::WIRETYPE_LENGTH_DELIMITED, &data_head);
    AppendVarint(data.size, &data_head);
  }
  std::string prefix;
  AppendTag(field, WireFormatLite::WIRETYPE_LENGTH_DELIMITED, &prefix);
  AppendVarint(head.size() + data_head.size() + data.size, &prefix);
  slices->emplace_back(prefix + head + data_head);
  if (data.size == 0) return;
  // The slice holds a reference to the buffer until gRPC is done with it.
  auto* owner = new std::shared_ptr<const void>(data.owner);
  slices->emplace_back(
      const_cast<char*>(data.data), data.size,
      [](void* p) { delete static_cast<std::shared_ptr<const void>*>(p); }, owner);
}

}  // namespace

grpc::ByteBuffer WriteAttentionResponse(const v1::AttentionResponse& response,
                                        const SharedBytes& output, const SharedBytes& lse) {
  std::vector<grpc::Slice> slices;
  if (response.has_output()) {
    AppendTensor(v1::AttentionResponse::kOutputFieldNumber, response.output(), output, &slices);
  }
  if (response.has_lse()) {
    AppendTensor(v1::AttentionResponse::kLseFieldNumber, response.lse(), lse, &slices);
  }
  v1::AttentionResponse rest = response;
  rest.clear_output();
  rest.clear_lse();
  if (std::string tail = rest.SerializeAsString(); !tail.empty()) slices.emplace_back(tail);
  return grpc::ByteBuffer(slices.data(), slices.size());
}

}  // namespace attn
