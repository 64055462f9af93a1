#include "server/api/validate.h"

#include <cmath>
#include <cstring>
#include <functional>
#include <limits>
#include <string>

#include "absl/strings/str_cat.h"
#include "gtest/gtest.h"

namespace attn {
namespace {

using v1::DecodeRequest;
using v1::PrefillRequest;

PoolGeometry GqaPool() {
  return PoolGeometry::Gqa("gqa", /*num_layers=*/2, /*page_size=*/4, /*num_qo_heads=*/8,
                           /*num_kv_heads=*/2, /*head_dim=*/64, /*num_pages=*/32);
}

PoolGeometry MlaPool() {
  return PoolGeometry::Mla("mla", /*num_layers=*/2, /*page_size=*/4, /*num_heads=*/16,
                           /*num_pages=*/32);
}

void SetBf16(v1::Tensor* t, std::initializer_list<int64_t> shape) {
  t->set_dtype(v1::DTYPE_BF16);
  int64_t n = 1;
  for (int64_t d : shape) {
    t->add_shape(d);
    n *= d;
  }
  t->set_data(std::string(n * 2, '\0'));
}

// Two sequences: q_len 3 on kv_len 6 (pages 0, 1), q_len 2 on kv_len 9 (pages 2, 3, 4).
PrefillRequest ValidGqaPrefill() {
  PrefillRequest r;
  r.set_pool("gqa");
  r.set_layer(1);
  SetBf16(r.mutable_q(), {5, 8, 64});
  SetBf16(r.mutable_k_new(), {5, 2, 64});
  SetBf16(r.mutable_v_new(), {5, 2, 64});
  for (int v : {0, 3, 5}) r.add_qo_indptr(v);
  for (int v : {0, 2, 5}) r.add_kv_indptr(v);
  for (int v : {0, 1, 2, 3, 4}) r.add_kv_indices(v);
  for (int v : {2, 1}) r.add_kv_last_page_len(v);
  r.set_return_lse(true);
  return r;
}

DecodeRequest ValidMlaDecode() {
  DecodeRequest r;
  r.set_pool("mla");
  r.set_layer(0);
  SetBf16(r.mutable_q(), {2, 16, 512});
  SetBf16(r.mutable_q_pe(), {2, 16, 64});
  SetBf16(r.mutable_ckv_new(), {2, 512});
  SetBf16(r.mutable_kpe_new(), {2, 64});
  for (int v : {0, 1, 3}) r.add_kv_indptr(v);
  for (int v : {5, 6, 7}) r.add_kv_indices(v);
  for (int v : {4, 2}) r.add_kv_last_page_len(v);
  r.set_sm_scale(0.1352337747812271f);
  return r;
}

class ValidateTest : public ::testing::Test {
 protected:
  PoolGeometry gqa_ = GqaPool();
  PoolGeometry mla_ = MlaPool();
};

TEST_F(ValidateTest, AcceptsValidGqaPrefill) {
  PrefillRequest r = ValidGqaPrefill();
  auto call = ValidatePrefill(r, gqa_);
  ASSERT_TRUE(call.ok()) << call.status();
  EXPECT_EQ(call->batch_size, 2);
  EXPECT_EQ(call->total_q, 5);
  EXPECT_EQ(call->layer, 1);
  EXPECT_TRUE(call->appends());
  EXPECT_TRUE(call->return_lse);
  EXPECT_FLOAT_EQ(call->sm_scale, 1.0f / 8.0f);  // 1/sqrt(64) by default
  EXPECT_EQ(call->kv_last_page_len, (std::vector<int32_t>{2, 1}));
  // Rows 3..5 of sequence 0 land in its pages 0 and 1, rows 7..8 of sequence 1 in pages 3 and 4.
  EXPECT_EQ(call->append_pages, (std::vector<int64_t>{AppendKey(0, 1), AppendKey(1, 1),
                                                      AppendKey(3, 1), AppendKey(4, 1)}));
}

TEST_F(ValidateTest, AppendedPagesBelongToOneSequence) {
  // Sequence 1 reading sequence 0's page 0 as a shared prefix is fine...
  PrefillRequest shared = ValidGqaPrefill();
  shared.set_kv_indices(2, 0);  // sequence 1: pages 0, 3, 4
  auto call = ValidatePrefill(shared, gqa_);
  ASSERT_TRUE(call.ok()) << call.status();
  EXPECT_EQ(call->append_pages.size(), 4u);

  // ...appending to it is not: the two sequences would write the same page.
  PrefillRequest both = ValidGqaPrefill();
  both.set_kv_indices(3, 1);  // sequence 1: pages 2, 1, 4; its row 7 lands in page 1
  auto bad = ValidatePrefill(both, gqa_);
  ASSERT_FALSE(bad.ok());
  EXPECT_EQ(bad.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(bad.status().message().find("sequences 0 and 1 both append to page 1"),
            std::string::npos)
      << bad.status();

  PrefillRequest twice = ValidGqaPrefill();
  twice.set_kv_indices(1, 0);  // sequence 0: pages 0, 0
  auto bad_twice = ValidatePrefill(twice, gqa_);
  ASSERT_FALSE(bad_twice.ok());
  EXPECT_NE(bad_twice.status().message().find("sequence 0 appends to page 0 at two positions"),
            std::string::npos)
      << bad_twice.status();
}

TEST_F(ValidateTest, AcceptsValidMlaDecode) {
  DecodeRequest r = ValidMlaDecode();
  auto call = ValidateDecode(r, mla_);
  ASSERT_TRUE(call.ok()) << call.status();
  EXPECT_EQ(call->batch_size, 2);
  EXPECT_EQ(call->total_q, 2);
  EXPECT_TRUE(call->qo_indptr.empty());
  EXPECT_TRUE(call->q_pe.present);
  EXPECT_FLOAT_EQ(call->sm_scale, 0.1352337747812271f);
}

TEST_F(ValidateTest, AcceptsTrailingLastPageLenAndEmptySequences) {
  PrefillRequest r = ValidGqaPrefill();
  r.add_kv_last_page_len(0);  // batch + 1 entries: the last is ignored
  ASSERT_TRUE(ValidatePrefill(r, gqa_).ok());

  // A third sequence without pages and without query rows.
  PrefillRequest e = ValidGqaPrefill();
  e.add_qo_indptr(5);
  e.add_kv_indptr(5);
  e.add_kv_last_page_len(0);
  auto call = ValidatePrefill(e, gqa_);
  ASSERT_TRUE(call.ok()) << call.status();
  EXPECT_EQ(call->kv_last_page_len.back(), 0);
}

TEST_F(ValidateTest, PageSizeOneMayOmitLastPageLen) {
  PoolGeometry g = GqaPool();
  g.page_size = 1;
  PrefillRequest r = ValidGqaPrefill();
  r.clear_kv_last_page_len();  // kv_len = 2 and 3 pages of one token: q_len 3 > 2 must fail
  EXPECT_EQ(ValidatePrefill(r, g).status().code(), absl::StatusCode::kInvalidArgument);
  r.clear_kv_indptr();
  for (int v : {0, 3, 5}) r.add_kv_indptr(v);
  auto call = ValidatePrefill(r, g);
  ASSERT_TRUE(call.ok()) << call.status();
  EXPECT_EQ(call->kv_last_page_len, (std::vector<int32_t>{1, 1}));
}

struct BadCase {
  std::string name;
  std::function<void(PrefillRequest&)> mutate;
  absl::StatusCode code;
  std::string message_part;  // the field the message must name
};

class BadPrefillTest : public ValidateTest, public ::testing::WithParamInterface<BadCase> {};

TEST_P(BadPrefillTest, RejectsNamingTheField) {
  const BadCase& c = GetParam();
  PrefillRequest r = ValidGqaPrefill();
  c.mutate(r);
  auto call = ValidatePrefill(r, gqa_);
  ASSERT_FALSE(call.ok()) << c.name;
  EXPECT_EQ(call.status().code(), c.code) << call.status();
  EXPECT_NE(call.status().message().find(c.message_part), std::string::npos) << call.status();
}

const auto kInvalid = absl::StatusCode::kInvalidArgument;

INSTANTIATE_TEST_SUITE_P(
    Table, BadPrefillTest,
    ::testing::Values(
        BadCase{"layer_negative", [](PrefillRequest& r) { r.set_layer(-1); }, kInvalid, "layer"},
        BadCase{"layer_too_big", [](PrefillRequest& r) { r.set_layer(2); }, kInvalid, "layer"},
        BadCase{"q_fp32", [](PrefillRequest& r) { r.mutable_q()->set_dtype(v1::DTYPE_FP32); },
                kInvalid, "q: dtype"},
        BadCase{"q_unspecified_dtype",
                [](PrefillRequest& r) { r.mutable_q()->set_dtype(v1::DTYPE_UNSPECIFIED); },
                kInvalid, "q: dtype"},
        BadCase{"q_wrong_heads", [](PrefillRequest& r) { r.mutable_q()->set_shape(1, 4); },
                kInvalid, "num_qo_heads"},
        BadCase{"q_wrong_rank",
                [](PrefillRequest& r) { r.mutable_q()->mutable_shape()->RemoveLast(); }, kInvalid,
                "q: shape"},
        BadCase{"q_short_data",
                [](PrefillRequest& r) { r.mutable_q()->mutable_data()->pop_back(); }, kInvalid,
                "q: data"},
        BadCase{"q_missing", [](PrefillRequest& r) { r.clear_q(); }, kInvalid, "q: dtype"},
        BadCase{"k_without_v", [](PrefillRequest& r) { r.clear_v_new(); }, kInvalid, "v_new"},
        BadCase{"k_wrong_heads", [](PrefillRequest& r) { r.mutable_k_new()->set_shape(1, 8); },
                kInvalid, "k_new"},
        BadCase{"v_wrong_rows", [](PrefillRequest& r) { r.mutable_v_new()->set_shape(0, 4); },
                kInvalid, "v_new"},
        BadCase{"mla_field_on_gqa",
                [](PrefillRequest& r) {
                  SetBf16(r.mutable_q_pe(), {5, 8, 64});
                },
                kInvalid, "MLA"},
        BadCase{"qo_indptr_empty", [](PrefillRequest& r) { r.clear_qo_indptr(); }, kInvalid,
                "qo_indptr"},
        BadCase{"qo_indptr_not_zero_first", [](PrefillRequest& r) { r.set_qo_indptr(0, 1); },
                kInvalid, "qo_indptr[0]"},
        BadCase{"qo_indptr_decreasing", [](PrefillRequest& r) { r.set_qo_indptr(1, 6); }, kInvalid,
                "qo_indptr[2]"},
        BadCase{"qo_indptr_negative_total", [](PrefillRequest& r) { r.set_qo_indptr(2, -5); },
                kInvalid, "total_q"},
        BadCase{"kv_indptr_wrong_size", [](PrefillRequest& r) { r.add_kv_indptr(5); }, kInvalid,
                "kv_indptr"},
        BadCase{"kv_indptr_decreasing", [](PrefillRequest& r) { r.set_kv_indptr(1, 6); }, kInvalid,
                "kv_indptr[2]"},
        BadCase{"kv_indptr_not_matching_indices", [](PrefillRequest& r) { r.add_kv_indices(5); },
                kInvalid, "len(kv_indices)"},
        BadCase{"last_page_len_zero", [](PrefillRequest& r) { r.set_kv_last_page_len(0, 0); },
                kInvalid, "kv_last_page_len[0] = 0"},
        BadCase{"last_page_len_above_page", [](PrefillRequest& r) { r.set_kv_last_page_len(1, 5); },
                kInvalid, "kv_last_page_len[1] = 5"},
        BadCase{"last_page_len_wrong_count",
                [](PrefillRequest& r) { r.mutable_kv_last_page_len()->RemoveLast(); }, kInvalid,
                "kv_last_page_len has 1"},
        BadCase{"sm_scale_nan",
                [](PrefillRequest& r) { r.set_sm_scale(std::numeric_limits<float>::quiet_NaN()); },
                kInvalid, "sm_scale"},
        BadCase{"sm_scale_inf",
                [](PrefillRequest& r) { r.set_sm_scale(std::numeric_limits<float>::infinity()); },
                kInvalid, "sm_scale"},
        BadCase{"append_longer_than_kv",
                [](PrefillRequest& r) {
                  // Sequence 0 keeps 3 query rows but its table shrinks to one page of 2 tokens.
                  r.set_kv_last_page_len(0, 2);
                  r.set_kv_indptr(1, 1);
                  r.mutable_kv_indices()->RemoveLast();
                  r.set_kv_indptr(2, 4);
                },
                kInvalid, "sequence 0 appends 3 tokens"}),
    [](const ::testing::TestParamInfo<BadCase>& info) { return info.param.name; });

// A page table may name a page more than once, but no sequence can hold more pages than the pool:
// otherwise a few bytes per entry on the wire would overflow int32 kv_len in the kernels.
TEST_F(ValidateTest, RejectsSequencesLongerThanThePool) {
  DecodeRequest r = ValidMlaDecode();  // pool of 32 pages
  r.set_kv_indptr(2, 1 + 33);
  for (int i = 0; i < 31; ++i) r.add_kv_indices(0);
  ASSERT_EQ(r.kv_indices_size(), 34);
  auto call = ValidateDecode(r, mla_);
  ASSERT_FALSE(call.ok());
  EXPECT_EQ(call.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(call.status().message().find("sequence 1 has 33 pages"), std::string::npos)
      << call.status();
  r.mutable_kv_indices()->RemoveLast();  // 32 pages (all of them, page 0 repeated) is allowed
  r.set_kv_indptr(2, 1 + 32);
  EXPECT_TRUE(ValidateDecode(r, mla_).ok()) << ValidateDecode(r, mla_).status();
}

// The client's shape is echoed in the message, but not all of it: a hostile one with thousands of
// dimensions would make the error message larger than gRPC's metadata limit.
TEST_F(ValidateTest, LongShapesAreShortenedInMessages) {
  PrefillRequest r = ValidGqaPrefill();
  for (int i = 0; i < 10000; ++i) r.mutable_q()->add_shape(123456789);
  auto call = ValidatePrefill(r, gqa_);
  ASSERT_FALSE(call.ok());
  EXPECT_EQ(call.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(call.status().message().find("(10003 dimensions)"), std::string::npos) << call.status();
  EXPECT_LT(call.status().message().size(), 300u) << call.status();
}

TEST_F(ValidateTest, MlaRejectsMissingScaleAndGqaFields) {
  DecodeRequest no_scale = ValidMlaDecode();
  no_scale.clear_sm_scale();
  auto st = ValidateDecode(no_scale, mla_).status();
  EXPECT_EQ(st.code(), kInvalid);
  EXPECT_NE(st.message().find("sm_scale is required"), std::string::npos);

  DecodeRequest gqa_fields = ValidMlaDecode();
  SetBf16(gqa_fields.mutable_k_new(), {2, 1, 512});
  EXPECT_EQ(ValidateDecode(gqa_fields, mla_).status().code(), kInvalid);

  DecodeRequest no_pe = ValidMlaDecode();
  no_pe.clear_q_pe();
  EXPECT_EQ(ValidateDecode(no_pe, mla_).status().code(), kInvalid);

  DecodeRequest half_append = ValidMlaDecode();
  half_append.clear_kpe_new();
  EXPECT_EQ(ValidateDecode(half_append, mla_).status().code(), kInvalid);

  DecodeRequest bad_rows = ValidMlaDecode();
  bad_rows.mutable_q()->set_shape(0, 3);
  EXPECT_EQ(ValidateDecode(bad_rows, mla_).status().code(), kInvalid);
}

TEST_F(ValidateTest, DecodeNeedsAtLeastOneSequence) {
  DecodeRequest r = ValidMlaDecode();
  r.clear_kv_indptr();
  EXPECT_EQ(ValidateDecode(r, mla_).status().code(), kInvalid);
  r.add_kv_indptr(0);
  EXPECT_EQ(ValidateDecode(r, mla_).status().code(), kInvalid);
}

TEST_F(ValidateTest, WithoutAppendRowsMayOutnumberKeys) {
  // q_len > kv_len is legal when nothing is appended: the early rows see no key.
  PrefillRequest r = ValidGqaPrefill();
  r.clear_k_new();
  r.clear_v_new();
  r.set_kv_last_page_len(0, 1);
  r.set_kv_indptr(1, 0);
  r.set_kv_indices(0, 0);
  r.clear_kv_indices();
  for (int v : {2, 3, 4}) r.add_kv_indices(v);
  r.set_kv_indptr(2, 3);
  auto call = ValidatePrefill(r, gqa_);
  ASSERT_TRUE(call.ok()) << call.status();
  EXPECT_FALSE(call->appends());
}

}  // namespace
}  // namespace attn

namespace attn {
namespace {

// Sets element `i` of a bf16 tensor's data to `bits`.
void SetElement(v1::Tensor* t, size_t i, uint16_t bits) {
  std::memcpy(t->mutable_data()->data() + 2 * i, &bits, 2);
}

TEST(ValidateFiniteTest, NonFiniteInputsAreRefusedNamingTheElement) {
  const PoolGeometry gqa = GqaPool(), mla = MlaPool();
  struct Case {
    const char* field;
    uint16_t bits;
    const char* what;
  };
  for (const Case& c : {Case{"k_new", 0x7fc0, "NaN"}, Case{"v_new", 0x7f80, "Inf"},
                        Case{"q", 0xff80, "Inf"}, Case{"q", 0xffc1, "NaN"}}) {
    PrefillRequest r = ValidGqaPrefill();
    v1::Tensor* t = std::string(c.field) == "q"       ? r.mutable_q()
                    : std::string(c.field) == "k_new" ? r.mutable_k_new()
                                                      : r.mutable_v_new();
    SetElement(t, 77, c.bits);
    absl::StatusOr<AttentionCall> call = ValidatePrefill(r, gqa);
    ASSERT_EQ(call.status().code(), absl::StatusCode::kInvalidArgument) << c.field;
    EXPECT_NE(call.status().message().find(absl::StrCat(c.field, ": element 77 is ", c.what)),
              std::string::npos)
        << call.status();
  }
  // The largest finite values pass.
  PrefillRequest big = ValidGqaPrefill();
  SetElement(big.mutable_k_new(), 3, 0x7f7f);
  SetElement(big.mutable_q(), 4, 0xff7f);
  EXPECT_TRUE(ValidatePrefill(big, gqa).ok());
  // MLA names its own fields.
  DecodeRequest d = ValidMlaDecode();
  SetElement(d.mutable_kpe_new(), 1, 0x7f80);
  EXPECT_NE(ValidateDecode(d, mla).status().message().find("kpe_new: element 1"),
            std::string::npos);
}

// The scan reads four elements at a time: a non-finite value is found in every lane and in the
// tail, and the largest finite values never look like one.
TEST(ValidateFiniteTest, EveryPositionIsChecked) {
  const PoolGeometry gqa = GqaPool();
  const size_t n = ValidGqaPrefill().q().data().size() / 2;
  for (size_t i = 0; i < n; ++i) {
    for (uint16_t bits : {uint16_t{0x7f80}, uint16_t{0xff80}, uint16_t{0x7fc1}}) {
      PrefillRequest r = ValidGqaPrefill();
      SetElement(r.mutable_q(), i, bits);
      EXPECT_NE(ValidatePrefill(r, gqa).status().message().find(absl::StrCat("q: element ", i)),
                std::string::npos)
          << i;
    }
  }
  PrefillRequest big = ValidGqaPrefill();
  for (size_t i = 0; i < n; ++i) SetElement(big.mutable_q(), i, i % 2 ? 0x7f7f : 0xff7f);
  EXPECT_TRUE(ValidatePrefill(big, gqa).ok());
}

// A backend that checks on the device (FiniteCheck::kBackend) gets the call unscanned.
TEST(ValidateFiniteTest, TheBackendMayCheckInstead) {
  PrefillRequest r = ValidGqaPrefill();
  SetElement(r.mutable_k_new(), 5, 0x7fc0);
  const InlineTensors data = InlineTensorsOf(r);
  EXPECT_EQ(ValidatePrefill(r, data, GqaPool(), {}).status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_TRUE(ValidatePrefill(r, data, GqaPool(), {}, FiniteCheck::kBackend).ok());
}

}  // namespace
}  // namespace attn

namespace attn {
namespace {

// A message's slices may split an element; the check must not read across the split.
TEST(ValidateFiniteTest, ElementsSplitAcrossPiecesAreReadWhole) {
  PrefillRequest r = ValidGqaPrefill();
  std::string& q = *r.mutable_q()->mutable_data();
  for (size_t i = 0; i < q.size(); i += 2) {
    q[i] = '\x80';  // 0x3f80 = 1.0: across an odd split the bytes would read 0x803f / 0x3f80...
    q[i + 1] = '\x3f';
  }
  q[1] = '\x7f';  // ...and element 0 is 0x7f80, Inf
  InlineTensors data = InlineTensorsOf(r);
  // Odd pieces in separate buffers (adjacent ranges would merge into one piece).
  HostBytes split;
  std::string rest = q.substr(7);
  std::string first = q.substr(0, 1), second = q.substr(1, 6);
  split.Append(first.data(), first.size());
  split.Append(second.data(), second.size());
  split.Append(rest.data(), rest.size());
  data.mutable_of(3) = split;
  absl::StatusOr<ValidatedCall> v = ValidatePrefill(r, data, GqaPool(), {});
  ASSERT_EQ(v.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(v.status().message().find("q: element 0 is Inf"), std::string::npos) << v.status();
  q[1] = '\x3f';  // all 1.0 now: finite however it is split
  first = q.substr(0, 1);
  second = q.substr(1, 6);
  rest = q.substr(7);
  split = HostBytes();
  split.Append(first.data(), first.size());
  split.Append(second.data(), second.size());
  split.Append(rest.data(), rest.size());
  data.mutable_of(3) = split;
  EXPECT_TRUE(ValidatePrefill(r, data, GqaPool(), {}).ok());
}

}  // namespace
}  // namespace attn
