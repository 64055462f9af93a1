// Tensor-core building blocks (sm_80+): ldmatrix and mma.sync m16n8k16 with bf16 inputs and fp32
// accumulation. Fragment layouts follow the PTX ISA ("Matrix Fragments for mma.m16n8k16"):
// lane = 4 * g + t (g = lane / 4, t = lane % 4);
//   A (16x16, row-major) a[0]: (g, 2t..2t+1)  a[1]: (g+8, 2t..)  a[2]: (g, 2t+8..)  a[3]: (g+8, 2t+8..)
//   B (16x8, k-major)    b[0]: (k 2t..2t+1, n g)  b[1]: (k 2t+8.., n g)
//   C (16x8, fp32)       c[0..1]: (g, 2t..2t+1)  c[2..3]: (g+8, 2t..2t+1)
#pragma once

#include <cuda_bf16.h>

#include <cstdint>

#include "kernels/cuda/common/async_copy.cuh"

namespace attn::cuda {

// Four 8x8 b16 matrices; lanes 8i..8i+7 give the row addresses of matrix i, and register i of
// every lane receives its (row lane/4, cols 2*(lane%4)..+1) pair of matrix i.
__device__ __forceinline__ void LdMatrixX4(uint32_t (&r)[4], const void* row_address) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(SmemAddress(row_address)));
}

// As LdMatrixX4, transposed: lane receives (rows 2*(lane%4)..+1, col lane/4) of each matrix.
__device__ __forceinline__ void LdMatrixX4Trans(uint32_t (&r)[4], const void* row_address) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(SmemAddress(row_address)));
}

// c += a * b for one m16n8k16 tile.
__device__ __forceinline__ void MmaBf16(float (&c)[4], const uint32_t (&a)[4], uint32_t b0,
                                       uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, "
      "{%8, %9}, {%0, %1, %2, %3};\n"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// Two floats rounded to bf16 and packed (lo in the low half), as mma operands expect.
__device__ __forceinline__ uint32_t PackBf16(float lo, float hi) {
  const __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
  return *reinterpret_cast<const uint32_t*>(&v);
}

}  // namespace attn::cuda
