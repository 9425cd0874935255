#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <optional>
#include <random>
#include <string>
#include <vector>

#include "isa_expected.h"
#include "../../cpp/src/linear_amx.h"
#include "half_bits.h"
#include "pyspec/check.h"
#include "pyspec/linear.h"
#include "pyspec/thread_pool.h"

namespace pyspec {
namespace {

using testing_util::FromBits;
using testing_util::F32Bits;
using testing_util::ToBits;

// Values in fp32 master copies (exactly representable in `dtype`) plus their storage.
struct Buf {
  DType dtype;
  std::vector<float> f;      // values
  std::vector<float> f32;    // storage when dtype is fp32
  std::vector<uint16_t> h;   // storage otherwise

  Buf(DType dt, int64_t n, std::mt19937* rng, float scale) : dtype(dt), f(n) {
    std::normal_distribution<float> normal(0.0f, scale);
    for (float& v : f) {
      v = normal(*rng);
      if (dt != DType::kFloat32) v = FromBits(ToBits(v, dt), dt);
    }
    if (dt == DType::kFloat32) {
      f32 = f;
    } else {
      h.resize(n);
      for (int64_t i = 0; i < n; ++i) h[i] = ToBits(f[i], dt);
    }
  }
  void* data() { return dtype == DType::kFloat32 ? static_cast<void*>(f32.data()) : h.data(); }
  float at(int64_t i) const { return dtype == DType::kFloat32 ? f32[i] : FromBits(h[i], dtype); }
  TensorView View(std::initializer_list<int64_t> shape) {
    return TensorView::Contiguous(data(), dtype, shape);
  }
};

// Runs fn and expects a ValueError whose message contains needle.
template <class Fn>
void ExpectValueError(Fn fn, const std::string& needle) {
  try {
    fn();
    ADD_FAILURE() << "no error; expected one naming " << needle;
  } catch (const ValueError& e) {
    EXPECT_NE(std::string(e.what()).find(needle), std::string::npos) << e.what();
  }
}

struct Case {
  int64_t M, N, K;
  bool bias;
  DType dtype;
};

// Runs Linear and compares against a double-precision loop. The reference rounds once to the
// output dtype, so fp32 agrees to accumulation-order error; bf16/fp16 to one output rounding.
void Check(const Case& cs, const LinearKernels* kernels, ThreadPool* pool = nullptr) {
  SCOPED_TRACE(::testing::Message() << "M=" << cs.M << " N=" << cs.N << " K=" << cs.K
                                    << " bias=" << cs.bias << " " << DTypeName(cs.dtype));
  std::mt19937 rng(static_cast<uint32_t>(cs.M * 7919 + cs.N * 31 + cs.K));
  Buf x(cs.dtype, cs.M * cs.K, &rng, 1.0f), w(cs.dtype, cs.N * cs.K, &rng, 0.1f);
  Buf b(cs.dtype, cs.N, &rng, 1.0f), out(cs.dtype, cs.M * cs.N, &rng, 1.0f);
  TensorView bv = b.View({cs.N});
  Linear(x.View({cs.M, cs.K}), w.View({cs.N, cs.K}), cs.bias ? &bv : nullptr,
         out.View({cs.M, cs.N}), pool, kernels);
  const double rel =
      cs.dtype == DType::kFloat32 ? 1e-5 : (cs.dtype == DType::kBFloat16 ? 8e-3 : 1e-3);
  for (int64_t m = 0; m < cs.M; ++m) {
    for (int64_t n = 0; n < cs.N; ++n) {
      double ref = cs.bias ? b.f[n] : 0.0, mag = std::fabs(ref);
      for (int64_t k = 0; k < cs.K; ++k) {
        const double p = double(x.f[m * cs.K + k]) * double(w.f[n * cs.K + k]);
        ref += p;
        mag += std::fabs(p);
      }
      const double got = out.at(m * cs.N + n);
      ASSERT_NEAR(got, ref, rel * (mag + 1e-3) + 1e-6) << "at m=" << m << " n=" << n;
    }
  }
}

// Every build of the kernel this CPU runs, each through its own LinearKernels (nothing
// process-wide): an ISA the CPU lacks is a visible skip, or a failure where it is expected.
class LinearIsaTest : public IsaParamTest {
 protected:
  void Check(const Case& cs, ThreadPool* pool = nullptr) const { ::pyspec::Check(cs, k(), pool); }
};

TEST_P(LinearIsaTest, MatchesNaiveLoop) {
  for (DType dt : {DType::kFloat32, DType::kBFloat16, DType::kFloat16}) {
    for (int64_t M : {1, 2, 3, 4, 5, 6, 7, 8, 12, 13, 16, 40}) {
      // (48, 96) and (32, 576) are shapes the AMX kernel takes (N % 16 == 0, K % 32 == 0).
      for (auto nk : {std::pair<int64_t, int64_t>{7, 5}, {33, 19}, {61, 100}, {129, 576},
                      {48, 96}, {32, 576}}) {
        for (bool bias : {false, true}) Check({M, nk.first, nk.second, bias, dt});
      }
    }
  }
}

TEST_P(LinearIsaTest, KTailsAndSmallN) {
  for (int64_t K : {1, 2, 3, 4, 7, 8, 9, 15, 16, 17, 31, 33}) {
    for (int64_t N : {1, 2, 3, 4, 5}) {
      Check({3, N, K, true, DType::kFloat32});
      Check({2, N, K, false, DType::kBFloat16});
      Check({1, N, K, true, DType::kFloat16});
    }
  }
}

TEST_P(LinearIsaTest, LargeLayerIsSplitOverThreads) {
  ThreadPool pool(3);
  // 1001 rows x 577 columns: far above the single-thread threshold, odd in both dimensions.
  Check({1, 1001, 577, true, DType::kFloat32}, &pool);
  Check({5, 1001, 577, false, DType::kBFloat16}, &pool);
  Check({16, 1001, 577, true, DType::kFloat16}, &pool);
}

// A row's result must not depend on the rows computed beside it (a draft tree is verified in one
// call, a plain step has one row; the two must agree bit for bit for greedy decoding to be
// lossless): row m of an M-row call equals the same row computed alone, for every dtype and M.
TEST_P(LinearIsaTest, RowsAreIndependentOfM) {
  // (48, 96) is a shape the AMX kernel takes, (37, 611) one it leaves to the vector kernels.
  for (auto nk : {std::pair<int64_t, int64_t>{37, 611}, {48, 96}}) {
    for (DType dt : {DType::kFloat32, DType::kBFloat16, DType::kFloat16}) {
      const int64_t N = nk.first, K = nk.second, Mmax = 70;
      std::mt19937 rng(5);
      Buf x(dt, Mmax * K, &rng, 1.0f), w(dt, N * K, &rng, 0.1f);
      Buf single(dt, N, &rng, 1.0f);
      for (int64_t M : {2, 5, 6, 7, 13, 20, 33, 70}) {
        Buf out(dt, M * N, &rng, 1.0f);
        Linear(x.View({M, K}), w.View({N, K}), nullptr, out.View({M, N}), nullptr, k());
        for (int64_t m = 0; m < M; ++m) {
          const void* row = static_cast<const char*>(x.data()) + m * K * DTypeSize(dt);
          Linear(TensorView::Contiguous(const_cast<void*>(row), dt, {1, K}), w.View({N, K}),
                 nullptr, single.View({1, N}), nullptr, k());
          for (int64_t n = 0; n < N; ++n) {
            ASSERT_EQ(single.at(n), out.at(m * N + n))
                << DTypeName(dt) << " N=" << N << " M=" << M << " m=" << m << " n=" << n;
          }
        }
      }
    }
  }
}

// The AMX kernel's own cases (bf16, N % 16 == 0, K % 32 == 0): input rows in 1-9 chunks of 16
// (one to three passes of four C tiles over a weight block), partial last chunks, K of one to 48
// tile steps, layers split over threads.
TEST_P(LinearIsaTest, AmxShapes) {
  ThreadPool pool(3);
  for (int64_t M : {1, 15, 16, 17, 33, 64, 65, 130}) {
    for (auto nk : {std::pair<int64_t, int64_t>{16, 32}, {48, 96}, {64, 1536}, {1024, 576}}) {
      for (bool bias : {false, true}) Check({M, nk.first, nk.second, bias, DType::kBFloat16},
                                            &pool);
    }
  }
}

TEST_P(LinearIsaTest, Bf16Specials) {
  // NaN and Inf in a weight reach their outputs; every kernel sums from +0.0, so a row of -0.0
  // products gives +0.0 (as torch's matmul does) whichever kernel runs.
  const int64_t N = 16, K = 32;
  std::vector<uint16_t> x(K, half::FloatToBF16(1.0f)), w(N * K, half::FloatToBF16(0.0f));
  w[0] = 0x7fc0u;                       // NaN in row 0
  w[K] = 0x7f80u;                       // +Inf in row 1
  for (int64_t k = 0; k < K; ++k) w[2 * K + k] = 0x8000u;  // -0.0 row 2
  w[3 * K + 5] = half::FloatToBF16(-2.5f);
  std::vector<uint16_t> out(N, 0x1234u);
  Linear(TensorView::Contiguous(x.data(), DType::kBFloat16, {1, K}),
         TensorView::Contiguous(w.data(), DType::kBFloat16, {N, K}), nullptr,
         TensorView::Contiguous(out.data(), DType::kBFloat16, {1, N}), nullptr, k());
  EXPECT_TRUE(std::isnan(half::BF16ToFloat(out[0])));
  EXPECT_EQ(half::BF16ToFloat(out[1]), INFINITY);
  EXPECT_EQ(out[2], 0u);
  EXPECT_EQ(half::BF16ToFloat(out[3]), -2.5f);
  for (int64_t n = 4; n < N; ++n) EXPECT_EQ(out[n], 0u) << n;
}

INSTANTIATE_TEST_SUITE_P(Isa, LinearIsaTest,
                         ::testing::Values("generic", "avx2", "avx512", "amx"),
                         [](const auto& info) { return info.param; });

// Routing is a property of a LinearKernels object: names, row limits and routes per ISA, and two
// objects with different builds side by side in one process.
TEST(LinearKernels, RoutesAndNames) {
  using R = LinearKernels::Route;
  const LinearKernels g("generic");
  EXPECT_EQ(g.isa(), "generic");
  EXPECT_EQ(g.Kernel(DType::kFloat32), "generic");
  EXPECT_EQ(g.MaxFastRows(DType::kFloat32), 16);
  EXPECT_EQ(g.MaxFastRows(DType::kBFloat16), 8);
  EXPECT_EQ(g.PackedMaxRows(), 0);
  EXPECT_FALSE(g.PackedAvailable());
  EXPECT_EQ(g.DenseRoute(DType::kFloat32, 16), R::kLinear);
  EXPECT_EQ(g.DenseRoute(DType::kFloat32, 17), R::kGemm);
  EXPECT_EQ(g.PackedRoute(1, true), R::kLinear);  // no packed kernel: the dense matrix
  EXPECT_EQ(g.PackedRoute(1, false), R::kLinear);
  EXPECT_EQ(g.PackedRoute(40, true), R::kGemm);
  EXPECT_EQ(LinearKernels::Default().isa(), LinearKernels("auto").isa());
  EXPECT_THROW(LinearKernels(""), ValueError);
  std::optional<LinearKernels> w;
  try {
    w.emplace("avx512");
  } catch (const ValueError&) {
    if (IsaExpected("avx512")) FAIL() << "PYSPEC_EXPECT_ISAS names avx512, but it is missing";
    GTEST_SKIP() << "no AVX-512 kernel on this CPU (the generic routes were checked)";
  }
  EXPECT_EQ(w->Kernel(DType::kFloat32), "avx512");
  EXPECT_EQ(w->MaxFastRows(DType::kFloat32), 64);
  EXPECT_EQ(w->PackedMaxRows(), 32);
  EXPECT_EQ(w->PackedRoute(0, true), R::kLinear);
  EXPECT_EQ(w->PackedRoute(32, true), R::kPacked);
  EXPECT_EQ(w->PackedRoute(33, true), R::kLinear);  // the float32 matrix beats the codes
  EXPECT_EQ(w->PackedRoute(33, false), R::kPacked);  // the codes alone: wherever the core runs
  EXPECT_EQ(w->PackedRoute(64, false), R::kPacked);
  EXPECT_EQ(w->PackedRoute(65, false), R::kGemm);
  // Side by side: each object's call runs its own build, both correct.
  Check({5, 61, 100, true, DType::kFloat32}, &g);
  Check({5, 61, 100, true, DType::kFloat32}, &*w);
  EXPECT_EQ(g.Kernel(DType::kFloat32), "generic");
}

TEST(Linear, ZeroSizesAndZeroK) {
  std::vector<float> x(6, 1.0f), w(3, 0.0f), b = {1.0f, 2.0f, 3.0f}, out(6, -1.0f);
  // K = 0: out = bias.
  TensorView bv = TensorView::Contiguous(b.data(), DType::kFloat32, {3});
  Linear(TensorView::Contiguous(x.data(), DType::kFloat32, {2, 0}),
         TensorView::Contiguous(w.data(), DType::kFloat32, {3, 0}), &bv,
         TensorView::Contiguous(out.data(), DType::kFloat32, {2, 3}));
  EXPECT_EQ(out, (std::vector<float>{1, 2, 3, 1, 2, 3}));
  // M = 0: nothing written, no error.
  Linear(TensorView::Contiguous(x.data(), DType::kFloat32, {0, 3}),
         TensorView::Contiguous(w.data(), DType::kFloat32, {1, 3}), nullptr,
         TensorView::Contiguous(out.data(), DType::kFloat32, {0, 1}));
}

TEST(Linear, FloatSpecialsPropagate) {
  // fp16 Inf in a weight must reach the output (the lane-wise fp16 widening keeps Inf/NaN).
  std::vector<uint16_t> x = {half::FloatToHalf(1.0f), half::FloatToHalf(1.0f)};
  std::vector<uint16_t> w = {0x7c00u, 0, half::FloatToHalf(2.0f), half::FloatToHalf(-3.0f)};
  std::vector<uint16_t> out(2);
  Linear(TensorView::Contiguous(x.data(), DType::kFloat16, {1, 2}),
         TensorView::Contiguous(w.data(), DType::kFloat16, {2, 2}), nullptr,
         TensorView::Contiguous(out.data(), DType::kFloat16, {1, 2}));
  EXPECT_TRUE(std::isinf(half::HalfToFloat(out[0])));
  EXPECT_EQ(half::HalfToFloat(out[1]), -1.0f);
}

TEST(Linear, RejectsBadArguments) {
  std::vector<float> f(64);
  std::vector<uint16_t> h(64);
  auto F = [&](std::initializer_list<int64_t> s) {
    return TensorView::Contiguous(f.data(), DType::kFloat32, s);
  };
  auto H = [&](std::initializer_list<int64_t> s) {
    return TensorView::Contiguous(h.data(), DType::kBFloat16, s);
  };
  ExpectValueError([&] { Linear(F({2, 4}), H({3, 4}), nullptr, F({2, 3})); }, "'w'");
  ExpectValueError([&] { Linear(F({2, 4}), F({3, 4}), nullptr, H({2, 3})); }, "'out'");
  ExpectValueError([&] { Linear(F({2, 4}), F({3, 5}), nullptr, F({2, 3})); }, "'w'");
  ExpectValueError([&] { Linear(F({2, 4}), F({3, 4}), nullptr, F({2, 4})); }, "'out'");
  TensorView bad_bias = F({4});
  ExpectValueError([&] { Linear(F({2, 4}), F({3, 4}), &bad_bias, F({2, 3})); }, "'bias'");
  ExpectValueError([&] { Linear(F({8}), F({3, 8}), nullptr, F({1, 3})); }, "'x'");
  TensorView ints = TensorView::Contiguous(f.data(), DType::kInt32, {2, 4});
  ExpectValueError([&] { Linear(ints, F({3, 4}), nullptr, F({2, 3})); }, "'x'");
  TensorView strided = F({2, 4});
  strided.strides[0] = 8;
  ExpectValueError([&] { Linear(strided, F({3, 4}), nullptr, F({2, 3})); }, "'x'");
  TensorView cuda = F({3, 4});
  cuda.device = Device{DeviceType::kCUDA, 0};
  EXPECT_THROW(Linear(F({2, 4}), cuda, nullptr, F({2, 3})), RuntimeError);
  EXPECT_THROW(LinearKernels("avx9"), ValueError);
}

// A float32 matrix [N, K] on a 4-bit (d * q + m) or 8-bit (d * q) grid with float16-valued d (and
// m), and its codes.
struct PackedGrid {
  int64_t N, K;
  std::vector<float> w, d, m;
  std::vector<uint8_t> q;
};

PackedGrid MakePackedGrid(int bits, int64_t N, int64_t K, std::mt19937& rng) {
  std::uniform_int_distribution<int> q4(0, 15), q8(-127, 127);
  std::uniform_real_distribution<float> ud(1e-3f, 2e-2f), um(-0.2f, 0.0f);
  auto f16 = [](float v) { return half::HalfToFloat(half::FloatToHalf(v)); };
  const int64_t G = K / 32;
  PackedGrid p{N, K, std::vector<float>(N * K), std::vector<float>(N * G),
               std::vector<float>(N * G), std::vector<uint8_t>(bits == 4 ? N * K / 2 : N * K)};
  for (int64_t n = 0; n < N; ++n) {
    for (int64_t g = 0; g < G; ++g) {
      p.d[n * G + g] = f16(ud(rng));
      p.m[n * G + g] = f16(um(rng));
      for (int j = 0; j < 32; ++j) {
        const int64_t k = g * 32 + j;
        if (bits == 4) {
          const int v = q4(rng);
          p.w[n * K + k] = p.d[n * G + g] * static_cast<float>(v) + p.m[n * G + g];
          uint8_t& byte = p.q[n * K / 2 + g * 16 + j % 16];
          byte = static_cast<uint8_t>(j < 16 ? (byte & 0xf0) | v : (byte & 0x0f) | (v << 4));
        } else {
          const int v = q8(rng);
          p.w[n * K + k] = p.d[n * G + g] * static_cast<float>(v);
          p.q[n * K + k] = static_cast<uint8_t>(static_cast<int8_t>(v));
        }
      }
    }
  }
  return p;
}

// Packed weights: codes on a 4-bit (d * q + m) or 8-bit (d * q) grid with float16-valued d give
// Linear's float32 results on the rebuilt matrix bit for bit, at every M.
TEST(LinearPacked, EqualsFloat32KernelBitForBit) {
  int isas_run = 0;
  for (const char* isa : {"avx2", "avx512"}) {
    std::optional<LinearKernels> lk;
    try {
      lk.emplace(isa);
    } catch (const ValueError&) {
      continue;  // this CPU lacks it
    }
    SCOPED_TRACE(isa);
    ASSERT_TRUE(lk->PackedAvailable());
    ++isas_run;
    std::mt19937 rng(11);
    std::uniform_real_distribution<float> um(-0.2f, 0.0f);
    for (int bits : {4, 8}) {
      for (auto nk : {std::pair<int64_t, int64_t>{13, 96}, {300, 576}, {64, 1536}}) {
        PackedGrid p = MakePackedGrid(bits, nk.first, nk.second, rng);
        const int64_t N = p.N, K = p.K, G = K / 32;
        std::vector<float> &w = p.w, &d = p.d, &m = p.m;
        std::vector<uint8_t>& q = p.q;
        std::vector<float> bias(N);
        for (float& b : bias) b = um(rng);
        const DType qt = bits == 4 ? DType::kUInt8 : DType::kInt8;
        const TensorView qv = TensorView::Contiguous(q.data(), qt, {N, bits == 4 ? K / 2 : K});
        const TensorView dv = TensorView::Contiguous(d.data(), DType::kFloat32, {N, G});
        const TensorView mv = TensorView::Contiguous(m.data(), DType::kFloat32, {N, G});
        const TensorView bv = TensorView::Contiguous(bias.data(), DType::kFloat32, {N});
        for (int64_t M : {1, 2, 4, 5, 8, 9, 16, 37}) {
          SCOPED_TRACE(::testing::Message() << "bits=" << bits << " N=" << N << " K=" << K
                                            << " M=" << M);
          std::vector<float> x(M * K), want(M * N), got(M * N, NAN);
          for (float& v : x) v = um(rng) * 10.0f + 1.0f;
          const TensorView xv = TensorView::Contiguous(x.data(), DType::kFloat32, {M, K});
          for (const TensorView* b : {static_cast<const TensorView*>(nullptr), &bv}) {
            Linear(xv, TensorView::Contiguous(w.data(), DType::kFloat32, {N, K}), b,
                   TensorView::Contiguous(want.data(), DType::kFloat32, {M, N}), nullptr, &*lk);
            LinearPacked(xv, qv, dv, bits == 4 ? &mv : nullptr, b,
                         TensorView::Contiguous(got.data(), DType::kFloat32, {M, N}), nullptr,
                         &*lk);
            for (int64_t i = 0; i < M * N; ++i) {
              ASSERT_EQ(F32Bits(got[i]), F32Bits(want[i]))
                  << "output " << i << ": " << got[i] << " vs " << want[i];
            }
          }
        }
      }
    }
  }
  if (isas_run == 0) GTEST_SKIP() << "no AVX2 or AVX-512 float32 kernel on this CPU";
}

// 16-bit codes: a float32 matrix whose values are float16 (or bfloat16) values, held as those
// values, gives Linear's float32 results bit for bit at every M (subnormal float16 values and
// signed zeros included), and UnpackPacked widens them exactly, on any CPU.
TEST(LinearPacked, SixteenBitCodesEqualFloat32KernelBitForBit) {
  std::mt19937 rng(17);
  std::normal_distribution<float> nd(0.0f, 0.5f);
  for (DType half_t : {DType::kFloat16, DType::kBFloat16}) {
    for (auto nk : {std::pair<int64_t, int64_t>{13, 96}, {300, 576}, {5, 32}}) {
      const int64_t N = nk.first, K = nk.second;
      std::vector<uint16_t> q(N * K);
      std::vector<float> w(N * K);
      for (int64_t i = 0; i < N * K; ++i) {
        float v = nd(rng) * (i % 7 == 3 ? 1e-6f : 1.0f);  // float16 subnormals among them
        if (i == 1) v = -0.0f;
        q[i] = half_t == DType::kFloat16 ? half::FloatToHalf(v) : half::FloatToBF16(v);
        w[i] = half_t == DType::kFloat16 ? half::HalfToFloat(q[i]) : half::BF16ToFloat(q[i]);
      }
      SCOPED_TRACE(::testing::Message() << DTypeName(half_t) << " N=" << N << " K=" << K);
      const TensorView qv = TensorView::Contiguous(q.data(), half_t, {N, K});
      std::vector<float> unpacked(N * K, NAN);
      UnpackPacked(qv, TensorView(), nullptr,
                   TensorView::Contiguous(unpacked.data(), DType::kFloat32, {N, K}));
      for (int64_t i = 0; i < N * K; ++i) {
        ASSERT_EQ(F32Bits(unpacked[i]), F32Bits(w[i])) << i;
      }
      for (const char* isa : {"avx2", "avx512"}) {
        std::optional<LinearKernels> lk;
        try {
          lk.emplace(isa);
        } catch (const ValueError&) {
          continue;  // this CPU lacks it (the 4-/8-bit test above says which ran)
        }
        for (int64_t M : {1, 3, 5, 8, 9, 33}) {
          SCOPED_TRACE(::testing::Message() << isa << " M=" << M);
          std::vector<float> x(M * K), want(M * N), got(M * N, NAN);
          for (float& v : x) v = nd(rng);
          const TensorView xv = TensorView::Contiguous(x.data(), DType::kFloat32, {M, K});
          Linear(xv, TensorView::Contiguous(w.data(), DType::kFloat32, {N, K}), nullptr,
                 TensorView::Contiguous(want.data(), DType::kFloat32, {M, N}), nullptr, &*lk);
          LinearPacked(xv, qv, TensorView(), nullptr, nullptr,
                       TensorView::Contiguous(got.data(), DType::kFloat32, {M, N}), nullptr,
                       &*lk);
          for (int64_t i = 0; i < M * N; ++i) {
            ASSERT_EQ(F32Bits(got[i]), F32Bits(want[i])) << i;
          }
        }
      }
    }
  }
  // 16-bit codes take no scales, and [N, K] values.
  std::vector<uint16_t> q(3 * 64);
  std::vector<float> f(4096);
  const TensorView qv = TensorView::Contiguous(q.data(), DType::kFloat16, {3, 64});
  const TensorView d = TensorView::Contiguous(f.data(), DType::kFloat32, {3, 2});
  const TensorView x = TensorView::Contiguous(f.data() + 8, DType::kFloat32, {2, 64});
  const TensorView out = TensorView::Contiguous(f.data() + 512, DType::kFloat32, {2, 3});
  ExpectValueError([&] { LinearPacked(x, qv, d, nullptr, nullptr, out); }, "no scales");
  ExpectValueError([&] {
    LinearPacked(x, TensorView::Contiguous(q.data(), DType::kFloat16, {3, 32}), TensorView(),
                 nullptr, nullptr, out);
  }, "'q'");
}

// Buffers viewed as float32 or uint8 tensors of any small shape (argument checks).
struct CodeBuffers {
  std::vector<float> f = std::vector<float>(4096);
  std::vector<uint8_t> q = std::vector<uint8_t>(4096);
  TensorView F(std::initializer_list<int64_t> s) {
    return TensorView::Contiguous(f.data(), DType::kFloat32, s);
  }
  TensorView Q(std::initializer_list<int64_t> s) {
    return TensorView::Contiguous(q.data(), DType::kUInt8, s);
  }
};

// UnpackPacked rebuilds the matrix the codes were made from, bit for bit, on any CPU.
TEST(UnpackPacked, RebuildsTheMatrixBitForBit) {
  std::mt19937 rng(5);
  for (int bits : {4, 8}) {
    for (auto nk : {std::pair<int64_t, int64_t>{1, 32}, {13, 96}, {300, 576}}) {
      PackedGrid p = MakePackedGrid(bits, nk.first, nk.second, rng);
      const int64_t N = p.N, K = p.K;
      std::vector<float> got(N * K, NAN);
      const TensorView mv = TensorView::Contiguous(p.m.data(), DType::kFloat32, {N, K / 32});
      UnpackPacked(TensorView::Contiguous(p.q.data(), bits == 4 ? DType::kUInt8 : DType::kInt8,
                                          {N, bits == 4 ? K / 2 : K}),
                   TensorView::Contiguous(p.d.data(), DType::kFloat32, {N, K / 32}),
                   bits == 4 ? &mv : nullptr,
                   TensorView::Contiguous(got.data(), DType::kFloat32, {N, K}));
      for (int64_t i = 0; i < N * K; ++i) {
        ASSERT_EQ(F32Bits(got[i]), F32Bits(p.w[i]))
            << "bits=" << bits << " N=" << N << " K=" << K << " element " << i;
      }
    }
  }
  CodeBuffers b;
  auto F = [&](std::initializer_list<int64_t> s) { return b.F(s); };
  auto Q = [&](std::initializer_list<int64_t> s) { return b.Q(s); };
  TensorView m = F({3, 2});
  ExpectValueError([&] { UnpackPacked(Q({3, 24}), F({3, 1}), &m, F({3, 48})); }, "multiple of 32");
  ExpectValueError([&] { UnpackPacked(Q({3, 32}), F({3, 2}), &m, F({4, 64})); }, "'out'");
  ExpectValueError([&] { UnpackPacked(Q({3, 31}), F({3, 2}), &m, F({3, 64})); }, "'q'");
  ExpectValueError([&] { UnpackPacked(Q({3, 32}), F({3, 2}), nullptr, F({3, 64})); }, "'q'");
  TensorView cuda = F({3, 64});
  cuda.device = Device{DeviceType::kCUDA, 0};
  EXPECT_THROW(UnpackPacked(Q({3, 32}), F({3, 2}), &m, cuda), RuntimeError);
}

TEST(LinearPacked, RejectsBadArguments) {
  CodeBuffers b;
  auto F = [&](std::initializer_list<int64_t> s) { return b.F(s); };
  auto Q = [&](std::initializer_list<int64_t> s) { return b.Q(s); };
  TensorView m = F({3, 2});
  ExpectValueError([&] { LinearPacked(F({2, 48}), Q({3, 24}), F({3, 1}), &m, nullptr, F({2, 3})); },
               "multiple of 32");
  ExpectValueError([&] { LinearPacked(F({2, 64}), Q({3, 31}), F({3, 2}), &m, nullptr, F({2, 3})); },
               "'q'");
  ExpectValueError([&] { LinearPacked(F({2, 64}), Q({3, 32}), F({3, 3}), &m, nullptr, F({2, 3})); },
               "'d'");
  TensorView bad_m = F({3, 1});
  ExpectValueError(
      [&] { LinearPacked(F({2, 64}), Q({3, 32}), F({3, 2}), &bad_m, nullptr, F({2, 3})); }, "'m'");
  ExpectValueError([&] { LinearPacked(F({2, 64}), Q({3, 32}), F({3, 2}), &m, nullptr, F({2, 4})); },
               "'out'");
  TensorView bias = F({4});
  ExpectValueError([&] { LinearPacked(F({2, 64}), Q({3, 32}), F({3, 2}), &m, &bias, F({2, 3})); },
               "'bias'");
}

// ---- the AMX kernel's logic on emulated tiles (every CPU) -------------------------------------------

// Denormals as zero (TDPBF16PS's DAZ on inputs, FTZ on results).
float FlushDenormal(float x) {
  return std::fpclassify(x) == FP_SUBNORMAL ? std::copysign(0.0f, x) : x;
}

// One output the way the AMX kernel computes it, written out directly from x and w (no packing,
// no tiles): per 32-k chunk, the even and the odd bf16 products summed separately in fp32 (FMA, k
// ascending), their sum added to the running fp32 total; then the bias; one rounding to bf16.
uint16_t AmxOrderReference(const uint16_t* x, const uint16_t* w, int64_t K, const float* bias) {
  float acc = 0.0f;
  for (int64_t k0 = 0; k0 < K; k0 += 32) {
    float even = 0.0f, odd = 0.0f;
    for (int64_t p = 0; p < 16; ++p) {
      const int64_t k = k0 + 2 * p;
      even = FlushDenormal(std::fma(FlushDenormal(half::BF16ToFloat(w[k])),
                                    FlushDenormal(half::BF16ToFloat(x[k])), even));
      odd = FlushDenormal(std::fma(FlushDenormal(half::BF16ToFloat(w[k + 1])),
                                   FlushDenormal(half::BF16ToFloat(x[k + 1])), odd));
    }
    acc = FlushDenormal(acc + FlushDenormal(even + odd));
  }
  if (bias != nullptr) acc += *bias;
  return half::FloatToBF16(acc);
}

// The kernel body on emulated tiles, over the shapes it takes (N % 16 == 0, K % 32 == 0; input
// rows in 1-10 chunks of 16, i.e. one to three passes of up to four C tiles, with partial last
// chunks): bit for bit the reference order above, within bf16 rounding of the exact (double) sum,
// only the requested output blocks written, and the same bits whether the blocks run in one call
// or several. Where the CPU has AMX, the hardware kernel must give the emulation's bits too.
TEST(LinearAmxEmulated, MatchesTheKernelOrderBitForBit) {
  std::mt19937 rng(20240901);
  std::uniform_real_distribution<float> uni(-2.0f, 2.0f);
  auto random_bf16 = [&](int64_t n) {
    std::vector<uint16_t> v(static_cast<size_t>(n));
    for (auto& h : v) {
      const uint32_t r = rng() % 64;
      if (r == 0) {
        h = 0x8000u;  // -0.0
      } else if (r == 1) {
        h = static_cast<uint16_t>(0x0001u + rng() % 0x7fu);  // a denormal (treated as zero)
      } else if (r == 2) {
        h = 0;
      } else {
        h = half::FloatToBF16(uni(rng));
      }
    }
    return v;
  };
  const bool hardware = detail::AmxBf16Available();
  int64_t checked = 0;
  for (auto nk : {std::pair<int64_t, int64_t>{16, 32}, {48, 96}, {32, 256}}) {
    const int64_t N = nk.first, K = nk.second, blocks = N / 16;
    ASSERT_TRUE(detail::AmxShapeOk(N, K));
    for (int64_t M : {1, 2, 15, 16, 17, 31, 33, 48, 63, 64, 65, 100, 128, 129, 144, 159}) {
      for (bool with_bias : {false, true}) {
        const std::vector<uint16_t> x = random_bf16(M * K), w = random_bf16(N * K);
        std::vector<float> bias(static_cast<size_t>(N));
        for (float& b : bias) b = uni(rng);
        const float* bp = with_bias ? bias.data() : nullptr;
        std::vector<uint16_t> packed(static_cast<size_t>(detail::AmxPackedElems(M, K)), 0xdeadu);
        detail::AmxPackInputs(x.data(), M, K, packed.data());
        // All blocks in one call.
        std::vector<uint16_t> out(static_cast<size_t>(M * N), 0xffffu);
        detail::AmxLinearBlocksEmulated(packed.data(), w.data(), bp, out.data(), M, N, K, 0,
                                        blocks);
        for (int64_t m = 0; m < M; ++m) {
          for (int64_t n = 0; n < N; ++n) {
            const uint16_t want = AmxOrderReference(&x[m * K], &w[n * K], K, bp ? bp + n : nullptr);
            ASSERT_EQ(out[m * N + n], want) << "M " << M << " N " << N << " K " << K << " bias "
                                            << with_bias << " at [" << m << ", " << n << "]";
            double exact = bp ? bp[n] : 0.0, mag = bp ? std::abs(bp[n]) : 0.0;
            for (int64_t k = 0; k < K; ++k) {
              const double xv = FlushDenormal(half::BF16ToFloat(x[m * K + k]));
              const double wv = FlushDenormal(half::BF16ToFloat(w[n * K + k]));
              exact += xv * wv;
              mag += std::abs(xv * wv);
            }
            const double got = half::BF16ToFloat(out[m * N + n]);
            ASSERT_LE(std::abs(got - exact), std::abs(exact) / 256.0 + mag * K * 0x1p-23 + 1e-30)
                << "M " << M << " N " << N << " K " << K << " at [" << m << ", " << n << "]";
            ++checked;
          }
        }
        // Block by block (as the thread pool splits a layer), in reverse order: same bits, and a
        // call writes only its own blocks.
        std::vector<uint16_t> split(static_cast<size_t>(M * N), 0xffffu);
        for (int64_t b = blocks - 1; b >= 0; --b) {
          detail::AmxLinearBlocksEmulated(packed.data(), w.data(), bp, split.data(), M, N, K, b,
                                          b + 1);
          for (int64_t m = 0; m < M; ++m) {
            for (int64_t n = 0; n < N; ++n) {
              const bool written = n >= b * 16;
              ASSERT_EQ(split[m * N + n], written ? out[m * N + n] : uint16_t{0xffffu})
                  << "block " << b << " at [" << m << ", " << n << "]";
            }
          }
        }
        if (hardware) {
          std::vector<uint16_t> hw(static_cast<size_t>(M * N), 0xffffu);
          detail::AmxLinearBlocks(packed.data(), w.data(), bp, hw.data(), M, N, K, 0, blocks);
          ASSERT_EQ(hw, out) << "hardware vs emulated tiles: M " << M << " N " << N << " K " << K;
        }
      }
    }
  }
  EXPECT_GT(checked, 10000);
  if (!hardware) RecordProperty("amx_hardware", "absent: emulated tiles only");
}

// The packed layout itself: pair p of row m at [m / 16][p / 16][p % 16][m % 16][2], rows past M
// zero (the kernel's B operand).
TEST(LinearAmxEmulated, PackInputsLayout) {
  for (int64_t M : {1, 16, 17, 40}) {
    for (int64_t K : {32, 96}) {
      std::vector<uint16_t> x(static_cast<size_t>(M * K));
      for (size_t i = 0; i < x.size(); ++i) x[i] = static_cast<uint16_t>(i * 7 + 1);
      std::vector<uint16_t> packed(static_cast<size_t>(detail::AmxPackedElems(M, K)), 0xdeadu);
      detail::AmxPackInputs(x.data(), M, K, packed.data());
      const int64_t chunks = (M + 15) / 16, kcn = K / 32;
      for (int64_t c = 0; c < chunks; ++c) {
        for (int64_t kc = 0; kc < kcn; ++kc) {
          for (int64_t p = 0; p < 16; ++p) {
            for (int64_t r = 0; r < 16; ++r) {
              for (int64_t e = 0; e < 2; ++e) {
                const int64_t m = c * 16 + r, k = kc * 32 + 2 * p + e;
                const uint16_t got = packed[(((c * kcn + kc) * 16 + p) * 16 + r) * 2 + e];
                ASSERT_EQ(got, m < M ? x[m * K + k] : uint16_t{0}) << M << " " << K;
              }
            }
          }
        }
      }
    }
  }
}

}  // namespace
}  // namespace pyspec
