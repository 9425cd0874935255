// The CPU sampling filters (pyspec/acceptance.h, cpp/src/sampling_filters.cc).
#include "pyspec/acceptance.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <numeric>
#include <random>
#include <vector>

#include "pyspec/check.h"
#include "pyspec/thread_pool.h"

namespace pyspec {
namespace {

// ---- sampling filters -----------------------------------------------------------------------------

std::vector<float> Filter(const std::vector<float>& logits, int64_t vocab, float t, int32_t k, float p,
                          float m) {
  const int64_t n = static_cast<int64_t>(logits.size()) / vocab;
  std::vector<float> temp(n, t), tp(n, p), mp(n, m), out(n * vocab, -1.0f);
  std::vector<int32_t> tk(n, k);
  std::vector<float> in = logits;
  ApplySamplingFilters(TensorView::Contiguous(in.data(), DType::kFloat32, {n, vocab}),
                       TensorView::Contiguous(temp.data(), DType::kFloat32, {n}),
                       TensorView::Contiguous(tk.data(), DType::kInt32, {n}),
                       TensorView::Contiguous(tp.data(), DType::kFloat32, {n}),
                       TensorView::Contiguous(mp.data(), DType::kFloat32, {n}),
                       TensorView::Contiguous(out.data(), DType::kFloat32, {n, vocab}));
  return out;
}

int CountNonZero(const std::vector<float>& v) {
  return static_cast<int>(std::count_if(v.begin(), v.end(), [](float x) { return x != 0.0f; }));
}

TEST(AcceptFilters, TemperatureZeroIsOneHotAtLowestArgmax) {
  std::vector<float> out = Filter({1.0f, 3.0f, 3.0f, -2.0f}, 4, 0.0f, 2, 0.5f, 0.1f);
  EXPECT_EQ(out, (std::vector<float>{0.0f, 1.0f, 0.0f, 0.0f}));
}

TEST(AcceptFilters, NoFilterIsSoftmaxOfTemperedLogits) {
  std::vector<float> logits = {0.5f, -1.0f, 2.0f, 0.0f, -INFINITY};
  std::vector<float> out = Filter(logits, 5, 0.7f, 0, 1.0f, 0.0f);
  double z = 0;
  for (int v = 0; v < 4; ++v) z += std::exp(logits[v] / 0.7);
  for (int v = 0; v < 4; ++v) EXPECT_NEAR(out[v], std::exp(logits[v] / 0.7) / z, 1e-6);
  EXPECT_EQ(out[4], 0.0f);
}

TEST(AcceptFilters, TopKKeepsExactlyKWithLowIdsOnTies) {
  std::mt19937 rng(1);
  const int64_t V = 97;
  for (int32_t k : {1, 2, 5, 50, 96}) {
    std::vector<float> logits(V);
    for (float& x : logits) x = static_cast<float>(rng() % 7);  // many ties
    std::vector<float> out = Filter(logits, V, 1.3f, k, 1.0f, 0.0f);
    EXPECT_EQ(CountNonZero(out), k);
    // Reference: stable order by (logit desc, id asc), first k.
    std::vector<int> ids(V);
    std::iota(ids.begin(), ids.end(), 0);
    std::stable_sort(ids.begin(), ids.end(), [&](int a, int b) { return logits[a] > logits[b]; });
    for (int i = 0; i < V; ++i) EXPECT_EQ(out[ids[i]] != 0.0f, i < k) << "k=" << k << " rank " << i;
    EXPECT_NEAR(std::accumulate(out.begin(), out.end(), 0.0), 1.0, 1e-5);
  }
}

TEST(AcceptFilters, TopPBoundaryKeepsTheCrossingToken) {
  // probs (T=1) proportional to 4, 3, 2, 1 -> 0.4, 0.3, 0.2, 0.1.
  std::vector<float> logits = {std::log(3.0f), std::log(1.0f), std::log(4.0f), std::log(2.0f)};
  auto kept = [&](float p) { return CountNonZero(Filter(logits, 4, 1.0f, 0, p, 0.0f)); };
  EXPECT_EQ(kept(0.05f), 1);
  EXPECT_EQ(kept(0.39f), 1);
  EXPECT_EQ(kept(0.41f), 2);  // 0.4 < 0.41: the 0.3 token crosses it and is kept
  EXPECT_EQ(kept(0.69f), 2);
  EXPECT_EQ(kept(0.71f), 3);
  EXPECT_EQ(kept(0.95f), 4);
  std::vector<float> out = Filter(logits, 4, 1.0f, 0, 0.6f, 0.0f);
  EXPECT_NEAR(out[2], 4.0 / 7.0, 1e-6);
  EXPECT_NEAR(out[0], 3.0 / 7.0, 1e-6);
}

TEST(AcceptFilters, TopPMatchesSortedReferenceOnLargeRows) {
  std::mt19937 rng(2);
  std::normal_distribution<float> normal(0.0f, 2.0f);
  const int64_t V = 5000;
  for (float p : {0.1f, 0.5f, 0.9f, 0.999f}) {
    std::vector<float> logits(V);
    for (float& x : logits) x = normal(rng);
    std::vector<float> out = Filter(logits, V, 0.9f, 0, p, 0.0f);
    std::vector<int> ids(V);
    std::iota(ids.begin(), ids.end(), 0);
    std::stable_sort(ids.begin(), ids.end(), [&](int a, int b) { return logits[a] > logits[b]; });
    double z = 0, cum = 0;
    for (float x : logits) z += std::exp(x / 0.9);
    int expect = 0;
    while (cum < p * z) cum += std::exp(logits[ids[expect++]] / 0.9);
    EXPECT_EQ(CountNonZero(out), expect) << "p=" << p;
    for (int i = 0; i < expect; ++i) EXPECT_NE(out[ids[i]], 0.0f);
  }
}

TEST(AcceptFilters, TopKThenTopPThenMinP) {
  // probs 0.4, 0.3, 0.2, 0.1 (ids 2, 0, 3, 1).
  std::vector<float> logits = {std::log(3.0f), std::log(1.0f), std::log(4.0f), std::log(2.0f)};
  // top-k 3 -> {.4,.3,.2}/.9; top-p .75 on that: .444, .777 -> keeps 2 tokens.
  EXPECT_EQ(CountNonZero(Filter(logits, 4, 1.0f, 3, 0.75f, 0.0f)), 2);
  // min-p 0.45: keep p >= 0.18 -> ids 2, 0, 3.
  std::vector<float> out = Filter(logits, 4, 1.0f, 0, 1.0f, 0.45f);
  EXPECT_EQ(out[1], 0.0f);
  EXPECT_NEAR(out[2], 4.0 / 9.0, 1e-6);
  // min-p 0.76 keeps only the top token (0.3 / 0.4 = 0.75 < 0.76).
  EXPECT_EQ(CountNonZero(Filter(logits, 4, 1.0f, 0, 1.0f, 0.76f)), 1);
}

TEST(AcceptFilters, HalfAndBFloat16Inputs) {
  // 1.0, 2.0, -inf in fp16 and bf16.
  std::vector<uint16_t> half = {0x3C00, 0x4000, 0xFC00}, bf16 = {0x3F80, 0x4000, 0xFF80};
  std::vector<float> temp = {1.0f}, tp = {1.0f}, mp = {0.0f};
  std::vector<int32_t> tk = {0};
  for (auto* in : {&half, &bf16}) {
    std::vector<float> out(3);
    ApplySamplingFilters(
        TensorView::Contiguous(in->data(), in == &half ? DType::kFloat16 : DType::kBFloat16, {1, 3}),
        TensorView::Contiguous(temp.data(), DType::kFloat32, {1}),
        TensorView::Contiguous(tk.data(), DType::kInt32, {1}),
        TensorView::Contiguous(tp.data(), DType::kFloat32, {1}),
        TensorView::Contiguous(mp.data(), DType::kFloat32, {1}),
        TensorView::Contiguous(out.data(), DType::kFloat32, {1, 3}));
    EXPECT_NEAR(out[1], std::exp(2.0) / (std::exp(1.0) + std::exp(2.0)), 1e-6);
    EXPECT_EQ(out[2], 0.0f);
  }
}

TEST(AcceptFilters, BadInputThrowsValueError) {
  EXPECT_THROW(Filter({1.0f, NAN}, 2, 1.0f, 0, 1.0f, 0.0f), ValueError);
  EXPECT_THROW(Filter({-INFINITY, -INFINITY}, 2, 1.0f, 0, 1.0f, 0.0f), ValueError);
  EXPECT_THROW(Filter({1.0f, 2.0f}, 2, -1.0f, 0, 1.0f, 0.0f), ValueError);
  EXPECT_THROW(Filter({1.0f, 2.0f}, 2, 1.0f, -1, 1.0f, 0.0f), ValueError);
  EXPECT_THROW(Filter({1.0f, 2.0f}, 2, 1.0f, 0, 0.0f, 0.0f), ValueError);
  EXPECT_THROW(Filter({1.0f, 2.0f}, 2, 1.0f, 0, 1.0f, 1.5f), ValueError);
  std::vector<float> logits(4), temp(2), out(4);
  std::vector<int32_t> tk(2);
  EXPECT_THROW(ApplySamplingFilters(TensorView::Contiguous(logits.data(), DType::kFloat32, {2, 2}),
                                    TensorView::Contiguous(temp.data(), DType::kFloat32, {2}),
                                    TensorView::Contiguous(tk.data(), DType::kInt32, {2}),
                                    TensorView::Contiguous(temp.data(), DType::kFloat32, {1}),
                                    TensorView::Contiguous(temp.data(), DType::kFloat32, {2}),
                                    TensorView::Contiguous(out.data(), DType::kFloat32, {2, 2})),
               ValueError);
}

}  // namespace
}  // namespace pyspec
