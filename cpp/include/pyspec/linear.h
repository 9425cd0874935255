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

// out[m, n] = sum_k x[m, k] * w[n, k] + bias[n], for
//   x     [M, K]
//   w     [N, K]
//   bias  [N], or nullptr
//   out   [M, N] (written; may alias x, which is read before any output is written)
// All tensors contiguous, on the CPU, and of one dtype: float32, bfloat16 or float16. Products are
// accumulated in fp32 and each output is rounded once. `pool` defaults to ThreadPool::Default().
// Throws ValueError naming the bad argument; RuntimeError for CUDA tensors (not implemented).
void Linear(const TensorView& x, const TensorView& w, const TensorView* bias,
            const TensorView& out, ThreadPool* pool = nullptr);

// Packed weights: out[m, n] = sum_k x[m, k] * w[n, k] + bias[n] with w rebuilt from codes in
// groups of 32 along K: 4-bit, w = d * q + m with q in 0..15 (q [N, K / 2] uint8, byte j of a
// group holding element j in its low nibble and element j + 16 in its high one; d, m [N, K / 32]
// float32), or 8-bit when `m` is null, w = d * q (q [N, K] int8). x [M, K] and out [M, N] float32,
// bias [N] float32 or nullptr, K a multiple of 32. Each output accumulates exactly as Linear's
// float32 kernel in use does over the rebuilt weights, so where those equal a float32 matrix bit
// for bit (d * q exact, as with d a float16 value) the result equals Linear on that matrix bit for
// bit, for any M. Needs the AVX2 or AVX-512 build of the float32 kernel
// (detail::PackedLinearAvailable()), and matches that build; ValueError otherwise and for bad
// arguments.
void LinearPacked(const TensorView& x, const TensorView& q, const TensorView& d,
                  const TensorView* m, const TensorView* bias, const TensorView& out,
                  ThreadPool* pool = nullptr);

// The float32 matrix [N, K] that packed codes stand for (as LinearPacked rebuilds it: 4-bit
// w = d * q + m, 8-bit w = d * q, each one rounding of an exact product plus m), written into
// `out` [N, K] float32 contiguous; the codes as for LinearPacked (m null: 8-bit). Where the codes
// were made from a float32 matrix exactly (the packer checks every value), `out` equals it bit
// for bit. Runs on any CPU; ValueError for bad arguments.
void UnpackPacked(const TensorView& q, const TensorView& d, const TensorView* m,
                  const TensorView& out, ThreadPool* pool = nullptr);

// Packed codes on AMX int8 tiles with fixed-point inputs (an opt-in numerics, beside the exact
// LinearPacked). Each float32 input row becomes integers X = round(x * 2^(30 - e)) (|x| < 2^e for
// the row's largest |x|: an exact power-of-two scaling, one rounding), held as 4 signed bytes
// (balanced base 256); AMX int8 tiles multiply them by the codes exactly in int32 per group of
// 32 weights; each group's sums are scaled by its d (plus, 4-bit, m times the group's sum of X) in
// float32, groups in ascending order, and the row's scale is applied once. A row's outputs depend
// only on that row, never on M or the other rows; they are about as accurate as float32 (not its
// bits). A row holding a NaN or an infinity gives NaN outputs. N must be a multiple of 16.
//
// RepackFixed: codes in LinearPacked's layout (q [N, K / 2] uint8 with m, or [N, K] int8; d, m
// [N, K / 32]) -> the same shapes in the tiles' layout (per 16 rows and group: the VNNI tile).
void RepackFixed(const TensorView& q, const TensorView& d, const TensorView* m,
                 const TensorView& tq, const TensorView& td, const TensorView* tm);
// out [M, N] = x [M, K] . W^T (+ bias) with W the repacked codes. ValueError without AMX-INT8.
void LinearFixed(const TensorView& x, const TensorView& tq, const TensorView& td,
                 const TensorView* tm, const TensorView* bias, const TensorView& out,
                 ThreadPool* pool = nullptr);

namespace detail {
// Whether LinearFixed can run here (AMX-INT8 and the OS's tile state).
bool AmxInt8Available();
// Whether LinearPacked can run: the float32 kernel in use is the AVX2 or the AVX-512 build.
bool PackedLinearAvailable();
// Input rows up to which LinearPacked beats Linear on the float32 matrix with the kernel in use
// (32 for AVX-512, 4 for AVX2; 0 where it cannot run). Any M is correct.
int64_t PackedLinearMaxRows();
// LinearPacked's prefetch distance in blocks of 4 weight rows (0: none); a negative value only
// reads it. Returns the distance now in use. A benchmark knob.
int64_t SetPackedPrefetchBlocks(int64_t blocks);
// Which instruction set the kernel uses: "auto" (best the CPU supports), "generic" (SSE2), "avx2"
// (AVX2+FMA), "avx512" (no AMX) or "amx" (AVX-512, and AMX tiles for bfloat16). Process-wide, for
// tests and benchmarks. Returns the ISA now in use. Throws ValueError for unknown names or an ISA
// this CPU lacks.
std::string SetLinearIsa(const std::string& isa);
std::string LinearIsa();
// The build that runs layers of `dtype` now: "generic", "avx2", "avx512", "avx512-bf16" (bf16
// through vdpbf16ps) or "amx-bf16" (bf16 on AMX tiles, for the shapes it takes).
std::string LinearKernel(DType dtype);
}  // namespace detail

}  // namespace pyspec
