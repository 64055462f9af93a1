#include "server/rpc/transport_args.h"

#include <sys/socket.h>

#include <utility>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "grpc/grpc.h"
#include "grpc/support/sync.h"

// gRPC's socket mutator interface (src/core/lib/iomgr/socket_mutator.h), which gRPC does not
// install although ChannelArguments::SetSocketMutator takes one: the same declarations, whose
// layout has not changed since gRPC 1.33 (mutate_fd_2, the only form that also sees a server's
// accepted connections). gRPC reaches the mutator only through the vtable and the refcount.
typedef enum {
  GRPC_FD_CLIENT_CONNECTION_USAGE,
  GRPC_FD_SERVER_LISTENER_USAGE,
  GRPC_FD_SERVER_CONNECTION_USAGE,
} grpc_fd_usage;

typedef struct {
  int fd;
  grpc_fd_usage usage;
} grpc_mutate_socket_info;

struct grpc_socket_mutator_vtable {
  bool (*mutate_fd)(int fd, grpc_socket_mutator* mutator);
  int (*compare)(grpc_socket_mutator* a, grpc_socket_mutator* b);
  void (*destroy)(grpc_socket_mutator* mutator);
  bool (*mutate_fd_2)(const grpc_mutate_socket_info* info, grpc_socket_mutator* mutator);
};

struct grpc_socket_mutator {
  const grpc_socket_mutator_vtable* vtable;
  gpr_refcount refcount;
};

namespace attn {
namespace {

// A mutator that sizes unix sockets' buffers. gRPC owns it (its refcount) once it is set on
// channel arguments.
struct UnixBufferMutator {
  grpc_socket_mutator base;  // first: gRPC's pointer to it is a pointer to this
  int bytes;
};

UnixBufferMutator* Of(grpc_socket_mutator* m) { return reinterpret_cast<UnixBufferMutator*>(m); }

// A failed setsockopt leaves the socket as the system made it: a slower connection, not a
// refused one, so the mutator always reports success.
bool MutateFd(int fd, grpc_socket_mutator* m) {
  SetUnixSocketBuffers(fd, Of(m)->bytes);
  return true;
}

bool MutateFd2(const grpc_mutate_socket_info* info, grpc_socket_mutator* m) {
  return MutateFd(info->fd, m);
}

int Compare(grpc_socket_mutator* a, grpc_socket_mutator* b) {
  return (Of(a)->bytes > Of(b)->bytes) - (Of(a)->bytes < Of(b)->bytes);
}

void Destroy(grpc_socket_mutator* m) { delete Of(m); }

constexpr grpc_socket_mutator_vtable kUnixBufferVtable = {MutateFd, Compare, Destroy, MutateFd2};

grpc_socket_mutator* NewUnixBufferMutator(int bytes) {
  auto* m = new UnixBufferMutator{{&kUnixBufferVtable, {}}, bytes};
  gpr_ref_init(&m->base.refcount, 1);
  return &m->base;
}

class BulkTransport final : public grpc::ServerBuilderOption {
 public:
  explicit BulkTransport(IntChannelArgs overrides) : overrides_(std::move(overrides)) {}
  void UpdateArguments(grpc::ChannelArguments* args) override {
    SetBulkTransportArgs(args, overrides_);
  }
  void UpdatePlugins(std::vector<std::unique_ptr<grpc::ServerBuilderPlugin>>*) override {}

 private:
  const IntChannelArgs overrides_;
};

}  // namespace

bool SetUnixSocketBuffers(int fd, int bytes) {
  sockaddr_storage addr{};
  socklen_t len = sizeof(addr);
  int type = 0;
  socklen_t type_len = sizeof(type);
  if (getsockname(fd, reinterpret_cast<sockaddr*>(&addr), &len) != 0 || addr.ss_family != AF_UNIX ||
      getsockopt(fd, SOL_SOCKET, SO_TYPE, &type, &type_len) != 0 || type != SOCK_STREAM) {
    return true;
  }
  // For a unix stream socket the sender's buffer bounds the bytes in flight (the receiver's is
  // not charged); both are set so that either end's writes are covered whichever end this is.
  const bool snd = setsockopt(fd, SOL_SOCKET, SO_SNDBUF, &bytes, sizeof(bytes)) == 0;
  const bool rcv = setsockopt(fd, SOL_SOCKET, SO_RCVBUF, &bytes, sizeof(bytes)) == 0;
  return snd && rcv;
}

void SetBulkTransportArgs(grpc::ChannelArguments* args, const IntChannelArgs& overrides) {
  args->SetInt(GRPC_ARG_HTTP2_MAX_FRAME_SIZE, (1 << 24) - 1);
  args->SetInt(GRPC_ARG_TCP_READ_CHUNK_SIZE, 4 << 20);
  args->SetInt(GRPC_ARG_TCP_MIN_READ_CHUNK_SIZE, 256 << 10);
  args->SetInt(GRPC_ARG_TCP_MAX_READ_CHUNK_SIZE, 16 << 20);
  args->SetSocketMutator(NewUnixBufferMutator(kUnixSocketBufferBytes));
  for (const auto& [name, value] : overrides) args->SetInt(name, value);
}

absl::StatusOr<IntChannelArgs> ParseIntChannelArgs(const std::vector<std::string>& text) {
  IntChannelArgs parsed;
  for (const std::string& arg : text) {
    const std::vector<std::string> kv = absl::StrSplit(arg, absl::MaxSplits('=', 1));
    int value = 0;
    if (kv.size() != 2 || kv[0].empty() || !absl::SimpleAtoi(kv[1], &value)) {
      return absl::InvalidArgumentError(
          absl::StrCat("channel argument \"", arg, "\" is not NAME=INTEGER"));
    }
    parsed.emplace_back(kv[0], value);
  }
  return parsed;
}

std::unique_ptr<grpc::ServerBuilderOption> BulkTransportOption(IntChannelArgs overrides) {
  return std::make_unique<BulkTransport>(std::move(overrides));
}

}  // namespace attn
