// bfloat16 dense layer on Intel AMX tiles (internal to pyspec_core; see pyspec/linear.h).
//
// out[m, n] = sum_k x[m, k] * w[n, k] + bias[n] with the weights read in place: a tile of 16 weight
// rows x 32 k (row-major w, no repacking) is the A operand of TDPBF16PS, and the inputs, repacked
// once per call into AMX's pair-interleaved layout (16 rows per tile, zero-padded), are the B
// operand, so a C tile holds 16 outputs x 16 input rows in fp32. Every weight byte is read once per
// call for up to 64 input rows (four C tiles), and the tile units do 16 x 16 x 32 products per
// instruction, so up to a few dozen rows cost about what one row costs: the read of the weights.
// Each output is accumulated in fp32 in one fixed order (k ascending in chunks of 32) that does not
// depend on M or on the other rows, and is rounded once to bfloat16.
#pragma once

#include <cstdint>
#include <functional>

#include "cpu_isa.h"
#include "pyspec/tensor_view.h"

// AMX code is built where the compiler can emit it: x86-64 Linux, GCC >= 11 or Clang >= 12.
#if defined(PYSPEC_X86) && defined(__linux__) && defined(__x86_64__) && \
    ((defined(__clang__) && __clang_major__ >= 12) ||                     \
     (!defined(__clang__) && defined(__GNUC__) && __GNUC__ >= 11))
#define PYSPEC_HAVE_AMX 1
#endif

namespace pyspec {
class ThreadPool;

namespace detail {

// LDTILECFG's 64-byte operand (palette 1: rows and bytes per row of tiles 0-7). Defined in every
// build: the emulated tiles (AmxLinearBlocksEmulated) take the same configuration.
struct alignas(64) AmxTileConfig {
  uint8_t palette_id;
  uint8_t start_row;
  uint8_t reserved[14];
  uint16_t colsb[16];
  uint8_t rows[16];
};

// run(b0, b1) over [0, blocks) blocks of `block_bytes` weight bytes each: on the calling thread when
// they are too few to be worth waking a worker (under 96 KiB in all), else split over `pool`
// (ThreadPool::Default() when null) in chunks of at least that many bytes.
void RunBlocks(ThreadPool* pool, int64_t blocks, int64_t block_bytes,
               const std::function<void(int64_t, int64_t)>& run);

// True when the CPU has AMX-TILE, AMX-BF16, AVX-512F and AVX-512BW, the build can emit them, and
// the OS granted this process the tile data state (arch_prctl ARCH_REQ_XCOMP_PERM, asked once for
// all threads); cached.
bool AmxBf16Available();

// The layer shapes the AMX kernel takes: K a multiple of 32 and N of 16 (others run elsewhere).
inline bool AmxShapeOk(int64_t N, int64_t K) { return K > 0 && K % 32 == 0 && N % 16 == 0; }

// Elements (uint16) of the packed inputs for M rows of K.
inline int64_t AmxPackedElems(int64_t M, int64_t K) { return (M + 15) / 16 * 16 * K; }

// x [M, K] bf16 bits -> packed [M/16 chunks][K/32][16 pairs][16 rows][2], rows past M zero.
// Plain C++: every build.
void AmxPackInputs(const uint16_t* x, int64_t M, int64_t K, uint16_t* packed);

// Output blocks [b0, b1) of 16 weight rows each: out [M, N] bf16 bits, bias [N] fp32 or nullptr.
// Only where AmxBf16Available().
void AmxLinearBlocks(const uint16_t* packed, const uint16_t* w, const float* bias, uint16_t* out,
                     int64_t M, int64_t N, int64_t K, int64_t b0, int64_t b1);

// The same kernel body (one source, templated on the tile unit) on tiles emulated in plain C++:
// LDTILECFG, TILEZERO, TILELOADD, TILESTORED and TDPBF16PS as the Intel SDM specifies them (rows
// and bytes per row from the tile configuration; TDPBF16PS accumulates the even and the odd bf16
// products of each pair separately in fp32 with FMA, round to nearest even, denormal inputs as
// zero and denormal results flushed, then adds their sum to the C element). Runs on every CPU, so
// the kernel's logic (packing, tile loads and strides, the C-tile gather, bias, rounding) is
// tested everywhere; slow, for tests only.
void AmxLinearBlocksEmulated(const uint16_t* packed, const uint16_t* w, const float* bias,
                             uint16_t* out, int64_t M, int64_t N, int64_t K, int64_t b0,
                             int64_t b1);

}  // namespace detail
}  // namespace pyspec
