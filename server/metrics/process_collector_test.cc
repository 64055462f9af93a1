#include "server/metrics/process_collector.h"

#include <fcntl.h>
#include <unistd.h>

#include <cmath>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <map>
#include <string>

#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "gtest/gtest.h"
#include "prometheus/metric_type.h"

namespace attn {
namespace {

using prometheus::MetricType;

// name -> value of every family (each has one sample); the type is checked on the way.
std::map<std::string, double> Values(const ProcessCollector& c) {
  std::map<std::string, double> values;
  for (const prometheus::MetricFamily& f : c.Collect()) {
    EXPECT_EQ(f.metric.size(), 1u) << f.name;
    EXPECT_FALSE(f.help.empty()) << f.name;
    const bool counter = f.name == "process_cpu_seconds_total";
    EXPECT_EQ(f.type, counter ? MetricType::Counter : MetricType::Gauge) << f.name;
    values[f.name] = counter ? f.metric[0].counter.value : f.metric[0].gauge.value;
  }
  return values;
}

TEST(ProcessCollectorTest, ReadsThisProcess) {
  ProcessCollector c;
  std::map<std::string, double> v = Values(c);
  ASSERT_EQ(v.size(), 6u);
  EXPECT_GT(v["process_resident_memory_bytes"], 0);
  EXPECT_GE(v["process_virtual_memory_bytes"], v["process_resident_memory_bytes"]);
  EXPECT_GE(v["process_open_fds"], 3);  // stdin, stdout, stderr
  EXPECT_GE(v["process_max_fds"], v["process_open_fds"]);
  EXPECT_GE(v["process_cpu_seconds_total"], 0);
  const double now = absl::ToDoubleSeconds(absl::Now() - absl::UnixEpoch());
  EXPECT_LE(v["process_start_time_seconds"], now + 1);  // rounded to clock ticks
  EXPECT_GT(v["process_start_time_seconds"], now - 3600);

  // Descriptors opened are counted at the next scrape.
  const double before = v["process_open_fds"];
  int fds[3];
  for (int& fd : fds) fd = open("/dev/null", O_RDONLY | O_CLOEXEC);
  for (int fd : fds) ASSERT_GE(fd, 0);
  EXPECT_EQ(Values(c)["process_open_fds"], before + 3);
  for (int fd : fds) close(fd);
  EXPECT_EQ(Values(c)["process_open_fds"], before);
}

TEST(ProcessCollectorTest, CpuTimeGrowsWithWork) {
  ProcessCollector c;
  const double before = Values(c)["process_cpu_seconds_total"];
  // Spin until the kernel has charged at least two clock ticks (bounded: at most 20 s of wall).
  const absl::Time give_up = absl::Now() + absl::Seconds(20);
  volatile double sink = 0;
  double after = before;
  while (after < before + 0.02 && absl::Now() < give_up) {
    for (int i = 0; i < 1000000; ++i) sink = sink + std::sqrt(static_cast<double>(i));
    after = Values(c)["process_cpu_seconds_total"];
  }
  EXPECT_GE(after, before + 0.02);
}

// A procfs of files written here: the parsing of each field, a command name with spaces and
// parentheses, "unlimited" descriptors.
class FakeProcTest : public ::testing::Test {
 protected:
  void SetUp() override {
    // One directory per test process: ctest runs this suite's tests in parallel.
    root_ = std::filesystem::path(testing::TempDir()) / ("fake_proc." + std::to_string(getpid()));
    std::filesystem::remove_all(root_);
    std::filesystem::create_directories(root_ / "self" / "fd");
    for (const char* fd : {"0", "1", "2", "7"}) Write(std::string("self/fd/") + fd, "");
    Write("stat", "cpu  1 2 3 4\nintr 5\nbtime 1700000000\nprocesses 9\n");
  }
  void TearDown() override { std::filesystem::remove_all(root_); }
  void Write(const std::string& name, const std::string& text) {
    std::ofstream(root_ / name) << text;
  }
  std::filesystem::path root_;
};

TEST_F(FakeProcTest, ParsesEveryField) {
  const double hz = static_cast<double>(sysconf(_SC_CLK_TCK));
  const double page = static_cast<double>(sysconf(_SC_PAGESIZE));
  // Fields 1..24 of proc(5): utime 14 = 3 s, stime 15 = 1 s, starttime 22 = 50 s after boot,
  // vsize 23, rss 24 (pages).
  const auto ticks = [hz](double s) { return std::to_string(static_cast<long>(s * hz)); };
  Write("self/stat", "42 (attn (x) serve) S 1 42 42 0 -1 4194560 100 0 0 0 " + ticks(3) + " " +
                         ticks(1) + " 0 0 20 0 9 0 " + ticks(50) +
                         " 123456789 2500 18446744073709551615 1 1 0 0 0 0 0 0 0\n");
  Write("self/limits",
        "Limit                     Soft Limit           Hard Limit           Units\n"
        "Max processes             514000               514000               processes\n"
        "Max open files            4096                 524288               files\n");
  std::map<std::string, double> v = Values(ProcessCollector(root_.string()));
  EXPECT_DOUBLE_EQ(v["process_cpu_seconds_total"], 4);
  EXPECT_DOUBLE_EQ(v["process_start_time_seconds"], 1700000050);
  EXPECT_DOUBLE_EQ(v["process_virtual_memory_bytes"], 123456789);
  EXPECT_DOUBLE_EQ(v["process_resident_memory_bytes"], 2500 * page);
  EXPECT_DOUBLE_EQ(v["process_open_fds"], 4);
  EXPECT_DOUBLE_EQ(v["process_max_fds"], 4096);
}

TEST_F(FakeProcTest, UnlimitedDescriptorsAndUnreadableFilesAreNotFatal) {
  Write("self/stat", "42 (truncated");
  Write("self/limits",
        "Max open files            unlimited            unlimited            files\n");
  std::map<std::string, double> v = Values(ProcessCollector(root_.string()));
  EXPECT_TRUE(std::isinf(v["process_max_fds"]));
  EXPECT_EQ(v.count("process_cpu_seconds_total"), 0u);  // the bad stat leaves its families out
  EXPECT_EQ(v.count("process_start_time_seconds"), 0u);
  EXPECT_DOUBLE_EQ(v["process_open_fds"], 4);
  EXPECT_TRUE(ProcessCollector((root_ / "nowhere").string()).Collect().empty());
}

}  // namespace
}  // namespace attn
