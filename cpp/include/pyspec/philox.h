// Philox4x32-10, the counter-based random number generator of Salmon, Moraes, Dror and Shaw,
// "Parallel random numbers: as easy as 1, 2, 3" (SC 2011).
//
// Why counter-based: acceptance sampling must give a request the same random numbers whatever else
// is in its batch and whichever thread or device runs it. With Philox a draw is a pure function of
// (key, counter): the key is the request's seed and the counter names the draw (step offset, tree
// node, draw index), so there is no generator state to carry or split.
//
// Header-only and free of CUDA types so that host code and (later) device kernels share one
// definition; PYSPEC_HOST_DEVICE expands to __host__ __device__ under nvcc.
#pragma once

#include <cstdint>

#if defined(__CUDACC__)
#define PYSPEC_HOST_DEVICE __host__ __device__
#else
#define PYSPEC_HOST_DEVICE
#endif

namespace pyspec {

struct PhiloxCounter {
  uint32_t v[4];
};
struct PhiloxKey {
  uint32_t v[2];
};

namespace philox_detail {
constexpr uint32_t kMul0 = 0xD2511F53u;
constexpr uint32_t kMul1 = 0xCD9E8D57u;
constexpr uint32_t kWeyl0 = 0x9E3779B9u;  // golden ratio
constexpr uint32_t kWeyl1 = 0xBB67AE85u;  // sqrt(3) - 1

PYSPEC_HOST_DEVICE inline void MulHiLo(uint32_t a, uint32_t b, uint32_t* hi, uint32_t* lo) {
  const uint64_t p = static_cast<uint64_t>(a) * static_cast<uint64_t>(b);
  *hi = static_cast<uint32_t>(p >> 32);
  *lo = static_cast<uint32_t>(p);
}
}  // namespace philox_detail

// One Philox4x32 block with 10 rounds: four independent 32-bit outputs for (counter, key).
// Matches the Random123 reference (its known-answer vectors are in tests/cpp/test_acceptance.cc).
PYSPEC_HOST_DEVICE inline PhiloxCounter Philox4x32_10(PhiloxCounter ctr, PhiloxKey key) {
  using namespace philox_detail;
  for (int round = 0; round < 10; ++round) {
    if (round > 0) {
      key.v[0] += kWeyl0;
      key.v[1] += kWeyl1;
    }
    uint32_t hi0, lo0, hi1, lo1;
    MulHiLo(kMul0, ctr.v[0], &hi0, &lo0);
    MulHiLo(kMul1, ctr.v[2], &hi1, &lo1);
    PhiloxCounter next;
    next.v[0] = hi1 ^ ctr.v[1] ^ key.v[0];
    next.v[1] = lo1;
    next.v[2] = hi0 ^ ctr.v[3] ^ key.v[1];
    next.v[3] = lo0;
    ctr = next;
  }
  return ctr;
}

// A uniform double in [0, 1) from all 32 bits of one output word (exact: k / 2^32).
PYSPEC_HOST_DEVICE inline double UniformFromBits(uint32_t bits) {
  return static_cast<double>(bits) * (1.0 / 4294967296.0);
}

// The draws of one request: key = the 64-bit seed, counter = (position lo, position hi, stream,
// draw / 4), and draw d uses output word d % 4 of that block. Acceptance keys its draws by the
// sequence position of the token being decided (so a request's draws do not depend on how its
// tokens were split into steps) and uses two streams per position: kDrawSample for the token
// sampled there (plain decoding, the target-only walk, a recovered or bonus token) and
// kDrawChildTest for the accept/reject tests of sampled draft children (draw = child index).
constexpr uint32_t kDrawSample = 0;
constexpr uint32_t kDrawChildTest = 1;

PYSPEC_HOST_DEVICE inline double PhiloxUniform(uint64_t seed, uint64_t position, uint32_t stream,
                                               uint32_t draw) {
  PhiloxKey key{{static_cast<uint32_t>(seed), static_cast<uint32_t>(seed >> 32)}};
  PhiloxCounter ctr{{static_cast<uint32_t>(position), static_cast<uint32_t>(position >> 32),
                     stream, draw >> 2}};
  return UniformFromBits(Philox4x32_10(ctr, key).v[draw & 3]);
}

}  // namespace pyspec
