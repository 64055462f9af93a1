#include "server/metrics/metrics.h"

#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/strings/strip.h"
#include "gtest/gtest.h"

namespace attn {
namespace {

bool Has(const std::string& text, const std::string& part) {
  return text.find(part) != std::string::npos;
}

// The le="..." values of the bucket lines that start with `series` (a name and its first labels),
// in the order of the exposition.
std::vector<std::string> Bounds(const std::string& text, const std::string& series) {
  std::vector<std::string> bounds;
  for (absl::string_view line : absl::StrSplit(text, '\n')) {
    if (!absl::ConsumePrefix(&line, series)) continue;
    const size_t le = line.find("le=\"");
    if (le == absl::string_view::npos) continue;
    line.remove_prefix(le + 4);
    bounds.emplace_back(line.substr(0, line.find('"')));
  }
  return bounds;
}

TEST(MetricsTest, ExposesEveryFamilyWithItsType) {
  Metrics m("1.2.3", "cpu", "test device");
  m.AddPool("gqa", 8);  // launch families have series per pool (a family without any is not shown)
  const std::string text = m.Scrape();
  for (const char* family :
       {"# TYPE attn_queue_wait_seconds histogram", "# TYPE attn_kernel_duration_seconds histogram",
        "# TYPE attn_launch_stage_seconds histogram", "# TYPE attn_batch_requests histogram",
        "# TYPE attn_batch_tokens histogram", "# TYPE attn_transfer_bytes_total counter",
        "# TYPE attn_inflight_requests gauge", "# TYPE attn_build_info gauge",
        "# TYPE process_cpu_seconds_total counter", "# TYPE process_resident_memory_bytes gauge",
        "# TYPE process_open_fds gauge", "# TYPE process_start_time_seconds gauge"}) {
    EXPECT_TRUE(Has(text, family)) << family;
  }
  EXPECT_TRUE(Has(text, R"(attn_build_info{backend="cpu",device="test device",version="1.2.3"} 1)"))
      << text;
}

TEST(MetricsTest, MethodsStartAtZero) {
  Metrics m("v", "cpu", "d");
  m.AddMethod("Decode");
  std::string text = m.Scrape();
  EXPECT_TRUE(Has(text, R"(attn_rpc_requests_total{code="ok",method="Decode"} 0)")) << text;
  EXPECT_TRUE(Has(text, R"(attn_request_errors_total{method="Decode",reason="internal"} 0)"));
  m.OnRpc("Decode", absl::InternalError("device"), absl::Microseconds(3));
  text = m.Scrape();
  EXPECT_TRUE(Has(text, R"(attn_request_errors_total{method="Decode",reason="internal"} 1)"));
  EXPECT_TRUE(Has(text, R"(attn_rpc_requests_total{code="internal",method="Decode"} 1)"));
}

TEST(MetricsTest, RpcsCountAndTime) {
  Metrics m("v", "cpu", "d");
  m.OnRpcStarted();
  m.OnRpc("Decode", absl::OkStatus(), absl::Microseconds(30));
  m.OnRpcFinished();
  m.OnRpc("Decode", absl::InvalidArgumentError("bad"), absl::Microseconds(3));
  const std::string text = m.Scrape();
  EXPECT_TRUE(Has(text, R"(attn_rpc_requests_total{code="ok",method="Decode"} 1)")) << text;
  EXPECT_TRUE(Has(text, R"(attn_rpc_requests_total{code="invalid_argument",method="Decode"} 1)"));
  EXPECT_TRUE(
      Has(text, R"(attn_request_errors_total{method="Decode",reason="invalid_argument"} 1)"));
  // 30 us falls in the 5e-05 bucket, not the 2e-05 one; buckets run from 5 us to 10 s.
  EXPECT_TRUE(
      Has(text, R"(attn_rpc_duration_seconds_bucket{code="ok",method="Decode",le="2e-05"} 0)"))
      << text;
  EXPECT_TRUE(
      Has(text, R"(attn_rpc_duration_seconds_bucket{code="ok",method="Decode",le="5e-05"} 1)"));
  EXPECT_TRUE(Has(text, "attn_inflight_requests 0"));
}

// The bounds print as the decimals they stand for (the spelling Prometheus' own Go clients use,
// strconv 'g'), so a query for le="0.0001" finds its bucket.
TEST(MetricsTest, LatencyBoundsPrintAsExactDecimals) {
  Metrics m("v", "cpu", "d");
  m.OnRpc("Decode", absl::OkStatus(), absl::Microseconds(30));
  const std::vector<std::string> expected = {
      "5e-06", "1e-05", "2e-05", "5e-05", "0.0001", "0.0002", "0.0005",
      "0.001", "0.002", "0.005", "0.01",  "0.02",   "0.05",   "0.1",
      "0.2",   "0.5",   "1",     "2",     "5",      "10",     "+Inf"};
  EXPECT_EQ(Bounds(m.Scrape(), R"(attn_rpc_duration_seconds_bucket{code="ok",method="Decode",)"),
            expected);
}

TEST(MetricsTest, LaunchesPoolsAndTransfers) {
  Metrics m("v", "cpu", "d");
  LaunchStats stats;
  stats.compute = absl::Milliseconds(2);
  stats.prepare = absl::Microseconds(40);
  stats.execute = absl::Milliseconds(3);
  stats.finish = absl::Microseconds(60);
  stats.bytes_in = 1000;
  stats.bytes_out = 10;
  m.OnLaunch("gqa", Op::kDecode, 3, 24, stats);
  m.OnQueueWait("gqa", Op::kDecode, absl::Microseconds(7));
  m.AddPool("gqa", 100);
  EXPECT_TRUE(Has(m.Scrape(), R"(attn_pages_reclaimed_total{pool="gqa"} 0)"));
  m.SetPoolPages("gqa", 90, 100);
  m.OnAllocationFailure("gqa");
  const std::string pool = "gqa";
  m.OnPageChange(PageChange{pool, PageEvent::kReclaimed, 7, 97, 100});
  const std::string text = m.Scrape();
  EXPECT_TRUE(Has(text, R"(attn_batch_requests_bucket{op="decode",pool="gqa",le="2"} 0)")) << text;
  EXPECT_TRUE(Has(text, R"(attn_batch_requests_bucket{op="decode",pool="gqa",le="4"} 1)"));
  EXPECT_TRUE(Has(text, R"(attn_batch_tokens_sum{op="decode",pool="gqa"} 24)"));
  EXPECT_TRUE(Has(text, R"(attn_kernel_duration_seconds_count{op="decode",pool="gqa"} 1)"));
  EXPECT_TRUE(Has(text, R"(attn_queue_wait_seconds_count{op="decode",pool="gqa"} 1)"));
  EXPECT_TRUE(
      Has(text, R"(attn_launch_stage_seconds_sum{op="decode",pool="gqa",stage="prepare"} 4e-05)"))
      << text;
  EXPECT_TRUE(
      Has(text, R"(attn_launch_stage_seconds_sum{op="decode",pool="gqa",stage="execute"} 0.003)"));
  EXPECT_TRUE(
      Has(text, R"(attn_launch_stage_seconds_sum{op="decode",pool="gqa",stage="finish"} 6e-05)"));
  EXPECT_TRUE(Has(text, R"(attn_transfer_bytes_total{direction="in"} 1000)"));
  EXPECT_TRUE(Has(text, R"(attn_kv_pages{pool="gqa",state="free"} 97)"));
  EXPECT_TRUE(Has(text, R"(attn_kv_pages{pool="gqa",state="used"} 3)"));
  EXPECT_TRUE(Has(text, R"(attn_kv_pages_capacity{pool="gqa"} 100)"));
  EXPECT_TRUE(Has(text, R"(attn_page_alloc_failures_total{pool="gqa"} 1)"));
  EXPECT_TRUE(Has(text, R"(attn_pages_reclaimed_total{pool="gqa"} 7)"));
}

// Every page-count change sets the gauges, whatever caused it: a lease reclaim used to count its
// pages but leave attn_kv_pages{state="used"} where it was.
TEST(MetricsTest, EveryPageChangeMovesThePoolGauges) {
  Metrics m("v", "cpu", "d");
  m.OnPoolAdded("mla", 64);
  const std::string pool = "mla";
  m.OnPageChange(PageChange{pool, PageEvent::kAllocated, 9, 55, 64});
  EXPECT_TRUE(Has(m.Scrape(), R"(attn_kv_pages{pool="mla",state="used"} 9)"));
  m.OnPageChange(PageChange{pool, PageEvent::kReclaimed, 9, 60, 64});  // 4 still pinned
  std::string text = m.Scrape();
  EXPECT_TRUE(Has(text, R"(attn_kv_pages{pool="mla",state="used"} 4)")) << text;
  EXPECT_TRUE(Has(text, R"(attn_pages_reclaimed_total{pool="mla"} 9)"));
  m.OnPageChange(PageChange{pool, PageEvent::kUnpinned, 4, 64, 64});
  text = m.Scrape();
  EXPECT_TRUE(Has(text, R"(attn_kv_pages{pool="mla",state="used"} 0)")) << text;
  EXPECT_TRUE(Has(text, R"(attn_kv_pages{pool="mla",state="free"} 64)"));
  EXPECT_TRUE(Has(text, R"(attn_pages_reclaimed_total{pool="mla"} 9)"));  // counted once
}

// Two pools serve two models: their launches are told apart, and a pool's launch series exist at
// zero from AddPool on (so rate() over them starts with the first scrape).
TEST(MetricsTest, LaunchSeriesArePerPool) {
  Metrics m("v", "cpu", "d");
  m.AddPool("gqa", 10);
  m.AddPool("mla", 10);
  const std::string idle = m.Scrape();
  for (const char* pool : {"gqa", "mla"}) {
    for (const char* op : {"prefill", "decode"}) {
      const std::string labels = absl::StrCat(R"({op=")", op, R"(",pool=")", pool, R"("})");
      for (const char* series :
           {"attn_queue_wait_seconds_count", "attn_kernel_duration_seconds_count",
            "attn_batch_requests_count", "attn_batch_tokens_count"}) {
        EXPECT_TRUE(Has(idle, absl::StrCat(series, labels, " 0"))) << series << labels;
      }
      EXPECT_TRUE(Has(idle, absl::StrCat(R"(attn_launch_stage_seconds_count{op=")", op,
                                         R"(",pool=")", pool, R"(",stage="execute"} 0)")));
    }
  }
  LaunchStats stats;
  stats.compute = absl::Milliseconds(1);
  m.OnLaunch("mla", Op::kPrefill, 2, 100, stats);
  m.OnQueueWait("mla", Op::kPrefill, absl::Microseconds(9));
  m.OnQueueWait("mla", Op::kPrefill, absl::Microseconds(9));
  m.OnLaunch("gqa", Op::kPrefill, 1, 7, stats);
  m.OnQueueWait("gqa", Op::kPrefill, absl::Microseconds(9));
  const std::string text = m.Scrape();
  EXPECT_TRUE(Has(text, R"(attn_batch_tokens_sum{op="prefill",pool="mla"} 100)")) << text;
  EXPECT_TRUE(Has(text, R"(attn_batch_tokens_sum{op="prefill",pool="gqa"} 7)"));
  EXPECT_TRUE(Has(text, R"(attn_queue_wait_seconds_count{op="prefill",pool="mla"} 2)"));
  EXPECT_TRUE(Has(text, R"(attn_queue_wait_seconds_count{op="prefill",pool="gqa"} 1)"));
  EXPECT_TRUE(Has(text, R"(attn_kernel_duration_seconds_count{op="decode",pool="mla"} 0)"));
  // A latency histogram of a pool has the same exact bounds as every other.
  EXPECT_EQ(Bounds(text, R"(attn_kernel_duration_seconds_bucket{op="prefill",pool="mla",)").size(),
            21u);
}

TEST(MetricsTest, ServesOnAFreePort) {
  Metrics m("v", "cpu", "d");
  absl::StatusOr<int> port = m.Serve("127.0.0.1", 0);
  ASSERT_TRUE(port.ok()) << port.status();
  EXPECT_GT(*port, 0);
}

}  // namespace
}  // namespace attn
