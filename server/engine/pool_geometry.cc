#include "server/engine/pool_geometry.h"

namespace attn {

int64_t PoolGeometry::ElementsPerToken() const {
  return kind == PoolKind::kGqa ? 2 * int64_t{num_kv_heads} * head_dim : kMlaTokenDim;
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
