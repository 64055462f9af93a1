// Subnormal floats on the CPU backend's threads.
//
// x86 and Arm cores take a slow path (a microcode assist of ~100 cycles on x86) for every
// operation that reads or produces a subnormal float. Attention inputs with tiny magnitudes make
// such products constantly (two values near 2^-70 multiply to a subnormal), and a batch of them
// ran the kernels 7-9x slower than ordinary inputs. ScopedFlushSubnormals sets the thread's
// flush-to-zero and denormals-are-zero modes (x86 MXCSR FTZ|DAZ, Arm FPCR.FZ) for its lifetime and
// restores the previous mode after, so code outside the kernels never sees it. Values below 2^-126
// then count as zero; a score changes by at most head_dim * 2^-126 * max|k| (far below the
// tolerance of docs/design.md unless keys approach the float range), and the GPU kernels'
// exp2 flushes the same way (ex2.approx.ftz).
#pragma once

#include <cstdint>

#if defined(__x86_64__) || defined(_M_X64) || defined(__i386__)
#include <immintrin.h>
#define ATTN_FLOAT_ENV_X86 1
#elif defined(__aarch64__)
#define ATTN_FLOAT_ENV_ARM64 1
#endif

namespace attn::cpu {

#if defined(ATTN_FLOAT_ENV_X86)
inline constexpr uint64_t kFlushSubnormalBits = 0x8040;  // MXCSR FTZ (bit 15) | DAZ (bit 6)
inline uint64_t ReadFloatControl() { return _mm_getcsr(); }
inline void WriteFloatControl(uint64_t v) { _mm_setcsr(static_cast<unsigned>(v)); }
#elif defined(ATTN_FLOAT_ENV_ARM64)
inline constexpr uint64_t kFlushSubnormalBits = uint64_t{1} << 24;  // FPCR.FZ
inline uint64_t ReadFloatControl() {
  uint64_t v;
  __asm__ __volatile__("mrs %0, fpcr" : "=r"(v));
  return v;
}
inline void WriteFloatControl(uint64_t v) { __asm__ __volatile__("msr fpcr, %0" : : "r"(v)); }
#else
inline constexpr uint64_t kFlushSubnormalBits = 0;  // other targets: left as they are
inline uint64_t ReadFloatControl() { return 0; }
inline void WriteFloatControl(uint64_t) {}
#endif

// Whether the calling thread flushes subnormals now.
inline bool SubnormalsFlushed() {
  return kFlushSubnormalBits != 0 &&
         (ReadFloatControl() & kFlushSubnormalBits) == kFlushSubnormalBits;
}

class ScopedFlushSubnormals {
 public:
  ScopedFlushSubnormals() : saved_(ReadFloatControl()) {
    if ((saved_ & kFlushSubnormalBits) != kFlushSubnormalBits) {
      WriteFloatControl(saved_ | kFlushSubnormalBits);
    }
  }
  ~ScopedFlushSubnormals() {
    if ((saved_ & kFlushSubnormalBits) != kFlushSubnormalBits) WriteFloatControl(saved_);
  }
  ScopedFlushSubnormals(const ScopedFlushSubnormals&) = delete;
  ScopedFlushSubnormals& operator=(const ScopedFlushSubnormals&) = delete;

 private:
  const uint64_t saved_;
};

}  // namespace attn::cpu
