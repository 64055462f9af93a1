// Hopper (sm_90a) building blocks in PTX: mbarriers, cp.async that completes on an mbarrier, TMA,
// the generic-to-async proxy fence, register reallocation between warpgroups and the shared
// memory matrix descriptors wgmma reads its operands through (kernels/cuda/sm90/wgmma.cuh).
//
// Shared memory is addressed by 32-bit shared-window addresses throughout (what the PTX
// instructions take), not generic pointers.
#pragma once

#include <cuda.h>  // CUtensorMap (the driver entry point is looked up at run time)
#include <cuda_runtime.h>

#include <cstdint>

namespace attn::cuda::sm90 {

__device__ __forceinline__ uint32_t SharedAddress(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

// ---- mbarrier (one 8-byte word of shared memory each).

__device__ __forceinline__ void BarrierInit(uint32_t bar, uint32_t arrivals) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(bar), "r"(arrivals));
}

// One arrival of the calling thread.
__device__ __forceinline__ void BarrierArrive(uint32_t bar) {
  asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];\n" ::"r"(bar) : "memory");
}

// An arrival once every cp.async the calling thread issued before has landed. The barrier's
// arrival count must include it (.noinc: the pending count is not raised first).
__device__ __forceinline__ void BarrierArriveOnCopies(uint32_t bar) {
  asm volatile("cp.async.mbarrier.arrive.noinc.shared::cta.b64 [%0];\n" ::"r"(bar) : "memory");
}

// Waits until the phase with the given parity has completed. A fresh barrier is in phase 0, so
// waiting on parity 1 returns at once (the producer's first pass over a ring of stages).
__device__ __forceinline__ void BarrierWait(uint32_t bar, uint32_t parity) {
  uint32_t done = 0;
  do {
    asm volatile(
        "{\n.reg .pred p;\n"
        "mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\n"
        "selp.u32 %0, 1, 0, p;\n}\n"
        : "=r"(done)
        : "r"(bar), "r"(parity)
        : "memory");
  } while (!done);
}

// An arrival of the calling thread that also expects `bytes` more of asynchronous copies (TMA)
// to complete on the barrier before its phase can.
__device__ __forceinline__ void BarrierArriveExpectTx(uint32_t bar, uint32_t bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" ::"r"(bar), "r"(bytes)
               : "memory");
}

// ---- copies and fences.

// TMA: the box of a 2-D tensor map at element coordinates (c0 innermost, c1) into shared memory
// at dst, in the map's swizzle, completing its bytes on the mbarrier bar. `map` is the address
// of a __grid_constant__ CUtensorMap kernel parameter.
__device__ __forceinline__ void TmaLoad2d(uint32_t dst, const void* map, int c0, int c1,
                                          uint32_t bar) {
  asm volatile(
      "cp.async.bulk.tensor.2d.shared::cluster.global.tile.mbarrier::complete_tx::bytes"
      " [%0], [%1, {%2, %3}], [%4];\n" ::"r"(dst),
      "l"(reinterpret_cast<uint64_t>(map)), "r"(c0), "r"(c1), "r"(bar)
      : "memory");
}

// The same for the box of a 3-D tensor map at (c0 innermost, c1, c2).
__device__ __forceinline__ void TmaLoad3d(uint32_t dst, const void* map, int c0, int c1, int c2,
                                          uint32_t bar) {
  asm volatile(
      "cp.async.bulk.tensor.3d.shared::cluster.global.tile.mbarrier::complete_tx::bytes"
      " [%0], [%1, {%2, %3, %4}], [%5];\n" ::"r"(dst),
      "l"(reinterpret_cast<uint64_t>(map)), "r"(c0), "r"(c1), "r"(c2), "r"(bar)
      : "memory");
}

// Fetches a tensor map (a __grid_constant__ kernel parameter) into the TMA unit's cache ahead of
// its first use.
__device__ __forceinline__ void PrefetchTensorMap(const void* map) {
  asm volatile("prefetch.tensormap [%0];\n" ::"l"(reinterpret_cast<uint64_t>(map)) : "memory");
}

// 16 bytes global -> shared, or 16 zero bytes when !valid (src is then not read).
__device__ __forceinline__ void CopyAsync16(uint32_t dst, const void* src, bool valid) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(src),
               "r"(valid ? 16 : 0)
               : "memory");
}

// 16 bytes global -> shared, unconditionally.
__device__ __forceinline__ void CopyAsync16(uint32_t dst, const void* src) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(dst), "l"(src) : "memory");
}

// Brings the line at `src` into L2, translating its address on the way: touched ahead of the copies
// that read its page, so that they find the translation done.
__device__ __forceinline__ void PrefetchLineL2(const void* src) {
  asm volatile("prefetch.global.L2 [%0];\n" ::"l"(src));
}

__device__ __forceinline__ void WaitAllCopies() {
  asm volatile("cp.async.wait_all;\n" ::: "memory");
}

// Orders the calling thread's view of shared memory written through the generic proxy (ordinary
// stores, cp.async seen through an mbarrier) before its later async-proxy reads (wgmma).
__device__ __forceinline__ void FenceProxyAsync() {
  asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
}

// True in one lane of the calling (converged) warp: it issues what the warp does once. Inside it
// the compiler keeps warp-uniform operands (TMA coordinates, addresses) in uniform registers.
__device__ __forceinline__ bool ElectOne() {
  uint32_t elected = 0;
  asm volatile(
      "{\n.reg .pred p;\n"
      "elect.sync _|p, 0xffffffff;\n"
      "selp.u32 %0, 1, 0, p;\n}\n"
      : "=r"(elected));
  return elected != 0;
}

// ---- named barriers (ids 1..15; 0 is __syncthreads): `threads` counts the arriving and the
// waiting threads together.

__device__ __forceinline__ void NamedBarrierSync(int id, int threads) {
  asm volatile("bar.sync %0, %1;\n" ::"r"(id), "r"(threads) : "memory");
}

__device__ __forceinline__ void NamedBarrierArrive(int id, int threads) {
  asm volatile("bar.arrive %0, %1;\n" ::"r"(id), "r"(threads) : "memory");
}

// ---- warpgroup register reallocation (needs __launch_bounds__(threads, 1)).

template <int kRegisters>
__device__ __forceinline__ void ReleaseRegisters() {
  asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;\n" ::"n"(kRegisters));
}

template <int kRegisters>
__device__ __forceinline__ void ClaimRegisters() {
  asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;\n" ::"n"(kRegisters));
}

// ---- shared memory matrix descriptors, 128-byte swizzle.
//
// Every tile the kernels give wgmma is stored as column blocks of 64 bf16 (128 bytes): column
// block cb of a tile of R rows starts at cb * R * 128 bytes, row r of it at r * 128, and the
// 16-byte chunk c of the row at chunk position c ^ (r % 8) (SwizzledOffset). Tiles start on a
// 1024-byte boundary, so this is the hardware's 128-byte swizzle pattern (address bits 4-6 XOR
// bits 7-9). Descriptor fields: start address, leading and stride byte offsets (all >> 4), and
// the swizzle mode in bits 62-63 (1: 128 bytes).

__device__ __forceinline__ uint32_t SwizzledOffset(int rows, int row, int chunk) {
  const int cb = chunk >> 3, c = chunk & 7;
  return static_cast<uint32_t>(cb * rows * 128 + row * 128 + ((c ^ (row & 7)) << 4));
}

__device__ __forceinline__ uint64_t DescriptorBits(uint32_t leading_bytes, uint32_t stride_bytes) {
  return (static_cast<uint64_t>((leading_bytes >> 4) & 0x3fff) << 16) |
         (static_cast<uint64_t>((stride_bytes >> 4) & 0x3fff) << 32) | (uint64_t{1} << 62);
}

// K-major operand (rows of the M or N dimension, K contiguous): groups of 8 rows are 1024 bytes
// apart; the leading offset is unused by swizzled K-major layouts (1 by convention). A 16-wide
// k-step within a column block starts 32 bytes further.
__device__ __forceinline__ uint64_t KMajorDescriptor(uint32_t start) {
  return DescriptorBits(16, 1024) | ((start & 0x3ffff) >> 4);
}

// MN-major operand (rows of the K dimension, N contiguous; wgmma's transposed B): 8-row K groups
// are 1024 bytes apart, 64-wide N blocks `block_bytes` apart. A 16-deep k-step starts 2048 bytes
// further.
__device__ __forceinline__ uint64_t MnMajorDescriptor(uint32_t start, uint32_t block_bytes) {
  return DescriptorBits(block_bytes, 1024) | ((start & 0x3ffff) >> 4);
}

// ---- wgmma issue/complete (the warpgroup's 128 threads execute these together).

// Orders earlier register writes (accumulators, A fragments) before the next wgmma reads them.
__device__ __forceinline__ void WgmmaFence() {
  asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory");
}

__device__ __forceinline__ void WgmmaCommit() {
  asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory");
}

// Waits until at most kPending committed wgmma groups are still running.
template <int kPending>
__device__ __forceinline__ void WgmmaWait() {
  asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(kPending) : "memory");
}

// Keeps the compiler from moving reads or writes of registers an in-flight wgmma owns across
// the issue or the wait (the asm "touches" each one).
template <int kN>
__device__ __forceinline__ void PinRegisters(float (&r)[kN][4]) {
#pragma unroll
  for (int i = 0; i < kN; ++i) {
#pragma unroll
    for (int j = 0; j < 4; ++j) asm volatile("" : "+f"(r[i][j])::"memory");
  }
}

template <int kN>
__device__ __forceinline__ void PinRegisters(uint32_t (&r)[kN][4]) {
#pragma unroll
  for (int i = 0; i < kN; ++i) {
#pragma unroll
    for (int j = 0; j < 4; ++j) asm volatile("" : "+r"(r[i][j])::"memory");
  }
}

// ---- tensor maps (host).

// The driver's cuTensorMapEncodeTiled, looked up once at run time (so the build needs no libcuda);
// null where the driver has none.
using TensorMapEncodeTiled = CUresult (*)(CUtensorMap*, CUtensorMapDataType, cuuint32_t, void*,
                                          const cuuint64_t*, const cuuint64_t*, const cuuint32_t*,
                                          const cuuint32_t*, CUtensorMapInterleave,
                                          CUtensorMapSwizzle, CUtensorMapL2promotion,
                                          CUtensorMapFloatOOBfill);
inline TensorMapEncodeTiled TensorMapEncoder() {
  static const TensorMapEncodeTiled encode = [] {
    void* fn = nullptr;
    cudaDriverEntryPointQueryResult found;
    if (cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &fn, 12000, cudaEnableDefault,
                                         &found) != cudaSuccess ||
        found != cudaDriverEntryPointSuccess) {
      fn = nullptr;
    }
    return reinterpret_cast<TensorMapEncodeTiled>(fn);
  }();
  return encode;
}

}  // namespace attn::cuda::sm90
