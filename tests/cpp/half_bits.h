// 16-bit float storage helpers shared by the tests of the kernels that take float16/bfloat16.
#pragma once

#include <cstdint>
#include <cstring>

#include "../../cpp/src/half.h"
#include "pyspec/tensor_view.h"

namespace pyspec {
namespace testing_util {

// A float32 value's bits (for bit-for-bit comparisons of float32 results).
inline uint32_t F32Bits(float v) {
  uint32_t u;
  std::memcpy(&u, &v, sizeof u);
  return u;
}

// v rounded to `dt` (bfloat16 or float16), as its bits.
inline uint16_t ToBits(float v, DType dt) {
  return dt == DType::kBFloat16 ? half::FloatToBF16(v) : half::FloatToHalf(v);
}
inline float FromBits(uint16_t b, DType dt) {
  return dt == DType::kBFloat16 ? half::BF16ToFloat(b) : half::HalfToFloat(b);
}

}  // namespace testing_util
}  // namespace pyspec
