#include "server/metrics/process_collector.h"

#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <limits>
#include <optional>
#include <sstream>
#include <utility>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_split.h"
#include "absl/strings/string_view.h"
#include "absl/strings/strip.h"

namespace attn {
namespace {

using prometheus::ClientMetric;
using prometheus::MetricFamily;
using prometheus::MetricType;

std::optional<std::string> ReadFile(const std::string& path) {
  std::ifstream in(path);
  if (!in) return std::nullopt;
  std::ostringstream text;
  text << in.rdbuf();
  return text.str();
}

// The fields of /proc/<pid>/stat (proc(5)) that the families need, in their units there.
struct Stat {
  double utime_ticks = 0;
  double stime_ticks = 0;
  double start_ticks = 0;  // after boot
  double vsize_bytes = 0;
  double rss_pages = 0;
};

std::optional<Stat> ParseStat(absl::string_view text) {
  // Field 2 is the command name in parentheses, which may itself hold spaces and parentheses:
  // the fields after it start behind the last ')'.
  const size_t close = text.rfind(')');
  if (close == absl::string_view::npos) return std::nullopt;
  const std::vector<absl::string_view> f =
      absl::StrSplit(text.substr(close + 1), ' ', absl::SkipWhitespace());
  // f[0] is field 3 (state), so field n is f[n - 3]: utime 14, stime 15, starttime 22, vsize 23,
  // rss 24.
  if (f.size() < 22) return std::nullopt;
  Stat s;
  if (!absl::SimpleAtod(f[11], &s.utime_ticks) || !absl::SimpleAtod(f[12], &s.stime_ticks) ||
      !absl::SimpleAtod(f[19], &s.start_ticks) || !absl::SimpleAtod(f[20], &s.vsize_bytes) ||
      !absl::SimpleAtod(f[21], &s.rss_pages)) {
    return std::nullopt;
  }
  return s;
}

// "btime <seconds since the epoch>" of /proc/stat: when the machine booted.
std::optional<double> ParseBootTime(absl::string_view text) {
  for (absl::string_view line : absl::StrSplit(text, '\n')) {
    if (absl::ConsumePrefix(&line, "btime ")) {
      double t;
      if (absl::SimpleAtod(absl::StripAsciiWhitespace(line), &t)) return t;
    }
  }
  return std::nullopt;
}

// The soft limit of "Max open files" in /proc/<pid>/limits; "unlimited" is +Inf.
std::optional<double> ParseMaxFds(absl::string_view text) {
  for (absl::string_view line : absl::StrSplit(text, '\n')) {
    if (!absl::ConsumePrefix(&line, "Max open files")) continue;
    const std::vector<absl::string_view> f = absl::StrSplit(line, ' ', absl::SkipWhitespace());
    if (f.empty()) return std::nullopt;
    if (f[0] == "unlimited") return std::numeric_limits<double>::infinity();
    double v;
    if (absl::SimpleAtod(f[0], &v)) return v;
    return std::nullopt;
  }
  return std::nullopt;
}

// The entries of a directory. For <pid>/fd that includes the descriptor that reads it, as in the
// Go client's process_open_fds.
std::optional<double> CountEntries(const std::string& dir) {
  std::error_code error;
  std::filesystem::directory_iterator it(dir, error);
  if (error) return std::nullopt;
  double n = 0;
  for (; it != std::filesystem::directory_iterator(); it.increment(error)) {
    if (error) return std::nullopt;
    ++n;
  }
  return n;
}

void Add(std::vector<MetricFamily>& out, const char* name, const char* help, MetricType type,
         double value) {
  ClientMetric m;
  if (type == MetricType::Counter) {
    m.counter.value = value;
  } else {
    m.gauge.value = value;
  }
  out.push_back(MetricFamily{name, help, type, {std::move(m)}});
}

}  // namespace

ProcessCollector::ProcessCollector(std::string proc_root) : root_(std::move(proc_root)) {}

std::vector<MetricFamily> ProcessCollector::Collect() const {
  std::vector<MetricFamily> out;
  const std::string self = root_ + "/self";
  const double ticks_per_second = static_cast<double>(sysconf(_SC_CLK_TCK));
  const double page_bytes = static_cast<double>(sysconf(_SC_PAGESIZE));

  std::optional<Stat> stat;
  if (std::optional<std::string> text = ReadFile(self + "/stat")) stat = ParseStat(*text);
  if (stat) {
    Add(out, "process_cpu_seconds_total", "User and system CPU time spent in seconds",
        MetricType::Counter, (stat->utime_ticks + stat->stime_ticks) / ticks_per_second);
    Add(out, "process_virtual_memory_bytes", "Virtual memory size in bytes", MetricType::Gauge,
        stat->vsize_bytes);
    Add(out, "process_resident_memory_bytes", "Resident memory size in bytes", MetricType::Gauge,
        stat->rss_pages * page_bytes);
    std::optional<double> boot;
    if (std::optional<std::string> text = ReadFile(root_ + "/stat")) boot = ParseBootTime(*text);
    if (boot) {
      Add(out, "process_start_time_seconds",
          "Start time of the process since unix epoch in seconds", MetricType::Gauge,
          *boot + stat->start_ticks / ticks_per_second);
    }
  }
  if (std::optional<double> fds = CountEntries(self + "/fd")) {
    Add(out, "process_open_fds", "Number of open file descriptors", MetricType::Gauge, *fds);
  }
  std::optional<double> max_fds;
  if (std::optional<std::string> text = ReadFile(self + "/limits")) max_fds = ParseMaxFds(*text);
  if (max_fds) {
    Add(out, "process_max_fds", "Maximum number of open file descriptors", MetricType::Gauge,
        *max_fds);
  }
  return out;
}

}  // namespace attn
