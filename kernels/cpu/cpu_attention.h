// CPU backend of the kernels library: paged K/V append and paged attention (GQA and MLA, prefill
// and decode), multi-threaded over a ThreadPool. Numerics follow kernels/attention.h: float32
// accumulation, bf16 output rounded to nearest even, base-2 lse, rows without a visible key get
// output 0 and lse kEmptyRowLse.
//
// Preconditions (the server validates requests before calling; nothing here re-checks them):
// - All pointers are host pointers. batch.kv_indptr, batch.kv_indices and batch.kv_last_page_len
//   are set (kv_last_page_len is read only for sequences that own at least one page) and describe
//   batch.batch_size sequences; page ids are in [0, cache.num_pages); kv_last_page_len[b] is in
//   [1, cache.page_size]. Sequences may share pages for reading; the slots that an append writes
//   belong to one sequence only.
// - batch.qo_indptr is nullptr (decode: total_q == batch_size, one query row per sequence) or
//   non-decreasing with qo_indptr[0] == 0 and qo_indptr[batch_size] == total_q.
// - batch.seq_layer is nullptr (layer 0) or each entry is in [0, cache.num_layers).
// - GQA: num_qo_heads is a positive multiple of cache.num_kv_heads; head_dim > 0 (any value works,
//   multiples of 16 are fastest). MLA: num_heads > 0.
// - Attention reads only cache slots below each sequence's kv_len; output and lse buffers do not
//   overlap any input. lse may be nullptr (not requested).
// - Append: k_new and v_new (ckv_new and kpe_new) are both set or both nullptr (then a no-op);
//   kv_len[b] >= q_len[b] for every sequence (the page table already includes the new tokens).
//
// Subnormal floats count as zero inside the attention functions (float_env.h: they would run
// several times slower); the caller's floating-point mode is left as it was.
// Thread safety: the functions keep no state between calls; concurrent calls (also on one pool)
// are safe as long as they do not write the same cache slots or outputs.
// Memory: each thread that runs work keeps a thread-local scratch buffer, grown to the largest work
// item it has seen (a few hundred KiB for the published geometries) and reused; the merge of
// split KV allocates num_chunks x rows x heads x head_dim floats per call.
#pragma once

#include "kernels/attention.h"
#include "kernels/cpu/thread_pool.h"

namespace attn::cpu {

// Writes row r of k_new / v_new (sequence b) into the page slot of token position
// kv_len[b] - q_len[b] + (r - q_begin[b]) of layer seq_layer[b]. No-op when k_new is nullptr.
void GqaAppendKv(const GqaParams& params, ThreadPool& pool);

// Paged GQA attention over the cache: prefill when batch.qo_indptr is set, decode otherwise.
// Writes out (and lse when set) for every query row. Does not append; call GqaAppendKv first.
void GqaAttention(const GqaParams& params, ThreadPool& pool);

// As GqaAppendKv, for the 576-wide MLA token rows (ckv_new then kpe_new).
void MlaAppendKv(const MlaParams& params, ThreadPool& pool);

// Paged MLA attention (absorbed form: one latent KV row shared by all heads; the output is in
// latent space, [total_q, num_heads, kMlaCkvDim]).
void MlaAttention(const MlaParams& params, ThreadPool& pool);

// SIMD width of the kernels: kAuto (the default) uses the widest the CPU has (16 floats with
// AVX-512, 8 with AVX2, else 4), each with its own register blocking. Tests and benchmarks force
// a width to cover every code path on one machine (a width the CPU lacks still runs correctly,
// split over its narrower registers, only slowly); results agree within float rounding. Takes
// effect for calls that start afterwards.
enum class SimdWidth { kAuto, k4, k8, k16 };
void SetSimdWidthForTesting(SimdWidth width);

}  // namespace attn::cpu
