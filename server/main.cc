// attnserve: the attention server. With no arguments it serves the embedded default (see
// server/config.h) on 127.0.0.1:50051; --config=FILE names a text-format ServerConfig, and the
// flags below override single settings.
#include <pthread.h>
#include <signal.h>

#include <cstdio>
#include <cstdlib>
#include <iostream>
#include <memory>
#include <optional>
#include <random>
#include <string>
#include <thread>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/flags/usage.h"
#include "absl/synchronization/mutex.h"
#include "absl/strings/str_cat.h"
#include "grpcpp/ext/proto_server_reflection_plugin.h"
#include "grpcpp/grpcpp.h"
#include "grpcpp/health_check_service_interface.h"
#include "server/backend_factory.h"
#include "server/config.h"
#include "server/engine.h"
#include "server/metrics.h"
#include "server/service.h"
#include "server/status_macros.h"

// Sentinels ("" and -1) mean "not given": the config file or the embedded default applies.
ABSL_FLAG(std::string, config, "", "Text-format attnserve.v1.ServerConfig file");
ABSL_FLAG(std::string, listen_address, "", "host:port to serve on (default 127.0.0.1:50051)");
ABSL_FLAG(int, metrics_port, -1,
          "Port of the Prometheus /metrics endpoint on the listen host (default 9464), 0 = off");
ABSL_FLAG(std::string, backend, "", "auto, cpu or cuda (default auto: cuda when a GPU is present)");
ABSL_FLAG(int, cpu_threads, -1, "CPU backend threads (default: hardware concurrency)");
ABSL_FLAG(int64_t, max_message_bytes, -1, "Largest request/response (default 512 MiB)");
ABSL_FLAG(int, max_queue_delay_us, -1, "Longest wait for calls to merge with (microseconds)");
ABSL_FLAG(int, max_batch_requests, -1, "Most calls merged into one launch");
ABSL_FLAG(int, max_batch_tokens, -1, "Most query tokens in one launch");
ABSL_FLAG(int, max_queue_requests, -1, "Queued calls per pool and op before RESOURCE_EXHAUSTED");
ABSL_FLAG(int, drain_timeout_seconds, -1,
          "On SIGTERM, how long accepted calls may take to finish (default 30)");
ABSL_FLAG(int, session_lease_seconds, -1,
          "Lease of implicit sessions and of sessions opened without one (default 300)");
ABSL_FLAG(int, session_max_pages, -1, "Page quota of sessions opened without one (default none)");
ABSL_FLAG(bool, cuda_single_stream, false,
          "Run prefill and decode on one CUDA stream (for comparisons; default: a stream each)");

namespace attn {
namespace {

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
    ASSIGN_OR_RETURN(file, ReadConfigFile(path));
  }
  ConfigOverrides o;
  o.listen_address = Given(FLAGS_listen_address);
  o.metrics_port = Given(FLAGS_metrics_port);
  o.backend = Given(FLAGS_backend);
  o.cpu_threads = Given(FLAGS_cpu_threads);
  o.max_message_bytes = Given(FLAGS_max_message_bytes);
  o.max_queue_delay_us = Given(FLAGS_max_queue_delay_us);
  o.max_batch_requests = Given(FLAGS_max_batch_requests);
  o.max_batch_tokens = Given(FLAGS_max_batch_tokens);
  o.max_queue_requests = Given(FLAGS_max_queue_requests);
  o.drain_timeout_seconds = Given(FLAGS_drain_timeout_seconds);
  o.session_lease_seconds = Given(FLAGS_session_lease_seconds);
  o.session_max_pages = Given(FLAGS_session_max_pages);
  if (absl::GetFlag(FLAGS_cuda_single_stream)) o.cuda_single_stream = true;
  return ResolveConfig(file ? &*file : nullptr, o);
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

// The host part of a host:port listen address ("[::]" stays bracketed).
std::string ListenHost(const std::string& listen) { return listen.substr(0, listen.rfind(':')); }

int Run() {
  absl::StatusOr<ServerOptions> options = OptionsFromFlags();
  if (!options.ok()) {
    std::cerr << "attnserve: " << options.status() << "\n";
    return 2;
  }
  ShutdownRequest shutdown;
  grpc::Server* serving = nullptr;  // set once the server runs; read by the fatal-error handler
  absl::StatusOr<std::unique_ptr<Backend>> backend =
      CreateBackend(*options, [&](const absl::Status& error) {
        if (serving != nullptr) serving->GetHealthCheckService()->SetServingStatus(false);
        shutdown.Request(1, absl::StrCat("fatal device error: ", error.ToString()));
      });
  if (!backend.ok()) {
    std::cerr << "attnserve: " << backend.status() << "\n";
    return 1;
  }
  Metrics metrics(kVersion, (*backend)->name(), (*backend)->device());
  // A new epoch every start: session handles of an earlier run are recognized as such.
  const uint64_t epoch = (uint64_t{std::random_device{}()} << 32) | std::random_device{}();
  absl::StatusOr<std::unique_ptr<Engine>> engine = Engine::Create(
      *std::move(backend), options->pools, options->batching, options->sessions, epoch, &metrics,
      [&metrics](const std::string& pool, int pages) { metrics.OnPagesReclaimed(pool, pages); });
  if (!engine.ok()) {
    std::cerr << "attnserve: " << engine.status() << "\n";
    return 1;
  }
  const std::string host = ListenHost(options->listen_address);
  if (options->metrics_port > 0) {
    absl::StatusOr<int> port = metrics.Serve(host, options->metrics_port);
    if (!port.ok()) {
      std::cerr << "attnserve: " << port.status() << "\n";
      return 1;
    }
    std::cerr << "attnserve: metrics on " << host << ":" << *port << "/metrics\n";
  }

  AttentionServiceImpl service(engine->get(), &metrics, options->max_message_bytes);
  grpc::EnableDefaultHealthCheckService(true);
  grpc::reflection::InitProtoReflectionServerBuilderPlugin();
  grpc::ServerBuilder builder;
  int port = 0;
  builder.AddListeningPort(options->listen_address, grpc::InsecureServerCredentials(), &port);
  builder.SetMaxReceiveMessageSize(static_cast<int>(options->max_message_bytes));
  builder.SetMaxSendMessageSize(static_cast<int>(options->max_message_bytes));
  builder.RegisterService(&service);
  std::unique_ptr<grpc::Server> server = builder.BuildAndStart();
  if (server == nullptr || port == 0) {
    std::cerr << "attnserve: cannot listen on " << options->listen_address << "\n";
    return 1;
  }
  std::cerr << "attnserve " << kVersion << ": backend " << (*engine)->backend().name() << " ("
            << (*engine)->backend().device() << "), " << options->pools.size() << " pool(s)\n";
  std::cout << "attnserve listening on " << host << ":" << port << std::endl;

  serving = server.get();

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
  server->GetHealthCheckService()->SetServingStatus(false);
  if (exit_code == 0) {
    // Drain: refuse new work, let accepted calls finish (up to the deadline).
    service.StartDrain();
    const absl::Duration limit = absl::Seconds(options->drain_timeout_seconds);
    if (!service.WaitForIdle(absl::Now() + limit)) {
      std::cerr << "attnserve: drain deadline (" << limit << ") passed with calls in flight\n";
    }
    // Keep answering UNAVAILABLE a moment longer, so a client's next call gets that answer
    // rather than a connection torn down under it.
    absl::SleepFor(absl::Milliseconds(250));
  }
  server->Shutdown(std::chrono::system_clock::now() + std::chrono::seconds(1));
  engine->reset();
  return exit_code;
}

}  // namespace
}  // namespace attn

int main(int argc, char** argv) {
  absl::SetProgramUsageMessage("attnserve [--config=FILE] [--listen_address=HOST:PORT] ...");
  absl::ParseCommandLine(argc, argv);
  // Block the shutdown signals in every thread; Run() takes them with sigwait.
  sigset_t signals;
  sigemptyset(&signals);
  sigaddset(&signals, SIGTERM);
  sigaddset(&signals, SIGINT);
  pthread_sigmask(SIG_BLOCK, &signals, nullptr);
  return attn::Run();
}
