// Scalar math shared by the CPU sampling filters and their CUDA kernels, so both compute the same
// weights bit for bit (the CUDA file is compiled without FMA contraction for this reason).
#pragma once

#include <cstdint>
#include <cstring>

#include "pyspec/philox.h"  // PYSPEC_HOST_DEVICE

namespace pyspec {
namespace detail {

// exp(x) for x <= 0 (inputs below -87 are clamped), branch-free so that loops over it vectorise.
// Cody-Waite reduction x = n ln2 + r, |r| <= ln2 / 2, and a degree-6 Taylor polynomial: relative
// error about 2e-7, below float32 probability resolution that matters here.
PYSPEC_HOST_DEVICE inline float ExpNonPositive(float x) {
  x = x < -87.0f ? -87.0f : x;
  const float nf = static_cast<float>(static_cast<int32_t>(x * 1.44269504f - 0.5f));  // round
  float r = x - nf * 0.693145751953125f;
  r = r - nf * 1.428606765330187e-06f;
  float poly = 1.0f / 720.0f;
  poly = poly * r + 1.0f / 120.0f;
  poly = poly * r + 1.0f / 24.0f;
  poly = poly * r + 1.0f / 6.0f;
  poly = poly * r + 0.5f;
  poly = poly * r + 1.0f;
  poly = poly * r + 1.0f;
  const uint32_t bits = static_cast<uint32_t>(static_cast<int32_t>(nf) + 127) << 23;
  float scale;
  std::memcpy(&scale, &bits, sizeof(scale));
  return poly * scale;
}

}  // namespace detail
}  // namespace pyspec
