// Hand-computed cases pinning the reference itself: if these hold, the reference implements the
// contract in docs/design.md ("Attention semantics"), and every backend test inherits that.
#include "kernels/reference/reference.h"

#include <gtest/gtest.h>

#include <cmath>
#include <limits>
#include <vector>

namespace attn::reference {
namespace {

constexpr double kLog2e = 1.4426950408889634;

float F(bf16 x) { return Bf16ToFloat(x); }
bf16 B(float x) { return FloatToBf16(x); }

// A GQA batch with one KV head of dim 2, page size 2, one layer; the caller fills K/V token rows.
struct TinyGqa {
  int num_qo_heads = 1;
  std::vector<bf16> cache;  // [1 layer, num_pages, 2, page_size 2, 1 head, dim 2]
  std::vector<int32_t> qo_indptr, kv_indptr, kv_indices, last_page_len;
  std::vector<bf16> q, k_new, v_new, out;
  std::vector<float> lse;
  bool causal = true;

  explicit TinyGqa(int num_pages) : cache(num_pages * 2 * 2 * 2, kBf16QuietNan) {}

  // Sets token `slot` of page `page`: K then V.
  void SetToken(int page, int slot, float k0, float k1, float v0, float v1) {
    bf16* k = cache.data() + (page * 2 + 0) * 4 + slot * 2;
    bf16* v = cache.data() + (page * 2 + 1) * 4 + slot * 2;
    k[0] = B(k0), k[1] = B(k1), v[0] = B(v0), v[1] = B(v1);
  }

  GqaParams Params(float sm_scale) {
    const int total_q = qo_indptr.back();
    out.assign(total_q * num_qo_heads * 2, kBf16QuietNan);
    lse.assign(total_q * num_qo_heads, std::numeric_limits<float>::quiet_NaN());
    GqaParams p;
    p.cache = {cache.data(), 1, static_cast<int>(cache.size() / 8), 2, 1, 2};
    p.batch.batch_size = static_cast<int>(kv_indptr.size()) - 1;
    p.batch.total_q = total_q;
    p.batch.qo_indptr = qo_indptr.data();
    p.batch.kv_indptr = kv_indptr.data();
    p.batch.kv_indices = kv_indices.data();
    p.batch.kv_last_page_len = last_page_len.data();
    p.num_qo_heads = num_qo_heads;
    p.q = q.data();
    p.k_new = k_new.empty() ? nullptr : k_new.data();
    p.v_new = v_new.empty() ? nullptr : v_new.data();
    p.out = out.data();
    p.lse = lse.data();
    p.sm_scale = sm_scale;
    p.causal = causal;
    return p;
  }
};

TEST(ReferenceTest, OneKeyOutputsItsValue) {
  TinyGqa t(2);
  t.SetToken(1, 0, 1.f, 2.f, 0.25f, -3.f);  // page 1 only; page 0 stays NaN
  t.qo_indptr = {0, 1};
  t.kv_indptr = {0, 1};
  t.kv_indices = {1};
  t.last_page_len = {1};
  t.q = {B(0.5f), B(1.f)};
  GqaAttention(t.Params(0.5f));
  EXPECT_EQ(F(t.out[0]), 0.25f);
  EXPECT_EQ(F(t.out[1]), -3.f);
  // s = 0.5 * (0.5 * 1 + 1 * 2) = 1.25; lse = log2(e^s) = s * log2(e).
  EXPECT_NEAR(t.lse[0], 1.25 * kLog2e, 1e-6);
}

TEST(ReferenceTest, TwoKeysKnownSoftmax) {
  TinyGqa t(1);
  t.SetToken(0, 0, 1.f, 0.f, 1.f, 0.f);
  t.SetToken(0, 1, 0.f, 1.f, 0.f, 1.f);
  t.qo_indptr = {0, 1};
  t.kv_indptr = {0, 1};
  t.kv_indices = {0};
  t.last_page_len = {2};
  t.q = {B(std::log(3.f)), B(0.f)};  // logits ln3 (rounded to bf16) and 0
  GqaAttention(t.Params(1.f));
  const double s0 = F(B(std::log(3.f)));
  const double p0 = std::exp(s0) / (std::exp(s0) + 1.0);  // ~0.75
  EXPECT_NEAR(F(t.out[0]), p0, 4e-3);
  EXPECT_NEAR(F(t.out[1]), 1 - p0, 4e-3);
  EXPECT_NEAR(t.lse[0], std::log2(std::exp(s0) + 1.0), 1e-6);
}

// Bottom-right aligned causal mask: with kv_len 3 and q_len 2, row 0 sees keys 0..1, row 1 sees
// keys 0..2. With equal logits the output is the mean of the visible values.
TEST(ReferenceTest, CausalMaskIsBottomRightAligned) {
  TinyGqa t(2);
  t.SetToken(1, 0, 0.f, 0.f, 1.f, 0.f);
  t.SetToken(1, 1, 0.f, 0.f, 2.f, 0.f);
  t.SetToken(0, 0, 0.f, 0.f, 6.f, 0.f);
  t.qo_indptr = {0, 2};
  t.kv_indptr = {0, 2};
  t.kv_indices = {1, 0};  // token order: page 1 then page 0
  t.last_page_len = {1};
  t.q = {B(1.f), B(1.f), B(1.f), B(1.f)};
  GqaAttention(t.Params(1.f));
  EXPECT_EQ(F(t.out[0]), 1.5f);      // (1 + 2) / 2
  EXPECT_EQ(F(t.out[2]), 3.f);       // (1 + 2 + 6) / 3
  EXPECT_NEAR(t.lse[0], 1.0, 1e-6);  // log2(e^0 + e^0)
  EXPECT_NEAR(t.lse[1], std::log2(3.0), 1e-6);

  t.causal = false;
  GqaAttention(t.Params(1.f));
  EXPECT_EQ(F(t.out[0]), 3.f);
  EXPECT_EQ(F(t.out[2]), 3.f);
}

// q_len > kv_len: rows with i + kv_len - q_len < 0 see nothing; an empty sequence too.
TEST(ReferenceTest, RowsWithoutKeysAreZero) {
  TinyGqa t(1);
  t.SetToken(0, 0, 1.f, 1.f, 5.f, 7.f);
  t.qo_indptr = {0, 2, 3};
  t.kv_indptr = {0, 1, 1};
  t.kv_indices = {0};
  t.last_page_len = {1, 0};
  t.q.assign(3 * 2, B(1.f));
  GqaAttention(t.Params(1.f));
  EXPECT_EQ(F(t.out[0]), 0.f);
  EXPECT_EQ(F(t.out[1]), 0.f);
  EXPECT_EQ(t.lse[0], kEmptyRowLse);
  EXPECT_EQ(F(t.out[2]), 5.f);  // row 1 sees key 0
  EXPECT_EQ(F(t.out[3]), 7.f);
  EXPECT_NEAR(t.lse[1], 2.0 * kLog2e, 1e-6);
  EXPECT_EQ(F(t.out[4]), 0.f);  // empty sequence
  EXPECT_EQ(t.lse[2], kEmptyRowLse);
}

// Query heads 0, 1 use KV head 0... here one KV head serves two query heads (group 2).
TEST(ReferenceTest, GroupedHeadsShareTheKvHead) {
  TinyGqa t(1);
  t.num_qo_heads = 2;
  t.SetToken(0, 0, 1.f, 0.f, 1.f, 0.f);
  t.SetToken(0, 1, 0.f, 1.f, 0.f, 1.f);
  t.qo_indptr = {0, 1};
  t.kv_indptr = {0, 1};
  t.kv_indices = {0};
  t.last_page_len = {2};
  t.q = {B(8.f), B(0.f), B(0.f), B(8.f)};  // head 0 picks key 0, head 1 key 1
  GqaAttention(t.Params(4.f));
  EXPECT_NEAR(F(t.out[0]), 1.f, 1e-6);
  EXPECT_NEAR(F(t.out[1]), 0.f, 1e-6);
  EXPECT_NEAR(F(t.out[2]), 0.f, 1e-6);
  EXPECT_NEAR(F(t.out[3]), 1.f, 1e-6);
}

TEST(ReferenceTest, AppendWritesTheLastQLenPositions) {
  TinyGqa t(2);
  t.SetToken(0, 0, 1.f, 1.f, 1.f, 1.f);
  t.qo_indptr = {0, 2};
  t.kv_indptr = {0, 2};
  t.kv_indices = {0, 1};
  t.last_page_len = {1};  // kv_len 3: positions 1 and 2 are the new rows
  t.q.assign(2 * 2, B(0.f));
  t.k_new = {B(2.f), B(3.f), B(4.f), B(5.f)};
  t.v_new = {B(6.f), B(7.f), B(8.f), B(9.f)};
  GqaAppendKv(t.Params(1.f));
  EXPECT_EQ(F(t.cache[(0 * 2 + 0) * 4 + 1 * 2]), 2.f);      // page 0 slot 1: K row 0
  EXPECT_EQ(F(t.cache[(0 * 2 + 1) * 4 + 1 * 2 + 1]), 7.f);  // V row 0
  EXPECT_EQ(F(t.cache[(1 * 2 + 0) * 4 + 0]), 4.f);          // page 1 slot 0: K row 1
  EXPECT_EQ(F(t.cache[(1 * 2 + 1) * 4 + 1]), 9.f);
  EXPECT_TRUE(std::isnan(F(t.cache[(1 * 2 + 0) * 4 + 2])));  // page 1 slot 1 untouched
}

// MLA: one key; the output is the key's ckv part, the logit mixes ckv and kpe.
TEST(ReferenceTest, MlaOneKey) {
  std::vector<bf16> cache(kMlaTokenDim, B(0.f));
  cache[0] = B(1.f);
  cache[kMlaCkvDim] = B(2.f);
  cache[3] = B(-0.5f);
  std::vector<bf16> q_nope(kMlaCkvDim, B(0.f)), q_pe(kMlaKpeDim, B(0.f));
  q_nope[0] = B(1.f);
  q_pe[0] = B(1.f);
  std::vector<bf16> out(kMlaCkvDim, kBf16QuietNan);
  float lse = 0;
  const int32_t kv_indptr[] = {0, 1}, kv_indices[] = {0}, last[] = {1};
  MlaParams p;
  p.cache = {cache.data(), 1, 1, 1};
  p.batch.batch_size = 1;
  p.batch.total_q = 1;
  p.batch.kv_indptr = kv_indptr;
  p.batch.kv_indices = kv_indices;
  p.batch.kv_last_page_len = last;
  p.num_heads = 1;
  p.q_nope = q_nope.data();
  p.q_pe = q_pe.data();
  p.out = out.data();
  p.lse = &lse;
  p.sm_scale = 0.5f;
  MlaAttention(p);
  EXPECT_EQ(F(out[0]), 1.f);
  EXPECT_EQ(F(out[3]), -0.5f);
  EXPECT_EQ(F(out[1]), 0.f);
  EXPECT_NEAR(lse, 0.5 * (1 + 2) * kLog2e, 1e-6);  // s = 0.5 * (1*1 + 1*2)
}

}  // namespace
}  // namespace attn::reference
