// The data of a Prefill/Decode request's tensors when it arrived in the message: where each
// Tensor field's bytes are (the request reader, server/rpc/request_reader.h, leaves them in the
// gRPC message's slices), by field number.
#pragma once

#include <array>

#include "absl/types/span.h"
#include "attnserve/v1/attention.pb.h"
#include "server/engine/host_bytes.h"

namespace attn {

namespace v1 = ::attnserve::v1;

// The data of the Tensor fields of PrefillRequest/DecodeRequest (field numbers 3 to 8: q, q_pe,
// k_new, v_new, ckv_new, kpe_new).
class InlineTensors {
 public:
  static constexpr int kFirstField = 3;
  static constexpr int kLastField = 8;
  static bool IsTensorField(int field) { return field >= kFirstField && field <= kLastField; }

  const HostBytes& q() const { return of(3); }
  const HostBytes& q_pe() const { return of(4); }
  const HostBytes& k_new() const { return of(5); }
  const HostBytes& v_new() const { return of(6); }
  const HostBytes& ckv_new() const { return of(7); }
  const HostBytes& kpe_new() const { return of(8); }
  const HostBytes& of(int field) const { return data_[field - kFirstField]; }
  HostBytes& mutable_of(int field) { return data_[field - kFirstField]; }
  // Every field's data, from kFirstField to kLastField.
  absl::Span<HostBytes> mutable_all() { return absl::MakeSpan(data_); }

 private:
  std::array<HostBytes, kLastField - kFirstField + 1> data_;
};

// The tensors' data as the message itself holds it (a request parsed by protobuf, or built in a
// test); the HostBytes point into `request`.
template <typename Request>
InlineTensors InlineTensorsOf(const Request& request) {
  InlineTensors t;
  const auto set = [&t](int field, const v1::Tensor& tensor) {
    t.mutable_of(field) = HostBytes(tensor.data().data(), tensor.data().size());
  };
  set(3, request.q());
  set(4, request.q_pe());
  set(5, request.k_new());
  set(6, request.v_new());
  set(7, request.ckv_new());
  set(8, request.kpe_new());
  return t;
}

}  // namespace attn
