// The standard process_* families of Prometheus' client libraries, read from procfs at each
// scrape: process_cpu_seconds_total, process_start_time_seconds, process_resident_memory_bytes,
// process_virtual_memory_bytes, process_open_fds and process_max_fds. Linux only.
#pragma once

#include <string>
#include <vector>

#include "prometheus/collectable.h"
#include "prometheus/metric_family.h"

namespace attn {

class ProcessCollector final : public prometheus::Collectable {
 public:
  // Reads <proc_root>/self/{stat,fd,limits} and <proc_root>/stat (boot time). Another root than
  // /proc is for tests.
  explicit ProcessCollector(std::string proc_root = "/proc");

  // A family whose file cannot be read or parsed is left out of the scrape (a scrape never
  // fails for it). Thread safe: it holds no state.
  std::vector<prometheus::MetricFamily> Collect() const override;

 private:
  const std::string root_;
};

}  // namespace attn
