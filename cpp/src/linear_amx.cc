// bfloat16 dense layer on AMX tiles; the layout and the contract are in linear_amx.h.
//
// Tiles (palette 1, each 16 rows x 64 bytes): tmm0-3 accumulate C for up to four 16-row chunks of
// the inputs, tmm4 holds the weights (16 rows x 32 k, loaded straight from row-major w with the
// row stride), tmm5-7 the packed inputs. A C tile's element [r][i] is output (row i of the chunk,
// weight row n0 + r), so the output stage reads C tiles by column (a gather from the stored tile)
// to write 16 consecutive outputs of one input row.
//
// The kernel body (linear_amx_kernel.inc) is one template over the tile unit, built twice: on the
// AMX instructions (AmxLinearBlocks; the tile ops are always-inline wrappers of the intrinsics, so
// the code is what the body written with the intrinsics gives) and on a plain C++ emulation of
// the tile instructions (AmxLinearBlocksEmulated, every CPU, for tests).
#include "linear_amx.h"

#include <algorithm>
#include <cmath>
#include <cstring>

#include "half.h"
#include "pyspec/check.h"

#ifdef PYSPEC_HAVE_AMX
#include <cpuid.h>
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>
#endif

namespace pyspec {
namespace detail {

namespace {

// Elements of one packed input tile (16 k pairs x 16 rows x 2), i.e. 32 k of a 16-row chunk.
constexpr int64_t kTileElems = 512;

}  // namespace

#ifdef PYSPEC_HAVE_AMX
// GCC 12 flags its own AVX-512 intrinsics (their _mm512_undefined_* operands) as maybe
// uninitialized once inlined; a known false positive.
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
namespace {

#define PYSPEC_AMX_TARGET __attribute__((target("amx-tile,amx-bf16,avx512f,avx512bw")))
#define PYSPEC_AMX_INLINE PYSPEC_AMX_TARGET inline __attribute__((always_inline))

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

// GCC's tile intrinsics write their tile operand into the instruction text (they stringify the
// argument), so a tile number must reach them as a literal: one constexpr branch per tile.
#define PYSPEC_FOR_TILE(T, OP)         \
  static_assert((T) >= 0 && (T) < 8);  \
  if constexpr ((T) == 0) {            \
    OP(0);                             \
  } else if constexpr ((T) == 1) {     \
    OP(1);                             \
  } else if constexpr ((T) == 2) {     \
    OP(2);                             \
  } else if constexpr ((T) == 3) {     \
    OP(3);                             \
  } else if constexpr ((T) == 4) {     \
    OP(4);                             \
  } else if constexpr ((T) == 5) {     \
    OP(5);                             \
  } else if constexpr ((T) == 6) {     \
    OP(6);                             \
  } else {                             \
    OP(7);                             \
  }
#define PYSPEC_TILE_ZERO(t) _tile_zero(t)
#define PYSPEC_TILE_LOAD(t) _tile_loadd(t, p, stride)
#define PYSPEC_TILE_STORE(t) _tile_stored(t, p, stride)

// The tile unit itself: each operation is the intrinsic.
struct HardwareTiles {
  // Gather offsets of one column of a stored C tile (elements [r][i], r = 0..15, 16 floats a row).
  __m512i column;
  PYSPEC_AMX_INLINE HardwareTiles()
      : column(_mm512_mullo_epi32(
            _mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0),
            _mm512_set1_epi32(16))) {}
  PYSPEC_AMX_INLINE void Config(const AmxTileConfig& cfg) { _tile_loadconfig(&cfg); }
  template <int T>
  PYSPEC_AMX_INLINE void Zero() {
    PYSPEC_FOR_TILE(T, PYSPEC_TILE_ZERO)
  }
  template <int T>
  PYSPEC_AMX_INLINE void Load(const void* p, int64_t stride) {
    PYSPEC_FOR_TILE(T, PYSPEC_TILE_LOAD)
  }
  template <int T>
  PYSPEC_AMX_INLINE void Store(void* p, int64_t stride) {
    PYSPEC_FOR_TILE(T, PYSPEC_TILE_STORE)
  }
  // The kernel's four products (C tile, weights, packed inputs).
  template <int C, int A, int B>
  PYSPEC_AMX_INLINE void Dp() {
    if constexpr (C == 0 && A == 4 && B == 5) {
      _tile_dpbf16ps(0, 4, 5);
    } else if constexpr (C == 1 && A == 4 && B == 6) {
      _tile_dpbf16ps(1, 4, 6);
    } else if constexpr (C == 2 && A == 4 && B == 7) {
      _tile_dpbf16ps(2, 4, 7);
    } else {
      static_assert(C == 3 && A == 4 && B == 5, "add the tile combination here");
      _tile_dpbf16ps(3, 4, 5);
    }
  }
  PYSPEC_AMX_INLINE void Release() { _tile_release(); }

  using Bias = __m512;
  PYSPEC_AMX_INLINE Bias LoadBias(const float* b) {
    return b != nullptr ? _mm512_loadu_ps(b) : _mm512_setzero_ps();
  }
  PYSPEC_AMX_INLINE void StoreRow(const float* c, int i, Bias bv, bool has_bias, uint16_t* dst) {
    __m512 v = _mm512_i32gather_ps(column, c + i, 4);
    if (has_bias) v = _mm512_add_ps(v, bv);  // no bias: nothing added (keeps -0.0)
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst), RoundToBf16(v));
  }
};

#undef PYSPEC_TILE_STORE
#undef PYSPEC_TILE_LOAD
#undef PYSPEC_TILE_ZERO
#undef PYSPEC_FOR_TILE

namespace hw {
#define PYSPEC_TILE_FN PYSPEC_AMX_INLINE
#include "linear_amx_kernel.inc"
#undef PYSPEC_TILE_FN
}  // namespace hw

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

PYSPEC_AMX_TARGET void AmxLinearBlocks(const uint16_t* packed, const uint16_t* w,
                                       const float* bias, uint16_t* out, int64_t M, int64_t N,
                                       int64_t K, int64_t b0, int64_t b1) {
  HardwareTiles t;
  hw::LinearBlocksBody(t, packed, w, bias, out, M, N, K, b0, b1);
}

#pragma GCC diagnostic pop

#else  // no AMX in this build

bool AmxBf16Available() { return false; }
void AmxLinearBlocks(const uint16_t*, const uint16_t*, const float*, uint16_t*, int64_t, int64_t,
                     int64_t, int64_t, int64_t) {}

#endif

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

// ---- emulated tiles (every build) ----------------------------------------------------------------

namespace {

// Tiles in plain C++ with the semantics of the Intel SDM's pseudo-code (palette 1: 8 tiles of at
// most 16 rows x 64 bytes). Misuse the hardware would fault on (#GP/#UD: bad configuration,
// mismatched TDPBF16PS shapes) is an internal error here.
class EmulatedTiles {
 public:
  void Config(const AmxTileConfig& cfg) {
    PYSPEC_ICHECK(cfg.palette_id == 1 && cfg.start_row == 0, "tile config: palette ",
                  int{cfg.palette_id}, ", start_row ", int{cfg.start_row});
    for (int i = 0; i < 8; ++i) {
      PYSPEC_ICHECK(cfg.rows[i] <= 16 && cfg.colsb[i] <= 64 && cfg.colsb[i] % 4 == 0,
                    "tile config: tile ", i, " rows ", int{cfg.rows[i]}, " colsb ",
                    int{cfg.colsb[i]});
      tiles_[i].rows = cfg.rows[i];
      tiles_[i].colsb = cfg.colsb[i];
      std::memset(tiles_[i].data, 0, sizeof(tiles_[i].data));
    }
    configured_ = true;
  }
  template <int T>
  void Zero() {
    std::memset(Tile<T>().data, 0, sizeof(tiles_[T].data));
  }
  // Rows [0, rows) of colsb bytes from p + r * stride; the rest of the tile zeroed.
  template <int T>
  void Load(const void* p, int64_t stride) {
    TileData& t = Tile<T>();
    std::memset(t.data, 0, sizeof(t.data));
    for (int r = 0; r < t.rows; ++r) {
      std::memcpy(t.data[r], static_cast<const uint8_t*>(p) + r * stride, t.colsb);
    }
  }
  template <int T>
  void Store(void* p, int64_t stride) {
    const TileData& t = Tile<T>();
    for (int r = 0; r < t.rows; ++r) {
      std::memcpy(static_cast<uint8_t*>(p) + r * stride, t.data[r], t.colsb);
    }
  }
  // TDPBF16PS: C[m][n] += sum over pairs k of A[m].bf16[2k] * B[k].bf16[2n] (the even sum) and
  // A[m].bf16[2k+1] * B[k].bf16[2n+1] (the odd sum), each accumulated in fp32 with FMA in k order,
  // then C[m][n] += (even + odd). DAZ on inputs, FTZ on results, round to nearest even.
  template <int C, int A, int B>
  void Dp() {
    static_assert(C != A && C != B, "TDPBF16PS: the destination must differ from the sources");
    TileData& c = Tile<C>();
    const TileData& a = Tile<A>();
    const TileData& b = Tile<B>();
    const int pairs = a.colsb / 4, cols = c.colsb / 4;
    PYSPEC_ICHECK(c.rows == a.rows && pairs == b.rows && c.colsb == b.colsb,
                  "TDPBF16PS shapes: C ", c.rows, "x", c.colsb, ", A ", a.rows, "x", a.colsb,
                  ", B ", b.rows, "x", b.colsb);
    for (int m = 0; m < c.rows; ++m) {
      float tmp[32] = {};
      for (int k = 0; k < pairs; ++k) {
        const float a0 = Bf16(a, m, 2 * k), a1 = Bf16(a, m, 2 * k + 1);
        for (int n = 0; n < cols; ++n) {
          tmp[2 * n] = Ftz(std::fma(a0, Bf16(b, k, 2 * n), tmp[2 * n]));
          tmp[2 * n + 1] = Ftz(std::fma(a1, Bf16(b, k, 2 * n + 1), tmp[2 * n + 1]));
        }
      }
      for (int n = 0; n < cols; ++n) {
        float cv;
        std::memcpy(&cv, c.data[m] + 4 * n, 4);
        cv = Ftz(Ftz(cv) + Ftz(tmp[2 * n] + tmp[2 * n + 1]));
        std::memcpy(c.data[m] + 4 * n, &cv, 4);
      }
    }
  }
  void Release() { configured_ = false; }

  struct Bias {
    float v[16];
  };
  Bias LoadBias(const float* b) {
    Bias out{};
    if (b != nullptr) std::memcpy(out.v, b, sizeof(out.v));
    return out;
  }
  void StoreRow(const float* c, int i, const Bias& bv, bool has_bias, uint16_t* dst) {
    for (int r = 0; r < 16; ++r) {
      float v = c[r * 16 + i];
      if (has_bias) v += bv.v[r];  // no bias: nothing added (keeps -0.0)
      dst[r] = half::FloatToBF16(v);
    }
  }

 private:
  struct TileData {
    int rows = 0, colsb = 0;
    alignas(64) uint8_t data[16][64];
  };
  template <int T>
  TileData& Tile() {
    static_assert(T >= 0 && T < 8, "palette 1 has tiles 0-7");
    PYSPEC_ICHECK(configured_, "tile instruction without a tile configuration");
    return tiles_[T];
  }
  // Denormals (as inputs: DAZ; as results: FTZ) become zero of the same sign.
  static float Ftz(float x) {
    uint32_t u;
    std::memcpy(&u, &x, 4);
    if ((u & 0x7f800000u) == 0) u &= 0x80000000u;
    std::memcpy(&x, &u, 4);
    return x;
  }
  static float Bf16(const TileData& t, int row, int elem) {
    uint16_t h;
    std::memcpy(&h, t.data[row] + 2 * elem, 2);
    return Ftz(half::BF16ToFloat(h));
  }

  TileData tiles_[8];
  bool configured_ = false;
};

namespace emulated {
#define PYSPEC_TILE_FN inline
#include "linear_amx_kernel.inc"
#undef PYSPEC_TILE_FN
}  // namespace emulated

}  // namespace

void AmxLinearBlocksEmulated(const uint16_t* packed, const uint16_t* w, const float* bias,
                             uint16_t* out, int64_t M, int64_t N, int64_t K, int64_t b0,
                             int64_t b1) {
  EmulatedTiles t;
  emulated::LinearBlocksBody(t, packed, w, bias, out, M, N, K, b0, b1);
}

}  // namespace detail
}  // namespace pyspec
