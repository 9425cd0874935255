// Run-time choice between the builds of a CPU kernel: generic (SSE2 baseline), AVX2+FMA and, where a
// unit has one, AVX-512.
//
// Kernels are compiled several times (plain and with __attribute__((target(...)))) so the library
// runs on any x86-64 and uses the widest vectors the CPU has. Each kernel unit owns one IsaSelector
// that knows the widest build the unit has; its override exists so tests can run every build.
#pragma once

#include <atomic>
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
  return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
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

class IsaSelector {
 public:
  static constexpr int kGeneric = 0;
  static constexpr int kAvx2 = 1;
  static constexpr int kAvx512 = 2;

  // `widest`: the widest build this unit has.
  explicit IsaSelector(int widest) : widest_(widest) {}

  // The build in use: the override when set, else the widest the CPU and the unit support.
  int Resolved() const {
    const int isa = override_.load(std::memory_order_relaxed);
    if (isa >= 0) return isa;
    static const int cpu = CpuHasAvx512() ? kAvx512 : CpuHasAvx2() ? kAvx2 : kGeneric;
    return cpu < widest_ ? cpu : widest_;
  }
  const char* Name() const {
    const int isa = Resolved();
    return isa == kAvx512 ? "avx512" : isa == kAvx2 ? "avx2" : "generic";
  }

  // "auto" | "generic" | "avx2" | "avx512"; returns the resolved name. `unit` names the kernel in
  // errors.
  std::string Set(const std::string& isa, const char* unit) {
    if (isa == "auto") {
      override_.store(-1);
    } else if (isa == "generic") {
      override_.store(kGeneric);
    } else if (isa == "avx2") {
      PYSPEC_CHECK(CpuHasAvx2(), "this CPU (or build) has no AVX2+FMA ", unit, " kernel");
      override_.store(kAvx2);
    } else if (isa == "avx512" && widest_ >= kAvx512) {
      PYSPEC_CHECK(CpuHasAvx512(), "this CPU (or build) has no AVX-512 ", unit, " kernel");
      override_.store(kAvx512);
    } else {
      throw ValueError(StrCat("unknown ", unit, " ISA '", isa, "'; use auto, generic, avx2",
                              widest_ >= kAvx512 ? " or avx512" : " (no avx512 build)"));
    }
    return Name();
  }

 private:
  const int widest_;
  std::atomic<int> override_{-1};
};

}  // namespace detail
}  // namespace pyspec
