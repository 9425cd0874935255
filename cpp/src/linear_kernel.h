// The register-blocked dense kernel shared by Linear (linear_dense.cc) and LinearPacked
// (linear_packed.cc); internal to pyspec_core. See pyspec/linear.h for the contracts.
//
// Work layout: the output columns (weight rows) are split into blocks of kNr = 4 rows; a block is
// one unit of parallel work. For each block the kernel walks K once per tile of up to MR input
// rows, keeping MR x 4 vector accumulators in registers: the block's weights come from memory on
// the first tile and from L1/L2 on the others, so every weight byte crosses the memory bus once per
// call. While a block's tiles run, the next block is prefetched into L2, spread evenly over all of
// them: with many input rows the block's compute then hides the next block's memory reads instead
// of following them. The inputs are first copied (and widened) into a zero-padded buffer, so the
// kernel loads whole vectors of x even at the K tail; only the weights need a partial load there.
// Like attention.cc, the kernel is written with GCC/Clang vector extensions and compiled three
// times (x86-64 baseline, target("avx2,fma") and target("avx512f")); a cpuid check picks one at run
// time. On CPUs with AVX512_BF16, bfloat16 layers multiply pairs of bf16 values with vdpbf16ps
// (fp32 accumulation, exact products; the inputs stay bfloat16), twice the rate of widening them to
// fp32 first. FMA contraction of `acc += x * w` relies on GCC/Clang's default -ffp-contract for
// C++. Each output's accumulation order depends only on the build in use, never on M or on which
// tile computes it, so a row's result does not depend on the rows beside it.
#pragma once

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

#include "cpu_isa.h"
#include "half.h"
#include "pyspec/check.h"
#include "pyspec/linear.h"
#include "pyspec/tensor_view.h"

#define PYSPEC_INLINE inline __attribute__((always_inline))
#define PYSPEC_INLINE_LAMBDA __attribute__((always_inline))

namespace pyspec {
namespace linear_kernel {

using detail::StrCat;

constexpr int kNr = 4;         // weight rows per register block (and per unit of parallel work)
constexpr int64_t kPad = 32;   // x rows are padded to a multiple of this many elements (>= any step)
// Smallest amount of weights one parallel chunk reads. Waking a worker costs a few microseconds,
// about the time to stream 64 KiB, so smaller layers stay on the calling thread.
constexpr int64_t kMinChunkBytes = 96 * 1024;

// kBF16Dot: bf16 weights and bf16 inputs multiplied in pairs by vdpbf16ps (AVX512_BF16 builds).
enum class WKind { kF32, kBF16, kF16, kBF16Dot };

struct Ctx {
  const float* x;     // [M, ldx] fp32, zero-padded past K (kBF16Dot: [M, ldx] bf16 bits)
  const void* w;      // [N, K] in the weight dtype
  const float* bias;  // [N] fp32 or nullptr
  void* out;          // [M, N] in the output dtype
  int64_t M, N, K, ldx;
  DType dtype;
};

inline int64_t RoundUp(int64_t x, int64_t m) { return (x + m - 1) / m * m; }

// ---------------------------------------------------------------------------------------------
// Vector helpers (V = float vector type of L lanes)
// ---------------------------------------------------------------------------------------------

// Integer vectors of the lane count of a float vector (4 or 8 lanes).
template <int L>
struct IntVec;
template <>
struct IntVec<4> {
  typedef uint32_t U __attribute__((vector_size(16)));
};
template <>
struct IntVec<8> {
  typedef uint32_t U __attribute__((vector_size(32)));
};
template <>
struct IntVec<16> {
  typedef uint32_t U __attribute__((vector_size(64)));
};

// fp16 bits held in the high half of each 32-bit lane (low half zero) -> fp32. Moving the
// exponent+mantissa to float position and multiplying by 2^112 rebiases the exponent and
// normalizes subnormals exactly (the sign rides along); Inf/NaN keep an all-ones exponent.
// Vectors go by pointer, never by value, so the psABI never changes (as in attention.cc).
template <class V, class U>
PYSPEC_INLINE void HalfHighToFloat(V* out, const U& h) {
  const U sign = h & 0x80000000u;
  const U em = (h >> 3) & 0x0fffe000u;
  const U scaled = reinterpret_cast<U>(reinterpret_cast<V>(sign | em) * 5.192296858534828e33f);
  // Exponent 31 (Inf/NaN). A signed compare (em < 2^28): x86 has no unsigned vector compare.
  typedef int32_t I __attribute__((vector_size(sizeof(U))));
  const U special = reinterpret_cast<U>(reinterpret_cast<I>(em) >= 0x0f800000);
  *out = reinterpret_cast<V>((special & (sign | em | 0x7f800000u)) | (~special & scaled));
}

// Loads 2L consecutive 16-bit weights at p as two fp32 vectors: `even` holds elements 0, 2, 4..,
// `odd` elements 1, 3, 5... Each 32-bit lane holds an (even, odd) pair; the odd one already sits
// where a bf16 widens to, so bf16 costs one shift and one mask per 2L weights. The inputs are laid
// out to match (see WidenRows).
template <class V, WKind WK>
PYSPEC_INLINE void LoadW16(V* even, V* odd, const void* p) {
  using U = typename IntVec<sizeof(V) / sizeof(float)>::U;
  U u;
  std::memcpy(&u, p, sizeof(U));
  const U lo = u << 16, hi = u & 0xffff0000u;
  if constexpr (WK == WKind::kBF16) {
    *even = reinterpret_cast<V>(lo);
    *odd = reinterpret_cast<V>(hi);
  } else {
    HalfHighToFloat(even, lo);
    HalfHighToFloat(odd, hi);
  }
}

// Sums of the lanes of four vectors, as {sum a[0], sum a[1], sum a[2], sum a[3]}.
template <class V>
PYSPEC_INLINE void Reduce4(const V* a, float* res) {
  typedef float V4 __attribute__((vector_size(16)));
  V4 q[4];
  for (int r = 0; r < 4; ++r) {
    if constexpr (sizeof(V) == 64) {
      typedef float V8 __attribute__((vector_size(32)));
      const V8 h = __builtin_shufflevector(a[r], a[r], 0, 1, 2, 3, 4, 5, 6, 7) +
                   __builtin_shufflevector(a[r], a[r], 8, 9, 10, 11, 12, 13, 14, 15);
      q[r] = __builtin_shufflevector(h, h, 0, 1, 2, 3) + __builtin_shufflevector(h, h, 4, 5, 6, 7);
    } else if constexpr (sizeof(V) == 32) {
      q[r] = __builtin_shufflevector(a[r], a[r], 0, 1, 2, 3) +
             __builtin_shufflevector(a[r], a[r], 4, 5, 6, 7);
    } else {
      q[r] = a[r];
    }
  }
  const V4 t0 = __builtin_shufflevector(q[0], q[1], 0, 2, 4, 6) +
                __builtin_shufflevector(q[0], q[1], 1, 3, 5, 7);
  const V4 t1 = __builtin_shufflevector(q[2], q[3], 0, 2, 4, 6) +
                __builtin_shufflevector(q[2], q[3], 1, 3, 5, 7);
  const V4 s = __builtin_shufflevector(t0, t1, 0, 2, 4, 6) +
               __builtin_shufflevector(t0, t1, 1, 3, 5, 7);
  std::memcpy(res, &s, sizeof s);
}

template <class V>
PYSPEC_INLINE float Reduce1(const V& a) {
  constexpr int L = sizeof(V) / sizeof(float);
  float s = 0.0f;
  for (int i = 0; i < L; ++i) s += a[i];
  return s;
}

// One row of Reduce4's tree (the same additions in the same order, so the same bits), for a
// block that holds fewer than four weight rows of a full one.
template <class V>
PYSPEC_INLINE float ReduceTree1(const V& a) {
  typedef float V4 __attribute__((vector_size(16)));
  V4 q;
  if constexpr (sizeof(V) == 64) {
    typedef float V8 __attribute__((vector_size(32)));
    const V8 h = __builtin_shufflevector(a, a, 0, 1, 2, 3, 4, 5, 6, 7) +
                 __builtin_shufflevector(a, a, 8, 9, 10, 11, 12, 13, 14, 15);
    q = __builtin_shufflevector(h, h, 0, 1, 2, 3) + __builtin_shufflevector(h, h, 4, 5, 6, 7);
  } else if constexpr (sizeof(V) == 32) {
    q = __builtin_shufflevector(a, a, 0, 1, 2, 3) + __builtin_shufflevector(a, a, 4, 5, 6, 7);
  } else {
    q = a;
  }
  return (q[0] + q[1]) + (q[2] + q[3]);
}

// ---------------------------------------------------------------------------------------------
// Micro-kernel: res[MR][NR] = x[MR rows] . w[NR rows] over all K
// ---------------------------------------------------------------------------------------------

// Elements of K per step: L fp32 weights, or 2L 16-bit ones (an even and an odd vector when
// widened, L pairs for vdpbf16ps). Either way one step of NR rows reads NR * sizeof(V) bytes.
template <class V, WKind WK>
constexpr int64_t StepOf() {
  return WK == WKind::kF32 ? sizeof(V) / sizeof(float) : 2 * sizeof(V) / sizeof(float);
}

// Bytes per element of the input buffer: fp32, or the bf16 inputs themselves for kBF16Dot.
template <WKind WK>
constexpr int64_t XSize() {
  return WK == WKind::kBF16Dot ? 2 : 4;
}

// acc[i] += x[2i] * w[2i] + x[2i + 1] * w[2i + 1] over bf16 pairs (vdpbf16ps: the products are exact
// in fp32). Inline assembly, because the target("avx512f") build that instantiates it is entered
// only on CPUs with AVX512_BF16 (SelectKernel), and its "v" operands are zmm registers there.
template <class V>
PYSPEC_INLINE void DotBf16(V* acc, const V& x, const V& w) {
  static_assert(sizeof(V) == 64, "vdpbf16ps is used on zmm registers");
  V a = *acc;  // a plain value as the asm operand keeps the accumulators in registers
  asm("vdpbf16ps %2, %1, %0" : "+v"(a) : "v"(w), "vm"(x));
  *acc = a;
}

// res[m][r] from the accumulators: Reduce4 for a full block of 4 weight rows, Reduce1 for the rows
// past the last full block (the packed kernels reduce exactly so too).
template <int MR, int NR, class V>
PYSPEC_INLINE void ReduceRows(const V (&acc)[MR][NR], float* res) {
  for (int m = 0; m < MR; ++m) {
    if constexpr (NR == 4) {
      Reduce4(acc[m], res + m * NR);
    } else {
      for (int r = 0; r < NR; ++r) res[m * NR + r] = Reduce1(acc[m][r]);
    }
  }
}

// x: MR input rows of ldx elements (XSize<WK>() bytes each). With pf, also prefetches pf_bytes
// at pf (a share of the weight block after this one) into L2, spread evenly over the steps, so
// its DRAM reads overlap this call's compute. Into L2: a block of 4 long rows and the inputs need
// not fit L1 twice.
template <class V, WKind WK, int MR, int NR>
PYSPEC_INLINE void DotBlock(int64_t K, int64_t ldw, int64_t ldx, const char* x, const char* w,
                            const char* pf, int64_t pf_bytes, float* res) {
  constexpr int L = sizeof(V) / sizeof(float);
  constexpr int64_t S = StepOf<V, WK>();
  constexpr int64_t esize = WK == WKind::kF32 ? 4 : 2;
  constexpr int64_t xsize = XSize<WK>();
  const int64_t xrow = ldx * xsize;
  V acc[MR][NR];
#pragma GCC unroll 8
  for (int m = 0; m < MR; ++m) {
#pragma GCC unroll 4
    for (int r = 0; r < NR; ++r) acc[m][r] = V{};
  }
  // One step: wv from w (full vectors) or from a zero-padded copy of the tail.
  auto step = [&](const char* wp, int64_t wstride, int64_t k) PYSPEC_INLINE_LAMBDA {
    const char* xk = x + k * xsize;
    if constexpr (WK == WKind::kF32 || WK == WKind::kBF16Dot) {
      V wv[NR];
#pragma GCC unroll 4
      for (int r = 0; r < NR; ++r) std::memcpy(&wv[r], wp + r * wstride, sizeof(V));
#pragma GCC unroll 8
      for (int m = 0; m < MR; ++m) {
        V xv;
        std::memcpy(&xv, xk + m * xrow, sizeof(V));
#pragma GCC unroll 4
        for (int r = 0; r < NR; ++r) {
          if constexpr (WK == WKind::kF32) {
            acc[m][r] += xv * wv[r];
          } else {
            DotBf16(&acc[m][r], xv, wv[r]);
          }
        }
      }
    } else {
      // Row-outer, so only one row's two widened vectors are live next to the MR x NR
      // accumulators (the inputs are FMA memory operands, from L1).
#pragma GCC unroll 4
      for (int r = 0; r < NR; ++r) {
        V we, wo;
        LoadW16<V, WK>(&we, &wo, wp + r * wstride);
#pragma GCC unroll 8
        for (int m = 0; m < MR; ++m) {
          V xe, xo;
          std::memcpy(&xe, xk + m * xrow, sizeof(V));
          std::memcpy(&xo, xk + m * xrow + L * 4, sizeof(V));
          // Two FMAs in this order, as the fp32 kernel runs over widened weights (RowBlock):
          // a row's result is then the same whichever path its call took.
          acc[m][r] += xe * we;
          acc[m][r] += xo * wo;
        }
      }
    }
  };
  const int64_t k_full = K / S * S;
  const int64_t pf_lines = pf != nullptr ? (pf_bytes + 63) / 64 : 0;
  const int64_t steps = k_full / S;
  const int64_t lines_per_step = steps > 0 ? (pf_lines + steps - 1) / steps : 0;
  int64_t line = 0;
  for (int64_t k = 0; k < k_full; k += S) {
    for (int64_t e = std::min(pf_lines, line + lines_per_step); line < e; ++line) {
      __builtin_prefetch(pf + line * 64, 0, 2);
    }
    step(w + k * esize, ldw, k);
  }
  for (; line < pf_lines; ++line) __builtin_prefetch(pf + line * 64, 0, 2);
  if (k_full < K) {
    // x is zero-padded to ldx >= RoundUp(K, S); the weights are copied into zeroed rows.
    alignas(64) char tail[NR][sizeof(V)] = {};
    for (int r = 0; r < NR; ++r) {
      std::memcpy(tail[r], w + r * ldw + k_full * esize, (K - k_full) * esize);
    }
    step(&tail[0][0], sizeof(V), k_full);
  }
  ReduceRows<MR, NR>(acc, res);
}

// 1 <= rows <= MR input rows: the MR-row kernel, or the one for a remainder of fewer rows.
template <class V, WKind WK, int MR, int NR>
PYSPEC_INLINE void DotRows(int rows, int64_t K, int64_t ldw, int64_t ldx, const char* x,
                           const char* w, const char* pf, int64_t pf_bytes, float* res) {
  if constexpr (MR > 1) {
    if (rows < MR) {
      DotRows<V, WK, MR - 1, NR>(rows, K, ldw, ldx, x, w, pf, pf_bytes, res);
      return;
    }
  }
  DotBlock<V, WK, MR, NR>(K, ldw, ldx, x, w, pf, pf_bytes, res);
}

// Writes res[mr][nr] (+ bias) to out[m0.., n0..], rounding once to the output dtype.
inline void StoreBlock(const Ctx& c, int64_t m0, int64_t n0, int mr, int nr, const float* res) {
  if (c.dtype == DType::kFloat32 && c.bias == nullptr) {
    for (int m = 0; m < mr; ++m) {
      std::memcpy(static_cast<float*>(c.out) + (m0 + m) * c.N + n0, res + m * nr,
                  nr * sizeof(float));
    }
    return;
  }
  for (int m = 0; m < mr; ++m) {
    const int64_t o = (m0 + m) * c.N + n0;
    for (int r = 0; r < nr; ++r) {
      float v = res[m * nr + r];
      if (c.bias != nullptr) v += c.bias[n0 + r];
      if (c.dtype == DType::kFloat32) {
        static_cast<float*>(c.out)[o + r] = v;
      } else if (c.dtype == DType::kBFloat16) {
        static_cast<uint16_t*>(c.out)[o + r] = half::FloatToBF16(v);
      } else {
        static_cast<uint16_t*>(c.out)[o + r] = half::FloatToHalf(v);
      }
    }
  }
}

// Widens NR rows of 16-bit weights (row length K) into fp32 rows of length ldx (zero-padded), in
// the even/odd order of the inputs, prefetching the next block (pf) like DotBlock.
template <class V, WKind WK, int NR>
PYSPEC_INLINE void WidenBlock(int64_t K, int64_t ldx, const char* w, const char* pf, float* dst) {
  constexpr int L = sizeof(V) / sizeof(float);
  constexpr int64_t S = 2 * L, kStepBytes = NR * sizeof(V);
  const int64_t k_full = K / S * S;
  int64_t i = 0;
  for (int64_t k = 0; k < k_full; k += S, ++i) {
    if (pf != nullptr) {
      for (int64_t b = 0; b < kStepBytes; b += 64) {
        __builtin_prefetch(pf + i * kStepBytes + b, 0, 2);
      }
    }
#pragma GCC unroll 4
    for (int r = 0; r < NR; ++r) {
      V we, wo;
      LoadW16<V, WK>(&we, &wo, w + (r * K + k) * 2);
      std::memcpy(dst + r * ldx + k, &we, sizeof(V));
      std::memcpy(dst + r * ldx + k + L, &wo, sizeof(V));
    }
  }
  for (int r = 0; r < NR; ++r) {
    float* d = dst + r * ldx;
    std::fill(d + k_full, d + ldx, 0.0f);
    if (k_full < K) {
      alignas(64) char tail[sizeof(V)] = {};
      std::memcpy(tail, w + (r * K + k_full) * 2, (K - k_full) * 2);
      V we, wo;
      LoadW16<V, WK>(&we, &wo, tail);
      std::memcpy(d + k_full, &we, sizeof(V));
      std::memcpy(d + k_full + L, &wo, sizeof(V));
    }
  }
}

// All input rows, in tiles of MR, against NR weight rows (row stride ldw bytes, length K). The
// first tile reads the block from memory, the others find it in cache; each tile prefetches an
// equal share of the next block's pf_bytes at pf (none when pf is null).
template <class V, WKind WK, int MR, int NR>
PYSPEC_INLINE void Tiles(const Ctx& c, int64_t n0, int64_t K, int64_t ldw, const char* w,
                         const char* pf, int64_t pf_bytes) {
  float res[MR * NR];
  const char* x = reinterpret_cast<const char*>(c.x);
  const int64_t xrow = c.ldx * XSize<WK>();
  const int64_t tiles = (c.M + MR - 1) / MR;
  const int64_t share = pf != nullptr ? RoundUp((pf_bytes + tiles - 1) / tiles, 64) : 0;
  for (int64_t t = 0; t < tiles; ++t) {
    const int64_t m = t * MR;
    const int rows = static_cast<int>(std::min<int64_t>(MR, c.M - m));
    const int64_t lo = std::min(pf_bytes, t * share), hi = std::min(pf_bytes, lo + share);
    DotRows<V, WK, MR, NR>(rows, K, ldw, c.ldx, x + m * xrow, w,
                           hi > lo ? pf + lo : nullptr, hi - lo, res);
    StoreBlock(c, m, n0, rows, NR, res);
  }
}

// All input rows against weight rows [n0, n0 + NR); `pf` is the next block (pf_bytes) to
// prefetch, or null. fp16 weights needed by more than one tile are widened once into `scratch`
// (NR x ldx floats) and the tiles run the fp32 kernel on that (faster from a few rows on in
// bench/bench_linear.py; for bf16, whose widening is one shift or mask, widening per tile is as
// fast).
template <class Isa, WKind WK, int NR>
PYSPEC_INLINE void RowBlock(const Ctx& c, int64_t n0, const char* pf, int64_t pf_bytes,
                            float* scratch) {
  using V = typename Isa::V;
  constexpr int MR = Isa::kMr;
  constexpr int64_t esize = WK == WKind::kF32 ? 4 : 2;
  const int64_t K = c.K, ldw = K * esize;
  const char* w = static_cast<const char*>(c.w) + n0 * ldw;
  if (WK == WKind::kF16 && c.M > MR) {
    WidenBlock<V, WK, NR>(K, c.ldx, w, pf, scratch);
    Tiles<V, WKind::kF32, MR, NR>(c, n0, c.ldx, c.ldx * 4,
                                   reinterpret_cast<const char*>(scratch), nullptr, 0);
    return;
  }
  Tiles<V, WK, MR, NR>(c, n0, K, ldw, w, pf, pf_bytes);
}

// Weight row blocks [b0, b1) of kNr rows; the last block may be partial.
template <class Isa, WKind WK>
PYSPEC_INLINE void RunBlocksImpl(const Ctx& c, int64_t b0, int64_t b1) {
  constexpr int64_t esize = WK == WKind::kF32 ? 4 : 2;
  // Widened fp16 weight block (see RowBlock); per thread, reused across calls.
  thread_local std::vector<float> scratch_buf;
  float* scratch = nullptr;
  if (WK == WKind::kF16 && c.M > Isa::kMr) {
    if (static_cast<int64_t>(scratch_buf.size()) < kNr * c.ldx) scratch_buf.resize(kNr * c.ldx);
    scratch = scratch_buf.data();
  }
  const int64_t block_bytes = kNr * c.K * esize;
  for (int64_t b = b0; b < b1; ++b) {
    const int64_t n0 = b * kNr;
    if (n0 + kNr <= c.N) {
      // Prefetch the next full block, also across the chunk end (it is likely the next chunk's
      // first block, read next by some thread). Not for a single float32 input row: the loop
      // then only streams the weights in address order, which the hardware prefetchers follow
      // better on their own. From 2 rows on, and for 16-bit weights, whose widening makes the
      // loop slower than the stream, the software prefetch wins (bench/bench_linear.py;
      // docs/experiments/2026-12-04-alignment-prefetch-hugepages.md).
      const char* pf = nullptr;
      if ((c.M > 1 || WK != WKind::kF32) && n0 + 2 * kNr <= c.N) {
        pf = static_cast<const char*>(c.w) + (n0 + kNr) * c.K * esize;
      }
      RowBlock<Isa, WK, kNr>(c, n0, pf, block_bytes, scratch);
    } else {
      for (int64_t n = n0; n < c.N; ++n) RowBlock<Isa, WK, 1>(c, n, nullptr, 0, scratch);
    }
  }
}

template <class Isa>
PYSPEC_INLINE void RunBlocksDispatch(const Ctx& c, int64_t b0, int64_t b1) {
  if (c.dtype == DType::kFloat32) {
    RunBlocksImpl<Isa, WKind::kF32>(c, b0, b1);
  } else if (c.dtype == DType::kBFloat16) {
    RunBlocksImpl<Isa, Isa::kBf16>(c, b0, b1);
  } else {
    RunBlocksImpl<Isa, WKind::kF16>(c, b0, b1);
  }
}

// 16 xmm registers: 3 x 4 accumulators + 4 weight vectors (x is a memory operand).
struct GenericIsa {
  typedef float V __attribute__((vector_size(16)));
  static constexpr int kMr = 3;
  static constexpr WKind kBf16 = WKind::kBF16;
};
#ifdef PYSPEC_X86
// 16 ymm registers, same blocking as the generic kernel with twice the lanes.
struct Avx2Isa {
  typedef float V __attribute__((vector_size(32)));
  static constexpr int kMr = 3;
  static constexpr WKind kBf16 = WKind::kBF16;
};

// 32 zmm registers: 6 x 4 accumulators + 4 weight vectors; bf16 through vdpbf16ps, so this build
// runs bf16 layers only where the CPU has AVX512_BF16 (elsewhere they take the AVX2 build).
struct Avx512Isa {
  typedef float V __attribute__((vector_size(64)));
  static constexpr int kMr = 6;
  static constexpr WKind kBf16 = WKind::kBF16Dot;
};
#endif

// The builds of the kernel over weight row blocks [b0, b1) (linear_dense.cc).
using BlocksFn = void (*)(const Ctx&, int64_t, int64_t);
void RunBlocksGeneric(const Ctx& c, int64_t b0, int64_t b1);
#ifdef PYSPEC_X86
__attribute__((target("avx2,fma"))) void RunBlocksAvx2(const Ctx& c, int64_t b0, int64_t b1);
__attribute__((target("avx512f,avx2,fma"))) void RunBlocksAvx512(const Ctx& c, int64_t b0,
                                                                  int64_t b1);
#endif

// The kernel build for a dtype with `kernels`, and its input layout: 16-bit inputs widened in
// groups of `step16` (2 x its float lanes), or, for `dot`, kept as bf16 (linear_dispatch.cc).
struct Kernel {
  BlocksFn fn;
  int64_t step16;
  bool dot;
};
Kernel SelectKernel(DType dtype, const LinearKernels& kernels);
// Whether `kernels` run `dtype` on AMX tiles (for the shapes they take).
bool UseAmx(DType dtype, const LinearKernels& kernels);

}  // namespace linear_kernel
}  // namespace pyspec
