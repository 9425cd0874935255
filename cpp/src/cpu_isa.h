// Run-time choice between the builds of a CPU kernel: generic (SSE2 baseline), AVX2+FMA and, where a
// unit has one, AVX-512.
//
// Kernels are compiled several times (plain and with __attribute__((target(...)))) so the library
// runs on any x86-64 and uses the widest vectors the CPU has. Which build runs is chosen per call,
// never per process: a model's LinearKernels (pyspec/linear.h) for its dense layers, tree
// attention and the engine's sampling filters (these two at most AVX-512); calls without one (a
// drafter's own filters, the greedy walk's scan, which give the same bits in every build) run
// this CPU's widest.
#pragma once

#include <string>

#include "pyspec/check.h"

#if defined(__x86_64__) || defined(__i386__)
#define PYSPEC_X86 1
#endif

namespace pyspec {
namespace detail {

inline bool CpuHasAvx2() {
#ifdef PYSPEC_X86
  __builtin_cpu_init();
  // F16C (float16 conversion) came before AVX2 on every x86 CPU; the AVX2 builds use it.
  return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") &&
         __builtin_cpu_supports("f16c");
#else
  return false;
#endif
}

inline bool CpuHasAvx512() {
#ifdef PYSPEC_X86
  __builtin_cpu_init();
  return CpuHasAvx2() && __builtin_cpu_supports("avx512f");
#else
  return false;
#endif
}

// Vector ISA levels of the kernel units' builds.
inline constexpr int kIsaGeneric = 0;
inline constexpr int kIsaAvx2 = 1;
inline constexpr int kIsaAvx512 = 2;

// The widest level this CPU runs (asked once).
inline int CpuIsaLevel() {
  static const int level = CpuHasAvx512() ? kIsaAvx512 : CpuHasAvx2() ? kIsaAvx2 : kIsaGeneric;
  return level;
}

inline const char* IsaLevelName(int level) {
  return level == kIsaAvx512 ? "avx512" : level == kIsaAvx2 ? "avx2" : "generic";
}

// The level an ISA name asks for: -1 for "auto", -2 for a name that is none of "auto", "generic",
// "avx2", "avx512" (the caller names what it allows). ValueError for a level this CPU (or build)
// lacks; `unit` names the kernel in that message.
inline int ParseIsaLevel(const std::string& isa, const char* unit) {
  if (isa == "auto") return -1;
  if (isa == "generic") return kIsaGeneric;
  if (isa == "avx2") {
    PYSPEC_CHECK(CpuHasAvx2(), "this CPU (or build) has no AVX2+FMA ", unit, " kernel");
    return kIsaAvx2;
  }
  if (isa == "avx512") {
    PYSPEC_CHECK(CpuHasAvx512(), "this CPU (or build) has no AVX-512 ", unit, " kernel");
    return kIsaAvx512;
  }
  return -2;
}

}  // namespace detail
}  // namespace pyspec
