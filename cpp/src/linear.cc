// CPU dense layer for few input rows (see pyspec/linear.h for the contract).
//
// Work layout: the output columns (weight rows) are split into blocks of kNr = 4 rows; a block is
// one unit of parallel work. For each block the kernel walks K once per tile of up to MR input
// rows, keeping MR x 4 vector accumulators in registers: the block's weights come from memory on
// the first tile and from L1/L2 on the others, so every weight byte crosses the memory bus once per
// call. The inputs are first copied (and widened) into a zero-padded fp32 buffer, so the kernel
// loads whole vectors of x even at the K tail; only the weights need a partial load there.
// Like attention.cc, the kernel is written with GCC/Clang vector extensions and compiled twice
// (x86-64 baseline and target("avx2,fma")); a cpuid check picks one at run time. FMA contraction
// of `acc += x * w` relies on GCC/Clang's default -ffp-contract for C++.
#include "pyspec/linear.h"

#include <algorithm>
#include <atomic>
#include <cstring>
#include <vector>

#include "cpu_isa.h"
#include "half.h"
#include "pyspec/check.h"
#include "pyspec/thread_pool.h"

#define PYSPEC_INLINE inline __attribute__((always_inline))
#define PYSPEC_INLINE_LAMBDA __attribute__((always_inline))

namespace pyspec {
namespace {

using detail::StrCat;

constexpr int kNr = 4;         // weight rows per register block (and per unit of parallel work)
constexpr int64_t kPad = 16;   // x rows are padded to a multiple of this many floats (>= any step)
// Smallest amount of weights one parallel chunk reads. Waking a worker costs a few microseconds,
// about the time to stream 64 KiB, so smaller layers stay on the calling thread.
constexpr int64_t kMinChunkBytes = 96 * 1024;

enum class WKind { kF32, kBF16, kF16 };

struct Ctx {
  const float* x;     // [M, ldx] fp32, zero-padded past K
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
    if constexpr (sizeof(V) == 32) {
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

// ---------------------------------------------------------------------------------------------
// Micro-kernel: res[MR][NR] = x[MR rows] . w[NR rows] over all K
// ---------------------------------------------------------------------------------------------

// Weights per K step: L fp32, or 2L 16-bit ones (an even and an odd vector). Either way one step
// of NR rows reads NR * sizeof(V) bytes.
template <class V, WKind WK>
constexpr int64_t StepOf() {
  return WK == WKind::kF32 ? sizeof(V) / sizeof(float) : 2 * sizeof(V) / sizeof(float);
}

// With kPrefetch, also touches the weight block after this one (pf, contiguous, the same size as
// this block) at the pace this block is read, so its DRAM reads overlap this block's compute and
// the later input tiles, which run from cache. Into L2: a block of 4 long rows and the inputs
// need not fit L1 twice.
template <class V, WKind WK, int MR, int NR, bool kPrefetch>
PYSPEC_INLINE void DotBlock(int64_t K, int64_t ldw, int64_t ldx, const float* x, const char* w,
                            const char* pf, float* res) {
  constexpr int L = sizeof(V) / sizeof(float);
  constexpr int64_t S = StepOf<V, WK>();
  constexpr int64_t esize = WK == WKind::kF32 ? 4 : 2;
  constexpr int64_t kStepBytes = NR * sizeof(V);
  V acc[MR][NR];
#pragma GCC unroll 4
  for (int m = 0; m < MR; ++m) {
#pragma GCC unroll 4
    for (int r = 0; r < NR; ++r) acc[m][r] = V{};
  }
  // One step: wv from w (full vectors) or from a zero-padded copy of the tail.
  auto step = [&](const char* wp, int64_t wstride, int64_t k) PYSPEC_INLINE_LAMBDA {
    if constexpr (WK == WKind::kF32) {
      V wv[NR];
#pragma GCC unroll 4
      for (int r = 0; r < NR; ++r) std::memcpy(&wv[r], wp + r * wstride, sizeof(V));
#pragma GCC unroll 4
      for (int m = 0; m < MR; ++m) {
        V xv;
        std::memcpy(&xv, x + m * ldx + k, sizeof(V));
#pragma GCC unroll 4
        for (int r = 0; r < NR; ++r) acc[m][r] += xv * wv[r];
      }
    } else {
      // Row-outer, so only one row's two widened vectors are live next to the MR x NR
      // accumulators (the inputs are FMA memory operands, from L1).
#pragma GCC unroll 4
      for (int r = 0; r < NR; ++r) {
        V we, wo;
        LoadW16<V, WK>(&we, &wo, wp + r * wstride);
#pragma GCC unroll 4
        for (int m = 0; m < MR; ++m) {
          V xe, xo;
          std::memcpy(&xe, x + m * ldx + k, sizeof(V));
          std::memcpy(&xo, x + m * ldx + k + L, sizeof(V));
          acc[m][r] += xe * we + xo * wo;
        }
      }
    }
  };
  const int64_t k_full = K / S * S;
  int64_t i = 0;
  for (int64_t k = 0; k < k_full; k += S, ++i) {
    if constexpr (kPrefetch) {
      for (int64_t b = 0; b < kStepBytes; b += 64) {
        __builtin_prefetch(pf + i * kStepBytes + b, 0, 2);
      }
    }
    step(w + k * esize, ldw, k);
  }
  if (k_full < K) {
    // x is zero-padded to ldx >= RoundUp(K, S); the weights are copied into zeroed rows.
    alignas(32) char tail[NR][sizeof(V)] = {};
    for (int r = 0; r < NR; ++r) {
      std::memcpy(tail[r], w + r * ldw + k_full * esize, (K - k_full) * esize);
    }
    step(&tail[0][0], sizeof(V), k_full);
  }
  for (int m = 0; m < MR; ++m) {
    if constexpr (NR == 4) {
      Reduce4(acc[m], res + m * NR);
    } else {
      for (int r = 0; r < NR; ++r) res[m * NR + r] = Reduce1(acc[m][r]);
    }
  }
}

// Writes res[mr][nr] (+ bias) to out[m0.., n0..], rounding once to the output dtype.
void StoreBlock(const Ctx& c, int64_t m0, int64_t n0, int mr, int nr, const float* res) {
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
      alignas(32) char tail[sizeof(V)] = {};
      std::memcpy(tail, w + (r * K + k_full) * 2, (K - k_full) * 2);
      V we, wo;
      LoadW16<V, WK>(&we, &wo, tail);
      std::memcpy(d + k_full, &we, sizeof(V));
      std::memcpy(d + k_full + L, &wo, sizeof(V));
    }
  }
}

// Input rows [m0, M) in tiles of MR against NR weight rows (row stride ldw bytes, length K).
template <class V, WKind WK, int MR, int NR>
PYSPEC_INLINE void Tiles(const Ctx& c, int64_t m0, int64_t n0, int64_t K, int64_t ldw,
                         const char* w) {
  float res[MR * NR];
  int64_t m = m0;
  for (; m + MR <= c.M; m += MR) {
    DotBlock<V, WK, MR, NR, false>(K, ldw, c.ldx, c.x + m * c.ldx, w, nullptr, res);
    StoreBlock(c, m, n0, MR, NR, res);
  }
  const int rest = static_cast<int>(c.M - m);
  if (rest == 0) return;
  if (rest == 1) {
    DotBlock<V, WK, 1, NR, false>(K, ldw, c.ldx, c.x + m * c.ldx, w, nullptr, res);
  } else {
    DotBlock<V, WK, (MR > 2 ? 2 : 1), NR, false>(K, ldw, c.ldx, c.x + m * c.ldx, w, nullptr, res);
  }
  StoreBlock(c, m, n0, rest, NR, res);
}

// All input rows against weight rows [n0, n0 + NR); `pf` is the next block to prefetch or null.
// The first tile reads the block from memory and prefetches the next one; the other tiles find
// it in cache. fp16 weights needed by more than one tile are widened once into `scratch`
// (NR x ldx floats) and the tiles run the fp32 kernel on that (measured 2x faster at M = 16; for
// bf16, whose widening is one shift or mask, widening per tile is as fast).
template <class Isa, WKind WK, int NR>
PYSPEC_INLINE void RowBlock(const Ctx& c, int64_t n0, const char* pf, float* scratch) {
  using V = typename Isa::V;
  constexpr int MR = Isa::kMr;
  static_assert(MR >= 1 && MR <= 3, "the remainder tiles cover MR <= 3");
  constexpr int64_t esize = WK == WKind::kF32 ? 4 : 2;
  const int64_t K = c.K, ldw = K * esize;
  const char* w = static_cast<const char*>(c.w) + n0 * ldw;
  if (WK == WKind::kF16 && c.M > MR) {
    WidenBlock<V, WK, NR>(K, c.ldx, w, pf, scratch);
    Tiles<V, WKind::kF32, MR, NR>(c, 0, n0, c.ldx, c.ldx * 4,
                                   reinterpret_cast<const char*>(scratch));
    return;
  }
  int64_t m = 0;
  if (pf != nullptr) {
    float res[MR * NR];
    const int first = static_cast<int>(std::min<int64_t>(c.M, MR));
    if (first == MR) {
      DotBlock<V, WK, MR, NR, true>(K, ldw, c.ldx, c.x, w, pf, res);
    } else if (first == 1) {
      DotBlock<V, WK, 1, NR, true>(K, ldw, c.ldx, c.x, w, pf, res);
    } else {
      DotBlock<V, WK, (MR > 2 ? 2 : 1), NR, true>(K, ldw, c.ldx, c.x, w, pf, res);
    }
    StoreBlock(c, 0, n0, first, NR, res);
    m = first;
  }
  Tiles<V, WK, MR, NR>(c, m, n0, K, ldw, w);
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
  for (int64_t b = b0; b < b1; ++b) {
    const int64_t n0 = b * kNr;
    if (n0 + kNr <= c.N) {
      // Prefetch the next full block, also across the chunk end (it is likely the next chunk's
      // first block, read next by some thread).
      const char* pf = nullptr;
      if (n0 + 2 * kNr <= c.N) pf = static_cast<const char*>(c.w) + (n0 + kNr) * c.K * esize;
      RowBlock<Isa, WK, kNr>(c, n0, pf, scratch);
    } else {
      for (int64_t n = n0; n < c.N; ++n) RowBlock<Isa, WK, 1>(c, n, nullptr, scratch);
    }
  }
}

template <class Isa>
PYSPEC_INLINE void RunBlocksDispatch(const Ctx& c, int64_t b0, int64_t b1) {
  if (c.dtype == DType::kFloat32) {
    RunBlocksImpl<Isa, WKind::kF32>(c, b0, b1);
  } else if (c.dtype == DType::kBFloat16) {
    RunBlocksImpl<Isa, WKind::kBF16>(c, b0, b1);
  } else {
    RunBlocksImpl<Isa, WKind::kF16>(c, b0, b1);
  }
}

// 16 xmm registers: 3 x 4 accumulators + 4 weight vectors (x is a memory operand).
struct GenericIsa {
  typedef float V __attribute__((vector_size(16)));
  static constexpr int kMr = 3;
};

void RunBlocksGeneric(const Ctx& c, int64_t b0, int64_t b1) {
  RunBlocksDispatch<GenericIsa>(c, b0, b1);
}

#ifdef PYSPEC_X86
// 16 ymm registers, same blocking as the generic kernel with twice the lanes.
struct Avx2Isa {
  typedef float V __attribute__((vector_size(32)));
  static constexpr int kMr = 3;
};

__attribute__((target("avx2,fma"))) void RunBlocksAvx2(const Ctx& c, int64_t b0, int64_t b1) {
  RunBlocksDispatch<Avx2Isa>(c, b0, b1);
}

#endif

using BlocksFn = void (*)(const Ctx&, int64_t, int64_t);

detail::IsaSelector g_isa(detail::IsaSelector::kAvx2);  // process-wide: which build of the kernel runs (tests override it)

// The kernel and its 16-bit input grouping (2 x its float lanes), resolved together once a call.
struct Kernel {
  BlocksFn fn;
  int64_t step16;
};

Kernel SelectKernel() {
#ifdef PYSPEC_X86
  if (g_isa.Resolved() >= detail::IsaSelector::kAvx2) return {&RunBlocksAvx2, 16};
#endif
  return {&RunBlocksGeneric, 8};
}


// Copies rows of x into a zero-padded fp32 buffer of row length ldx. For 16-bit dtypes each group
// of `step` (= 2L) inputs is stored as its even elements then its odd ones, the order LoadW16
// produces the weights in.
void WidenRows(const TensorView& x, int64_t M, int64_t K, int64_t ldx, int64_t step, float* dst) {
  for (int64_t m = 0; m < M; ++m) {
    float* d = dst + m * ldx;
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

std::string SetLinearIsa(const std::string& isa) { return g_isa.Set(isa, "linear"); }

std::string LinearIsa() { return g_isa.Name(); }

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
  const Kernel kernel = SelectKernel();
  const int64_t ldx = RoundUp(std::max<int64_t>(K, 1), kPad);
  if (static_cast<int64_t>(xbuf.size()) < M * ldx) xbuf.resize(M * ldx);
  WidenRows(x, M, K, ldx, kernel.step16, xbuf.data());
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

  Ctx c{xbuf.data(), w.data, bias_f, out.data, M, N, K, ldx, x.dtype};
  const BlocksFn fn = kernel.fn;
  const int64_t blocks = (N + kNr - 1) / kNr;
  const int64_t block_bytes = std::max<int64_t>(1, kNr * K * DTypeSize(x.dtype));
  const int64_t grain = std::max<int64_t>(1, kMinChunkBytes / block_bytes);
  if (blocks <= grain) {
    fn(c, 0, blocks);
    return;
  }
  ThreadPool& tp = pool != nullptr ? *pool : ThreadPool::Default();
  tp.ParallelFor(blocks, grain, [&](int64_t b0, int64_t b1) { fn(c, b0, b1); });
}

}  // namespace pyspec
