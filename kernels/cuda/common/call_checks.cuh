// Device side of CallChecks (kernels/cuda/api.h): which call of a merged launch a query row is.
#pragma once

#include "kernels/cuda/api.h"

namespace attn::cuda {

// The call of query row `row`: the last c with checks.rows[c] <= row (a launch merges at most a
// few hundred calls, so a binary search of the row offsets is a handful of loads).
__device__ __forceinline__ int CallOfRow(const CallChecks& checks, int row) {
  int lo = 0, hi = checks.num_calls - 1;
  while (lo < hi) {
    const int mid = (lo + hi + 1) / 2;
    if (checks.rows[mid] <= row) {
      lo = mid;
    } else {
      hi = mid - 1;
    }
  }
  return lo;
}

}  // namespace attn::cuda
