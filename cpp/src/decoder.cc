// The CPU decoder stack in one call (see pyspec/decoder.h for the contract).
#include "pyspec/decoder.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <string>
#include <cstdint>
#include <vector>

#include "pyspec/check.h"
#include "pyspec/layer_ops.h"
#include "pyspec/linear.h"
#include "pyspec/thread_pool.h"

namespace pyspec {
namespace {

// Layer `l` of a [L, ...] contiguous tensor.
TensorView Slice0(const TensorView& t, int64_t l) {
  TensorView v;
  v.data = static_cast<char*>(t.data) + l * t.strides[0] * DTypeSize(t.dtype);
  v.dtype = t.dtype;
  v.device = t.device;
  v.ndim = t.ndim - 1;
  for (int i = 1; i < t.ndim; ++i) {
    v.shape[i - 1] = t.shape[i];
    v.strides[i - 1] = t.strides[i];
  }
  return v;
}

const TensorView* Opt(const TensorView& t) { return t.data != nullptr ? &t : nullptr; }

// Shape, dtype and layout of one matrix [N, K] (and its codes) in the model's dtype.
void CheckMatrix(const DecoderMatrix& m, const std::string& name, int64_t N, int64_t K,
                 DType dtype) {
  PYSPEC_CHECK(m.w.data != nullptr || m.packed, "'", name, "' has neither a dense matrix nor "
               "packed codes");
  if (m.w.data != nullptr) {
    PYSPEC_CHECK(m.w.dtype == dtype, "'", name, "' has dtype ", DTypeName(m.w.dtype),
                 " but the model's is ", DTypeName(dtype));
    PYSPEC_CHECK(m.w.ndim == 2 && m.w.shape[0] == N && m.w.shape[1] == K, "'", name,
                 "' must be [", N, ", ", K, "]; got shape ", m.w.ShapeString());
    CheckContiguous(m.w, name.c_str());
  }
  if (!m.packed) return;
  PYSPEC_CHECK(dtype == DType::kFloat32 && K % 32 == 0, "'", name,
               "': packed codes need a float32 model and K a multiple of 32");
  if (m.q.dtype == DType::kFloat16 || m.q.dtype == DType::kBFloat16) {  // 16-bit: no scales
    PYSPEC_CHECK(m.q.ndim == 2 && m.q.shape[0] == N && m.q.shape[1] == K && m.d.data == nullptr &&
                     m.m.data == nullptr,
                 "'", name, "' 16-bit codes must be [", N, ", ", K, "] without scales; got ",
                 m.q.ShapeString());
    CheckContiguous(m.q, name.c_str());
    return;
  }
  const bool four = m.m.data != nullptr;
  PYSPEC_CHECK(m.q.ndim == 2 && m.q.shape[0] == N && m.q.shape[1] == (four ? K / 2 : K) &&
                   m.q.dtype == (four ? DType::kUInt8 : DType::kInt8),
               "'", name, "' codes must be ", four ? "uint8 [N, K / 2]" : "int8 [N, K]",
               " for N = ", N, ", K = ", K, "; got ", DTypeName(m.q.dtype), " ",
               m.q.ShapeString());
  for (const TensorView* t : {&m.d, four ? &m.m : &m.d}) {
    PYSPEC_CHECK(t->ndim == 2 && t->shape[0] == N && t->shape[1] == K / 32 &&
                     t->dtype == DType::kFloat32,
                 "'", name, "' scales must be float32 [", N, ", ", K / 32, "]; got ",
                 DTypeName(t->dtype), " ", t->ShapeString());
    CheckContiguous(*t, name.c_str());
  }
  CheckContiguous(m.q, name.c_str());
}

// A matrix's stored column order: int64 [K], each entry in [0, K) (the gather reads x there;
// checked on every call, a pass over K values without branches).
void CheckPerm(const DecoderMatrix& m, const std::string& name, int64_t K) {
  if (m.perm.data == nullptr) return;
  const TensorView& p = m.perm;
  PYSPEC_CHECK(p.dtype == DType::kInt64 && p.ndim == 1 && p.shape[0] == K, "'", name,
               "' column order must be int64 [", K, "]; got ", DTypeName(p.dtype), " ",
               p.ShapeString());
  CheckContiguous(p, name.c_str());
  const int64_t* idx = static_cast<const int64_t*>(p.data);
  int64_t lo = 0, hi = 0;
  for (int64_t j = 0; j < K; ++j) {
    lo = std::min(lo, idx[j]);
    hi = std::max(hi, idx[j]);
  }
  PYSPEC_CHECK(lo >= 0 && hi < K, "'", name, "' column order must index [0, ", K,
               "); it holds ", lo < 0 ? lo : hi);
}

void CheckVector(const TensorView& t, const std::string& name, int64_t n, DType dtype) {
  PYSPEC_CHECK(t.dtype == dtype && t.ndim == 1 && t.shape[0] == n, "'", name, "' must be [", n,
               "] ", DTypeName(dtype), "; got ", DTypeName(t.dtype), " ", t.ShapeString());
  CheckContiguous(t, name.c_str());
}

// Which matrices of a step read their codes (LinearKernels::PackedRoute at the step's rows).
struct PackedRoutes {
  bool with_dense;  // codes held beside the float32 matrix
  bool alone;       // codes only
};

// out = x W^T (+ bias); a matrix with a stored column order reads x gathered into `gathered`
// (scratch of at least x's size).
void RunLinear(const TensorView& x0, const DecoderMatrix& w, const TensorView* bias,
               const TensorView& out, const LinearKernels& kernels, PackedRoutes routes,
               ThreadPool* pool, void* gathered) {
  TensorView x = x0;
  if (w.perm.data != nullptr) {
    const int64_t T = x0.shape[0], K = x0.shape[1], es = DTypeSize(x0.dtype);
    const int64_t* idx = static_cast<const int64_t*>(w.perm.data);
    const char* src = static_cast<const char*>(x0.data);
    char* dst = static_cast<char*>(gathered);
    for (int64_t t = 0; t < T; ++t) {
      const char* row = src + t * K * es;
      char* o = dst + t * K * es;
      if (es == 4) {
        const float* r = reinterpret_cast<const float*>(row);
        float* of = reinterpret_cast<float*>(o);
        for (int64_t j = 0; j < K; ++j) of[j] = r[idx[j]];
      } else {
        for (int64_t j = 0; j < K; ++j) std::memcpy(o + j * es, row + idx[j] * es, es);
      }
    }
    x = TensorView::Contiguous(gathered, x0.dtype, {T, K});
  }
  if (w.packed && (w.w.data != nullptr ? routes.with_dense : routes.alone)) {
    LinearPacked(x, w.q, w.d, Opt(w.m), bias, out, pool, &kernels);
  } else {
    Linear(x, w.w, bias, out, pool, &kernels);
  }
}

}  // namespace

void CheckDecoderLayers(const DecoderConfig& cfg, const std::vector<DecoderLayerWeights>& layers,
                        int64_t hidden, DType dtype) {
  const int64_t Hq = cfg.num_heads, Hkv = cfg.num_kv_heads, D = cfg.head_dim;
  const int64_t I = cfg.intermediate;
  PYSPEC_CHECK(Hq > 0 && Hkv > 0 && Hq % Hkv == 0 && D > 0 && D % 2 == 0 && I > 0 && hidden > 0,
               "bad decoder config: ", Hq, " heads, ", Hkv, " KV heads, head dim ", D,
               ", intermediate size ", I, ", hidden size ", hidden,
               " (heads a multiple of the KV heads, an even head dim)");
  PYSPEC_CHECK(std::isfinite(cfg.eps) && cfg.eps >= 0.f, "'eps' must be finite and >= 0; got ",
               cfg.eps);
  const int64_t qkv_n = (Hq + 2 * Hkv) * D;
  for (size_t l = 0; l < layers.size(); ++l) {
    const DecoderLayerWeights& w = layers[l];
    const std::string p = "layer " + std::to_string(l) + " ";
    CheckVector(w.ln1, p + "ln1", hidden, dtype);
    CheckVector(w.ln2, p + "ln2", hidden, dtype);
    CheckMatrix(w.wqkv, p + "wqkv", qkv_n, hidden, dtype);
    CheckMatrix(w.wo, p + "wo", hidden, Hq * D, dtype);
    CheckMatrix(w.wgu, p + "wgu", 2 * I, hidden, dtype);
    CheckMatrix(w.wd, p + "wd", hidden, I, dtype);
    CheckPerm(w.wqkv, p + "wqkv", hidden);
    CheckPerm(w.wo, p + "wo", Hq * D);
    CheckPerm(w.wgu, p + "wgu", hidden);
    CheckPerm(w.wd, p + "wd", I);
    if (w.bqkv.data != nullptr) CheckVector(w.bqkv, p + "bqkv", qkv_n, dtype);
    if (w.bo.data != nullptr) CheckVector(w.bo, p + "bo", hidden, dtype);
  }
}

void DecoderLayers(const DecoderConfig& cfg, const std::vector<DecoderLayerWeights>& layers,
                   const TensorView& x, const TensorView& cos, const TensorView& sin,
                   const AttentionPlan& plan, const TensorView& k_pages,
                   const TensorView& v_pages, const TensorView& k_new, const TensorView& v_new,
                   int64_t begin, int64_t end, ThreadPool* pool, const LinearKernels* kernels) {
  for (const TensorView* t : {&x, &cos, &sin, &k_pages, &v_pages, &k_new, &v_new}) {
    if (t->device.type == DeviceType::kCUDA) {
      throw RuntimeError("pyspec decoder_layers: got CUDA tensors; it runs on the CPU only");
    }
  }
  CheckDType(x, "x", {DType::kFloat32, DType::kBFloat16, DType::kFloat16});
  PYSPEC_CHECK(x.ndim == 2, "'x' must be 2-D [T, hidden]; got shape ", x.ShapeString());
  CheckContiguous(x, "x");
  const int64_t T = x.shape[0], H = x.shape[1];
  const int64_t Hq = cfg.num_heads, Hkv = cfg.num_kv_heads, D = cfg.head_dim;
  const int64_t I = cfg.intermediate;
  CheckDecoderLayers(cfg, layers, H, x.dtype);
  const int64_t L = static_cast<int64_t>(layers.size());
  if (end < 0) end = L;
  PYSPEC_CHECK(0 <= begin && begin <= end && end <= L, "layers [", begin, ", ", end,
               ") must lie within the stack's ", L);
  for (const auto& [t, name] : {std::pair<const TensorView*, const char*>{&k_pages, "k_pages"},
                               {&v_pages, "v_pages"}}) {
    PYSPEC_CHECK(t->ndim == 5 && t->shape[0] >= L && t->shape[3] == Hkv && t->shape[4] == D,
                 "'", name, "' must be [L >= ", L, ", num_blocks, block_size, ", Hkv, ", ", D,
                 "]; got shape ", t->ShapeString());
    CheckContiguous(*t, name);
    // The KV cache: the activations' dtype, or 16 bits under float32 activations.
    PYSPEC_CHECK(t->dtype == x.dtype ||
                     (x.dtype == DType::kFloat32 &&
                      (t->dtype == DType::kFloat16 || t->dtype == DType::kBFloat16)),
                 "'", name, "' has dtype ", DTypeName(t->dtype), " but 'x' has ",
                 DTypeName(x.dtype), "; the KV cache is in the activations' dtype, or in "
                 "float16 / bfloat16 under float32 activations");
    PYSPEC_CHECK(t->dtype == k_pages.dtype, "'", name, "' has dtype ", DTypeName(t->dtype),
                 " but 'k_pages' has ", DTypeName(k_pages.dtype));
  }
  for (const auto& [t, name] : {std::pair<const TensorView*, const char*>{&k_new, "k_new"},
                               {&v_new, "v_new"}}) {
    PYSPEC_CHECK(t->ndim == 4 && t->shape[0] >= L && t->shape[1] == T && t->shape[2] == Hkv &&
                     t->shape[3] == D,
                 "'", name, "' must be [L >= ", L, ", ", T, ", ", Hkv, ", ", D, "]; got shape ",
                 t->ShapeString());
    CheckContiguous(*t, name);
    PYSPEC_CHECK(t->dtype == k_pages.dtype, "'", name, "' has dtype ", DTypeName(t->dtype),
                 " but 'k_pages' has ", DTypeName(k_pages.dtype), "; the step's K/V are stored "
                 "like the cache's");
  }
  for (const auto& [t, name] : {std::pair<const TensorView*, const char*>{&cos, "cos"},
                               {&sin, "sin"}}) {
    PYSPEC_CHECK(t->dtype == DType::kFloat32 && t->ndim == 2 && t->shape[0] == T &&
                     t->shape[1] == D,
                 "'", name, "' must be float32 [", T, ", ", D, "]; got ", DTypeName(t->dtype),
                 " ", t->ShapeString());
    CheckContiguous(*t, name);
  }
  PYSPEC_CHECK(plan.num_queries() == T, "the plan is for ", plan.num_queries(),
               " query rows but 'x' has ", T);
  PYSPEC_CHECK(plan.num_kv_heads() == 0 ||
                   (plan.num_q_heads() == Hq && plan.num_kv_heads() == Hkv),
               "the plan was built for ", plan.num_q_heads(), "/", plan.num_kv_heads(),
               " q/kv heads but the config has ", Hq, "/", Hkv);
  PYSPEC_CHECK(k_pages.shape[1] == plan.num_blocks() && k_pages.shape[2] == plan.block_size(),
               "'k_pages' has ", k_pages.shape[1], " blocks of ", k_pages.shape[2],
               " tokens but the plan is for ", plan.num_blocks(), " of ", plan.block_size());
  PYSPEC_CHECK(v_pages.shape[1] == k_pages.shape[1] && v_pages.shape[2] == k_pages.shape[2],
               "'v_pages' has shape ", v_pages.ShapeString(), " but 'k_pages' ",
               k_pages.ShapeString());
  if (T == 0 || begin == end) return;
  const int64_t es = DTypeSize(x.dtype);
  const int64_t qkv_n = (Hq + 2 * Hkv) * D;
  // Scratch, per thread and reused across calls: h, qkv, q, attention out, projection out,
  // gate/up, activation, and an input gathered for a matrix's stored column order (when any).
  bool any_perm = false;
  for (int64_t l = begin; l < end; ++l) {
    for (const DecoderMatrix* m : {&layers[l].wqkv, &layers[l].wo, &layers[l].wgu, &layers[l].wd}) {
      any_perm = any_perm || m->perm.data != nullptr;
    }
  }
  const int64_t max_k = std::max(std::max(H, Hq * D), I);
  const int64_t sizes[] = {T * H,      T * qkv_n, T * Hq * D, T * Hq * D, T * H, T * 2 * I,
                           T * I,      any_perm ? T * max_k : 0};
  constexpr int kParts = sizeof(sizes) / sizeof(sizes[0]);
  int64_t total = 0;
  for (int64_t s : sizes) total += (s * es + 63) / 64 * 64;
  thread_local std::vector<char> buf;
  if (static_cast<int64_t>(buf.size()) < total + 64) buf.resize(total + 64);
  char* p = buf.data() + (64 - reinterpret_cast<uintptr_t>(buf.data()) % 64) % 64;
  void* ptrs[kParts];
  for (int i = 0; i < kParts; ++i) {
    ptrs[i] = p;
    p += (sizes[i] * es + 63) / 64 * 64;
  }
  const TensorView h = TensorView::Contiguous(ptrs[0], x.dtype, {T, H});
  const TensorView qkv = TensorView::Contiguous(ptrs[1], x.dtype, {T, qkv_n});
  const TensorView q = TensorView::Contiguous(ptrs[2], x.dtype, {T, Hq, D});
  const TensorView a3 = TensorView::Contiguous(ptrs[3], x.dtype, {T, Hq, D});
  const TensorView a2 = TensorView::Contiguous(ptrs[3], x.dtype, {T, Hq * D});
  const TensorView o = TensorView::Contiguous(ptrs[4], x.dtype, {T, H});
  const TensorView gu = TensorView::Contiguous(ptrs[5], x.dtype, {T, 2 * I});
  const TensorView act = TensorView::Contiguous(ptrs[6], x.dtype, {T, I});
  const float scale = cfg.attn_scale != 0.f
                          ? cfg.attn_scale
                          : static_cast<float>(1.0 / std::sqrt(static_cast<double>(D)));
  const LinearKernels& lk = kernels != nullptr ? *kernels : LinearKernels::Default();
  const PackedRoutes routes{lk.PackedRoute(T, true) == LinearKernels::Route::kPacked,
                            lk.PackedRoute(T, false) == LinearKernels::Route::kPacked};
  // Codes without their dense matrix need the packed kernel (the stack has no GEMM to rebuild
  // them for): refused before x changes.
  for (size_t l = 0; !routes.alone && l < layers.size(); ++l) {
    for (const DecoderMatrix* m : {&layers[l].wqkv, &layers[l].wo, &layers[l].wgu, &layers[l].wd}) {
      PYSPEC_CHECK(m->w.data != nullptr, "layer ", l, " holds packed codes without their float32 "
                   "matrix, which the ", lk.isa(), " kernels cannot read at ", T, " rows");
    }
  }
  for (int64_t l = begin; l < end; ++l) {
    const DecoderLayerWeights& w = layers[l];
    const TensorView kp = Slice0(k_pages, l), vp = Slice0(v_pages, l);
    const TensorView kn = Slice0(k_new, l), vn = Slice0(v_new, l);
    RmsNorm(x, w.ln1, cfg.eps, h, pool);
    RunLinear(h, w.wqkv, Opt(w.bqkv), qkv, lk, routes, pool, ptrs[7]);
    RotaryQKV(qkv, cos, sin, q, kn, vn, pool);
    RunAttention(plan, q, kp, vp, kn, vn, a3, nullptr, scale, pool, &lk);
    RunLinear(a2, w.wo, Opt(w.bo), o, lk, routes, pool, ptrs[7]);
    AddInPlace(x, o, pool);
    RmsNorm(x, w.ln2, cfg.eps, h, pool);
    RunLinear(h, w.wgu, nullptr, gu, lk, routes, pool, ptrs[7]);
    SiluMul(gu, act, pool);
    RunLinear(act, w.wd, nullptr, o, lk, routes, pool, ptrs[7]);
    AddInPlace(x, o, pool);
  }
}

}  // namespace pyspec
