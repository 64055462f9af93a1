// The finiteness check of a launch's inputs (kernels/cuda/api.h CheckFinite): every 16-byte
// vector of each input is read once, at memory speed, and a non-finite element flags its call.
// On the GPU this costs microseconds where the host would scan at a few GB/s (a 96 MB prefill's
// q and K/V: tens of milliseconds), and it covers inputs in CUDA IPC regions, which the host
// cannot read.
#include <cuda_runtime.h>

#include <algorithm>

#include "kernels/cuda/api.h"
#include "kernels/cuda/common/call_checks.cuh"
#include "kernels/cuda/common/cuda_check.h"

namespace attn::cuda {
namespace {

constexpr int kThreads = 256;
constexpr int kMaxInputs = 4;

struct Inputs {
  CheckedInput input[kMaxInputs];
  int count;
};

// True when one of the two bf16 of `w` has all exponent bits set (Inf or NaN).
__device__ __forceinline__ bool NonFinitePair(uint32_t w) {
  return (w & 0x7f80u) == 0x7f80u || (w & 0x7f800000u) == 0x7f800000u;
}

__device__ __forceinline__ bool NonFinite(uint4 v) {
  return NonFinitePair(v.x) || NonFinitePair(v.y) || NonFinitePair(v.z) || NonFinitePair(v.w);
}

__device__ void Flag(const CheckedInput& in, const CallChecks& checks, int64_t element) {
  const int row = static_cast<int>(element / in.width);
  atomicOr(&checks.refused[CallOfRow(checks, row)], in.bit);
}

__global__ void __launch_bounds__(kThreads)
    CheckFiniteKernel(const Inputs inputs, const CallChecks checks) {
  const int64_t stride = int64_t{gridDim.x} * kThreads;
  const int64_t first = int64_t{blockIdx.x} * kThreads + threadIdx.x;
  for (int t = 0; t < inputs.count; ++t) {
    const CheckedInput& in = inputs.input[t];
    const int64_t elements = in.rows * in.width;
    const int64_t vectors = elements / 8;
    const uint4* v = reinterpret_cast<const uint4*>(in.data);
    for (int64_t i = first; i < vectors; i += stride) {
      if (NonFinite(v[i])) {
        // Which of the 8 elements: the row of the first non-finite one (a vector may straddle
        // two rows, of two calls, when width is not a multiple of 8).
        const uint4 x = v[i];
        const uint32_t w[4] = {x.x, x.y, x.z, x.w};
        for (int e = 0; e < 8; ++e) {
          const uint32_t bits = (w[e / 2] >> (16 * (e % 2))) & 0xffffu;
          if ((bits & 0x7f80u) == 0x7f80u) Flag(in, checks, 8 * i + e);
        }
      }
    }
    // The tail past the last whole vector.
    const uint16_t* h = reinterpret_cast<const uint16_t*>(in.data);
    for (int64_t e = 8 * vectors + first; e < elements; e += stride) {
      if ((h[e] & 0x7f80u) == 0x7f80u) Flag(in, checks, e);
    }
  }
}

}  // namespace

cudaError_t CheckFinite(const CheckedInput* inputs, int num_inputs, const CallChecks& checks,
                        int num_sms, cudaStream_t stream) {
  if (checks.num_calls == 0) return cudaSuccess;
  if (num_inputs > kMaxInputs || num_inputs < 0 || num_sms < 1) return cudaErrorInvalidValue;
  Inputs in{};
  int64_t vectors = 0;
  for (int i = 0; i < num_inputs; ++i) {
    if (inputs[i].data == nullptr || inputs[i].rows == 0 || inputs[i].width == 0) continue;
    if (reinterpret_cast<uintptr_t>(inputs[i].data) % 16 != 0) return cudaErrorInvalidValue;
    in.input[in.count++] = inputs[i];
    vectors = std::max(vectors, (inputs[i].rows * inputs[i].width + 7) / 8);
  }
  if (in.count == 0) return cudaSuccess;
  // Enough blocks to keep every SM's loads in flight, no more than the largest input needs.
  const int64_t blocks =
      std::min<int64_t>((vectors + kThreads - 1) / kThreads, int64_t{num_sms} * 8);
  CheckFiniteKernel<<<static_cast<int>(blocks), kThreads, 0, stream>>>(in, checks);
  ATTN_CUDA_RETURN_IF_LAUNCH_FAILED();
  return cudaSuccess;
}

}  // namespace attn::cuda
