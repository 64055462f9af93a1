#include "server/engine/pool_geometry.h"

#include <utility>

namespace attn {

PoolGeometry::PoolGeometry(std::string name, PoolKind kind, int num_layers, int page_size,
                           int num_qo_heads, int num_kv_heads, int head_dim, int num_pages,
                           RowShapes rows)
    : name(std::move(name)),
      kind(kind),
      num_layers(num_layers),
      page_size(page_size),
      num_qo_heads(num_qo_heads),
      num_kv_heads(num_kv_heads),
      head_dim(head_dim),
      num_pages(num_pages),
      rows_(rows) {}

PoolGeometry PoolGeometry::Gqa(std::string name, int num_layers, int page_size, int num_qo_heads,
                               int num_kv_heads, int head_dim, int num_pages) {
  const RowShape heads{num_qo_heads, head_dim, "num_qo_heads", "head_dim"};
  const RowShape kv{num_kv_heads, head_dim, "num_kv_heads", "head_dim"};
  return PoolGeometry(std::move(name), PoolKind::kGqa, num_layers, page_size, num_qo_heads,
                      num_kv_heads, head_dim, num_pages,
                      RowShapes{heads, RowShape{}, kv, kv, heads, num_qo_heads});
}

PoolGeometry PoolGeometry::Mla(std::string name, int num_layers, int page_size, int num_heads,
                               int num_pages) {
  const RowShape nope{num_heads, kMlaCkvDim, "num_qo_heads", "ckv_dim"};
  const RowShape pe{num_heads, kMlaKpeDim, "num_qo_heads", "kpe_dim"};
  // The appended ckv and kpe rows are the token's latent, shared by every head.
  const RowShape ckv{0, kMlaCkvDim, "", "ckv_dim"}, kpe{0, kMlaKpeDim, "", "kpe_dim"};
  return PoolGeometry(std::move(name), PoolKind::kMla, num_layers, page_size, num_heads,
                      /*num_kv_heads=*/1, /*head_dim=*/0, num_pages,
                      RowShapes{nope, pe, ckv, kpe, nope, num_heads});
}

int64_t PoolGeometry::ElementsPerToken() const {
  return rows_.k_new.elements() + rows_.v_new.elements();
}

int64_t PoolGeometry::BytesPerPage() const {
  return int64_t{num_layers} * page_size * ElementsPerToken() * int64_t{sizeof(bf16)};
}

GqaCache PoolGeometry::GqaView(bf16* data) const {
  return GqaCache{data, num_layers, num_pages, page_size, num_kv_heads, head_dim};
}

MlaCache PoolGeometry::MlaView(bf16* data) const {
  return MlaCache{data, num_layers, num_pages, page_size};
}

}  // namespace attn
