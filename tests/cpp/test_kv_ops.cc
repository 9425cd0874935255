#include <gtest/gtest.h>

#include <numeric>
#include <vector>

#include "pyspec/check.h"
#include "pyspec/kv_ops.h"

namespace pyspec {
namespace {

TEST(MaterializeKV, CopiesAcceptedRowsToSlots) {
  const int64_t S = 5, H = 3, D = 4, B = 4, bs = 2;
  std::vector<float> scratch(S * H * D);
  std::iota(scratch.begin(), scratch.end(), 0.f);
  std::vector<float> pages(B * bs * H * D, -1.f);
  std::vector<int32_t> src = {0, 2, 4};
  std::vector<int64_t> dst = {7, 0, 3};  // block 3 offset 1, block 0 offset 0, block 1 offset 1
  auto sv = TensorView::Contiguous(scratch.data(), DType::kFloat32, {S, H, D});
  auto pv = TensorView::Contiguous(pages.data(), DType::kFloat32, {B, bs, H, D});
  auto rv = TensorView::Contiguous(src.data(), DType::kInt32, {3});
  auto dv = TensorView::Contiguous(dst.data(), DType::kInt64, {3});
  MaterializeKV(sv, pv, rv, dv);
  for (int i = 0; i < 3; ++i) {
    for (int k = 0; k < H * D; ++k) {
      EXPECT_EQ(pages[dst[i] * H * D + k], scratch[src[i] * H * D + k]);
    }
  }
  int untouched = 0;
  for (float v : pages) untouched += v == -1.f;
  EXPECT_EQ(untouched, (B * bs - 3) * H * D);
}

TEST(MaterializeKV, LayerStackAndErrors) {
  const int64_t L = 2, S = 3, H = 1, D = 2, B = 2, bs = 2;
  std::vector<uint16_t> scratch(L * S * H * D);
  std::iota(scratch.begin(), scratch.end(), 1);
  std::vector<uint16_t> pages(L * B * bs * H * D, 0);
  std::vector<int64_t> src = {1}, dst = {2};
  auto sv = TensorView::Contiguous(scratch.data(), DType::kBFloat16, {L, S, H, D});
  auto pv = TensorView::Contiguous(pages.data(), DType::kBFloat16, {L, B, bs, H, D});
  auto rv = TensorView::Contiguous(src.data(), DType::kInt64, {1});
  auto dv = TensorView::Contiguous(dst.data(), DType::kInt64, {1});
  MaterializeKV(sv, pv, rv, dv);
  for (int l = 0; l < L; ++l) {
    for (int k = 0; k < D; ++k) {
      EXPECT_EQ(pages[(l * B * bs + 2) * D + k], scratch[(l * S + 1) * D + k]);
    }
  }
  dst[0] = B * bs;  // one past the pool
  EXPECT_THROW(MaterializeKV(sv, pv, rv, dv), ValueError);
  dst[0] = 0;
  src[0] = -1;
  EXPECT_THROW(MaterializeKV(sv, pv, rv, dv), ValueError);
  src[0] = 0;
  auto bad_pages = TensorView::Contiguous(pages.data(), DType::kFloat16, {L, B, bs, H, D});
  EXPECT_THROW(MaterializeKV(sv, bad_pages, rv, dv), ValueError);
  auto bad_shape = TensorView::Contiguous(pages.data(), DType::kBFloat16, {L, B, bs, H + 1, D - 1});
  EXPECT_THROW(MaterializeKV(sv, bad_shape, rv, dv), ValueError);
}

}  // namespace
}  // namespace pyspec
