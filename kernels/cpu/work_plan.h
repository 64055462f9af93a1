// Work decomposition heuristics of the CPU attention backend: pure functions, unit-tested.
//
// A work item is (sequence, KV heads, block of query rows, chunk of keys). All query heads that
// share a KV head, for every row of the block, are processed together so each K/V row is converted
// from bf16 once and reused by all of them. Keys are split into chunks only when the unsplit items
// are too few to keep every thread busy (small-batch decode); the per-chunk partial softmax states
// are merged afterwards.
#pragma once

#include <cstdint>

namespace attn::cpu {

// Keys converted and scored together (kChunkGranularity is a multiple of each). Prefill tiles of 64
// keys amortize the online-softmax rescale over more work; decode items hold the tiles of several
// KV heads at once, which must stay in L2; MLA rows are 576 wide, so 16 of them (36 KiB as floats)
// fit L1 while every block of query vectors streams over them.
inline constexpr int kKeyTileGqaPrefill = 64;
inline constexpr int kKeyTileGqaDecode = 32;
inline constexpr int kKeyTileMla = 16;
inline constexpr int kChunkGranularity = 64;

// Query vectors (rows x heads) one item aims for: enough reuse of each converted K/V row while the
// float copies of Q and of the output accumulators stay in L2 (64 x 512 floats = 128 KiB for MLA).
inline constexpr int kTargetQueryVectors = 64;

// Unsplit plans with at least this many items per thread are balanced well enough by the pool's
// dynamic scheduling; below it, KV chunks are split to reach kSplitItemsPerThread.
inline constexpr int kMinItemsPerThread = 2;
inline constexpr int kSplitItemsPerThread = 4;
// A chunk shorter than this costs more in merge traffic and per-item setup than it gains.
inline constexpr int kMinChunkLen = 256;

// Query rows per work item for `group` query vectors per row (query heads per KV head for GQA,
// all heads for MLA): kTargetQueryVectors / group, at least 1.
int ChooseRowsPerItem(int group);

// Float K/V tiles one item keeps (all its KV heads): sized to stay in a core's L2 next to the
// query and output rows.
inline constexpr int kMaxItemTileBytes = 512 * 1024;

// KV heads one work item covers. Decode items take as many KV heads as fit kMaxItemTileBytes
// (tile keys x floats per key and head, qk + v): the K and V rows of all KV heads of a token are
// contiguous in the cache, so such items read memory in long runs instead of head_dim * 2-byte
// pieces a token stride apart. Prefill items already reuse each K/V row across many query rows and
// keep one KV head (their query and output state would not fit otherwise).
int ChooseKvHeadsPerItem(bool decode, int num_kv_heads, int tile_keys, int floats_per_key_head);

// Keys per chunk for a launch whose unsplit plan has num_items items that scan total_keys keys
// (summed over the items; the longest scans max_keys), run on num_threads threads. Returns 0 for
// "do not split". Otherwise the result is a multiple of kChunkGranularity, at least kMinChunkLen,
// and less than max_keys: ceil(total_keys / (kSplitItemsPerThread * num_threads)) rounded up.
int ChooseKvChunkLen(int num_threads, int64_t num_items, int64_t total_keys, int64_t max_keys);

}  // namespace attn::cpu
