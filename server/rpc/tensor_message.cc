#include "server/rpc/tensor_message.h"

#include <algorithm>
#include <climits>
#include <cstdint>
#include <memory>
#include <string>

#include "absl/strings/str_cat.h"
#include "attnserve/v1/attention.pb.h"
#include "google/protobuf/descriptor.h"
#include "google/protobuf/io/coded_stream.h"
#include "google/protobuf/wire_format_lite.h"

namespace attn {
namespace {

namespace v1 = ::attnserve::v1;
using google::protobuf::Descriptor;
using google::protobuf::FieldDescriptor;
using google::protobuf::Message;
using google::protobuf::Reflection;
using google::protobuf::internal::WireFormatLite;

enum WireType : int { kVarint = 0, kFixed64 = 1, kLengthDelimited = 2, kFixed32 = 5 };

// ---- Reading

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

absl::Status Invalid(const Message& message, uint64_t bytes) {
  return absl::InvalidArgumentError(absl::StrCat("not a valid ",
                                                 message.GetDescriptor()->full_name(), " (", bytes,
                                                 " bytes): truncated or corrupt protobuf"));
}

// ---- Writing

void AppendVarint(uint64_t v, std::string* out) {
  char buf[10];
  const uint8_t* end = google::protobuf::io::CodedOutputStream::WriteVarint64ToArray(
      v, reinterpret_cast<uint8_t*>(buf));
  out->append(buf, reinterpret_cast<const char*>(end) - buf);
}

void AppendLengthTag(int field, std::string* out) {
  AppendVarint(WireFormatLite::MakeTag(field, WireFormatLite::WIRETYPE_LENGTH_DELIMITED), out);
}

// `message` serialized in the pieces between the split fields (sorted, distinct; each left out):
// piece i holds the fields numbered between split[i - 1] and split[i], the last one also the
// unknown fields, which protobuf writes after the known ones. Concatenated with the split fields
// in their places, they are protobuf's serialization.
std::vector<std::string> Around(const Message& message, absl::Span<const int> split) {
  const Reflection* r = message.GetReflection();
  std::vector<const FieldDescriptor*> present;
  r->ListFields(message, &present);  // in field-number order
  std::vector<std::string> pieces(split.size() + 1);
  size_t next = 0;  // the first field of `present` not yet placed
  for (size_t i = 0; i < pieces.size(); ++i) {
    const int lo = i == 0 ? 0 : split[i - 1];
    const int hi = i < split.size() ? split[i] : INT_MAX;
    const bool last = i == split.size();
    bool any = last && !r->GetUnknownFields(message).empty();
    while (next < present.size() && present[next]->number() < hi) {
      any |= present[next]->number() > lo;
      ++next;
    }
    if (!any) continue;
    // A copy holding only this range's fields: a few copies of a small message per call.
    std::unique_ptr<Message> part(message.New());
    part->CopyFrom(message);
    for (const FieldDescriptor* f : present) {
      if (f->number() <= lo || f->number() >= hi) r->ClearField(part.get(), f);
    }
    if (!last) r->MutableUnknownFields(part.get())->Clear();
    part->SerializeToString(&pieces[i]);
  }
  return pieces;
}

// Gathers a message's bytes as slices: small serialized runs are merged into one slice each,
// the tensors' data slices are referenced as they are.
class SliceList {
 public:
  void Append(const std::string& bytes) { pending_ += bytes; }
  void Append(const grpc::Slice& data) {
    if (data.size() == 0) return;
    Flush();
    slices_.push_back(data);
  }
  grpc::ByteBuffer Finish() {
    Flush();
    return grpc::ByteBuffer(slices_.data(), slices_.size());
  }

 private:
  void Flush() {
    if (!pending_.empty()) slices_.emplace_back(pending_);
    pending_.clear();
  }
  std::string pending_;
  std::vector<grpc::Slice> slices_;
};

}  // namespace

absl::Status ReadTensorMessage(absl::Span<const absl::string_view> pieces, int first_field,
                               int last_field, Message* message, absl::Span<HostBytes> data) {
  if (last_field < first_field ||
      data.size() != static_cast<size_t>(last_field - first_field + 1)) {
    return absl::InternalError(absl::StrCat("ReadTensorMessage: ", data.size(),
                                            " data slots for fields ", first_field, " to ",
                                            last_field));
  }
  PieceReader in(pieces);
  const uint64_t total = in.left();
  const auto is_tensor = [&](int field) { return field >= first_field && field <= last_field; };
  std::string rest;  // every field but the tensors, re-assembled for protobuf
  std::vector<std::string> tensor_rest(data.size());
  std::vector<bool> seen(data.size());
  while (in.left() > 0) {
    std::string tag_bytes;
    uint64_t tag = 0;
    if (!in.Varint(&tag, &tag_bytes)) return Invalid(*message, total);
    const int field = static_cast<int>(tag >> 3);
    const int wire_type = static_cast<int>(tag & 7);
    if (field == 0) return Invalid(*message, total);
    if (is_tensor(field) && wire_type == kLengthDelimited) {
      uint64_t len = 0;
      const int i = field - first_field;
      if (!in.Varint(&len) || !ReadTensor(in, len, &data[i], &tensor_rest[i])) {
        return Invalid(*message, total);
      }
      seen[i] = true;
    } else {
      rest.append(tag_bytes);
      if (!CopyField(in, wire_type, &rest)) return Invalid(*message, total);
    }
  }
  if (!message->ParseFromString(rest)) return Invalid(*message, total);
  const Descriptor* d = message->GetDescriptor();
  const Reflection* r = message->GetReflection();
  for (int field = first_field; field <= last_field; ++field) {
    const int i = field - first_field;
    if (!seen[i]) continue;
    // A present Tensor field is set even when empty, as protobuf would leave it.
    Message* t = r->MutableMessage(message, d->FindFieldByNumber(field));
    if (!t->MergeFromString(tensor_rest[i])) return Invalid(*message, total);
  }
  return absl::OkStatus();
}

absl::Status ReadTensorMessage(const grpc::ByteBuffer& in, std::vector<grpc::Slice>* slices,
                               int first_field, int last_field, Message* message,
                               absl::Span<HostBytes> data) {
  slices->clear();
  if (!in.Dump(slices).ok()) return Invalid(*message, in.Length());
  std::vector<absl::string_view> pieces;
  pieces.reserve(slices->size());
  for (const grpc::Slice& s : *slices) {
    pieces.emplace_back(reinterpret_cast<const char*>(s.begin()), s.size());
  }
  return ReadTensorMessage(pieces, first_field, last_field, message, data);
}

grpc::ByteBuffer WriteTensorMessage(const Message& message, absl::Span<const TensorSlice> tensors) {
  const Reflection* r = message.GetReflection();
  const Descriptor* d = message.GetDescriptor();
  std::vector<const TensorSlice*> present;
  for (const TensorSlice& t : tensors) {
    if (r->HasField(message, d->FindFieldByNumber(t.field))) present.push_back(&t);
  }
  std::sort(present.begin(), present.end(),
            [](const TensorSlice* a, const TensorSlice* b) { return a->field < b->field; });
  present.erase(
      std::unique(present.begin(), present.end(),
                  [](const TensorSlice* a, const TensorSlice* b) { return a->field == b->field; }),
      present.end());
  std::vector<int> split;
  for (const TensorSlice* t : present) split.push_back(t->field);
  const std::vector<std::string> around = Around(message, split);
  constexpr int kData[] = {v1::Tensor::kDataFieldNumber};
  SliceList out;
  out.Append(around[0]);
  for (size_t i = 0; i < present.size(); ++i) {
    const Message& tensor = r->GetMessage(message, d->FindFieldByNumber(present[i]->field));
    const std::vector<std::string> parts = Around(tensor, kData);  // dtype, shape | region
    const size_t n = present[i]->data.size();
    std::string data_head;
    if (n > 0) {  // proto3 leaves empty bytes out
      AppendLengthTag(v1::Tensor::kDataFieldNumber, &data_head);
      AppendVarint(n, &data_head);
    }
    std::string head;
    AppendLengthTag(present[i]->field, &head);
    AppendVarint(parts[0].size() + data_head.size() + n + parts[1].size(), &head);
    out.Append(head);
    out.Append(parts[0]);
    out.Append(data_head);
    out.Append(present[i]->data);
    out.Append(parts[1]);
    out.Append(around[i + 1]);
  }
  return out.Finish();
}

grpc::Slice BorrowedSlice(const char* data, size_t size) {
  return grpc::Slice(data, size, grpc::Slice::STATIC_SLICE);
}

}  // namespace attn
