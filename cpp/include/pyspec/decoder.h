// A Llama-style decoder stack on the CPU in one call: for each layer,
//   h = RMSNorm(x, ln1); qkv = h Wqkv^T + bqkv; rotate q, k (RoPE) into q and k_new[l], v_new[l];
//   x += attention(q, pages of layer l, k_new[l], v_new[l]) Wo^T + bo;
//   h = RMSNorm(x, ln2); x += (silu(h Wg^T) * (h Wu^T)) Wd^T
// with the same kernels, in the same order, as the ops one at a time (RmsNorm, Linear or
// LinearPacked, RotaryQKV, RunAttention, SiluMul, AddInPlace), so the results are those ops'
// bit for bit. For decoding and verification steps (few rows), where calling the ops one by one
// costs more than they compute.
#pragma once

#include <cstdint>
#include <vector>

#include "pyspec/attention.h"
#include "pyspec/tensor_view.h"

namespace pyspec {

class LinearKernels;
class ThreadPool;

// One weight matrix [N, K]: the dense values and, optionally, the same values as packed codes
// (see LinearPacked; `m.data == nullptr` for 8-bit codes), read where the model's
// LinearKernels::PackedRoute says (the same bits either way). Packed codes may come without the
// dense values (`w.data == nullptr`). `perm` (int64 [K], or data == nullptr for none): the
// columns are stored in another order (GPTQ act-order checkpoints, their quantization groups made
// contiguous): stored column j multiplies input column perm[j], so the product reads the input
// gathered at those indices (each in [0, K)).
struct DecoderMatrix {
  TensorView w;
  bool packed = false;
  TensorView q, d, m;
  TensorView perm;
};

struct DecoderLayerWeights {
  TensorView ln1, ln2;                    // [hidden]
  DecoderMatrix wqkv, wo, wgu, wd;        // [(Hq + 2 Hkv) D, hidden], [hidden, Hq D],
                                          // [2 I, hidden] (gate then up), [hidden, I]
  TensorView bqkv, bo;                    // biases, or data == nullptr for none
};

struct DecoderConfig {
  int64_t num_heads = 0, num_kv_heads = 0, head_dim = 0, intermediate = 0;
  float eps = 1e-6f;
  float attn_scale = 0.f;  // 0: 1 / sqrt(head_dim)
};

// Validates a stack's weights for hidden size `hidden` and the model's dtype: every shape, dtype
// and layout, packed codes included. Throws ValueError naming the layer and the tensor.
void CheckDecoderLayers(const DecoderConfig& cfg, const std::vector<DecoderLayerWeights>& layers,
                        int64_t hidden, DType dtype);

// Runs x [T, hidden] (contiguous, in place) through `layers` for one step planned by `plan`.
// cos/sin [T, head_dim] float32; k_pages/v_pages [L, num_blocks, block_size, Hkv, D]; k_new /
// v_new [L', T, Hkv, D] with L' >= layers.size(), receiving each layer's new K/V. Every tensor on
// the CPU in the model's dtype (float32, bfloat16 or float16) except cos/sin.
// Only layers [begin, end) run (end < 0: to the last), so a caller can read x between them; layer l
// always uses k_pages[l] and k_new[l]. Every argument is checked (CheckDecoderLayers included)
// before x changes. Linear and LinearPacked are correct for any T, but a GEMM library is faster
// for prefill-sized steps, and the per-thread scratch (about T x (2 hidden + 5 head rows + 3
// intermediate) values, and T x max(K) more when a matrix has a `perm`) is kept for the thread's
// next call. `kernels`: the model's dense-layer
// kernels (LinearKernels::Default() when null). Throws ValueError naming a bad argument.
void DecoderLayers(const DecoderConfig& cfg, const std::vector<DecoderLayerWeights>& layers,
                   const TensorView& x, const TensorView& cos, const TensorView& sin,
                   const AttentionPlan& plan, const TensorView& k_pages,
                   const TensorView& v_pages, const TensorView& k_new, const TensorView& v_new,
                   int64_t begin = 0, int64_t end = -1, ThreadPool* pool = nullptr,
                   const LinearKernels* kernels = nullptr);

}  // namespace pyspec
