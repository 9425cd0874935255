// CPU dense layer for few input rows (see pyspec/linear.h for the contract).
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
#include "pyspec/linear.h"

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstring>
#include <initializer_list>
#include <string>
#include <vector>

#include "cpu_isa.h"
#include "half.h"
#include "linear_amx.h"
#include "pyspec/check.h"
#include "pyspec/thread_pool.h"

#ifdef PYSPEC_X86
#include <immintrin.h>
#endif

#define PYSPEC_INLINE inline __attribute__((always_inline))
#define PYSPEC_INLINE_LAMBDA __attribute__((always_inline))

namespace pyspec {
namespace {

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

int64_t RoundUp(int64_t x, int64_t m) { return (x + m - 1) / m * m; }

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
void StoreBlock(const Ctx& c, int64_t m0, int64_t n0, int mr, int nr, const float* res) {
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
// (NR x ldx floats) and the tiles run the fp32 kernel on that (measured 2x faster at M = 16; for
// bf16, whose widening is one shift or mask, widening per tile is as fast).
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
      // better on their own (bench_linear.py, 2 threads: 20.1-20.6 ms per model pass without
      // against 21.3-22.2 ms with). From 2 rows on, and for 16-bit weights, whose widening
      // makes the loop slower than the stream, the software prefetch wins (float32 at 8 rows
      // 27.6 vs 33.7 ms; float16 at 1 row 16.0-17.5 vs 27.6-28.4 ms).
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

void RunBlocksGeneric(const Ctx& c, int64_t b0, int64_t b1) {
  RunBlocksDispatch<GenericIsa>(c, b0, b1);
}

#ifdef PYSPEC_X86
// 16 ymm registers, same blocking as the generic kernel with twice the lanes.
struct Avx2Isa {
  typedef float V __attribute__((vector_size(32)));
  static constexpr int kMr = 3;
  static constexpr WKind kBf16 = WKind::kBF16;
};

__attribute__((target("avx2,fma"))) void RunBlocksAvx2(const Ctx& c, int64_t b0, int64_t b1) {
  RunBlocksDispatch<Avx2Isa>(c, b0, b1);
}

// 32 zmm registers: 6 x 4 accumulators + 4 weight vectors; bf16 through vdpbf16ps, so this build
// runs bf16 layers only where the CPU has AVX512_BF16 (elsewhere they take the AVX2 build).
struct Avx512Isa {
  typedef float V __attribute__((vector_size(64)));
  static constexpr int kMr = 6;
  static constexpr WKind kBf16 = WKind::kBF16Dot;
};

__attribute__((target("avx512f,avx2,fma"))) void RunBlocksAvx512(const Ctx& c, int64_t b0,
                                                                  int64_t b1) {
  RunBlocksDispatch<Avx512Isa>(c, b0, b1);
}

// ---------------------------------------------------------------------------------------------
// Packed weights (LinearPacked): 4-bit (w = d * q + m, q in 0..15) or 8-bit (w = d * q, q in
// -128..127) codes in groups of 32 along K, one d (and m) per group as fp32. Each step rebuilds
// 16 weights as fp32 and runs the float32 kernel's accumulation on them: acc += x * w per 16 lanes
// of K in ascending order, then Reduce4. With d a float16 value (11 significant bits) every d * q
// is exact in fp32, so the rebuilt weight is one rounding of d * q + m whichever way it is
// computed; where those equal the float32 weights bit for bit (the packer checks), a packed layer
// gives the float32 kernel's outputs bit for bit while reading 3.6x (8-bit) to 5.3x (4-bit) fewer
// bytes.
// ---------------------------------------------------------------------------------------------

std::atomic<int64_t> g_packed_pf_blocks{2};  // prefetch distance in blocks (a benchmark knob)

struct PackedCtx {
  const float* x;       // [M, ldx] fp32 (rows aligned to 64 bytes)
  const uint8_t* q;     // 4-bit: [N, K / 2]; 8-bit: [N, K]
  const float* d;       // [N, K / 32]
  const float* mn;      // [N, K / 32] (4-bit), or nullptr (8-bit)
  const float* bias;    // [N] or nullptr
  float* out;           // [M, N]
  int64_t M, N, K, ldx;

  // The same call as a float32 one (no weights): for the float32 kernel's tiles and stores.
  Ctx Dense() const { return Ctx{x, nullptr, bias, out, M, N, K, ldx, DType::kFloat32}; }
};

typedef float VQ __attribute__((vector_size(64)));
typedef int32_t IQ __attribute__((vector_size(64)));

// The 32 weights of group g of packed row `row` as two fp32 vectors (k = 32g .. 32g + 15 and
// 32g + 16 .. 32g + 31). 4-bit: the group's 16 possible values d * j + m (j = 0..15) fill one
// register and vpermps picks each weight's, indexed by the low 4 bits of its lane, so the low
// nibble needs no mask; 8-bit: d * q.
template <int BITS>
__attribute__((target("avx512f,avx2,fma"))) PYSPEC_INLINE void RebuildGroup(
    const PackedCtx& c, int64_t row, int64_t g, VQ* w0, VQ* w1) {
  const int64_t G = c.K / 32;
  const VQ dv = VQ{} + c.d[row * G + g];
  if constexpr (BITS == 4) {
    const VQ iota = {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15};
    const VQ table = iota * dv + (VQ{} + c.mn[row * G + g]);
    const __m512i i = _mm512_maskz_cvtepu8_epi32(
        0xffff, _mm_loadu_si128(reinterpret_cast<const __m128i*>(c.q + row * (c.K / 2) + g * 16)));
    // The maskz forms: GCC 12's unmasked ones start from an "undefined" register that -Wall
    // reports as maybe-uninitialized.
    const __m512i hi = reinterpret_cast<__m512i>(reinterpret_cast<IQ>(i) >> 4);
    *w0 = reinterpret_cast<VQ>(
        _mm512_maskz_permutexvar_ps(0xffff, i, reinterpret_cast<__m512>(table)));
    *w1 = reinterpret_cast<VQ>(
        _mm512_maskz_permutexvar_ps(0xffff, hi, reinterpret_cast<__m512>(table)));
  } else {
    const __m128i* p = reinterpret_cast<const __m128i*>(c.q + row * c.K + g * 32);
    const IQ i0 = reinterpret_cast<IQ>(_mm512_maskz_cvtepi8_epi32(0xffff, _mm_loadu_si128(p)));
    const IQ i1 = reinterpret_cast<IQ>(_mm512_maskz_cvtepi8_epi32(0xffff, _mm_loadu_si128(p + 1)));
    *w0 = __builtin_convertvector(i0, VQ) * dv;
    *w1 = __builtin_convertvector(i1, VQ) * dv;
  }
}

// res[MR][NR] for rows x[0..MR) against packed weight rows [n0, n0 + NR), rebuilding the
// weights in registers (few input rows).
// kTree: reduce every output alone with Reduce4's tree (MR > 4: more input rows than the float32
// kernel's tiles of 4, whose full blocks it reduces so).
template <int MR, int NR, int BITS, bool kTree = false>
__attribute__((target("avx512f,avx2,fma"))) PYSPEC_INLINE void DotBlockPacked(
    const PackedCtx& c, const float* x, int64_t n0, float* res) {
  const int64_t G = c.K / 32;
  VQ acc[MR][NR];
#pragma GCC unroll 8
  for (int m = 0; m < MR; ++m) {
#pragma GCC unroll 4
    for (int r = 0; r < NR; ++r) acc[m][r] = VQ{};
  }
  for (int64_t g = 0; g < G; ++g) {
    VQ w0[NR], w1[NR];
#pragma GCC unroll 4
    for (int r = 0; r < NR; ++r) RebuildGroup<BITS>(c, n0 + r, g, &w0[r], &w1[r]);
    const float* xk = x + g * 32;
#pragma GCC unroll 8
    for (int m = 0; m < MR; ++m) {
      VQ xv;
      std::memcpy(&xv, xk + m * c.ldx, sizeof(VQ));
#pragma GCC unroll 4
      for (int r = 0; r < NR; ++r) acc[m][r] += xv * w0[r];
    }
#pragma GCC unroll 8
    for (int m = 0; m < MR; ++m) {
      VQ xv;
      std::memcpy(&xv, xk + 16 + m * c.ldx, sizeof(VQ));
#pragma GCC unroll 4
      for (int r = 0; r < NR; ++r) acc[m][r] += xv * w1[r];
    }
  }
  if constexpr (kTree) {
    for (int m = 0; m < MR; ++m) {
      for (int r = 0; r < NR; ++r) res[m * NR + r] = ReduceTree1(acc[m][r]);
    }
  } else {
    ReduceRows<MR, NR>(acc, res);
  }
}

template <int MR, int NR, int BITS, bool kTree = false>
__attribute__((target("avx512f,avx2,fma"))) PYSPEC_INLINE void DotRowsPacked(
    int rows, const PackedCtx& c, const float* x, int64_t n0, float* res) {
  if constexpr (MR > 1) {
    if (rows < MR) {
      DotRowsPacked<MR - 1, NR, BITS, kTree>(rows, c, x, n0, res);
      return;
    }
  }
  DotBlockPacked<MR, NR, BITS, kTree>(c, x, n0, res);
}

// Up to this many input rows the weights are rebuilt in registers for each tile of 4 rows;
// beyond it a block's rows are rebuilt once into an fp32 scratch block (L1-resident) that the
// float32 kernel's tiles then read, as for float16 weights (RowBlock).
constexpr int64_t kPackedRegisterRows = 8;

template <int NR, int BITS>
__attribute__((target("avx512f,avx2,fma"))) void PackedRowBlock(const PackedCtx& c, int64_t n0,
                                                               float* scratch) {
  if (c.M > kPackedRegisterRows) {
    for (int r = 0; r < NR; ++r) {
      for (int64_t g = 0; g < c.K / 32; ++g) {
        VQ w0, w1;
        RebuildGroup<BITS>(c, n0 + r, g, &w0, &w1);
        std::memcpy(scratch + r * c.K + g * 32, &w0, sizeof(VQ));
        std::memcpy(scratch + r * c.K + g * 32 + 16, &w1, sizeof(VQ));
      }
    }
    const Ctx f = c.Dense();
    Tiles<VQ, WKind::kF32, Avx512Isa::kMr, NR>(f, n0, c.K, c.K * 4,
                                                 reinterpret_cast<const char*>(scratch), nullptr,
                                                 0);
    return;
  }
  if constexpr (NR == 4) {
    if (c.M > 4) {
      // 5 to 8 rows: one pass over the codes, all four weight rows at a time (up to 8 x 4
      // accumulators), rather than rebuilding every weight for two tiles of 4 rows; reduced with
      // Reduce4's tree, so each output has the bits the float32 kernel's full block gives it.
      // (Two weight rows at a time, 8 x 2, measured 13% / 12% / 6% / 2% slower at 5 / 6 / 7 / 8
      // rows: bench/bench_linear.py --packed --rows 4,5,6,7,8.)
      float res[kPackedRegisterRows * 4];
      const int rows = static_cast<int>(c.M);
      DotRowsPacked<kPackedRegisterRows, 4, BITS, true>(rows, c, c.x, n0, res);
      StoreBlock(c.Dense(), 0, n0, rows, 4, res);
      return;
    }
  }
  constexpr int MR = 4;
  float res[MR * NR];
  for (int64_t m0 = 0; m0 < c.M; m0 += MR) {
    const int rows = static_cast<int>(std::min<int64_t>(MR, c.M - m0));
    DotRowsPacked<MR, NR, BITS>(rows, c, c.x + m0 * c.ldx, n0, res);
    StoreBlock(c.Dense(), m0, n0, rows, NR, res);
  }
}

// The AVX2 build: the float32 kernel there walks K in steps of 8 lanes (3 x 4 register blocks),
// so the packed one rebuilds 8 weights at a time, w = d * q + m computed directly (a 16-value
// table does not fit an 8-lane permute), and accumulates in that kernel's order.
typedef float V8 __attribute__((vector_size(32)));
typedef int32_t I8v __attribute__((vector_size(32)));

// Elements 32g + 8s .. 32g + 8s + 7 of packed row `row` (s = 0..3): for 4-bit, the low nibbles
// of the group's bytes 0-7 (s = 0) and 8-15 (s = 1), then their high nibbles.
template <int BITS>
__attribute__((target("avx2,fma"))) PYSPEC_INLINE V8 RebuildStep8(const PackedCtx& c,
                                                                  int64_t row, int64_t g, int s) {
  const int64_t G = c.K / 32;
  const V8 dv = V8{} + c.d[row * G + g];
  if constexpr (BITS == 4) {
    const uint8_t* p = c.q + row * (c.K / 2) + g * 16 + (s & 1) * 8;
    I8v i = reinterpret_cast<I8v>(
        _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
    i = s < 2 ? (i & 15) : (i >> 4);
    return __builtin_convertvector(i, V8) * dv + (V8{} + c.mn[row * G + g]);
  } else {
    const uint8_t* p = c.q + row * c.K + g * 32 + s * 8;
    const I8v i = reinterpret_cast<I8v>(
        _mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
    return __builtin_convertvector(i, V8) * dv;
  }
}

template <int MR, int NR, int BITS>
__attribute__((target("avx2,fma"))) PYSPEC_INLINE void DotBlockPacked8(
    const PackedCtx& c, const float* x, int64_t n0, float* res) {
  V8 acc[MR][NR];
#pragma GCC unroll 4
  for (int m = 0; m < MR; ++m) {
#pragma GCC unroll 4
    for (int r = 0; r < NR; ++r) acc[m][r] = V8{};
  }
  for (int64_t g = 0; g < c.K / 32; ++g) {
#pragma GCC unroll 4
    for (int s = 0; s < 4; ++s) {
      V8 w[NR];
#pragma GCC unroll 4
      for (int r = 0; r < NR; ++r) w[r] = RebuildStep8<BITS>(c, n0 + r, g, s);
      const float* xk = x + g * 32 + s * 8;
#pragma GCC unroll 4
      for (int m = 0; m < MR; ++m) {
        V8 xv;
        std::memcpy(&xv, xk + m * c.ldx, sizeof(V8));
#pragma GCC unroll 4
        for (int r = 0; r < NR; ++r) acc[m][r] += xv * w[r];
      }
    }
  }
  ReduceRows<MR, NR>(acc, res);
}

template <int MR, int NR, int BITS>
__attribute__((target("avx2,fma"))) PYSPEC_INLINE void DotRowsPacked8(
    int rows, const PackedCtx& c, const float* x, int64_t n0, float* res) {
  if constexpr (MR > 1) {
    if (rows < MR) {
      DotRowsPacked8<MR - 1, NR, BITS>(rows, c, x, n0, res);
      return;
    }
  }
  DotBlockPacked8<MR, NR, BITS>(c, x, n0, res);
}

// As PackedRowBlock: up to 4 input rows in registers (tiles of 2 rows: 2 x 4 accumulators and 4
// weight vectors of the 16 ymm registers), beyond that one rebuild into the scratch block for the
// float32 kernel's tiles.
template <int NR, int BITS>
__attribute__((target("avx2,fma"))) void PackedRowBlock8(const PackedCtx& c, int64_t n0,
                                                         float* scratch) {
  if (c.M > 4) {
    for (int r = 0; r < NR; ++r) {
      for (int64_t g = 0; g < c.K / 32; ++g) {
        for (int s = 0; s < 4; ++s) {
          const V8 w = RebuildStep8<BITS>(c, n0 + r, g, s);
          std::memcpy(scratch + r * c.K + g * 32 + s * 8, &w, sizeof(V8));
        }
      }
    }
    const Ctx f = c.Dense();
    Tiles<V8, WKind::kF32, Avx2Isa::kMr, NR>(f, n0, c.K, c.K * 4,
                                               reinterpret_cast<const char*>(scratch), nullptr, 0);
    return;
  }
  constexpr int MR = 2;
  float res[MR * NR];
  for (int64_t m0 = 0; m0 < c.M; m0 += MR) {
    const int rows = static_cast<int>(std::min<int64_t>(MR, c.M - m0));
    DotRowsPacked8<MR, NR, BITS>(rows, c, c.x + m0 * c.ldx, n0, res);
    StoreBlock(c.Dense(), m0, n0, rows, NR, res);
  }
}

template <int BITS, bool kW512>
PYSPEC_INLINE void PackedBlocksImpl(const PackedCtx& c, int64_t b0,
                                                             int64_t b1) {
  thread_local std::vector<float> scratch_buf;  // kNr rebuilt rows, per thread
  if (static_cast<int64_t>(scratch_buf.size()) < kNr * c.K + 16) scratch_buf.resize(kNr * c.K + 16);
  float* scratch = scratch_buf.data();
  scratch += ((64 - reinterpret_cast<uintptr_t>(scratch) % 64) % 64) / sizeof(float);
  const int64_t G = c.K / 32, qrow = BITS == 4 ? c.K / 2 : c.K;
  const int64_t pf_dist = g_packed_pf_blocks.load(std::memory_order_relaxed);
  for (int64_t b = b0; b < b1; ++b) {
    const int64_t n0 = b * kNr;
    // Prefetch the codes and scales of the block pf_dist blocks ahead into L2: rebuilding the
    // weights keeps the loop busy enough that the hardware prefetchers alone fall behind.
    if (pf_dist > 0 && n0 + (pf_dist + 1) * kNr <= c.N) {
      const int64_t nf = n0 + pf_dist * kNr;
      const char* pq = reinterpret_cast<const char*>(c.q + nf * qrow);
      for (int64_t o = 0; o < kNr * qrow; o += 64) __builtin_prefetch(pq + o, 0, 2);
      const char* pd = reinterpret_cast<const char*>(c.d + nf * G);
      for (int64_t o = 0; o < kNr * G * 4; o += 64) __builtin_prefetch(pd + o, 0, 2);
      if constexpr (BITS == 4) {
        const char* pm = reinterpret_cast<const char*>(c.mn + nf * G);
        for (int64_t o = 0; o < kNr * G * 4; o += 64) __builtin_prefetch(pm + o, 0, 2);
      }
    }
    if (n0 + kNr <= c.N) {
      if constexpr (kW512) {
        PackedRowBlock<kNr, BITS>(c, n0, scratch);
      } else {
        PackedRowBlock8<kNr, BITS>(c, n0, scratch);
      }
    } else {
      for (int64_t n = n0; n < c.N; ++n) {
        if constexpr (kW512) {
          PackedRowBlock<1, BITS>(c, n, scratch);
        } else {
          PackedRowBlock8<1, BITS>(c, n, scratch);
        }
      }
    }
  }
}

template <int BITS>
__attribute__((target("avx512f,avx2,fma"))) void PackedBlocks512(const PackedCtx& c, int64_t b0,
                                                                int64_t b1) {
  PackedBlocksImpl<BITS, true>(c, b0, b1);
}

template <int BITS>
__attribute__((target("avx2,fma"))) void PackedBlocks256(const PackedCtx& c, int64_t b0,
                                                         int64_t b1) {
  PackedBlocksImpl<BITS, false>(c, b0, b1);
}

bool CpuHasAvx512Bf16() {
  __builtin_cpu_init();
  return __builtin_cpu_supports("avx512bf16");
}
#endif

using BlocksFn = void (*)(const Ctx&, int64_t, int64_t);

detail::IsaSelector g_isa(detail::IsaSelector::kAvx512);  // process-wide: which build of the kernel runs (tests override it)
// bfloat16 on AMX tiles: -1 where available (with the AVX-512 build in use), 0 never, 1 always
// (set through SetLinearIsa: "amx" forces it, a named vector ISA turns it off). Like g_isa, a test
// and benchmark knob: change it while no Linear call runs (the two settings are stored apart).
std::atomic<int> g_amx{-1};

bool UseAmx(DType dtype) {
  if (dtype != DType::kBFloat16) return false;
  const int mode = g_amx.load(std::memory_order_relaxed);
  if (mode >= 0) return mode == 1;
  return g_isa.Resolved() >= detail::IsaSelector::kAvx512 && detail::AmxBf16Available();
}

// The kernel for a dtype, and its input layout: 16-bit inputs widened in groups of `step16`
// (2 x its float lanes), or, for `dot`, kept as bf16.
struct Kernel {
  BlocksFn fn;
  int64_t step16;
  bool dot;
};

Kernel SelectKernel(DType dtype) {
#ifdef PYSPEC_X86
  const int isa = g_isa.Resolved();
  if (isa >= detail::IsaSelector::kAvx512) {
    if (dtype != DType::kBFloat16) return {&RunBlocksAvx512, 32, false};
    static const bool bf16_dot = CpuHasAvx512Bf16();
    if (bf16_dot) return {&RunBlocksAvx512, 32, true};
  }
  if (isa >= detail::IsaSelector::kAvx2) return {&RunBlocksAvx2, 16, false};
#else
  (void)dtype;
#endif
  return {&RunBlocksGeneric, 8, false};
}


// Copies rows of x into a zero-padded buffer of row length ldx: bf16 bits as they are for a `dot`
// kernel, else fp32. Widened 16-bit inputs are stored per group of `step` (= 2L) as the group's
// even elements then its odd ones, the order LoadW16 produces the weights in.
void WidenRows(const TensorView& x, int64_t M, int64_t K, int64_t ldx, const Kernel& kernel,
               void* dst_buf) {
  if (kernel.dot) {
    for (int64_t m = 0; m < M; ++m) {
      uint16_t* d = static_cast<uint16_t*>(dst_buf) + m * ldx;
      std::memcpy(d, x.ptr<uint16_t>() + m * K, K * sizeof(uint16_t));
      std::fill(d + K, d + ldx, uint16_t{0});
    }
    return;
  }
  const int64_t step = kernel.step16;
  for (int64_t m = 0; m < M; ++m) {
    float* d = static_cast<float*>(dst_buf) + m * ldx;
    std::fill(d, d + ldx, 0.0f);
    if (x.dtype == DType::kFloat32) {
      std::memcpy(d, x.ptr<float>() + m * K, K * sizeof(float));
      continue;
    }
    const uint16_t* s = x.ptr<uint16_t>() + m * K;
    const bool bf16 = x.dtype == DType::kBFloat16;
    const int64_t half_step = step / 2;
    for (int64_t k = 0; k < K; ++k) {
      const int64_t g = k / step * step, j = k - g;
      d[g + (j & 1) * half_step + j / 2] = bf16 ? half::BF16ToFloat(s[k]) : half::HalfToFloat(s[k]);
    }
  }
}

void CheckArg(const TensorView& t, const char* name, DType dtype,
              std::initializer_list<int64_t> dims) {
  PYSPEC_CHECK(t.dtype == dtype, "'", name, "' has dtype ", DTypeName(t.dtype), " but 'x' has ",
               DTypeName(dtype), "; x, w, bias and out must share one dtype");
  CheckShape(t, name, dims);
  CheckContiguous(t, name);
}

}  // namespace

namespace detail {

std::string SetLinearIsa(const std::string& isa) {
  if (isa == "amx") {
    PYSPEC_CHECK(AmxBf16Available(), "this CPU, OS or build has no AMX-BF16 linear kernel; use "
                 "auto, generic, avx2 or avx512");
    g_isa.Set("avx512", "linear");
    g_amx.store(1);
    return LinearIsa();
  }
  g_isa.Set(isa, "linear");
  g_amx.store(isa == "auto" ? -1 : 0);
  return LinearIsa();
}

std::string LinearIsa() { return UseAmx(DType::kBFloat16) ? "amx" : g_isa.Name(); }

int64_t SetPackedPrefetchBlocks(int64_t blocks) {
#ifdef PYSPEC_X86
  if (blocks >= 0) g_packed_pf_blocks.store(blocks);
  return g_packed_pf_blocks.load();
#else
  return blocks;
#endif
}

bool PackedLinearAvailable() { return PackedLinearMaxRows() > 0; }

int64_t PackedLinearMaxRows() {
#ifdef PYSPEC_X86
  // Measured on the SmolLM2-135M shapes, 2 threads (one decoding step's dense layers): AVX-512
  // 8.0 / 9.9 / 16.9 / 27.3 ms at 1 / 4 / 8 / 16 rows against 21.1 / 23.2 / 27.3 / 34.0 for
  // float32, 41.0 against 42.9 at 32 and 76.3 against 74.5 at 64; AVX2 9.3 / 17.8 ms at 1 / 4
  // rows against 21.3 / 23.0, but 29.6 / 44.1 at 8 / 16 against 26.9 / 37.4 (its 16 registers
  // hold fewer rows per rebuilt weight).
  const BlocksFn fn = SelectKernel(DType::kFloat32).fn;
  if (fn == &RunBlocksAvx512) return 32;
  if (fn == &RunBlocksAvx2) return 4;
#endif
  return 0;
}

std::string LinearKernel(DType dtype) {
  if (UseAmx(dtype)) return "amx-bf16";
  const Kernel k = SelectKernel(dtype);
  if (k.dot) return "avx512-bf16";
#ifdef PYSPEC_X86
  if (k.fn == &RunBlocksAvx512) return "avx512";
  if (k.fn == &RunBlocksAvx2) return "avx2";
#endif
  return "generic";
}

}  // namespace detail

void Linear(const TensorView& x, const TensorView& w, const TensorView* bias,
            const TensorView& out, ThreadPool* pool) {
  for (const TensorView* t : {&x, &w, bias, &out}) {
    if (t != nullptr && t->device.type == DeviceType::kCUDA) {
      throw RuntimeError("pyspec linear: got CUDA tensors; linear is not implemented on CUDA "
                         "(use torch.nn.functional.linear or cpu tensors)");
    }
  }
  CheckDType(x, "x", {DType::kFloat32, DType::kBFloat16, DType::kFloat16});
  PYSPEC_CHECK(x.ndim == 2, "'x' must be 2-D [M, K]; got shape ", x.ShapeString());
  CheckContiguous(x, "x");
  const int64_t M = x.shape[0], K = x.shape[1];
  PYSPEC_CHECK(w.ndim == 2, "'w' must be 2-D [N, K]; got shape ", w.ShapeString());
  const int64_t N = w.shape[0];
  CheckArg(w, "w", x.dtype, {N, K});
  if (bias != nullptr) CheckArg(*bias, "bias", x.dtype, {N});
  CheckArg(out, "out", x.dtype, {M, N});
  if (M == 0 || N == 0) return;

  // Widened, padded inputs and fp32 bias, shared read-only by the workers. Thread-local so
  // concurrent callers do not share them, and reused across calls.
  thread_local std::vector<float> xbuf, bbuf;
  const float* bias_f = nullptr;
  if (bias != nullptr) {
    if (bias->dtype == DType::kFloat32) {
      bias_f = bias->ptr<float>();
    } else {
      if (static_cast<int64_t>(bbuf.size()) < N) bbuf.resize(N);
      const uint16_t* s = bias->ptr<uint16_t>();
      for (int64_t n = 0; n < N; ++n) {
        bbuf[n] = bias->dtype == DType::kBFloat16 ? half::BF16ToFloat(s[n])
                                                  : half::HalfToFloat(s[n]);
      }
      bias_f = bbuf.data();
    }
  }
  ThreadPool& tp = pool != nullptr ? *pool : ThreadPool::Default();

  // The AMX path depends on the dtype and the layer's shape only, never on M, so every row of a
  // layer is computed by one kernel whatever the rows beside it.
  if (UseAmx(x.dtype) && detail::AmxShapeOk(N, K)) {
    thread_local std::vector<uint16_t> packed;
    const int64_t elems = detail::AmxPackedElems(M, K);
    if (static_cast<int64_t>(packed.size()) < elems) packed.resize(elems);
    detail::AmxPackInputs(x.ptr<uint16_t>(), M, K, packed.data());
    const uint16_t* pk = packed.data();
    const uint16_t* wp = w.ptr<uint16_t>();
    uint16_t* op = static_cast<uint16_t*>(out.data);
    detail::RunBlocks(&tp, N / 16, 16 * K * 2, [&](int64_t b0, int64_t b1) {
      detail::AmxLinearBlocks(pk, wp, bias_f, op, M, N, K, b0, b1);
    });
    return;
  }

  const Kernel kernel = SelectKernel(x.dtype);
  const int64_t ldx = RoundUp(std::max<int64_t>(K, 1), kPad);
  // 16 floats of slack let the rows start on a 64-byte boundary; ldx is a multiple of 32
  // elements, so every row then starts a cache line and no vector load of x splits one (about
  // 10% of the time of a 16-row step on an L2-resident layer).
  if (static_cast<int64_t>(xbuf.size()) < M * ldx + 16) xbuf.resize(M * ldx + 16);
  float* xa = xbuf.data();
  xa += ((64 - reinterpret_cast<uintptr_t>(xa) % 64) % 64) / sizeof(float);
  WidenRows(x, M, K, ldx, kernel, xa);

  Ctx c{xa, w.data, bias_f, out.data, M, N, K, ldx, x.dtype};
  const BlocksFn fn = kernel.fn;
  const int64_t blocks = (N + kNr - 1) / kNr;
  const int64_t block_bytes = std::max<int64_t>(1, kNr * K * DTypeSize(x.dtype));
  detail::RunBlocks(&tp, blocks, block_bytes, [&](int64_t b0, int64_t b1) { fn(c, b0, b1); });
}


namespace detail {

void RunBlocks(ThreadPool* pool, int64_t blocks, int64_t block_bytes,
               const std::function<void(int64_t, int64_t)>& run) {
  const int64_t grain = std::max<int64_t>(1, kMinChunkBytes / std::max<int64_t>(1, block_bytes));
  if (blocks <= grain) {
    run(0, blocks);
    return;
  }
  (pool != nullptr ? *pool : ThreadPool::Default()).ParallelFor(blocks, grain, run);
}

void RefuseCuda(std::initializer_list<const TensorView*> ts, const char* op) {
  for (const TensorView* t : ts) {
    if (t != nullptr && t->device.type == DeviceType::kCUDA) {
      throw RuntimeError(detail::StrCat("pyspec ", op, ": got CUDA tensors; packed weights run ",
                                        "on the CPU"));
    }
  }
}

}  // namespace detail

namespace {

using detail::RefuseCuda;

// Checks packed codes q (and scales d, m) of a matrix with K weights per row (`k_from` names the
// argument K comes from); returns N.
int64_t CheckPackedCodes(const TensorView& q, const TensorView& d, const TensorView* mn, int64_t K,
                         const char* k_from) {
  PYSPEC_CHECK(K % 32 == 0 && K > 0, "packed weights need K to be a positive multiple of 32; got ",
               K);
  const int bits = mn != nullptr ? 4 : 8;
  // uint8 nibble pairs with 'm' (4-bit), int8 codes without (8-bit): another pairing would be
  // read as the other format.
  CheckDType(q, "q", {bits == 4 ? DType::kUInt8 : DType::kInt8});
  PYSPEC_CHECK(q.ndim == 2, "'q' must be 2-D; got shape ", q.ShapeString());
  const int64_t N = q.shape[0];
  PYSPEC_CHECK(q.shape[1] == (bits == 4 ? K / 2 : K), "'q' has shape ", q.ShapeString(),
               ": ", bits == 4 ? q.shape[1] * 2 : q.shape[1], " weights per row, but '", k_from,
               "' has K = ", K, " (", bits, "-bit codes: [N, ", bits == 4 ? "K / 2" : "K", "])");
  CheckShape(q, "q", {N, bits == 4 ? K / 2 : K});
  CheckContiguous(q, "q");
  CheckDType(d, "d", {DType::kFloat32});
  CheckShape(d, "d", {N, K / 32});
  CheckContiguous(d, "d");
  if (mn != nullptr) {
    CheckDType(*mn, "m", {DType::kFloat32});
    CheckShape(*mn, "m", {N, K / 32});
    CheckContiguous(*mn, "m");
  }
  return N;
}

}  // namespace

void UnpackPacked(const TensorView& q, const TensorView& d, const TensorView* mn,
                  const TensorView& out, ThreadPool* pool) {
  RefuseCuda({&q, &d, mn, &out}, "unpack_packed");
  CheckDType(out, "out", {DType::kFloat32});
  PYSPEC_CHECK(out.ndim == 2, "'out' must be 2-D [N, K]; got shape ", out.ShapeString());
  const int64_t K = out.shape[1];
  const int64_t N = CheckPackedCodes(q, d, mn, K, "out");
  CheckShape(out, "out", {N, K});
  CheckContiguous(out, "out");
  if (N == 0) return;
  const int64_t G = K / 32;
  const uint8_t* qp = static_cast<const uint8_t*>(q.data);
  const float* dp = d.ptr<float>();
  const float* mp = mn != nullptr ? mn->ptr<float>() : nullptr;
  float* op = static_cast<float*>(out.data);
  // d * q is exact in float32 (the packer's float16 scales), so a fused or a separate multiply-add
  // gives the same one rounding.
  auto run = [&](int64_t n0, int64_t n1) {
    for (int64_t n = n0; n < n1; ++n) {
      for (int64_t g = 0; g < G; ++g) {
        const float dv = dp[n * G + g];
        float* w = op + n * K + g * 32;
        if (mp != nullptr) {
          const float mv = mp[n * G + g];
          const uint8_t* b = qp + n * (K / 2) + g * 16;
          for (int j = 0; j < 16; ++j) {
            w[j] = dv * static_cast<float>(b[j] & 15) + mv;
            w[j + 16] = dv * static_cast<float>(b[j] >> 4) + mv;
          }
        } else {
          const int8_t* b = reinterpret_cast<const int8_t*>(qp) + n * K + g * 32;
          for (int j = 0; j < 32; ++j) w[j] = dv * static_cast<float>(b[j]);
        }
      }
    }
  };
  ThreadPool& tp = pool != nullptr ? *pool : ThreadPool::Default();
  tp.ParallelFor(N, std::max<int64_t>(1, (int64_t{1} << 16) / K), run);
}

void LinearPacked(const TensorView& x, const TensorView& q, const TensorView& d,
                  const TensorView* mn, const TensorView* bias, const TensorView& out,
                  ThreadPool* pool) {
  RefuseCuda({&x, &q, &d, mn, bias, &out}, "linear_packed");
  CheckDType(x, "x", {DType::kFloat32});
  PYSPEC_CHECK(x.ndim == 2, "'x' must be 2-D [M, K]; got shape ", x.ShapeString());
  CheckContiguous(x, "x");
  const int64_t M = x.shape[0], K = x.shape[1];
  const int64_t N = CheckPackedCodes(q, d, mn, K, "x");
  const int bits = mn != nullptr ? 4 : 8;
  if (bias != nullptr) {
    CheckDType(*bias, "bias", {DType::kFloat32});
    CheckShape(*bias, "bias", {N});
    CheckContiguous(*bias, "bias");
  }
  CheckDType(out, "out", {DType::kFloat32});
  CheckShape(out, "out", {M, N});
  CheckContiguous(out, "out");
  PYSPEC_CHECK(detail::PackedLinearAvailable(),
               "packed weights need the AVX2 or AVX-512 build of the float32 linear kernel (this "
               "CPU or the selected ISA has neither)");
  if (M == 0 || N == 0) return;
#ifdef PYSPEC_X86
  thread_local std::vector<float> xbuf;
  const int64_t ldx = K;  // a multiple of 32 floats: every row starts a cache line
  if (static_cast<int64_t>(xbuf.size()) < M * ldx + 16) xbuf.resize(M * ldx + 16);
  float* xa = xbuf.data();
  xa += ((64 - reinterpret_cast<uintptr_t>(xa) % 64) % 64) / sizeof(float);
  std::memcpy(xa, x.ptr<float>(), M * K * sizeof(float));
  PackedCtx c{xa, static_cast<const uint8_t*>(q.data), d.ptr<float>(),
              mn != nullptr ? mn->ptr<float>() : nullptr,
              bias != nullptr ? bias->ptr<float>() : nullptr, static_cast<float*>(out.data),
              M, N, K, ldx};
  const int64_t blocks = (N + kNr - 1) / kNr;
  const int64_t block_bytes = kNr * (K * bits / 8 + (K / 32) * (bits == 4 ? 8 : 4));
  const bool w512 = SelectKernel(DType::kFloat32).fn == &RunBlocksAvx512;
  auto run = [&](int64_t b0, int64_t b1) {
    if (w512) {
      if (bits == 4) {
        PackedBlocks512<4>(c, b0, b1);
      } else {
        PackedBlocks512<8>(c, b0, b1);
      }
    } else if (bits == 4) {
      PackedBlocks256<4>(c, b0, b1);
    } else {
      PackedBlocks256<8>(c, b0, b1);
    }
  };
  detail::RunBlocks(pool, blocks, block_bytes, run);
#endif
}

}  // namespace pyspec
