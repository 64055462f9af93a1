#include "kernels/reference/reference.h"

#include <algorithm>
#include <cmath>
#include <vector>

namespace attn::reference {
namespace {

// Token position pos of a sequence -> (page id, slot).
struct Slot {
  int page;
  int slot;
};

Slot TokenSlot(const PagedBatch& b, const SeqExtent& e, int page_size, int pos) {
  return {b.kv_indices[e.page_begin + pos / page_size], pos % page_size};
}

// Softmax attention of one query vector over its visible keys, given their logits (natural-log
// domain) and value rows, written to out / lse exactly as the contract says. Logits are doubles:
// finite bf16 inputs and a finite float sm_scale give |logit| < 1e120, so a row that sees keys
// always has a finite state here and the contract's NaN for float32 overflow never arises (the
// backends' tests check that rule on their own, testing::MakeLogitsOverflow).
void Finish(const std::vector<double>& logits, const std::vector<const bf16*>& values, int v_dim,
            bf16* out, float* lse) {
  if (logits.empty()) {
    for (int d = 0; d < v_dim; ++d) out[d] = FloatToBf16(0.f);
    if (lse) *lse = kEmptyRowLse;
    return;
  }
  double max = logits[0];
  for (double x : logits) max = std::max(max, x);
  double sum = 0;
  for (double x : logits) sum += std::exp(x - max);
  std::vector<double> acc(v_dim, 0.0);
  for (size_t j = 0; j < logits.size(); ++j) {
    const double prob = std::exp(logits[j] - max) / sum;
    for (int d = 0; d < v_dim; ++d) acc[d] += prob * Bf16ToFloat(values[j][d]);
  }
  for (int d = 0; d < v_dim; ++d) out[d] = FloatToBf16(static_cast<float>(acc[d]));
  if (lse) *lse = static_cast<float>((max + std::log(sum)) / std::log(2.0));
}

double ToDouble(bf16 x) { return Bf16ToFloat(x); }

}  // namespace

void GqaAppendKv(const GqaParams& p) {
  if (p.k_new == nullptr) return;
  const GqaCache& c = p.cache;
  for (int seq = 0; seq < p.batch.batch_size; ++seq) {
    const SeqExtent e = GetSeqExtent(p.batch, c.page_size, seq);
    for (int i = 0; i < e.q_len; ++i) {
      const int pos = e.kv_len - e.q_len + i;
      if (pos < 0) continue;
      const Slot s = TokenSlot(p.batch, e, c.page_size, pos);
      const int64_t row = e.q_begin + i;
      for (int h = 0; h < c.num_kv_heads; ++h) {
        for (int d = 0; d < c.head_dim; ++d) {
          // Cache index of [layer, page, K or V, slot, head, d].
          const int64_t k =
              ((((int64_t{e.layer} * c.num_pages + s.page) * 2 + 0) * c.page_size + s.slot) *
                   c.num_kv_heads +
               h) *
                  c.head_dim +
              d;
          const int64_t v =
              ((((int64_t{e.layer} * c.num_pages + s.page) * 2 + 1) * c.page_size + s.slot) *
                   c.num_kv_heads +
               h) *
                  c.head_dim +
              d;
          const int64_t src = (row * c.num_kv_heads + h) * c.head_dim + d;
          c.data[k] = p.k_new[src];
          c.data[v] = p.v_new[src];
        }
      }
    }
  }
}

void GqaAttention(const GqaParams& p) {
  const GqaCache& c = p.cache;
  const int group = p.num_qo_heads / c.num_kv_heads;
  const int dim = c.head_dim;
  for (int seq = 0; seq < p.batch.batch_size; ++seq) {
    const SeqExtent e = GetSeqExtent(p.batch, c.page_size, seq);
    for (int i = 0; i < e.q_len; ++i) {
      const int64_t row = e.q_begin + i;
      for (int h = 0; h < p.num_qo_heads; ++h) {
        const int kvh = h / group;
        std::vector<double> logits;
        std::vector<const bf16*> values;
        for (int j = 0; j < e.kv_len; ++j) {
          // Bottom-right aligned causal mask.
          if (p.causal && j > i + (e.kv_len - e.q_len)) continue;
          const Slot s = TokenSlot(p.batch, e, c.page_size, j);
          const int64_t k =
              ((((int64_t{e.layer} * c.num_pages + s.page) * 2 + 0) * c.page_size + s.slot) *
                   c.num_kv_heads +
               kvh) *
              dim;
          const int64_t v =
              ((((int64_t{e.layer} * c.num_pages + s.page) * 2 + 1) * c.page_size + s.slot) *
                   c.num_kv_heads +
               kvh) *
              dim;
          double dot = 0;
          for (int d = 0; d < dim; ++d) {
            dot += ToDouble(p.q[(row * p.num_qo_heads + h) * dim + d]) * ToDouble(c.data[k + d]);
          }
          logits.push_back(double{p.sm_scale} * dot);
          values.push_back(c.data + v);
        }
        const int64_t vec = row * p.num_qo_heads + h;
        Finish(logits, values, dim, p.out + vec * dim, p.lse ? p.lse + vec : nullptr);
      }
    }
  }
}

void MlaAppendKv(const MlaParams& p) {
  if (p.ckv_new == nullptr) return;
  const MlaCache& c = p.cache;
  for (int seq = 0; seq < p.batch.batch_size; ++seq) {
    const SeqExtent e = GetSeqExtent(p.batch, c.page_size, seq);
    for (int i = 0; i < e.q_len; ++i) {
      const int pos = e.kv_len - e.q_len + i;
      if (pos < 0) continue;
      const Slot s = TokenSlot(p.batch, e, c.page_size, pos);
      const int64_t row = e.q_begin + i;
      // Cache index of [layer, page, slot, 0].
      const int64_t dst =
          ((int64_t{e.layer} * c.num_pages + s.page) * c.page_size + s.slot) * kMlaTokenDim;
      for (int d = 0; d < kMlaCkvDim; ++d) c.data[dst + d] = p.ckv_new[row * kMlaCkvDim + d];
      for (int d = 0; d < kMlaKpeDim; ++d) {
        c.data[dst + kMlaCkvDim + d] = p.kpe_new[row * kMlaKpeDim + d];
      }
    }
  }
}

void MlaAttention(const MlaParams& p) {
  const MlaCache& c = p.cache;
  for (int seq = 0; seq < p.batch.batch_size; ++seq) {
    const SeqExtent e = GetSeqExtent(p.batch, c.page_size, seq);
    for (int i = 0; i < e.q_len; ++i) {
      const int64_t row = e.q_begin + i;
      for (int h = 0; h < p.num_heads; ++h) {
        const int64_t vec = row * p.num_heads + h;
        std::vector<double> logits;
        std::vector<const bf16*> values;
        for (int j = 0; j < e.kv_len; ++j) {
          if (p.causal && j > i + (e.kv_len - e.q_len)) continue;
          const Slot s = TokenSlot(p.batch, e, c.page_size, j);
          const bf16* token =
              c.data +
              ((int64_t{e.layer} * c.num_pages + s.page) * c.page_size + s.slot) * kMlaTokenDim;
          double dot = 0;
          for (int d = 0; d < kMlaCkvDim; ++d) {
            dot += ToDouble(p.q_nope[vec * kMlaCkvDim + d]) * ToDouble(token[d]);
          }
          for (int d = 0; d < kMlaKpeDim; ++d) {
            dot += ToDouble(p.q_pe[vec * kMlaKpeDim + d]) * ToDouble(token[kMlaCkvDim + d]);
          }
          logits.push_back(double{p.sm_scale} * dot);
          values.push_back(token);  // the value is the latent ckv part of the same row
        }
        Finish(logits, values, kMlaCkvDim, p.out + vec * kMlaCkvDim, p.lse ? p.lse + vec : nullptr);
      }
    }
  }
}

}  // namespace attn::reference
