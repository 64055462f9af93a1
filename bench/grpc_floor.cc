// The floor gRPC itself puts under a bytes call: one unary call of N request bytes and M response
// bytes between two processes, through the same channel arguments as attnserve and attn_loadgen
// (server/rpc/transport_args.h), the server on the callback API answering from a preallocated
// slice (as attnserve answers from its pinned output buffers) and the client awaiting the reply
// in its completion queue (as attn_loadgen does: asleep in it, or polling it with --spin). No
// tensors are read or written: what a
// call costs here is gRPC's framing, its reads and writes, its wake-ups and the kernel's socket
// copies. bench/socket_floor.py gives the same sizes through a plain socket; the difference is
// gRPC's own share, and what attn_loadgen's bytes scenarios take above this is attnserve's.
//
//   grpc_floor [--transport=tcp|unix] [--request_bytes=N] [--response_bytes=M] [--seconds=S]
//              [--handoff] [--spin] [--json=FILE]
//
// --handoff answers from a second thread that waits on an absl::Mutex condition, as attnserve's
// batcher does (a call's reply is written by the batcher thread, not by gRPC's): the wake-up of
// that thread and a write started off gRPC's threads are then part of the floor.
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <csignal>
#include <cstdio>
#include <cstdlib>
#include <deque>
#include <string>
#include <thread>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "grpcpp/generic/async_generic_service.h"
#include "grpcpp/generic/generic_stub.h"
#include "grpcpp/grpcpp.h"
#include "server/rpc/transport_args.h"

ABSL_FLAG(std::string, transport, "tcp", "tcp (127.0.0.1) or unix (a socket in a fresh folder)");
ABSL_FLAG(int64_t, request_bytes, 512 << 10, "bytes of each request (decode b64: 512 KiB of q)");
ABSL_FLAG(int64_t, response_bytes, 512 << 10, "bytes of each response");
ABSL_FLAG(double, seconds, 3, "how long to measure, after 0.5 s of warm-up");
ABSL_FLAG(bool, handoff, false, "answer from a second thread, as attnserve's batcher does");
ABSL_FLAG(bool, spin, false, "the client polls its completion queue instead of sleeping in it");
ABSL_FLAG(std::string, json, "", "also write the percentiles here");

namespace attn::bench {
namespace {

using Clock = std::chrono::steady_clock;

grpc::Slice Filled(int64_t bytes) {
  std::string s(static_cast<size_t>(bytes), '\0');
  for (size_t i = 0; i < s.size(); ++i) s[i] = static_cast<char>(i * 131);
  return grpc::Slice(s);
}

// The thread that answers calls in --handoff mode: woken through an absl::Mutex condition.
class Answerer {
 public:
  Answerer() : thread_([this] { Loop(); }) {}
  ~Answerer() {
    {
      absl::MutexLock lock(&mu_);
      stopping_ = true;
    }
    thread_.join();
  }
  void Push(grpc::ServerGenericBidiReactor* r, void (*reply)(grpc::ServerGenericBidiReactor*)) {
    absl::MutexLock lock(&mu_);
    queue_.push_back({r, reply});
  }

 private:
  struct Job {
    grpc::ServerGenericBidiReactor* reactor;
    void (*reply)(grpc::ServerGenericBidiReactor*);
  };
  void Loop() {
    for (;;) {
      Job job;
      {
        absl::MutexLock lock(&mu_);
        mu_.Await(absl::Condition(
            +[](Answerer* a)
                 ABSL_NO_THREAD_SAFETY_ANALYSIS { return a->stopping_ || !a->queue_.empty(); },
            this));
        if (queue_.empty()) return;
        job = queue_.front();
        queue_.pop_front();
      }
      job.reply(job.reactor);
    }
  }
  absl::Mutex mu_;
  std::deque<Job> queue_ ABSL_GUARDED_BY(mu_);
  bool stopping_ ABSL_GUARDED_BY(mu_) = false;
  std::thread thread_;
};

class EchoReactor final : public grpc::ServerGenericBidiReactor {
 public:
  EchoReactor(const grpc::Slice* response, Answerer* answerer)
      : response_slice_(response), answerer_(answerer) {
    StartRead(&request_);
  }
  void OnReadDone(bool ok) override {
    if (!ok) {
      Finish(grpc::Status(grpc::StatusCode::INVALID_ARGUMENT, "no request"));
      return;
    }
    if (answerer_ == nullptr) {
      Reply(this);
    } else {
      answerer_->Push(this, &EchoReactor::Reply);
    }
  }
  void OnDone() override { delete this; }

 private:
  static void Reply(grpc::ServerGenericBidiReactor* base) {
    auto* self = static_cast<EchoReactor*>(base);
    self->request_.Clear();
    self->response_ = grpc::ByteBuffer(self->response_slice_, 1);
    self->StartWriteAndFinish(&self->response_, grpc::WriteOptions(), grpc::Status::OK);
  }
  const grpc::Slice* const response_slice_;
  Answerer* const answerer_;
  grpc::ByteBuffer request_, response_;
};

class EchoService final : public grpc::CallbackGenericService {
 public:
  EchoService(int64_t response_bytes, bool handoff) : response_(Filled(response_bytes)) {
    if (handoff) answerer_ = std::make_unique<Answerer>();
  }
  grpc::ServerGenericBidiReactor* CreateReactor(grpc::GenericCallbackServerContext*) override {
    return new EchoReactor(&response_, answerer_.get());
  }

 private:
  const grpc::Slice response_;
  std::unique_ptr<Answerer> answerer_;
};

// The server process: writes its address to `ready` once listening, then serves until killed.
[[noreturn]] void Serve(const std::string& listen, int ready) {
  EchoService service(absl::GetFlag(FLAGS_response_bytes), absl::GetFlag(FLAGS_handoff));
  grpc::ServerBuilder builder;
  builder.SetMaxReceiveMessageSize(-1);
  builder.SetMaxSendMessageSize(-1);
  builder.SetOption(BulkTransportOption());
  int port = 0;
  builder.AddListeningPort(listen, grpc::InsecureServerCredentials(), &port);
  builder.RegisterCallbackGenericService(&service);
  std::unique_ptr<grpc::Server> server = builder.BuildAndStart();
  if (server == nullptr) {
    std::fprintf(stderr, "grpc_floor: cannot listen on %s\n", listen.c_str());
    std::_Exit(1);
  }
  const std::string address =
      absl::StartsWith(listen, "unix:") ? listen : absl::StrCat("127.0.0.1:", port);
  (void)!write(ready, address.data(), address.size());
  close(ready);
  server->Wait();
  std::_Exit(0);
}

double Percentile(std::vector<double> v, double p) {
  if (v.empty()) return 0;
  std::sort(v.begin(), v.end());
  return v[std::min(v.size() - 1, static_cast<size_t>(p * static_cast<double>(v.size())))];
}

int Main() {
  const std::string transport = absl::GetFlag(FLAGS_transport);
  const int64_t request_bytes = absl::GetFlag(FLAGS_request_bytes);
  const int64_t response_bytes = absl::GetFlag(FLAGS_response_bytes);
  if ((transport != "tcp" && transport != "unix") || request_bytes < 0 || response_bytes < 0) {
    std::fprintf(stderr, "grpc_floor: --transport is tcp or unix; sizes are not negative\n");
    return 2;
  }
  std::string listen = "127.0.0.1:0";
  if (transport == "unix") {
    char dir[] = "/tmp/grpc_floor.XXXXXX";
    if (mkdtemp(dir) == nullptr) return 1;
    listen = absl::StrCat("unix:", dir, "/floor.sock");
  }
  // The server is forked before this process starts gRPC: each side has gRPC's threads alone.
  int pipe_fds[2];
  if (pipe(pipe_fds) != 0) return 1;
  const pid_t child = fork();
  if (child < 0) return 1;
  if (child == 0) {
    close(pipe_fds[0]);
    Serve(listen, pipe_fds[1]);
  }
  close(pipe_fds[1]);
  char buf[256];
  const ssize_t n = read(pipe_fds[0], buf, sizeof(buf));
  close(pipe_fds[0]);
  if (n <= 0) return 1;
  const std::string address(buf, static_cast<size_t>(n));

  grpc::ChannelArguments args;
  args.SetMaxReceiveMessageSize(-1);
  args.SetMaxSendMessageSize(-1);
  SetBulkTransportArgs(&args);
  grpc::GenericStub stub(
      grpc::CreateCustomChannel(address, grpc::InsecureChannelCredentials(), args));
  grpc::Slice request_slice = Filled(request_bytes);
  const grpc::ByteBuffer request(&request_slice, 1);
  grpc::CompletionQueue cq;
  const bool spin = absl::GetFlag(FLAGS_spin);
  auto call_once = [&]() -> bool {
    grpc::ClientContext ctx;
    ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(30));
    std::unique_ptr<grpc::GenericClientAsyncResponseReader> call =
        stub.PrepareUnaryCall(&ctx, "/attnserve.bench.Floor/Echo", request, &cq);
    call->StartCall();
    grpc::ByteBuffer reply;
    grpc::Status status;
    call->Finish(&reply, &status, &call);
    void* tag = nullptr;
    bool ok = false;
    if (spin) {
      while (cq.AsyncNext(&tag, &ok, gpr_time_0(GPR_CLOCK_MONOTONIC)) !=
             grpc::CompletionQueue::NextStatus::GOT_EVENT) {
      }
    } else {
      cq.Next(&tag, &ok);
    }
    if (!status.ok()) {
      std::fprintf(stderr, "grpc_floor: call failed: %s\n", status.error_message().c_str());
      return false;
    }
    return static_cast<int64_t>(reply.Length()) == response_bytes;
  };

  int status = 0;
  std::vector<double> us;
  for (const auto warm_until = Clock::now() + std::chrono::milliseconds(500);
       Clock::now() < warm_until;) {
    if (!call_once()) status = 1;
  }
  const auto until = Clock::now() + std::chrono::duration<double>(absl::GetFlag(FLAGS_seconds));
  while (status == 0 && Clock::now() < until) {
    const auto t0 = Clock::now();
    if (!call_once()) status = 1;
    us.push_back(std::chrono::duration<double, std::micro>(Clock::now() - t0).count());
  }
  kill(child, SIGKILL);
  waitpid(child, nullptr, 0);
  cq.Shutdown();
  void* tag;
  bool ok;
  while (cq.Next(&tag, &ok)) {
  }
  if (status != 0) {
    std::fprintf(stderr, "grpc_floor: a call failed or answered the wrong size\n");
    return status;
  }
  const bool handoff = absl::GetFlag(FLAGS_handoff);
  const double p50 = Percentile(us, 0.5), p90 = Percentile(us, 0.9), p99 = Percentile(us, 0.99);
  const std::string mode =
      absl::StrCat(spin ? ", client polling" : "", handoff ? ", answered by another thread" : "");
  std::printf("grpc_floor %s %lld in / %lld out%s: p50 %.0f  p90 %.0f  p99 %.0f us (%zu calls)\n",
              transport.c_str(), static_cast<long long>(request_bytes),
              static_cast<long long>(response_bytes), mode.c_str(), p50, p90, p99, us.size());
  if (const std::string json = absl::GetFlag(FLAGS_json); !json.empty()) {
    if (FILE* f = std::fopen(json.c_str(), "w")) {
      std::fprintf(f,
                   "{\"transport\": \"%s\", \"request_bytes\": %lld, \"response_bytes\": %lld, "
                   "\"handoff\": %s, \"client_polls\": %s, \"calls\": %zu, "
                   "\"p50_us\": %.1f, \"p90_us\": %.1f, \"p99_us\": %.1f}\n",
                   transport.c_str(), static_cast<long long>(request_bytes),
                   static_cast<long long>(response_bytes), handoff ? "true" : "false",
                   spin ? "true" : "false", us.size(), p50, p90, p99);
      std::fclose(f);
    }
  }
  return 0;
}

}  // namespace
}  // namespace attn::bench

int main(int argc, char** argv) {
  absl::ParseCommandLine(argc, argv);
  return attn::bench::Main();
}
