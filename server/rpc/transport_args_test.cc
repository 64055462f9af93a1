#include "server/rpc/transport_args.h"

#include <dirent.h>
#include <netinet/in.h>
#include <stdlib.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <unistd.h>

#include <chrono>
#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include "grpcpp/generic/async_generic_service.h"
#include "grpcpp/grpcpp.h"
#include "gtest/gtest.h"

namespace attn {
namespace {

int BufferOf(int fd, int option) {
  int value = 0;
  socklen_t len = sizeof(value);
  EXPECT_EQ(getsockopt(fd, SOL_SOCKET, option, &value, &len), 0);
  return value;
}

// What the kernel grants a unix socket that asks for `bytes` (capped by net.core.wmem_max and
// rmem_max, then doubled), asked of a socket of its own.
int Granted(int option, int bytes) {
  int pair[2];
  EXPECT_EQ(socketpair(AF_UNIX, SOCK_STREAM, 0, pair), 0);
  EXPECT_EQ(setsockopt(pair[0], SOL_SOCKET, option, &bytes, sizeof(bytes)), 0);
  const int granted = BufferOf(pair[0], option);
  close(pair[0]);
  close(pair[1]);
  return granted;
}

TEST(SetUnixSocketBuffersTest, SizesUnixStreamSockets) {
  int pair[2];
  ASSERT_EQ(socketpair(AF_UNIX, SOCK_STREAM, 0, pair), 0);
  EXPECT_TRUE(SetUnixSocketBuffers(pair[0], kUnixSocketBufferBytes));
  EXPECT_EQ(BufferOf(pair[0], SO_SNDBUF), Granted(SO_SNDBUF, kUnixSocketBufferBytes));
  EXPECT_EQ(BufferOf(pair[0], SO_RCVBUF), Granted(SO_RCVBUF, kUnixSocketBufferBytes));
  close(pair[0]);
  close(pair[1]);
}

// TCP keeps the kernel's autotuning (a size set by hand turns it off); datagram sockets are not
// gRPC's.
TEST(SetUnixSocketBuffersTest, LeavesOtherSocketsAlone) {
  const int tcp = socket(AF_INET, SOCK_STREAM, 0);
  ASSERT_GE(tcp, 0);
  int dgram[2];
  ASSERT_EQ(socketpair(AF_UNIX, SOCK_DGRAM, 0, dgram), 0);
  for (int fd : {tcp, dgram[0]}) {
    const int snd = BufferOf(fd, SO_SNDBUF), rcv = BufferOf(fd, SO_RCVBUF);
    EXPECT_TRUE(SetUnixSocketBuffers(fd, kUnixSocketBufferBytes));
    EXPECT_EQ(BufferOf(fd, SO_SNDBUF), snd);
    EXPECT_EQ(BufferOf(fd, SO_RCVBUF), rcv);
  }
  close(tcp);
  close(dgram[0]);
  close(dgram[1]);
}

// This process's unix stream sockets whose own or peer address is `path`.
std::vector<int> SocketsOn(const std::string& path) {
  std::vector<int> fds;
  DIR* dir = opendir("/proc/self/fd");
  if (dir == nullptr) return fds;
  while (dirent* e = readdir(dir)) {
    const int fd = atoi(e->d_name);
    if (e->d_name[0] == '.' || fd == dirfd(dir)) continue;
    for (auto name : {getsockname, getpeername}) {
      sockaddr_un addr{};
      socklen_t len = sizeof(addr);
      if (name(fd, reinterpret_cast<sockaddr*>(&addr), &len) == 0 && addr.sun_family == AF_UNIX &&
          path == addr.sun_path) {
        fds.push_back(fd);
        break;
      }
    }
  }
  closedir(dir);
  return fds;
}

// The value gRPC's core takes for `name`: the last one set (its ChannelArgs::FromC sets each in
// order), or -1.
int LastIntArg(const grpc::ChannelArguments& args, const std::string& name) {
  const grpc_channel_args c = args.c_channel_args();
  int value = -1;
  for (size_t i = 0; i < c.num_args; ++i) {
    if (name == c.args[i].key && c.args[i].type == GRPC_ARG_INTEGER) {
      value = c.args[i].value.integer;
    }
  }
  return value;
}

TEST(IntChannelArgsTest, OverridesTheBulkSizes) {
  grpc::ChannelArguments plain;
  SetBulkTransportArgs(&plain);
  EXPECT_EQ(LastIntArg(plain, GRPC_ARG_HTTP2_MAX_FRAME_SIZE), (1 << 24) - 1);
  const absl::StatusOr<IntChannelArgs> overrides = ParseIntChannelArgs(
      {"grpc.http2.max_frame_size=16384", "grpc.http2.lookahead_bytes=67108864", "grpc.x=-3"});
  ASSERT_TRUE(overrides.ok()) << overrides.status();
  grpc::ChannelArguments args;
  SetBulkTransportArgs(&args, *overrides);
  EXPECT_EQ(LastIntArg(args, GRPC_ARG_HTTP2_MAX_FRAME_SIZE), 16384);
  EXPECT_EQ(LastIntArg(args, GRPC_ARG_HTTP2_STREAM_LOOKAHEAD_BYTES), 64 << 20);
  EXPECT_EQ(LastIntArg(args, "grpc.x"), -3);
  const absl::StatusOr<IntChannelArgs> none = ParseIntChannelArgs({});
  ASSERT_TRUE(none.ok());
  EXPECT_TRUE(none->empty());
}

// A bad entry anywhere in the list fails the whole list (so nothing of it can be set), and the
// error names it.
TEST(IntChannelArgsTest, RefusesWhatIsNotNameEqualsInteger) {
  for (const char* bad : {"grpc.http2.lookahead_bytes", "=5", "grpc.a=", "grpc.a=1.5",
                          "grpc.a=0x10", "grpc.a=99999999999", "grpc.a=5k"}) {
    const absl::StatusOr<IntChannelArgs> parsed = ParseIntChannelArgs({"grpc.ok=1", bad});
    EXPECT_EQ(parsed.status().code(), absl::StatusCode::kInvalidArgument) << bad;
    EXPECT_NE(parsed.status().message().find(bad), std::string::npos) << parsed.status();
  }
}

// Both ends of a gRPC connection over a unix socket get the buffers: the server's accepted
// socket (the option on its builder) and the client's (the arguments on its channel).
TEST(BulkTransportTest, BothEndsOfAUnixConnectionGetTheBuffers) {
  char dir[] = "/tmp/transport_args_test.XXXXXX";
  ASSERT_NE(mkdtemp(dir), nullptr);
  const std::string path = std::string(dir) + "/socket";
  grpc::CallbackGenericService service;  // answers UNIMPLEMENTED; only the connection matters
  grpc::ServerBuilder builder;
  builder.RegisterCallbackGenericService(&service);
  builder.AddListeningPort("unix:" + path, grpc::InsecureServerCredentials());
  builder.SetOption(BulkTransportOption());
  std::unique_ptr<grpc::Server> server = builder.BuildAndStart();
  ASSERT_NE(server, nullptr);

  grpc::ChannelArguments args;
  SetBulkTransportArgs(&args);
  std::shared_ptr<grpc::Channel> channel =
      grpc::CreateCustomChannel("unix:" + path, grpc::InsecureChannelCredentials(), args);
  ASSERT_TRUE(
      channel->WaitForConnected(std::chrono::system_clock::now() + std::chrono::seconds(30)));

  // The listener, the accepted socket and the client's, at least; each sized.
  const std::vector<int> fds = SocketsOn(path);
  EXPECT_GE(fds.size(), 3u);
  for (int fd : fds) {
    EXPECT_EQ(BufferOf(fd, SO_SNDBUF), Granted(SO_SNDBUF, kUnixSocketBufferBytes)) << fd;
  }
  channel.reset();
  server->Shutdown();
  unlink(path.c_str());
  rmdir(dir);
}

}  // namespace
}  // namespace attn
