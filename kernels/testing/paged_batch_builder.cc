#include "kernels/testing/paged_batch_builder.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <limits>
#include <numeric>

namespace attn::testing {
namespace {

float Uniform(std::mt19937_64& rng, float scale) {
  return std::uniform_real_distribution<float>(-scale, scale)(rng);
}

void FillRandom(std::vector<bf16>& v, int64_t n, float scale, std::mt19937_64& rng) {
  v.resize(n);
  for (bf16& x : v) x = FloatToBf16(Uniform(rng, scale));
}

// Page table for seqs with page_size tokens per page; page ids are a random permutation of the
// pool (unless !o.shuffle_pages), handed out in order, so every sequence's pages are shuffled and
// non-contiguous.
HostPageTable MakeTable(const std::vector<SeqSpec>& seqs, int page_size, const BatchOptions& o,
                        std::mt19937_64& rng) {
  HostPageTable t;
  t.seqs = seqs;
  t.decode = o.decode;
  const int batch = static_cast<int>(seqs.size());
  int total_pages = 0;
  for (const SeqSpec& s : seqs) total_pages += (s.kv_len + page_size - 1) / page_size;
  t.num_pages = total_pages + o.extra_pages;
  std::vector<int32_t> pool(t.num_pages);
  std::iota(pool.begin(), pool.end(), 0);
  if (o.shuffle_pages) std::shuffle(pool.begin(), pool.end(), rng);

  t.kv_indptr.push_back(0);
  if (!o.decode) t.qo_indptr.push_back(0);
  bool any_layer = o.force_seq_layer;
  for (int b = 0; b < batch; ++b) {
    const SeqSpec& s = seqs[b];
    const int pages = (s.kv_len + page_size - 1) / page_size;
    for (int i = 0; i < pages; ++i) t.kv_indices.push_back(pool[t.kv_indices.size()]);
    t.kv_indptr.push_back(static_cast<int32_t>(t.kv_indices.size()));
    t.kv_last_page_len.push_back(pages == 0 ? 0 : s.kv_len - (pages - 1) * page_size);
    t.seq_layer.push_back(s.layer);
    any_layer |= s.layer != 0;
    t.total_q += o.decode ? 1 : s.q_len;
    if (!o.decode) t.qo_indptr.push_back(t.total_q);
  }
  if (o.pad_last_page_len) t.kv_last_page_len.push_back(0);
  if (!any_layer) t.seq_layer.clear();
  return t;
}

// Positions of sequence b that hold real tokens before any append.
int PrefilledLen(const SeqSpec& s, const BatchOptions& o) {
  const int q_len = o.decode ? 1 : s.q_len;
  return o.append ? std::max(s.kv_len - q_len, 0) : s.kv_len;
}

}  // namespace

PagedBatch HostPageTable::View() const {
  PagedBatch b;
  b.batch_size = static_cast<int>(seqs.size());
  b.total_q = total_q;
  b.qo_indptr = decode ? nullptr : qo_indptr.data();
  b.kv_indptr = kv_indptr.data();
  b.kv_indices = kv_indices.data();
  b.kv_last_page_len = kv_last_page_len.data();
  b.seq_layer = seq_layer.empty() ? nullptr : seq_layer.data();
  return b;
}

GqaParams GqaHostBatch::Params() {
  GqaParams p;
  p.cache.data = cache.data();
  p.cache.num_layers = geometry.num_layers;
  p.cache.num_pages = table.num_pages;
  p.cache.page_size = geometry.page_size;
  p.cache.num_kv_heads = geometry.num_kv_heads;
  p.cache.head_dim = geometry.head_dim;
  p.batch = table.View();
  p.num_qo_heads = geometry.num_qo_heads;
  p.q = q.data();
  p.k_new = k_new.empty() ? nullptr : k_new.data();
  p.v_new = v_new.empty() ? nullptr : v_new.data();
  p.out = out.data();
  p.lse = lse.empty() ? nullptr : lse.data();
  p.sm_scale = sm_scale;
  p.causal = causal;
  return p;
}

MlaParams MlaHostBatch::Params() {
  MlaParams p;
  p.cache.data = cache.data();
  p.cache.num_layers = geometry.num_layers;
  p.cache.num_pages = table.num_pages;
  p.cache.page_size = geometry.page_size;
  p.batch = table.View();
  p.num_heads = geometry.num_heads;
  p.q_nope = q_nope.data();
  p.q_pe = q_pe.data();
  p.ckv_new = ckv_new.empty() ? nullptr : ckv_new.data();
  p.kpe_new = kpe_new.empty() ? nullptr : kpe_new.data();
  p.out = out.data();
  p.lse = lse.empty() ? nullptr : lse.data();
  p.sm_scale = sm_scale;
  p.causal = causal;
  return p;
}

GqaHostBatch MakeGqaBatch(const GqaGeometry& g, const std::vector<SeqSpec>& seqs,
                          const BatchOptions& o, std::mt19937_64& rng) {
  GqaHostBatch hb;
  hb.geometry = g;
  hb.table = MakeTable(seqs, g.page_size, o, rng);
  hb.causal = o.causal;
  hb.sm_scale = o.sm_scale != 0.f ? o.sm_scale : 1.f / std::sqrt(static_cast<float>(g.head_dim));

  const int64_t token = int64_t{g.num_kv_heads} * g.head_dim;
  const int64_t page_stride = 2 * int64_t{g.page_size} * token;
  const int64_t layer_stride = int64_t{hb.table.num_pages} * page_stride;
  hb.cache.assign(g.num_layers * layer_stride, kBf16QuietNan);
  for (size_t b = 0; b < seqs.size(); ++b) {
    const int layer = seqs[b].layer;
    for (int pos = 0; pos < PrefilledLen(seqs[b], o); ++pos) {
      const int page = hb.table.kv_indices[hb.table.kv_indptr[b] + pos / g.page_size];
      bf16* k =
          hb.cache.data() + layer * layer_stride + page * page_stride + (pos % g.page_size) * token;
      bf16* v = k + g.page_size * token;
      for (int64_t i = 0; i < token; ++i) k[i] = FloatToBf16(Uniform(rng, 1.f));
      for (int64_t i = 0; i < token; ++i) v[i] = FloatToBf16(Uniform(rng, 1.f));
    }
  }
  const int64_t total_q = hb.table.total_q;
  FillRandom(hb.q, total_q * g.num_qo_heads * g.head_dim, o.query_scale, rng);
  if (o.append) {
    FillRandom(hb.k_new, total_q * token, 1.f, rng);
    FillRandom(hb.v_new, total_q * token, 1.f, rng);
  }
  hb.out.resize(total_q * g.num_qo_heads * g.head_dim);
  if (o.with_lse) hb.lse.resize(total_q * g.num_qo_heads);
  PoisonOutputs(hb.out, hb.lse);
  return hb;
}

MlaHostBatch MakeMlaBatch(const MlaGeometry& g, const std::vector<SeqSpec>& seqs,
                          const BatchOptions& o, std::mt19937_64& rng) {
  MlaHostBatch hb;
  hb.geometry = g;
  hb.table = MakeTable(seqs, g.page_size, o, rng);
  hb.causal = o.causal;
  hb.sm_scale = o.sm_scale != 0.f ? o.sm_scale : 1.f / std::sqrt(float{kMlaTokenDim});

  const int64_t page_stride = int64_t{g.page_size} * kMlaTokenDim;
  const int64_t layer_stride = int64_t{hb.table.num_pages} * page_stride;
  hb.cache.assign(g.num_layers * layer_stride, kBf16QuietNan);
  for (size_t b = 0; b < seqs.size(); ++b) {
    for (int pos = 0; pos < PrefilledLen(seqs[b], o); ++pos) {
      const int page = hb.table.kv_indices[hb.table.kv_indptr[b] + pos / g.page_size];
      bf16* row = hb.cache.data() + seqs[b].layer * layer_stride + page * page_stride +
                  (pos % g.page_size) * kMlaTokenDim;
      for (int i = 0; i < kMlaTokenDim; ++i) row[i] = FloatToBf16(Uniform(rng, 1.f));
    }
  }
  const int64_t total_q = hb.table.total_q;
  FillRandom(hb.q_nope, total_q * g.num_heads * kMlaCkvDim, o.query_scale, rng);
  FillRandom(hb.q_pe, total_q * g.num_heads * kMlaKpeDim, o.query_scale, rng);
  if (o.append) {
    FillRandom(hb.ckv_new, total_q * kMlaCkvDim, 1.f, rng);
    FillRandom(hb.kpe_new, total_q * kMlaKpeDim, 1.f, rng);
  }
  hb.out.resize(total_q * g.num_heads * kMlaCkvDim);
  if (o.with_lse) hb.lse.resize(total_q * g.num_heads);
  PoisonOutputs(hb.out, hb.lse);
  return hb;
}

void PoisonOutputs(std::vector<bf16>& out, std::vector<float>& lse) {
  std::fill(out.begin(), out.end(), kBf16QuietNan);
  std::fill(lse.begin(), lse.end(), std::numeric_limits<float>::quiet_NaN());
}

namespace {

// Finite elements x of v become 0.5 + |x| / 2; NaN (slots without a token) stays NaN.
void MakePositive(std::vector<bf16>& v) {
  for (bf16& x : v) {
    const float f = Bf16ToFloat(x);
    if (std::isfinite(f)) x = FloatToBf16(0.5f + 0.5f * std::abs(f));
  }
}

// Queries for `how` (already positive), and the finite sentinel in the outputs.
void ApplyOverflow(Overflow how, std::vector<bf16>* q0, std::vector<bf16>* q1, float* sm_scale,
                   std::vector<bf16>& out, std::vector<float>& lse) {
  for (std::vector<bf16>* q : {q0, q1}) {
    if (q == nullptr) continue;
    MakePositive(*q);
    if (how != Overflow::kHugeScale) {
      std::fill(q->begin(), q->end(), FloatToBf16(how == Overflow::kHugeQuery ? 1e38f : -1e38f));
    }
  }
  if (how == Overflow::kHugeScale) *sm_scale = 1e38f;
  std::fill(out.begin(), out.end(), FloatToBf16(1.f));
  std::fill(lse.begin(), lse.end(), 1.f);
}

}  // namespace

void MakeLogitsOverflow(Overflow how, GqaHostBatch* b) {
  MakePositive(b->cache);
  MakePositive(b->k_new);
  MakePositive(b->v_new);
  ApplyOverflow(how, &b->q, nullptr, &b->sm_scale, b->out, b->lse);
}

void MakeLogitsOverflow(Overflow how, MlaHostBatch* b) {
  MakePositive(b->cache);
  MakePositive(b->ckv_new);
  MakePositive(b->kpe_new);
  ApplyOverflow(how, &b->q_nope, &b->q_pe, &b->sm_scale, b->out, b->lse);
}

int64_t CheckOverflowRows(const HostPageTable& t, int page_size, bool causal, int num_heads,
                          int v_dim, const std::vector<bf16>& out, const std::vector<float>& lse,
                          std::string* report, int max_report) {
  const PagedBatch b = t.View();
  int64_t failures = 0;
  for (int seq = 0; seq < b.batch_size; ++seq) {
    const SeqExtent e = GetSeqExtent(b, page_size, seq);
    for (int i = 0; i < e.q_len; ++i) {
      const bool sees = VisibleKeys(e, i, causal) > 0;
      for (int h = 0; h < num_heads; ++h) {
        const int64_t vec = (int64_t{e.q_begin} + i) * num_heads + h;
        int64_t bad = -1;  // the first element that is not the contract's answer
        for (int d = 0; d < v_dim && bad < 0; ++d) {
          const float x = Bf16ToFloat(out[vec * v_dim + d]);
          if (sees ? !std::isnan(x) : x != 0.f) bad = d;
        }
        const bool bad_lse =
            !lse.empty() && (sees ? !std::isnan(lse[vec]) : lse[vec] != kEmptyRowLse);
        if (bad < 0 && !bad_lse) continue;
        if (failures++ < max_report && report != nullptr) {
          char line[200];
          std::snprintf(line, sizeof(line), "row %lld head %d (%s): out[%lld] = %.6g, lse = %.6g\n",
                        static_cast<long long>(e.q_begin + i), h,
                        sees ? "sees keys, wants NaN" : "sees no key, wants 0 / kEmptyRowLse",
                        static_cast<long long>(bad < 0 ? 0 : bad),
                        Bf16ToFloat(out[vec * v_dim + (bad < 0 ? 0 : bad)]),
                        lse.empty() ? 0.0 : double{lse[vec]});
          *report += line;
        }
      }
    }
  }
  return failures;
}

bool WithinTolerance(double x, double ref) {
  const double diff = std::abs(x - ref);
  return !(diff > 1e-2 && diff / (std::abs(ref) + 1e-8) > 1e-2);
}

namespace {

template <typename T, typename ToDouble>
int64_t Compare(const std::string& what, const T* got, const T* ref, int64_t n, std::string* report,
                int max_report, ToDouble to_double) {
  int64_t failures = 0;
  for (int64_t i = 0; i < n; ++i) {
    const double x = to_double(got[i]);
    const double r = to_double(ref[i]);
    if (std::isfinite(x) && WithinTolerance(x, r)) continue;
    if (failures++ < max_report && report != nullptr) {
      char line[160];
      std::snprintf(line, sizeof(line), "%s[%lld]: got %.6g, ref %.6g\n", what.c_str(),
                    static_cast<long long>(i), x, r);
      *report += line;
    }
  }
  return failures;
}

}  // namespace

int64_t CompareBf16(const std::string& what, const bf16* got, const bf16* ref, int64_t n,
                    std::string* report, int max_report) {
  return Compare(what, got, ref, n, report, max_report,
                 [](bf16 x) { return double{Bf16ToFloat(x)}; });
}

int64_t CompareFloat(const std::string& what, const float* got, const float* ref, int64_t n,
                     std::string* report, int max_report) {
  return Compare(what, got, ref, n, report, max_report, [](float x) { return double{x}; });
}

}  // namespace attn::testing
