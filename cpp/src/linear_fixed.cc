// Packed codes on AMX int8 tiles with fixed-point inputs (LinearFixed; the contract is in
// pyspec/linear.h, the layouts in linear_amx.h).
//
// Tiles (palette 1): for a block of up to 12 input rows (48 fixed-point byte rows: a row's 4
// pieces one after the other), tmm0-2 accumulate C (16 byte rows x 16 outputs, int32) from A
// tiles tmm5-7 (16 byte rows x 32 k) and the weights in tmm4 (8 rows of 4 k x 16 outputs, the
// VNNI layout RepackFixed writes). TDPBSUD (4-bit codes, unsigned) or TDPBSSD (8-bit, signed).
#include <algorithm>
#include <cmath>
#include <cstring>
#include <vector>

#include "cpu_isa.h"
#include "linear_amx.h"
#include "pyspec/check.h"
#include "pyspec/linear.h"
#include "pyspec/thread_pool.h"

#ifdef PYSPEC_HAVE_AMX
#include <immintrin.h>
#endif

namespace pyspec {
namespace detail {

namespace {

constexpr int64_t kBlockRows = kFixedBlockRows;
constexpr int64_t kPieceRows = 4 * kBlockRows;  // their fixed-point byte rows

}  // namespace

#ifdef PYSPEC_HAVE_AMX
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"

bool AmxInt8Available() {
  static const bool ok = AmxFeatureAvailable(25);
  return ok;
}

namespace {

#define PYSPEC_AMX_I8_TARGET __attribute__((target("amx-tile,amx-int8,avx512f,avx512bw")))

// Tiles for `piece_rows` (1..48) byte rows of inputs.
PYSPEC_AMX_I8_TARGET void Configure(int piece_rows) {
  AmxTileConfig cfg;
  std::memset(&cfg, 0, sizeof(cfg));
  cfg.palette_id = 1;
  for (int t = 0; t < 3; ++t) {
    const int rows = std::max(0, std::min(16, piece_rows - 16 * t));
    if (rows == 0) continue;
    cfg.rows[t] = static_cast<uint8_t>(rows);  // C: rows x 16 int32
    cfg.colsb[t] = 64;
    cfg.rows[5 + t] = static_cast<uint8_t>(rows);  // A: rows x 32 bytes
    cfg.colsb[5 + t] = 32;
  }
  if (piece_rows <= 16) {  // one A tile: two output blocks at a time (Block2)
    cfg.rows[1] = static_cast<uint8_t>(piece_rows);  // C of the second block
    cfg.colsb[1] = 64;
    cfg.rows[6] = 8;  // its weights
    cfg.colsb[6] = 64;
  }
  cfg.rows[4] = 8;  // B: 8 rows (k / 4) x 16 outputs x 4
  cfg.colsb[4] = 64;
  asm volatile("" : : "m"(cfg) : "memory");  // (GCC may not see ldtilecfg read it)
  _tile_loadconfig(&cfg);
}

// The helpers both kernel variants (Block, Block2) use, so that a row gets the same arithmetic,
// and the same bits, whichever runs it.

// One group's 4-bit weights of an output block (256 bytes of nibbles) as the B tile's bytes:
// rows 2v and 2v + 1 are the low and high nibbles of bytes [64 v, 64 v + 64).
PYSPEC_AMX_I8_TARGET inline void UnpackNibbles(const uint8_t* src, uint8_t* btile) {
  const __m512i lo_mask = _mm512_set1_epi8(0x0f);
  for (int v = 0; v < 4; ++v) {
    const __m512i w = _mm512_loadu_si512(src + v * 64);
    _mm512_store_si512(btile + (2 * v) * 64, _mm512_and_si512(w, lo_mask));
    _mm512_store_si512(btile + (2 * v + 1) * 64,
                       _mm512_and_si512(_mm512_srli_epi16(w, 4), lo_mask));
  }
}

// acc += d * (the row's group sum, its 4 pieces' int32 sums `ci` combined) (+ m * its sum of X
// first, 4-bit). Pieces two at a time in int32 (a group's sum is below 2^20 in magnitude:
// c0 * 256 + c1 is below 2^29), one conversion per pair.
template <bool FOUR>
PYSPEC_AMX_I8_TARGET inline __m512 AddGroup(__m512 acc, const int32_t* ci, __m512 dv, __m512 mv,
                                            float xsum) {
  const __m512i hi = _mm512_add_epi32(_mm512_slli_epi32(_mm512_load_si512(ci), 8),
                                      _mm512_load_si512(ci + 16));
  const __m512i lo = _mm512_add_epi32(_mm512_slli_epi32(_mm512_load_si512(ci + 32), 8),
                                      _mm512_load_si512(ci + 48));
  const __m512 s = _mm512_fmadd_ps(_mm512_cvtepi32_ps(hi), _mm512_set1_ps(65536.0f),
                                   _mm512_cvtepi32_ps(lo));
  if constexpr (FOUR) acc = _mm512_fmadd_ps(mv, _mm512_set1_ps(xsum), acc);
  return _mm512_fmadd_ps(dv, s, acc);
}

// A row's 16 outputs of block b: its scale times acc (+ bias), or NaN for a non-finite row.
PYSPEC_AMX_I8_TARGET inline void StoreOutputs(float* o, __m512 acc, float scale, bool bad,
                                              const float* bias, int64_t b) {
  if (bad) {
    _mm512_storeu_ps(o, _mm512_set1_ps(std::nanf("")));
    return;
  }
  __m512 y = _mm512_mul_ps(acc, _mm512_set1_ps(scale));
  if (bias != nullptr) y = _mm512_add_ps(y, _mm512_loadu_ps(bias + b * 16));
  _mm512_storeu_ps(o, y);
}

// Rows [0, rows) of one input block against output blocks [b0, b1), NT tiles of byte rows.
template <int NT, bool FOUR>
PYSPEC_AMX_I8_TARGET void Block(const int8_t* a, const float* scale, const float* xsum,
                                const uint8_t* bad, const uint8_t* tq, const float* td,
                                const float* tm, const float* bias, float* out, int rows,
                                int64_t N, int64_t G, int64_t b0, int64_t b1) {
  constexpr int64_t kTileBytes = FOUR ? 256 : 512;
  alignas(64) uint8_t btile[512];
  alignas(64) int32_t c[kPieceRows * 16];
  __m512 acc[kBlockRows];
  for (int64_t b = b0; b < b1; ++b) {
    for (int i = 0; i < rows; ++i) acc[i] = _mm512_setzero_ps();
    for (int64_t g = 0; g < G; ++g) {
      const uint8_t* src = tq + (b * G + g) * kTileBytes;
      if constexpr (FOUR) {
        UnpackNibbles(src, btile);
        _tile_loadd(4, btile, 64);
      } else {
        _tile_loadd(4, src, 64);
      }
      const int8_t* ag = a + g * kPieceRows * 32;
      _tile_zero(0);
      _tile_loadd(5, ag, 32);
      if constexpr (FOUR) _tile_dpbsud(0, 5, 4); else _tile_dpbssd(0, 5, 4);
      if constexpr (NT > 1) {
        _tile_zero(1);
        _tile_loadd(6, ag + 16 * 32, 32);
        if constexpr (FOUR) _tile_dpbsud(1, 6, 4); else _tile_dpbssd(1, 6, 4);
      }
      if constexpr (NT > 2) {
        _tile_zero(2);
        _tile_loadd(7, ag + 32 * 32, 32);
        if constexpr (FOUR) _tile_dpbsud(2, 7, 4); else _tile_dpbssd(2, 7, 4);
      }
      _tile_stored(0, c, 64);
      if constexpr (NT > 1) _tile_stored(1, c + 16 * 16, 64);
      if constexpr (NT > 2) _tile_stored(2, c + 32 * 16, 64);
      const __m512 dv = _mm512_loadu_ps(td + (b * G + g) * 16);
      const __m512 mv = FOUR ? _mm512_loadu_ps(tm + (b * G + g) * 16) : _mm512_setzero_ps();
      for (int i = 0; i < rows; ++i) {
        acc[i] = AddGroup<FOUR>(acc[i], c + (4 * i) * 16, dv, mv, FOUR ? xsum[i * G + g] : 0.0f);
      }
    }
    for (int i = 0; i < rows; ++i) {
      StoreOutputs(out + i * N + b * 16, acc[i], scale[i], bad[i] != 0, bias, b);
    }
  }
}

// Input rows -> A tiles: [block][group][48 byte rows][32 k] (byte row 4 i + p: piece p of the
// block's row i; rows past M zero), the per-row scales 2^(e - 30), each row's sum of X per group
// (float) and whether the row holds a NaN or an infinity. |x| < 2^e for the row's largest |x|:
// X = x * 2^(30 - e) is an exact scaling (float32 keeps every bit), below 2^30 in magnitude,
// rounded to the nearest integer (ties to even, vcvtps2dq) once; its balanced base-256 digits,
// most significant (piece 0) first, are X = sum_p a_p 256^(3-p).
PYSPEC_AMX_I8_TARGET void PackInputsAvx512(const float* x, int64_t M, int64_t K, int8_t* a,
                                           float* scale, float* xsum, uint8_t* bad) {
  const int64_t G = K / 32, blocks = (M + kBlockRows - 1) / kBlockRows;
  std::memset(a, 0, static_cast<size_t>(blocks * G * kPieceRows * 32));
  for (int64_t m = 0; m < M; ++m) {
    const float* xr = x + m * K;
    __m512 mxv = _mm512_setzero_ps();
    for (int64_t k = 0; k < K; k += 16) {
      // max of |x| (a NaN may or may not survive vmaxps: the scalar check below decides)
      mxv = _mm512_max_ps(mxv, _mm512_abs_ps(_mm512_loadu_ps(xr + k)));
    }
    float mx = _mm512_reduce_max_ps(mxv);
    bool finite = std::isfinite(mx);
    for (int64_t k = 0; k < K && finite; ++k) finite = std::isfinite(xr[k]);
    bad[m] = finite ? 0 : 1;
    int e = 0;
    if (finite && mx > 0.0f) std::frexp(mx, &e);
    // (At most 2^126 as the factor: a row of tiny values, |x| < 2^-96, scales exactly by 2^126
    // and keeps fewer bits.)
    e = std::max(e, -96);
    const __m512 up = _mm512_set1_ps(finite ? std::ldexp(1.0f, 30 - e) : 0.0f);
    scale[m] = std::ldexp(1.0f, e - 30);
    const int64_t b = m / kBlockRows, i = m % kBlockRows;
    for (int64_t g = 0; g < G; ++g) {
      int8_t* rows = a + ((b * G + g) * kPieceRows + 4 * i) * 32;
      __m512i s64 = _mm512_setzero_si512();
      for (int h = 0; h < 2; ++h) {
        __m512i X = _mm512_cvtps_epi32(_mm512_mul_ps(_mm512_loadu_ps(xr + g * 32 + h * 16), up));
        s64 = _mm512_add_epi64(s64, _mm512_cvtepi32_epi64(_mm512_castsi512_si256(X)));
        s64 = _mm512_add_epi64(s64, _mm512_cvtepi32_epi64(_mm512_extracti64x4_epi64(X, 1)));
        for (int p = 3; p >= 0; --p) {
          const __m512i digit = _mm512_srai_epi32(_mm512_slli_epi32(X, 24), 24);
          _mm_storeu_si128(reinterpret_cast<__m128i*>(rows + p * 32 + h * 16),
                           _mm512_cvtepi32_epi8(digit));
          X = _mm512_srai_epi32(_mm512_sub_epi32(X, digit), 8);
        }
      }
      xsum[m * G + g] = static_cast<float>(_mm512_reduce_add_epi64(s64));
    }
  }
}

// Up to 4 input rows (one A tile) against output blocks [b0, b1) two at a time: the two blocks'
// tile chains (weights, product, store, combine) are independent, so one's latency hides behind
// the other's work. An odd last block goes through Block<1>.
template <bool FOUR>
PYSPEC_AMX_I8_TARGET void Block2(const int8_t* a, const float* scale, const float* xsum,
                                 const uint8_t* bad, const uint8_t* tq, const float* td,
                                 const float* tm, const float* bias, float* out, int rows,
                                 int64_t N, int64_t G, int64_t b0, int64_t b1) {
  constexpr int64_t kTileBytes = FOUR ? 256 : 512;
  alignas(64) uint8_t btile[2][512];
  alignas(64) int32_t c[2][16 * 16];
  __m512 acc[2][4];
  int64_t b = b0;
  for (; b + 1 < b1; b += 2) {
    for (int i = 0; i < rows; ++i) acc[0][i] = acc[1][i] = _mm512_setzero_ps();
    for (int64_t g = 0; g < G; ++g) {
      if constexpr (FOUR) {
        UnpackNibbles(tq + (b * G + g) * kTileBytes, btile[0]);
        UnpackNibbles(tq + ((b + 1) * G + g) * kTileBytes, btile[1]);
      }
      if constexpr (FOUR) {
        _tile_loadd(4, btile[0], 64);
        _tile_loadd(6, btile[1], 64);
      } else {
        _tile_loadd(4, tq + (b * G + g) * kTileBytes, 64);
        _tile_loadd(6, tq + ((b + 1) * G + g) * kTileBytes, 64);
      }
      _tile_loadd(5, a + g * kPieceRows * 32, 32);
      _tile_zero(0);
      _tile_zero(1);
      if constexpr (FOUR) {
        _tile_dpbsud(0, 5, 4);
        _tile_dpbsud(1, 5, 6);
      } else {
        _tile_dpbssd(0, 5, 4);
        _tile_dpbssd(1, 5, 6);
      }
      _tile_stored(0, c[0], 64);
      _tile_stored(1, c[1], 64);
      for (int h = 0; h < 2; ++h) {
        const __m512 dv = _mm512_loadu_ps(td + ((b + h) * G + g) * 16);
        const __m512 mv =
            FOUR ? _mm512_loadu_ps(tm + ((b + h) * G + g) * 16) : _mm512_setzero_ps();
        for (int i = 0; i < rows; ++i) {
          acc[h][i] = AddGroup<FOUR>(acc[h][i], c[h] + (4 * i) * 16, dv, mv,
                                     FOUR ? xsum[i * G + g] : 0.0f);
        }
      }
    }
    for (int h = 0; h < 2; ++h) {
      for (int i = 0; i < rows; ++i) {
        StoreOutputs(out + i * N + (b + h) * 16, acc[h][i], scale[i], bad[i] != 0, bias, b + h);
      }
    }
  }
  if (b < b1) Block<1, FOUR>(a, scale, xsum, bad, tq, td, tm, bias, out, rows, N, G, b, b1);
}

}  // namespace

PYSPEC_AMX_I8_TARGET void FixedLinearBlocks(const int8_t* a, const float* scale,
                                            const float* xsum, const uint8_t* bad,
                                            const uint8_t* tq, const float* td, const float* tm,
                                            const float* bias, float* out, int64_t M, int64_t N,
                                            int64_t K, int64_t b0, int64_t b1) {
  const int64_t G = K / 32;
  // Configured on every call (another kernel may have configured or released the tiles since),
  // and not released at the end: the next call's configuration replaces this one (a release per
  // call measured about 0.5 ms per decoding step of the default model).
  int configured = -1;
  for (int64_t m0 = 0; m0 < M; m0 += kBlockRows) {
    const int rows = static_cast<int>(std::min<int64_t>(kBlockRows, M - m0));
    if (4 * rows != configured) {
      Configure(4 * rows);
      configured = 4 * rows;
    }
    const int nt = (4 * rows + 15) / 16;
    const int8_t* ab = a + (m0 / kBlockRows) * G * kPieceRows * 32;
    const float* sc = scale + m0;
    const float* xs = xsum + m0 * G;
    const uint8_t* bd = bad + m0;
    float* o = out + m0 * N;
#define PYSPEC_FIXED_BLOCK(NT, FOUR) \
  Block<NT, FOUR>(ab, sc, xs, bd, tq, td, tm, bias, o, rows, N, G, b0, b1)
    if (nt == 1) {
      if (tm != nullptr) {
        Block2<true>(ab, sc, xs, bd, tq, td, tm, bias, o, rows, N, G, b0, b1);
      } else {
        Block2<false>(ab, sc, xs, bd, tq, td, tm, bias, o, rows, N, G, b0, b1);
      }
    } else if (tm != nullptr) {
      if (nt == 1) PYSPEC_FIXED_BLOCK(1, true);
      else if (nt == 2) PYSPEC_FIXED_BLOCK(2, true);
      else PYSPEC_FIXED_BLOCK(3, true);
    } else {
      if (nt == 1) PYSPEC_FIXED_BLOCK(1, false);
      else if (nt == 2) PYSPEC_FIXED_BLOCK(2, false);
      else PYSPEC_FIXED_BLOCK(3, false);
    }
#undef PYSPEC_FIXED_BLOCK
  }
}

#pragma GCC diagnostic pop

#else  // no AMX in this build

bool AmxInt8Available() { return false; }
void FixedLinearBlocks(const int8_t*, const float*, const float*, const uint8_t*, const uint8_t*,
                       const float*, const float*, const float*, float*, int64_t, int64_t, int64_t,
                       int64_t, int64_t) {}

#endif

}  // namespace detail

namespace {

// Shapes of codes in either layout: q [N, K / 2] uint8 (4-bit, m given) or [N, K] int8, d (and
// m) [N, K / 32] float32, all contiguous. Returns N.
int64_t CheckCodes(const TensorView& q, const TensorView& d, const TensorView* m, int64_t K,
                   const char* what) {
  PYSPEC_CHECK(K > 0 && K % 32 == 0, what, ": K must be a positive multiple of 32; got ", K);
  const bool four = m != nullptr;
  PYSPEC_CHECK(q.ndim == 2 && q.dtype == (four ? DType::kUInt8 : DType::kInt8) &&
                   q.shape[1] == (four ? K / 2 : K),
               what, ": codes must be ", four ? "uint8 [N, K / 2]" : "int8 [N, K]", " for K = ",
               K, "; got ", DTypeName(q.dtype), " ", q.ShapeString());
  const int64_t N = q.shape[0];
  PYSPEC_CHECK(N % 16 == 0, what, ": N must be a multiple of 16; got ", N);
  CheckContiguous(q, "q");
  for (const TensorView* t : {&d, m}) {
    if (t == nullptr) continue;
    PYSPEC_CHECK(t->ndim == 2 && t->dtype == DType::kFloat32 && t->shape[0] == N &&
                     t->shape[1] == K / 32,
                 what, ": scales must be float32 [", N, ", ", K / 32, "]; got ",
                 DTypeName(t->dtype), " ", t->ShapeString());
    CheckContiguous(*t, "scales");
  }
  return N;
}

}  // namespace

void RepackFixed(const TensorView& q, const TensorView& d, const TensorView* m,
                 const TensorView& tq, const TensorView& td, const TensorView* tm) {
  detail::RefuseCuda({&q, &d, m, &tq, &td, tm}, "repack_fixed");
  const bool four = m != nullptr;
  PYSPEC_CHECK((tm != nullptr) == four, "repack_fixed: m and tm go together (4-bit codes)");
  const int64_t K = four ? q.shape[1] * 2 : q.shape[1];
  const int64_t N = CheckCodes(q, d, m, K, "repack_fixed");
  CheckCodes(tq, td, tm, K, "repack_fixed (output)");
  PYSPEC_CHECK(tq.shape[0] == N, "repack_fixed: outputs must have the codes' shapes");
  const int64_t G = K / 32, tile = four ? 256 : 512;
  const uint8_t* src = static_cast<const uint8_t*>(q.data);
  uint8_t* dst = static_cast<uint8_t*>(tq.data);
  const float* ds = d.ptr<float>();
  float* dd = static_cast<float*>(td.data);
  for (int64_t b = 0; b < N / 16; ++b) {
    for (int64_t g = 0; g < G; ++g) {
      uint8_t* t = dst + (b * G + g) * tile;
      std::memset(t, 0, static_cast<size_t>(tile));
      for (int n = 0; n < 16; ++n) {
        const int64_t row = b * 16 + n;
        dd[(b * G + g) * 16 + n] = ds[row * G + g];
        if (four) {
          static_cast<float*>(tm->data)[(b * G + g) * 16 + n] = m->ptr<float>()[row * G + g];
        }
        for (int k = 0; k < 32; ++k) {
          // Code of weight (row, 32 g + k): 4-bit, the low nibble of byte k (k < 16) or the high
          // nibble of byte k - 16; 8-bit, byte k.
          uint8_t v;
          if (four) {
            const uint8_t byte = src[row * (K / 2) + g * 16 + (k & 15)];
            v = k < 16 ? (byte & 15) : (byte >> 4);
          } else {
            v = src[row * K + g * 32 + k];
          }
          // B row kr = k / 4, column byte 4 n + k % 4; 4-bit: rows 2v / 2v + 1 are the low /
          // high nibbles of bytes [64 v, 64 v + 64).
          const int kr = k / 4, col = 4 * n + k % 4;
          if (four) {
            uint8_t& byte = t[(kr / 2) * 64 + col];
            byte = static_cast<uint8_t>(kr % 2 == 0 ? (byte & 0xf0) | v : (byte & 0x0f) | (v << 4));
          } else {
            t[kr * 64 + col] = v;
          }
        }
      }
    }
  }
}

void LinearFixed(const TensorView& x, const TensorView& tq, const TensorView& td,
                 const TensorView* tm, const TensorView* bias, const TensorView& out,
                 ThreadPool* pool) {
  detail::RefuseCuda({&x, &tq, &td, tm, bias, &out}, "linear_fixed");
  CheckDType(x, "x", {DType::kFloat32});
  PYSPEC_CHECK(x.ndim == 2, "'x' must be 2-D [M, K]; got shape ", x.ShapeString());
  CheckContiguous(x, "x");
  const int64_t M = x.shape[0], K = x.shape[1];
  const int64_t N = CheckCodes(tq, td, tm, K, "linear_fixed");
  if (bias != nullptr) {
    CheckDType(*bias, "bias", {DType::kFloat32});
    CheckShape(*bias, "bias", {N});
    CheckContiguous(*bias, "bias");
  }
  CheckDType(out, "out", {DType::kFloat32});
  CheckShape(out, "out", {M, N});
  CheckContiguous(out, "out");
  PYSPEC_CHECK(detail::AmxInt8Available(), "linear_fixed needs a CPU with AMX-INT8 tiles (and "
               "the OS granting their state); this one has none");
  if (M == 0 || N == 0) return;
  const int64_t G = K / 32;
  const int64_t blocks_in = (M + detail::kFixedBlockRows - 1) / detail::kFixedBlockRows;
  thread_local std::vector<int8_t> a;
  thread_local std::vector<float> scale, xsum;
  thread_local std::vector<uint8_t> bad;
  a.resize(static_cast<size_t>(blocks_in * G * 48 * 32));
  scale.resize(static_cast<size_t>(M));
  xsum.resize(static_cast<size_t>(M * G));
  bad.resize(static_cast<size_t>(M));
  detail::FixedPackInputs(x.ptr<float>(), M, K, a.data(), scale.data(), xsum.data(), bad.data());
  const int8_t* ap = a.data();
  const float* sp = scale.data();
  const float* xs = xsum.data();
  const uint8_t* bp = bad.data();
  const uint8_t* qp = static_cast<const uint8_t*>(tq.data);
  const float* dp = td.ptr<float>();
  const float* mp = tm != nullptr ? tm->ptr<float>() : nullptr;
  const float* biasp = bias != nullptr ? bias->ptr<float>() : nullptr;
  float* op = static_cast<float*>(out.data);
  const int64_t block_bytes = 16 * (K * (tm != nullptr ? 4 : 8) / 8 + G * (tm != nullptr ? 8 : 4));
  detail::RunBlocks(pool, N / 16, block_bytes, [&](int64_t b0, int64_t b1) {
    detail::FixedLinearBlocks(ap, sp, xs, bp, qp, dp, mp, biasp, op, M, N, K, b0, b1);
  });
}

namespace detail {
void FixedPackInputs(const float* x, int64_t M, int64_t K, int8_t* a, float* scale, float* xsum,
                     uint8_t* bad) {
#ifdef PYSPEC_HAVE_AMX
  PackInputsAvx512(x, M, K, a, scale, xsum, bad);
#else
  (void)x, (void)M, (void)K, (void)a, (void)scale, (void)xsum, (void)bad;
#endif
}
}  // namespace detail

}  // namespace pyspec
