// The CPU decoder stack in one call (see pyspec/decoder.h for the contract).
#include "pyspec/decoder.h"

#include <cmath>
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

void RunLinear(const TensorView& x, const DecoderMatrix& w, const TensorView* bias,
               const TensorView& out, int64_t packed_rows, ThreadPool* pool) {
  if (w.packed && x.shape[0] <= packed_rows) {
    LinearPacked(x, w.q, w.d, Opt(w.m), bias, out, pool);
  } else {
    Linear(x, w.w, bias, out, pool);
  }
}

}  // namespace

void DecoderLayers(const DecoderConfig& cfg, const std::vector<DecoderLayerWeights>& layers,
                   const TensorView& x, const TensorView& cos, const TensorView& sin,
                   const AttentionPlan& plan, const TensorView& k_pages,
                   const TensorView& v_pages, const TensorView& k_new, const TensorView& v_new,
                   int64_t begin, int64_t end, ThreadPool* pool) {
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
  PYSPEC_CHECK(Hq > 0 && Hkv > 0 && Hq % Hkv == 0 && D > 0 && D % 2 == 0 && I > 0,
               "bad decoder config: ", Hq, " heads, ", Hkv, " KV heads, head dim ", D,
               ", intermediate size ", I, " (heads a multiple of the KV heads, an even head dim)");
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
    PYSPEC_CHECK(t->dtype == x.dtype, "'", name, "' has dtype ", DTypeName(t->dtype),
                 " but 'x' has ", DTypeName(x.dtype));
  }
  for (const auto& [t, name] : {std::pair<const TensorView*, const char*>{&k_new, "k_new"},
                               {&v_new, "v_new"}}) {
    PYSPEC_CHECK(t->ndim == 4 && t->shape[0] >= L && t->shape[1] == T && t->shape[2] == Hkv &&
                     t->shape[3] == D,
                 "'", name, "' must be [L >= ", L, ", ", T, ", ", Hkv, ", ", D, "]; got shape ",
                 t->ShapeString());
    CheckContiguous(*t, name);
    PYSPEC_CHECK(t->dtype == x.dtype, "'", name, "' has dtype ", DTypeName(t->dtype),
                 " but 'x' has ", DTypeName(x.dtype));
  }
  if (T == 0 || begin == end) return;
  const int64_t es = DTypeSize(x.dtype);
  const int64_t qkv_n = (Hq + 2 * Hkv) * D;
  // Scratch, per thread and reused across calls: h, qkv, q, attention out, projection out,
  // gate/up, activation.
  const int64_t sizes[] = {T * H, T * qkv_n, T * Hq * D, T * Hq * D, T * H, T * 2 * I, T * I};
  int64_t total = 0;
  for (int64_t s : sizes) total += (s * es + 63) / 64 * 64;
  thread_local std::vector<char> buf;
  if (static_cast<int64_t>(buf.size()) < total + 64) buf.resize(total + 64);
  char* p = buf.data() + (64 - reinterpret_cast<uintptr_t>(buf.data()) % 64) % 64;
  void* ptrs[7];
  for (int i = 0; i < 7; ++i) {
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
  const int64_t packed_rows = detail::PackedLinearMaxRows();
  for (int64_t l = begin; l < end; ++l) {
    const DecoderLayerWeights& w = layers[l];
    const TensorView kp = Slice0(k_pages, l), vp = Slice0(v_pages, l);
    const TensorView kn = Slice0(k_new, l), vn = Slice0(v_new, l);
    RmsNorm(x, w.ln1, cfg.eps, h, pool);
    RunLinear(h, w.wqkv, Opt(w.bqkv), qkv, packed_rows, pool);
    RotaryQKV(qkv, cos, sin, q, kn, vn, pool);
    RunAttention(plan, q, kp, vp, kn, vn, a3, nullptr, scale, pool);
    RunLinear(a2, w.wo, Opt(w.bo), o, packed_rows, pool);
    AddInPlace(x, o, pool);
    RmsNorm(x, w.ln2, cfg.eps, h, pool);
    RunLinear(h, w.wgu, nullptr, gu, packed_rows, pool);
    SiluMul(gu, act, pool);
    RunLinear(act, w.wd, nullptr, o, packed_rows, pool);
    AddInPlace(x, o, pool);
  }
}

}  // namespace pyspec
