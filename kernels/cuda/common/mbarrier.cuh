// mbarriers (sm_80+; the transaction counts sm_90+): one 8-byte word of shared memory each,
// addressed by its 32-bit shared-window address (what the PTX instructions take).
#pragma once

#include <cstdint>

namespace attn::cuda {

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
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ < 900
  __trap();  // try_wait is sm_90's
#else
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
#endif
}

// An arrival of the calling thread that also expects `bytes` more of asynchronous copies (TMA,
// cp.async.bulk) to complete on the barrier before its phase can (sm_90+).
__device__ __forceinline__ void BarrierArriveExpectTx(uint32_t bar, uint32_t bytes) {
#if !defined(__CUDA_ARCH__) || __CUDA_ARCH__ >= 900
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" ::"r"(bar), "r"(bytes)
               : "memory");
#else
  __trap();
#endif
}

}  // namespace attn::cuda
