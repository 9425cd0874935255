// A feasibility probe, not a kernel of the library: how fast could the default model's packed
// layers (4-bit codes w = d * q + m, groups of 32 along K; the lm_head 8-bit w = d * q) run on AMX
// int8 tiles, with each float32 input row held as P signed bytes of one fixed-point integer per
// row (x ~= s_r * sum_p a_p * 256^(P-1-p), scale s_r from the row's largest |x|)? Every product
// and every group's sum is then exact in int32 (TDPBSUD / TDPBSSD), and a row's result does not
// depend on the other rows of the call, so plain and speculative steps would give one row the
// same bits; the results are not the float32 kernel's bits (P = 4: 30 bits of fixed point per
// row, against float32's 24 significant bits per element).
//
// It times one pass over SmolLM2-135M's layer shapes (30 x q/k/v/o/gate/up/down in 4-bit codes,
// the 49152 x 576 lm_head in 8-bit) for M = 1..16 input rows and P = 3, 4, on 2 threads
// (M * P <= 48) and reports each P's error against a float64 reference next to the float32 error (inputs with a few
// large dimensions, as hidden states have). Compare its times with the core kernel's in the same
// session: `python bench/bench_linear.py --packed --rows 1,2,4,8,16`.
//
//   g++ -O2 -std=c++17 -fopenmp -march=sapphirerapids bench/amx_int8_probe.cc -o /tmp/amx_probe
//   OMP_NUM_THREADS=2 /tmp/amx_probe
#include <immintrin.h>
#include <omp.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <random>
#include <vector>

namespace {

constexpr int kArchReqXcompPerm = 0x1023;
constexpr int kXfeatureXtiledata = 18;

struct alignas(64) TileConfig {
  uint8_t palette_id = 1;
  uint8_t start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

// One layer: N outputs x K inputs. Codes are stored per group of 16 outputs, per K group of 32,
// already in the B tile's layout (K/4 rows of 16 outputs x 4 k): 4-bit as 256 bytes whose low
// nibbles are tile rows 0, 2, 4, 6 and high nibbles rows 1, 3, 5, 7; 8-bit as the 512-byte tile.
struct Layer {
  int N, K, bits;
  std::vector<uint8_t> codes;  // [N/16][K/32][256 or 512]
  std::vector<float> d, mn;    // [N/16][K/32][16]
  std::vector<float> w;        // [N][K] the same weights as float32 (reference)
};

Layer MakeLayer(int N, int K, int bits, std::mt19937& rng) {
  Layer L{N, K, bits, {}, {}, {}, {}};
  const int NG = N / 16, G = K / 32, bytes = bits == 4 ? 256 : 512;
  L.codes.resize(static_cast<size_t>(NG) * G * bytes);
  L.d.resize(static_cast<size_t>(NG) * G * 16);
  L.mn.resize(L.d.size());
  L.w.resize(static_cast<size_t>(N) * K);
  std::uniform_real_distribution<float> ud(0.001f, 0.01f);
  std::uniform_int_distribution<int> q4(0, 15), q8(-128, 127);
  for (int ng = 0; ng < NG; ++ng) {
    for (int g = 0; g < G; ++g) {
      uint8_t* c = &L.codes[(static_cast<size_t>(ng) * G + g) * bytes];
      float* dd = &L.d[(static_cast<size_t>(ng) * G + g) * 16];
      float* mm = &L.mn[(static_cast<size_t>(ng) * G + g) * 16];
      for (int n = 0; n < 16; ++n) {
        dd[n] = ud(rng);
        mm[n] = bits == 4 ? -8.0f * dd[n] : 0.0f;
      }
      for (int kr = 0; kr < 8; ++kr) {      // tile row: k = 4 kr .. 4 kr + 3
        for (int b = 0; b < 64; ++b) {      // byte b of the row: output b / 4, k = 4 kr + b % 4
          const int n = b / 4, k = 4 * kr + b % 4;
          const int q = bits == 4 ? q4(rng) : q8(rng);
          if (bits == 4) {
            uint8_t& byte = c[(kr / 2) * 64 + b];
            byte = static_cast<uint8_t>(kr % 2 == 0 ? (byte & 0xf0) | q : (byte & 0x0f) | (q << 4));
          } else {
            c[kr * 64 + b] = static_cast<uint8_t>(static_cast<int8_t>(q));
          }
          L.w[static_cast<size_t>(ng * 16 + n) * K + g * 32 + k] = dd[n] * q + mm[n];
        }
      }
    }
  }
  return L;
}

// The inputs as P-byte fixed point per row: a[g][m * P + p][32] (the A tiles of each K group),
// the row scales and each row's group sums of x (for the m term).
struct Inputs {
  int M, K, P;
  std::vector<int8_t> a;
  std::vector<float> scale, gsum;
};

Inputs Quantize(const std::vector<float>& x, int M, int K, int P) {
  Inputs in{M, K, P, {}, {}, {}};
  const int G = K / 32;
  in.a.assign(static_cast<size_t>(G) * M * P * 32, 0);
  in.scale.resize(M);
  in.gsum.assign(static_cast<size_t>(M) * G, 0.0f);
  const double top = std::ldexp(1.0, 8 * P - 2);
  for (int m = 0; m < M; ++m) {
    double mx = 0;
    for (int k = 0; k < K; ++k) mx = std::max(mx, std::fabs(static_cast<double>(x[m * K + k])));
    const double s = mx > 0 ? mx / top : 1.0;
    in.scale[m] = static_cast<float>(s);
    for (int k = 0; k < K; ++k) {
      int64_t X = std::llround(x[m * K + k] / s);
      for (int p = P - 1; p >= 0; --p) {  // balanced base-256 digits, lowest first
        int64_t digit = ((X % 256) + 256) % 256;
        if (digit >= 128) digit -= 256;
        in.a[(static_cast<size_t>(k / 32) * M * P + m * P + p) * 32 + k % 32] =
            static_cast<int8_t>(digit);
        X = (X - digit) / 256;
      }
      in.gsum[m * G + k / 32] += x[m * K + k];
    }
  }
  return in;
}

__attribute__((target("amx-tile,amx-int8,avx512f,avx512bw"))) void ConfigureTiles(int mp) {
  // C tiles 0-2 and A tiles 5-7 of up to 16 rows each (B is tile 4): rows 16 t .. 16 t + 15 of
  // the M * P fixed-point rows go through A tile 5 + t into C tile t.
  TileConfig cfg;
  const int nt = (mp + 15) / 16;
  for (int t = 0; t < nt; ++t) {
    const int rows = std::min(16, mp - 16 * t);
    cfg.rows[t] = static_cast<uint8_t>(rows);  // C: rows x 16 int32
    cfg.colsb[t] = 64;
  }
  for (int t = 0; t < 3 && t < nt; ++t) {
    cfg.rows[5 + t] = static_cast<uint8_t>(std::min(16, mp - 16 * t));  // A: rows x 32 bytes
    cfg.colsb[5 + t] = 32;
  }
  cfg.rows[4] = 8;  // B: 8 rows x 64 bytes (32 k x 16 outputs)
  cfg.colsb[4] = 64;
  // GCC 12 does not see ldtilecfg read cfg and dropped its stores (the tile loads then fault).
  asm volatile("" : : "m"(cfg) : "memory");
  _tile_loadconfig(&cfg);
}

// out[m][n] for one layer, its output groups shared among the threads of the enclosing parallel
// region (tiles configured for M * P <= 48 rows; a fourth tile of A rows would need another
// tile register, so M * P <= 48: M <= 12 at P = 4, M <= 16 at P = 3).
template <int BITS, int NT>
__attribute__((target("amx-tile,amx-int8,avx512f,avx512bw"))) void LayerAmx(
    const Layer& L, const Inputs& in, float* out) {
  const int NG = L.N / 16, G = L.K / 32, M = in.M, P = in.P, MP = M * P;
  const int bytes = BITS == 4 ? 256 : 512;
  alignas(64) uint8_t btile[512];
  alignas(64) int32_t c[48 * 16];
  {
#pragma omp for schedule(static)
    for (int ng = 0; ng < NG; ++ng) {
      __m512 acc[16], accm[16];
      for (int m = 0; m < M; ++m) acc[m] = accm[m] = _mm512_setzero_ps();
      for (int g = 0; g < G; ++g) {
        const uint8_t* src = &L.codes[(static_cast<size_t>(ng) * G + g) * bytes];
        if constexpr (BITS == 4) {
          const __m512i lo = _mm512_set1_epi8(0x0f);
          for (int i = 0; i < 4; ++i) {
            const __m512i v = _mm512_loadu_si512(src + i * 64);
            _mm512_store_si512(btile + (2 * i) * 64, _mm512_and_si512(v, lo));
            _mm512_store_si512(btile + (2 * i + 1) * 64,
                               _mm512_and_si512(_mm512_srli_epi16(v, 4), lo));
          }
          _tile_loadd(4, btile, 64);
        } else {
          _tile_loadd(4, src, 64);
        }
        const int8_t* a = &in.a[static_cast<size_t>(g) * MP * 32];
        _tile_loadd(5, a, 32);
        _tile_zero(0);
        if constexpr (BITS == 4) _tile_dpbsud(0, 5, 4); else _tile_dpbssd(0, 5, 4);
        if constexpr (NT > 1) {
          _tile_loadd(6, a + 16 * 32, 32);
          _tile_zero(1);
          if constexpr (BITS == 4) _tile_dpbsud(1, 6, 4); else _tile_dpbssd(1, 6, 4);
        }
        if constexpr (NT > 2) {
          _tile_loadd(7, a + 32 * 32, 32);
          _tile_zero(2);
          if constexpr (BITS == 4) _tile_dpbsud(2, 7, 4); else _tile_dpbssd(2, 7, 4);
        }
        _tile_stored(0, c, 64);
        if constexpr (NT > 1) _tile_stored(1, c + 16 * 16, 64);
        if constexpr (NT > 2) _tile_stored(2, c + 32 * 16, 64);
        const float* dd = &L.d[(static_cast<size_t>(ng) * G + g) * 16];
        const __m512 dv = _mm512_loadu_ps(dd);
        const __m512 mv = _mm512_loadu_ps(&L.mn[(static_cast<size_t>(ng) * G + g) * 16]);
        for (int m = 0; m < M; ++m) {
          // Pieces two at a time in int32 (a group's sum is below 2^20 in magnitude, so
          // c0 * 256 + c1 is below 2^29), then one conversion per pair.
          const int32_t* cm = c + (m * P) * 16;
          auto pair = [&](int p) {
            return _mm512_add_epi32(_mm512_slli_epi32(_mm512_load_si512(cm + p * 16), 8),
                                    _mm512_load_si512(cm + (p + 1) * 16));
          };
          __m512 s;
          if (P == 4) {
            s = _mm512_fmadd_ps(_mm512_cvtepi32_ps(pair(0)), _mm512_set1_ps(65536.0f),
                                _mm512_cvtepi32_ps(pair(2)));
          } else if (P == 3) {
            s = _mm512_fmadd_ps(_mm512_cvtepi32_ps(pair(0)), _mm512_set1_ps(256.0f),
                                _mm512_cvtepi32_ps(_mm512_load_si512(cm + 32)));
          } else {
            s = _mm512_cvtepi32_ps(_mm512_load_si512(cm));
            for (int p = 1; p < P; ++p) {
              s = _mm512_fmadd_ps(s, _mm512_set1_ps(256.0f),
                                  _mm512_cvtepi32_ps(_mm512_load_si512(cm + p * 16)));
            }
          }
          acc[m] = _mm512_fmadd_ps(dv, s, acc[m]);
          accm[m] = _mm512_fmadd_ps(mv, _mm512_set1_ps(in.gsum[m * G + g]), accm[m]);
        }
      }
      for (int m = 0; m < M; ++m) {
        _mm512_storeu_ps(out + static_cast<size_t>(m) * L.N + ng * 16,
                         _mm512_fmadd_ps(acc[m], _mm512_set1_ps(in.scale[m]), accm[m]));
      }
    }
  }
}

template <int BITS>
void LayerAmxAny(const Layer& L, const Inputs& in, float* out) {
  const int nt = (in.M * in.P + 15) / 16;
  if (nt == 1) LayerAmx<BITS, 1>(L, in, out);
  else if (nt == 2) LayerAmx<BITS, 2>(L, in, out);
  else LayerAmx<BITS, 3>(L, in, out);
}

// Runs f() on every thread of one parallel region with the tiles configured for M * P rows.
template <typename F>
void Parallel(int mp, F f) {
#pragma omp parallel
  {
    ConfigureTiles(mp);
    f();
    _tile_release();
  }
}

bool RequestAmx() {
  return syscall(SYS_arch_prctl, kArchReqXcompPerm, kXfeatureXtiledata) == 0;
}

}  // namespace

int main() {
  if (!RequestAmx()) {
    std::printf("AMX tile data not granted by the kernel\n");
    return 1;
  }
  std::mt19937 rng(1);
  const int H = 576, I = 1536, KV = 192;
  std::vector<Layer> layers;
  // One decoder layer's seven matrices (timed 30 times: the weights differ per layer in the
  // model, so each pass below streams 30 copies to keep the bytes read per pass the model's).
  for (int l = 0; l < 30; ++l) {
    for (auto [n, k] : {std::pair{H, H}, {KV, H}, {KV, H}, {H, H}, {I, H}, {I, H}, {H, I}}) {
      layers.push_back(MakeLayer(n, k, 4, rng));
    }
  }
  Layer head = MakeLayer(49152, H, 8, rng);
  size_t bytes = head.codes.size() + head.d.size() * 8;
  for (const Layer& L : layers) bytes += L.codes.size() + L.d.size() * 8;
  std::printf("codes + scales per pass: %.1f MB; threads %d\n", bytes / 1e6, omp_get_max_threads());

  // Accuracy on one 1536 x 576 layer: x with a few large dimensions.
  {
    const Layer& L = layers[4];
    std::vector<float> x(L.K);
    std::normal_distribution<float> nd(0.0f, 1.0f);
    for (float& v : x) v = nd(rng);
    x[7] = 60.0f;
    x[300] = -45.0f;
    std::vector<double> ref(L.N);
    double refmax = 0;
    std::vector<float> f32(L.N);
    for (int n = 0; n < L.N; ++n) {
      double s = 0;
      float sf = 0;
      for (int k = 0; k < L.K; ++k) {
        s += static_cast<double>(L.w[static_cast<size_t>(n) * L.K + k]) * x[k];
        sf = std::fma(L.w[static_cast<size_t>(n) * L.K + k], x[k], sf);
      }
      ref[n] = s;
      f32[n] = sf;
      refmax = std::max(refmax, std::fabs(s));
    }
    double e32 = 0;
    for (int n = 0; n < L.N; ++n) e32 = std::max(e32, std::fabs(f32[n] - ref[n]));
    std::printf("max |error| / max |y| on a 1536 x 576 layer: float32 sequential fma %.2e", e32 / refmax);
    for (int P : {2, 3, 4}) {
      Inputs in = Quantize(x, 1, L.K, P);
      std::vector<float> out(L.N);
      Parallel(P, [&] { LayerAmxAny<4>(L, in, out.data()); });
      double e = 0;
      for (int n = 0; n < L.N; ++n) e = std::max(e, std::fabs(out[n] - ref[n]));
      std::printf(", P=%d %.2e", P, e / refmax);
    }
    std::printf("\n");
  }

  std::printf("rows  P  ms per pass (30 layers + lm_head)\n");
  for (int P : {3, 4}) {
    for (int M : {1, 2, 4, 8, 12, 16}) {
      if (M * P > 48) continue;
      std::vector<float> xh(static_cast<size_t>(M) * H), xi(static_cast<size_t>(M) * I);
      std::normal_distribution<float> nd(0.0f, 1.0f);
      for (float& v : xh) v = nd(rng);
      for (float& v : xi) v = nd(rng);
      Inputs ih = Quantize(xh, M, H, P), ii = Quantize(xi, M, I, P);
      std::vector<float> out(static_cast<size_t>(M) * 49152);
      auto pass = [&] {
        Parallel(M * P, [&] {
          for (const Layer& L : layers) LayerAmxAny<4>(L, L.K == H ? ih : ii, out.data());
          LayerAmxAny<8>(head, ih, out.data());
        });
      };
      for (int i = 0; i < 3; ++i) pass();
      const int reps = 20;
      std::vector<double> t;
      for (int i = 0; i < reps; ++i) {
        auto t0 = std::chrono::steady_clock::now();
        pass();
        t.push_back(std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0)
                        .count());
      }
      std::sort(t.begin(), t.end());
      std::printf("%4d  %d  median %.2f  min %.2f\n", M, P, t[reps / 2], t[0]);
    }
  }
  return 0;
}
