#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <random>
#include <vector>

#include "half_bits.h"
#include "pyspec/check.h"
#include "pyspec/layer_ops.h"
#include "pyspec/thread_pool.h"

namespace pyspec {
namespace {

using testing_util::FromBits;
using testing_util::ToBits;

// Values (exactly representable in the dtype) and their storage.
struct Buf {
  DType dtype;
  std::vector<float> f32;
  std::vector<uint16_t> h;
  Buf(DType dt, int64_t n, std::mt19937* rng, float scale) : dtype(dt), f32(n), h(n) {
    std::normal_distribution<float> normal(0.0f, scale);
    for (int64_t i = 0; i < n; ++i) {
      float v = rng != nullptr ? normal(*rng) : 0.0f;
      if (dt != DType::kFloat32) {
        h[i] = ToBits(v, dt);
        v = FromBits(h[i], dt);
      }
      f32[i] = v;
    }
  }
  void* data() { return dtype == DType::kFloat32 ? static_cast<void*>(f32.data()) : h.data(); }
  float at(int64_t i) const { return dtype == DType::kFloat32 ? f32[i] : FromBits(h[i], dtype); }
  TensorView View(std::initializer_list<int64_t> shape) {
    return TensorView::Contiguous(data(), dtype, shape);
  }
};

double Tol(DType dt) { return dt == DType::kFloat32 ? 2e-6 : (dt == DType::kBFloat16 ? 1.6e-2 : 2e-3); }

class LayerOps : public ::testing::TestWithParam<DType> {};

TEST_P(LayerOps, RmsNormMatchesReferenceAndRowsAreIndependent) {
  const DType dt = GetParam();
  ThreadPool pool(3);
  for (int64_t T : {1, 5, 300}) {
    for (int64_t H : {7, 64, 576}) {
      SCOPED_TRACE(::testing::Message() << "T=" << T << " H=" << H << " " << DTypeName(dt));
      std::mt19937 rng(static_cast<uint32_t>(T * 131 + H));
      Buf x(dt, T * H, &rng, 2.0f), w(dt, H, &rng, 1.0f), out(dt, T * H, nullptr, 0.0f);
      const float eps = 1e-5f;
      RmsNorm(x.View({T, H}), w.View({H}), eps, out.View({T, H}), &pool);
      for (int64_t t = 0; t < T; ++t) {
        double ss = 0;
        for (int64_t i = 0; i < H; ++i) ss += double(x.at(t * H + i)) * x.at(t * H + i);
        const double scale = 1.0 / std::sqrt(ss / H + eps);
        for (int64_t i = 0; i < H; ++i) {
          const double ref = double(w.at(i)) * x.at(t * H + i) * scale;
          ASSERT_NEAR(out.at(t * H + i), ref, Tol(dt) * (std::fabs(ref) + 1e-3)) << t << " " << i;
        }
        // The same row alone gives the same bits.
        Buf one(dt, H, nullptr, 0.0f), row(dt, H, nullptr, 0.0f);
        for (int64_t i = 0; i < H; ++i) {
          one.f32[i] = x.f32[t * H + i];
          one.h[i] = x.h[t * H + i];
        }
        RmsNorm(one.View({1, H}), w.View({H}), eps, row.View({1, H}), &pool);
        for (int64_t i = 0; i < H; ++i) ASSERT_EQ(row.at(i), out.at(t * H + i)) << t << " " << i;
      }
    }
  }
}

TEST_P(LayerOps, RmsNormInPlace) {
  const DType dt = GetParam();
  std::mt19937 rng(5);
  Buf x(dt, 3 * 40, &rng, 1.0f), w(dt, 40, &rng, 1.0f), out(dt, 3 * 40, nullptr, 0.0f);
  RmsNorm(x.View({3, 40}), w.View({40}), 1e-6f, out.View({3, 40}));
  RmsNorm(x.View({3, 40}), w.View({40}), 1e-6f, x.View({3, 40}));
  for (int64_t i = 0; i < 3 * 40; ++i) ASSERT_EQ(x.at(i), out.at(i)) << i;
}

TEST_P(LayerOps, RotaryQKVMatchesReference) {
  const DType dt = GetParam();
  const int64_t Hq = 3, Hkv = 1, D = 8;
  for (int64_t T : {1, 4, 700}) {
    SCOPED_TRACE(::testing::Message() << "T=" << T << " " << DTypeName(dt));
    std::mt19937 rng(static_cast<uint32_t>(T));
    const int64_t cols = (Hq + 2 * Hkv) * D;
    Buf qkv(dt, T * cols, &rng, 1.0f), q(dt, T * Hq * D, nullptr, 0.f),
        k(dt, T * Hkv * D, nullptr, 0.f), v(dt, T * Hkv * D, nullptr, 0.f);
    std::vector<float> cs(T * D), sn(T * D);
    for (int64_t t = 0; t < T; ++t) {
      for (int64_t i = 0; i < D / 2; ++i) {
        const double ang = (t + 1) * std::pow(10000.0, -2.0 * i / D);
        cs[t * D + i] = cs[t * D + i + D / 2] = static_cast<float>(std::cos(ang));
        sn[t * D + i] = sn[t * D + i + D / 2] = static_cast<float>(std::sin(ang));
      }
    }
    RotaryQKV(qkv.View({T, cols}), TensorView::Contiguous(cs.data(), DType::kFloat32, {T, D}),
              TensorView::Contiguous(sn.data(), DType::kFloat32, {T, D}), q.View({T, Hq, D}),
              k.View({T, Hkv, D}), v.View({T, Hkv, D}));
    for (int64_t t = 0; t < T; ++t) {
      auto check = [&](int64_t col0, int64_t heads, const Buf& dst) {
        for (int64_t h = 0; h < heads; ++h) {
          for (int64_t i = 0; i < D; ++i) {
            const int64_t j = i < D / 2 ? i + D / 2 : i - D / 2;
            const double xi = qkv.at(t * cols + col0 + h * D + i);
            const double xj = qkv.at(t * cols + col0 + h * D + j);
            const double rot = i < D / 2 ? -xj : xj;
            const double ref = xi * cs[t * D + i] + rot * sn[t * D + i];
            const double mag = std::fabs(xi * cs[t * D + i]) + std::fabs(rot * sn[t * D + i]);
            ASSERT_NEAR(dst.at((t * heads + h) * D + i), ref, Tol(dt) * (mag + 1e-6));
          }
        }
      };
      check(0, Hq, q);
      check(Hq * D, Hkv, k);
      for (int64_t i = 0; i < Hkv * D; ++i) {
        ASSERT_EQ(v.at(t * Hkv * D + i), qkv.at(t * cols + (Hq + Hkv) * D + i));
      }
    }
  }
}

INSTANTIATE_TEST_SUITE_P(Dtypes, LayerOps,
                         ::testing::Values(DType::kFloat32, DType::kBFloat16, DType::kFloat16),
                         [](const auto& info) { return std::string(DTypeName(info.param)); });

TEST(LayerOpsArgs, BadInputsNameTheArgument) {
  std::vector<float> a(64, 1.0f), b(64, 1.0f), c(64, 1.0f);
  auto f32 = [](std::vector<float>& v, std::initializer_list<int64_t> s) {
    return TensorView::Contiguous(v.data(), DType::kFloat32, s);
  };
  auto expect = [](auto fn, const char* needle) {
    try {
      fn();
      ADD_FAILURE() << "no error; expected one mentioning " << needle;
    } catch (const ValueError& e) {
      EXPECT_NE(std::string(e.what()).find(needle), std::string::npos) << e.what();
    }
  };
  expect([&] { RmsNorm(f32(a, {4, 8}), f32(b, {7}), 1e-5f, f32(c, {4, 8})); }, "'w'");
  expect([&] { RmsNorm(f32(a, {4, 8}), f32(b, {8}), 1e-5f, f32(c, {8, 4})); }, "'out'");
  expect([&] { RmsNorm(f32(a, {32}), f32(b, {32}), 1e-5f, f32(c, {32})); }, "'x'");
  expect([&] { RmsNorm(f32(a, {4, 8}), f32(b, {8}), -1.0f, f32(c, {4, 8})); }, "'eps'");
  expect([&] { RmsNorm(f32(a, {4, 8}), f32(b, {8}), NAN, f32(c, {4, 8})); }, "'eps'");
  std::vector<uint16_t> hw(8);
  expect([&] {
    RmsNorm(f32(a, {4, 8}), TensorView::Contiguous(hw.data(), DType::kBFloat16, {8}), 1e-5f,
            f32(c, {4, 8}));
  }, "dtype");
  std::vector<float> qkv(2 * 20), cs(2 * 4), sn(2 * 4), q(2 * 12), k(2 * 4), v(2 * 4);
  auto rot = [&](std::initializer_list<int64_t> qkv_shape, std::initializer_list<int64_t> q_shape,
                 std::initializer_list<int64_t> cos_shape) {
    RotaryQKV(f32(qkv, qkv_shape), f32(cs, cos_shape), f32(sn, {2, 4}), f32(q, q_shape),
              f32(k, {2, 1, 4}), f32(v, {2, 1, 4}));
  };
  rot({2, 20}, {2, 3, 4}, {2, 4});  // valid
  expect([&] { rot({2, 16}, {2, 3, 4}, {2, 4}); }, "'qkv'");
  expect([&] { rot({2, 20}, {2, 3, 4}, {2, 2}); }, "'cos'");
  expect([&] { rot({2, 20}, {2, 12}, {2, 4}); }, "'q'");
  std::vector<float> q3(2 * 9), k3(2 * 3), v3(2 * 3), qkv3(2 * 15), c3(2 * 3), s3(2 * 3);
  expect([&] {
    RotaryQKV(f32(qkv3, {2, 15}), f32(c3, {2, 3}), f32(s3, {2, 3}), f32(q3, {2, 3, 3}),
              f32(k3, {2, 1, 3}), f32(v3, {2, 1, 3}));
  }, "even");
}

}  // namespace
}  // namespace pyspec
