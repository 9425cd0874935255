// CPU kernel builds in tests: every build runs where the CPU has it, and one it lacks is a visible
// skip, or a failure where the environment says it must be there (PYSPEC_EXPECT_ISAS=generic,avx2,
// avx512, set by .ci/run for the machines CI runs on), so no ISA path drops out unnoticed.
#pragma once

#include <gtest/gtest.h>

#include <cstdlib>
#include <optional>
#include <string>

#include "pyspec/check.h"
#include "pyspec/linear.h"

inline bool IsaExpected(const std::string& isa) {
  const char* env = std::getenv("PYSPEC_EXPECT_ISAS");
  if (env == nullptr) return false;
  const std::string list = std::string(",") + env + ",";
  return list.find("," + isa + ",") != std::string::npos;
}

// A test whose parameter names a build ("generic", "avx2", "avx512", "amx"): SetUp makes its
// LinearKernels (nothing process-wide), or skips / fails as above.
class IsaParamTest : public ::testing::TestWithParam<std::string> {
 protected:
  void SetUp() override {
    try {
      kernels_.emplace(GetParam());
    } catch (const pyspec::ValueError& e) {
      if (IsaExpected(GetParam())) {
        FAIL() << "PYSPEC_EXPECT_ISAS names " << GetParam() << ", but: " << e.what();
      }
      GTEST_SKIP() << "no " << GetParam() << " kernel on this CPU: " << e.what();
    }
  }
  const pyspec::LinearKernels* k() const { return &*kernels_; }

  std::optional<pyspec::LinearKernels> kernels_;
};
