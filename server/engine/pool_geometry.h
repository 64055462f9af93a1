// Geometry of a KV page pool, the per-token row shapes of its calls, and the kernel cache views
// over its storage (no protobuf here: server/api/pool_config.h turns a configured pool into a
// geometry).
#pragma once

#include <algorithm>
#include <cstdint>
#include <string>

#include "kernels/attention.h"

namespace attn {

enum class PoolKind { kGqa, kMla };

// The shape of one token's row of a per-token tensor: [heads, dim], or [dim] when heads is 0
// (MLA's ckv and kpe rows, which every head shares). The names are the ones PoolInfo and error
// messages give the two axes. A row that a pool's calls do not carry has dim 0.
struct RowShape {
  int heads = 0;  // 0: no head axis
  int dim = 0;
  const char* heads_name = "";
  const char* dim_name = "";

  bool present() const { return dim > 0; }
  int64_t elements() const { return int64_t{std::max(heads, 1)} * dim; }
};

// What one token of a call carries in each tensor (bf16 unless noted), so that validation, the
// RPC edge and the backends agree on one set of widths.
//   GQA: q and out [H, D]; k_new, v_new [H_kv, D]; no q_pe.
//   MLA: q (q_nope) and out [H, 512]; q_pe [H, 64]; k_new (ckv) [512]; v_new (kpe) [64].
struct RowShapes {
  RowShape q, q_pe, k_new, v_new, out;
  int lse = 0;  // float32 per token: one per query head
};

// Build geometries with Gqa() or Mla(): they derive the row shapes, which then stay as they are
// (a pool never changes shape; do not edit kind, heads or head_dim of a built geometry).
struct PoolGeometry {
  static PoolGeometry Gqa(std::string name, int num_layers, int page_size, int num_qo_heads,
                          int num_kv_heads, int head_dim, int num_pages);
  static PoolGeometry Mla(std::string name, int num_layers, int page_size, int num_heads,
                          int num_pages);
  PoolGeometry() = default;  // an empty pool (no rows); assign a built one

  std::string name;
  PoolKind kind = PoolKind::kGqa;
  int num_layers = 0;
  int page_size = 0;
  int num_qo_heads = 0;
  int num_kv_heads = 0;  // GQA; 1 for MLA
  int head_dim = 0;      // GQA; 0 for MLA
  int num_pages = 0;

  const RowShapes& rows() const { return rows_; }

  // bf16 elements one token occupies in one layer: K and V (GQA) or ckv and kpe (MLA).
  int64_t ElementsPerToken() const;
  int64_t BytesPerPage() const;  // all layers
  int64_t TotalBytes() const { return BytesPerPage() * num_pages; }

  GqaCache GqaView(bf16* data) const;
  MlaCache MlaView(bf16* data) const;

 private:
  PoolGeometry(std::string name, PoolKind kind, int num_layers, int page_size, int num_qo_heads,
               int num_kv_heads, int head_dim, int num_pages, RowShapes rows);

  RowShapes rows_;
};

}  // namespace attn
