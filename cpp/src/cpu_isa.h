// Run-time choice between the generic (SSE2-baseline) and AVX2+FMA builds of a CPU kernel.
//
// Kernels are compiled twice (plain and with __attribute__((target("avx2,fma")))) so the library
// runs on any x86-64 and uses AVX2 where the CPU has it. Each kernel unit owns one IsaSelector; its
// override exists so tests can run both builds on one machine.
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

class IsaSelector {
 public:
  static constexpr int kGeneric = 0;
  static constexpr int kAvx2 = 1;

  // The ISA in use: the override when set, else the best the CPU supports (checked once).
  int Resolved() const {
    const int isa = override_.load(std::memory_order_relaxed);
    if (isa >= 0) return isa;
    static const int best = CpuHasAvx2() ? kAvx2 : kGeneric;
    return best;
  }
  const char* Name() const { return Resolved() == kAvx2 ? "avx2" : "generic"; }

  // "auto" | "generic" | "avx2"; returns the resolved name. `unit` names the kernel in errors.
  std::string Set(const std::string& isa, const char* unit) {
    if (isa == "auto") {
      override_.store(-1);
    } else if (isa == "generic") {
      override_.store(kGeneric);
    } else if (isa == "avx2") {
      PYSPEC_CHECK(CpuHasAvx2(), "this CPU (or build) has no AVX2+FMA ", unit, " kernel");
      override_.store(kAvx2);
    } else {
      throw ValueError(StrCat("unknown ", unit, " ISA '", isa, "'; use auto, generic or avx2"));
    }
    return Name();
  }

 private:
  std::atomic<int> override_{-1};
};

}  // namespace detail
}  // namespace pyspec
