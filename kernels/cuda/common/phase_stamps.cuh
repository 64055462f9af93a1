// Phase stamps: where a CTA's time goes, as kernel_bench --stamps records it for the kernels'
// stamped variants (kernels/cuda/api.h). A stamped kernel writes one record of kPhaseStampSlots
// 64-bit words per work (per CTA, unless persistent) into the buffer its family's setter names;
// the other variants compile none of it.
//
// A record's slots (PhaseSlot): the SM and the CTA's key tiles, two global-timer stamps (ns,
// comparable across SMs: the CTA's start and its last warpgroup's end) and SM clock stamps
// (cycles, comparable within the CTA) at the phases between. bench/stamps.py reads them.
#pragma once

#include <cstdint>

#include "kernels/cuda/api.h"

namespace attn::cuda {

__device__ __forceinline__ uint64_t GlobalTimerNs() {
  uint64_t t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}

__device__ __forceinline__ uint32_t SmId() {
  uint32_t id;
  asm volatile("mov.u32 %0, %%smid;" : "=r"(id));
  return id;
}

// Writes slot `slot` of record `record` (nothing past the buffer's capacity).
__device__ __forceinline__ void WriteStamp(const PhaseStampBuffer& b, int record, PhaseSlot slot,
                                           uint64_t value) {
  if (b.records != nullptr && record < b.capacity) {
    b.records[int64_t{record} * kPhaseStampSlots + static_cast<int>(slot)] = value;
  }
}

__device__ __forceinline__ void StampClock(const PhaseStampBuffer& b, int record, PhaseSlot slot) {
  WriteStamp(b, record, slot, static_cast<uint64_t>(clock64()));
}

}  // namespace attn::cuda
