// 2^x on the FMA pipe: a cubic for 2^f on [-1/2, 1/2] and the integer part added to the exponent
// bits. The softmax of a Hopper prefill tile takes 64 exponentials a lane; on the SFU (ex2.approx,
// 16 a clock on an SM) both consumer warpgroups' exponentials take ~1024 cycles a key tile, which
// may bound the phase between the S GEMM's end and the next one's issue. Some of them computed
// here, in ~9 FMA-pipe instructions each, shorten it (FlashAttention-4 does this on Blackwell).
//
// Within 7.5e-5 of 2^x (relative) for x in [-125, 127], well under the bf16 rounding P gets
// before its GEMM (2^-9); below -125 a value under 2^-125 (not accurate: the exponent field runs
// out), and exactly 0 from -127 down and for -inf (masked scores), as ex2.approx.ftz gives. Host and device alike, so that a CPU test checks it (exp2_fma_test.cc).
#pragma once

#include <cstdint>
#include <cstring>

#include "kernels/attention.h"

namespace attn::cuda {

// The bits of `from` as a To (a register move once compiled, host or device).
template <typename To, typename From>
ATTN_HOST_DEVICE To BitCast(From from) {
  static_assert(sizeof(To) == sizeof(From));
  To to;
  std::memcpy(&to, &from, sizeof(to));
  return to;
}

// For x <= 127 (a softmax's x is at most 0); NaN gives NaN, as the SFU's does, so that an
// overflowed logit still poisons its row (softmax_state.cuh).
ATTN_HOST_DEVICE float Exp2Fma(float x) {
  // 1.5 * 2^23: adding it rounds x to an integer j held in the low mantissa bits of `shifted`.
  constexpr float kRound = 12582912.f;
  const float clamped = x > -127.f ? x : -127.f;  // -inf and NaN become -127 here
  const float shifted = clamped + kRound;
  const float f = clamped - (shifted - kRound);  // x - j, in [-1/2, 1/2]
  // A minimax fit of 2^f in relative error (Lawson's weighted least squares, float32 coefficients).
  float p = 0x1.c3f76p-5f;
  p = p * f + 0x1.f0de1ap-3f;
  p = p * f + 0x1.62f31ap-1f;
  p = p * f + 0x1.fff692p-1f;
  // p * 2^j: j's two's complement, shifted into the exponent field, adds j to p's exponent.
  const float r = BitCast<float>(BitCast<uint32_t>(p) + (BitCast<uint32_t>(shifted) << 23));
  return x > -127.f ? r : (x <= -127.f ? 0.f : x);
}

}  // namespace attn::cuda
