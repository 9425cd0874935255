// Sampling filters on the CPU (temperature, top-k, top-p, min-p). See acceptance.h for the
// contract; this file states the numerical choices.
//
// Numerics: every sum is accumulated in double, in a fixed order over the vocabulary (sequentially,
// or in a fixed number of lanes combined in a fixed order), so a result does not depend on the
// thread count or the instruction set.
#include "pyspec/acceptance.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <string>
#include <utility>
#include <vector>

#include "pyspec/check.h"
#include "pyspec/linear.h"
#include "pyspec/thread_pool.h"
#include "cpu_isa.h"
#include "sampling_math.h"
#include "sampling_rows.h"

namespace pyspec {
namespace {

// ---- scalar conversions ---------------------------------------------------------------------------

inline float BF16ToFloat(uint16_t h) {
  uint32_t bits = static_cast<uint32_t>(h) << 16;
  float f;
  std::memcpy(&f, &bits, sizeof(f));
  return f;
}

inline float HalfToFloat(uint16_t h) {
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  uint32_t exp = (h >> 10) & 0x1Fu;
  uint32_t mant = h & 0x3FFu;
  uint32_t bits;
  if (exp == 0x1Fu) {
    bits = sign | 0x7F800000u | (mant << 13);  // inf / nan
  } else if (exp != 0) {
    bits = sign | ((exp + 112u) << 23) | (mant << 13);  // 127 - 15 = 112
  } else if (mant == 0) {
    bits = sign;
  } else {  // subnormal: normalise
    int e = -1;
    do {
      ++e;
      mant <<= 1;
    } while ((mant & 0x400u) == 0);
    bits = sign | (static_cast<uint32_t>(112 - e) << 23) | ((mant & 0x3FFu) << 13);
  }
  float f;
  std::memcpy(&f, &bits, sizeof(f));
  return f;
}

void LoadRow(const TensorView& logits, int64_t row, int64_t vocab, float* out) {
  const int64_t base = row * vocab;
  switch (logits.dtype) {
    case DType::kFloat32:
      std::memcpy(out, logits.ptr<const float>() + base, sizeof(float) * vocab);
      break;
    case DType::kBFloat16: {
      const uint16_t* src = logits.ptr<const uint16_t>() + base;
      for (int64_t v = 0; v < vocab; ++v) out[v] = BF16ToFloat(src[v]);
      break;
    }
    case DType::kFloat16: {
      const uint16_t* src = logits.ptr<const uint16_t>() + base;
      for (int64_t v = 0; v < vocab; ++v) out[v] = HalfToFloat(src[v]);
      break;
    }
    default:
      PYSPEC_ICHECK(false, "unexpected logits dtype");
  }
}

// ---- sampling filters -----------------------------------------------------------------------------

struct Candidate {
  float w;  // unnormalised probability exp((z - zmax) / T), in (0, 1]
  int32_t id;
};
// The strict total order of the filters: larger probability first, then lower token id.
inline bool Before(const Candidate& a, const Candidate& b) {
  return a.w > b.w || (a.w == b.w && a.id < b.id);
}

// Reorders cand so that cand[0..n_keep) is the smallest prefix (in `Before` order) whose mass is
// >= target, and returns n_keep. A mass-weighted quickselect: each round partitions the live range
// around its middle position with nth_element and continues on the side that holds the crossing
// point, so the expected cost is linear in the candidate count (no full sort).
int64_t TopPPrefix(std::vector<Candidate>& cand, double target) {
  int64_t lo = 0, hi = static_cast<int64_t>(cand.size());
  double before = 0.0;  // mass of cand[0..lo), all of which come first in order
  while (hi - lo > 32) {
    const int64_t mid = lo + (hi - lo) / 2;
    std::nth_element(cand.begin() + lo, cand.begin() + mid, cand.begin() + hi, Before);
    double left = 0.0;
    for (int64_t i = lo; i < mid; ++i) left += cand[i].w;
    if (before + left >= target) {
      hi = mid;
    } else if (before + left + cand[mid].w >= target) {
      return mid + 1;
    } else {
      before += left + cand[mid].w;
      lo = mid + 1;
    }
  }
  std::sort(cand.begin() + lo, cand.begin() + hi, Before);
  for (int64_t i = lo; i < hi; ++i) {
    before += cand[i].w;
    if (before >= target) return i + 1;
  }
  // Rounding kept the running mass just under target: keep everything.
  return static_cast<int64_t>(cand.size());
}

inline int ExponentBucket(float w) {  // w in [0, 1]: the biased float exponent, 0..127
  uint32_t bits;
  std::memcpy(&bits, &w, sizeof(bits));
  return static_cast<int>(bits >> 23);
}

struct FilterScratch {
  std::vector<float> z, w;
  std::vector<Candidate> cand;
};

// Writes out[id] = w / sum(kept) for the kept candidates cand[0..n) with w >= min_w.
void WriteCandidates(const std::vector<Candidate>& cand, int64_t n, float min_w, float* out) {
  double kept = 0.0;
  for (int64_t i = 0; i < n; ++i) {
    if (cand[i].w >= min_w) kept += cand[i].w;
  }
  const double inv = 1.0 / kept;
  for (int64_t i = 0; i < n; ++i) {
    if (cand[i].w >= min_w) out[cand[i].id] = static_cast<float>(cand[i].w * inv);
  }
}

// ---- the filters' passes over a row --------------------------------------------------------------
//
// Written so that the compiler vectorises them without reassociating anything (the scan and the
// kept mass keep lanes of their own, in GCC vector types): every value is the one a scalar loop
// computes, in every build, since this file is compiled without FMA contraction (CMakeLists.txt).
// Each pass is built for the x86-64 baseline, AVX2 and AVX-512; ApplySamplingFilters runs the one
// of the LinearKernels it is given (every build gives the same bits; tests compare each build).

constexpr int kLanes = 16;

using RowScan = detail::LogitsRowScan;

#define PYSPEC_INLINE inline __attribute__((always_inline))

typedef float F16 __attribute__((vector_size(64)));
typedef int32_t I16 __attribute__((vector_size(64)));

// 16 lanes, each with its running maximum and the first index holding it (a later entry replaces
// it only when strictly greater, as a scalar scan does); the lowest index among the lanes that hold
// the overall maximum is then the row's first maximum.
PYSPEC_INLINE RowScan ScanLogits(const float* z, int64_t vocab) {
  constexpr float kInf = std::numeric_limits<float>::infinity();
  F16 m, x;
  I16 idx, at, fin, bad;
  for (int l = 0; l < kLanes; ++l) {
    m[l] = -kInf;
    idx[l] = -1;
    at[l] = l;
    fin[l] = 0;
    bad[l] = 0;
  }
  int64_t v = 0;
  for (; v + kLanes <= vocab; v += kLanes) {
    std::memcpy(&x, z + v, sizeof(x));
    const I16 gt = x > m;
    m = gt ? x : m;
    idx = gt ? at : idx;
    fin -= x != -kInf;
    bad |= ~(x < kInf);  // NaN or +inf
    at += kLanes;
  }
  RowScan r{-1, 0, false};
  float best = -kInf;
  for (int l = 0; l < kLanes; ++l) {
    r.finite += fin[l];
    r.bad |= bad[l] != 0;
    if (idx[l] >= 0 && (m[l] > best || (m[l] == best && idx[l] < r.argmax))) {
      best = m[l];
      r.argmax = idx[l];
    }
  }
  for (; v < vocab; ++v) {  // the tail, after every lane's earlier indices
    const float y = z[v];
    if (y > best) {
      best = y;
      r.argmax = v;
    }
    r.finite += y != -kInf;
    r.bad |= !(y < kInf);
  }
  return r;
}

// w[v] = exp((z[v] - zmax) / T), 0 for -inf logits (zeroed through a bit mask: GCC does not
// vectorise that select in its AVX builds).
PYSPEC_INLINE void ExpWeights(const float* z, int64_t vocab, float zmax, float inv_t, float* w) {
  constexpr float kNegInf = -std::numeric_limits<float>::infinity();
  for (int64_t v = 0; v < vocab; ++v) {
    const float e = detail::ExpNonPositive((z[v] - zmax) * inv_t);
    uint32_t bits;
    std::memcpy(&bits, &e, sizeof(bits));
    bits &= 0u - static_cast<uint32_t>(z[v] != kNegInf);
    std::memcpy(w + v, &bits, sizeof(bits));
  }
}

// Whether FilterRow keeps token v of weight w: above 0, at or above the min-p floor, and in the
// top-p prefix (before the boundary token (w_b, id_b) in (w desc, id asc) order, or it).
PYSPEC_INLINE bool Kept(float w, int64_t v, float floor_w, float w_b, int32_t id_b) {
  return (w > 0.0f) & (w >= floor_w) & ((w > w_b) | (static_cast<int32_t>(v) <= id_b));
}

typedef double D8 __attribute__((vector_size(64)));
typedef float F8 __attribute__((vector_size(32)));
typedef int32_t I8 __attribute__((vector_size(32)));

// The mass FilterRow keeps: the sum of w[v] over kept tokens, in double, in 8 lanes (token v in
// lane v % 8, the tail in a ninth) added in a fixed order: the same sum whatever the build or the
// thread count, without a sequential chain of 49k dependent additions.
PYSPEC_INLINE double KeptMass(const float* w, int64_t vocab, float floor_w, float w_b,
                              int32_t id_b) {
  D8 acc = {};
  I8 id;
  for (int l = 0; l < 8; ++l) id[l] = l;
  int64_t v = 0;
  for (; v + 8 <= vocab; v += 8) {  // vocab fits int32 (CheckFilterArgs)
    F8 x;
    std::memcpy(&x, w + v, sizeof(x));
    const I8 keep = (x > 0.0f) & (x >= floor_w) & ((x > w_b) | (id <= id_b));  // Kept, 8 lanes
    I8 bits;
    std::memcpy(&bits, &x, sizeof(bits));
    bits &= keep;
    std::memcpy(&x, &bits, sizeof(x));
    acc += __builtin_convertvector(x, D8);
    id += 8;
  }
  double tail = 0.0;
  for (; v < vocab; ++v) tail += Kept(w[v], v, floor_w, w_b, id_b) ? w[v] : 0.0f;
  return (((acc[0] + acc[1]) + (acc[2] + acc[3])) + ((acc[4] + acc[5]) + (acc[6] + acc[7]))) +
         tail;
}

// out[v] = w[v] * inv where FilterRow keeps token v, else 0.
PYSPEC_INLINE void WriteKept(const float* w, int64_t vocab, float floor_w, float w_b, int32_t id_b,
                             float inv, float* out) {
  for (int64_t v = 0; v < vocab; ++v) {
    out[v] = Kept(w[v], v, floor_w, w_b, id_b) ? w[v] * inv : 0.0f;
  }
}

struct FilterPasses {
  RowScan (*scan)(const float*, int64_t);
  void (*exp)(const float*, int64_t, float, float, float*);
  double (*kept)(const float*, int64_t, float, float, int32_t);
  void (*write)(const float*, int64_t, float, float, int32_t, float, float*);
};

// One build of the four passes per instruction set.
#define PYSPEC_FILTER_BUILD(NAME, ATTR)                                                            \
  ATTR RowScan ScanLogits##NAME(const float* z, int64_t n) { return ScanLogits(z, n); }          \
  ATTR void ExpWeights##NAME(const float* z, int64_t n, float zmax, float inv_t, float* w) {     \
    ExpWeights(z, n, zmax, inv_t, w);                                                            \
  }                                                                                              \
  ATTR double KeptMass##NAME(const float* w, int64_t n, float floor_w, float w_b, int32_t id_b) { \
    return KeptMass(w, n, floor_w, w_b, id_b);                                                   \
  }                                                                                              \
  ATTR void WriteKept##NAME(const float* w, int64_t n, float floor_w, float w_b, int32_t id_b,   \
                            float inv, float* out) {                                             \
    WriteKept(w, n, floor_w, w_b, id_b, inv, out);                                               \
  }                                                                                              \
  constexpr FilterPasses k##NAME##Passes{&ScanLogits##NAME, &ExpWeights##NAME, &KeptMass##NAME,  \
                                         &WriteKept##NAME};

PYSPEC_FILTER_BUILD(Generic, )
#ifdef PYSPEC_X86
PYSPEC_FILTER_BUILD(Avx2, __attribute__((target("avx2,fma"))))
PYSPEC_FILTER_BUILD(Avx512, __attribute__((target("avx512f,avx2,fma"))))
#endif
#undef PYSPEC_FILTER_BUILD

// The vector build of `kernels` (a model's; nullptr: this CPU's best), AVX-512 at most.
int PassLevel(const LinearKernels* kernels) {
  const int level = kernels != nullptr ? kernels->level() : detail::CpuIsaLevel();
  return std::min(level, detail::kIsaAvx512);
}

FilterPasses Passes(const LinearKernels* kernels = nullptr) {
#ifdef PYSPEC_X86
  const int level = PassLevel(kernels);
  if (level >= detail::kIsaAvx512) return kAvx512Passes;
  if (level >= detail::kIsaAvx2) return kAvx2Passes;
#endif
  (void)kernels;
  return kGenericPasses;
}

// `scan` of logits row `row` (`z`), or ValueError naming what is wrong with the row.
const RowScan& CheckScan(const RowScan& scan, const float* z, int64_t vocab, int64_t row) {
  if (scan.bad) {
    for (int64_t v = 0; v < vocab; ++v) {
      PYSPEC_CHECK(!std::isnan(z[v]) && z[v] != std::numeric_limits<float>::infinity(),
                   "'logits' row ", row, " has a NaN or +inf entry at token ", v);
    }
  }
  PYSPEC_CHECK(scan.argmax >= 0, "'logits' row ", row, " has no finite entry (all -inf)");
  return scan;
}

void FilterRow(const FilterPasses& passes, const TensorView& logits, int64_t row, int64_t vocab,
               float temperature, int32_t top_k, float top_p, float min_p, float* out,
               FilterScratch& s) {
  float* z = s.z.data();
  LoadRow(logits, row, vocab, z);
  const RowScan scan = CheckScan(passes.scan(z, vocab), z, vocab, row);
  const int64_t argmax = scan.argmax;
  const float zmax = z[argmax];
  const int64_t num_finite = scan.finite;
  const float inv_t = 1.0f / temperature;
  if (temperature == 0.0f || !std::isfinite(inv_t)) {  // a subnormal T is greedy too
    std::fill(out, out + vocab, 0.0f);
    out[argmax] = 1.0f;
    return;
  }
  const float min_w = min_p;  // min-p: the largest weight is exp(0) = 1 and is always kept

  if (top_k > 0 && top_k < num_finite) {
    // Top-k on the logits (temperature keeps the order). Exactly k survive: every value above the
    // k-th largest, then the lowest ids among the values equal to it. Only k exps are computed.
    float* sel = s.w.data();
    std::copy(z, z + vocab, sel);
    std::nth_element(sel, sel + (top_k - 1), sel + vocab, std::greater<float>());
    const float kth = sel[top_k - 1];
    int64_t above = 0;
    for (int64_t i = 0; i < top_k - 1; ++i) above += (sel[i] > kth);
    int64_t ties_left = top_k - above;
    s.cand.clear();
    for (int64_t v = 0; v < vocab; ++v) {
      if (z[v] > kth || (z[v] == kth && ties_left-- > 0)) {
        s.cand.push_back({detail::ExpNonPositive((z[v] - zmax) * inv_t), static_cast<int32_t>(v)});
      }
    }
    int64_t n = static_cast<int64_t>(s.cand.size());
    if (top_p < 1.0f) {
      double total = 0.0;
      for (const Candidate& c : s.cand) total += c.w;
      n = TopPPrefix(s.cand, static_cast<double>(top_p) * total);
    }
    std::fill(out, out + vocab, 0.0f);
    WriteCandidates(s.cand, n, min_w, out);
    return;
  }

  // Dense path: weights for the whole vocabulary (-inf logits get weight 0).
  float* w = s.w.data();
  passes.exp(z, vocab, zmax, inv_t, w);
  // Top-p boundary: the last kept token (w_b, id_b) in (w desc, id asc) order. Masses per float
  // exponent bucket locate the bucket that crosses top_p; only that bucket (values within a factor
  // of 2) goes through the quickselect.
  float w_b = 0.0f;
  int32_t id_b = std::numeric_limits<int32_t>::max();
  if (top_p < 1.0f) {
    // Four interleaved histograms: neighbouring tokens often share a bucket, and one histogram
    // would serialise on its read-modify-write.
    double hist[4][128] = {};
    int64_t v = 0;
    for (; v + 4 <= vocab; v += 4) {
      for (int i = 0; i < 4; ++i) hist[i][ExponentBucket(w[v + i])] += w[v + i];
    }
    for (; v < vocab; ++v) hist[0][ExponentBucket(w[v])] += w[v];
    double bucket[128];
    double total = 0.0;
    for (int e = 127; e >= 0; --e) {
      bucket[e] = (hist[0][e] + hist[1][e]) + (hist[2][e] + hist[3][e]);
      total += bucket[e];
    }
    const double target = static_cast<double>(top_p) * total;
    double above = 0.0;
    int cross = -1;
    for (int e = 127; e >= 1; --e) {
      if (above + bucket[e] >= target) {
        cross = e;
        break;
      }
      above += bucket[e];
    }
    if (cross >= 0) {
      s.cand.clear();
      for (int64_t v = 0; v < vocab; ++v) {
        if (ExponentBucket(w[v]) == cross) s.cand.push_back({w[v], static_cast<int32_t>(v)});
      }
      const int64_t n = TopPPrefix(s.cand, target - above);
      // The boundary is the latest of the kept prefix in (w desc, id asc) order.
      Candidate last = s.cand[0];
      for (int64_t i = 1; i < n; ++i) {
        if (Before(last, s.cand[i])) last = s.cand[i];
      }
      w_b = last.w;
      id_b = last.id;
    }
  }
  const float floor_w = std::max(min_w, w_b);
  const double kept = passes.kept(w, vocab, floor_w, w_b, id_b);
  const float inv = static_cast<float>(1.0 / kept);
  passes.write(w, vocab, floor_w, w_b, id_b, inv, out);
}

}  // namespace

namespace detail {
LogitsRowScan ScanLogitsRow(const float* z, int64_t vocab) { return Passes().scan(z, vocab); }

LogitsRowScan CheckedScanLogitsRow(const float* z, int64_t vocab, int64_t row) {
  return CheckScan(Passes().scan(z, vocab), z, vocab, row);
}
}  // namespace detail

namespace detail {
void CheckFilterArgs(const TensorView& logits, const TensorView& temperature,
                     const TensorView& top_k, const TensorView& top_p, const TensorView& min_p,
                     const TensorView& probs, DeviceType device, const FilterParams& params) {
  const std::pair<const TensorView*, const char*> all[] = {
      {&temperature, "temperature"}, {&top_k, "top_k"}, {&top_p, "top_p"}, {&min_p, "min_p"},
      {&probs, "probs"}};
  CheckDevice(logits, "logits", device);
  for (const auto& t : all) CheckSameDevice(logits, "logits", *t.first, t.second);
  CheckDType(logits, "logits", {DType::kFloat32, DType::kFloat16, DType::kBFloat16});
  CheckDType(temperature, "temperature", {DType::kFloat32});
  CheckDType(top_k, "top_k", {DType::kInt32});
  CheckDType(top_p, "top_p", {DType::kFloat32});
  CheckDType(min_p, "min_p", {DType::kFloat32});
  CheckDType(probs, "probs", {DType::kFloat32});
  CheckShape(logits, "logits", {-1, -1});
  const int64_t rows = logits.shape[0], vocab = logits.shape[1];
  PYSPEC_CHECK(vocab >= 1, "'logits' needs a vocabulary of at least 1; got ", logits.ShapeString());
  PYSPEC_CHECK(vocab <= std::numeric_limits<int32_t>::max(), "'logits' vocabulary is too large");
  CheckShape(probs, "probs", {rows, vocab});
  CheckContiguous(logits, "logits");
  CheckContiguous(probs, "probs");
  for (const auto& t : all) {
    if (t.first == &probs) continue;
    CheckShape(*t.first, t.second, {rows});
    CheckContiguous(*t.first, t.second);
  }
  const float* temp = params.temperature ? params.temperature : temperature.ptr<const float>();
  const int32_t* k = params.top_k ? params.top_k : top_k.ptr<const int32_t>();
  const float* tp = params.top_p ? params.top_p : top_p.ptr<const float>();
  const float* mp = params.min_p ? params.min_p : min_p.ptr<const float>();
  for (int64_t r = 0; r < rows; ++r) {
    PYSPEC_CHECK(std::isfinite(temp[r]) && temp[r] >= 0.0f, "'temperature'[", r, "] = ", temp[r],
                 " must be finite and >= 0 (0 = greedy)");
    PYSPEC_CHECK(k[r] >= 0, "'top_k'[", r, "] = ", k[r], " must be >= 0 (0 = off)");
    PYSPEC_CHECK(tp[r] > 0.0f && tp[r] <= 1.0f, "'top_p'[", r, "] = ", tp[r],
                 " must be in (0, 1] (1 = off)");
    PYSPEC_CHECK(mp[r] >= 0.0f && mp[r] <= 1.0f, "'min_p'[", r, "] = ", mp[r],
                 " must be in [0, 1] (0 = off)");
  }
}
}  // namespace detail

namespace detail {
std::string SamplingIsa(const LinearKernels* kernels) {
  return detail::IsaLevelName(PassLevel(kernels));
}
}  // namespace detail

void ApplySamplingFilters(const TensorView& logits, const TensorView& temperature,
                          const TensorView& top_k, const TensorView& top_p, const TensorView& min_p,
                          const TensorView& probs, ThreadPool* pool,
                          const LinearKernels* kernels) {
  detail::CheckFilterArgs(logits, temperature, top_k, top_p, min_p, probs, DeviceType::kCPU, {});
  const int64_t rows = logits.shape[0], vocab = logits.shape[1];
  const float* temp = temperature.ptr<const float>();
  const int32_t* k = top_k.ptr<const int32_t>();
  const float* tp = top_p.ptr<const float>();
  const float* mp = min_p.ptr<const float>();
  float* out = probs.ptr<float>();
  ThreadPool& tp_pool = pool ? *pool : ThreadPool::Default();
  const FilterPasses passes = Passes(kernels);
  tp_pool.ParallelFor(rows, 1, [&](int64_t begin, int64_t end) {
    // Reused across calls: two fresh vocabulary-sized buffers per call cost page faults.
    thread_local FilterScratch s;
    if (static_cast<int64_t>(s.z.size()) < vocab) {
      s.z.resize(vocab);
      s.w.resize(vocab);
    }
    for (int64_t r = begin; r < end; ++r) {
      FilterRow(passes, logits, r, vocab, temp[r], k[r], tp[r], mp[r], out + r * vocab, s);
    }
  });
}

}  // namespace pyspec
