// Per-token pieces of a decoder layer on the CPU: RMSNorm and the rotary embedding of a fused
// q/k/v projection.
//
// Decoding runs them on a handful of rows, where a chain of framework ops (upcast, square, mean,
// rsqrt, scale, downcast, weight; slice, negate, concatenate, two products, a sum per head group)
// costs tens of microseconds per call in dispatch alone, a large share of a decode step of the
// default model. Each op here is one call. Both compute in fp32 and round once to the tensor
// dtype; a row's result depends only on that row, never on how many rows the call holds, so a
// draft tree's rows are processed exactly as plain decoding processes them one at a time.
#pragma once

#include "pyspec/tensor_view.h"

namespace pyspec {

class ThreadPool;

// out[t, :] = w * round(x[t, :] * rsqrt(mean(x[t, :]^2) + eps)) for
//   x [T, H], w [H], out [T, H] (may alias x),
// contiguous CPU tensors of one dtype (float32, bfloat16 or float16). The normalized row is
// rounded to the dtype before the weight multiplies it and the product is rounded again, as
// Hugging Face's Llama RMSNorm does (for float32 both roundings are exact no-ops). eps must be
// finite and >= 0. Throws ValueError naming the bad argument.
void RmsNorm(const TensorView& x, const TensorView& w, float eps, const TensorView& out,
             ThreadPool* pool = nullptr);

// Splits a fused projection qkv [T, (Hq + 2 * Hkv) * D] into q [T, Hq, D], k [T, Hkv, D] and
// v [T, Hkv, D], rotating q and k by the rotary embedding in rotate-half layout:
//   y[i] = x[i] * cos[t, i] - x[i + D/2] * sin[t, i]            (i < D/2)
//   y[i] = x[i] * cos[t, i] + x[i - D/2] * sin[t, i]            (i >= D/2)
// with cos/sin [T, D] float32 (any dtype for the others, all alike). v is copied as is. D must be
// even. Throws ValueError naming the bad argument.
void RotaryQKV(const TensorView& qkv, const TensorView& cos, const TensorView& sin,
               const TensorView& q, const TensorView& k, const TensorView& v,
               ThreadPool* pool = nullptr);

// The gated MLP activation: out[t, i] = round(round(silu(gu[t, i])) * gu[t, I + i]) for
// gu [T, 2 * I] (gate then up, as a fused gate/up projection writes them) and out [T, I], with
// silu(a) = a / (1 + exp(-a)) in fp32 and each result rounded to the dtype as torch's
// silu(gate) * up does. Contiguous CPU tensors of one dtype (float32, bfloat16 or float16).
// Throws ValueError naming the bad argument.
void SiluMul(const TensorView& gu, const TensorView& out, ThreadPool* pool = nullptr);

// x[t, j] = round(x[t, j] + y[t, j]) (a residual connection), x and y [T, H] contiguous CPU
// tensors of one dtype. Throws ValueError naming the bad argument.
void AddInPlace(const TensorView& x, const TensorView& y, ThreadPool* pool = nullptr);

}  // namespace pyspec
