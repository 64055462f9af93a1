#include "server/api/pool_config.h"

#include <limits>

#include "absl/strings/str_cat.h"

namespace attn {
namespace {

constexpr int kMaxHeads = 256;
constexpr int kMaxPageSize = 1024;
constexpr int kMaxLayers = 1024;

bool ValidName(const std::string& name) {
  if (name.empty() || name.size() > 64) return false;
  for (char c : name) {
    const bool ok = (c >= 'a' && c <= 'z') || (c >= '0' && c <= '9') || c == '_' || c == '-';
    if (!ok) return false;
  }
  return true;
}

absl::Status RangeError(const std::string& pool, const char* field, int64_t value, int64_t lo,
                        int64_t hi) {
  return absl::InvalidArgumentError(absl::StrCat("pool '", pool, "': ", field, " = ", value,
                                                 " is outside [", lo, ", ", hi, "]"));
}

}  // namespace

absl::StatusOr<PoolGeometry> GeometryFromConfig(const v1::PoolConfig& c) {
  const std::string& name = c.name();
  if (!ValidName(name)) {
    return absl::InvalidArgumentError(
        absl::StrCat("pool name '", name, "' must be 1-64 characters of [a-z0-9_-]"));
  }
  if (c.num_layers() < 1 || c.num_layers() > kMaxLayers) {
    return RangeError(name, "num_layers", c.num_layers(), 1, kMaxLayers);
  }
  if (c.page_size() < 1 || c.page_size() > kMaxPageSize) {
    return RangeError(name, "page_size", c.page_size(), 1, kMaxPageSize);
  }
  if (c.num_qo_heads() < 1 || c.num_qo_heads() > kMaxHeads) {
    return RangeError(name, "num_qo_heads", c.num_qo_heads(), 1, kMaxHeads);
  }
  // num_pages is set below: with capacity_bytes it follows from the page size.
  PoolGeometry g;
  switch (c.kind()) {
    case v1::POOL_KIND_GQA:
      if (c.num_kv_heads() < 1 || c.num_qo_heads() % c.num_kv_heads() != 0) {
        return absl::InvalidArgumentError(
            absl::StrCat("pool '", name, "': num_kv_heads = ", c.num_kv_heads(),
                         " must be positive and divide num_qo_heads = ", c.num_qo_heads()));
      }
      if (c.head_dim() != 64 && c.head_dim() != 128 && c.head_dim() != 256) {
        return absl::InvalidArgumentError(absl::StrCat(
            "pool '", name, "': head_dim = ", c.head_dim(), " is not one of 64, 128, 256"));
      }
      g = PoolGeometry::Gqa(name, c.num_layers(), c.page_size(), c.num_qo_heads(), c.num_kv_heads(),
                            c.head_dim(), /*num_pages=*/0);
      break;
    case v1::POOL_KIND_MLA:
      g = PoolGeometry::Mla(name, c.num_layers(), c.page_size(), c.num_qo_heads(),
                            /*num_pages=*/0);
      break;
    default:
      return absl::InvalidArgumentError(
          absl::StrCat("pool '", name, "': kind must be POOL_KIND_GQA or POOL_KIND_MLA"));
  }
  if ((c.num_pages() > 0) == (c.capacity_bytes() > 0)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "pool '", name, "': set exactly one of num_pages and capacity_bytes (both positive)"));
  }
  const int64_t pages =
      c.num_pages() > 0 ? int64_t{c.num_pages()} : c.capacity_bytes() / g.BytesPerPage();
  constexpr int64_t kMaxPages = std::numeric_limits<int32_t>::max();
  if (pages < 1 || pages > kMaxPages) return RangeError(name, "num_pages", pages, 1, kMaxPages);
  g.num_pages = static_cast<int>(pages);
  return g;
}

v1::PoolInfo ToPoolInfo(const PoolGeometry& g) {
  v1::PoolInfo info;
  info.set_name(g.name);
  info.set_kind(g.kind == PoolKind::kGqa ? v1::POOL_KIND_GQA : v1::POOL_KIND_MLA);
  info.set_num_layers(g.num_layers);
  info.set_page_size(g.page_size);
  info.set_num_qo_heads(g.num_qo_heads);
  info.set_num_kv_heads(g.num_kv_heads);
  if (g.kind == PoolKind::kGqa) {
    info.set_head_dim(g.head_dim);
  } else {
    info.set_ckv_dim(kMlaCkvDim);
    info.set_kpe_dim(kMlaKpeDim);
  }
  info.set_kv_dtype(v1::DTYPE_BF16);
  info.set_total_pages(g.num_pages);
  info.set_bytes_per_page(g.BytesPerPage());
  return info;
}

}  // namespace attn
