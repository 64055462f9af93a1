// Error propagation for host code that launches kernels: every CUDA call's result is checked and
// returned (kernels never exit or throw).
#pragma once

#include <cuda_runtime_api.h>

// Returns the cudaError_t of `expr` from the enclosing function when it is not cudaSuccess.
#define ATTN_CUDA_RETURN_IF_ERROR(expr)      \
  do {                                       \
    const cudaError_t _attn_err = (expr);    \
    if (_attn_err != cudaSuccess) {          \
      return _attn_err;                      \
    }                                        \
  } while (0)

// After a <<<...>>> launch: returns the launch error, if any, without synchronizing.
#define ATTN_CUDA_RETURN_IF_LAUNCH_FAILED() ATTN_CUDA_RETURN_IF_ERROR(cudaGetLastError())
