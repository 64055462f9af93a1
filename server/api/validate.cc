#include "server/api/validate.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <string>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "server/engine/status_macros.h"

namespace attn {
namespace {

struct Dim {
  int64_t size;
  const char* name;
};

// At most kMaxShownDims dimensions: the shape is the client's, and an error message as long as
// the request would not fit gRPC's metadata limits (the client would get RESOURCE_EXHAUSTED
// without the reason).
constexpr size_t kMaxShownDims = 8;
std::string ShapeString(absl::Span<const int64_t> shape) {
  if (shape.size() <= kMaxShownDims) return absl::StrCat("[", absl::StrJoin(shape, ", "), "]");
  return absl::StrCat("[", absl::StrJoin(shape.first(kMaxShownDims), ", "), ", ... (",
                      shape.size(), " dimensions)]");
}

std::string ExpectedString(absl::Span<const Dim> dims) {
  std::vector<std::string> sizes, names;
  for (const Dim& d : dims) {
    sizes.push_back(absl::StrCat(d.size));
    names.push_back(d.name);
  }
  return absl::StrCat("[", absl::StrJoin(sizes, ", "), "] ([", absl::StrJoin(names, ", "), "])");
}

// Checks dtype, shape and byte count of a bf16 tensor and returns its data.
absl::StatusOr<const bf16*> Bf16Tensor(const v1::Tensor& t, const char* field,
                                       absl::Span<const Dim> dims) {
  if (t.dtype() != v1::DTYPE_BF16) {
    return absl::InvalidArgumentError(absl::StrCat(
        field, ": dtype ", v1::DType_Name(t.dtype()), " is not supported; send DTYPE_BF16"));
  }
  bool same = t.shape_size() == static_cast<int>(dims.size());
  for (int i = 0; same && i < t.shape_size(); ++i) same = t.shape(i) == dims[i].size;
  if (!same) {
    return absl::InvalidArgumentError(absl::StrCat(field, ": shape ", ShapeString(t.shape()),
                                                   " does not match ", ExpectedString(dims)));
  }
  int64_t elements = 1;
  for (const Dim& d : dims) elements *= d.size;  // dims are bounded: no overflow
  if (static_cast<int64_t>(t.data().size()) != elements * int64_t{sizeof(bf16)}) {
    return absl::InvalidArgumentError(absl::StrCat(field, ": data has ", t.data().size(),
                                                   " bytes, shape ", ShapeString(t.shape()),
                                                   " needs ", elements * sizeof(bf16)));
  }
  // Protobuf's string storage is heap- or object-aligned, which satisfies bf16's 2 bytes.
  return reinterpret_cast<const bf16*>(t.data().data());
}

// A per-token tensor: `rows` tokens of the pool's row shape `row`.
absl::StatusOr<const bf16*> Bf16Rows(const v1::Tensor& t, const char* field, int64_t rows,
                                     const RowShape& row) {
  const Dim tokens{rows, "total_q"}, heads{row.heads, row.heads_name}, dim{row.dim, row.dim_name};
  if (row.heads == 0) return Bf16Tensor(t, field, {tokens, dim});
  return Bf16Tensor(t, field, {tokens, heads, dim});
}

// indptr[0] == 0, non-decreasing, indptr.back() == last.
absl::Status CheckIndptr(absl::Span<const int32_t> indptr, const char* field, int64_t last,
                         const char* last_name) {
  if (indptr[0] != 0) {
    return absl::InvalidArgumentError(absl::StrCat(field, "[0] = ", indptr[0], " must be 0"));
  }
  for (size_t i = 1; i < indptr.size(); ++i) {
    if (indptr[i] < indptr[i - 1]) {
      return absl::InvalidArgumentError(absl::StrCat(field, "[", i, "] = ", indptr[i],
                                                     " is less than ", field, "[", i - 1,
                                                     "] = ", indptr[i - 1]));
    }
  }
  if (indptr.back() != last) {
    return absl::InvalidArgumentError(absl::StrCat(field, "[", indptr.size() - 1, "] = ",
                                                   indptr.back(), " must equal ", last_name,
                                                   " = ", last));
  }
  return absl::OkStatus();
}

// A sequence cannot hold more tokens than the pool has slots. Without this bound a page table that
// names one page millions of times (a few bytes per entry on the wire) overflows the int32 kv_len
// of the kernels and asks for attention over billions of keys.
absl::Status CheckPagesPerSequence(absl::Span<const int32_t> kv_indptr, const PoolGeometry& pool) {
  const int64_t max_pages = std::min<int64_t>(
      pool.num_pages, std::numeric_limits<int32_t>::max() / std::max(pool.page_size, 1));
  for (size_t b = 0; b + 1 < kv_indptr.size(); ++b) {
    const int64_t pages = int64_t{kv_indptr[b + 1]} - kv_indptr[b];
    if (pages > max_pages) {
      return absl::InvalidArgumentError(absl::StrCat(
          "kv_indptr: sequence ", b, " has ", pages, " pages; a sequence may have at most ",
          max_pages, max_pages == pool.num_pages ? " (the pool's num_pages)" : " (int32 kv_len)"));
    }
  }
  return absl::OkStatus();
}

// Normalizes kv_last_page_len to batch entries (0 for sequences without pages) and checks that
// every sequence with pages has 1..page_size tokens in its last page.
absl::StatusOr<std::vector<int32_t>> LastPageLens(absl::Span<const int32_t> given,
                                                  absl::Span<const int32_t> kv_indptr,
                                                  int batch, int page_size) {
  const bool implicit = given.empty() && page_size == 1;
  if (!implicit && given.size() != static_cast<size_t>(batch) &&
      given.size() != static_cast<size_t>(batch) + 1) {
    return absl::InvalidArgumentError(
        absl::StrCat("kv_last_page_len has ", given.size(), " entries; the batch has ", batch,
                     " sequences (send batch or batch + 1 entries; empty only for page_size 1)"));
  }
  std::vector<int32_t> lens(batch);
  for (int b = 0; b < batch; ++b) {
    const bool has_pages = kv_indptr[b + 1] > kv_indptr[b];
    const int32_t v = implicit ? 1 : given[b];
    const int32_t lo = has_pages ? 1 : 0;
    if (v < lo || v > page_size) {
      return absl::InvalidArgumentError(
          absl::StrCat("kv_last_page_len[", b, "] = ", v, " is outside [", lo, ", ", page_size,
                       "]", has_pages ? "" : " (sequence without pages)"));
    }
    lens[b] = has_pages ? v : 0;
  }
  return lens;
}

// The fields Prefill and Decode share, read from either request type.
template <typename Request>
absl::Status ValidateCommon(const Request& req, const PoolGeometry& pool, AttentionCall& call) {
  if (req.layer() < 0 || req.layer() >= pool.num_layers) {
    return absl::InvalidArgumentError(absl::StrCat("layer = ", req.layer(), " is outside [0, ",
                                                   pool.num_layers, ")"));
  }
  call.layer = req.layer();

  const int batch = call.batch_size;
  call.kv_indptr = absl::MakeConstSpan(req.kv_indptr());
  call.kv_indices = absl::MakeConstSpan(req.kv_indices());
  if (call.kv_indptr.size() != static_cast<size_t>(batch) + 1) {
    return absl::InvalidArgumentError(absl::StrCat("kv_indptr has ", call.kv_indptr.size(),
                                                   " entries, expected batch + 1 = ", batch + 1));
  }
  ATTN_RETURN_IF_ERROR(CheckIndptr(call.kv_indptr, "kv_indptr",
                              static_cast<int64_t>(call.kv_indices.size()), "len(kv_indices)"));
  ATTN_RETURN_IF_ERROR(CheckPagesPerSequence(call.kv_indptr, pool));
  ATTN_ASSIGN_OR_RETURN(call.kv_last_page_len, LastPageLens(absl::MakeConstSpan(req.kv_last_page_len()),
                                                       call.kv_indptr, batch, pool.page_size));

  const int64_t tq = call.total_q;
  const RowShapes& rows = pool.rows();
  ATTN_ASSIGN_OR_RETURN(call.q, Bf16Rows(req.q(), "q", tq, rows.q));
  if (pool.kind == PoolKind::kGqa) {
    if (req.has_q_pe() || req.has_ckv_new() || req.has_kpe_new()) {
      return absl::InvalidArgumentError(
          "q_pe, ckv_new and kpe_new are MLA fields; this pool is GQA");
    }
    if (req.has_k_new() != req.has_v_new()) {
      return absl::InvalidArgumentError("k_new and v_new must be sent together");
    }
    if (req.has_k_new()) {
      ATTN_ASSIGN_OR_RETURN(call.k_new, Bf16Rows(req.k_new(), "k_new", tq, rows.k_new));
      ATTN_ASSIGN_OR_RETURN(call.v_new, Bf16Rows(req.v_new(), "v_new", tq, rows.v_new));
    }
  } else {
    ATTN_ASSIGN_OR_RETURN(call.q_pe, Bf16Rows(req.q_pe(), "q_pe", tq, rows.q_pe));
    if (req.has_k_new() || req.has_v_new()) {
      return absl::InvalidArgumentError("k_new and v_new are GQA fields; this pool is MLA");
    }
    if (req.has_ckv_new() != req.has_kpe_new()) {
      return absl::InvalidArgumentError("ckv_new and kpe_new must be sent together");
    }
    if (req.has_ckv_new()) {
      ATTN_ASSIGN_OR_RETURN(call.k_new, Bf16Rows(req.ckv_new(), "ckv_new", tq, rows.k_new));
      ATTN_ASSIGN_OR_RETURN(call.v_new, Bf16Rows(req.kpe_new(), "kpe_new", tq, rows.v_new));
    }
  }

  if (req.has_sm_scale()) {
    if (!std::isfinite(req.sm_scale())) {
      return absl::InvalidArgumentError(
          absl::StrCat("sm_scale = ", req.sm_scale(), " must be finite"));
    }
    call.sm_scale = req.sm_scale();
  } else if (pool.kind == PoolKind::kGqa) {
    call.sm_scale = 1.0f / std::sqrt(static_cast<float>(pool.head_dim));
  } else {
    return absl::InvalidArgumentError(
        "sm_scale is required for MLA pools (e.g. 0.1352337747812271 for DeepSeek-V3)");
  }
  call.return_lse = req.return_lse();

  // Appended rows take the last q_len positions of each sequence, so they must fit in kv_len,
  // and the pages they land in belong to that sequence alone (two writers of one page would
  // race on the device).
  if (call.appends()) {
    const PagedBatch view{batch, call.total_q,
                          call.qo_indptr.empty() ? nullptr : call.qo_indptr.data(),
                          call.kv_indptr.data(), nullptr, call.kv_last_page_len.data(), nullptr};
    absl::flat_hash_map<int32_t, int> writer;  // page -> the sequence appending to it
    for (int b = 0; b < batch; ++b) {
      const SeqExtent e = GetSeqExtent(view, pool.page_size, b);
      if (e.q_len > e.kv_len) {
        return absl::InvalidArgumentError(
            absl::StrCat("sequence ", b, " appends ", e.q_len, " tokens but its page table holds ",
                         e.kv_len, "; the page table must include the appended tokens"));
      }
      if (e.q_len == 0) continue;
      for (int i = (e.kv_len - e.q_len) / pool.page_size; i <= (e.kv_len - 1) / pool.page_size;
           ++i) {
        const int32_t page = call.kv_indices[e.page_begin + i];
        const auto [it, inserted] = writer.try_emplace(page, b);
        if (!inserted) {
          return absl::InvalidArgumentError(
              it->second == b
                  ? absl::StrCat("sequence ", b, " appends to page ", page,
                                 " at two positions (its page table lists the page twice)")
                  : absl::StrCat("sequences ", it->second, " and ", b, " both append to page ",
                                 page, "; appended rows must go to pages of their own sequence"));
        }
        call.append_pages.push_back(AppendKey(page, call.layer));
      }
    }
  }
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<AttentionCall> ValidatePrefill(const v1::PrefillRequest& req,
                                              const PoolGeometry& pool) {
  AttentionCall call;
  call.op = Op::kPrefill;
  call.qo_indptr = absl::MakeConstSpan(req.qo_indptr());
  if (call.qo_indptr.size() < 2 || call.qo_indptr.size() > kMaxCallTokens + 1u) {
    return absl::InvalidArgumentError(absl::StrCat("qo_indptr has ", call.qo_indptr.size(),
                                                   " entries; send batch + 1 with batch in [1, ",
                                                   kMaxCallTokens, "]"));
  }
  call.batch_size = static_cast<int>(call.qo_indptr.size()) - 1;
  call.total_q = call.qo_indptr.back();
  if (call.total_q < 0 || call.total_q > kMaxCallTokens) {
    return absl::InvalidArgumentError(absl::StrCat("total_q = qo_indptr[batch] = ", call.total_q,
                                                   " is outside [0, ", kMaxCallTokens, "]"));
  }
  ATTN_RETURN_IF_ERROR(CheckIndptr(call.qo_indptr, "qo_indptr", call.total_q, "total_q"));
  ATTN_RETURN_IF_ERROR(ValidateCommon(req, pool, call));
  return call;
}

absl::StatusOr<AttentionCall> ValidateDecode(const v1::DecodeRequest& req,
                                             const PoolGeometry& pool) {
  AttentionCall call;
  call.op = Op::kDecode;
  const int64_t batch = static_cast<int64_t>(req.kv_indptr_size()) - 1;
  if (batch < 1 || batch > kMaxCallTokens) {
    return absl::InvalidArgumentError(absl::StrCat("kv_indptr has ", req.kv_indptr_size(),
                                                   " entries; send batch + 1 with batch in [1, ",
                                                   kMaxCallTokens, "]"));
  }
  call.batch_size = static_cast<int>(batch);
  call.total_q = call.batch_size;
  ATTN_RETURN_IF_ERROR(ValidateCommon(req, pool, call));
  return call;
}

}  // namespace attn
