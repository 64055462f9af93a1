// ZeroPages clears exactly the listed pages, in every layer, and nothing else.
#include <cuda_runtime_api.h>

#include <algorithm>
#include <cstdint>
#include <vector>

#include "gtest/gtest.h"
#include "kernels/cuda/api.h"
#include "kernels/testing/device_batch.h"

namespace attn::cuda {
namespace {

TEST(ZeroPagesTest, ClearsTheListedPagesOfEveryLayerOnly) {
  if (!testing::CudaDeviceAvailable()) GTEST_SKIP() << "no CUDA device";
  constexpr int kLayers = 3, kPages = 40;
  constexpr int64_t kPageBytes = 16 * 1152;  // an MLA page of 16 tokens
  const size_t total = size_t{kLayers} * kPages * kPageBytes;
  void* storage = nullptr;
  int32_t* ids = nullptr;
  ASSERT_EQ(cudaMalloc(&storage, total), cudaSuccess);
  ASSERT_EQ(cudaMemset(storage, 0xab, total), cudaSuccess);
  const std::vector<int32_t> listed = {0, 7, 8, 39, 21};
  ASSERT_EQ(cudaMalloc(reinterpret_cast<void**>(&ids), listed.size() * sizeof(int32_t)),
            cudaSuccess);
  ASSERT_EQ(cudaMemcpy(ids, listed.data(), listed.size() * sizeof(int32_t), cudaMemcpyHostToDevice),
            cudaSuccess);
  ASSERT_EQ(ZeroPages(storage, kLayers, kPages, kPageBytes, ids, static_cast<int>(listed.size()),
                      nullptr),
            cudaSuccess);
  std::vector<uint8_t> host(total);
  ASSERT_EQ(cudaMemcpy(host.data(), storage, total, cudaMemcpyDeviceToHost), cudaSuccess);
  for (int layer = 0; layer < kLayers; ++layer) {
    for (int page = 0; page < kPages; ++page) {
      const bool cleared = std::find(listed.begin(), listed.end(), page) != listed.end();
      const uint8_t* p = host.data() + (int64_t{layer} * kPages + page) * kPageBytes;
      int64_t wrong = 0;
      for (int64_t i = 0; i < kPageBytes; ++i) wrong += p[i] != (cleared ? 0 : 0xab);
      EXPECT_EQ(wrong, 0) << "layer " << layer << " page " << page;
    }
  }
  EXPECT_EQ(ZeroPages(storage, kLayers, kPages, 24, ids, 1, nullptr), cudaErrorInvalidValue);
  cudaFree(ids);
  cudaFree(storage);
}

}  // namespace
}  // namespace attn::cuda
