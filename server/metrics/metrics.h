// Prometheus metrics of the server (prometheus-cpp), served at /metrics.
//
// Names follow Prometheus conventions: prefix attn_, base units (seconds, bytes), counters end in
// _total, and every label set is bounded (methods, status codes, ops, pools, directions; never a
// client or sequence id). Launch histograms (queue wait, kernel time, launch stages, batch sizes)
// are labelled by pool and op: a server with a GQA and an MLA pool serves two models. Latency
// histograms use 1-2-5 buckets from 5 microseconds to 10 seconds; batch-size histograms use powers
// of two. The standard process_* families (memory, descriptors, CPU time, start time) come along.
// Thread safe.
#pragma once

#include <array>
#include <functional>
#include <map>
#include <memory>
#include <string>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "prometheus/counter.h"
#include "prometheus/exposer.h"
#include "prometheus/family.h"
#include "prometheus/gauge.h"
#include "prometheus/histogram.h"
#include "prometheus/registry.h"
#include "server/engine/batcher.h"
#include "server/engine/observer.h"
#include "server/metrics/process_collector.h"

namespace attn {

class Metrics final : public BatchObserver, public PageObserver {
 public:
  Metrics(const std::string& version, const std::string& backend, const std::string& device);
  ~Metrics() override;

  // Serves /metrics on host:port (port 0 picks a free one); returns the bound port. At most 4
  // requests are served at once (8 more connections wait), each given 2 s to arrive.
  absl::StatusOr<int> Serve(const std::string& host, int port);

  // The text exposition (what a scrape returns, process_* families included), for tests and
  // debugging.
  std::string Scrape() const;

  // Creates a method's count of successful calls and of INTERNAL failures at zero: a healthy
  // server then shows 0 (not "no data") on the dashboard, and increase() sees the first
  // internal error, which a series born at 1 would hide.
  void AddMethod(const std::string& method);

  // One finished RPC (server-side end to end) and, when it failed, why.
  void OnRpc(const char* method, const absl::Status& status, absl::Duration duration);
  void OnRpcStarted() { inflight_.Increment(); }
  void OnRpcFinished() { inflight_.Decrement(); }

  // Creates a pool's series at zero (so rates start from the first scrape) and sets its pages.
  // A pool the observer reports before AddPool gets its launch series then.
  void AddPool(const std::string& pool, int total_pages);
  void SetPoolPages(const std::string& pool, int free_pages, int total_pages);

  // PageObserver (called by the engine, under its pools' locks): every page-count change sets the
  // pool gauges; a lease reclaim also counts its pages.
  void OnPoolAdded(const std::string& pool, int total_pages) override {
    AddPool(pool, total_pages);
  }
  void OnPageChange(const PageChange& change) override;
  void OnAllocationFailure(const std::string& pool) override;

  // BatchObserver (called on batcher threads).
  void OnLaunch(const std::string& pool, Op op, int requests, int tokens,
                const LaunchStats& stats) override;
  void OnQueueWait(const std::string& pool, Op op, absl::Duration wait) override;

 private:
  struct OpMetrics {
    prometheus::Histogram* queue_wait;
    prometheus::Histogram* kernel;
    prometheus::Histogram* prepare;  // attn_launch_stage_seconds by stage
    prometheus::Histogram* execute;
    prometheus::Histogram* finish;
    prometheus::Histogram* batch_requests;
    prometheus::Histogram* batch_tokens;
  };
  using PoolMetrics = std::array<OpMetrics, 2>;  // indexed by Op

  // The launch series of (pool, op), created on first use.
  OpMetrics LaunchSeries(const std::string& pool, Op op) ABSL_LOCKS_EXCLUDED(mu_);

  std::shared_ptr<prometheus::Registry> registry_;
  std::shared_ptr<ProcessCollector> process_;
  std::unique_ptr<prometheus::Exposer> exposer_;  // after what it serves: destroyed first
  prometheus::Family<prometheus::Histogram>& rpc_duration_;
  prometheus::Family<prometheus::Counter>& rpc_requests_;
  prometheus::Family<prometheus::Counter>& request_errors_;
  prometheus::Family<prometheus::Gauge>& kv_pages_;
  prometheus::Family<prometheus::Gauge>& kv_pages_capacity_;
  prometheus::Family<prometheus::Counter>& alloc_failures_;
  prometheus::Family<prometheus::Counter>& pages_reclaimed_;
  prometheus::Family<prometheus::Counter>& transfer_bytes_;
  prometheus::Counter& bytes_in_;
  prometheus::Counter& bytes_out_;
  prometheus::Gauge& inflight_;
  prometheus::Family<prometheus::Histogram>& queue_wait_;
  prometheus::Family<prometheus::Histogram>& kernel_;
  prometheus::Family<prometheus::Histogram>& stage_;
  prometheus::Family<prometheus::Histogram>& batch_requests_;
  prometheus::Family<prometheus::Histogram>& batch_tokens_;

  // The families would find a series by its labels themselves; this map saves hashing the labels
  // on every call.
  absl::Mutex mu_;
  std::map<std::string, PoolMetrics, std::less<>> pools_ ABSL_GUARDED_BY(mu_);
};

}  // namespace attn
