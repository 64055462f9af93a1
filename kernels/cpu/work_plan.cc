#include "kernels/cpu/work_plan.h"

#include <algorithm>

namespace attn::cpu {

int ChooseRowsPerItem(int group) { return std::max(1, kTargetQueryVectors / std::max(group, 1)); }

int ChooseKvHeadsPerItem(bool decode, int num_kv_heads, int tile_keys, int floats_per_key_head) {
  if (!decode) return 1;
  const int64_t per_head = int64_t{tile_keys} * floats_per_key_head * int64_t{sizeof(float)};
  const int64_t fit = std::max<int64_t>(1, kMaxItemTileBytes / std::max<int64_t>(per_head, 1));
  return static_cast<int>(std::min<int64_t>(fit, std::max(num_kv_heads, 1)));
}

int ChooseKvChunkLen(int num_threads, int64_t num_items, int64_t total_keys, int64_t max_keys) {
  if (num_threads <= 1 || num_items <= 0) return 0;
  if (num_items >= int64_t{kMinItemsPerThread} * num_threads) return 0;
  const int64_t target_items = int64_t{kSplitItemsPerThread} * num_threads;
  int64_t chunk = (total_keys + target_items - 1) / target_items;
  chunk = (chunk + kChunkGranularity - 1) / kChunkGranularity * kChunkGranularity;
  chunk = std::max<int64_t>(chunk, kMinChunkLen);
  if (chunk >= max_keys) return 0;
  return static_cast<int>(chunk);
}

}  // namespace attn::cpu
