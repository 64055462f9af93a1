// The RPC edge's handling of tensor bytes (Google Benchmark): parsing a request with protobuf
// (every tensor copied into a string) against the request reader (tensors left in the slices),
// and serializing a response with protobuf against the response writer (output sent from the
// backend's buffer). Shapes: decode batch 64 (32 heads x 128: 512 KiB of q) and an 8192-token
// prefill with K/V (64 MiB of q, 32 MiB of K/V). The client's side too: writing the request
// with protobuf against tensor_message.h's writer (the tensors as slices of their own), and
// reading the response. bench/RESULTS.md has the numbers.
#include <benchmark/benchmark.h>

#include <memory>
#include <string>
#include <vector>

#include "attnserve/v1/attention.pb.h"
#include "grpcpp/impl/codegen/proto_utils.h"
#include "grpcpp/support/proto_buffer_reader.h"
#include "grpcpp/support/proto_buffer_writer.h"
#include "kernels/cpu/thread_pool.h"
#include "server/backends/merged_batch.h"
#include "server/rpc/request_reader.h"
#include "server/rpc/response_writer.h"
#include "server/rpc/tensor_message.h"

namespace attn {
namespace {

constexpr int kHeads = 32, kKvHeads = 8, kHeadDim = 128;

void Fill(v1::Tensor* t, int64_t rows, int64_t width) {
  t->set_dtype(v1::DTYPE_BF16);
  t->add_shape(rows);
  t->add_shape(width / kHeadDim);
  t->add_shape(kHeadDim);
  t->mutable_data()->assign(rows * width * 2, '\x3f');
}

// A request of `tokens` query rows (with K/V when `append`).
v1::PrefillRequest Request(int tokens, bool append) {
  v1::PrefillRequest r;
  Fill(r.mutable_q(), tokens, kHeads * kHeadDim);
  if (append) {
    Fill(r.mutable_k_new(), tokens, kKvHeads * kHeadDim);
    Fill(r.mutable_v_new(), tokens, kKvHeads * kHeadDim);
  }
  r.add_qo_indptr(0);
  r.add_qo_indptr(tokens);
  for (int i = 0; i < tokens / 16 + 64; ++i) r.add_kv_indices(i);
  return r;
}

// The request serialized, in 4 MiB slices as gRPC delivers it.
std::vector<grpc::Slice> Message(int tokens, bool append) {
  const std::string bytes = Request(tokens, append).SerializeAsString();
  std::vector<grpc::Slice> slices;
  for (size_t at = 0; at < bytes.size(); at += 4 << 20) {
    slices.emplace_back(bytes.substr(at, 4 << 20));
  }
  return slices;
}

void BM_ParseProtobuf(benchmark::State& state) {
  std::vector<grpc::Slice> slices = Message(state.range(0), state.range(1));
  grpc::ByteBuffer buffer(slices.data(), slices.size());
  for (auto _ : state) {
    grpc::ByteBuffer copy(buffer);
    v1::PrefillRequest r;
    grpc::ProtoBufferReader reader(&copy);
    benchmark::DoNotOptimize(r.ParseFromZeroCopyStream(&reader));
  }
  state.SetBytesProcessed(state.iterations() * buffer.Length());
}

void BM_ParseReader(benchmark::State& state) {
  std::vector<grpc::Slice> slices = Message(state.range(0), state.range(1));
  grpc::ByteBuffer buffer(slices.data(), slices.size());
  std::vector<grpc::Slice> held;
  for (auto _ : state) {
    v1::PrefillRequest r;
    InlineTensors tensors;
    benchmark::DoNotOptimize(ReadAttentionRequest(buffer, &held, &r, &tensors).ok());
  }
  state.SetBytesProcessed(state.iterations() * buffer.Length());
}

v1::AttentionResponse Response(int tokens) {
  v1::AttentionResponse r;
  r.mutable_output()->set_dtype(v1::DTYPE_BF16);
  r.mutable_output()->add_shape(tokens);
  r.mutable_output()->add_shape(kHeads);
  r.mutable_output()->add_shape(kHeadDim);
  r.mutable_lse()->set_dtype(v1::DTYPE_FP32);
  r.mutable_lse()->add_shape(tokens);
  r.mutable_lse()->add_shape(kHeads);
  return r;
}

// The protobuf way: the output is copied from the backend's buffer into the message, which is
// then serialized into the gRPC buffer.
void BM_WriteProtobuf(benchmark::State& state) {
  const int tokens = state.range(0);
  const std::string out(int64_t{tokens} * kHeads * kHeadDim * 2, 'o');
  const std::string lse(int64_t{tokens} * kHeads * 4, 'l');
  for (auto _ : state) {
    v1::AttentionResponse r = Response(tokens);
    r.mutable_output()->set_data(out);
    r.mutable_lse()->set_data(lse);
    grpc::ByteBuffer buffer;
    bool own = false;
    benchmark::DoNotOptimize(
        grpc::SerializationTraits<v1::AttentionResponse>::Serialize(r, &buffer, &own).ok());
  }
  state.SetBytesProcessed(state.iterations() * (out.size() + lse.size()));
}

void BM_WriteShared(benchmark::State& state) {
  const int tokens = state.range(0);
  auto out = std::make_shared<std::string>(int64_t{tokens} * kHeads * kHeadDim * 2, 'o');
  auto lse = std::make_shared<std::string>(int64_t{tokens} * kHeads * 4, 'l');
  for (auto _ : state) {
    grpc::ByteBuffer buffer =
        WriteAttentionResponse(Response(tokens), SharedBytes{out, out->data(), out->size()},
                               SharedBytes{lse, lse->data(), lse->size()});
    benchmark::DoNotOptimize(buffer.Length());
  }
  state.SetBytesProcessed(state.iterations() * (out->size() + lse->size()));
}

// The client's side of a request: the generated stub's serialization (every tensor copied into
// the gRPC buffer), against the request written once as slices of its own tensors and sent again
// (a copy of the ByteBuffer: references only).
void BM_ClientWriteProtobuf(benchmark::State& state) {
  const v1::PrefillRequest r = Request(state.range(0), state.range(1));
  for (auto _ : state) {
    grpc::ByteBuffer buffer;
    bool own = false;
    benchmark::DoNotOptimize(
        grpc::SerializationTraits<v1::PrefillRequest>::Serialize(r, &buffer, &own).ok());
  }
  state.SetBytesProcessed(state.iterations() * r.ByteSizeLong());
}

void BM_ClientWriteSlices(benchmark::State& state) {
  const v1::PrefillRequest r = Request(state.range(0), state.range(1));
  std::vector<TensorSlice> tensors;
  for (const auto& [field, t] : {std::pair{3, &r.q()}, {5, &r.k_new()}, {6, &r.v_new()}}) {
    tensors.push_back({field, BorrowedSlice(t->data().data(), t->data().size())});
  }
  const grpc::ByteBuffer prepared = WriteTensorMessage(r, tensors);
  for (auto _ : state) {
    grpc::ByteBuffer buffer(prepared);
    benchmark::DoNotOptimize(buffer.Length());
  }
  state.SetBytesProcessed(state.iterations() * r.ByteSizeLong());
}

// The client's side of a response: protobuf's parse (output and lse copied into strings) against
// the reader (left in the slices), over a response in 4 MiB slices.
grpc::ByteBuffer ResponseMessage(int tokens) {
  v1::AttentionResponse r = Response(tokens);
  r.mutable_output()->set_data(std::string(int64_t{tokens} * kHeads * kHeadDim * 2, 'o'));
  r.mutable_lse()->set_data(std::string(int64_t{tokens} * kHeads * 4, 'l'));
  const std::string bytes = r.SerializeAsString();
  std::vector<grpc::Slice> slices;
  for (size_t at = 0; at < bytes.size(); at += 4 << 20) {
    slices.emplace_back(bytes.substr(at, 4 << 20));
  }
  return grpc::ByteBuffer(slices.data(), slices.size());
}

void BM_ClientReadProtobuf(benchmark::State& state) {
  const grpc::ByteBuffer buffer = ResponseMessage(state.range(0));
  for (auto _ : state) {
    grpc::ByteBuffer copy(buffer);
    v1::AttentionResponse r;
    benchmark::DoNotOptimize(
        grpc::SerializationTraits<v1::AttentionResponse>::Deserialize(&copy, &r).ok());
  }
  state.SetBytesProcessed(state.iterations() * buffer.Length());
}

void BM_ClientReadSlices(benchmark::State& state) {
  const grpc::ByteBuffer buffer = ResponseMessage(state.range(0));
  std::vector<grpc::Slice> held;
  for (auto _ : state) {
    v1::AttentionResponse r;
    HostBytes data[2];
    benchmark::DoNotOptimize(ReadTensorMessage(buffer, &held, 1, 2, &r, data).ok());
  }
  state.SetBytesProcessed(state.iterations() * buffer.Length());
}

// The backend's gather of a message's tensor bytes (4 MiB slices) into one staging buffer, on
// 1 or more threads of a pool (CopyRun, which stays on the caller below kParallelCopyMinBytes
// per thread): range(0) bytes, range(1) threads.
void BM_Gather(benchmark::State& state) {
  const size_t bytes = state.range(0);
  const int threads = static_cast<int>(state.range(1));
  std::vector<std::string> slices;
  HostBytes host;
  for (size_t at = 0; at < bytes; at += 4 << 20) {
    slices.emplace_back(std::min<size_t>(4 << 20, bytes - at), '\x3f');
  }
  for (const std::string& s : slices) host.Append(s.data(), s.size());
  HostRun run;
  run.Add(0, &host);
  std::string staging(bytes, '\0');
  cpu::ThreadPool pool(threads - 1);
  const ParallelFor parallel_for = [&](int64_t n, const std::function<void(int64_t)>& fn) {
    pool.ParallelFor(n, fn);
  };
  for (auto _ : state) {
    CopyRun(run, staging.data(), 0, bytes, threads, parallel_for);
    benchmark::ClobberMemory();
  }
  state.SetBytesProcessed(state.iterations() * bytes);
}

BENCHMARK(BM_ParseProtobuf)->Args({64, 0})->Args({8192, 1})->Unit(benchmark::kMicrosecond);
BENCHMARK(BM_ParseReader)->Args({64, 0})->Args({8192, 1})->Unit(benchmark::kMicrosecond);
BENCHMARK(BM_WriteProtobuf)->Arg(64)->Arg(8192)->Unit(benchmark::kMicrosecond);
BENCHMARK(BM_WriteShared)->Arg(64)->Arg(8192)->Unit(benchmark::kMicrosecond);
BENCHMARK(BM_ClientWriteProtobuf)->Args({64, 0})->Args({8192, 1})->Unit(benchmark::kMicrosecond);
BENCHMARK(BM_ClientWriteSlices)->Args({64, 0})->Args({8192, 1})->Unit(benchmark::kMicrosecond);
BENCHMARK(BM_ClientReadProtobuf)->Arg(64)->Arg(8192)->Unit(benchmark::kMicrosecond);
BENCHMARK(BM_Gather)
    ->ArgsProduct({{512 << 10, 2 << 20, 8 << 20, 96 << 20}, {1, 2}})
    ->Unit(benchmark::kMicrosecond);
BENCHMARK(BM_ClientReadSlices)->Arg(64)->Arg(8192)->Unit(benchmark::kMicrosecond);

}  // namespace
}  // namespace attn

BENCHMARK_MAIN();
