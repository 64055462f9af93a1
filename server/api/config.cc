#include "server/api/config.h"

#include <algorithm>
#include <fstream>
#include <limits>
#include <sstream>
#include <thread>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "google/protobuf/text_format.h"
#include "server/api/pool_config.h"
#include "server/engine/status_macros.h"

namespace attn {
namespace {

constexpr int64_t kDefaultMaxMessageBytes = int64_t{512} << 20;
constexpr int64_t kGrpcMessageLimit = (int64_t{1} << 31) - 1;

absl::Status CheckRange(const char* name, int64_t value, int64_t lo, int64_t hi) {
  if (value < lo || value > hi) {
    return absl::InvalidArgumentError(
        absl::StrCat(name, " = ", value, " is outside [", lo, ", ", hi, "]"));
  }
  return absl::OkStatus();
}

bool IsUnixAddress(absl::string_view address) {
  return absl::StartsWith(address, "unix:") || absl::StartsWith(address, "unix-abstract:");
}

// metrics_address is "host", "host:port" or "[v6]:port"; empty takes the listen host. A port
// given there wins over metrics_port.
absl::Status ResolveMetricsAddress(absl::string_view address, ServerOptions* s) {
  if (address.empty()) {
    s->metrics_host = IsUnixAddress(s->listen_address)
                          ? "127.0.0.1"
                          : s->listen_address.substr(0, s->listen_address.rfind(':'));
    return absl::OkStatus();
  }
  const size_t colon = address.rfind(':');
  const bool has_port =
      colon != absl::string_view::npos && (address.front() != '[' || address[colon - 1] == ']');
  if (!has_port) {
    s->metrics_host = std::string(address);
    return absl::OkStatus();
  }
  int port = 0;
  if (!absl::SimpleAtoi(address.substr(colon + 1), &port) || port < 0 || port > 65535 ||
      colon == 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("metrics_address = '", address, "'; expected HOST or HOST:PORT"));
  }
  s->metrics_host = std::string(address.substr(0, colon));
  s->metrics_port = port;
  return absl::OkStatus();
}

absl::Status ParseFileMode(absl::string_view text, ServerOptions* s) {
  if (text.empty()) return absl::OkStatus();
  int mode = 0;
  for (char c : text) {
    if (c < '0' || c > '7' || mode > 0777) {
      mode = -1;
      break;
    }
    mode = mode * 8 + (c - '0');
  }
  if (mode < 0 || mode > 0777) {
    return absl::InvalidArgumentError(
        absl::StrCat("unix_socket_mode = '", text, "'; expected an octal mode such as 0660"));
  }
  if (!absl::StartsWith(s->listen_address, "unix:")) {
    return absl::InvalidArgumentError("unix_socket_mode needs a unix:PATH listen_address");
  }
  s->unix_socket_mode = mode;
  return absl::OkStatus();
}

absl::Status ResolveDataPlane(const v1::DataPlaneConfig& c, DataPlaneOptions* d) {
  d->shared_memory = c.shared_memory();
  d->cuda_ipc = c.cuda_ipc();
  if (c.max_regions_per_session() != 0) {
    d->limits.max_regions_per_session = c.max_regions_per_session();
  }
  if (c.max_region_bytes_per_session() != 0) {
    d->limits.max_bytes_per_session = c.max_region_bytes_per_session();
  }
  if (!c.shm_name_prefix().empty()) d->shm_name_prefix = c.shm_name_prefix();
  if (c.max_call_queues() != 0) d->max_call_queues = c.max_call_queues();
  if (c.max_call_queues_per_session() != 0) {
    d->max_call_queues_per_session = c.max_call_queues_per_session();
  }
  // Polling burns the core it runs on: worth it beside spare cores, not on a small machine where
  // it takes the CPU from the threads that run the call (bench/RESULTS.md, "Call queues").
  d->call_queue_spin_us = c.has_call_queue_spin_us()                 ? c.call_queue_spin_us()
                          : std::thread::hardware_concurrency() >= 8 ? 100
                                                                     : 0;
  if (c.max_plans_per_session() != 0) d->max_plans_per_session = c.max_plans_per_session();
  ATTN_RETURN_IF_ERROR(
      CheckRange("data_plane.max_plans_per_session", d->max_plans_per_session, 1, 1024));
  ATTN_RETURN_IF_ERROR(CheckRange("data_plane.max_call_queues", d->max_call_queues, 1, 1024));
  ATTN_RETURN_IF_ERROR(
      CheckRange("data_plane.max_call_queues_per_session", d->max_call_queues_per_session, 1, 64));
  ATTN_RETURN_IF_ERROR(
      CheckRange("data_plane.call_queue_spin_us", d->call_queue_spin_us, 0, 100000));
  ATTN_RETURN_IF_ERROR(
      CheckRange("data_plane.max_regions_per_session", d->limits.max_regions_per_session, 1, 1024));
  ATTN_RETURN_IF_ERROR(CheckRange("data_plane.max_region_bytes_per_session",
                                  d->limits.max_bytes_per_session, kRegionHeaderBytes,
                                  int64_t{1} << 40));
  const std::string& prefix = d->shm_name_prefix;
  bool ok = prefix.size() >= 2 && prefix.size() <= 200 && prefix[0] == '/';
  for (size_t i = 1; ok && i < prefix.size(); ++i) {
    const char ch = prefix[i];
    ok = (ch >= 'a' && ch <= 'z') || (ch >= 'A' && ch <= 'Z') || (ch >= '0' && ch <= '9') ||
         ch == '_' || ch == '.' || ch == '-';
  }
  if (!ok) {
    return absl::InvalidArgumentError(
        absl::StrCat("data_plane.shm_name_prefix = '", prefix,
                     "' must be '/' and then 1-199 characters of [A-Za-z0-9_.-]"));
  }
  return absl::OkStatus();
}

}  // namespace

v1::ServerConfig DefaultConfig() {
  v1::ServerConfig c;
  c.set_listen_address("127.0.0.1:50051");
  c.set_metrics_port(9464);
  c.set_backend("auto");
  c.set_cpu_threads(0);
  c.set_max_message_bytes(kDefaultMaxMessageBytes);
  c.set_drain_timeout_seconds(30);
  c.set_session_lease_seconds(300);
  v1::BatchingConfig* b = c.mutable_batching();
  const BatchingOptions defaults;
  b->set_max_queue_delay_us(static_cast<int>(absl::ToInt64Microseconds(defaults.max_queue_delay)));
  b->set_max_batch_requests(defaults.max_batch_requests);
  b->set_max_batch_tokens(defaults.max_batch_tokens);
  b->set_max_queue_requests(defaults.max_queue_requests);
  b->set_max_queue_bytes(defaults.max_queue_bytes);
  b->set_max_call_key_reads(defaults.max_call_key_reads);
  c.set_max_sessions(SessionOptions{}.max_sessions);
  c.set_cuda_direct_output_min_bytes(kDefaultCudaDirectOutputMinBytes);
  c.set_cuda_output_chunk_bytes(kDefaultCudaOutputChunkBytes);
  v1::PoolConfig* p = c.add_pools();
  p->set_name("default");
  p->set_kind(v1::POOL_KIND_GQA);
  p->set_num_layers(2);
  p->set_page_size(16);
  p->set_num_qo_heads(32);
  p->set_num_kv_heads(8);
  p->set_head_dim(128);
  p->set_num_pages(4096);
  return c;
}

absl::StatusOr<v1::ServerConfig> ReadConfigFile(const std::string& path) {
  std::ifstream in(path);
  if (!in) return absl::NotFoundError(absl::StrCat("cannot open config file ", path));
  std::stringstream text;
  text << in.rdbuf();
  v1::ServerConfig config;
  if (!google::protobuf::TextFormat::ParseFromString(text.str(), &config)) {
    return absl::InvalidArgumentError(
        absl::StrCat(path, " is not a text-format attnserve.v1.ServerConfig (see the log above)"));
  }
  return config;
}

absl::StatusOr<ServerOptions> ResolveConfig(const v1::ServerConfig* file,
                                            const ConfigOverrides& o) {
  v1::ServerConfig c = DefaultConfig();
  if (file != nullptr) {
    // Zero scalars in the file mean "not set" and merge as no-ops; pools replace the default's.
    if (file->pools_size() > 0) c.clear_pools();
    c.MergeFrom(*file);
  }

  if (o.call_queue_spin_us) c.mutable_data_plane()->set_call_queue_spin_us(*o.call_queue_spin_us);
  ServerOptions s;
  s.listen_address = o.listen_address.value_or(c.listen_address());
  s.metrics_port = o.metrics_port.value_or(c.metrics_port());
  ATTN_RETURN_IF_ERROR(ResolveMetricsAddress(o.metrics_address.value_or(c.metrics_address()), &s));
  ATTN_RETURN_IF_ERROR(ParseFileMode(o.unix_socket_mode.value_or(c.unix_socket_mode()), &s));
  s.backend.kind = o.backend.value_or(c.backend());
  s.backend.cpu_threads = o.cpu_threads.value_or(c.cpu_threads());
  s.max_message_bytes = o.max_message_bytes.value_or(c.max_message_bytes());
  s.backend.cuda_single_stream = o.cuda_single_stream.value_or(c.cuda_single_stream());
  s.backend.cuda_direct_output_min_bytes =
      o.cuda_direct_output_min_bytes.value_or(c.cuda_direct_output_min_bytes());
  s.backend.cuda_output_chunk_bytes =
      o.cuda_output_chunk_bytes.value_or(c.cuda_output_chunk_bytes());
  s.drain_timeout_seconds = o.drain_timeout_seconds.value_or(c.drain_timeout_seconds());
  const int lease_s = o.session_lease_seconds.value_or(c.session_lease_seconds());
  s.sessions.default_lease = absl::Seconds(lease_s);
  s.sessions.max_lease = std::max(absl::Hours(1), s.sessions.default_lease);
  s.sessions.max_pages = o.session_max_pages.value_or(c.session_max_pages());
  s.sessions.max_sessions = o.max_sessions.value_or(c.max_sessions());
  s.tls = c.tls();
  if (o.tls_cert_file) s.tls.set_cert_file(*o.tls_cert_file);
  if (o.tls_key_file) s.tls.set_key_file(*o.tls_key_file);
  if (o.tls_client_ca_file) s.tls.set_client_ca_file(*o.tls_client_ca_file);
  s.access_tokens.assign(c.access_tokens().begin(), c.access_tokens().end());
  s.health_port = o.health_port.value_or(c.health_port());
  if (s.tls.cert_file().empty() != s.tls.key_file().empty()) {
    return absl::InvalidArgumentError("tls: set both cert_file and key_file, or neither");
  }
  if (!s.tls.client_ca_file().empty() && s.tls.cert_file().empty()) {
    return absl::InvalidArgumentError("tls: client_ca_file needs cert_file and key_file");
  }
  ATTN_RETURN_IF_ERROR(CheckRange("health_port", s.health_port, 0, 65535));
  const v1::BatchingConfig& b = c.batching();
  s.batching.max_queue_delay =
      absl::Microseconds(o.max_queue_delay_us.value_or(b.max_queue_delay_us()));
  s.batching.max_batch_requests = o.max_batch_requests.value_or(b.max_batch_requests());
  s.batching.max_batch_tokens = o.max_batch_tokens.value_or(b.max_batch_tokens());
  s.batching.max_queue_requests = o.max_queue_requests.value_or(b.max_queue_requests());
  s.batching.max_queue_bytes = o.max_queue_bytes.value_or(b.max_queue_bytes());
  s.batching.max_call_key_reads = o.max_call_key_reads.value_or(b.max_call_key_reads());

  if (s.listen_address.empty()) return absl::InvalidArgumentError("listen_address is empty");
  if (s.backend.kind != "auto" && s.backend.kind != "cpu" && s.backend.kind != "cuda") {
    return absl::InvalidArgumentError(
        absl::StrCat("backend = '", s.backend.kind, "'; use auto, cpu or cuda"));
  }
  ATTN_RETURN_IF_ERROR(CheckRange("metrics_port", s.metrics_port, 0, 65535));
  ATTN_RETURN_IF_ERROR(CheckRange("cpu_threads", s.backend.cpu_threads, 0, 1024));
  ATTN_RETURN_IF_ERROR(CheckRange("drain_timeout_seconds", s.drain_timeout_seconds, 0, 3600));
  ATTN_RETURN_IF_ERROR(CheckRange("session_lease_seconds", lease_s, 1, 7 * 24 * 3600));
  ATTN_RETURN_IF_ERROR(CheckRange("session_max_pages", s.sessions.max_pages, 0,
                                  std::numeric_limits<int32_t>::max()));
  ATTN_RETURN_IF_ERROR(CheckRange("max_sessions", s.sessions.max_sessions, 1, 1 << 24));
  ATTN_RETURN_IF_ERROR(CheckRange("cuda_direct_output_min_bytes",
                                  s.backend.cuda_direct_output_min_bytes, 0,
                                  std::numeric_limits<int64_t>::max()));
  ATTN_RETURN_IF_ERROR(CheckRange("cuda_output_chunk_bytes", s.backend.cuda_output_chunk_bytes, 0,
                                  std::numeric_limits<int64_t>::max()));
  ATTN_RETURN_IF_ERROR(
      CheckRange("max_message_bytes", s.max_message_bytes, 1 << 20, kGrpcMessageLimit));
  ATTN_RETURN_IF_ERROR(CheckRange(
      "max_queue_delay_us", absl::ToInt64Microseconds(s.batching.max_queue_delay), 0, 1000000));
  ATTN_RETURN_IF_ERROR(CheckRange("max_batch_requests", s.batching.max_batch_requests, 1, 65536));
  ATTN_RETURN_IF_ERROR(CheckRange("max_batch_tokens", s.batching.max_batch_tokens, 1, 1 << 24));
  ATTN_RETURN_IF_ERROR(CheckRange("max_queue_requests", s.batching.max_queue_requests, 1, 1 << 20));
  ATTN_RETURN_IF_ERROR(ResolveDataPlane(c.data_plane(), &s.data_plane));
  ATTN_RETURN_IF_ERROR(
      CheckRange("max_queue_bytes", s.batching.max_queue_bytes, 1 << 20, int64_t{1} << 40));
  ATTN_RETURN_IF_ERROR(
      CheckRange("max_call_key_reads", s.batching.max_call_key_reads, 1, int64_t{1} << 50));
  for (const v1::PoolConfig& p : c.pools()) {
    ATTN_ASSIGN_OR_RETURN(PoolGeometry g, GeometryFromConfig(p));
    s.pools.push_back(std::move(g));
  }
  return s;
}

}  // namespace attn
