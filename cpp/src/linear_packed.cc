// LinearPacked and UnpackPacked: dense layers read as 4-bit / 8-bit block codes or as 16-bit
// float codes (pyspec/linear.h).
#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstring>
#include <initializer_list>
#include <vector>

#include "half.h"
#include "linear_amx.h"
#include "linear_kernel.h"
#include "pyspec/check.h"
#include "pyspec/linear.h"
#include "pyspec/thread_pool.h"

#ifdef PYSPEC_X86
#include <immintrin.h>
#endif

namespace pyspec {
namespace {

using namespace linear_kernel;  // NOLINT(build/namespaces)

// Code formats (the kernels' template argument FMT): 4-bit and 8-bit block codes with float32
// scales, and 16-bit codes that are the weights themselves as float16 or bfloat16 values (no
// scales: every rebuilt weight is an exact widening).
constexpr int kQ4 = 4, kQ8 = 8, kF16 = 16, kBF16 = 17;

// Bytes of one row of K codes.
constexpr int64_t CodeRowBytes(int fmt, int64_t K) {
  return fmt == kQ4 ? K / 2 : fmt == kQ8 ? K : 2 * K;
}

#ifdef PYSPEC_X86
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
  const uint8_t* q;     // 4-bit: [N, K / 2]; 8-bit: [N, K]; 16-bit: [N, 2K] bytes
  const float* d;       // [N, K / 32] (4-bit, 8-bit), or nullptr (16-bit)
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
// nibble needs no mask; 8-bit: d * q; 16-bit: the float16 (vcvtph2ps) or bfloat16 (16 bits up)
// values widened.
template <int FMT>
__attribute__((target("avx512f,avx2,fma"))) PYSPEC_INLINE void RebuildGroup(
    const PackedCtx& c, int64_t row, int64_t g, VQ* w0, VQ* w1) {
  if constexpr (FMT == kF16 || FMT == kBF16) {
    const __m256i* p = reinterpret_cast<const __m256i*>(c.q + row * (2 * c.K) + g * 64);
    const __m256i h0 = _mm256_loadu_si256(p), h1 = _mm256_loadu_si256(p + 1);
    // (The maskz forms, as below.)
    if constexpr (FMT == kF16) {
      *w0 = reinterpret_cast<VQ>(_mm512_maskz_cvtph_ps(0xffff, h0));
      *w1 = reinterpret_cast<VQ>(_mm512_maskz_cvtph_ps(0xffff, h1));
    } else {
      *w0 = reinterpret_cast<VQ>(
          _mm512_maskz_slli_epi32(0xffff, _mm512_maskz_cvtepu16_epi32(0xffff, h0), 16));
      *w1 = reinterpret_cast<VQ>(
          _mm512_maskz_slli_epi32(0xffff, _mm512_maskz_cvtepu16_epi32(0xffff, h1), 16));
    }
    return;
  }
  const int64_t G = c.K / 32;
  const VQ dv = VQ{} + c.d[row * G + g];
  if constexpr (FMT == kQ4) {
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
template <int MR, int NR, int FMT, bool kTree = false>
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
    for (int r = 0; r < NR; ++r) RebuildGroup<FMT>(c, n0 + r, g, &w0[r], &w1[r]);
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

template <int MR, int NR, int FMT, bool kTree = false>
__attribute__((target("avx512f,avx2,fma"))) PYSPEC_INLINE void DotRowsPacked(
    int rows, const PackedCtx& c, const float* x, int64_t n0, float* res) {
  if constexpr (MR > 1) {
    if (rows < MR) {
      DotRowsPacked<MR - 1, NR, FMT, kTree>(rows, c, x, n0, res);
      return;
    }
  }
  DotBlockPacked<MR, NR, FMT, kTree>(c, x, n0, res);
}

// Up to this many input rows the weights are rebuilt in registers for each tile of 4 rows;
// beyond it a block's rows are rebuilt once into an fp32 scratch block (L1-resident) that the
// float32 kernel's tiles then read, as for float16 weights (RowBlock).
constexpr int64_t kPackedRegisterRows = 8;

template <int NR, int FMT>
__attribute__((target("avx512f,avx2,fma"))) void PackedRowBlock(const PackedCtx& c, int64_t n0,
                                                               float* scratch) {
  if (c.M > kPackedRegisterRows) {
    for (int r = 0; r < NR; ++r) {
      for (int64_t g = 0; g < c.K / 32; ++g) {
        VQ w0, w1;
        RebuildGroup<FMT>(c, n0 + r, g, &w0, &w1);
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
      // (Two weight rows at a time, 8 x 2, was slower at 5 to 8 rows:
      // bench/bench_linear.py --packed --rows 4,5,6,7,8.)
      float res[kPackedRegisterRows * 4];
      const int rows = static_cast<int>(c.M);
      DotRowsPacked<kPackedRegisterRows, 4, FMT, true>(rows, c, c.x, n0, res);
      StoreBlock(c.Dense(), 0, n0, rows, 4, res);
      return;
    }
  }
  constexpr int MR = 4;
  float res[MR * NR];
  for (int64_t m0 = 0; m0 < c.M; m0 += MR) {
    const int rows = static_cast<int>(std::min<int64_t>(MR, c.M - m0));
    DotRowsPacked<MR, NR, FMT>(rows, c, c.x + m0 * c.ldx, n0, res);
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
template <int FMT>
__attribute__((target("avx2,fma,f16c"))) PYSPEC_INLINE V8 RebuildStep8(const PackedCtx& c,
                                                                  int64_t row, int64_t g, int s) {
  if constexpr (FMT == kF16 || FMT == kBF16) {
    const __m128i h = _mm_loadu_si128(
        reinterpret_cast<const __m128i*>(c.q + row * (2 * c.K) + g * 64 + s * 16));
    if constexpr (FMT == kF16) {
      return reinterpret_cast<V8>(_mm256_cvtph_ps(h));
    } else {
      return reinterpret_cast<V8>(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
    }
  }
  const int64_t G = c.K / 32;
  const V8 dv = V8{} + c.d[row * G + g];
  if constexpr (FMT == kQ4) {
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

template <int MR, int NR, int FMT>
__attribute__((target("avx2,fma,f16c"))) PYSPEC_INLINE void DotBlockPacked8(
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
      for (int r = 0; r < NR; ++r) w[r] = RebuildStep8<FMT>(c, n0 + r, g, s);
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

template <int MR, int NR, int FMT>
__attribute__((target("avx2,fma,f16c"))) PYSPEC_INLINE void DotRowsPacked8(
    int rows, const PackedCtx& c, const float* x, int64_t n0, float* res) {
  if constexpr (MR > 1) {
    if (rows < MR) {
      DotRowsPacked8<MR - 1, NR, FMT>(rows, c, x, n0, res);
      return;
    }
  }
  DotBlockPacked8<MR, NR, FMT>(c, x, n0, res);
}

// As PackedRowBlock: up to 4 input rows in registers (tiles of 2 rows: 2 x 4 accumulators and 4
// weight vectors of the 16 ymm registers), beyond that one rebuild into the scratch block for the
// float32 kernel's tiles.
template <int NR, int FMT>
__attribute__((target("avx2,fma,f16c"))) void PackedRowBlock8(const PackedCtx& c, int64_t n0,
                                                         float* scratch) {
  if (c.M > 4) {
    for (int r = 0; r < NR; ++r) {
      for (int64_t g = 0; g < c.K / 32; ++g) {
        for (int s = 0; s < 4; ++s) {
          const V8 w = RebuildStep8<FMT>(c, n0 + r, g, s);
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
    DotRowsPacked8<MR, NR, FMT>(rows, c, c.x + m0 * c.ldx, n0, res);
    StoreBlock(c.Dense(), m0, n0, rows, NR, res);
  }
}

template <int FMT, bool kW512>
PYSPEC_INLINE void PackedBlocksImpl(const PackedCtx& c, int64_t b0,
                                                             int64_t b1) {
  thread_local std::vector<float> scratch_buf;  // kNr rebuilt rows, per thread
  if (static_cast<int64_t>(scratch_buf.size()) < kNr * c.K + 16) scratch_buf.resize(kNr * c.K + 16);
  float* scratch = scratch_buf.data();
  scratch += ((64 - reinterpret_cast<uintptr_t>(scratch) % 64) % 64) / sizeof(float);
  const int64_t G = c.K / 32, qrow = CodeRowBytes(FMT, c.K);
  const int64_t pf_dist = g_packed_pf_blocks.load(std::memory_order_relaxed);
  for (int64_t b = b0; b < b1; ++b) {
    const int64_t n0 = b * kNr;
    // Prefetch the codes and scales of the block pf_dist blocks ahead into L2: rebuilding the
    // weights keeps the loop busy enough that the hardware prefetchers alone fall behind.
    if (pf_dist > 0 && n0 + (pf_dist + 1) * kNr <= c.N) {
      const int64_t nf = n0 + pf_dist * kNr;
      const char* pq = reinterpret_cast<const char*>(c.q + nf * qrow);
      for (int64_t o = 0; o < kNr * qrow; o += 64) __builtin_prefetch(pq + o, 0, 2);
      if constexpr (FMT == kQ4 || FMT == kQ8) {
        const char* pd = reinterpret_cast<const char*>(c.d + nf * G);
        for (int64_t o = 0; o < kNr * G * 4; o += 64) __builtin_prefetch(pd + o, 0, 2);
      }
      if constexpr (FMT == kQ4) {
        const char* pm = reinterpret_cast<const char*>(c.mn + nf * G);
        for (int64_t o = 0; o < kNr * G * 4; o += 64) __builtin_prefetch(pm + o, 0, 2);
      }
    }
    if (n0 + kNr <= c.N) {
      if constexpr (kW512) {
        PackedRowBlock<kNr, FMT>(c, n0, scratch);
      } else {
        PackedRowBlock8<kNr, FMT>(c, n0, scratch);
      }
    } else {
      for (int64_t n = n0; n < c.N; ++n) {
        if constexpr (kW512) {
          PackedRowBlock<1, FMT>(c, n, scratch);
        } else {
          PackedRowBlock8<1, FMT>(c, n, scratch);
        }
      }
    }
  }
}

template <int FMT>
__attribute__((target("avx512f,avx2,fma"))) void PackedBlocks512(const PackedCtx& c, int64_t b0,
                                                                int64_t b1) {
  PackedBlocksImpl<FMT, true>(c, b0, b1);
}

template <int FMT>
__attribute__((target("avx2,fma,f16c"))) void PackedBlocks256(const PackedCtx& c, int64_t b0,
                                                         int64_t b1) {
  PackedBlocksImpl<FMT, false>(c, b0, b1);
}
#endif

// A RuntimeError naming `op` when any of the (non-null) tensors is on a CUDA device.
void RefuseCuda(std::initializer_list<const TensorView*> ts, const char* op) {
  for (const TensorView* t : ts) {
    if (t != nullptr && t->device.type == DeviceType::kCUDA) {
      throw RuntimeError(detail::StrCat("pyspec ", op, ": got CUDA tensors; packed weights run ",
                                        "on the CPU"));
    }
  }
}

// Checks packed codes q (and scales d, m) of a matrix with K weights per row (`k_from` names the
// argument K comes from); returns their format (kQ4, kQ8, kF16, kBF16) and N.
int CheckPackedCodes(const TensorView& q, const TensorView& d, const TensorView* mn, int64_t K,
                     const char* k_from, int64_t* n_out) {
  PYSPEC_CHECK(K % 32 == 0 && K > 0, "packed weights need K to be a positive multiple of 32; got ",
               K);
  // The codes' dtype names the format: uint8 nibble pairs with 'm' (4-bit), int8 codes without
  // (8-bit), float16 / bfloat16 values with neither scale (16-bit); another pairing would be read
  // as another format.
  const bool sixteen = q.dtype == DType::kFloat16 || q.dtype == DType::kBFloat16;
  const int fmt = sixteen ? (q.dtype == DType::kFloat16 ? kF16 : kBF16)
                          : mn != nullptr ? kQ4 : kQ8;
  if (sixteen) {
    PYSPEC_CHECK(d.data == nullptr && mn == nullptr, "16-bit codes (float16 / bfloat16 'q') have "
                 "no scales: 'd' and 'm' must be None");
  } else {
    CheckDType(q, "q", {fmt == kQ4 ? DType::kUInt8 : DType::kInt8});
  }
  PYSPEC_CHECK(q.ndim == 2, "'q' must be 2-D; got shape ", q.ShapeString());
  const int64_t N = q.shape[0];
  const int64_t per_row = fmt == kQ4 ? K / 2 : K;
  PYSPEC_CHECK(q.shape[1] == per_row, "'q' has shape ", q.ShapeString(), ": ",
               fmt == kQ4 ? q.shape[1] * 2 : q.shape[1], " weights per row, but '", k_from,
               "' has K = ", K, " (", fmt == kQ4 ? "4-bit codes: [N, K / 2]" :
               fmt == kQ8 ? "8-bit codes: [N, K]" : "16-bit codes: [N, K]", ")");
  CheckContiguous(q, "q");
  if (!sixteen) {
    CheckDType(d, "d", {DType::kFloat32});
    CheckShape(d, "d", {N, K / 32});
    CheckContiguous(d, "d");
  }
  if (mn != nullptr) {
    CheckDType(*mn, "m", {DType::kFloat32});
    CheckShape(*mn, "m", {N, K / 32});
    CheckContiguous(*mn, "m");
  }
  *n_out = N;
  return fmt;
}

}  // namespace

namespace detail {
int64_t SetPackedPrefetchBlocks(int64_t blocks) {
#ifdef PYSPEC_X86
  if (blocks >= 0) g_packed_pf_blocks.store(blocks);
  return g_packed_pf_blocks.load();
#else
  return blocks;
#endif
}
}  // namespace detail

void UnpackPacked(const TensorView& q, const TensorView& d, const TensorView* mn,
                  const TensorView& out, ThreadPool* pool) {
  RefuseCuda({&q, &d, mn, &out}, "unpack_packed");
  CheckDType(out, "out", {DType::kFloat32});
  PYSPEC_CHECK(out.ndim == 2, "'out' must be 2-D [N, K]; got shape ", out.ShapeString());
  const int64_t K = out.shape[1];
  int64_t N = 0;
  const int fmt = CheckPackedCodes(q, d, mn, K, "out", &N);
  CheckShape(out, "out", {N, K});
  CheckContiguous(out, "out");
  if (N == 0) return;
  const int64_t G = K / 32;
  const uint8_t* qp = static_cast<const uint8_t*>(q.data);
  float* op = static_cast<float*>(out.data);
  ThreadPool& tp = pool != nullptr ? *pool : ThreadPool::Default();
  if (fmt == kF16 || fmt == kBF16) {  // exact widenings
    const uint16_t* hp = reinterpret_cast<const uint16_t*>(qp);
    tp.ParallelFor(N, std::max<int64_t>(1, (int64_t{1} << 16) / K), [&](int64_t n0, int64_t n1) {
      if (fmt == kF16) {
        for (int64_t i = n0 * K; i < n1 * K; ++i) op[i] = half::HalfToFloat(hp[i]);
      } else {
        for (int64_t i = n0 * K; i < n1 * K; ++i) op[i] = half::BF16ToFloat(hp[i]);
      }
    });
    return;
  }
  const float* dp = d.ptr<float>();
  const float* mp = mn != nullptr ? mn->ptr<float>() : nullptr;
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
  tp.ParallelFor(N, std::max<int64_t>(1, (int64_t{1} << 16) / K), run);
}

void LinearPacked(const TensorView& x, const TensorView& q, const TensorView& d,
                  const TensorView* mn, const TensorView* bias, const TensorView& out,
                  ThreadPool* pool, const LinearKernels* kernels) {
  const LinearKernels& lk = kernels != nullptr ? *kernels : LinearKernels::Default();
  RefuseCuda({&x, &q, &d, mn, bias, &out}, "linear_packed");
  CheckDType(x, "x", {DType::kFloat32});
  PYSPEC_CHECK(x.ndim == 2, "'x' must be 2-D [M, K]; got shape ", x.ShapeString());
  CheckContiguous(x, "x");
  const int64_t M = x.shape[0], K = x.shape[1];
  int64_t N = 0;
  const int fmt = CheckPackedCodes(q, d, mn, K, "x", &N);
  if (bias != nullptr) {
    CheckDType(*bias, "bias", {DType::kFloat32});
    CheckShape(*bias, "bias", {N});
    CheckContiguous(*bias, "bias");
  }
  CheckDType(out, "out", {DType::kFloat32});
  CheckShape(out, "out", {M, N});
  CheckContiguous(out, "out");
  PYSPEC_CHECK(lk.PackedAvailable(),
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
  PackedCtx c{xa, static_cast<const uint8_t*>(q.data), static_cast<const float*>(d.data),
              mn != nullptr ? mn->ptr<float>() : nullptr,
              bias != nullptr ? bias->ptr<float>() : nullptr, static_cast<float*>(out.data),
              M, N, K, ldx};
  const int64_t blocks = (N + kNr - 1) / kNr;
  const int64_t block_bytes =
      kNr * (CodeRowBytes(fmt, K) + (K / 32) * (fmt == kQ4 ? 8 : fmt == kQ8 ? 4 : 0));
  const bool w512 = lk.level() >= detail::kIsaAvx512;
  auto run = [&](int64_t b0, int64_t b1) {
    switch (fmt) {
      case kQ4: return w512 ? PackedBlocks512<kQ4>(c, b0, b1) : PackedBlocks256<kQ4>(c, b0, b1);
      case kQ8: return w512 ? PackedBlocks512<kQ8>(c, b0, b1) : PackedBlocks256<kQ8>(c, b0, b1);
      case kF16: return w512 ? PackedBlocks512<kF16>(c, b0, b1) : PackedBlocks256<kF16>(c, b0, b1);
      default: return w512 ? PackedBlocks512<kBF16>(c, b0, b1) : PackedBlocks256<kBF16>(c, b0, b1);
    }
  };
  detail::RunBlocks(pool, blocks, block_bytes, run);
#endif
}
}  // namespace pyspec
