#include "server/rpc/tensor_message.h"

#include <random>
#include <string>
#include <vector>

#include "attnserve/v1/attention.pb.h"
#include "google/protobuf/util/message_differencer.h"
#include "gtest/gtest.h"

namespace attn {
namespace {

namespace v1 = ::attnserve::v1;
using google::protobuf::util::MessageDifferencer;

std::string Bytes(const grpc::ByteBuffer& buffer) {
  std::vector<grpc::Slice> slices;
  EXPECT_TRUE(buffer.Dump(&slices).ok());
  std::string bytes;
  for (const grpc::Slice& s : slices) {
    bytes.append(reinterpret_cast<const char*>(s.begin()), s.size());
  }
  return bytes;
}

// A tensor of `bytes` random bytes (odd sizes and 0 included), sometimes with a region too.
void Fill(v1::Tensor* t, size_t bytes, std::mt19937& rng) {
  t->set_dtype(rng() % 2 ? v1::DTYPE_BF16 : v1::DTYPE_FP32);
  for (int i = 0, n = static_cast<int>(rng() % 4); i < n; ++i) t->add_shape(rng() % 300);
  std::string* data = t->mutable_data();
  for (size_t i = 0; i < bytes; ++i) data->push_back(static_cast<char>(rng()));
  if (rng() % 4 == 0) {
    t->mutable_region()->set_name("arena");
    t->mutable_region()->set_offset(rng() % 4096);
  }
}

// Unknown fields (a newer peer's) in the message: protobuf keeps and writes them last.
void AddUnknown(google::protobuf::Message* m, std::mt19937& rng) {
  google::protobuf::UnknownFieldSet* u = m->GetReflection()->MutableUnknownFields(m);
  u->AddVarint(900 + rng() % 50, rng());
  u->AddLengthDelimited(1000, "later");
}

v1::PrefillRequest RandomPrefill(std::mt19937& rng) {
  v1::PrefillRequest r;
  if (rng() % 2) r.set_pool("pool");
  r.set_session("0123456789abcdef-1");
  r.set_layer(static_cast<int>(rng() % 3));
  Fill(r.mutable_q(), 1 + rng() % 5000, rng);
  if (rng() % 2) Fill(r.mutable_k_new(), rng() % 3 == 0 ? 0 : rng() % 777, rng);
  if (rng() % 2) Fill(r.mutable_v_new(), rng() % 3 == 0 ? 0 : rng() % 777, rng);
  if (rng() % 3 == 0) r.mutable_q_pe();  // present and empty
  if (rng() % 3 == 0) Fill(r.mutable_kpe_new(), 1, rng);
  for (int i = 0, n = static_cast<int>(rng() % 40); i < n; ++i) {
    r.add_kv_indices(static_cast<int32_t>(rng() % 100000));
  }
  r.add_qo_indptr(0);
  r.add_qo_indptr(3);
  if (rng() % 2) r.set_sm_scale(0.125f);
  if (rng() % 4 == 0) AddUnknown(&r, rng);
  if (rng() % 4 == 0) AddUnknown(r.mutable_q(), rng);
  return r;
}

// The request's tensors as slices borrowed from it.
std::vector<TensorSlice> SlicesOf(const google::protobuf::Message& m) {
  std::vector<TensorSlice> tensors;
  const google::protobuf::Descriptor* d = m.GetDescriptor();
  for (int i = 0; i < d->field_count(); ++i) {
    const google::protobuf::FieldDescriptor* f = d->field(i);
    if (f->message_type() != v1::Tensor::descriptor()) continue;
    const auto& t = static_cast<const v1::Tensor&>(m.GetReflection()->GetMessage(m, f));
    tensors.push_back({f->number(), BorrowedSlice(t.data().data(), t.data().size())});
  }
  return tensors;
}

TEST(TensorMessageTest, WritesProtobufsBytesExactly) {
  std::mt19937 rng(1);
  for (int round = 0; round < 500; ++round) {
    const v1::PrefillRequest r = RandomPrefill(rng);
    std::vector<TensorSlice> tensors = SlicesOf(r);
    std::shuffle(tensors.begin(), tensors.end(), rng);  // any order
    ASSERT_EQ(Bytes(WriteTensorMessage(r, tensors)), r.SerializeAsString())
        << round << ": " << r.ShortDebugString();
  }
}

TEST(TensorMessageTest, WritesEveryMessageTypeWithTensors) {
  std::mt19937 rng(2);
  v1::DecodeRequest d;
  d.set_session("s");
  Fill(d.mutable_q(), 4097, rng);
  d.add_kv_indptr(0);
  d.add_kv_indptr(1);
  d.add_kv_indices(7);
  EXPECT_EQ(Bytes(WriteTensorMessage(d, SlicesOf(d))), d.SerializeAsString());
  v1::AttentionResponse a;
  Fill(a.mutable_output(), 1 << 16, rng);
  Fill(a.mutable_lse(), 12, rng);
  a.mutable_timings()->set_total_us(17);
  EXPECT_EQ(Bytes(WriteTensorMessage(a, SlicesOf(a))), a.SerializeAsString());
  v1::AttentionResponse empty;
  EXPECT_EQ(WriteTensorMessage(empty, SlicesOf(empty)).Length(), 0u);
}

TEST(TensorMessageTest, TheDataComesFromTheSlicesNotTheMessage) {
  v1::AttentionResponse r;
  r.mutable_output()->set_dtype(v1::DTYPE_BF16);
  r.mutable_output()->set_data("ignored");
  const std::string out = "the output";
  const TensorSlice tensors[] = {
      {v1::AttentionResponse::kOutputFieldNumber, BorrowedSlice(out.data(), out.size())},
      // lse is not in the message: not written, whatever its slice.
      {v1::AttentionResponse::kLseFieldNumber, BorrowedSlice(out.data(), out.size())}};
  v1::AttentionResponse got;
  ASSERT_TRUE(got.ParseFromString(Bytes(WriteTensorMessage(r, tensors))));
  EXPECT_EQ(got.output().data(), out);
  EXPECT_FALSE(got.has_lse());
}

TEST(TensorMessageTest, BorrowedDataIsNotCopied) {
  std::mt19937 rng(3);
  v1::DecodeRequest d;
  Fill(d.mutable_q(), 1 << 20, rng);
  std::vector<grpc::Slice> slices;
  ASSERT_TRUE(WriteTensorMessage(d, SlicesOf(d)).Dump(&slices).ok());
  bool found = false;
  for (const grpc::Slice& s : slices) {
    found |= reinterpret_cast<const char*>(s.begin()) == d.q().data().data();
  }
  EXPECT_TRUE(found);
}

TEST(TensorMessageTest, ReadsBackWhatItWrites) {
  std::mt19937 rng(4);
  for (int round = 0; round < 200; ++round) {
    v1::AttentionResponse sent;
    Fill(sent.mutable_output(), rng() % 3 == 0 ? 0 : 1 + rng() % 9999, rng);
    if (rng() % 2) Fill(sent.mutable_lse(), rng() % 401, rng);
    sent.mutable_timings()->set_compute_us(static_cast<int64_t>(rng() % 1000));
    if (rng() % 4 == 0) AddUnknown(&sent, rng);
    std::vector<grpc::Slice> slices;
    v1::AttentionResponse got;
    HostBytes data[2];
    ASSERT_TRUE(ReadTensorMessage(WriteTensorMessage(sent, SlicesOf(sent)), &slices,
                                  v1::AttentionResponse::kOutputFieldNumber,
                                  v1::AttentionResponse::kLseFieldNumber, &got, data)
                    .ok());
    EXPECT_TRUE(got.output().data().empty());  // the data stays in the slices
    EXPECT_EQ(got.has_lse(), sent.has_lse());
    for (int i = 0; i < 2; ++i) {
      v1::Tensor* t = i == 0 ? got.mutable_output() : got.mutable_lse();
      t->mutable_data()->resize(data[i].size());
      data[i].CopyTo(t->mutable_data()->data());
    }
    if (!sent.has_lse()) got.clear_lse();  // mutable_lse() above made it present
    ASSERT_TRUE(MessageDifferencer::Equals(sent, got)) << sent.ShortDebugString() << "\nvs\n"
                                                       << got.ShortDebugString();
  }
}

TEST(TensorMessageTest, RefusesDataSlotsThatDoNotMatchTheFields) {
  v1::AttentionResponse r;
  HostBytes data[1];
  const std::vector<absl::string_view> none;
  EXPECT_EQ(ReadTensorMessage(none, 1, 2, &r, data).code(), absl::StatusCode::kInternal);
  EXPECT_TRUE(ReadTensorMessage(none, 1, 1, &r, data).ok());
}

}  // namespace
}  // namespace attn
