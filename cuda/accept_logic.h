// The per-row logic of the CUDA sampling filters and the per-request logic of CUDA tree acceptance,
// written once against a small "row operations" interface so that the same code runs
//   * on the GPU, one thread block per row / request, with block-wide reductions and scans
//     (BlockRowOps in acceptance.cuh), and
//   * on the host with serial loops (SerialRowOps below), where tests/cpp/test_cuda_logic.cc
//     compares it with the CPU ops (pyspec/acceptance.h) on machines without a GPU.
//
// Semantics are those of the CPU ops; the algorithms differ where a GPU needs them to:
//   * top-k and top-p never sort: the k-th largest logit and the top-p boundary are found by
//     radix selection (four passes of 8-bit histograms over order-preserving keys; for top-p the
//     histograms carry probability mass), and ties at the boundary are broken by token id with an
//     ordered count (NthTrue), exactly as the CPU filters break them;
//   * the walk stores its residual and draft rows in double like the CPU walk, reads the same
//     Philox draws and samples by inverse CDF. Sums are accumulated in a different order than the
//     CPU's sequential sums, so a decision differs from the CPU's only when a uniform draw lands
//     within rounding (~1e-16 relative) of a boundary.
// Row operations every implementation provides (results are returned to every thread):
//   double SumD(n, f)              sum of f(v) (double) over v in [0, n)
//   int64_t CountIf(n, pred)
//   bool AnyOf(n, pred)
//   void ArgMaxFirst(n, f, &best, &idx)   float max of f(v), lowest index among equal maxima
//   void ForEach(n, f)             f(v) for every v (element-wise writes), then a barrier
//   int64_t NthTrue(n, pred, k)    the k-th (0-based, index order) v with pred(v); -1 if fewer
//   int64_t SampleCdf(n, w, target)  first v with w(v) > 0 and w(0) + .. + w(v) > target; else
//                                    the last v with w(v) > 0; -1 if none
//   void Histogram(n, digit, mass, counts[256], masses[256])  digit(v) in [-1, 256) (-1 = skip);
//                                  mass(v) in [0, 1]; the masses are exact to 2^-40 per entry
//                                  and independent of timing on the GPU (fixed-point sums)
//   bool Leader()                  true in exactly one thread (for scalar writes)
#pragma once

#include <cstdint>
#include <cstring>

#include "pyspec/philox.h"
#include "sampling_math.h"

namespace pyspec {
namespace accept_logic {

#define PYSPEC_LOGIC_HD PYSPEC_HOST_DEVICE

// ---- float keys --------------------------------------------------------------------------------

PYSPEC_LOGIC_HD inline uint32_t FloatBits(float x) {
  uint32_t u;
  std::memcpy(&u, &x, sizeof(u));
  return u;
}
PYSPEC_LOGIC_HD inline float BitsFloat(uint32_t u) {
  float x;
  std::memcpy(&x, &u, sizeof(x));
  return x;
}
// Unsigned key with the order of the floats (NaN excluded).
PYSPEC_LOGIC_HD inline uint32_t OrderedKey(float x) {
  const uint32_t u = FloatBits(x);
  return (u & 0x80000000u) ? ~u : (u | 0x80000000u);
}
PYSPEC_LOGIC_HD inline float KeyToFloat(uint32_t k) {
  return BitsFloat((k & 0x80000000u) ? (k & 0x7FFFFFFFu) : ~k);
}
PYSPEC_LOGIC_HD inline bool IsNan(float x) { return x != x; }
PYSPEC_LOGIC_HD inline bool IsPosInf(float x) { return x > 3.402823466e38f; }
PYSPEC_LOGIC_HD inline bool IsNegInf(float x) { return x < -3.402823466e38f; }

// Radix selection of the key K with count(key > K) < k <= count(key >= K) among the v with
// in_set(v), keys given by key(v) (k >= 1 and at most the set's size). Four passes of 8 bits.
template <class Ops, class KeyFn, class InSet>
PYSPEC_LOGIC_HD uint32_t SelectKthLargestKey(Ops& ops, int64_t n, KeyFn key, InSet in_set,
                                             int64_t k, uint32_t* counts, double* masses) {
  uint32_t prefix = 0, prefix_mask = 0;
  for (int shift = 24; shift >= 0; shift -= 8) {
    ops.Histogram(
        n,
        [&](int64_t v) -> int {
          if (!in_set(v)) return -1;
          const uint32_t kv = key(v);
          return (kv & prefix_mask) == prefix ? static_cast<int>((kv >> shift) & 0xFFu) : -1;
        },
        [&](int64_t) { return 0.0; }, counts, masses);
    int64_t above = 0;
    int bin = 255;
    for (; bin > 0; --bin) {
      if (above + counts[bin] >= k) break;
      above += counts[bin];
    }
    k -= above;
    prefix |= static_cast<uint32_t>(bin) << shift;
    prefix_mask |= 0xFFu << shift;
  }
  return prefix;
}

// ---- sampling filters ---------------------------------------------------------------------------

enum FilterStatus : int { kFilterOk = 0, kFilterBadValue = 1, kFilterNoFinite = 2 };

// One row of pyspec::ApplySamplingFilters (see acceptance.h for the order and tie rules).
// z(v): the logit as float. w: [V] scratch, may be `out`. counts/masses: 256-entry scratch.
// Returns a FilterStatus; *bad_index receives the first offending token for kFilterBadValue.
template <class Ops, class ZFn>
PYSPEC_LOGIC_HD int FilterRow(Ops& ops, int64_t V, ZFn z, float temperature, int32_t top_k,
                              float top_p, float min_p, float* out, float* w, uint32_t* counts,
                              double* masses, int64_t* bad_index) {
  auto bad = [&](int64_t v) {
    const float x = z(v);
    return IsNan(x) || IsPosInf(x);
  };
  if (ops.AnyOf(V, bad)) {
    *bad_index = ops.NthTrue(V, bad, 0);
    return kFilterBadValue;
  }
  float zmax = 0.0f;
  int64_t argmax = -1;
  ops.ArgMaxFirst(V, z, &zmax, &argmax);
  if (IsNegInf(zmax)) return kFilterNoFinite;
  const float inv_t = 1.0f / temperature;
  if (temperature == 0.0f || IsPosInf(inv_t)) {  // a subnormal T is greedy too
    ops.ForEach(V, [&](int64_t v) { out[v] = v == argmax ? 1.0f : 0.0f; });
    return kFilterOk;
  }
  const int64_t num_finite = ops.CountIf(V, [&](int64_t v) { return !IsNegInf(z(v)); });
  ops.ForEach(V, [&](int64_t v) {
    const float x = z(v);
    w[v] = IsNegInf(x) ? 0.0f : detail::ExpNonPositive((x - zmax) * inv_t);
  });
  if (top_k > 0 && top_k < num_finite) {
    // Exactly k survive: every logit above the k-th largest, then the lowest ids equal to it.
    const uint32_t kth_key = SelectKthLargestKey(
        ops, V, [&](int64_t v) { return OrderedKey(z(v)); }, [](int64_t) { return true; }, top_k,
        counts, masses);
    const float kth = KeyToFloat(kth_key);
    const int64_t above = ops.CountIf(V, [&](int64_t v) { return z(v) > kth; });
    const int64_t last_tie =
        ops.NthTrue(V, [&](int64_t v) { return z(v) == kth; }, top_k - above - 1);
    ops.ForEach(V, [&](int64_t v) {
      const float x = z(v);
      if (!(x > kth || (x == kth && v <= last_tie))) w[v] = 0.0f;
    });
  }
  // Top-p boundary (w_b, id_b): the last kept token in (w desc, id asc) order.
  float w_b = 0.0f;
  int64_t id_b = INT64_MAX;
  if (top_p < 1.0f) {
    const double total = ops.SumD(V, [&](int64_t v) { return static_cast<double>(w[v]); });
    const double target = static_cast<double>(top_p) * total;
    // Radix selection weighted by mass: the value at which the running mass (largest first)
    // reaches target. w >= 0, so its bit pattern orders like the value.
    uint32_t prefix = 0, prefix_mask = 0;
    double above = 0.0;
    bool found = true;
    for (int shift = 24; shift >= 0 && found; shift -= 8) {
      ops.Histogram(
          V,
          [&](int64_t v) -> int {
            const uint32_t u = FloatBits(w[v]);
            if (!(w[v] > 0.0f) || (u & prefix_mask) != prefix) return -1;
            return static_cast<int>((u >> shift) & 0xFFu);
          },
          [&](int64_t v) { return static_cast<double>(w[v]); }, counts, masses);
      int bin = 255, lowest = -1;
      for (; bin >= 0; --bin) {
        if (counts[bin] > 0) lowest = bin;
        if (above + masses[bin] >= target) break;
        above += masses[bin];
      }
      if (bin < 0 && shift == 24) {
        found = false;  // rounding left the total just under target: keep everything (as the CPU)
      } else {
        if (bin < 0) {
          // Within the crossing bucket the sub-bins re-summed to just under the remaining mass
          // (rounding): the boundary is the bucket's smallest value, as in the CPU's prefix search.
          bin = lowest;
          above -= masses[bin];
        }
        prefix |= static_cast<uint32_t>(bin) << shift;
        prefix_mask |= 0xFFu << shift;
      }
    }
    if (found) {
      const float wb = BitsFloat(prefix);
      const int64_t ties = ops.CountIf(V, [&](int64_t v) { return w[v] == wb; });
      // The smallest c with above + c * wb >= target, within [1, ties].
      int64_t c = 1;
      if (wb > 0.0f) {
        double need = (target - above) / static_cast<double>(wb);
        c = static_cast<int64_t>(need);
        if (static_cast<double>(c) < need) ++c;
        while (c > 1 && above + static_cast<double>(c - 1) * wb >= target) --c;
        while (c < ties && above + static_cast<double>(c) * wb < target) ++c;
        c = c < 1 ? 1 : (c > ties ? ties : c);
      }
      w_b = wb;
      id_b = ops.NthTrue(V, [&](int64_t v) { return w[v] == wb; }, c - 1);
    }
  }
  const float floor_w = min_p > w_b ? min_p : w_b;
  auto keep = [&](int64_t v) {
    const float x = w[v];
    return x > 0.0f && x >= floor_w && (x > w_b || v <= id_b);
  };
  const double kept =
      ops.SumD(V, [&](int64_t v) { return keep(v) ? static_cast<double>(w[v]) : 0.0; });
  const float inv = static_cast<float>(1.0 / kept);
  ops.ForEach(V, [&](int64_t v) { out[v] = keep(v) ? w[v] * inv : 0.0f; });
  return kFilterOk;
}

// ---- tree acceptance ----------------------------------------------------------------------------

// Below this mass a residual is treated as empty (as in the CPU walk).
constexpr double kEmptyMass = 1e-9;

enum WalkStatus : int {
  kWalkOk = 0,
  kWalkBadEntry = 1,     // NaN / infinite / negative / > 1 + tol entry: row, token
  kWalkBadSum = 2,       // |sum - 1| > tol: row, sum
  kWalkZeroDraft = 3,    // sampled child with q(x) = 0: row, child node, token
  kWalkNoMass = 4,       // nothing to sample from
};

struct WalkError {
  int32_t status;
  int32_t node;     // tree-local node
  int64_t row;      // global row
  int64_t token;    // offending token (kWalkBadEntry, kWalkZeroDraft) or child (kWalkZeroDraft)
  int64_t child;
  double value;     // offending value or sum
  int32_t is_draft; // the row is draft_probs (else target_probs)
};

struct WalkInputs {
  const float* target;   // [N, V]
  const float* draft;    // [N, V] or nullptr
  const int32_t* tokens;  // [N]
  const int32_t* parents; // [N]
  const int64_t* indptr;  // [B + 1]
  int64_t vocab;
  double tol;
  bool skip_residual;    // FOR TESTS ONLY (AcceptOptions::debug_skip_residual)
};

// Validates a probability row the walk reads; returns its sum (negative on error, with *err set).
template <class Ops>
PYSPEC_LOGIC_HD double CheckedRowSum(Ops& ops, const float* row, int64_t V, double tol,
                                     bool is_draft, int64_t global_row, int32_t node,
                                     WalkError* err) {
  const float hi = 1.0f + static_cast<float>(tol);
  auto bad = [&](int64_t v) { const float x = row[v]; return !(x >= 0.0f) || !(x <= hi); };
  if (ops.AnyOf(V, bad)) {
    // Entries above 1 + tol make the sum check fail on the CPU; report them as a bad sum there.
    const int64_t at = ops.NthTrue(V, [&](int64_t v) {
      const float x = row[v];
      return IsNan(x) || IsPosInf(x) || IsNegInf(x) || x < 0.0f;
    }, 0);
    if (at >= 0) {
      *err = WalkError{kWalkBadEntry, node, global_row, at, -1, static_cast<double>(row[at]),
                       is_draft ? 1 : 0};
      return -1.0;
    }
  }
  const double sum = ops.SumD(V, [&](int64_t v) { return static_cast<double>(row[v]); });
  const double dev = sum - 1.0;
  if (dev > tol || dev < -tol) {
    *err = WalkError{kWalkBadSum, node, global_row, -1, -1, sum, is_draft ? 1 : 0};
    return -1.0;
  }
  return sum;
}

// Walks request b's tree (see pyspec::AcceptTrees). resid/qcur: [V] double scratch (only touched
// in sampled mode). path/emitted: [width] outputs; *num_path receives the path length
// (accepted + 1), emitted has the same length. Returns kWalkOk or the status stored in *err.
template <class Ops>
PYSPEC_LOGIC_HD int WalkRequest(Ops& ops, const WalkInputs& in, int64_t b, bool greedy,
                                bool sampled, uint64_t seed, uint64_t offset, double* resid,
                                double* qcur, int32_t* path, int32_t* emitted, int32_t* num_path,
                                WalkError* err) {
  const int64_t base = in.indptr[b];
  const int32_t n = static_cast<int32_t>(in.indptr[b + 1] - base);
  const int64_t V = in.vocab;
  int32_t len = 1;
  path[0] = 0;
  int32_t node = 0;
  uint64_t position = offset;  // the sequence position of the token `node` decides
  while (true) {
    const int64_t row = base + node;
    const float* p = in.target + row * V;
    // Children of `node`, in index order: the later nodes whose parent it is.
    int32_t num_kids = 0;
    for (int32_t j = node + 1; j < n; ++j) num_kids += in.parents[base + j] == node;
    if (greedy || (!(sampled && num_kids > 0) && !in.skip_residual)) {
      // Greedy: the argmax. Target-only walk: a sample of the target with plain decoding's draw
      // for this position. Either way move to the first child holding that token.
      const double mass = CheckedRowSum(ops, p, V, in.tol, false, row, node, err);
      if (mass < 0.0) return err->status;
      int64_t t = 0;
      if (greedy) {
        float best_val = 0.0f;
        ops.ArgMaxFirst(V, [&](int64_t v) { return p[v]; }, &best_val, &t);
      } else {
        const double u = PhiloxUniform(seed, position, kDrawSample, 0);
        t = ops.SampleCdf(V, [&](int64_t v) { return static_cast<double>(p[v]); }, u * mass);
        if (t < 0) {
          *err = WalkError{kWalkNoMass, node, row, -1, -1, 0.0, 0};
          return kWalkNoMass;
        }
      }
      emitted[len - 1] = static_cast<int32_t>(t);
      int32_t next = -1;
      for (int32_t j = node + 1; j < n && next < 0; ++j) {
        if (in.parents[base + j] == node && in.tokens[base + j] == t) next = j;
      }
      if (next < 0) break;  // recovered (a miss) or bonus (a leaf)
      path[len++] = next;
      node = next;
      ++position;
      continue;
    }

    double p_mass = CheckedRowSum(ops, p, V, in.tol, false, row, node, err);
    if (p_mass < 0.0) return err->status;
    // Sampled children: recursive rejection sampling (and, tests only, the broken rule for
    // deterministic children: accept x with probability p(x), keep the unmodified p).
    const float* q = nullptr;
    double q_mass = 1.0;
    if (sampled && num_kids > 0) {
      q = in.draft + row * V;
      q_mass = CheckedRowSum(ops, q, V, in.tol, true, row, node, err);
      if (q_mass < 0.0) return err->status;
    }
    bool have_resid = false, have_q = false;
    int32_t accepted = -1;
    int32_t j = 0;  // index of the child among its siblings
    for (int32_t child = node + 1; child < n; ++child) {
      if (in.parents[base + child] != node) continue;
      const int32_t x = in.tokens[base + child];
      const double u = PhiloxUniform(seed, position, kDrawChildTest, static_cast<uint32_t>(j));
      ++j;
      if (q == nullptr) {  // the broken rule (skip_residual)
        if (u < static_cast<double>(p[x]) / p_mass) {
          accepted = child;
          break;
        }
        continue;
      }
      const double px = (have_resid ? resid[x] : static_cast<double>(p[x])) / p_mass;
      const double qx = (have_q ? qcur[x] : static_cast<double>(q[x])) / q_mass;
      if (!(qx > 0.0)) {
        *err = WalkError{kWalkZeroDraft, node, row, x, child, 0.0, 1};
        return kWalkZeroDraft;
      }
      if (u * qx < px) {  // probability min(1, px / qx)
        accepted = child;
        break;
      }
      // Rejection: p <- max(p / |p| - q / |q|, 0), q <- q without x (Jeon et al. 2024).
      const double inv_p = 1.0 / p_mass, inv_q = 1.0 / q_mass;
      const bool hr = have_resid, hq = have_q;
      auto P = [&](int64_t v) { return hr ? resid[v] : static_cast<double>(p[v]); };
      auto Q = [&](int64_t v) { return hq ? qcur[v] : static_cast<double>(q[v]); };
      // Read before the block-wide steps below: the update zeroes qcur[x].
      const double qx_raw = Q(x);
      const double r_mass = ops.SumD(V, [&](int64_t v) {
        const double d = P(v) * inv_p - Q(v) * inv_q;
        return d > 0.0 ? d : 0.0;
      });
      const double q_total = ops.SumD(V, Q);
      const bool take = !in.skip_residual && r_mass > kEmptyMass;
      ops.ForEach(V, [&](int64_t v) {
        const double pv = P(v), qv = Q(v);
        if (take) {
          const double d = pv * inv_p - qv * inv_q;
          resid[v] = d > 0.0 ? d : 0.0;
        }
        qcur[v] = v == x ? 0.0 : qv;
      });
      have_q = true;
      q_mass = q_total - qx_raw;
      if (take) {
        have_resid = true;
        p_mass = r_mass;
      }
    }
    if (accepted >= 0) {
      emitted[len - 1] = in.tokens[base + accepted];
      path[len++] = accepted;
      node = accepted;
      ++position;
      continue;
    }
    // Every child rejected (recovered token) or a leaf (bonus token): sample the current p.
    const double u = PhiloxUniform(seed, position, kDrawSample, 0);
    int64_t t;
    if (have_resid) {
      t = ops.SampleCdf(V, [&](int64_t v) { return resid[v]; }, u * p_mass);
    } else {
      t = ops.SampleCdf(V, [&](int64_t v) { return static_cast<double>(p[v]); }, u * p_mass);
    }
    if (t < 0) {
      *err = WalkError{kWalkNoMass, node, row, -1, -1, 0.0, 0};
      return kWalkNoMass;
    }
    emitted[len - 1] = static_cast<int32_t>(t);
    break;
  }
  *num_path = len;
  return kWalkOk;
}

// ---- serial row operations (host) ------------------------------------------------------------

struct SerialRowOps {
  template <class F>
  double SumD(int64_t n, F f) {
    double s = 0.0;
    for (int64_t v = 0; v < n; ++v) s += f(v);
    return s;
  }
  template <class F>
  int64_t CountIf(int64_t n, F f) {
    int64_t c = 0;
    for (int64_t v = 0; v < n; ++v) c += f(v) ? 1 : 0;
    return c;
  }
  template <class F>
  bool AnyOf(int64_t n, F f) {
    for (int64_t v = 0; v < n; ++v) {
      if (f(v)) return true;
    }
    return false;
  }
  template <class F>
  void ArgMaxFirst(int64_t n, F f, float* best, int64_t* idx) {
    float b = f(0);
    int64_t i = 0;
    for (int64_t v = 1; v < n; ++v) {
      const float x = f(v);
      if (x > b) {
        b = x;
        i = v;
      }
    }
    *best = b;
    *idx = i;
  }
  template <class F>
  void ForEach(int64_t n, F f) {
    for (int64_t v = 0; v < n; ++v) f(v);
  }
  template <class F>
  int64_t NthTrue(int64_t n, F pred, int64_t k) {
    if (k < 0) return -1;
    for (int64_t v = 0; v < n; ++v) {
      if (pred(v) && k-- == 0) return v;
    }
    return -1;
  }
  template <class W>
  int64_t SampleCdf(int64_t n, W w, double target) {
    double cum = 0.0;
    int64_t last = -1;
    for (int64_t v = 0; v < n; ++v) {
      const double x = w(v);
      if (x > 0.0) {
        cum += x;
        last = v;
        if (cum > target) return v;
      }
    }
    return last;
  }
  template <class Digit, class Mass>
  void Histogram(int64_t n, Digit digit, Mass mass, uint32_t* counts, double* masses) {
    for (int i = 0; i < 256; ++i) {
      counts[i] = 0;
      masses[i] = 0.0;
    }
    for (int64_t v = 0; v < n; ++v) {
      const int d = digit(v);
      if (d >= 0) {
        ++counts[d];
        masses[d] += mass(v);
      }
    }
  }
  bool Leader() const { return true; }
};

#undef PYSPEC_LOGIC_HD

}  // namespace accept_logic
}  // namespace pyspec
