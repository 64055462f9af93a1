#include "server/api/validate.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <string>
#include <type_traits>
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
  return absl::StrCat("[", absl::StrJoin(shape.first(kMaxShownDims), ", "), ", ... (", shape.size(),
                      " dimensions)]");
}

std::string ExpectedString(absl::Span<const Dim> dims) {
  std::vector<std::string> sizes, names;
  for (const Dim& d : dims) {
    sizes.push_back(absl::StrCat(d.size));
    names.push_back(d.name);
  }
  return absl::StrCat("[", absl::StrJoin(sizes, ", "), "] ([", absl::StrJoin(names, ", "), "])");
}

// The region slices a request names, each filled into the input or output it belongs to once
// they are resolved (all of them at once: all or nothing).
class Slices {
 public:
  void Input(const v1::RegionSlice& at, int64_t bytes, std::string field, CallInput* in) {
    refs_.push_back({at.name(), at.offset(), bytes, std::move(field)});
    inputs_.push_back(in);
    outputs_.push_back(nullptr);
  }
  void Output(const v1::RegionSlice& at, int64_t bytes, std::string field, CallOutput* out) {
    refs_.push_back({at.name(), at.offset(), bytes, std::move(field)});
    inputs_.push_back(nullptr);
    outputs_.push_back(out);
  }
  bool empty() const { return refs_.empty(); }

  absl::StatusOr<RegionUse> Resolve(const RegionResolver& regions) {
    if (refs_.empty()) return RegionUse();
    if (!regions) {
      return absl::InvalidArgumentError(
          absl::StrCat(refs_[0].field, ": this server accepts no region references"));
    }
    ATTN_ASSIGN_OR_RETURN(RegionUse use, regions(refs_));
    for (size_t i = 0; i < refs_.size(); ++i) {
      const bool device = use.kind(i) == RegionKind::kCudaIpc;
      if (CallInput* in = inputs_[i]) {
        if (device) {
          in->device = use.data(i);
        } else {
          in->host = HostBytes(use.data(i), static_cast<size_t>(refs_[i].bytes));
          in->registered = true;
        }
      } else {
        (device ? outputs_[i]->device : outputs_[i]->host) = use.data(i);
      }
    }
    return use;
  }

 private:
  std::vector<SliceRef> refs_;
  std::vector<CallInput*> inputs_;
  std::vector<CallOutput*> outputs_;
};

// Checks dtype and shape of a bf16 tensor; returns its size in bytes.
absl::StatusOr<int64_t> Bf16Bytes(const v1::Tensor& t, const char* field,
                                  absl::Span<const Dim> dims) {
  if (t.dtype() != v1::DTYPE_BF16) {
    return absl::InvalidArgumentError(absl::StrCat(field, ": dtype ", v1::DType_Name(t.dtype()),
                                                   " is not supported; send DTYPE_BF16"));
  }
  bool same = t.shape_size() == static_cast<int>(dims.size());
  for (int i = 0; same && i < t.shape_size(); ++i) same = t.shape(i) == dims[i].size;
  if (!same) {
    return absl::InvalidArgumentError(absl::StrCat(field, ": shape ", ShapeString(t.shape()),
                                                   " does not match ", ExpectedString(dims)));
  }
  int64_t elements = 1;
  for (const Dim& d : dims) elements *= d.size;  // dims are bounded: no overflow
  return elements * int64_t{sizeof(bf16)};
}

// A per-token input: `rows` tokens of the pool's row shape `row`, its data in the message
// (`inline_data`) or in a region slice (added to `slices`).
absl::Status Bf16Rows(const v1::Tensor& t, const HostBytes& inline_data, const char* field,
                      int64_t rows, const RowShape& row, CallInput* in, Slices* slices) {
  const Dim tokens{rows, "total_q"}, heads{row.heads, row.heads_name}, dim{row.dim, row.dim_name};
  absl::StatusOr<int64_t> bytes = row.heads == 0 ? Bf16Bytes(t, field, {tokens, dim})
                                                 : Bf16Bytes(t, field, {tokens, heads, dim});
  if (!bytes.ok()) return bytes.status();
  in->present = true;
  in->bytes = static_cast<size_t>(*bytes);
  if (t.has_region()) {
    if (!inline_data.empty() || !t.data().empty()) {
      return absl::InvalidArgumentError(absl::StrCat(field, ": set data or region, not both"));
    }
    slices->Input(t.region(), *bytes, absl::StrCat(field, ".region"), in);
    return absl::OkStatus();
  }
  if (static_cast<int64_t>(inline_data.size()) != *bytes) {
    return absl::InvalidArgumentError(absl::StrCat(field, ": data has ", inline_data.size(),
                                                   " bytes, shape ", ShapeString(t.shape()),
                                                   " needs ", *bytes));
  }
  in->host = inline_data;
  return absl::OkStatus();
}

// Whether `n` bf16 values at `p` are all finite (exponent not all ones), four at a time: with
// the exponents flipped, a non-finite value is a zero 16-bit lane, which the borrow of
// (t - 1) & ~t & 0x8000 finds. Branch-free, so the compiler vectorizes it.
bool AllFinite(const char* p, size_t n) {
  constexpr uint64_t kExponents = 0x7f807f807f807f80ull;
  constexpr uint64_t kOnes = 0x0001000100010001ull, kHigh = 0x8000800080008000ull;
  uint64_t bad = 0;
  size_t i = 0;
  for (; i + 4 <= n; i += 4) {
    uint64_t w;
    std::memcpy(&w, p + 2 * i, 8);
    const uint64_t t = (w & kExponents) ^ kExponents;
    bad |= (t - kOnes) & ~t & kHigh;
  }
  for (; i < n; ++i) {
    uint16_t bits;
    std::memcpy(&bits, p + 2 * i, 2);
    bad |= (bits & 0x7f80u) == 0x7f80u;
  }
  return bad == 0;
}

// INVALID_ARGUMENT naming the first NaN or Inf of a host input. A non-finite K or V appended to
// the cache would poison every later read of its KV head, and one in q comes back as a row that
// "sees no key": neither is an answer (docs/design.md, "Attention semantics").
absl::Status CheckFinite(const CallInput& in, const char* field) {
  if (!in.present || in.on_device() || in.bytes == 0) return absl::OkStatus();
  // The pieces (gRPC slices) may split an element: its first byte waits in `carry`.
  size_t element = 0;  // index of the next whole element
  bool have_carry = false;
  char carry = 0;
  absl::Status bad;
  auto report = [&](uint16_t bits, size_t index) {
    bad = absl::InvalidArgumentError(
        absl::StrCat(field, ": element ", index, " is ", (bits & 0x7fu) ? "NaN" : "Inf",
                     " (bf16 0x", absl::Hex(bits, absl::kZeroPad4), "); inputs must be finite"));
  };
  in.host.ForEachPiece([&](const char* data, size_t size) {
    if (!bad.ok() || size == 0) return;
    if (have_carry) {
      const char pair[2] = {carry, data[0]};
      uint16_t bits;
      std::memcpy(&bits, pair, 2);
      if ((bits & 0x7f80u) == 0x7f80u) return report(bits, element);
      ++element;
      ++data;
      --size;
      have_carry = false;
    }
    const size_t n = size / 2;
    if (!AllFinite(data, n)) {
      for (size_t i = 0; i < n; ++i) {
        uint16_t bits;
        std::memcpy(&bits, data + 2 * i, 2);
        if ((bits & 0x7f80u) == 0x7f80u) return report(bits, element + i);
      }
    }
    element += n;
    if (size % 2 == 1) {
      carry = data[size - 1];
      have_carry = true;
    }
  });
  return bad;
}

absl::Status CheckFinite(const AttentionCall& c, const PoolGeometry& pool) {
  const bool gqa = pool.kind == PoolKind::kGqa;
  ATTN_RETURN_IF_ERROR(CheckFinite(c.q, "q"));
  ATTN_RETURN_IF_ERROR(CheckFinite(c.q_pe, "q_pe"));
  ATTN_RETURN_IF_ERROR(CheckFinite(c.k_new, gqa ? "k_new" : "ckv_new"));
  return CheckFinite(c.v_new, gqa ? "v_new" : "kpe_new");
}

// The page table the call reads: the request's repeated fields, or a PageTableRef copied into
// the call (`call.table`) before anything looks at it, so the caller cannot change what was
// checked.
struct TableSpans {
  absl::Span<const int32_t> qo_indptr, kv_indptr, kv_indices, kv_last_page_len;
};

template <typename Request>
absl::StatusOr<TableSpans> ReadPageTable(const Request& req, bool prefill,
                                         const RegionResolver& regions, const PlanTable* plan,
                                         AttentionCall& call) {
  constexpr bool kHasQo = !std::is_same_v<Request, v1::DecodeRequest>;
  TableSpans t;
  bool repeated =
      req.kv_indptr_size() > 0 || req.kv_indices_size() > 0 || req.kv_last_page_len_size() > 0;
  if constexpr (kHasQo) repeated = repeated || req.qo_indptr_size() > 0;
  if constexpr (!std::is_same_v<Request, v1::CreatePlanRequest>) {
    if (!req.plan().empty()) {
      if (repeated || req.has_page_table()) {
        return absl::InvalidArgumentError(
            "plan: send the page table in a plan, a region or the request's fields, only one");
      }
      if (plan == nullptr) {
        return absl::InvalidArgumentError("plan: this server takes no plans on this path");
      }
      t.qo_indptr = absl::MakeConstSpan(plan->qo_indptr);
      t.kv_indptr = absl::MakeConstSpan(plan->kv_indptr);
      t.kv_indices = absl::MakeConstSpan(plan->kv_indices);
      t.kv_last_page_len = absl::MakeConstSpan(plan->kv_last_page_len);
      return t;
    }
  }
  if (!req.has_page_table()) {
    if constexpr (kHasQo) t.qo_indptr = absl::MakeConstSpan(req.qo_indptr());
    t.kv_indptr = absl::MakeConstSpan(req.kv_indptr());
    t.kv_indices = absl::MakeConstSpan(req.kv_indices());
    t.kv_last_page_len = absl::MakeConstSpan(req.kv_last_page_len());
    return t;
  }
  if (repeated) {
    return absl::InvalidArgumentError(
        "page_table: send the page table in a region or in the request's fields, not both");
  }
  const v1::PageTableRef& ref = req.page_table();
  if (ref.batch() < 1 || ref.batch() > kMaxCallTokens) {
    return absl::InvalidArgumentError(
        absl::StrCat("page_table.batch = ", ref.batch(), " is outside [1, ", kMaxCallTokens, "]"));
  }
  if (ref.num_pages() < 0 || ref.num_pages() > kMaxTablePages) {
    return absl::InvalidArgumentError(absl::StrCat("page_table.num_pages = ", ref.num_pages(),
                                                   " is outside [0, ", kMaxTablePages, "]"));
  }
  const int64_t batch = ref.batch();
  const int64_t words = (batch + 1) + batch + ref.num_pages() + (prefill ? batch + 1 : 0);
  if (!regions) {
    return absl::InvalidArgumentError("page_table: this server accepts no region references");
  }
  const SliceRef slice{ref.at().name(), ref.at().offset(), 4 * words, "page_table.at"};
  ATTN_ASSIGN_OR_RETURN(RegionUse use, regions(absl::MakeConstSpan(&slice, 1)));
  if (use.kind(0) != RegionKind::kSharedMemory) {
    return absl::InvalidArgumentError(
        "page_table.at: the page table must be in a shared-memory region");
  }
  call.table.resize(static_cast<size_t>(words));
  std::memcpy(call.table.data(), use.data(0), static_cast<size_t>(4 * words));
  if (absl::Status st = use.CheckIntact(); !st.ok()) return st;
  const absl::Span<const int32_t> all = absl::MakeConstSpan(call.table);
  t.kv_indptr = all.subspan(0, batch + 1);
  t.kv_last_page_len = all.subspan(batch + 1, batch);
  t.kv_indices = all.subspan(2 * batch + 1, ref.num_pages());
  if (prefill) t.qo_indptr = all.subspan(2 * batch + 1 + ref.num_pages(), batch + 1);
  return t;
}

// Where an output goes: a region slice of `bytes` (added to `slices`) or the response.
absl::Status OutputTo(bool named, const v1::RegionSlice& at, int64_t bytes, const char* field,
                      CallOutput* out, Slices* slices) {
  if (named) slices->Output(at, bytes, field, out);
  return absl::OkStatus();
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
    return absl::InvalidArgumentError(absl::StrCat(field, "[", indptr.size() - 1,
                                                   "] = ", indptr.back(), " must equal ", last_name,
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
                                                  absl::Span<const int32_t> kv_indptr, int batch,
                                                  int page_size) {
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
      return absl::InvalidArgumentError(absl::StrCat("kv_last_page_len[", b, "] = ", v,
                                                     " is outside [", lo, ", ", page_size, "]",
                                                     has_pages ? "" : " (sequence without pages)"));
    }
    lens[b] = has_pages ? v : 0;
  }
  return lens;
}

// The query side of a page table: batch_size, total_q and (Prefill) qo_indptr.
absl::Status CheckBatch(const TableSpans& table, Op op, AttentionCall& call) {
  if (op == Op::kDecode) {
    const int64_t batch = static_cast<int64_t>(table.kv_indptr.size()) - 1;
    if (batch < 1 || batch > kMaxCallTokens) {
      return absl::InvalidArgumentError(absl::StrCat("kv_indptr has ", table.kv_indptr.size(),
                                                     " entries; send batch + 1 with batch in [1, ",
                                                     kMaxCallTokens, "]"));
    }
    call.batch_size = static_cast<int>(batch);
    call.total_q = call.batch_size;
    return absl::OkStatus();
  }
  call.qo_indptr = table.qo_indptr;
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
  return CheckIndptr(call.qo_indptr, "qo_indptr", call.total_q, "total_q");
}

// The key side of a page table, against the pool, once CheckBatch has set the batch.
absl::Status CheckKvTable(const TableSpans& table, const PoolGeometry& pool, AttentionCall& call) {
  const int batch = call.batch_size;
  call.kv_indptr = table.kv_indptr;
  call.kv_indices = table.kv_indices;
  if (call.kv_indptr.size() != static_cast<size_t>(batch) + 1) {
    return absl::InvalidArgumentError(absl::StrCat("kv_indptr has ", call.kv_indptr.size(),
                                                   " entries, expected batch + 1 = ", batch + 1));
  }
  ATTN_RETURN_IF_ERROR(CheckIndptr(call.kv_indptr, "kv_indptr",
                                   static_cast<int64_t>(call.kv_indices.size()),
                                   "len(kv_indices)"));
  ATTN_RETURN_IF_ERROR(CheckPagesPerSequence(call.kv_indptr, pool));
  ATTN_ASSIGN_OR_RETURN(call.kv_last_page_len, LastPageLens(table.kv_last_page_len, call.kv_indptr,
                                                            batch, pool.page_size));
  return absl::OkStatus();
}

// The fields Prefill and Decode share, read from either request type.
template <typename Request>
absl::Status ValidateCommon(const Request& req, const InlineTensors& data, const TableSpans& table,
                            const PoolGeometry& pool, AttentionCall& call, Slices& slices) {
  if (req.layer() < 0 || req.layer() >= pool.num_layers) {
    return absl::InvalidArgumentError(
        absl::StrCat("layer = ", req.layer(), " is outside [0, ", pool.num_layers, ")"));
  }
  call.layer = req.layer();

  ATTN_RETURN_IF_ERROR(CheckKvTable(table, pool, call));
  const int batch = call.batch_size;

  const int64_t tq = call.total_q;
  const RowShapes& rows = pool.rows();
  ATTN_RETURN_IF_ERROR(Bf16Rows(req.q(), data.q(), "q", tq, rows.q, &call.q, &slices));
  if (pool.kind == PoolKind::kGqa) {
    if (req.has_q_pe() || req.has_ckv_new() || req.has_kpe_new()) {
      return absl::InvalidArgumentError(
          "q_pe, ckv_new and kpe_new are MLA fields; this pool is GQA");
    }
    if (req.has_k_new() != req.has_v_new()) {
      return absl::InvalidArgumentError("k_new and v_new must be sent together");
    }
    if (req.has_k_new()) {
      ATTN_RETURN_IF_ERROR(
          Bf16Rows(req.k_new(), data.k_new(), "k_new", tq, rows.k_new, &call.k_new, &slices));
      ATTN_RETURN_IF_ERROR(
          Bf16Rows(req.v_new(), data.v_new(), "v_new", tq, rows.v_new, &call.v_new, &slices));
    }
  } else {
    ATTN_RETURN_IF_ERROR(
        Bf16Rows(req.q_pe(), data.q_pe(), "q_pe", tq, rows.q_pe, &call.q_pe, &slices));
    if (req.has_k_new() || req.has_v_new()) {
      return absl::InvalidArgumentError("k_new and v_new are GQA fields; this pool is MLA");
    }
    if (req.has_ckv_new() != req.has_kpe_new()) {
      return absl::InvalidArgumentError("ckv_new and kpe_new must be sent together");
    }
    if (req.has_ckv_new()) {
      ATTN_RETURN_IF_ERROR(
          Bf16Rows(req.ckv_new(), data.ckv_new(), "ckv_new", tq, rows.k_new, &call.k_new, &slices));
      ATTN_RETURN_IF_ERROR(
          Bf16Rows(req.kpe_new(), data.kpe_new(), "kpe_new", tq, rows.v_new, &call.v_new, &slices));
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
  if (req.has_lse_to() && !call.return_lse) {
    return absl::InvalidArgumentError("lse_to is set but return_lse is false");
  }
  if (req.has_lse_to() && !req.has_output_to()) {
    return absl::InvalidArgumentError("lse_to needs output_to: both outputs go to regions");
  }
  ATTN_RETURN_IF_ERROR(OutputTo(req.has_output_to(), req.output_to(),
                                tq * rows.out.elements() * int64_t{sizeof(bf16)}, "output_to",
                                &call.out, &slices));
  ATTN_RETURN_IF_ERROR(OutputTo(req.has_lse_to(), req.lse_to(), tq * rows.lse * int64_t{4},
                                "lse_to", &call.lse, &slices));

  // Appended rows take the last q_len positions of each sequence, so they must fit in kv_len,
  // and the pages they land in belong to that sequence alone (two writers of one page would
  // race on the device).
  if (call.appends()) {
    const PagedBatch view{batch,
                          call.total_q,
                          call.qo_indptr.empty() ? nullptr : call.qo_indptr.data(),
                          call.kv_indptr.data(),
                          nullptr,
                          call.kv_last_page_len.data(),
                          nullptr};
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

// What Prefill and Decode validate alike once their page table is read: the fields they share,
// the regions the call names (in use from here on), and the values of its host inputs.
template <typename Request>
absl::Status ValidateRest(const Request& req, const InlineTensors& data, const TableSpans& table,
                          const PoolGeometry& pool, const RegionResolver& regions,
                          FiniteCheck finite, ValidatedCall& v) {
  Slices slices;
  ATTN_RETURN_IF_ERROR(ValidateCommon(req, data, table, pool, v.call, slices));
  ATTN_ASSIGN_OR_RETURN(v.regions, slices.Resolve(regions));
  return finite == FiniteCheck::kHost ? CheckFinite(v.call, pool) : absl::OkStatus();
}

}  // namespace

absl::StatusOr<ValidatedCall> ValidatePrefill(const v1::PrefillRequest& req,
                                              const InlineTensors& data, const PoolGeometry& pool,
                                              const RegionResolver& regions, FiniteCheck finite,
                                              const PlanTable* plan) {
  ValidatedCall v;
  AttentionCall& call = v.call;
  call.op = Op::kPrefill;
  ATTN_ASSIGN_OR_RETURN(const TableSpans table,
                        ReadPageTable(req, /*prefill=*/true, regions, plan, call));
  ATTN_RETURN_IF_ERROR(CheckBatch(table, Op::kPrefill, call));
  ATTN_RETURN_IF_ERROR(ValidateRest(req, data, table, pool, regions, finite, v));
  return v;
}

absl::StatusOr<ValidatedCall> ValidateDecode(const v1::DecodeRequest& req,
                                             const InlineTensors& data, const PoolGeometry& pool,
                                             const RegionResolver& regions, FiniteCheck finite,
                                             const PlanTable* plan) {
  ValidatedCall v;
  AttentionCall& call = v.call;
  call.op = Op::kDecode;
  ATTN_ASSIGN_OR_RETURN(const TableSpans table,
                        ReadPageTable(req, /*prefill=*/false, regions, plan, call));
  ATTN_RETURN_IF_ERROR(CheckBatch(table, Op::kDecode, call));
  ATTN_RETURN_IF_ERROR(ValidateRest(req, data, table, pool, regions, finite, v));
  return v;
}

absl::StatusOr<PlanTable> ValidatePlanTable(const v1::CreatePlanRequest& req,
                                            const PoolGeometry& pool,
                                            const RegionResolver& regions) {
  const bool prefill = req.prefill();
  if (!req.has_page_table() && prefill != (req.qo_indptr_size() > 0)) {
    return absl::InvalidArgumentError(
        prefill ? "prefill is set but qo_indptr is empty: a Prefill plan needs qo_indptr"
                : "qo_indptr is sent but prefill is not set: set prefill for a Prefill plan");
  }
  const Op op = prefill ? Op::kPrefill : Op::kDecode;
  AttentionCall call;  // what a call on this table would hold
  call.op = op;
  ATTN_ASSIGN_OR_RETURN(const TableSpans table,
                        ReadPageTable(req, prefill, regions, /*plan=*/nullptr, call));
  ATTN_RETURN_IF_ERROR(CheckBatch(table, op, call));
  ATTN_RETURN_IF_ERROR(CheckKvTable(table, pool, call));
  PlanTable plan;
  plan.op = op;
  plan.qo_indptr.assign(table.qo_indptr.begin(), table.qo_indptr.end());
  plan.kv_indptr.assign(table.kv_indptr.begin(), table.kv_indptr.end());
  plan.kv_indices.assign(table.kv_indices.begin(), table.kv_indices.end());
  plan.kv_last_page_len.assign(table.kv_last_page_len.begin(), table.kv_last_page_len.end());
  return plan;
}

absl::StatusOr<AttentionCall> ValidatePrefill(const v1::PrefillRequest& req,
                                              const PoolGeometry& pool) {
  ATTN_ASSIGN_OR_RETURN(ValidatedCall v, ValidatePrefill(req, InlineTensorsOf(req), pool, {}));
  return std::move(v.call);
}

absl::StatusOr<AttentionCall> ValidateDecode(const v1::DecodeRequest& req,
                                             const PoolGeometry& pool) {
  ATTN_ASSIGN_OR_RETURN(ValidatedCall v, ValidateDecode(req, InlineTensorsOf(req), pool, {}));
  return std::move(v.call);
}

}  // namespace attn
