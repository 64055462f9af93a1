#include "server/metrics/metrics.h"

#include <string>
#include <utility>
#include <vector>

#include "absl/strings/ascii.h"
#include "absl/strings/str_cat.h"
#include "prometheus/text_serializer.h"

namespace attn {
namespace {

using prometheus::Histogram;

// 5 us .. 10 s in a 1-2-5 series, written as literals: each is the double nearest its decimal,
// so the exposition prints le="0.0001" (a computed 1e-6 * 10 * 10 prints 9.999999999999999e-05,
// which an le="0.0001" query never finds).
Histogram::BucketBoundaries LatencyBuckets() {
  return {5e-6, 1e-5, 2e-5, 5e-5, 1e-4, 2e-4, 5e-4, 1e-3, 2e-3, 5e-3,
          0.01, 0.02, 0.05, 0.1,  0.2,  0.5,  1,    2,    5,    10};
}

// 1, 2, 4, ... up to `max`.
Histogram::BucketBoundaries PowersOfTwo(double max) {
  Histogram::BucketBoundaries b;
  for (double v = 1; v <= max; v *= 2) b.push_back(v);
  return b;
}

std::string CodeName(absl::StatusCode code) {
  return absl::AsciiStrToLower(absl::StatusCodeToString(code));
}

double Seconds(absl::Duration d) { return absl::ToDoubleSeconds(d); }

}  // namespace

Metrics::Metrics(const std::string& version, const std::string& backend, const std::string& device)
    : registry_(std::make_shared<prometheus::Registry>()),
      process_(std::make_shared<ProcessCollector>()),
      rpc_duration_(prometheus::BuildHistogram()
                        .Name("attn_rpc_duration_seconds")
                        .Help("Server-side time from a call's arrival to its completion")
                        .Register(*registry_)),
      rpc_requests_(prometheus::BuildCounter()
                        .Name("attn_rpc_requests_total")
                        .Help("Finished calls by method and status code")
                        .Register(*registry_)),
      request_errors_(prometheus::BuildCounter()
                          .Name("attn_request_errors_total")
                          .Help("Failed calls by method and reason (the status code)")
                          .Register(*registry_)),
      kv_pages_(prometheus::BuildGauge()
                    .Name("attn_kv_pages")
                    .Help("KV cache pages by pool and state (free or used)")
                    .Register(*registry_)),
      kv_pages_capacity_(prometheus::BuildGauge()
                             .Name("attn_kv_pages_capacity")
                             .Help("KV cache pages a pool holds")
                             .Register(*registry_)),
      alloc_failures_(prometheus::BuildCounter()
                          .Name("attn_page_alloc_failures_total")
                          .Help("AllocatePages calls refused because the pool was too full")
                          .Register(*registry_)),
      pages_reclaimed_(prometheus::BuildCounter()
                           .Name("attn_pages_reclaimed_total")
                           .Help("Pages of sessions whose lease expired, returned to the pool")
                           .Register(*registry_)),
      transfer_bytes_(prometheus::BuildCounter()
                          .Name("attn_transfer_bytes_total")
                          .Help("Bytes moved to the backend (in: inputs) and back (out: outputs)")
                          .Register(*registry_)),
      bytes_in_(transfer_bytes_.Add({{"direction", "in"}})),
      bytes_out_(transfer_bytes_.Add({{"direction", "out"}})),
      inflight_(prometheus::BuildGauge()
                    .Name("attn_inflight_requests")
                    .Help("Calls received and not yet finished")
                    .Register(*registry_)
                    .Add({})),
      queue_wait_(prometheus::BuildHistogram()
                      .Name("attn_queue_wait_seconds")
                      .Help("Time a call waited in its batcher's queue")
                      .Register(*registry_)),
      kernel_(prometheus::BuildHistogram()
                  .Name("attn_kernel_duration_seconds")
                  .Help("Append + attention time of a launch (device time on the GPU)")
                  .Register(*registry_)),
      stage_(prometheus::BuildHistogram()
                 .Name("attn_launch_stage_seconds")
                 .Help("Time of each stage of a launch: prepare (merge, plan, gather inputs), "
                       "execute (copies and kernels), finish (write outputs)")
                 .Register(*registry_)),
      batch_requests_(prometheus::BuildHistogram()
                          .Name("attn_batch_requests")
                          .Help("Calls merged into one launch")
                          .Register(*registry_)),
      batch_tokens_(prometheus::BuildHistogram()
                        .Name("attn_batch_tokens")
                        .Help("Query tokens in one launch")
                        .Register(*registry_)) {
  prometheus::BuildGauge()
      .Name("attn_build_info")
      .Help("Version, backend and device of this server (value 1)")
      .Register(*registry_)
      .Add({{"version", version}, {"backend", backend}, {"device", device}})
      .Set(1);
}

Metrics::~Metrics() = default;

absl::StatusOr<int> Metrics::Serve(const std::string& host, int port) {
  // civetweb's defaults let two idle, half-sent requests hold both workers for 30 s, so a scrape
  // waited that long: a request now has 2 s to arrive, and 4 workers (with 8 connections queued
  // for them) bound what /metrics can take from the process.
  const std::vector<std::string> options = {
      "listening_ports",       absl::StrCat(host, ":", port),
      "num_threads",           "4",
      "connection_queue",      "8",
      "request_timeout_ms",    "2000",
      "keep_alive_timeout_ms", "2000",
  };
  try {
    exposer_ = std::make_unique<prometheus::Exposer>(options);
  } catch (const std::exception& e) {  // civetweb reports a failed bind by throwing
    return absl::UnavailableError(
        absl::StrCat("cannot serve metrics on ", host, ":", port, ": ", e.what()));
  }
  exposer_->RegisterCollectable(registry_);
  exposer_->RegisterCollectable(process_);
  const std::vector<int> ports = exposer_->GetListeningPorts();
  return ports.empty() ? port : ports.front();
}

std::string Metrics::Scrape() const {
  std::vector<prometheus::MetricFamily> families = registry_->Collect();
  for (prometheus::MetricFamily& f : process_->Collect()) families.push_back(std::move(f));
  return prometheus::TextSerializer().Serialize(families);
}

void Metrics::AddMethod(const std::string& method) {
  rpc_requests_.Add({{"method", method}, {"code", CodeName(absl::StatusCode::kOk)}});
  request_errors_.Add({{"method", method}, {"reason", CodeName(absl::StatusCode::kInternal)}});
}

void Metrics::OnRpc(const char* method, const absl::Status& status, absl::Duration duration) {
  const std::string code = CodeName(status.code());
  rpc_duration_.Add({{"method", method}, {"code", code}}, LatencyBuckets())
      .Observe(Seconds(duration));
  rpc_requests_.Add({{"method", method}, {"code", code}}).Increment();
  if (!status.ok()) request_errors_.Add({{"method", method}, {"reason", code}}).Increment();
}

Metrics::OpMetrics Metrics::LaunchSeries(const std::string& pool, Op op) {
  const int index = static_cast<int>(op);
  {
    absl::ReaderMutexLock lock(&mu_);
    auto it = pools_.find(pool);
    if (it != pools_.end()) return it->second[index];
  }
  absl::MutexLock lock(&mu_);
  auto [it, inserted] = pools_.try_emplace(pool);
  if (inserted) {
    for (Op o : {Op::kPrefill, Op::kDecode}) {
      const prometheus::Labels labels{{"pool", pool}, {"op", OpName(o)}};
      auto stage = [&](const char* name) {
        return &stage_.Add({{"pool", pool}, {"op", OpName(o)}, {"stage", name}}, LatencyBuckets());
      };
      it->second[static_cast<int>(o)] = OpMetrics{&queue_wait_.Add(labels, LatencyBuckets()),
                                                  &kernel_.Add(labels, LatencyBuckets()),
                                                  stage("prepare"),
                                                  stage("execute"),
                                                  stage("finish"),
                                                  &batch_requests_.Add(labels, PowersOfTwo(1024)),
                                                  &batch_tokens_.Add(labels, PowersOfTwo(1 << 20))};
    }
  }
  return it->second[index];
}

void Metrics::AddPool(const std::string& pool, int total_pages) {
  LaunchSeries(pool, Op::kDecode);  // creates the launch series of both ops
  alloc_failures_.Add({{"pool", pool}});
  pages_reclaimed_.Add({{"pool", pool}});
  SetPoolPages(pool, total_pages, total_pages);
}

void Metrics::SetPoolPages(const std::string& pool, int free_pages, int total_pages) {
  kv_pages_.Add({{"pool", pool}, {"state", "free"}}).Set(free_pages);
  kv_pages_.Add({{"pool", pool}, {"state", "used"}}).Set(total_pages - free_pages);
  kv_pages_capacity_.Add({{"pool", pool}}).Set(total_pages);
}

void Metrics::OnAllocationFailure(const std::string& pool) {
  alloc_failures_.Add({{"pool", pool}}).Increment();
}

void Metrics::OnPageChange(const PageChange& change) {
  SetPoolPages(change.pool, change.free_pages, change.total_pages);
  if (change.event == PageEvent::kReclaimed) {
    pages_reclaimed_.Add({{"pool", change.pool}}).Increment(change.pages);
  }
}

void Metrics::OnLaunch(const std::string& pool, Op op, int requests, int tokens,
                       const LaunchStats& stats) {
  const OpMetrics m = LaunchSeries(pool, op);
  m.kernel->Observe(Seconds(stats.compute));
  m.prepare->Observe(Seconds(stats.prepare));
  m.execute->Observe(Seconds(stats.execute));
  m.finish->Observe(Seconds(stats.finish));
  m.batch_requests->Observe(requests);
  m.batch_tokens->Observe(tokens);
  bytes_in_.Increment(static_cast<double>(stats.bytes_in));
  bytes_out_.Increment(static_cast<double>(stats.bytes_out));
}

void Metrics::OnQueueWait(const std::string& pool, Op op, absl::Duration wait) {
  LaunchSeries(pool, op).queue_wait->Observe(Seconds(wait));
}

}  // namespace attn
