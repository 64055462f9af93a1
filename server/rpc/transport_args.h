// gRPC channel arguments for messages of megabytes (a decode's 1 MiB, a prefill's 160 MB), shared
// by the server (server/main.cc) and C++ clients (bench/loadgen.cc), so both ends of a connection
// are sized alike.
//
// - HTTP/2 frames of up to 16 MiB and socket reads of 256 KiB - 16 MiB (4 MiB to start), so a
//   message is not cut into 16 KiB frames and 8 KiB reads (bench/RESULTS.md, "The bytes path
//   without protobuf's copies").
// - Unix sockets get send and receive buffers of `kUnixSocketBufferBytes`. gRPC sets no buffer
//   size on them, so they keep the system's default (net.core.wmem_default, 208 KiB on most
//   hosts), and a 1 MiB message then leaves in five writes, each waiting for the other side to
//   drain the socket and wake the writer again (docs/design.md, "Data plane"). TCP sockets are
//   left alone: setting a size there turns off the kernel's autotuning, which already grows
//   loopback buffers to megabytes.
//
// Thread safety: plain functions; the mutator they install is immutable.
#pragma once

#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/statusor.h"
#include "grpcpp/impl/server_builder_option.h"
#include "grpcpp/support/channel_arguments.h"

namespace attn {

// The buffer size asked for on each unix socket, both directions. The kernel caps it at
// net.core.wmem_max / rmem_max (and doubles what it grants, for its own bookkeeping), so a host
// whose limits are below this gets its limits.
inline constexpr int kUnixSocketBufferBytes = 4 << 20;

// Integer channel arguments an operator gives (attnserve --grpc_arg, attn_loadgen
// --channel_args), in the order given.
using IntChannelArgs = std::vector<std::pair<std::string, int>>;

// Parses "NAME=VALUE" entries, e.g. grpc.http2.lookahead_bytes=67108864. INVALID_ARGUMENT names
// the first one that is not NAME=INTEGER.
absl::StatusOr<IntChannelArgs> ParseIntChannelArgs(const std::vector<std::string>& text);

// Sets the frame and read sizes above and the unix socket buffers on `args`, then `overrides`
// (gRPC takes the last value set for a name, so they win).
void SetBulkTransportArgs(grpc::ChannelArguments* args, const IntChannelArgs& overrides = {});

// The same for a server: ServerBuilder::SetOption(BulkTransportOption(overrides)).
std::unique_ptr<grpc::ServerBuilderOption> BulkTransportOption(IntChannelArgs overrides = {});

// Asks for `bytes` of send and receive buffer on `fd` when it is a unix stream socket; leaves any
// other socket alone. False when a setsockopt failed (the socket is still usable).
bool SetUnixSocketBuffers(int fd, int bytes);

}  // namespace attn
