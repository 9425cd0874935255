#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <random>
#include <vector>

#include "half_bits.h"
#include "pyspec/attention.h"
#include "pyspec/check.h"
#include "pyspec/decoder.h"
#include "pyspec/layer_ops.h"
#include "pyspec/linear.h"
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

// Runs fn and expects a ValueError whose message contains needle.
template <class F>
void ExpectValueError(const F& fn, const char* needle) {
  try {
    fn();
    ADD_FAILURE() << "no error; expected one mentioning " << needle;
  } catch (const ValueError& e) {
    EXPECT_NE(std::string(e.what()).find(needle), std::string::npos) << e.what();
  }
}

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

TEST_P(LayerOps, SiluMulAndAddRoundLikeTorch) {
  const DType dt = GetParam();
  ThreadPool pool(2);
  for (int64_t T : {1, 3, 70}) {
    for (int64_t I : {5, 1536}) {
      SCOPED_TRACE(::testing::Message() << "T=" << T << " I=" << I << " " << DTypeName(dt));
      std::mt19937 rng(static_cast<uint32_t>(T * 7 + I));
      Buf gu(dt, T * 2 * I, &rng, 3.0f), out(dt, T * I, nullptr, 0.0f);
      SiluMul(gu.View({T, 2 * I}), out.View({T, I}), &pool);
      for (int64_t t = 0; t < T; ++t) {
        for (int64_t i = 0; i < I; ++i) {
          const double a = gu.at(t * 2 * I + i), b = gu.at(t * 2 * I + I + i);
          // silu rounded to the dtype, then the product rounded: within two roundings.
          const double want = a / (1.0 + std::exp(-a)) * b;
          EXPECT_NEAR(out.at(t * I + i), want, 2 * Tol(dt) * (std::fabs(want) + 1e-3));
        }
      }
      // x += y, one rounding: the dtype's rounding of the float sum.
      Buf x(dt, T * I, &rng, 1.0f), y(dt, T * I, &rng, 1.0f);
      std::vector<float> before(T * I);
      for (int64_t i = 0; i < T * I; ++i) before[i] = x.at(i);
      AddInPlace(x.View({T, I}), y.View({T, I}), &pool);
      for (int64_t i = 0; i < T * I; ++i) {
        const float sum = before[i] + y.at(i);
        const float want = dt == DType::kFloat32 ? sum : FromBits(ToBits(sum, dt), dt);
        ASSERT_EQ(x.at(i), want);
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
  ExpectValueError([&] { RmsNorm(f32(a, {4, 8}), f32(b, {7}), 1e-5f, f32(c, {4, 8})); }, "'w'");
  ExpectValueError([&] { RmsNorm(f32(a, {4, 8}), f32(b, {8}), 1e-5f, f32(c, {8, 4})); }, "'out'");
  ExpectValueError([&] { RmsNorm(f32(a, {32}), f32(b, {32}), 1e-5f, f32(c, {32})); }, "'x'");
  ExpectValueError([&] { RmsNorm(f32(a, {4, 8}), f32(b, {8}), -1.0f, f32(c, {4, 8})); }, "'eps'");
  ExpectValueError([&] { RmsNorm(f32(a, {4, 8}), f32(b, {8}), NAN, f32(c, {4, 8})); }, "'eps'");
  std::vector<uint16_t> hw(8);
  ExpectValueError([&] {
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
  ExpectValueError([&] { rot({2, 16}, {2, 3, 4}, {2, 4}); }, "'qkv'");
  ExpectValueError([&] { rot({2, 20}, {2, 3, 4}, {2, 2}); }, "'cos'");
  ExpectValueError([&] { rot({2, 20}, {2, 12}, {2, 4}); }, "'q'");
  std::vector<float> q3(2 * 9), k3(2 * 3), v3(2 * 3), qkv3(2 * 15), c3(2 * 3), s3(2 * 3);
  ExpectValueError([&] {
    RotaryQKV(f32(qkv3, {2, 15}), f32(c3, {2, 3}), f32(s3, {2, 3}), f32(q3, {2, 3, 3}),
              f32(k3, {2, 1, 3}), f32(v3, {2, 1, 3}));
  }, "even");
}

TEST(LayerOpsArgs, SiluMulAndAddNameTheArgument) {
  std::vector<float> a(64, 1.0f), b(64, 1.0f);
  auto f32 = [](std::vector<float>& v, std::initializer_list<int64_t> s) {
    return TensorView::Contiguous(v.data(), DType::kFloat32, s);
  };
  SiluMul(f32(a, {4, 8}), f32(b, {4, 4}));  // valid
  ExpectValueError([&] { SiluMul(f32(a, {4, 7}), f32(b, {4, 3})); }, "'gu'");
  ExpectValueError([&] { SiluMul(f32(a, {4, 8}), f32(b, {4, 8})); }, "'out'");
  ExpectValueError([&] { AddInPlace(f32(a, {4, 8}), f32(b, {8, 4})); }, "'y'");
  ExpectValueError([&] { AddInPlace(f32(a, {32}), f32(b, {32})); }, "'x'");
}

// A small Llama-style stack: DecoderLayers equals the ops run one at a time, bit for bit, over a
// step of a causal chunk and a tree after a prefix in the pages. With `stored_order`, every matrix
// has a column order (GPTQ act-order) and the ops read the input gathered by it.
void CheckLayersEqualTheOpsOneByOne(bool stored_order) {
  const int64_t H = 32, Hq = 4, Hkv = 2, D = 8, I = 48, L = 2, bs = 4, blocks = 8;
  const int64_t qkv_n = (Hq + 2 * Hkv) * D;
  std::mt19937 rng(5);
  std::normal_distribution<float> normal(0.0f, 0.3f);
  auto rnd = [&](int64_t n, float add = 0.0f) {
    std::vector<float> v(n);
    for (float& f : v) f = normal(rng) + add;
    return v;
  };
  struct LayerData {
    std::vector<float> ln1, ln2, wqkv, bqkv, wo, wgu, wd;
  };
  std::vector<LayerData> data(L);
  for (auto& d : data) {
    d = {rnd(H, 1.0f), rnd(H, 1.0f), rnd(qkv_n * H), rnd(qkv_n), rnd(H * Hq * D), rnd(2 * I * H),
         rnd(H * I)};
  }
  std::vector<DecoderLayerWeights> layers(L);
  auto f32 = [](std::vector<float>& v, std::initializer_list<int64_t> s) {
    return TensorView::Contiguous(v.data(), DType::kFloat32, s);
  };
  for (int64_t l = 0; l < L; ++l) {
    LayerData& d = data[l];
    layers[l].ln1 = f32(d.ln1, {H});
    layers[l].ln2 = f32(d.ln2, {H});
    layers[l].wqkv.w = f32(d.wqkv, {qkv_n, H});
    layers[l].bqkv = f32(d.bqkv, {qkv_n});
    layers[l].wo.w = f32(d.wo, {H, Hq * D});
    layers[l].wgu.w = f32(d.wgu, {2 * I, H});
    layers[l].wd.w = f32(d.wd, {H, I});
  }
  // Column orders: a reversal, a rotation, and two shuffles.
  std::vector<std::vector<int64_t>> orders;
  if (stored_order) {
    for (int64_t K : {H, Hq * D, H, I}) {
      std::vector<int64_t> p(K);
      for (int64_t j = 0; j < K; ++j) p[j] = j;
      if (orders.size() == 0) std::reverse(p.begin(), p.end());
      if (orders.size() == 1) std::rotate(p.begin(), p.begin() + 5, p.end());
      if (orders.size() >= 2) std::shuffle(p.begin(), p.end(), rng);
      orders.push_back(p);
    }
    for (int64_t l = 0; l < L; ++l) {
      DecoderMatrix* ms[] = {&layers[l].wqkv, &layers[l].wo, &layers[l].wgu, &layers[l].wd};
      for (int i = 0; i < 4; ++i) {
        ms[i]->perm = TensorView::Contiguous(orders[i].data(), DType::kInt64,
                                             {static_cast<int64_t>(orders[i].size())});
      }
    }
  }
  // The ops' product, reading the input gathered by the matrix's column order when it has one.
  std::vector<float> gathered;
  auto lin = [&](std::vector<float>& in, int64_t K, const DecoderMatrix& w, const TensorView* b,
                 std::vector<float>& out, int64_t N) {
    const int64_t rows = static_cast<int64_t>(in.size()) / K;
    std::vector<float>* src = &in;
    if (w.perm.data != nullptr) {
      const int64_t* idx = static_cast<const int64_t*>(w.perm.data);
      gathered.assign(in.size(), 0.0f);
      for (int64_t t = 0; t < rows; ++t) {
        for (int64_t j = 0; j < K; ++j) gathered[t * K + j] = in[t * K + idx[j]];
      }
      src = &gathered;
    }
    Linear(TensorView::Contiguous(src->data(), DType::kFloat32, {rows, K}), w.w, b,
           TensorView::Contiguous(out.data(), DType::kFloat32, {rows, N}));
  };
  // Two requests: 3 causal rows after 5 committed tokens, and a 4-node tree after 9.
  const int64_t T = 7;
  std::vector<int64_t> q_indptr = {0, 3, 7}, prefix = {5, 9}, tree_indptr = {0, 0, 4};
  std::vector<int64_t> tables = {0, 1, -1, 2, 3, 4};
  std::vector<int64_t> parents = {-1, 0, 0, 1};
  auto i64 = [](std::vector<int64_t>& v, std::initializer_list<int64_t> s) {
    return TensorView::Contiguous(v.data(), DType::kInt64, s);
  };
  const AttentionPlan plan =
      PlanAttention(i64(q_indptr, {3}), i64(prefix, {2}), i64(tables, {2, 3}), bs,
                    i64(parents, {4}), i64(tree_indptr, {3}), blocks, {Hq, Hkv});
  std::vector<float> kp = rnd(L * blocks * bs * Hkv * D), vp = rnd(L * blocks * bs * Hkv * D);
  std::vector<float> cs(T * D), sn(T * D);
  for (int64_t t = 0; t < T; ++t) {
    for (int64_t i = 0; i < D; ++i) {
      cs[t * D + i] = std::cos(0.1f * (t + 5) * (i % (D / 2) + 1));
      sn[t * D + i] = std::sin(0.1f * (t + 5) * (i % (D / 2) + 1));
    }
  }
  const std::vector<float> x0 = rnd(T * H);
  DecoderConfig cfg;
  cfg.num_heads = Hq;
  cfg.num_kv_heads = Hkv;
  cfg.head_dim = D;
  cfg.intermediate = I;
  cfg.eps = 1e-5f;
  // Fused.
  std::vector<float> x = x0, kn(L * T * Hkv * D), vn(L * T * Hkv * D);
  DecoderLayers(cfg, layers, f32(x, {T, H}), f32(cs, {T, D}), f32(sn, {T, D}), plan,
                f32(kp, {L, blocks, bs, Hkv, D}), f32(vp, {L, blocks, bs, Hkv, D}),
                f32(kn, {L, T, Hkv, D}), f32(vn, {L, T, Hkv, D}));
  // One op at a time.
  std::vector<float> y = x0, kn2(L * T * Hkv * D), vn2(L * T * Hkv * D);
  std::vector<float> h(T * H), qkv(T * qkv_n), q(T * Hq * D), a(T * Hq * D), o(T * H);
  std::vector<float> gu(T * 2 * I), act(T * I);
  const int64_t page = blocks * bs * Hkv * D, nw = T * Hkv * D;
  const float scale = static_cast<float>(1.0 / std::sqrt(double(D)));
  for (int64_t l = 0; l < L; ++l) {
    const DecoderLayerWeights& w = layers[l];
    auto sub = [&](std::vector<float>& v, int64_t off, std::initializer_list<int64_t> s) {
      return TensorView::Contiguous(v.data() + off, DType::kFloat32, s);
    };
    RmsNorm(f32(y, {T, H}), w.ln1, cfg.eps, f32(h, {T, H}));
    lin(h, H, w.wqkv, &w.bqkv, qkv, qkv_n);
    RotaryQKV(f32(qkv, {T, qkv_n}), f32(cs, {T, D}), f32(sn, {T, D}), f32(q, {T, Hq, D}),
              sub(kn2, l * nw, {T, Hkv, D}), sub(vn2, l * nw, {T, Hkv, D}));
    RunAttention(plan, f32(q, {T, Hq, D}), sub(kp, l * page, {blocks, bs, Hkv, D}),
                 sub(vp, l * page, {blocks, bs, Hkv, D}), sub(kn2, l * nw, {T, Hkv, D}),
                 sub(vn2, l * nw, {T, Hkv, D}), f32(a, {T, Hq, D}), nullptr, scale);
    lin(a, Hq * D, w.wo, nullptr, o, H);
    AddInPlace(f32(y, {T, H}), f32(o, {T, H}));
    RmsNorm(f32(y, {T, H}), w.ln2, cfg.eps, f32(h, {T, H}));
    lin(h, H, w.wgu, nullptr, gu, 2 * I);
    SiluMul(f32(gu, {T, 2 * I}), f32(act, {T, I}));
    lin(act, I, w.wd, nullptr, o, H);
    AddInPlace(f32(y, {T, H}), f32(o, {T, H}));
  }
  ASSERT_EQ(0, std::memcmp(x.data(), y.data(), x.size() * sizeof(float)));
  ASSERT_EQ(0, std::memcmp(kn.data(), kn2.data(), kn.size() * sizeof(float)));
  ASSERT_EQ(0, std::memcmp(vn.data(), vn2.data(), vn.size() * sizeof(float)));
  // Layers [0, 1) then [1, 2) give the same as [0, 2).
  std::vector<float> z = x0;
  for (int64_t l = 0; l < L; ++l) {
    DecoderLayers(cfg, layers, f32(z, {T, H}), f32(cs, {T, D}), f32(sn, {T, D}), plan,
                  f32(kp, {L, blocks, bs, Hkv, D}), f32(vp, {L, blocks, bs, Hkv, D}),
                  f32(kn, {L, T, Hkv, D}), f32(vn, {L, T, Hkv, D}), l, l + 1);
  }
  ASSERT_EQ(0, std::memcmp(x.data(), z.data(), x.size() * sizeof(float)));
  // Bad arguments name what is wrong.
  auto run_layers = [&](const std::vector<DecoderLayerWeights>& ls) {
    DecoderLayers(cfg, ls, f32(z, {T, H}), f32(cs, {T, D}), f32(sn, {T, D}), plan,
                  f32(kp, {L, blocks, bs, Hkv, D}), f32(vp, {L, blocks, bs, Hkv, D}),
                  f32(kn, {L, T, Hkv, D}), f32(vn, {L, T, Hkv, D}));
  };
  std::vector<DecoderLayerWeights> no_wo = layers;
  no_wo[1].wo.w = TensorView{};  // neither a dense matrix nor codes
  ExpectValueError([&] { run_layers(no_wo); }, "layer 1 wo' has neither");
  ExpectValueError([&] {
    DecoderLayers(cfg, layers, f32(z, {T, H}), f32(cs, {T, D}), f32(sn, {T, D}), plan,
                  f32(kp, {L * blocks, bs, Hkv, D}), f32(vp, {L, blocks, bs, Hkv, D}),
                  f32(kn, {L, T, Hkv, D}), f32(vn, {L, T, Hkv, D}));
  }, "'k_pages'");
  ExpectValueError([&] {
    DecoderLayers(cfg, layers, f32(z, {T, H}), f32(cs, {T, D}), f32(sn, {T, D}), plan,
                  f32(kp, {L, blocks, bs, Hkv, D}), f32(vp, {L, blocks, bs, Hkv, D}),
                  f32(kn, {L, T - 1, Hkv, D}), f32(vn, {L, T, Hkv, D}));
  }, "'k_new'");
  ExpectValueError([&] {
    DecoderLayers(cfg, layers, f32(z, {T, H}), f32(cs, {T, D}), f32(sn, {T, D}), plan,
                  f32(kp, {L, blocks, bs, Hkv, D}), f32(vp, {L, blocks, bs, Hkv, D}),
                  f32(kn, {L, T, Hkv, D}), f32(vn, {L, T, Hkv, D}), 1, 3);
  }, "layers [1, 3)");
  std::vector<float> short_wo(H * (Hq * D - 1));
  std::vector<DecoderLayerWeights> broken = layers;
  broken[1].wo.w = f32(short_wo, {H, Hq * D - 1});
  ExpectValueError([&] { run_layers(broken); }, "'layer 1 wo' must be");
  // A column order of the wrong length or pointing outside the input.
  std::vector<int64_t> short_order(H - 1, 0), outside(I, 0);
  outside[7] = I;
  std::vector<DecoderLayerWeights> bad_order = layers;
  bad_order[0].wgu.perm = i64(short_order, {H - 1});
  ExpectValueError([&] { run_layers(bad_order); }, "'layer 0 wgu' column order must be int64");
  bad_order = layers;
  bad_order[1].wd.perm = i64(outside, {I});
  ExpectValueError([&] { run_layers(bad_order); }, "'layer 1 wd' column order must index [0, 48)");
  ExpectValueError([&] {
    DecoderLayers(cfg, layers, f32(z, {T, H}), f32(cs, {T - 1, D}), f32(sn, {T, D}), plan,
                  f32(kp, {L, blocks, bs, Hkv, D}), f32(vp, {L, blocks, bs, Hkv, D}),
                  f32(kn, {L, T, Hkv, D}), f32(vn, {L, T, Hkv, D}));
  }, "'cos'");
  // An error leaves x as it was: every check runs before the first layer.
  std::vector<float> untouched = z;
  ASSERT_EQ(0, std::memcmp(untouched.data(), z.data(), z.size() * sizeof(float)));
  DecoderConfig bad = cfg;
  bad.num_heads = 3;
  ExpectValueError([&] {
    DecoderLayers(bad, layers, f32(z, {T, H}), f32(cs, {T, D}), f32(sn, {T, D}), plan,
                  f32(kp, {L, blocks, bs, Hkv, D}), f32(vp, {L, blocks, bs, Hkv, D}),
                  f32(kn, {L, T, Hkv, D}), f32(vn, {L, T, Hkv, D}));
  }, "bad decoder config");
}

TEST(Decoder, LayersEqualTheOpsOneByOne) { CheckLayersEqualTheOpsOneByOne(false); }

TEST(Decoder, StoredColumnOrdersGatherTheInput) { CheckLayersEqualTheOpsOneByOne(true); }

}  // namespace
}  // namespace pyspec
