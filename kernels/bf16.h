// bfloat16 storage type shared by host and device code, and host conversions.
// Same size, alignment and bits as CUDA's __nv_bfloat16, so device code reinterprets pointers.
#pragma once

#include <cstdint>
#include <cstring>

namespace attn {

struct bf16 {
  uint16_t bits;
};
static_assert(sizeof(bf16) == 2 && alignof(bf16) == 2);

inline float Bf16ToFloat(bf16 x) {
  const uint32_t u = uint32_t{x.bits} << 16;
  float f;
  std::memcpy(&f, &u, sizeof(f));
  return f;
}

// Round to nearest even; NaN stays a (quiet) NaN.
inline bf16 FloatToBf16(float f) {
  uint32_t u;
  std::memcpy(&u, &f, sizeof(u));
  if ((u & 0x7fffffffu) > 0x7f800000u) return bf16{static_cast<uint16_t>((u >> 16) | 0x40)};
  u += 0x7fffu + ((u >> 16) & 1u);
  return bf16{static_cast<uint16_t>(u >> 16)};
}

inline constexpr bf16 kBf16QuietNan{0x7fc0};

}  // namespace attn
