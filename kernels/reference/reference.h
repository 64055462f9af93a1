// Naive reference implementation of the kernels library's operations: single-threaded, double
// precision, written for obvious correctness rather than speed. It is the single source of truth
// every backend is tested against; it shares nothing with the backends but kernels/attention.h's
// types and GetSeqExtent. The causal rule and the append position are written out here again
// rather than taken from attention.h's VisibleKeys / AppendPosition, which the backends use, so a
// mistake in those helpers fails the tests instead of being shared by both sides.
//
// Same parameter structs, preconditions and outputs as the CPU backend
// (kernels/cpu/cpu_attention.h), on host pointers: outputs are rounded to bf16 (nearest even) from
// double, lse is written as float.
#pragma once

#include "kernels/attention.h"

namespace attn::reference {

// Copies row r of k_new / v_new into the cache slot of position kv_len - q_len + (r - q_begin).
// No-op when k_new is nullptr.
void GqaAppendKv(const GqaParams& params);
void GqaAttention(const GqaParams& params);

void MlaAppendKv(const MlaParams& params);
void MlaAttention(const MlaParams& params);

}  // namespace attn::reference
