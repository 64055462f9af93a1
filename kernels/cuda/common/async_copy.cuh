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

// Copies 16 bytes from global `src` to shared `dst`: the plain form, without the source size
// operand (and the select that computes it) of the zero-filling one.
__device__ __forceinline__ void CopyAsync16(void* dst, const void* src) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(SmemAddress(dst)), "l"(src));
}

// An L2 cache policy (createpolicy) under which the lines a copy brings in are the first its L2
// set evicts: for bytes read once, so that they replace each other instead of lines still to be
// read, or dirty lines whose eviction costs a DRAM write on top of the read.
__device__ __forceinline__ uint64_t EvictFirstPolicy() {
  uint64_t policy;
  asm volatile("createpolicy.fractional.L2::evict_first.b64 %0, 1.0;\n" : "=l"(policy));
  return policy;
}

// The plain CopyAsync16 under an L2 cache `policy`.
__device__ __forceinline__ void CopyAsync16Hinted(void* dst, const void* src, uint64_t policy) {
  asm volatile(
      "cp.async.cg.shared.global.L2::cache_hint [%0], [%1], 16, 16, %2;\n" ::"r"(SmemAddress(dst)),
      "l"(src), "l"(policy));
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
