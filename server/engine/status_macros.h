// Early-return helpers for absl::Status / absl::StatusOr.
#pragma once

#include "absl/status/status.h"
#include "absl/status/statusor.h"

#define ATTN_CONCAT_INNER(a, b) a##b
#define ATTN_CONCAT(a, b) ATTN_CONCAT_INNER(a, b)

// Returns the status from the enclosing function when `expr` is not OK.
#define ATTN_RETURN_IF_ERROR(expr)                  \
  do {                                         \
    if (absl::Status _st = (expr); !_st.ok()) { \
      return _st;                              \
    }                                          \
  } while (0)

// `lhs = value of expr`, or returns the error status of `expr`.
#define ATTN_ASSIGN_OR_RETURN(lhs, expr) \
  ATTN_ASSIGN_OR_RETURN_IMPL(ATTN_CONCAT(_status_or_, __LINE__), lhs, expr)
#define ATTN_ASSIGN_OR_RETURN_IMPL(tmp, lhs, expr) \
  auto tmp = (expr);                               \
  if (!tmp.ok()) return std::move(tmp).status();   \
  lhs = std::move(tmp).value()
