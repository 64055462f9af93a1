// Geometry of a KV page pool, and the kernel cache views over its storage (no protobuf here:
// server/api/pool_config.h turns a configured pool into a geometry).
#pragma once

#include <cstdint>
#include <string>

#include "kernels/attention.h"

namespace attn {

enum class PoolKind { kGqa, kMla };

struct PoolGeometry {
  std::string name;
  PoolKind kind = PoolKind::kGqa;
  int num_layers = 0;
  int page_size = 0;
  int num_qo_heads = 0;
  int num_kv_heads = 0;  // GQA; 1 for MLA
  int head_dim = 0;      // GQA; 0 for MLA
  int num_pages = 0;

  // bf16 elements one token occupies in one layer: K and V (GQA) or ckv and kpe (MLA).
  int64_t ElementsPerToken() const;
  int64_t BytesPerPage() const;  // all layers
  int64_t TotalBytes() const { return BytesPerPage() * num_pages; }

  GqaCache GqaView(bf16* data) const;
  MlaCache MlaView(bf16* data) const;
};

}  // namespace attn
