// Bit-exact conversions between float32 and the 16-bit float formats (IEEE binary16, bfloat16).
//
// The widening conversions are branch-free so loops over them auto-vectorize; the narrowing ones
// round to nearest even like torch's casts and are used only on outputs.
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>

namespace pyspec {
namespace half {

inline float BitsToFloat(uint32_t u) {
  float f;
  std::memcpy(&f, &u, sizeof f);
  return f;
}
inline uint32_t FloatToBits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, sizeof u);
  return u;
}

inline float BF16ToFloat(uint16_t h) { return BitsToFloat(static_cast<uint32_t>(h) << 16); }

inline uint16_t FloatToBF16(float f) {
  uint32_t u = FloatToBits(f);
  if ((u & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((u >> 16) | 0x0040u);  // NaN
  u += 0x7fffu + ((u >> 16) & 1u);
  return static_cast<uint16_t>(u >> 16);
}

// binary16 -> float32. Shifting the exponent+mantissa into float position and multiplying by
// 2^112 rebiases the exponent and normalizes subnormals exactly; Inf/NaN keep an all-ones exponent.
inline float HalfToFloat(uint16_t h) {
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  const uint32_t em = h & 0x7fffu;
  const uint32_t scaled = FloatToBits(BitsToFloat(em << 13) * 5.192296858534828e33f);  // 2^112
  const uint32_t bits = em >= 0x7c00u ? ((em << 13) | 0x7f800000u) : scaled;
  return BitsToFloat(sign | bits);
}

inline uint16_t FloatToHalf(float f) {
  uint32_t x = FloatToBits(f);
  const uint16_t sign = static_cast<uint16_t>((x >> 16) & 0x8000u);
  x &= 0x7fffffffu;
  if (x >= 0x7f800000u) return sign | (x > 0x7f800000u ? 0x7e00u : 0x7c00u);  // NaN / Inf
  if (x >= 0x477ff000u) return sign | 0x7c00u;  // rounds past 65504
  if (x < 0x38800000u) {                          // below 2^-14: subnormal or zero
    // Units of 2^-24 rounded to nearest even (the default rounding mode).
    const float units = std::nearbyint(BitsToFloat(x) * 16777216.0f);
    return sign | static_cast<uint16_t>(units);
  }
  x += 0xfffu + ((x >> 13) & 1u);
  return sign | static_cast<uint16_t>((x - (112u << 23)) >> 13);
}

}  // namespace half
}  // namespace pyspec
