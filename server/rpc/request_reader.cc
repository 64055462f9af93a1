#include "server/rpc/request_reader.h"

#include <cstdint>
#include <string>

#include "absl/strings/str_cat.h"
#include "google/protobuf/descriptor.h"

namespace attn {
namespace {

enum WireType : int { kVarint = 0, kFixed64 = 1, kLengthDelimited = 2, kFixed32 = 5 };

// Sequential reads over a message split into pieces.
class PieceReader {
 public:
  explicit PieceReader(absl::Span<const absl::string_view> pieces) : pieces_(pieces) {
    for (absl::string_view p : pieces) left_ += p.size();
  }

  uint64_t left() const { return left_; }

  bool Byte(uint8_t* b) {
    while (piece_ < pieces_.size() && at_ == pieces_[piece_].size()) Next();
    if (piece_ == pieces_.size()) return false;
    *b = static_cast<uint8_t>(pieces_[piece_][at_++]);
    --left_;
    return true;
  }

  // A varint, also appended as it was encoded to `raw` when given.
  bool Varint(uint64_t* v, std::string* raw = nullptr) {
    *v = 0;
    for (int shift = 0; shift < 64; shift += 7) {
      uint8_t b;
      if (!Byte(&b)) return false;
      if (raw) raw->push_back(static_cast<char>(b));
      *v |= uint64_t{b & 0x7fu} << shift;
      if ((b & 0x80) == 0) return true;
    }
    return false;  // longer than 10 bytes
  }

  // The next n bytes, as pieces (no copy).
  bool Take(uint64_t n, HostBytes* out) {
    if (n > left_) return false;
    while (n > 0) {
      while (at_ == pieces_[piece_].size()) Next();
      const uint64_t take = std::min<uint64_t>(n, pieces_[piece_].size() - at_);
      if (out) out->Append(pieces_[piece_].data() + at_, take);
      at_ += take;
      left_ -= take;
      n -= take;
    }
    return true;
  }

  // The next n bytes, copied onto `out`.
  bool Copy(uint64_t n, std::string* out) {
    if (n > left_) return false;
    HostBytes bytes;
    Take(n, &bytes);
    const size_t at = out->size();
    out->resize(at + n);
    bytes.CopyTo(out->data() + at);
    return true;
  }

 private:
  void Next() {
    ++piece_;
    at_ = 0;
  }

  absl::Span<const absl::string_view> pieces_;
  size_t piece_ = 0;
  size_t at_ = 0;
  uint64_t left_ = 0;
};

// Copies the rest of a field whose tag was read onto `raw` (tag included by the caller).
bool CopyField(PieceReader& in, int wire_type, std::string* raw) {
  uint64_t len = 0;
  switch (wire_type) {
    case kVarint:
      return in.Varint(&len, raw);
    case kFixed64:
      return in.Copy(8, raw);
    case kFixed32:
      return in.Copy(4, raw);
    case kLengthDelimited:
      return in.Varint(&len, raw) && in.Copy(len, raw);
    default:
      return false;  // groups do not occur in proto3
  }
}

// One Tensor message of `len` bytes: its data goes to `data` (the last occurrence wins, as in
// protobuf), every other field onto `rest`.
bool ReadTensor(PieceReader& in, uint64_t len, HostBytes* data, std::string* rest) {
  if (len > in.left()) return false;
  const uint64_t end = in.left() - len;
  while (in.left() > end) {
    std::string tag_bytes;
    uint64_t tag = 0;
    if (!in.Varint(&tag, &tag_bytes)) return false;
    const int field = static_cast<int>(tag >> 3);
    const int wire_type = static_cast<int>(tag & 7);
    if (field == 0) return false;
    if (field == v1::Tensor::kDataFieldNumber && wire_type == kLengthDelimited) {
      uint64_t n = 0;
      if (!in.Varint(&n) || n > in.left() - end) return false;
      *data = HostBytes();
      in.Take(n, data);
    } else {
      rest->append(tag_bytes);
      if (!CopyField(in, wire_type, rest)) return false;
    }
    if (in.left() < end) return false;  // a field ran past the Tensor's length
  }
  return true;
}

absl::Status Invalid(const google::protobuf::Message& request, uint64_t bytes) {
  return absl::InvalidArgumentError(absl::StrCat("the request is not a valid ",
                                                 request.GetDescriptor()->full_name(), " (", bytes,
                                                 " bytes): truncated or corrupt protobuf"));
}

}  // namespace

absl::Status ReadAttentionRequest(absl::Span<const absl::string_view> pieces,
                                  google::protobuf::Message* request, InlineTensors* tensors) {
  PieceReader in(pieces);
  const uint64_t total = in.left();
  std::string rest;  // every field but the tensors, re-assembled for protobuf
  std::array<std::string, InlineTensors::kLastField - InlineTensors::kFirstField + 1> tensor_rest;
  std::array<bool, InlineTensors::kLastField - InlineTensors::kFirstField + 1> seen{};
  while (in.left() > 0) {
    std::string tag_bytes;
    uint64_t tag = 0;
    if (!in.Varint(&tag, &tag_bytes)) return Invalid(*request, total);
    const int field = static_cast<int>(tag >> 3);
    const int wire_type = static_cast<int>(tag & 7);
    if (field == 0) return Invalid(*request, total);
    if (InlineTensors::IsTensorField(field) && wire_type == kLengthDelimited) {
      uint64_t len = 0;
      const int i = field - InlineTensors::kFirstField;
      if (!in.Varint(&len) || !ReadTensor(in, len, &tensors->mutable_of(field), &tensor_rest[i])) {
        return Invalid(*request, total);
      }
      seen[i] = true;
    } else {
      rest.append(tag_bytes);
      if (!CopyField(in, wire_type, &rest)) return Invalid(*request, total);
    }
  }
  if (!request->ParseFromString(rest)) return Invalid(*request, total);
  const google::protobuf::Descriptor* d = request->GetDescriptor();
  const google::protobuf::Reflection* r = request->GetReflection();
  for (int field = InlineTensors::kFirstField; field <= InlineTensors::kLastField; ++field) {
    const int i = field - InlineTensors::kFirstField;
    if (!seen[i]) continue;
    // A present Tensor field is set even when empty, as protobuf would leave it.
    google::protobuf::Message* t = r->MutableMessage(request, d->FindFieldByNumber(field));
    if (!t->MergeFromString(tensor_rest[i])) return Invalid(*request, total);
  }
  return absl::OkStatus();
}

namespace {

absl::Status ReadFromBuffer(const grpc::ByteBuffer& in, std::vector<grpc::Slice>* slices,
                            google::protobuf::Message* request, InlineTensors* tensors) {
  slices->clear();
  if (!in.Dump(slices).ok()) return Invalid(*request, in.Length());
  std::vector<absl::string_view> pieces;
  pieces.reserve(slices->size());
  for (const grpc::Slice& s : *slices) {
    pieces.emplace_back(reinterpret_cast<const char*>(s.begin()), s.size());
  }
  return ReadAttentionRequest(pieces, request, tensors);
}

}  // namespace

absl::Status ReadAttentionRequest(const grpc::ByteBuffer& in, std::vector<grpc::Slice>* slices,
                                  v1::PrefillRequest* request, InlineTensors* tensors) {
  return ReadFromBuffer(in, slices, request, tensors);
}

absl::Status ReadAttentionRequest(const grpc::ByteBuffer& in, std::vector<grpc::Slice>* slices,
                                  v1::DecodeRequest* request, InlineTensors* tensors) {
  return ReadFromBuffer(in, slices, request, tensors);
}

}  // namespace attn
