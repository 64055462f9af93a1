#include "server/api/config.h"

#include "google/protobuf/text_format.h"
#include "gtest/gtest.h"

namespace attn {
namespace {

v1::ServerConfig Parse(const std::string& text) {
  v1::ServerConfig c;
  EXPECT_TRUE(google::protobuf::TextFormat::ParseFromString(text, &c)) << text;
  return c;
}

TEST(ConfigTest, EmbeddedDefaultIsASingleGqaPoolOnLocalhost) {
  auto s = ResolveConfig(nullptr, {});
  ASSERT_TRUE(s.ok()) << s.status();
  EXPECT_EQ(s->listen_address, "127.0.0.1:50051");
  EXPECT_EQ(s->backend.kind, "auto");
  ASSERT_EQ(s->pools.size(), 1u);
  const PoolGeometry& g = s->pools[0];
  EXPECT_EQ(g.name, "default");
  EXPECT_EQ(g.kind, PoolKind::kGqa);
  EXPECT_EQ(g.num_qo_heads, 32);
  EXPECT_EQ(g.num_kv_heads, 8);
  EXPECT_EQ(g.head_dim, 128);
  EXPECT_EQ(g.page_size, 16);
  EXPECT_EQ(g.num_pages, 4096);
  EXPECT_EQ(g.BytesPerPage(), 2 * 16 * 2 * 8 * 128 * 2);
}

TEST(ConfigTest, MetricsPortZeroInTheFileDisablesMetrics) {
  // proto3 cannot tell a scalar 0 from unset; metrics_port has presence so the file's 0 holds.
  const v1::ServerConfig off = Parse("metrics_port: 0");
  auto s = ResolveConfig(&off, {});
  ASSERT_TRUE(s.ok()) << s.status();
  EXPECT_EQ(s->metrics_port, 0);
  const v1::ServerConfig unset = Parse(R"pb(listen_address: "127.0.0.1:7000")pb");
  s = ResolveConfig(&unset, {});
  ASSERT_TRUE(s.ok()) << s.status();
  EXPECT_EQ(s->metrics_port, 9464);
}

TEST(ConfigTest, OutputChunksDefaultToEightMebibytesAndZeroTurnsThemOff) {
  auto s = ResolveConfig(nullptr, {});
  ASSERT_TRUE(s.ok()) << s.status();
  EXPECT_EQ(s->backend.cuda_output_chunk_bytes, 8 << 20);
  const v1::ServerConfig off = Parse("cuda_output_chunk_bytes: 0");
  s = ResolveConfig(&off, {});
  ASSERT_TRUE(s.ok()) << s.status();
  EXPECT_EQ(s->backend.cuda_output_chunk_bytes, 0);
  ConfigOverrides o;
  o.cuda_output_chunk_bytes = 4096;
  s = ResolveConfig(&off, o);
  ASSERT_TRUE(s.ok()) << s.status();
  EXPECT_EQ(s->backend.cuda_output_chunk_bytes, 4096);
  const v1::ServerConfig negative = Parse("cuda_output_chunk_bytes: -1");
  s = ResolveConfig(&negative, {});
  ASSERT_FALSE(s.ok());
  EXPECT_NE(s.status().message().find("cuda_output_chunk_bytes"), std::string::npos);
}

TEST(ConfigTest, DirectOutputsDefaultToOneMebibyteAndZeroTurnsThemOff) {
  auto s = ResolveConfig(nullptr, {});
  ASSERT_TRUE(s.ok()) << s.status();
  EXPECT_EQ(s->backend.cuda_direct_output_min_bytes, 1 << 20);
  const v1::ServerConfig off = Parse("cuda_direct_output_min_bytes: 0");
  s = ResolveConfig(&off, {});
  ASSERT_TRUE(s.ok()) << s.status();
  EXPECT_EQ(s->backend.cuda_direct_output_min_bytes, 0);
  ConfigOverrides o;
  o.cuda_direct_output_min_bytes = 1;
  s = ResolveConfig(&off, o);
  ASSERT_TRUE(s.ok()) << s.status();
  EXPECT_EQ(s->backend.cuda_direct_output_min_bytes, 1);
  const v1::ServerConfig negative = Parse("cuda_direct_output_min_bytes: -1");
  s = ResolveConfig(&negative, {});
  ASSERT_FALSE(s.ok());
  EXPECT_NE(s.status().message().find("cuda_direct_output_min_bytes"), std::string::npos);
}

TEST(ConfigTest, MetricsBindTheirOwnAddress) {
  ConfigOverrides o;
  auto s = ResolveConfig(nullptr, o);
  ASSERT_TRUE(s.ok());
  EXPECT_EQ(s->metrics_host, "127.0.0.1");  // the listen host
  o.listen_address = "unix:/run/attn.sock";
  s = ResolveConfig(nullptr, o);
  ASSERT_TRUE(s.ok());
  EXPECT_EQ(s->metrics_host, "127.0.0.1");  // not "unix"
  o.metrics_address = "0.0.0.0:9500";
  s = ResolveConfig(nullptr, o);
  ASSERT_TRUE(s.ok());
  EXPECT_EQ(s->metrics_host, "0.0.0.0");
  EXPECT_EQ(s->metrics_port, 9500);
  o.metrics_address = "[::1]";
  s = ResolveConfig(nullptr, o);
  ASSERT_TRUE(s.ok());
  EXPECT_EQ(s->metrics_host, "[::1]");
  EXPECT_EQ(s->metrics_port, 9464);
  for (const char* bad : {"host:port", ":9500", "h:70000"}) {
    o.metrics_address = bad;
    EXPECT_FALSE(ResolveConfig(nullptr, o).ok()) << bad;
  }
}

TEST(ConfigTest, UnixSocketModeIsOctalAndNeedsAUnixAddress) {
  ConfigOverrides o;
  o.listen_address = "unix:/run/attn.sock";
  o.unix_socket_mode = "0660";
  auto s = ResolveConfig(nullptr, o);
  ASSERT_TRUE(s.ok()) << s.status();
  EXPECT_EQ(s->unix_socket_mode, 0660);
  for (const char* bad : {"0980", "660x", "07777", "-1"}) {
    o.unix_socket_mode = bad;
    EXPECT_FALSE(ResolveConfig(nullptr, o).ok()) << bad;
  }
  o.unix_socket_mode = "0600";
  o.listen_address = "127.0.0.1:50051";
  EXPECT_FALSE(ResolveConfig(nullptr, o).ok());
}

TEST(ConfigTest, FilePoolsReplaceTheDefaultAndFlagsWin) {
  const v1::ServerConfig file = Parse(R"pb(
    listen_address: "0.0.0.0:7000"
    metrics_port: 9400
    batching { max_queue_delay_us: 0 max_batch_requests: 8 }
    pools { name: "mla" kind: POOL_KIND_MLA num_layers: 4 page_size: 64 num_qo_heads: 16
            capacity_bytes: 10000000 }
    pools { name: "g" kind: POOL_KIND_GQA num_layers: 1 page_size: 1 num_qo_heads: 20
            num_kv_heads: 4 head_dim: 128 num_pages: 100 }
  )pb");
  ConfigOverrides o;
  o.listen_address = "127.0.0.1:0";
  o.max_batch_tokens = 99;
  auto s = ResolveConfig(&file, o);
  ASSERT_TRUE(s.ok()) << s.status();
  EXPECT_EQ(s->listen_address, "127.0.0.1:0");
  EXPECT_EQ(s->metrics_port, 9400);
  EXPECT_EQ(s->batching.max_queue_delay, absl::ZeroDuration());
  EXPECT_EQ(s->batching.max_batch_requests, 8);
  EXPECT_EQ(s->batching.max_batch_tokens, 99);
  EXPECT_EQ(s->batching.max_queue_requests, BatchingOptions().max_queue_requests);
  ASSERT_EQ(s->pools.size(), 2u);
  // 4 layers * 64 tokens * 576 elements * 2 bytes = 294912 bytes per page.
  EXPECT_EQ(s->pools[0].num_pages, 10000000 / 294912);
  EXPECT_EQ(s->pools[1].num_kv_heads, 4);
}

TEST(ConfigTest, RejectsBadSettings) {
  ConfigOverrides bad_backend;
  bad_backend.backend = "tpu";
  EXPECT_FALSE(ResolveConfig(nullptr, bad_backend).ok());

  for (const char* text : {
           R"pb(pools { name: "Bad Name" kind: POOL_KIND_GQA num_layers: 1 page_size: 16
                        num_qo_heads: 8 num_kv_heads: 2 head_dim: 128 num_pages: 4 })pb",
           R"pb(pools { name: "g" kind: POOL_KIND_GQA num_layers: 1 page_size: 16
                        num_qo_heads: 8 num_kv_heads: 3 head_dim: 128 num_pages: 4 })pb",
           R"pb(pools { name: "g" kind: POOL_KIND_GQA num_layers: 1 page_size: 16
                        num_qo_heads: 8 num_kv_heads: 2 head_dim: 96 num_pages: 4 })pb",
           R"pb(pools { name: "g" kind: POOL_KIND_GQA num_layers: 1 page_size: 16
                        num_qo_heads: 8 num_kv_heads: 2 head_dim: 128 })pb",
           R"pb(pools { name: "g" kind: POOL_KIND_GQA num_layers: 1 page_size: 16
                        num_qo_heads: 8 num_kv_heads: 2 head_dim: 128 num_pages: 4
                        capacity_bytes: 100000 })pb",
           R"pb(pools { name: "g" num_layers: 1 page_size: 16 num_qo_heads: 8 num_pages: 4 })pb",
           R"pb(pools { name: "m" kind: POOL_KIND_MLA num_layers: 0 page_size: 16
                        num_qo_heads: 8 num_pages: 4 })pb",
           R"pb(max_message_bytes: 100)pb",
       }) {
    const v1::ServerConfig file = Parse(text);
    EXPECT_EQ(ResolveConfig(&file, {}).status().code(), absl::StatusCode::kInvalidArgument)
        << text;
  }
}

}  // namespace
}  // namespace attn
