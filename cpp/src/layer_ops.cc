// RMSNorm and rotary q/k/v split on the CPU (see pyspec/layer_ops.h for the contract).
#include "pyspec/layer_ops.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>

#include "half.h"
#include "pyspec/check.h"
#include "pyspec/thread_pool.h"

namespace pyspec {
namespace {

// Elements processed below which a call stays on the calling thread (waking a worker costs more).
constexpr int64_t kMinParallelElems = 1 << 16;

inline float Load(const void* p, DType dt, int64_t i) {
  switch (dt) {
    case DType::kFloat32:
      return static_cast<const float*>(p)[i];
    case DType::kBFloat16:
      return half::BF16ToFloat(static_cast<const uint16_t*>(p)[i]);
    default:
      return half::HalfToFloat(static_cast<const uint16_t*>(p)[i]);
  }
}

// Rounds to the dtype and back (exact for float32).
inline float Round(float v, DType dt) {
  switch (dt) {
    case DType::kFloat32:
      return v;
    case DType::kBFloat16:
      return half::BF16ToFloat(half::FloatToBF16(v));
    default:
      return half::HalfToFloat(half::FloatToHalf(v));
  }
}

inline void Store(void* p, DType dt, int64_t i, float v) {
  switch (dt) {
    case DType::kFloat32:
      static_cast<float*>(p)[i] = v;
      break;
    case DType::kBFloat16:
      static_cast<uint16_t*>(p)[i] = half::FloatToBF16(v);
      break;
    default:
      static_cast<uint16_t*>(p)[i] = half::FloatToHalf(v);
  }
}

// Row-wise work over [0, rows): serial when small.
template <class F>
void ForRows(int64_t rows, int64_t row_elems, ThreadPool* pool, const F& fn) {
  if (rows * row_elems < kMinParallelElems || rows < 2) {
    fn(0, rows);
    return;
  }
  ThreadPool& tp = pool != nullptr ? *pool : ThreadPool::Default();
  const int64_t grain = std::max<int64_t>(1, kMinParallelElems / std::max<int64_t>(row_elems, 1));
  tp.ParallelFor(rows, grain, fn);
}

void CheckCpu(const TensorView& t, const char* op) {
  if (t.device.type == DeviceType::kCUDA) {
    throw RuntimeError(detail::StrCat("pyspec ", op, ": got CUDA tensors; it runs on the CPU only "
                                      "(use the torch ops on CUDA)"));
  }
}

void CheckLike(const TensorView& t, const char* name, DType dtype, const char* ref,
               std::initializer_list<int64_t> dims) {
  PYSPEC_CHECK(t.dtype == dtype, "'", name, "' has dtype ", DTypeName(t.dtype), " but '", ref,
               "' has ", DTypeName(dtype), "; they must match");
  CheckShape(t, name, dims);
  CheckContiguous(t, name);
}

// Sum of squares of n fp32 values in a fixed order (16 interleaved partial sums, then a fixed
// tree), so it vectorizes and never depends on anything but the row.
template <class LoadFn>
float SumSquares(int64_t n, const LoadFn& at) {
  float acc[16] = {};
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) {
    for (int j = 0; j < 16; ++j) {
      const float v = at(i + j);
      acc[j] += v * v;
    }
  }
  for (int j = 0; i < n; ++i, ++j) {
    const float v = at(i);
    acc[j] += v * v;
  }
  for (int w = 8; w >= 1; w /= 2) {
    for (int j = 0; j < w; ++j) acc[j] += acc[j + w];
  }
  return acc[0];
}

// One row of RMSNorm as Hugging Face's Llama computes it: the normalized value rounded to the
// dtype, then times the weight. The dtype is a template argument so the loads, roundings and
// stores fold into straight-line code and vectorize (Round is exact for float32).
template <DType DT>
void RmsRow(const void* xr, const void* w, void* orow, int64_t H, float eps) {
  const float r = SumSquares(H, [&](int64_t i) { return Load(xr, DT, i); });
  const float scale = 1.0f / std::sqrt(r / static_cast<float>(H) + eps);
  for (int64_t i = 0; i < H; ++i) {
    const float n = Round(Load(xr, DT, i) * scale, DT);
    Store(orow, DT, i, Load(w, DT, i) * n);
  }
}

// Rotates n heads of D values at `heads` (dtype DT) for row t into dst (rotate-half layout). The
// dtype is a template argument so the loads and stores fold into straight-line code and vectorize.
// Rotated heads of dtype DT, stored as `ot` (a 16-bit KV cache under float32 activations).
template <DType DT>
void RotateHeads(const char* heads, int64_t n, int64_t D, int64_t t, const float* c,
                 const float* s, void* dst, DType ot = DT) {
  const int64_t half = D / 2, es = DT == DType::kFloat32 ? 4 : 2;
  for (int64_t h = 0; h < n; ++h) {
    const char* x = heads + h * D * es;
    const int64_t o = (t * n + h) * D;
    for (int64_t i = 0; i < half; ++i) {
      const float a = Load(x, DT, i), b = Load(x, DT, i + half);
      Store(dst, ot, o + i, a * c[i] - b * s[i]);
      Store(dst, ot, o + i + half, b * c[i + half] + a * s[i + half]);
    }
  }
}

}  // namespace

void RmsNorm(const TensorView& x, const TensorView& w, float eps, const TensorView& out,
             ThreadPool* pool) {
  for (const TensorView* t : {&x, &w, &out}) CheckCpu(*t, "rms_norm");
  CheckDType(x, "x", {DType::kFloat32, DType::kBFloat16, DType::kFloat16});
  PYSPEC_CHECK(x.ndim == 2, "'x' must be 2-D [T, H]; got shape ", x.ShapeString());
  CheckContiguous(x, "x");
  const int64_t T = x.shape[0], H = x.shape[1];
  CheckLike(w, "w", x.dtype, "x", {H});
  CheckLike(out, "out", x.dtype, "x", {T, H});
  PYSPEC_CHECK(std::isfinite(eps) && eps >= 0.0f, "'eps' must be finite and >= 0; got ", eps);
  if (T == 0 || H == 0) return;
  const DType dt = x.dtype;
  const char* xb = static_cast<const char*>(x.data);
  char* ob = static_cast<char*>(out.data);
  const int64_t row_bytes = H * DTypeSize(dt);
  ForRows(T, H, pool, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) {
      const void* xr = xb + t * row_bytes;
      void* orow = ob + t * row_bytes;
      if (dt == DType::kFloat32) {
        RmsRow<DType::kFloat32>(xr, w.data, orow, H, eps);
      } else if (dt == DType::kBFloat16) {
        RmsRow<DType::kBFloat16>(xr, w.data, orow, H, eps);
      } else {
        RmsRow<DType::kFloat16>(xr, w.data, orow, H, eps);
      }
    }
  });
}

void RotaryQKV(const TensorView& qkv, const TensorView& cos, const TensorView& sin,
               const TensorView& q, const TensorView& k, const TensorView& v, ThreadPool* pool) {
  for (const TensorView* t : {&qkv, &cos, &sin, &q, &k, &v}) CheckCpu(*t, "rotary_qkv");
  CheckDType(qkv, "qkv", {DType::kFloat32, DType::kBFloat16, DType::kFloat16});
  PYSPEC_CHECK(qkv.ndim == 2, "'qkv' must be 2-D [T, (Hq + 2 * Hkv) * D]; got shape ",
               qkv.ShapeString());
  CheckContiguous(qkv, "qkv");
  PYSPEC_CHECK(q.ndim == 3, "'q' must be 3-D [T, Hq, D]; got shape ", q.ShapeString());
  PYSPEC_CHECK(k.ndim == 3, "'k' must be 3-D [T, Hkv, D]; got shape ", k.ShapeString());
  const int64_t T = qkv.shape[0], Hq = q.shape[1], Hkv = k.shape[1], D = q.shape[2];
  PYSPEC_CHECK(D > 0 && D % 2 == 0, "the head size (last dim of 'q') must be even and > 0; got ",
               D);
  CheckLike(q, "q", qkv.dtype, "qkv", {T, Hq, D});
  // K/V may be stored in 16 bits under float32 activations (a 16-bit KV cache).
  PYSPEC_CHECK(k.dtype == qkv.dtype || (qkv.dtype == DType::kFloat32 &&
                                         (k.dtype == DType::kFloat16 ||
                                          k.dtype == DType::kBFloat16)),
               "'k' has dtype ", DTypeName(k.dtype), " but 'qkv' has ", DTypeName(qkv.dtype),
               "; K/V are stored in the activations' dtype, or in float16 / bfloat16 under "
               "float32 activations");
  CheckLike(k, "k", k.dtype, "k", {T, Hkv, D});
  CheckLike(v, "v", k.dtype, "k", {T, Hkv, D});
  PYSPEC_CHECK(qkv.shape[1] == (Hq + 2 * Hkv) * D, "'qkv' must have (Hq + 2 * Hkv) * D = ",
               (Hq + 2 * Hkv) * D, " columns for q ", q.ShapeString(), " and k ",
               k.ShapeString(), "; got shape ", qkv.ShapeString());
  CheckDType(cos, "cos", {DType::kFloat32});
  CheckDType(sin, "sin", {DType::kFloat32});
  CheckShape(cos, "cos", {T, D});
  CheckShape(sin, "sin", {T, D});
  CheckContiguous(cos, "cos");
  CheckContiguous(sin, "sin");
  if (T == 0) return;
  const DType dt = qkv.dtype;
  const int64_t es = DTypeSize(dt), cols = qkv.shape[1];
  const char* src = static_cast<const char*>(qkv.data);
  const float* cs = static_cast<const float*>(cos.data);
  const float* sn = static_cast<const float*>(sin.data);
  ForRows(T, cols, pool, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) {
      const char* row = src + t * cols * es;
      const float* c = cs + t * D;
      const float* s = sn + t * D;
      auto rotate = [&](const char* heads, int64_t n, void* dst) {
        if (dt == DType::kFloat32) {
          RotateHeads<DType::kFloat32>(heads, n, D, t, c, s, dst);
        } else if (dt == DType::kBFloat16) {
          RotateHeads<DType::kBFloat16>(heads, n, D, t, c, s, dst);
        } else {
          RotateHeads<DType::kFloat16>(heads, n, D, t, c, s, dst);
        }
      };
      rotate(row, Hq, q.data);
      const char* vrow = row + (Hq + Hkv) * D * es;
      if (k.dtype == dt) {
        rotate(row + Hq * D * es, Hkv, k.data);
        std::memcpy(static_cast<char*>(v.data) + t * Hkv * D * es, vrow, Hkv * D * es);
      } else {  // float32 activations, 16-bit K/V
        RotateHeads<DType::kFloat32>(row + Hq * D * es, Hkv, D, t, c, s, k.data, k.dtype);
        for (int64_t i = 0; i < Hkv * D; ++i) {
          Store(v.data, k.dtype, t * Hkv * D + i, Load(vrow, DType::kFloat32, i));
        }
      }
    }
  });
}

namespace {
// fn(std::integral_constant<DType, DT>{}) for the float dtype dt: one row loop per dtype.
template <class F>
void ForDType(DType dt, const F& fn) {
  if (dt == DType::kFloat32) {
    fn(std::integral_constant<DType, DType::kFloat32>{});
  } else if (dt == DType::kBFloat16) {
    fn(std::integral_constant<DType, DType::kBFloat16>{});
  } else {
    fn(std::integral_constant<DType, DType::kFloat16>{});
  }
}

template <DType DT>
void SiluMulRow(const void* gu, void* out, int64_t t, int64_t I) {
  const int64_t g0 = t * 2 * I, o0 = t * I;
  for (int64_t i = 0; i < I; ++i) {
    const float a = Load(gu, DT, g0 + i);
    const float act = Round(a / (1.0f + std::exp(-a)), DT);
    Store(out, DT, o0 + i, act * Load(gu, DT, g0 + I + i));
  }
}

template <DType DT>
void AddRow(void* x, const void* y, int64_t t, int64_t H) {
  for (int64_t j = t * H; j < (t + 1) * H; ++j) Store(x, DT, j, Load(x, DT, j) + Load(y, DT, j));
}
}  // namespace

void SiluMul(const TensorView& gu, const TensorView& out, ThreadPool* pool) {
  for (const TensorView* t : {&gu, &out}) CheckCpu(*t, "silu_mul");
  CheckDType(gu, "gu", {DType::kFloat32, DType::kBFloat16, DType::kFloat16});
  PYSPEC_CHECK(gu.ndim == 2 && gu.shape[1] % 2 == 0,
               "'gu' must be 2-D [T, 2 * I] (gate then up); got shape ", gu.ShapeString());
  CheckContiguous(gu, "gu");
  const int64_t T = gu.shape[0], I = gu.shape[1] / 2;
  CheckLike(out, "out", gu.dtype, "gu", {T, I});
  const DType dt = gu.dtype;
  ForRows(T, I, pool, [&](int64_t r0, int64_t r1) {
    ForDType(dt, [&](auto d) {
      for (int64_t t = r0; t < r1; ++t) SiluMulRow<decltype(d)::value>(gu.data, out.data, t, I);
    });
  });
}

void AddInPlace(const TensorView& x, const TensorView& y, ThreadPool* pool) {
  for (const TensorView* t : {&x, &y}) CheckCpu(*t, "add");
  CheckDType(x, "x", {DType::kFloat32, DType::kBFloat16, DType::kFloat16});
  PYSPEC_CHECK(x.ndim == 2, "'x' must be 2-D [T, H]; got shape ", x.ShapeString());
  CheckContiguous(x, "x");
  const int64_t T = x.shape[0], H = x.shape[1];
  CheckLike(y, "y", x.dtype, "x", {T, H});
  const DType dt = x.dtype;
  ForRows(T, H, pool, [&](int64_t r0, int64_t r1) {
    ForDType(dt, [&](auto d) {
      for (int64_t t = r0; t < r1; ++t) AddRow<decltype(d)::value>(x.data, y.data, t, H);
    });
  });
}

}  // namespace pyspec
