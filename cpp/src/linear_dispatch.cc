// Kernel routing for dense layers (pyspec/linear.h, LinearKernels): which build of the kernels
// runs, and which route a call of a given size takes. One object per model: nothing here is
// process-wide state.
#include <algorithm>
#include <functional>
#include <string>

#include "cpu_isa.h"
#include "linear_amx.h"
#include "linear_kernel.h"
#include "pyspec/check.h"
#include "pyspec/linear.h"
#include "pyspec/thread_pool.h"

namespace pyspec {
namespace {

bool CpuHasAvx512Bf16() {
#ifdef PYSPEC_X86
  __builtin_cpu_init();
  return __builtin_cpu_supports("avx512bf16");
#else
  return false;
#endif
}

}  // namespace

namespace linear_kernel {

Kernel SelectKernel(DType dtype, const LinearKernels& kernels) {
#ifdef PYSPEC_X86
  const int isa = kernels.level();
  if (isa >= detail::kIsaAvx512) {
    if (dtype != DType::kBFloat16) return {&RunBlocksAvx512, 32, false};
    static const bool bf16_dot = CpuHasAvx512Bf16();
    if (bf16_dot) return {&RunBlocksAvx512, 32, true};
  }
  if (isa >= detail::kIsaAvx2) return {&RunBlocksAvx2, 16, false};
#else
  (void)dtype;
  (void)kernels;
#endif
  return {&RunBlocksGeneric, 8, false};
}

bool UseAmx(DType dtype, const LinearKernels& kernels) {
  return dtype == DType::kBFloat16 && kernels.amx_bf16();
}

}  // namespace linear_kernel

LinearKernels::LinearKernels(const std::string& isa) {
  // (the dense kernel has generic, AVX2 and AVX-512 builds, and AMX tiles for bfloat16)
  if (isa == "amx") {
    PYSPEC_CHECK(detail::AmxBf16Available(), "this CPU, OS or build has no AMX-BF16 linear "
                 "kernel; use auto, generic, avx2 or avx512");
    level_ = detail::kIsaAvx512;
    amx_ = true;
  } else {
    const int level = detail::ParseIsaLevel(isa, "linear");
    if (level == -2) {
      throw ValueError(detail::StrCat("unknown linear kernel ISA '", isa, "'; use auto, generic, "
                                      "avx2, avx512 or amx"));
    }
    level_ = level >= 0 ? level : detail::CpuIsaLevel();
    amx_ = level < 0 && level_ >= detail::kIsaAvx512 && detail::AmxBf16Available();
  }
  // Rows up to which this kernel beats torch's GEMM (which blocks over M), measured on the
  // SmolLM2-135M shapes with 2 threads (bench/bench_linear.py --rows; docs/kernels.md): float32
  // stays ahead at every M up to 64 in the AVX2 and AVX-512 builds; bfloat16 through vdpbf16ps
  // clearly up to 16, level with torch at 32-64, widened to fp32 (AVX2) only up to 8; float16
  // (widened) ahead from 8 rows on; bfloat16 on AMX tiles up to 64 (behind torch from 96). Up to
  // the limit every row is computed alike, so a draft tree of that many nodes is scored exactly
  // as plain decoding scores its rows.
  fast_rows_[0] = Kernel(DType::kFloat32) == "generic" ? 16 : 64;
  const std::string bf16 = Kernel(DType::kBFloat16);
  fast_rows_[1] = bf16 == "amx-bf16" ? 64 : bf16 == "avx512-bf16" ? 32 : 8;
  fast_rows_[2] = Kernel(DType::kFloat16) == "generic" ? 8 : 64;
}

const LinearKernels& LinearKernels::Default() {
  static const LinearKernels k("auto");
  return k;
}

std::string LinearKernels::isa() const { return amx_ ? "amx" : detail::IsaLevelName(level_); }

std::string LinearKernels::Kernel(DType dtype) const {
  if (linear_kernel::UseAmx(dtype, *this)) return "amx-bf16";
  const linear_kernel::Kernel k = linear_kernel::SelectKernel(dtype, *this);
  if (k.dot) return "avx512-bf16";
#ifdef PYSPEC_X86
  if (k.fn == &linear_kernel::RunBlocksAvx512) return "avx512";
  if (k.fn == &linear_kernel::RunBlocksAvx2) return "avx2";
#endif
  return "generic";
}

int64_t LinearKernels::MaxFastRows(DType dtype) const {
  switch (dtype) {
    case DType::kFloat32: return fast_rows_[0];
    case DType::kBFloat16: return fast_rows_[1];
    case DType::kFloat16: return fast_rows_[2];
    default: return 0;
  }
}

int64_t LinearKernels::PackedMaxRows() const {
  // Measured on the SmolLM2-135M shapes, 2 threads (one decoding step's dense layers): the AVX-512
  // codes beat the float32 matrix up to 32 rows (level at 32, behind at 64); the AVX2 build's 16
  // registers hold fewer rows per rebuilt weight, and it is behind from 8 rows.
  if (level_ >= detail::kIsaAvx512) return 32;
  if (level_ >= detail::kIsaAvx2) return 4;
  return 0;
}

LinearKernels::Route LinearKernels::DenseRoute(DType dtype, int64_t rows) const {
  return rows <= MaxFastRows(dtype) ? Route::kLinear : Route::kGemm;
}

int64_t LinearKernels::PackedRowsLimit(bool has_dense) const {
  // With the float32 matrix beside them, the codes where they beat it; alone, wherever the core
  // kernel runs at all (the same bits either way).
  const int64_t fast = MaxFastRows(DType::kFloat32);
  return !PackedAvailable() ? 0 : has_dense ? std::min(PackedMaxRows(), fast) : fast;
}

LinearKernels::Route LinearKernels::PackedRoute(int64_t rows, bool has_dense) const {
  if (rows >= 1 && rows <= PackedRowsLimit(has_dense)) return Route::kPacked;
  return DenseRoute(DType::kFloat32, rows);
}

namespace detail {

void RunBlocks(ThreadPool* pool, int64_t blocks, int64_t block_bytes,
               const std::function<void(int64_t, int64_t)>& run) {
  const int64_t grain =
      std::max<int64_t>(1, linear_kernel::kMinChunkBytes / std::max<int64_t>(1, block_bytes));
  if (blocks <= grain) {
    run(0, blocks);
    return;
  }
  (pool != nullptr ? *pool : ThreadPool::Default()).ParallelFor(blocks, grain, run);
}

}  // namespace detail
}  // namespace pyspec
