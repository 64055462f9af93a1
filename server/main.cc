// attnserve: the attention server. With no arguments it serves the embedded default (see
// server/api/config.h) on 127.0.0.1:50051; --config=FILE names a text-format ServerConfig, and the
// flags below override single settings.
#include <malloc.h>
#include <pthread.h>
#include <signal.h>
#include <sys/stat.h>

#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <iostream>
#include <memory>
#include <optional>
#include <random>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/flags/usage.h"
#include "absl/flags/usage_config.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "absl/synchronization/notification.h"
#include "google/protobuf/descriptor.h"
#include "google/protobuf/stubs/logging.h"
#include "grpcpp/grpcpp.h"
#include "server/api/config.h"
#include "server/backends/backend_factory.h"
#include "server/engine/engine.h"
#include "server/engine/status_macros.h"
#include "server/metrics/metrics.h"
#include "server/rpc/auth.h"
#include "server/rpc/health.h"
#include "server/rpc/reflection.h"
#include "server/rpc/service.h"
#include "server/rpc/transport_args.h"

// Sentinels ("" and -1) mean "not given": the config file or the embedded default applies.
ABSL_FLAG(std::string, config, "", "Text-format attnserve.v1.ServerConfig file");
ABSL_FLAG(std::string, listen_address, "",
          "host:port or unix:PATH to serve on (default 127.0.0.1:50051)");
ABSL_FLAG(std::string, unix_socket_mode, "",
          "File mode of the unix:PATH socket, octal (e.g. 0660; default: as created)");
ABSL_FLAG(int, metrics_port, -1, "Port of the Prometheus /metrics endpoint (default 9464), 0 = off");
ABSL_FLAG(std::string, metrics_address, "",
          "HOST or HOST:PORT /metrics binds (default: the listen host; 127.0.0.1 for unix:)");
ABSL_FLAG(std::string, backend, "", "auto, cpu or cuda (default auto: cuda when a GPU is present)");
ABSL_FLAG(int, cpu_threads, -1, "CPU backend threads (default: hardware concurrency)");
ABSL_FLAG(int64_t, max_message_bytes, -1, "Largest request/response (default 512 MiB)");
ABSL_FLAG(int, max_queue_delay_us, -1, "Longest wait for calls to merge with (microseconds)");
ABSL_FLAG(int, max_batch_requests, -1, "Most calls merged into one launch");
ABSL_FLAG(int, max_batch_tokens, -1, "Most query tokens in one launch");
ABSL_FLAG(int, max_queue_requests, -1, "Queued calls per pool and op before RESOURCE_EXHAUSTED");
ABSL_FLAG(int64_t, max_queue_bytes, -1,
          "Bytes the queued calls of one pool and op may hold before RESOURCE_EXHAUSTED "
          "(default 512 MiB)");
ABSL_FLAG(int64_t, max_call_key_reads, -1,
          "Work budget of one call: keys read, sum of q_len * kv_len (default 2^30)");
ABSL_FLAG(int, max_sessions, -1, "Open sessions at once (default 4096)");
ABSL_FLAG(int, drain_timeout_seconds, -1,
          "On SIGTERM, how long accepted calls may take to finish (default 30)");
ABSL_FLAG(int, session_lease_seconds, -1, "Lease of sessions opened without one (default 300)");
ABSL_FLAG(int, session_max_pages, -1,
          "Most pages one session may hold: every session's quota (default: no limit)");
ABSL_FLAG(std::string, tls_cert_file, "", "Server certificate chain (PEM): the gRPC port speaks TLS");
ABSL_FLAG(std::string, tls_key_file, "", "Private key of --tls_cert_file (PEM)");
ABSL_FLAG(std::string, tls_client_ca_file, "",
          "CA certificates (PEM) for mutual TLS: clients must present a certificate they signed");
ABSL_FLAG(int, health_port, -1,
          "Plaintext port serving only grpc.health.v1 (for probes when TLS or tokens are on)");
ABSL_FLAG(std::string, inject_fault, "",
          "Testing hook: make a launch fail or take long as a device can (sticky:N, alloc:N "
          "or delay:MS; see server/backends/fault_injection.h)");
ABSL_FLAG(int, call_queue_spin_us, -1,
          "How long a call queue's thread polls after each call before sleeping on its doorbell, "
          "microseconds (default 100 with 8 or more cores, else 0; data_plane.call_queue_spin_us)");
ABSL_FLAG(bool, cuda_single_stream, false,
          "Run prefill and decode on one CUDA stream (for comparisons; default: a stream each)");
ABSL_FLAG(int64_t, cuda_direct_output_min_bytes, -1,
          "A one-call decode whose output goes to a shared-memory region of at least this many "
          "bytes has the kernels write it there (0: never; default 1 MiB)");
ABSL_FLAG(int64_t, cuda_output_chunk_bytes, -1,
          "A prefill launch with at least twice this many output bytes computes them in chunks "
          "of at least this many, each copied out while the next is computed (0: one launch; "
          "default 8 MiB)");
ABSL_FLAG(std::vector<std::string>, grpc_arg, {},
          "Integer gRPC channel arguments of the server's port, NAME=VALUE,... (they override the "
          "HTTP/2 and TCP sizes set for MB messages, server/rpc/transport_args.h; e.g. "
          "grpc.http2.lookahead_bytes=67108864)");

namespace attn {
namespace {

// Health service names (proto/grpc/health/v1/health.proto lists what each one means).
constexpr char kReadyService[] = "attnserve.ready";
constexpr char kLiveService[] = "attnserve.live";
constexpr char kHealthService[] = "grpc.health.v1.Health";

template <typename T>
std::optional<T> Given(const absl::Flag<T>& flag) {
  T v = absl::GetFlag(flag);
  if constexpr (std::is_same_v<T, std::string>) {
    return v.empty() ? std::nullopt : std::optional<T>(v);
  } else {
    return v < 0 ? std::nullopt : std::optional<T>(v);
  }
}

absl::StatusOr<ServerOptions> OptionsFromFlags() {
  std::optional<v1::ServerConfig> file;
  if (const std::string path = absl::GetFlag(FLAGS_config); !path.empty()) {
    ATTN_ASSIGN_OR_RETURN(file, ReadConfigFile(path));
  }
  ConfigOverrides o;
  o.listen_address = Given(FLAGS_listen_address);
  o.metrics_port = Given(FLAGS_metrics_port);
  o.metrics_address = Given(FLAGS_metrics_address);
  o.unix_socket_mode = Given(FLAGS_unix_socket_mode);
  o.backend = Given(FLAGS_backend);
  o.cpu_threads = Given(FLAGS_cpu_threads);
  o.max_message_bytes = Given(FLAGS_max_message_bytes);
  o.max_queue_delay_us = Given(FLAGS_max_queue_delay_us);
  o.max_batch_requests = Given(FLAGS_max_batch_requests);
  o.max_batch_tokens = Given(FLAGS_max_batch_tokens);
  o.max_queue_requests = Given(FLAGS_max_queue_requests);
  o.max_queue_bytes = Given(FLAGS_max_queue_bytes);
  o.max_call_key_reads = Given(FLAGS_max_call_key_reads);
  o.max_sessions = Given(FLAGS_max_sessions);
  o.drain_timeout_seconds = Given(FLAGS_drain_timeout_seconds);
  o.session_lease_seconds = Given(FLAGS_session_lease_seconds);
  o.session_max_pages = Given(FLAGS_session_max_pages);
  o.tls_cert_file = Given(FLAGS_tls_cert_file);
  o.tls_key_file = Given(FLAGS_tls_key_file);
  o.tls_client_ca_file = Given(FLAGS_tls_client_ca_file);
  o.health_port = Given(FLAGS_health_port);
  o.call_queue_spin_us = Given(FLAGS_call_queue_spin_us);
  if (absl::GetFlag(FLAGS_cuda_single_stream)) o.cuda_single_stream = true;
  o.cuda_direct_output_min_bytes = Given(FLAGS_cuda_direct_output_min_bytes);
  o.cuda_output_chunk_bytes = Given(FLAGS_cuda_output_chunk_bytes);
  absl::StatusOr<ServerOptions> options = ResolveConfig(file ? &*file : nullptr, o);
  if (options.ok()) options->backend.inject_fault = absl::GetFlag(FLAGS_inject_fault);
  return options;
}

// Why and how the process ends: a shutdown signal (exit 0) or a fatal device error (exit 1).
class ShutdownRequest {
 public:
  void Request(int exit_code, const std::string& reason) {
    absl::MutexLock lock(&mu_);
    if (requested_) return;
    requested_ = true;
    exit_code_ = exit_code;
    reason_ = reason;
  }
  // Blocks until Request(); returns the exit code.
  int Wait() {
    absl::MutexLock lock(&mu_);
    mu_.Await(absl::Condition(&requested_));
    std::cerr << "attnserve: " << reason_ << ", shutting down\n";
    return exit_code_;
  }

 private:
  absl::Mutex mu_;
  bool requested_ ABSL_GUARDED_BY(mu_) = false;
  int exit_code_ ABSL_GUARDED_BY(mu_) = 0;
  std::string reason_ ABSL_GUARDED_BY(mu_);
};

absl::StatusOr<std::string> ReadFile(const std::string& path) {
  std::ifstream in(path);
  if (!in) return absl::NotFoundError(absl::StrCat("cannot read ", path));
  std::stringstream text;
  text << in.rdbuf();
  return text.str();
}

// Plaintext, TLS, or mutual TLS (options.tls).
absl::StatusOr<std::shared_ptr<grpc::ServerCredentials>> Credentials(const v1::TlsConfig& tls) {
  if (tls.cert_file().empty()) return grpc::InsecureServerCredentials();
  grpc::SslServerCredentialsOptions ssl(
      tls.client_ca_file().empty() ? GRPC_SSL_DONT_REQUEST_CLIENT_CERTIFICATE
                                   : GRPC_SSL_REQUEST_AND_REQUIRE_CLIENT_CERTIFICATE_AND_VERIFY);
  ATTN_ASSIGN_OR_RETURN(std::string cert, ReadFile(tls.cert_file()));
  ATTN_ASSIGN_OR_RETURN(std::string key, ReadFile(tls.key_file()));
  ssl.pem_key_cert_pairs.push_back({key, cert});
  if (!tls.client_ca_file().empty()) {
    ATTN_ASSIGN_OR_RETURN(ssl.pem_root_certs, ReadFile(tls.client_ca_file()));
  }
  return grpc::SslServerCredentials(ssl);
}

// Sets the socket file's mode of a unix:PATH address (the umask applied while it was created).
absl::Status SetSocketMode(const std::string& listen, int mode) {
  const std::string path = listen.substr(std::string("unix:").size());
  if (chmod(path.c_str(), static_cast<mode_t>(mode)) != 0) {
    return absl::InternalError(absl::StrCat("chmod ", path, ": ", std::strerror(errno)));
  }
  return absl::OkStatus();
}

int Run() {
  absl::StatusOr<ServerOptions> options = OptionsFromFlags();
  if (!options.ok()) {
    std::cerr << "attnserve: " << options.status() << "\n";
    return 2;
  }
  absl::StatusOr<IntChannelArgs> grpc_args = ParseIntChannelArgs(absl::GetFlag(FLAGS_grpc_arg));
  if (!grpc_args.ok()) {
    std::cerr << "attnserve: --grpc_arg: " << grpc_args.status().message() << "\n";
    return 2;
  }
  ShutdownRequest shutdown;
  absl::StatusOr<std::unique_ptr<Backend>> backend =
      CreateBackend(options->backend, [&](const absl::Status& error) {
        // The main thread turns health NOT_SERVING as soon as it wakes.
        shutdown.Request(1, absl::StrCat("fatal device error: ", error.ToString()));
      });
  if (!backend.ok()) {
    std::cerr << "attnserve: " << backend.status() << "\n";
    return 1;
  }
  Metrics metrics(kVersion, (*backend)->name(), (*backend)->device());
  // Every method of the API, from its descriptor: their zero series (metrics.h) cover them all.
  const google::protobuf::ServiceDescriptor* api =
      v1::GetServerInfoRequest::descriptor()->file()->FindServiceByName("AttentionService");
  for (int i = 0; i < api->method_count(); ++i) metrics.AddMethod(api->method(i)->name());
  // A new epoch every start: session handles of an earlier run are recognized as such.
  const uint64_t epoch = (uint64_t{std::random_device{}()} << 32) | std::random_device{}();
  absl::StatusOr<std::unique_ptr<Engine>> engine =
      Engine::Create(*std::move(backend), options->pools, options->batching, options->sessions,
                     epoch, /*batch_observer=*/&metrics, /*page_observer=*/&metrics,
                     options->data_plane);
  if (!engine.ok()) {
    std::cerr << "attnserve: " << engine.status() << "\n";
    return 1;
  }
  const std::string& host = options->metrics_host;
  if (options->metrics_port > 0) {
    absl::StatusOr<int> port = metrics.Serve(host, options->metrics_port);
    if (!port.ok()) {
      std::cerr << "attnserve: " << port.status() << "\n";
      return 1;
    }
    std::cerr << "attnserve: metrics on " << host << ":" << *port << "/metrics\n";
  }

  absl::StatusOr<Authorizer> auth = Authorizer::Create(options->access_tokens);
  absl::StatusOr<std::shared_ptr<grpc::ServerCredentials>> credentials = Credentials(options->tls);
  if (!auth.ok() || !credentials.ok()) {
    std::cerr << "attnserve: " << (auth.ok() ? credentials.status() : auth.status()) << "\n";
    return 2;
  }
  CallQueueOptions call_queues;
  call_queues.spin = absl::Microseconds(options->data_plane.call_queue_spin_us);
  AttentionServiceImpl service(engine->get(), &metrics, &*auth, options->max_message_bytes,
                               call_queues);
  // Health on both ports, reflection only on the main one (server/rpc/health.h and
  // reflection.h say why neither is gRPC's own).
  grpc::EnableDefaultHealthCheckService(false);
  HealthStatus health;
  HealthService main_health(&health), port_health(&health);
  Reflection reflection({v1::AttentionService::service_full_name(), kHealthService});
  grpc::ServerBuilder builder;
  int port = 0;
  builder.AddListeningPort(options->listen_address, *credentials, &port);
  builder.SetMaxReceiveMessageSize(static_cast<int>(options->max_message_bytes));
  builder.SetMaxSendMessageSize(static_cast<int>(options->max_message_bytes));
  // Frame, read and unix socket buffer sizes, then the operator's overrides.
  builder.SetOption(BulkTransportOption(*std::move(grpc_args)));
  builder.RegisterService(&service);
  builder.RegisterService(&main_health);
  builder.RegisterService(reflection.v1());
  builder.RegisterService(reflection.v1alpha());
  const bool unix_socket = absl::StartsWith(options->listen_address, "unix");
  // No moment with a looser mode: the umask applies while gRPC creates the socket.
  const mode_t umask_before =
      options->unix_socket_mode >= 0 ? umask(~static_cast<mode_t>(options->unix_socket_mode) & 0777)
                                     : 0;
  std::unique_ptr<grpc::Server> server = builder.BuildAndStart();
  if (options->unix_socket_mode >= 0) umask(umask_before);
  // gRPC reports port 1 for a bound unix socket.
  if (server == nullptr || port == 0) {
    std::cerr << "attnserve: cannot listen on " << options->listen_address << "\n";
    return 1;
  }
  if (options->unix_socket_mode >= 0) {
    if (absl::Status st = SetSocketMode(options->listen_address, options->unix_socket_mode);
        !st.ok()) {
      std::cerr << "attnserve: " << st << "\n";
      return 1;
    }
  }
  // Kubernetes probes cannot present client certificates or tokens: a plaintext port that
  // serves only grpc.health.v1 (no reflection, nothing else), following the main server's
  // status.
  std::unique_ptr<grpc::Server> health_server;
  if (options->health_port > 0) {
    grpc::ServerBuilder health_builder;
    health_builder.AddListeningPort(absl::StrCat(host, ":", options->health_port),
                                    grpc::InsecureServerCredentials());
    health_builder.RegisterService(&port_health);
    health_server = health_builder.BuildAndStart();
    if (health_server == nullptr) {
      std::cerr << "attnserve: cannot serve health on port " << options->health_port << "\n";
      return 1;
    }
  }
  // Readiness (take work) and liveness (the process works) are reported apart, so a draining
  // server is taken out of rotation without being restarted (docs/design.md, "Health").
  auto set_health = [&](bool ready, bool live) {
    for (const char* name : {"", kReadyService, v1::AttentionService::service_full_name()}) {
      health.Set(name, ready);
    }
    for (const char* name : {kLiveService, kHealthService, "grpc.reflection.v1.ServerReflection",
                             "grpc.reflection.v1alpha.ServerReflection"}) {
      health.Set(name, live);
    }
  };
  set_health(true, true);
  std::cerr << "attnserve " << kVersion << ": backend " << (*engine)->backend().name() << " ("
            << (*engine)->backend().device() << "), " << options->pools.size() << " pool(s)"
            << (options->tls.cert_file().empty() ? "" : ", TLS")
            << (options->tls.client_ca_file().empty() ? "" : " with client certificates")
            << (auth->enabled() ? ", bearer tokens" : "") << "\n";
  if (unix_socket) {
    std::cout << "attnserve listening on " << options->listen_address << std::endl;
  } else {
    const std::string& listen = options->listen_address;
    std::cout << "attnserve listening on " << listen.substr(0, listen.rfind(':')) << ":" << port
              << std::endl;
  }

  // Signals were blocked before any thread started; this thread takes them. The first asks for a
  // graceful drain, a second one ends the process at once.
  std::thread([&shutdown] {
    sigset_t signals;
    sigemptyset(&signals);
    sigaddset(&signals, SIGTERM);
    sigaddset(&signals, SIGINT);
    int signal_number = 0;
    sigwait(&signals, &signal_number);
    shutdown.Request(0, absl::StrCat("signal ", signal_number));
    sigwait(&signals, &signal_number);
    std::cerr << "attnserve: second signal, exiting now\n";
    std::_Exit(1);
  }).detach();
  const int exit_code = shutdown.Wait();
  const absl::Time drain_deadline =
      absl::Now() + absl::Seconds(exit_code == 0 ? options->drain_timeout_seconds : 0);
  set_health(false, exit_code == 0);
  // Refuse new work and let admitted calls finish, until the drain deadline. Then what is still
  // queued is cancelled (its callers get UNAVAILABLE), and the process exits at the deadline
  // even if a launch still runs: gRPC's Shutdown would wait for every call, so a queue of long
  // calls kept the process for their whole run (16-19 s with a 1 s deadline).
  (*engine)->StartDrain();
  const bool idle = (*engine)->WaitForIdle(drain_deadline);
  int cancelled = 0;
  if (!idle) {
    cancelled = (*engine)->CancelQueued(absl::UnavailableError(
        "the server is shutting down: its drain deadline passed before this call ran; retry on "
        "another server"));
  }
  // Keep answering UNAVAILABLE a moment longer, so a client's next call gets that answer rather
  // than a connection torn down under it, and the cancelled calls' answers go out.
  absl::SleepFor(absl::Milliseconds(250));
  // Shared with the thread, which may outlive this frame when the process exits at the deadline.
  auto stopped = std::make_shared<absl::Notification>();
  health.Shutdown();  // ends the Watch streams, which Shutdown would otherwise wait for
  std::thread([&server, &health_server, stopped] {
    server->Shutdown(std::chrono::system_clock::now());
    if (health_server) health_server->Shutdown();
    stopped->Notify();
  }).detach();
  if (!stopped->WaitForNotificationWithDeadline(std::max(drain_deadline, absl::Now()) +
                                                absl::Milliseconds(500))) {
    std::cerr << "attnserve: drain deadline (" << options->drain_timeout_seconds
              << " s) passed: " << cancelled << " queued call(s) cancelled, "
              << (*engine)->active_calls() << " still running on the backend abandoned; exiting\n";
    std::_Exit(exit_code);
  }
  std::cerr << "attnserve: "
            << (idle ? "drained: every admitted call finished"
                     : absl::StrCat("drain deadline (", options->drain_timeout_seconds,
                                    " s) passed: ", cancelled,
                                    " queued call(s) cancelled, the running ones finished"))
            << "\n";
  service.StopCallQueues();  // their threads call into the engine
  engine->reset();
  return exit_code;
}

}  // namespace
}  // namespace attn

namespace attn {
namespace {

// Protobuf logs an ERROR line for every request with invalid UTF-8 in a string field (such a
// request is refused with INVALID_ARGUMENT anyway), so one client could flood the log. Lines pass
// at most once a second; the rest are counted in the next line that passes.
void RateLimitedProtobufLog(google::protobuf::LogLevel level, const char* file, int line,
                            const std::string& message) {
  static absl::Mutex mu(absl::kConstInit);
  static absl::Time last = absl::InfinitePast();
  static int64_t suppressed = 0;
  absl::MutexLock lock(&mu);
  const absl::Time now = absl::Now();
  if (level < google::protobuf::LOGLEVEL_FATAL && now - last < absl::Seconds(1)) {
    ++suppressed;
    return;
  }
  last = now;
  std::cerr << "protobuf " << file << ":" << line << ": " << message;
  if (suppressed > 0) std::cerr << " (" << suppressed << " more suppressed)";
  std::cerr << "\n";
  suppressed = 0;
}

}  // namespace
}  // namespace attn

int main(int argc, char** argv) {
#ifdef NDEBUG
  // Debian builds Abseil without NDEBUG, which leaves absl::Mutex's deadlock detection on: every
  // lock of gRPC's and ours then updates one process-wide graph of lock order under a global
  // lock. A debugging aid for debug builds; release builds go without it.
  absl::SetMutexDeadlockDetectionMode(absl::OnDeadlockCycle::kIgnore);
#endif
  // Buffers of a MiB or more (requests, responses, scratch of large calls) are mapped and
  // unmapped on their own instead of coming from the heap: glibc's adaptive threshold would
  // otherwise rise to 32 MiB after the first large free, and a 98 MiB call left the process
  // about 350 MiB larger for good.
  mallopt(M_MMAP_THRESHOLD, 1 << 20);
  // Fixing that threshold also fixes glibc's trim threshold at 128 KiB, and every call's freed
  // socket reads (gRPC reads into 64 KiB pieces of the reading thread's arena) went back to the
  // system at once, to be faulted in again by the next call: 20-50 faults per batch-64 decode on
  // the 2-core VM. Up to 8 MiB of an arena's free top stays for the next call; beyond that, and
  // for memory in the middle of a heap, AllocatorTrimmer trims once large calls stop (a larger
  // threshold would keep a large call's reads for good: glibc trims other threads' arena tops
  // only when they free, never in malloc_trim).
  mallopt(M_TRIM_THRESHOLD, 8 << 20);
  google::protobuf::SetLogHandler(&attn::RateLimitedProtobufLog);
  absl::SetProgramUsageMessage("attnserve [--config=FILE] [--listen_address=HOST:PORT] ...");
  // --help lists the flags of files whose name matches the program's by default (attnserve.cc);
  // ours are defined here.
  absl::FlagsUsageConfig usage;
  usage.contains_help_flags = [](absl::string_view file) {
    return absl::EndsWith(file, "server/main.cc");
  };
  usage.normalize_filename = [](absl::string_view file) -> std::string {
    const size_t at = file.rfind("server/");
    return std::string(at == absl::string_view::npos ? file : file.substr(at));
  };
  absl::SetFlagsUsageConfig(usage);
  absl::ParseCommandLine(argc, argv);
  // Block the shutdown signals in every thread; Run() takes them with sigwait.
  sigset_t signals;
  sigemptyset(&signals);
  sigaddset(&signals, SIGTERM);
  sigaddset(&signals, SIGINT);
  pthread_sigmask(SIG_BLOCK, &signals, nullptr);
  return attn::Run();
}
