#include "kernels/cuda/plan.h"

#include <algorithm>
#include <cmath>
#include <functional>
#include <utility>

namespace attn {
namespace {

int64_t CeilDiv(int64_t a, int64_t b) { return (a + b - 1) / b; }

// The rows one CTA covers and the most keys any of them sees.
struct Tile {
  int seq;
  int row_begin;
  int visible;  // keys seen by the tile's last (widest-seeing) row
};

std::vector<Tile> MakeTiles(const PlanConfig& c, const int32_t* q_lens, const int32_t* kv_lens,
                            int batch_size) {
  std::vector<Tile> tiles;
  for (int b = 0; b < batch_size; ++b) {
    const int rows = q_lens[b] * c.group;
    for (int r = 0; r < rows; r += c.block_m) {
      const int last_token = (std::min(r + c.block_m, rows) - 1) / c.group;
      tiles.push_back({b, r, VisibleKeys(q_lens[b], kv_lens[b], last_token, c.causal)});
    }
  }
  return tiles;
}

// Workspace rows needed when sequences longer than chunk_len are split.
int64_t PartialRows(const PlanConfig& c, const int32_t* q_lens, const int32_t* kv_lens,
                    int batch_size, int chunk_len) {
  int64_t rows = 0;
  for (int b = 0; b < batch_size; ++b) {
    const int64_t splits = CeilDiv(kv_lens[b], chunk_len);
    if (splits > 1) rows += splits * q_lens[b] * int64_t{c.num_qo_heads};
  }
  return rows;
}

// CTA slots that take a launch's CTAs in order, each CTA on the slot that frees up first (as the
// GPU starts them): when the last one ends.
class Slots {
 public:
  explicit Slots(int n) : free_at_(n, 0.0) {}

  void Run(double duration) {
    std::pop_heap(free_at_.begin(), free_at_.end(), std::greater<double>());
    free_at_.back() += duration;
    makespan_ = std::max(makespan_, free_at_.back());
    std::push_heap(free_at_.begin(), free_at_.end(), std::greater<double>());
  }
  double makespan() const { return makespan_; }

 private:
  std::vector<double> free_at_;  // a min-heap of the slots' end times
  double makespan_ = 0;
};

// The share of cta_slots x makespan the unsplit tiles keep busy: each tile's CTAs (one per KV
// head) go longest first to the slot that frees up first, each lasting its visible keys.
double UnsplitFill(const PlanConfig& c, std::vector<Tile> tiles) {
  std::stable_sort(tiles.begin(), tiles.end(),
                   [](const Tile& a, const Tile& b) { return a.visible > b.visible; });
  Slots slots(c.cta_slots);
  double busy = 0;
  for (const Tile& t : tiles) {
    for (int h = 0; h < c.num_kv_heads; ++h) {
      slots.Run(t.visible);
      busy += t.visible;
    }
  }
  return slots.makespan() == 0 ? 1.0 : busy / (c.cta_slots * slots.makespan());
}

// Keys per chunk, or 0 to leave every sequence whole.
int ChooseChunkLen(const PlanConfig& c, const std::vector<Tile>& tiles, const int32_t* q_lens,
                   const int32_t* kv_lens, int batch_size) {
  const double unsplit_ctas = static_cast<double>(tiles.size()) * c.num_kv_heads;
  if (unsplit_ctas >= c.cta_slots * c.waves_before_split) return 0;
  const double no_split_fill = unsplit_ctas <= c.cta_slots && c.no_split_fill_one_wave > 0
                                   ? c.no_split_fill_one_wave
                                   : c.no_split_fill;
  if (no_split_fill > 0 && UnsplitFill(c, tiles) >= no_split_fill) return 0;
  int64_t work = 0;
  int max_visible = 0;
  for (const Tile& t : tiles) {
    work += t.visible;
    max_visible = std::max(max_visible, t.visible);
  }
  const double target_items = c.cta_slots * c.target_waves / c.num_kv_heads;
  int64_t chunk =
      CeilDiv(static_cast<int64_t>(std::ceil(work / target_items)), c.block_n) * c.block_n;
  chunk = std::max<int64_t>(chunk, CeilDiv(c.min_chunk_len, c.block_n) * c.block_n);
  // Wider chunks until the partials fit the workspace and no token has too many chunks.
  while (chunk < max_visible && (PartialRows(c, q_lens, kv_lens, batch_size,
                                             static_cast<int>(chunk)) > c.max_partial_rows ||
                                 CeilDiv(max_visible, chunk) > kMaxSplits)) {
    chunk *= 2;
  }
  return chunk < max_visible ? static_cast<int>(chunk) : 0;
}

// The sequences in the order of their longest item, each one's items longest first, by `longest`
// (a sequence's most keys in one item). So the tail of the launch is made of short items, and the
// CTAs that run side by side are mostly one sequence's (its key tiles stay in L2 for all its
// query tiles). Sorting the items alone interleaved the sequences: 8 x 512 on 1024 (40/10 heads)
// read every sequence's K/V once per query tile from DRAM (L2 hit rate 33%, 2.2 TB/s).
struct LongestFirst {
  const std::vector<int32_t>& longest;
  bool operator()(int seq_a, int keys_a, int seq_b, int keys_b) const {
    if (longest[seq_a] != longest[seq_b]) return longest[seq_a] > longest[seq_b];
    if (seq_a != seq_b) return seq_a < seq_b;
    return keys_a > keys_b;
  }
};

// A split for a kernel that merges in clusters of n CTAs: each row tile in n consecutive items of
// about equal length (whole key tiles; the last ones may be empty), the tiles longest first by
// sequence.
AttentionPlan PlanClusters(const PlanConfig& c, std::vector<Tile> tiles, int batch_size, int n) {
  AttentionPlan plan;
  plan.cluster_splits = n;
  std::vector<int32_t> longest(batch_size, 0);
  for (const Tile& t : tiles) longest[t.seq] = std::max(longest[t.seq], t.visible);
  const LongestFirst order{longest};
  std::stable_sort(tiles.begin(), tiles.end(), [&order](const Tile& a, const Tile& b) {
    return order(a.seq, a.visible, b.seq, b.visible);
  });
  for (const Tile& t : tiles) {
    const int chunk = static_cast<int>(CeilDiv(CeilDiv(t.visible, n), c.block_n) * c.block_n);
    plan.chunk_len = std::max(plan.chunk_len, chunk);
    for (int s = 0; s < n; ++s) {
      const int begin = std::min(s * chunk, t.visible);
      plan.items.push_back({t.seq, t.row_begin, begin, std::min(begin + chunk, t.visible), -1});
    }
  }
  return plan;
}

// The items of a plan that cuts every sequence into chunks of chunk_len keys (0: none), chunk-major
// within a sequence, so CTAs that run side by side read the same keys (L2), and then its merges;
// the sequences longest first (LongestFirst).
AttentionPlan PlanChunks(const PlanConfig& c, const std::vector<Tile>& tiles, const int32_t* q_lens,
                         const int32_t* kv_lens, int batch_size, int chunk_len) {
  AttentionPlan plan;
  plan.chunk_len = chunk_len;
  int32_t q_begin = 0;
  size_t t = 0;
  for (int b = 0; b < batch_size; ++b) {
    const size_t first_tile = t;
    while (t < tiles.size() && tiles[t].seq == b) ++t;
    const int splits = chunk_len ? static_cast<int>(CeilDiv(kv_lens[b], chunk_len)) : 1;
    if (splits <= 1) {
      for (size_t i = first_tile; i < t; ++i) {
        plan.items.push_back({b, tiles[i].row_begin, 0, tiles[i].visible, -1});
      }
    } else {
      const int32_t base = static_cast<int32_t>(plan.partial_rows);
      const int32_t stride = q_lens[b] * c.num_qo_heads;
      for (int s = 0; s < splits; ++s) {
        const int begin = s * chunk_len;
        for (size_t i = first_tile; i < t; ++i) {
          if (tiles[i].visible <= begin) continue;  // no row of the tile sees this chunk
          plan.items.push_back({b, tiles[i].row_begin, begin,
                                std::min(begin + chunk_len, tiles[i].visible), base + s * stride});
        }
      }
      for (int i = 0; i < q_lens[b]; ++i) {
        const int visible = VisibleKeys(q_lens[b], kv_lens[b], i, c.causal);
        const int splits_seen = static_cast<int>(CeilDiv(visible, chunk_len));
        plan.merges.push_back({q_begin + i, base + i * c.num_qo_heads, stride, splits_seen});
        plan.max_splits = std::max(plan.max_splits, splits_seen);
      }
      plan.partial_rows += int64_t{splits} * stride;
    }
    q_begin += q_lens[b];
  }
  std::vector<int32_t> longest(batch_size, 0);
  for (const WorkItem& w : plan.items) {
    longest[w.seq] = std::max(longest[w.seq], w.kv_end - w.kv_begin);
  }
  const LongestFirst order{longest};
  std::stable_sort(plan.items.begin(), plan.items.end(),
                   [&order](const WorkItem& a, const WorkItem& b) {
                     return order(a.seq, a.kv_end - a.kv_begin, b.seq, b.kv_end - b.kv_begin);
                   });
  return plan;
}

// A plan's time under PlanConfig's cost model (cta_start_keys, merge_keys, merge_keys_per_row):
// its CTAs in launch order on the CTA slots, each lasting its keys plus a start, then the merge.
double ModeledTime(const PlanConfig& c, const AttentionPlan& plan) {
  Slots slots(c.cta_slots);
  for (const WorkItem& w : plan.items) {
    for (int h = 0; h < c.num_kv_heads; ++h) slots.Run(w.kv_end - w.kv_begin + c.cta_start_keys);
  }
  if (plan.merges.empty()) return slots.makespan();
  return slots.makespan() + c.merge_keys +
         c.merge_keys_per_row * static_cast<double>(plan.partial_rows);
}

// Most waves of CTAs a modeled split may have: past a few waves more chunks shorten no slot's
// work, and the merge only grows.
constexpr int kMaxModeledWaves = 8;

// The plan PlanConfig's cost model chooses: the whole plan, or the fastest of those that cut
// sequences into chunks of about max_visible / n keys, n = 2, 3, ... Each candidate has a bound
// from its totals, which its modeled time cannot beat: its CTAs' keys and starts spread over
// every slot, or its longest CTA, whichever is longer, plus its merge. Candidates are built and
// timed in the order of their bounds until the next bound reaches the best time (of equal times,
// the one of fewer chunks is kept).
AttentionPlan PlanByCost(const PlanConfig& c, const std::vector<Tile>& tiles, const int32_t* q_lens,
                         const int32_t* kv_lens, int batch_size) {
  int max_visible = 0;
  double keys = 0;
  for (const Tile& t : tiles) {
    max_visible = std::max(max_visible, t.visible);
    keys += t.visible;
  }
  AttentionPlan best = PlanChunks(c, tiles, q_lens, kv_lens, batch_size, 0);
  double best_time = ModeledTime(c, best);
  struct Candidate {
    double bound;
    int chunk;
  };
  std::vector<Candidate> candidates;
  const int64_t min_chunk = std::max<int64_t>(CeilDiv(c.min_chunk_len, c.block_n), 1) * c.block_n;
  const int64_t max_ctas = int64_t{kMaxModeledWaves} * c.cta_slots;
  int64_t last_chunk = max_visible;
  for (int n = 2; n <= kMaxSplits; ++n) {
    const int64_t chunk = CeilDiv(CeilDiv(max_visible, n), c.block_n) * c.block_n;
    if (chunk < min_chunk) break;
    if (chunk >= last_chunk) continue;  // the same whole key tiles as n - 1's
    last_chunk = chunk;
    int64_t ctas = 0;
    for (const Tile& t : tiles) ctas += CeilDiv(t.visible, chunk);
    ctas *= c.num_kv_heads;
    const int64_t partial_rows =
        PartialRows(c, q_lens, kv_lens, batch_size, static_cast<int>(chunk));
    // Narrower chunks only make more CTAs and partial rows.
    if (ctas > max_ctas || partial_rows > c.max_partial_rows) break;
    const double spread =
        (keys * c.num_kv_heads + static_cast<double>(ctas) * c.cta_start_keys) / c.cta_slots;
    const double merge = c.merge_keys + c.merge_keys_per_row * static_cast<double>(partial_rows);
    // The spread and the merge only grow with n: no later candidate beats the whole plan.
    if (spread + merge >= best_time) break;
    const double bound = std::max(spread, static_cast<double>(chunk) + c.cta_start_keys) + merge;
    candidates.push_back({bound, static_cast<int>(chunk)});
  }
  // Lowest bound first; of equal bounds, longer chunks (fewer of them) first.
  std::sort(candidates.begin(), candidates.end(), [](const Candidate& a, const Candidate& b) {
    return a.bound != b.bound ? a.bound < b.bound : a.chunk > b.chunk;
  });
  for (const Candidate& candidate : candidates) {
    if (candidate.bound >= best_time) break;
    AttentionPlan plan = PlanChunks(c, tiles, q_lens, kv_lens, batch_size, candidate.chunk);
    const double time = ModeledTime(c, plan);
    if (time < best_time ||
        (time == best_time && candidate.chunk > best.chunk_len && best.chunk_len > 0)) {
      best_time = time;
      best = std::move(plan);
    }
  }
  return best;
}

}  // namespace

AttentionPlan PlanAttention(const PlanConfig& c, const int32_t* q_lens, const int32_t* kv_lens,
                            int batch_size) {
  std::vector<Tile> tiles = MakeTiles(c, q_lens, kv_lens, batch_size);
  if (c.cta_start_keys > 0) return PlanByCost(c, tiles, q_lens, kv_lens, batch_size);
  const int chunk_len = ChooseChunkLen(c, tiles, q_lens, kv_lens, batch_size);
  if (chunk_len > 0 && c.cluster_splits > 1) {
    int max_visible = 0;
    for (const Tile& t : tiles) max_visible = std::max(max_visible, t.visible);
    const int splits = static_cast<int>(CeilDiv(max_visible, chunk_len));
    if (splits <= c.cluster_splits) return PlanClusters(c, std::move(tiles), batch_size, splits);
  }
  return PlanChunks(c, tiles, q_lens, kv_lens, batch_size, chunk_len);
}

}  // namespace attn
