// CheckFinite flags exactly the calls whose inputs hold a NaN or Inf, and the append then writes
// no row of a flagged call (and every row of the others).
#include <cuda_runtime_api.h>

#include <cstdint>
#include <cstring>
#include <vector>

#include "gtest/gtest.h"
#include "kernels/cuda/api.h"
#include "kernels/testing/device_batch.h"

namespace attn::cuda {
namespace {

using testing::DeviceBuffer;

bf16 Bits(uint16_t b) {
  bf16 x;
  std::memcpy(&x, &b, 2);
  return x;
}

uint16_t BitsOf(bf16 x) {
  uint16_t b;
  std::memcpy(&b, &x, 2);
  return b;
}

// `rows` rows of `width` bf16, all 1.0 or the largest finite magnitudes, with the listed
// (element, bits) set.
std::vector<bf16> Tensor(int64_t rows, int64_t width,
                         const std::vector<std::pair<int64_t, uint16_t>>& set) {
  std::vector<bf16> t(static_cast<size_t>(rows * width));
  for (size_t i = 0; i < t.size(); ++i)
    t[i] = Bits(i % 3 == 0 ? 0x7f7f : i % 3 == 1 ? 0xff7f : 0x3f80);
  for (const auto& [element, bits] : set) t[static_cast<size_t>(element)] = Bits(bits);
  return t;
}

std::vector<uint32_t> Refused(const std::vector<std::vector<bf16>>& tensors,
                              const std::vector<int64_t>& widths,
                              const std::vector<int32_t>& rows) {
  const int num_calls = static_cast<int>(rows.size()) - 1;
  std::vector<DeviceBuffer> data(tensors.size());
  std::vector<CheckedInput> inputs;
  for (size_t t = 0; t < tensors.size(); ++t) {
    EXPECT_EQ(data[t].Upload(tensors[t]), cudaSuccess);
    inputs.push_back({data[t].get<bf16>(), rows.back(), widths[t], uint32_t{1} << t});
  }
  DeviceBuffer call_rows, refused;
  EXPECT_EQ(call_rows.Upload(rows), cudaSuccess);
  EXPECT_EQ(refused.Upload(std::vector<uint32_t>(num_calls, 0)), cudaSuccess);
  const CallChecks checks{call_rows.get<int32_t>(), refused.get<uint32_t>(), num_calls};
  // A few SMs' worth of blocks: the large inputs go round the grid-stride loop many times.
  EXPECT_EQ(
      CheckFinite(inputs.data(), static_cast<int>(inputs.size()), checks, /*num_sms=*/4, nullptr),
      cudaSuccess);
  std::vector<uint32_t> out(num_calls);
  EXPECT_EQ(cudaMemcpy(out.data(), refused.get<uint32_t>(), num_calls * 4, cudaMemcpyDeviceToHost),
            cudaSuccess);
  return out;
}

TEST(CheckFiniteTest, FlagsTheCallsWithANonFiniteInput) {
  if (!testing::CudaDeviceAvailable()) GTEST_SKIP() << "no CUDA device";
  // Calls of rows [0, 3), [3, 7), [7, 10). Width 12: vectors of 8 straddle rows (and calls).
  const std::vector<int32_t> rows = {0, 3, 7, 10};
  const std::vector<int64_t> widths = {12, 12, 5};
  // Input 0: Inf in call 1's first element (row 3, element 36, inside a vector that starts in
  // row 2 of call 0). Input 1: NaN in call 2's last element. Input 2 (50 elements, a tail past
  // the last whole vector): -Inf in the tail, row 9 (call 2).
  const std::vector<uint32_t> got =
      Refused({Tensor(10, 12, {{36, 0x7f80}}), Tensor(10, 12, {{119, 0x7fc1}}),
               Tensor(10, 5, {{49, 0xff80}})},
              widths, rows);
  EXPECT_EQ(got, (std::vector<uint32_t>{0, 1, 2 | 4}));
  // Finite everywhere: nothing flagged.
  EXPECT_EQ(Refused({Tensor(10, 12, {}), Tensor(10, 12, {}), Tensor(10, 5, {})}, widths, rows),
            (std::vector<uint32_t>{0, 0, 0}));
  // A large input: every position of its last vectors is found.
  for (int64_t e : {int64_t{0}, int64_t{1} << 20, (int64_t{1} << 21) - 1}) {
    const std::vector<uint32_t> big =
        Refused({Tensor(2048, 1024, {{e, 0xffc0}})}, {1024}, {0, 1024, 2048});
    EXPECT_EQ(big, (std::vector<uint32_t>{e < (1 << 20) ? 1u : 0u, e < (1 << 20) ? 0u : 1u})) << e;
  }
}

TEST(CheckFiniteTest, TheAppendSkipsRefusedCalls) {
  if (!testing::CudaDeviceAvailable()) GTEST_SKIP() << "no CUDA device";
  // A decode batch of 3 sequences of one page each (page size 4, 2 tokens), one call each; the new
  // row lands in slot 1 of each sequence's page.
  GqaCache cache;
  cache.num_layers = 1;
  cache.num_pages = 3;
  cache.page_size = 4;
  cache.num_kv_heads = 2;
  cache.head_dim = 8;
  const int64_t width = cache.TokenStride();
  DeviceBuffer storage, k_new, v_new, kv_indptr, kv_indices, last, call_rows, refused;
  const std::vector<bf16> zeros(static_cast<size_t>(cache.NumElements()), Bits(0));
  ASSERT_EQ(storage.Upload(zeros), cudaSuccess);
  ASSERT_EQ(k_new.Upload(Tensor(3, width, {})), cudaSuccess);
  ASSERT_EQ(v_new.Upload(Tensor(3, width, {})), cudaSuccess);
  ASSERT_EQ(kv_indptr.Upload(std::vector<int32_t>{0, 1, 2, 3}), cudaSuccess);
  ASSERT_EQ(kv_indices.Upload(std::vector<int32_t>{2, 0, 1}), cudaSuccess);
  ASSERT_EQ(last.Upload(std::vector<int32_t>{2, 2, 2}), cudaSuccess);
  ASSERT_EQ(call_rows.Upload(std::vector<int32_t>{0, 1, 2, 3}), cudaSuccess);
  ASSERT_EQ(refused.Upload(std::vector<uint32_t>{0, kFiniteKNew, 0}), cudaSuccess);
  GqaParams p;
  cache.data = storage.get<bf16>();
  p.cache = cache;
  p.num_qo_heads = 2;
  p.batch.batch_size = 3;
  p.batch.total_q = 3;
  p.batch.kv_indptr = kv_indptr.get<int32_t>();
  p.batch.kv_indices = kv_indices.get<int32_t>();
  p.batch.kv_last_page_len = last.get<int32_t>();
  p.k_new = k_new.get<bf16>();
  p.v_new = v_new.get<bf16>();
  const CallChecks checks{call_rows.get<int32_t>(), refused.get<uint32_t>(), 3};
  ASSERT_EQ(GqaAppendKv(p, checks, nullptr), cudaSuccess);
  std::vector<bf16> got(zeros.size());
  ASSERT_EQ(cudaMemcpy(got.data(), storage.get<bf16>(), got.size() * 2, cudaMemcpyDeviceToHost),
            cudaSuccess);
  // Sequence b's page: kv_indices[b]. Sequence 1 (page 0) was refused: its page stays zero.
  for (int page = 0; page < 3; ++page) {
    const bool written = page != 0;
    for (int kv = 0; kv < 2; ++kv) {
      const int64_t slot1 = page * cache.PageStride() + kv * cache.page_size * width + width;
      int64_t nonzero = 0;
      for (int64_t i = 0; i < width; ++i) nonzero += BitsOf(got[slot1 + i]) != 0;
      EXPECT_EQ(nonzero, written ? width : 0) << "page " << page << (kv ? " V" : " K");
    }
  }
}

}  // namespace
}  // namespace attn::cuda
