// Fast math for the softmax: hardware base-2 exponent/logarithm and quad reductions.
#pragma once

#include <cuda_runtime.h>

namespace attn::cuda {

// 2^x with the SFU (ex2.approx: ~2 ulp; exact 0 for -inf).
__device__ __forceinline__ float Exp2(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}

__device__ __forceinline__ float Log2(float x) {
  float y;
  asm("lg2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}

inline constexpr float kLog2e = 1.4426950408889634f;

// Reductions over the 4 lanes of an mma quad (lanes 4g .. 4g+3 hold one row's columns).
__device__ __forceinline__ float QuadMax(float x) {
  x = fmaxf(x, __shfl_xor_sync(0xffffffffu, x, 1));
  return fmaxf(x, __shfl_xor_sync(0xffffffffu, x, 2));
}

__device__ __forceinline__ float QuadSum(float x) {
  x += __shfl_xor_sync(0xffffffffu, x, 1);
  return x + __shfl_xor_sync(0xffffffffu, x, 2);
}

}  // namespace attn::cuda
