// wgmma.mma_async with bf16 operands and fp32 accumulators, M = 64 (one warpgroup), K = 16, for
// the N widths the attention kernels use. The accumulator fragment of each warp is that of
// mma.sync m16n8: warp w of the warpgroup holds rows 16 w + lane / 4 (+ 8), and d[j] covers
// columns 8 j + 2 (lane % 4) + {0, 1} (d[j][0..1]: row g, d[j][2..3]: row g + 8), so the
// portable kernels' softmax and epilogue helpers apply unchanged. A register A fragment is the
// mma.sync m16n8k16 A fragment of the warp's 16 rows.
//
// Issue inside WgmmaFence() ... WgmmaCommit(), then WgmmaWait<n>() before touching d (or the A
// registers); see kernels/cuda/sm90/hopper.cuh. PTX names every accumulator register, so the
// operand lists are spelled out by the macros below.
#pragma once

#include <cstdint>

// "%0, ..., %(n-1)": the accumulator registers of an n-register D.
#define ATTN_WGMMA_D8 "%0, %1, %2, %3, %4, %5, %6, %7"
#define ATTN_WGMMA_D16 ATTN_WGMMA_D8 ", %8, %9, %10, %11, %12, %13, %14, %15"
#define ATTN_WGMMA_D32                                                     \
  "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, " \
  "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31"
#define ATTN_WGMMA_D64                                                               \
  "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, "           \
  "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, " \
  "%32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, " \
  "%48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63"
#define ATTN_WGMMA_D128                                                                          \
  "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, "                       \
  "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, "             \
  "%32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, "             \
  "%48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63, "             \
  "%64, %65, %66, %67, %68, %69, %70, %71, %72, %73, %74, %75, %76, %77, %78, %79, "             \
  "%80, %81, %82, %83, %84, %85, %86, %87, %88, %89, %90, %91, %92, %93, %94, %95, "             \
  "%96, %97, %98, %99, %100, %101, %102, %103, %104, %105, %106, %107, %108, %109, %110, %111, " \
  "%112, %113, %114, %115, %116, %117, %118, %119, %120, %121, %122, %123, %124, %125, %126, %127"

// The matching asm operands: 4, 8, 16, 32, 64 or 128 accumulators d[j][0..3].
#define ATTN_WGMMA_ACC4(j) "+f"(d[j][0]), "+f"(d[j][1]), "+f"(d[j][2]), "+f"(d[j][3])
#define ATTN_WGMMA_ACC8(j) ATTN_WGMMA_ACC4(j), ATTN_WGMMA_ACC4(j + 1)
#define ATTN_WGMMA_ACC16(j) ATTN_WGMMA_ACC8(j), ATTN_WGMMA_ACC8(j + 2)
#define ATTN_WGMMA_ACC32(j)                                                                   \
  ATTN_WGMMA_ACC4(j), ATTN_WGMMA_ACC4(j + 1), ATTN_WGMMA_ACC4(j + 2), ATTN_WGMMA_ACC4(j + 3), \
      ATTN_WGMMA_ACC4(j + 4), ATTN_WGMMA_ACC4(j + 5), ATTN_WGMMA_ACC4(j + 6),                 \
      ATTN_WGMMA_ACC4(j + 7)
#define ATTN_WGMMA_ACC64(j) ATTN_WGMMA_ACC32(j), ATTN_WGMMA_ACC32(j + 8)
#define ATTN_WGMMA_ACC128(j) ATTN_WGMMA_ACC64(j), ATTN_WGMMA_ACC64(j + 16)

namespace attn::cuda::sm90 {

template <int kN>
struct Wgmma;

// The narrow widths of the transposed MLA decode (kernels/cuda/sm90/mla_sm90.cu: keys or output
// columns as M, the heads as N).
template <>
struct Wgmma<16> {
  // D (64 x 16, fp32) = A * B (+ D when accumulate): A and B from shared memory, both K-major.
  __device__ __forceinline__ static void SS(float (&d)[2][4], uint64_t a, uint64_t b,
                                            uint32_t accumulate) {
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %10, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n16k16.f32.bf16.bf16 {" ATTN_WGMMA_D8
        "}, %8, %9, p, 1, 1, 0, 0;\n}\n"
        : ATTN_WGMMA_ACC8(0)
        : "l"(a), "l"(b), "r"(accumulate));
  }
  // D (64 x 16, fp32) += A * B: A from shared memory, MN-major (transposed), B K-major.
  __device__ __forceinline__ static void SSTransA(float (&d)[2][4], uint64_t a, uint64_t b) {
    asm volatile(
        "{\n"
        "wgmma.mma_async.sync.aligned.m64n16k16.f32.bf16.bf16 {" ATTN_WGMMA_D8
        "}, %8, %9, 1, 1, 1, 1, 0;\n}\n"
        : ATTN_WGMMA_ACC8(0)
        : "l"(a), "l"(b));
  }
};

template <>
struct Wgmma<32> {
  // D (64 x 32, fp32) = A * B (+ D when accumulate): A and B from shared memory, both K-major.
  __device__ __forceinline__ static void SS(float (&d)[4][4], uint64_t a, uint64_t b,
                                            uint32_t accumulate) {
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %18, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n32k16.f32.bf16.bf16 {" ATTN_WGMMA_D16
        "}, %16, %17, p, 1, 1, 0, 0;\n}\n"
        : ATTN_WGMMA_ACC16(0)
        : "l"(a), "l"(b), "r"(accumulate));
  }
  // D (64 x 32, fp32) += A * B: A from shared memory, MN-major (transposed), B K-major.
  __device__ __forceinline__ static void SSTransA(float (&d)[4][4], uint64_t a, uint64_t b) {
    asm volatile(
        "{\n"
        "wgmma.mma_async.sync.aligned.m64n32k16.f32.bf16.bf16 {" ATTN_WGMMA_D16
        "}, %16, %17, 1, 1, 1, 1, 0;\n}\n"
        : ATTN_WGMMA_ACC16(0)
        : "l"(a), "l"(b));
  }
};

template <>
struct Wgmma<64> {
  // D (64 x 64, fp32) = A * B (+ D when accumulate): A and B from shared memory, both K-major.
  __device__ __forceinline__ static void SS(float (&d)[8][4], uint64_t a, uint64_t b,
                                            uint32_t accumulate) {
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %34, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 {" ATTN_WGMMA_D32
        "}, %32, %33, p, 1, 1, 0, 0;\n}\n"
        : ATTN_WGMMA_ACC32(0)
        : "l"(a), "l"(b), "r"(accumulate));
  }
  // D (64 x 64, fp32) += A * B: A from registers, B from shared memory, K-major.
  __device__ __forceinline__ static void RS(float (&d)[8][4], const uint32_t (&a)[4], uint64_t b) {
    asm volatile(
        "{\n"
        "wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 {" ATTN_WGMMA_D32
        "}, {%32, %33, %34, %35}, %36, 1, 1, 1, 0;\n}\n"
        : ATTN_WGMMA_ACC32(0)
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b));
  }
  // D (64 x 64, fp32) += A * B: A from registers, B from shared memory, MN-major (transposed).
  __device__ __forceinline__ static void RSTransB(float (&d)[8][4], const uint32_t (&a)[4],
                                                  uint64_t b) {
    asm volatile(
        "{\n"
        "wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 {" ATTN_WGMMA_D32
        "}, {%32, %33, %34, %35}, %36, 1, 1, 1, 1;\n}\n"
        : ATTN_WGMMA_ACC32(0)
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b));
  }
};

template <>
struct Wgmma<128> {
  // D (64 x 128, fp32) = A * B (+ D when accumulate): A and B from shared memory, both K-major.
  __device__ __forceinline__ static void SS(float (&d)[16][4], uint64_t a, uint64_t b,
                                            uint32_t accumulate) {
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %66, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n128k16.f32.bf16.bf16 {" ATTN_WGMMA_D64
        "}, %64, %65, p, 1, 1, 0, 0;\n}\n"
        : ATTN_WGMMA_ACC64(0)
        : "l"(a), "l"(b), "r"(accumulate));
  }
  // D (64 x 128, fp32) += A * B: A from registers, B from shared memory, MN-major (transposed).
  __device__ __forceinline__ static void RSTransB(float (&d)[16][4], const uint32_t (&a)[4],
                                                  uint64_t b) {
    asm volatile(
        "{\n"
        "wgmma.mma_async.sync.aligned.m64n128k16.f32.bf16.bf16 {" ATTN_WGMMA_D64
        "}, {%64, %65, %66, %67}, %68, 1, 1, 1, 1;\n}\n"
        : ATTN_WGMMA_ACC64(0)
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b));
  }
};

template <>
struct Wgmma<256> {
  // D (64 x 256, fp32) += A * B: A from shared memory (K-major), B from shared memory, MN-major
  // (transposed).
  __device__ __forceinline__ static void SSTransB(float (&d)[32][4], uint64_t a, uint64_t b) {
    asm volatile(
        "{\n"
        "wgmma.mma_async.sync.aligned.m64n256k16.f32.bf16.bf16 {" ATTN_WGMMA_D128
        "}, %128, %129, 1, 1, 1, 0, 1;\n}\n"
        : ATTN_WGMMA_ACC128(0)
        : "l"(a), "l"(b));
  }
  // D (64 x 256, fp32) += A * B: A from registers, B from shared memory, MN-major (transposed).
  __device__ __forceinline__ static void RSTransB(float (&d)[32][4], const uint32_t (&a)[4],
                                                  uint64_t b) {
    asm volatile(
        "{\n"
        "wgmma.mma_async.sync.aligned.m64n256k16.f32.bf16.bf16 {" ATTN_WGMMA_D128
        "}, {%128, %129, %130, %131}, %132, 1, 1, 1, 1;\n}\n"
        : ATTN_WGMMA_ACC128(0)
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b));
  }
};

}  // namespace attn::cuda::sm90

#undef ATTN_WGMMA_D8
#undef ATTN_WGMMA_D16
#undef ATTN_WGMMA_D32
#undef ATTN_WGMMA_D64
#undef ATTN_WGMMA_D128
#undef ATTN_WGMMA_ACC4
#undef ATTN_WGMMA_ACC8
#undef ATTN_WGMMA_ACC16
#undef ATTN_WGMMA_ACC32
#undef ATTN_WGMMA_ACC64
#undef ATTN_WGMMA_ACC128
