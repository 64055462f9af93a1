// cp.async (sm_80+): 16-byte global-to-shared copies that bypass registers, grouped into stages.
#pragma once

#include <cstdint>

namespace attn::cuda {

__device__ __forceinline__ uint32_t SmemAddress(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

// Copies 16 bytes from global `src` to shared `dst`, or writes 16 zero bytes when !valid (src is
// then not read, so it may point anywhere). Bypasses L1 (.cg): every byte is used once per CTA.
__device__ __forceinline__ void CopyAsync16(void* dst, const void* src, bool valid) {
  const int src_bytes = valid ? 16 : 0;
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(SmemAddress(dst)), "l"(src),
               "r"(src_bytes));
}

// Copies 4 bytes from global `src` to shared `dst` (through L1: .cg takes only 16-byte copies).
__device__ __forceinline__ void CopyAsync4(void* dst, const void* src) {
  asm volatile("cp.async.ca.shared.global [%0], [%1], 4;\n" ::"r"(SmemAddress(dst)), "l"(src));
}

__device__ __forceinline__ void CommitAsyncGroup() { asm volatile("cp.async.commit_group;\n" ::); }

// Waits until at most `kPending` committed groups are still in flight.
template <int kPending>
__device__ __forceinline__ void WaitAsyncGroups() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(kPending));
}

}  // namespace attn::cuda
