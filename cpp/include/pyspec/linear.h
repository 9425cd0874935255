// Dense layer out = x @ w^T + bias on the CPU, tuned for the few input rows of decoding.
//
// Decoding one token (or scoring a draft tree) multiplies M = 1..64 activation rows by every
// weight matrix of the model: with few rows the cost is reading the weights from memory once, a
// GEMV-like, bandwidth-bound problem that BLAS GEMM kernels (built for large M) serve poorly; with
// tens of rows it becomes compute-bound. This kernel streams each weight row exactly once per call
// and computes its dot products with all M input rows while the row is in cache (register blocks
// of 4 weight rows x up to 6 input rows), with fp32 accumulators, and prefetches the next weight
// rows while it computes. It is compiled for the x86-64 baseline (SSE2), AVX2+FMA and AVX-512 and
// picks one at run time (bfloat16 on AVX-512 needs AVX512_BF16, whose vdpbf16ps multiplies bf16
// pairs directly; without it bf16 runs the AVX2 build); output rows are split over the thread pool.
// On CPUs with AMX-BF16 (and an OS that grants the tile state), bfloat16 layers whose N is a
// multiple of 16 and K of 32 run on AMX tiles instead: 16 weight rows x 32 k per tile against up
// to 64 input rows, so a 16-64 row draft tree costs about what one row costs (src/linear_amx.h).
//
// Any M is computed correctly (input rows are tiled), and a row's result never depends on M or on
// the other rows, so a draft tree verified in one call agrees bit for bit with the same rows
// decoded one at a time. For large M (prefill) a GEMM library is faster; pyspec.linear routes
// those to torch.
#pragma once

#include <cstdint>
#include <string>

#include "pyspec/tensor_view.h"

namespace pyspec {

class ThreadPool;
class LinearKernels;

// out[m, n] = sum_k x[m, k] * w[n, k] + bias[n], for
//   x     [M, K]
//   w     [N, K]
//   bias  [N], or nullptr
//   out   [M, N] (written; may alias x, which is read before any output is written)
// All tensors contiguous, on the CPU, and of one dtype: float32, bfloat16 or float16. Products are
// accumulated in fp32 and each output is rounded once. `pool` defaults to ThreadPool::Default(),
// `kernels` (the builds that run) to LinearKernels::Default().
// Throws ValueError naming the bad argument; RuntimeError for CUDA tensors (not implemented).
void Linear(const TensorView& x, const TensorView& w, const TensorView* bias,
            const TensorView& out, ThreadPool* pool = nullptr,
            const LinearKernels* kernels = nullptr);

// Packed weights: out[m, n] = sum_k x[m, k] * w[n, k] + bias[n] with w rebuilt from codes in
// groups of 32 along K: 4-bit, w = d * q + m with q in 0..15 (q [N, K / 2] uint8, byte j of a
// group holding element j in its low nibble and element j + 16 in its high one; d, m [N, K / 32]
// float32), or 8-bit when `m` is null, w = d * q (q [N, K] int8), or 16-bit when q is float16 or
// bfloat16 [N, K]: the weights themselves, widened exactly (d.data and m null: no scales).
// x [M, K] and out [M, N] float32,
// bias [N] float32 or nullptr, K a multiple of 32. Each output accumulates exactly as Linear's
// float32 kernel in use does over the rebuilt weights, so where those equal a float32 matrix bit
// for bit (d * q exact, as with d a float16 value) the result equals Linear on that matrix bit for
// bit, for any M. Needs the AVX2 or AVX-512 build of the float32 kernel
// (LinearKernels::PackedAvailable()), and matches that build; ValueError otherwise and for bad
// arguments.
void LinearPacked(const TensorView& x, const TensorView& q, const TensorView& d,
                  const TensorView* m, const TensorView* bias, const TensorView& out,
                  ThreadPool* pool = nullptr, const LinearKernels* kernels = nullptr);

// The float32 matrix [N, K] that packed codes stand for (as LinearPacked rebuilds it: 4-bit
// w = d * q + m, 8-bit w = d * q, each one rounding of an exact product plus m; 16-bit codes
// widened), written into
// `out` [N, K] float32 contiguous; the codes as for LinearPacked (m null: 8-bit). Where the codes
// were made from a float32 matrix exactly (the packer checks every value), `out` equals it bit
// for bit. Runs on any CPU; ValueError for bad arguments.
void UnpackPacked(const TensorView& q, const TensorView& d, const TensorView* m,
                  const TensorView& out, ThreadPool* pool = nullptr);

// Which builds of the dense kernels run, and which route a call takes: a property of a model's
// weights and of the CPU, chosen once per model (pyspec.linear.Linear, LlamaForCausalLM's
// `kernels`), never per process, so two models in one process may use different ones.
//
// Routes, for a call of `rows` input rows:
//   dense matrix of dtype d: Linear (this kernel) up to MaxFastRows(d) rows, a GEMM library
//     beyond (the caller's: torch's GEMM, which blocks over M);
//   packed codes (LinearPacked) with the float32 matrix beside them: the codes up to
//     PackedMaxRows() rows (where reading 4-bit / 8-bit / 16-bit codes beats the float32 matrix with this
//     build), the float32 matrix beyond; with the codes alone, the codes up to MaxFastRows(float32)
//     rows and the matrix rebuilt for the call (UnpackPacked) beyond. Every route gives a row the
//     same bits.
class LinearKernels {
 public:
  enum class Route : uint8_t {
    kLinear = 0,  // Linear on the dense matrix
    kPacked,      // LinearPacked on the codes
    kGemm,        // a GEMM library on the dense matrix (rebuilt from the codes when absent)
  };

  // `isa`: "auto" (the best this CPU has), "generic" (SSE2), "avx2" (AVX2+FMA), "avx512" (no
  // AMX) or "amx" (AVX-512, and AMX tiles for bfloat16 layers whose shape they take). ValueError
  // for an unknown name or an ISA this CPU, OS or build lacks.
  explicit LinearKernels(const std::string& isa = "auto");
  // The "auto" kernels (this CPU's best), shared.
  static const LinearKernels& Default();

  // The resolved ISA: "generic", "avx2", "avx512" or "amx".
  std::string isa() const;
  // The build that runs layers of `dtype`: "generic", "avx2", "avx512", "avx512-bf16" (bf16
  // through vdpbf16ps) or "amx-bf16" (bf16 on AMX tiles, for the shapes it takes).
  std::string Kernel(DType dtype) const;
  // Input rows up to which Linear beats a GEMM library for `dtype` with this build (measured on
  // the default model's shapes; any M is correct).
  int64_t MaxFastRows(DType dtype) const;
  // Input rows up to which LinearPacked beats Linear on the float32 matrix (32 for AVX-512, 4 for
  // AVX2; 0 where LinearPacked cannot run: it needs the AVX2 or AVX-512 float32 build).
  int64_t PackedMaxRows() const;
  bool PackedAvailable() const { return PackedMaxRows() > 0; }
  // Input rows up to which packed codes take the packed route: with the float32 matrix beside
  // them, min(PackedMaxRows(), MaxFastRows(float32)); alone, MaxFastRows(float32); 0 where
  // LinearPacked cannot run.
  int64_t PackedRowsLimit(bool has_dense) const;
  Route DenseRoute(DType dtype, int64_t rows) const;
  Route PackedRoute(int64_t rows, bool has_dense) const;

  // Internal: the vector build level (0 generic, 1 AVX2, 2 AVX-512) and bf16 on AMX tiles.
  int level() const { return level_; }
  bool amx_bf16() const { return amx_; }

 private:
  int level_ = 0;
  bool amx_ = false;
  int64_t fast_rows_[3] = {0, 0, 0};  // MaxFastRows of float32, bfloat16, float16
};

namespace detail {
// LinearPacked's prefetch distance in blocks of 4 weight rows (0: none); a negative value only
// reads it. Returns the distance now in use. A benchmark knob (it never changes a result).
int64_t SetPackedPrefetchBlocks(int64_t blocks);
}  // namespace detail

}  // namespace pyspec
