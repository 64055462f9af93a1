// Server configuration: the embedded default, a text-format config file, and command-line
// overrides, resolved into the options the server starts with.
//
// Precedence, lowest first: the embedded default (CPU-friendly single GQA pool on localhost), the
// config file (its pools replace the default pool; its scalar fields replace the defaults they
// set), then command-line flags that were given.
#pragma once

#include <optional>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "attnserve/v1/server_config.pb.h"
#include "server/backends/backend_factory.h"
#include "server/engine/batcher.h"
#include "server/engine/pool_geometry.h"
#include "server/engine/regions.h"
#include "server/engine/sessions.h"

namespace attn {

namespace v1 = ::attnserve::v1;

struct ServerOptions {
  std::string listen_address;
  int metrics_port = 0;      // 0: no /metrics endpoint
  // Host /metrics binds: the listen address's host for TCP, 127.0.0.1 for a unix: address.
  std::string metrics_host;
  int unix_socket_mode = -1;  // file mode of a unix: listen address's socket; -1: as created
  BackendOptions backend;
  int64_t max_message_bytes = 0;
  int drain_timeout_seconds = 0;  // SIGTERM: how long accepted calls may take to finish
  BatchingOptions batching;
  SessionOptions sessions;
  DataPlaneOptions data_plane;  // registered memory: off unless the config enables it
  v1::TlsConfig tls;         // empty cert_file: plaintext
  std::vector<v1::AccessToken> access_tokens;  // empty: no authorization
  int health_port = 0;       // plaintext health-only port; 0: none
  std::vector<PoolGeometry> pools;
};

// Values given on the command line; unset ones leave the lower layers in place.
struct ConfigOverrides {
  std::optional<std::string> listen_address;
  std::optional<int> metrics_port;
  std::optional<std::string> metrics_address;
  std::optional<std::string> unix_socket_mode;
  std::optional<std::string> backend;
  std::optional<int> cpu_threads;
  std::optional<int64_t> max_message_bytes;
  std::optional<int> max_queue_delay_us;
  std::optional<int> max_batch_requests;
  std::optional<int> max_batch_tokens;
  std::optional<int> max_queue_requests;
  std::optional<int64_t> max_queue_bytes;
  std::optional<int64_t> max_call_key_reads;
  std::optional<int> max_sessions;
  std::optional<bool> cuda_single_stream;
  std::optional<int64_t> cuda_direct_output_min_bytes;
  std::optional<int64_t> cuda_output_chunk_bytes;
  std::optional<int> drain_timeout_seconds;
  std::optional<int> session_lease_seconds;
  std::optional<int> session_max_pages;
  std::optional<std::string> tls_cert_file;
  std::optional<std::string> tls_key_file;
  std::optional<std::string> tls_client_ca_file;
  std::optional<int> health_port;
  std::optional<int> call_queue_spin_us;
};

// The embedded default: 127.0.0.1:50051 (metrics on port 9464), backend auto, one GQA pool
// "default" (2 layers, 32 query / 8 KV heads, head_dim 128, page size 16, 4096 pages = 512 MiB).
v1::ServerConfig DefaultConfig();

// Parses a text-format attnserve.v1.ServerConfig file.
absl::StatusOr<v1::ServerConfig> ReadConfigFile(const std::string& path);

// Layers `file` (may be null) and `overrides` over the default and checks the result.
absl::StatusOr<ServerOptions> ResolveConfig(const v1::ServerConfig* file,
                                            const ConfigOverrides& overrides);

}  // namespace attn
