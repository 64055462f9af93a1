#include "server/rpc/request_reader.h"

#include <random>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "google/protobuf/stubs/logging.h"
#include "google/protobuf/util/message_differencer.h"
#include "gtest/gtest.h"

namespace attn {
namespace {

// Splits `bytes` at random points, as a message arrives in gRPC slices.
std::vector<absl::string_view> RandomPieces(const std::string& bytes, std::mt19937& rng) {
  std::vector<absl::string_view> pieces;
  size_t at = 0;
  while (at < bytes.size()) {
    const size_t n = std::min<size_t>(bytes.size() - at, 1 + rng() % 97);
    pieces.push_back(absl::string_view(bytes).substr(at, n));
    at += n;
  }
  return pieces;
}

void FillTensor(v1::Tensor* t, int elements, std::mt19937& rng) {
  t->set_dtype(v1::DTYPE_BF16);
  t->add_shape(elements);
  t->add_shape(2);
  std::string* data = t->mutable_data();
  for (int i = 0; i < elements * 4; ++i) data->push_back(static_cast<char>(rng()));
}

v1::PrefillRequest RandomPrefill(std::mt19937& rng) {
  v1::PrefillRequest r;
  r.set_pool("p");
  r.set_layer(static_cast<int>(rng() % 4));
  FillTensor(r.mutable_q(), 1 + rng() % 50, rng);
  if (rng() % 2) FillTensor(r.mutable_k_new(), 1 + rng() % 50, rng);
  if (rng() % 2) FillTensor(r.mutable_v_new(), 0, rng);
  if (rng() % 3 == 0) {
    r.mutable_q_pe()->mutable_region()->set_name("arena");
    r.mutable_q_pe()->mutable_region()->set_offset(4096);
  }
  for (int i = 0; i < 5; ++i) r.add_kv_indices(static_cast<int32_t>(rng() % 1000));
  r.add_qo_indptr(0);
  r.add_qo_indptr(3);
  r.set_sm_scale(0.125f);
  r.set_session("0123456789abcdef-1");
  return r;
}

// What the reader made of `pieces`, with the tensors' data copied back in.
absl::StatusOr<v1::PrefillRequest> ReadBack(const std::vector<absl::string_view>& pieces) {
  v1::PrefillRequest r;
  InlineTensors tensors;
  if (absl::Status st = ReadAttentionRequest(pieces, &r, &tensors); !st.ok()) return st;
  for (int field = InlineTensors::kFirstField; field <= InlineTensors::kLastField; ++field) {
    const HostBytes& b = tensors.of(field);
    if (b.empty()) continue;
    auto* t = static_cast<v1::Tensor*>(
        r.GetReflection()->MutableMessage(&r, r.GetDescriptor()->FindFieldByNumber(field)));
    EXPECT_TRUE(t->data().empty());  // the reader never copies data into the message
    t->mutable_data()->resize(b.size());
    b.CopyTo(t->mutable_data()->data());
  }
  return r;
}

TEST(RequestReaderTest, MeansWhatProtobufMeansOverAnySlicing) {
  std::mt19937 rng(1);
  for (int round = 0; round < 300; ++round) {
    const v1::PrefillRequest sent = RandomPrefill(rng);
    const std::string bytes = sent.SerializeAsString();
    absl::StatusOr<v1::PrefillRequest> got = ReadBack(RandomPieces(bytes, rng));
    ASSERT_TRUE(got.ok()) << got.status();
    ASSERT_TRUE(google::protobuf::util::MessageDifferencer::Equals(sent, *got))
        << sent.ShortDebugString() << "\nvs\n"
        << got->ShortDebugString();
  }
}

TEST(RequestReaderTest, TensorDataStaysInTheSlices) {
  std::mt19937 rng(2);
  v1::PrefillRequest sent = RandomPrefill(rng);
  const std::string bytes = sent.SerializeAsString();
  v1::PrefillRequest r;
  InlineTensors tensors;
  const std::vector<absl::string_view> whole = {bytes};
  ASSERT_TRUE(ReadAttentionRequest(whole, &r, &tensors).ok());
  const char* q = tensors.q().contiguous();
  ASSERT_NE(q, nullptr);
  EXPECT_GE(q, bytes.data());
  EXPECT_LT(q, bytes.data() + bytes.size());
  EXPECT_EQ(std::string(q, tensors.q().size()), sent.q().data());
  EXPECT_TRUE(r.has_q());
}

TEST(RequestReaderTest, RepeatedFieldsMergeAsInProtobuf) {
  // Two occurrences of q: shapes concatenate, the later data wins; an empty tensor is present.
  v1::PrefillRequest a, b;
  a.mutable_q()->set_dtype(v1::DTYPE_BF16);
  a.mutable_q()->add_shape(1);
  a.mutable_q()->set_data("first");
  b.mutable_q()->add_shape(2);
  b.mutable_q()->set_data("second");
  b.mutable_k_new();
  const std::string bytes = a.SerializeAsString() + b.SerializeAsString();
  v1::PrefillRequest expected;
  ASSERT_TRUE(expected.ParseFromString(bytes));
  absl::StatusOr<v1::PrefillRequest> got = ReadBack({bytes});
  ASSERT_TRUE(got.ok());
  EXPECT_TRUE(google::protobuf::util::MessageDifferencer::Equals(expected, *got))
      << expected.ShortDebugString() << "\nvs\n"
      << got->ShortDebugString();
  EXPECT_TRUE(got->has_k_new());
}

TEST(RequestReaderTest, AgreesWithProtobufOnCorruptBytes) {
  google::protobuf::LogSilencer quiet;  // protobuf logs every string with invalid UTF-8
  std::mt19937 rng(3);
  int refused = 0;
  for (int round = 0; round < 3000; ++round) {
    std::string bytes = RandomPrefill(rng).SerializeAsString();
    switch (rng() % 3) {
      case 0:
        bytes.resize(rng() % bytes.size());
        break;
      case 1:
        bytes[rng() % bytes.size()] = static_cast<char>(rng());
        break;
      default:
        bytes.insert(rng() % bytes.size(), 1, static_cast<char>(rng()));
    }
    v1::PrefillRequest expected;
    const bool protobuf_ok = expected.ParseFromString(bytes);
    absl::StatusOr<v1::PrefillRequest> got = ReadBack(RandomPieces(bytes, rng));
    ASSERT_EQ(got.ok(), protobuf_ok) << round << ": " << got.status();
    if (protobuf_ok) {
      ASSERT_TRUE(google::protobuf::util::MessageDifferencer::Equals(expected, *got)) << round;
    } else {
      EXPECT_EQ(got.status().code(), absl::StatusCode::kInvalidArgument);
      ++refused;
    }
  }
  EXPECT_GT(refused, 100);  // the mutations do reach the refusal paths
}

TEST(RequestReaderTest, ReadsDecodeRequestsFromAByteBuffer) {
  v1::DecodeRequest sent;
  sent.set_layer(1);
  sent.mutable_q()->set_dtype(v1::DTYPE_BF16);
  sent.mutable_q()->set_data(std::string(1 << 20, 'x'));
  sent.add_kv_indptr(0);
  const std::string bytes = sent.SerializeAsString();
  std::vector<grpc::Slice> parts = {grpc::Slice(bytes.substr(0, 1000)),
                                    grpc::Slice(bytes.substr(1000))};
  grpc::ByteBuffer buffer(parts.data(), parts.size());
  std::vector<grpc::Slice> slices;
  v1::DecodeRequest got;
  InlineTensors tensors;
  ASSERT_TRUE(ReadAttentionRequest(buffer, &slices, &got, &tensors).ok());
  EXPECT_EQ(got.layer(), 1);
  EXPECT_EQ(tensors.q().size(), size_t{1} << 20);
  EXPECT_EQ(tensors.q().num_pieces(), 2u);
  std::string q(tensors.q().size(), '\0');
  tensors.q().CopyTo(q.data());
  EXPECT_EQ(q, sent.q().data());
}

}  // namespace
}  // namespace attn
