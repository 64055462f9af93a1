// For tests and fuzzers that build requests by hand: a bf16 Tensor message of one value.
#pragma once

#include <cstdint>
#include <vector>

#include "attnserve/v1/attention.pb.h"
#include "kernels/bf16.h"

namespace attn {

// `t` becomes a bf16 tensor of `shape` with every element `value` (rounded to bf16).
inline void FillBf16(attnserve::v1::Tensor* t, const std::vector<int64_t>& shape, float value) {
  t->set_dtype(attnserve::v1::DTYPE_BF16);
  t->clear_shape();
  int64_t n = 1;
  for (int64_t d : shape) {
    t->add_shape(d);
    n *= d;
  }
  const std::vector<bf16> data(n, FloatToBf16(value));
  t->set_data(reinterpret_cast<const char*>(data.data()), data.size() * sizeof(bf16));
}

}  // namespace attn
