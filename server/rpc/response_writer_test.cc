#include "server/rpc/response_writer.h"

#include <memory>
#include <string>
#include <vector>

#include "gtest/gtest.h"

namespace attn {
namespace {

v1::AttentionResponse Parse(const grpc::ByteBuffer& buffer) {
  std::vector<grpc::Slice> slices;
  EXPECT_TRUE(buffer.Dump(&slices).ok());
  std::string bytes;
  for (const grpc::Slice& s : slices)
    bytes.append(reinterpret_cast<const char*>(s.begin()), s.size());
  v1::AttentionResponse r;
  EXPECT_TRUE(r.ParseFromString(bytes));
  return r;
}

SharedBytes Shared(const std::string& text) {
  auto buffer = std::make_shared<std::string>(text);
  return SharedBytes{buffer, buffer->data(), buffer->size()};
}

TEST(ResponseWriterTest, WritesWhatProtobufWouldWithTheSharedData) {
  v1::AttentionResponse r;
  r.mutable_output()->set_dtype(v1::DTYPE_BF16);
  r.mutable_output()->add_shape(3);
  r.mutable_output()->add_shape(300);
  r.mutable_lse()->set_dtype(v1::DTYPE_FP32);
  r.mutable_lse()->add_shape(3);
  r.mutable_timings()->set_total_us(17);
  const std::string out(1800, 'o'), lse(12, 'l');
  const v1::AttentionResponse got = Parse(WriteAttentionResponse(r, Shared(out), Shared(lse)));
  v1::AttentionResponse expected = r;
  expected.mutable_output()->set_data(out);
  expected.mutable_lse()->set_data(lse);
  EXPECT_EQ(got.SerializeAsString(), expected.SerializeAsString());
}

TEST(ResponseWriterTest, OmitsWhatTheResponseLacks) {
  v1::AttentionResponse r;
  r.mutable_output()->set_dtype(v1::DTYPE_BF16);
  r.mutable_output()->add_shape(0);
  const v1::AttentionResponse got = Parse(WriteAttentionResponse(r, {}, Shared("unused")));
  EXPECT_TRUE(got.has_output());
  EXPECT_TRUE(got.output().data().empty());
  EXPECT_FALSE(got.has_lse());
  EXPECT_EQ(Parse(WriteAttentionResponse(v1::AttentionResponse(), {}, {})).ByteSizeLong(), 0u);
}

TEST(ResponseWriterTest, TheBufferLivesUntilTheMessageIsGone) {
  auto buffer = std::make_shared<std::string>(1 << 20, 'x');
  std::weak_ptr<std::string> alive = buffer;
  v1::AttentionResponse r;
  r.mutable_output()->set_dtype(v1::DTYPE_BF16);
  {
    grpc::ByteBuffer message =
        WriteAttentionResponse(r, SharedBytes{buffer, buffer->data(), buffer->size()}, {});
    buffer.reset();
    EXPECT_FALSE(alive.expired());  // the message's slice holds it
    EXPECT_EQ(Parse(message).output().data().size(), size_t{1} << 20);
  }
  EXPECT_TRUE(alive.expired());
}

}  // namespace
}  // namespace attn
