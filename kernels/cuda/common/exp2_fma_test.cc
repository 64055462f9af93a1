// Exp2Fma against the library's exp2, on the host (the device runs the same arithmetic).
#include "kernels/cuda/common/exp2_fma.h"

#include <cmath>
#include <limits>

#include "gtest/gtest.h"

namespace attn::cuda {
namespace {

TEST(Exp2FmaTest, WithinItsBoundOverTheSoftmaxRange) {
  double worst = 0;
  for (int i = 0; i <= 2'000'000; ++i) {
    const float x = -125.f + 126.f * static_cast<float>(i) / 2'000'000.f;  // [-125, 1]
    const double want = std::exp2(static_cast<double>(x));
    worst = std::max(worst, std::abs(Exp2Fma(x) / want - 1));
  }
  EXPECT_LT(worst, 7.6e-5);
}

TEST(Exp2FmaTest, IntegersAndHalves) {
  for (int j = -125; j <= 127; ++j) {
    const float x = static_cast<float>(j);
    EXPECT_NEAR(Exp2Fma(x) / std::exp2(x), 1.0, 7.6e-5) << x;
    if (j < 127) {
      EXPECT_NEAR(Exp2Fma(x + 0.5f) / std::exp2(x + 0.5f), 1.0, 7.6e-5) << x;
    }
  }
}

TEST(Exp2FmaTest, MaskedAndNonFinite) {
  EXPECT_EQ(Exp2Fma(-std::numeric_limits<float>::infinity()), 0.f);
  EXPECT_EQ(Exp2Fma(-200.f), 0.f);
  EXPECT_EQ(Exp2Fma(-127.5f), 0.f);
  EXPECT_GE(Exp2Fma(-126.9f), 0.f);
  EXPECT_LT(Exp2Fma(-126.9f), 1e-37f);
  EXPECT_TRUE(std::isnan(Exp2Fma(std::numeric_limits<float>::quiet_NaN())));
}

}  // namespace
}  // namespace attn::cuda
