// bfloat16 dense layer on AMX tiles; the layout and the contract are in linear_amx.h.
//
// Tiles (palette 1, each 16 rows x 64 bytes): tmm0-3 accumulate C for up to four 16-row chunks of
// the inputs, tmm4 holds the weights (16 rows x 32 k, loaded straight from row-major w with the
// row stride), tmm5-7 the packed inputs. A C tile's element [r][i] is output (row i of the chunk,
// weight row n0 + r), so the output stage reads C tiles by column (a gather from the stored tile)
// to write 16 consecutive outputs of one input row.
#include "linear_amx.h"

#include <algorithm>
#include <cstring>

#ifdef PYSPEC_HAVE_AMX
#include <cpuid.h>
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>
#endif

namespace pyspec {
namespace detail {

#ifdef PYSPEC_HAVE_AMX
// GCC 12 flags its own AVX-512 intrinsics (their _mm512_undefined_* operands) as maybe
// uninitialized once inlined; a known false positive.
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
namespace {

#define PYSPEC_AMX_TARGET __attribute__((target("amx-tile,amx-bf16,avx512f,avx512bw")))

// Elements of one packed input tile (16 k pairs x 16 rows x 2), i.e. 32 k of a 16-row chunk.
constexpr int64_t kTileElems = 512;

// Accumulates C tiles 0..NM-1 over all of K for one block of 16 weight rows. The weights stream
// in address order (a block's rows are contiguous), which the hardware prefetchers follow: software
// prefetches of the next block were slower (bench/bench_linear.py, one row).
template <int NM>
PYSPEC_AMX_TARGET inline __attribute__((always_inline)) void Accumulate(
    const uint16_t* wb, int64_t ldw_bytes, const uint16_t* xg, int64_t chunk_elems, int64_t kcn) {
  for (int64_t kc = 0; kc < kcn; ++kc) {
    _tile_loadd(4, wb + kc * 32, ldw_bytes);
    const uint16_t* xb = xg + kc * kTileElems;
    _tile_loadd(5, xb, 64);
    _tile_dpbf16ps(0, 4, 5);
    if constexpr (NM > 1) {
      _tile_loadd(6, xb + chunk_elems, 64);
      _tile_dpbf16ps(1, 4, 6);
    }
    if constexpr (NM > 2) {
      _tile_loadd(7, xb + 2 * chunk_elems, 64);
      _tile_dpbf16ps(2, 4, 7);
    }
    if constexpr (NM > 3) {
      _tile_loadd(5, xb + 3 * chunk_elems, 64);
      _tile_dpbf16ps(3, 4, 5);
    }
  }
}

// fp32 -> bf16 bits, round to nearest even, NaN kept quiet (as half::FloatToBF16).
PYSPEC_AMX_TARGET inline __attribute__((always_inline)) __m256i RoundToBf16(__m512 v) {
  const __m512i u = _mm512_castps_si512(v);
  const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
  const __m512i rounded =
      _mm512_srli_epi32(_mm512_add_epi32(u, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7fff))), 16);
  const __mmask16 nan = _mm512_cmpgt_epu32_mask(_mm512_and_si512(u, _mm512_set1_epi32(0x7fffffff)),
                                                _mm512_set1_epi32(0x7f800000));
  const __m512i quiet = _mm512_or_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(0x40));
  return _mm512_cvtepi32_epi16(_mm512_mask_blend_epi32(nan, rounded, quiet));
}

}  // namespace

bool AmxBf16Available() {
  static const bool ok = [] {
    unsigned a = 0, b = 0, c = 0, d = 0;
    if (!__get_cpuid_count(7, 0, &a, &b, &c, &d)) return false;
    // CPUID.(7, 0): EDX bit 22 AMX-BF16, 24 AMX-TILE; EBX bit 16 AVX-512F, 30 AVX-512BW.
    const bool amx_bf16 = (d >> 22) & 1u, amx_tile = (d >> 24) & 1u;
    const bool avx512f = (b >> 16) & 1u, avx512bw = (b >> 30) & 1u;
    if (!(amx_bf16 && amx_tile && avx512f && avx512bw)) return false;
    // Linux hands out the tile data state only on request (once per process, for all threads).
    constexpr long kArchReqXcompPerm = 0x1023, kXfeatureXtiledata = 18;
    return syscall(SYS_arch_prctl, kArchReqXcompPerm, kXfeatureXtiledata) == 0;
  }();
  return ok;
}

void AmxPackInputs(const uint16_t* x, int64_t M, int64_t K, uint16_t* packed) {
  const int64_t kcn = K / 32, chunks = (M + 15) / 16;
  std::memset(packed, 0, static_cast<size_t>(chunks * 16 * K) * sizeof(uint16_t));
  // One 32-bit pair (k = 2p, 2p + 1) of row m goes to [chunk][kc][p % 16][m % 16].
  for (int64_t m = 0; m < M; ++m) {
    uint16_t* dst = packed + (m / 16) * kcn * kTileElems + 2 * (m % 16);
    const uint16_t* src = x + m * K;
    // Pair p lands at pair slot (kc * 16 + p % 16) * 16 == p * 16 (kc = p / 16).
    for (int64_t p = 0; p < K / 2; ++p) {
      std::memcpy(dst + 32 * p, src + 2 * p, 2 * sizeof(uint16_t));
    }
  }
}

PYSPEC_AMX_TARGET void AmxLinearBlocks(const uint16_t* packed, const uint16_t* w,
                                       const float* bias, uint16_t* out, int64_t M, int64_t N,
                                       int64_t K, int64_t b0, int64_t b1) {
  AmxTileConfig cfg;
  std::memset(&cfg, 0, sizeof(cfg));
  cfg.palette_id = 1;
  for (int t = 0; t < 8; ++t) {
    cfg.rows[t] = 16;
    cfg.colsb[t] = 64;
  }
  _tile_loadconfig(&cfg);
  const int64_t kcn = K / 32, chunks = (M + 15) / 16, chunk_elems = kcn * kTileElems;
  const int64_t ldw_bytes = K * static_cast<int64_t>(sizeof(uint16_t));
  alignas(64) float cbuf[4][256];
  const __m512i column = _mm512_mullo_epi32(
      _mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0),
      _mm512_set1_epi32(16));
  for (int64_t b = b0; b < b1; ++b) {
    const int64_t n0 = b * 16;
    const uint16_t* wb = w + n0 * K;
    const __m512 bv = bias != nullptr ? _mm512_loadu_ps(bias + n0) : _mm512_setzero_ps();
    const bool has_bias = bias != nullptr;
    for (int64_t g = 0; g < chunks; g += 4) {
      const int nm = static_cast<int>(std::min<int64_t>(4, chunks - g));
      const uint16_t* xg = packed + g * chunk_elems;
      _tile_zero(0);
      _tile_zero(1);
      _tile_zero(2);
      _tile_zero(3);
      switch (nm) {
        case 1: Accumulate<1>(wb, ldw_bytes, xg, chunk_elems, kcn); break;
        case 2: Accumulate<2>(wb, ldw_bytes, xg, chunk_elems, kcn); break;
        case 3: Accumulate<3>(wb, ldw_bytes, xg, chunk_elems, kcn); break;
        default: Accumulate<4>(wb, ldw_bytes, xg, chunk_elems, kcn); break;
      }
      _tile_stored(0, cbuf[0], 64);
      if (nm > 1) _tile_stored(1, cbuf[1], 64);
      if (nm > 2) _tile_stored(2, cbuf[2], 64);
      if (nm > 3) _tile_stored(3, cbuf[3], 64);
      for (int j = 0; j < nm; ++j) {
        const int64_t m0 = (g + j) * 16;
        const int rows = static_cast<int>(std::min<int64_t>(16, M - m0));
        for (int i = 0; i < rows; ++i) {
          __m512 v = _mm512_i32gather_ps(column, cbuf[j] + i, 4);
          if (has_bias) v = _mm512_add_ps(v, bv);  // no bias: nothing added (keeps -0.0)
          _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + (m0 + i) * N + n0),
                              RoundToBf16(v));
        }
      }
    }
  }
  _tile_release();
}

#pragma GCC diagnostic pop

#else  // no AMX in this build

bool AmxBf16Available() { return false; }
void AmxPackInputs(const uint16_t*, int64_t, int64_t, uint16_t*) {}
void AmxLinearBlocks(const uint16_t*, const uint16_t*, const float*, uint16_t*, int64_t, int64_t,
                     int64_t, int64_t, int64_t) {}

#endif

}  // namespace detail
}  // namespace pyspec
