// Batched tree acceptance on the CPU (acceptance.h has the contract and the papers; this file
// states the numerical choices).
//
// Numerics: probabilities are read as float32 and every sum, residual and CDF is accumulated in
// double, in a fixed order over the vocabulary, so a result does not depend on the thread count.
// Rows are normalised by their computed sum (not assumed to sum to exactly 1).
#include "pyspec/acceptance.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <utility>
#include <vector>

#include "pyspec/check.h"
#include "pyspec/philox.h"
#include "pyspec/thread_pool.h"
#include "pyspec/tree.h"
#include "sampling_rows.h"

namespace pyspec {
namespace {

inline bool ReadFlag(const TensorView& t, int64_t i) { return t.ptr<const uint8_t>()[i] != 0; }

// Per-request inputs shared by the walks.
struct Batch {
  const float* target;       // [N, V] probabilities, or logits (greedy only) with `argmax`
  const int32_t* argmax;     // [N] or nullptr: the logits rows' first maxima (LogitsArgmaxes)
  const float* draft;        // [N, V] or nullptr
  const int32_t* tokens;     // [N]
  const int32_t* parents;    // [N]
  const int64_t* indptr;     // [B + 1]
  int64_t vocab;
  double tol;
};

// Per-thread working memory, reused across the requests of a chunk.
struct WalkScratch {
  std::vector<double> resid;     // [V] current p (unnormalised) after a sampled-mode rejection
  std::vector<double> qcur;      // [V] current q (unnormalised, rejected siblings zeroed)
  std::vector<double> tmp;       // [V] staging for the next residual
  std::vector<int32_t> child_ptr, child_list, fill;
  std::vector<int32_t> path, emitted;
};

// One pass over a probability row: its sum (four accumulators in a fixed order: deterministic and
// about four times faster than one dependent chain) and whether any entry is outside [0, hi] or
// NaN. With `argmax` it also finds the first maximum.
template <bool kArgmax>
double ScanRow(const float* row, int64_t vocab, float hi, bool* bad, int64_t* argmax) {
  double a0 = 0.0, a1 = 0.0, a2 = 0.0, a3 = 0.0;
  bool out_of_range = false;
  int64_t best = 0;
  float best_val = row[0];
  int64_t v = 0;
  for (; v + 4 <= vocab; v += 4) {
    const float x0 = row[v], x1 = row[v + 1], x2 = row[v + 2], x3 = row[v + 3];
    out_of_range |= !(x0 >= 0.0f) | !(x0 <= hi) | !(x1 >= 0.0f) | !(x1 <= hi) |
                    !(x2 >= 0.0f) | !(x2 <= hi) | !(x3 >= 0.0f) | !(x3 <= hi);
    a0 += x0;
    a1 += x1;
    a2 += x2;
    a3 += x3;
    if (kArgmax) {
      // Strict '>' in index order keeps the first maximum.
      const float m01 = std::max(x0, x1), m23 = std::max(x2, x3);
      if (std::max(m01, m23) > best_val) {
        for (int i = 0; i < 4; ++i) {
          if (row[v + i] > best_val) {
            best_val = row[v + i];
            best = v + i;
          }
        }
      }
    }
  }
  for (; v < vocab; ++v) {
    out_of_range |= !(row[v] >= 0.0f) | !(row[v] <= hi);
    a0 += row[v];
    if (kArgmax && row[v] > best_val) {
      best_val = row[v];
      best = v;
    }
  }
  if (kArgmax) *argmax = best;
  *bad = out_of_range;
  return (a0 + a1) + (a2 + a3);
}

// Validates a probability row the walk reads and returns its sum.
template <bool kArgmax = false>
double CheckedRow(const float* row, int64_t vocab, double tol, const char* name, int64_t global_row,
                  int64_t request, int64_t node, int64_t* argmax = nullptr) {
  bool bad = false;
  const double sum = ScanRow<kArgmax>(row, vocab, 1.0f + static_cast<float>(tol), &bad, argmax);
  if (bad) {
    for (int64_t v = 0; v < vocab; ++v) {
      PYSPEC_CHECK(std::isfinite(row[v]) && row[v] >= 0.0f, "'", name, "' row ", global_row,
                   " (request ", request, ", node ", node, ") has a NaN, infinite or negative entry ",
                   row[v], " at token ", v);
    }
  }
  PYSPEC_CHECK(std::abs(sum - 1.0) <= tol, "'", name, "' row ", global_row, " (request ", request,
               ", node ", node, ") sums to ", sum, "; probability rows must sum to 1 within ", tol);
  return sum;
}

// Every row's first maximal logit. All rows are checked, visited by the walk or not (a NaN or
// +inf anywhere in the logits, or a row without a finite entry, is an error): the lowest bad row
// is reported, whichever thread scans it.
std::vector<int32_t> LogitsArgmaxes(const float* z, int64_t rows, int64_t vocab, ThreadPool& tp) {
  std::vector<int32_t> argmax(rows);
  tp.ParallelFor(rows, 1, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const detail::LogitsRowScan scan = detail::ScanLogitsRow(z + r * vocab, vocab);
      argmax[r] = scan.bad ? -1 : static_cast<int32_t>(scan.argmax);
    }
  });
  for (int64_t r = 0; r < rows; ++r) {
    if (argmax[r] < 0) detail::CheckedScanLogitsRow(z + r * vocab, vocab, r);  // throws
  }
  return argmax;
}

// Inverse-CDF sample from unnormalised weights w (total mass `total`). If rounding leaves
// u * total beyond the running sum, the last token with positive weight is returned (its mass
// absorbs the rounding).
template <typename T>
int32_t SampleIndex(const T* w, int64_t vocab, double total, double u) {
  const double target = u * total;
  double cum = 0.0;
  int64_t last_positive = -1;
  for (int64_t v = 0; v < vocab; ++v) {
    if (w[v] > 0) {
      cum += w[v];
      last_positive = v;
      if (cum > target) return static_cast<int32_t>(v);
    }
  }
  // Unreachable for validated rows (they sum to ~1); kept a user-facing error, not an abort.
  PYSPEC_CHECK(last_positive >= 0, "cannot sample: the distribution has no positive mass");
  return static_cast<int32_t>(last_positive);
}

// The rejection update of recursive rejection sampling, fused into one pass:
//   tmp  <- max(p / p_mass - q / q_mass, 0)      (the next target, unnormalised)
//   qout <- q with token x zeroed                  (the next draft: without replacement)
// Returns the masses of both. qout may alias q.
template <typename P, typename Q>
void RejectPass(const P* p, double p_mass, const Q* q, double q_mass, int32_t x, int64_t vocab,
                double* tmp, double* qout, double* r_mass, double* q_mass_out) {
  const double inv_p = 1.0 / p_mass, inv_q = 1.0 / q_mass;
  double r0 = 0.0, r1 = 0.0, s0 = 0.0, s1 = 0.0;
  int64_t v = 0;
  for (; v + 2 <= vocab; v += 2) {
    const double q0 = q[v], q1 = q[v + 1];
    const double d0 = std::max(p[v] * inv_p - q0 * inv_q, 0.0);
    const double d1 = std::max(p[v + 1] * inv_p - q1 * inv_q, 0.0);
    tmp[v] = d0;
    tmp[v + 1] = d1;
    qout[v] = q0;
    qout[v + 1] = q1;
    r0 += d0;
    r1 += d1;
    s0 += q0;
    s1 += q1;
  }
  for (; v < vocab; ++v) {
    const double q0 = q[v];
    const double d0 = std::max(p[v] * inv_p - q0 * inv_q, 0.0);
    tmp[v] = d0;
    qout[v] = q0;
    r0 += d0;
    s0 += q0;
  }
  // Drop x from the draft; subtracting keeps the pass single (the mass is only a normaliser).
  *q_mass_out = (s0 + s1) - qout[x];
  qout[x] = 0.0;
  *r_mass = r0 + r1;
}

// Below this mass a residual is treated as empty (the rejection that led to it had probability of
// the same order) and the walk keeps its current target instead.
constexpr double kEmptyMass = 1e-9;

void WalkRequest(const Batch& in, int64_t b, bool greedy, bool sampled, uint64_t seed,
                 uint64_t offset, const AcceptOptions& opt, WalkScratch& s) {
  const int64_t base = in.indptr[b];
  const int32_t n = static_cast<int32_t>(in.indptr[b + 1] - base);
  const int64_t V = in.vocab;
  // Children lists (CSR) of this tree, in index order.
  s.child_ptr.assign(n + 1, 0);
  for (int32_t i = 1; i < n; ++i) ++s.child_ptr[in.parents[base + i] + 1];
  for (int32_t i = 0; i < n; ++i) s.child_ptr[i + 1] += s.child_ptr[i];
  s.child_list.resize(n > 0 ? n - 1 : 0);
  s.fill.assign(s.child_ptr.begin(), s.child_ptr.end() - 1);
  for (int32_t i = 1; i < n; ++i) s.child_list[s.fill[in.parents[base + i]]++] = i;

  s.path.assign(1, 0);
  s.emitted.clear();
  int32_t node = 0;
  uint64_t position = offset;  // the sequence position of the token `node` decides
  while (true) {
    const int64_t row = base + node;
    const float* p = in.target + row * V;
    const int32_t* kid_begin = s.child_list.data() + s.child_ptr[node];
    const int32_t num_kids = s.child_ptr[node + 1] - s.child_ptr[node];
    if (greedy || (!(sampled && num_kids > 0) && !opt.debug_skip_residual)) {
      // Greedy: the argmax. Target-only walk (deterministic children, or none): a sample of the
      // target with the draw plain decoding uses at this position. Either way move to the first
      // child holding that token; a miss (recovered token) or a leaf (bonus) ends the walk.
      int32_t t;
      if (greedy && in.argmax != nullptr) {
        t = in.argmax[row];
      } else if (greedy) {
        int64_t best = 0;
        CheckedRow<true>(p, V, in.tol, "target_probs", row, b, node, &best);
        t = static_cast<int32_t>(best);
      } else {
        const double mass = CheckedRow(p, V, in.tol, "target_probs", row, b, node);
        t = SampleIndex(p, V, mass, PhiloxUniform(seed, position, kDrawSample, 0));
      }
      s.emitted.push_back(t);
      int32_t next = -1;
      for (int32_t j = 0; j < num_kids && next < 0; ++j) {
        if (in.tokens[base + kid_begin[j]] == t) next = kid_begin[j];
      }
      if (next < 0) break;
      s.path.push_back(next);
      node = next;
      ++position;
      continue;
    }

    double p_mass = CheckedRow(p, V, in.tol, "target_probs", row, b, node);
    // Sampled children: recursive rejection sampling over the children in index order. (Also,
    // for tests only, the deliberately broken rule for deterministic children: accept x with
    // probability p(x) and keep the unmodified p after a rejection.)
    const float* q = nullptr;
    double q_mass = 1.0;
    if (sampled && num_kids > 0) {
      q = in.draft + row * V;
      q_mass = CheckedRow(q, V, in.tol, "draft_probs", row, b, node);
    }
    bool have_resid = false;  // the current p lives in s.resid
    bool have_q = false;      // the current q lives in s.qcur
    int32_t accepted = -1;
    for (int32_t j = 0; j < num_kids; ++j) {
      const int32_t child = kid_begin[j];
      const int32_t x = in.tokens[base + child];
      const double u = PhiloxUniform(seed, position, kDrawChildTest, static_cast<uint32_t>(j));
      if (q == nullptr) {  // the broken rule (debug_skip_residual)
        if (u < p[x] / p_mass) {
          accepted = child;
          break;
        }
        continue;
      }
      const double px = (have_resid ? s.resid[x] : static_cast<double>(p[x])) / p_mass;
      const double qx = (have_q ? s.qcur[x] : static_cast<double>(q[x])) / q_mass;
      PYSPEC_CHECK(qx > 0.0, "request ", b, ": child node ", child, " has token ", x,
                   " but 'draft_probs' row ", row, " gives it probability 0 (after removing the "
                   "earlier siblings); sampled children must be distinct draws from that row");
      if (u * qx < px) {  // probability min(1, px / qx)
        accepted = child;
        break;
      }
      double r_mass = 0.0, next_q_mass = 0.0;
      if (have_resid) {
        if (have_q) {
          RejectPass(s.resid.data(), p_mass, s.qcur.data(), q_mass, x, V, s.tmp.data(),
                     s.qcur.data(), &r_mass, &next_q_mass);
        } else {
          RejectPass(s.resid.data(), p_mass, q, q_mass, x, V, s.tmp.data(), s.qcur.data(),
                     &r_mass, &next_q_mass);
        }
      } else if (have_q) {
        RejectPass(p, p_mass, s.qcur.data(), q_mass, x, V, s.tmp.data(), s.qcur.data(), &r_mass,
                   &next_q_mass);
      } else {
        RejectPass(p, p_mass, q, q_mass, x, V, s.tmp.data(), s.qcur.data(), &r_mass, &next_q_mass);
      }
      have_q = true;
      q_mass = next_q_mass;
      if (!opt.debug_skip_residual && r_mass > kEmptyMass) {
        std::swap(s.resid, s.tmp);
        have_resid = true;
        p_mass = r_mass;
      }
      // else: an empty residual (p <= q up to rounding) keeps the current p.
    }
    if (accepted >= 0) {
      s.emitted.push_back(in.tokens[base + accepted]);
      s.path.push_back(accepted);
      node = accepted;
      ++position;
      continue;
    }
    // Every child rejected (recovered token) or a leaf (bonus token): sample the current p.
    const double u = PhiloxUniform(seed, position, kDrawSample, 0);
    const int32_t t = have_resid ? SampleIndex(s.resid.data(), V, p_mass, u)
                                 : SampleIndex(p, V, p_mass, u);
    s.emitted.push_back(t);
    break;
  }
}

// Validates the trees (metadata shapes on `device`, values read from host pointers `par` and
// `indptr`) and returns the largest depth; depth_out receives every node's depth.
int32_t MaxDepthChecked(const TensorView& parents, const TensorView& tree_indptr, DeviceType device,
                        const int32_t* par, const int64_t* indptr,
                        std::vector<int32_t>* depth_out) {
  CheckDevice(parents, "parents", device);
  CheckSameDevice(parents, "parents", tree_indptr, "tree_indptr");
  CheckDType(parents, "parents", {DType::kInt32});
  CheckDType(tree_indptr, "tree_indptr", {DType::kInt64});
  CheckShape(parents, "parents", {-1});
  CheckShape(tree_indptr, "tree_indptr", {-1});
  CheckContiguous(parents, "parents");
  CheckContiguous(tree_indptr, "tree_indptr");
  PYSPEC_CHECK(tree_indptr.shape[0] >= 1, "'tree_indptr' must have batch + 1 >= 1 entries");
  const int64_t batch = tree_indptr.shape[0] - 1;
  const int64_t total = parents.shape[0];
  if (par == nullptr) par = parents.ptr<const int32_t>();
  if (indptr == nullptr) indptr = tree_indptr.ptr<const int64_t>();
  ValidateTreeBatch(par, indptr, batch, total, "parents");
  std::vector<int32_t> local;
  std::vector<int32_t>& depth = depth_out ? *depth_out : local;
  depth.assign(total, 0);
  int32_t max_depth = 0;
  for (int64_t b = 0; b < batch; ++b) {
    const int64_t base = indptr[b];
    for (int64_t i = 1; i < indptr[b + 1] - base; ++i) {
      depth[base + i] = depth[base + par[base + i]] + 1;
      max_depth = std::max(max_depth, depth[base + i]);
    }
  }
  return max_depth;
}

}  // namespace

namespace detail {
AcceptShape CheckAcceptArgs(const AcceptTreesArgs& args, DeviceType device, const AcceptMeta& meta) {
  const TensorView &target_probs = args.target, *draft_probs = args.draft();
  const TensorView &tokens = args.tokens, &parents = args.parents, &tree_indptr = args.tree_indptr;
  const TensorView &greedy = args.greedy, &sampled_children = args.sampled_children;
  const TensorView &seeds = args.seeds, &offsets = args.offsets;
  const TensorView &accepted_nodes = args.accepted_nodes, &emitted_tokens = args.emitted_tokens;
  const TensorView& num_accepted = args.num_accepted;
  const AcceptOptions& options = args.options;
  const std::pair<const TensorView*, const char*> all[] = {
      {&tokens, "tokens"}, {&parents, "parents"}, {&tree_indptr, "tree_indptr"},
      {&greedy, "greedy"}, {&sampled_children, "sampled_children"}, {&seeds, "seeds"},
      {&offsets, "offsets"}, {&accepted_nodes, "accepted_nodes"},
      {&emitted_tokens, "emitted_tokens"}, {&num_accepted, "num_accepted"}};
  // A tolerance near 1 would admit all-zero rows, leaving nothing to sample from.
  PYSPEC_CHECK(options.row_sum_tolerance > 0.0 && options.row_sum_tolerance <= 0.5,
               "'row_sum_tolerance' must be in (0, 0.5]; got ", options.row_sum_tolerance);
  CheckDevice(target_probs, "target_probs", device);
  for (const auto& t : all) {
    CheckSameDevice(target_probs, "target_probs", *t.first, t.second);
    CheckContiguous(*t.first, t.second);
  }
  CheckDType(target_probs, "target_probs", {DType::kFloat32});
  CheckShape(target_probs, "target_probs", {-1, -1});
  CheckContiguous(target_probs, "target_probs");
  const int64_t total = target_probs.shape[0], vocab = target_probs.shape[1];
  PYSPEC_CHECK(vocab >= 1, "'target_probs' needs a vocabulary of at least 1");
  PYSPEC_CHECK(vocab <= std::numeric_limits<int32_t>::max(), "'target_probs' vocabulary is too large");
  if (draft_probs != nullptr) {
    CheckSameDevice(target_probs, "target_probs", *draft_probs, "draft_probs");
    CheckDType(*draft_probs, "draft_probs", {DType::kFloat32});
    CheckShape(*draft_probs, "draft_probs", {total, vocab});
    CheckContiguous(*draft_probs, "draft_probs");
  }
  CheckDType(tokens, "tokens", {DType::kInt32});
  CheckShape(tokens, "tokens", {total});
  CheckShape(parents, "parents", {total});
  std::vector<int32_t> depth;
  MaxDepthChecked(parents, tree_indptr, device, meta.parents, meta.indptr, &depth);
  const int64_t batch = tree_indptr.shape[0] - 1;
  CheckDType(greedy, "greedy", {DType::kBool, DType::kUInt8});
  CheckDType(sampled_children, "sampled_children", {DType::kBool, DType::kUInt8});
  CheckDType(seeds, "seeds", {DType::kInt64});
  CheckDType(offsets, "offsets", {DType::kInt64});
  for (const auto* t : {&greedy, &sampled_children, &seeds, &offsets}) {
    const char* name = t == &greedy ? "greedy" : t == &sampled_children ? "sampled_children"
                       : t == &seeds ? "seeds" : "offsets";
    CheckShape(*t, name, {batch});
  }
  CheckDType(accepted_nodes, "accepted_nodes", {DType::kInt32});
  CheckDType(emitted_tokens, "emitted_tokens", {DType::kInt32});
  CheckDType(num_accepted, "num_accepted", {DType::kInt32});
  CheckShape(accepted_nodes, "accepted_nodes", {batch, -1});
  const int64_t width = accepted_nodes.shape[1];
  CheckShape(emitted_tokens, "emitted_tokens", {batch, width});
  CheckShape(num_accepted, "num_accepted", {batch});

  const int32_t* tok = meta.tokens ? meta.tokens : tokens.ptr<const int32_t>();
  const int64_t* indptr = meta.indptr ? meta.indptr : tree_indptr.ptr<const int64_t>();
  const uint8_t* greedy_flags = meta.greedy ? meta.greedy : greedy.ptr<const uint8_t>();
  const uint8_t* sampled_flags = meta.sampled ? meta.sampled : sampled_children.ptr<const uint8_t>();
  for (int64_t b = 0; b < batch; ++b) {
    int32_t tree_depth = 0;
    for (int64_t i = indptr[b] + 1; i < indptr[b + 1]; ++i) {
      PYSPEC_CHECK(tok[i] >= 0 && tok[i] < vocab, "'tokens'[", i, "] (request ", b, ", node ",
                   i - indptr[b], ") = ", tok[i], " is out of range [0, ", vocab, ")");
      tree_depth = std::max(tree_depth, depth[i]);
    }
    PYSPEC_CHECK(tree_depth + 1 <= width, "'accepted_nodes' / 'emitted_tokens' have width ", width,
                 " but tree ", b, " has depth ", tree_depth, "; need width >= max depth + 1");
    PYSPEC_CHECK(sampled_flags[b] == 0 || greedy_flags[b] != 0 || draft_probs != nullptr,
                 "'sampled_children'[", b, "] is set but 'draft_probs' was not given; pass the "
                 "draft distributions or mark the children deterministic");
  }
  if (options.target_is_logits) {
    PYSPEC_CHECK(device == DeviceType::kCPU, "target_is_logits: the greedy walk over logits runs "
                 "on the CPU only");
    PYSPEC_CHECK(draft_probs == nullptr, "target_is_logits: every request is greedy, so "
                 "'draft_probs' must not be given");
    for (int64_t b = 0; b < batch; ++b) {
      PYSPEC_CHECK(greedy_flags[b] != 0, "target_is_logits: request ", b, " is not greedy; the "
                   "logits of sampled requests go through the sampling filters first");
    }
  }

  return {batch, total, vocab, width};
}
}  // namespace detail

void AcceptTrees(const AcceptTreesArgs& args, ThreadPool* pool) {
  const detail::AcceptShape shape = detail::CheckAcceptArgs(args, DeviceType::kCPU, {});
  const AcceptOptions& options = args.options;
  const TensorView &greedy = args.greedy, &sampled_children = args.sampled_children;
  const int64_t batch = shape.batch, vocab = shape.vocab, width = shape.width;
  ThreadPool& tp = pool ? *pool : ThreadPool::Default();
  std::vector<int32_t> argmax;
  if (options.target_is_logits) {
    argmax = LogitsArgmaxes(args.target.ptr<const float>(), shape.total, vocab, tp);
  }
  Batch in{args.target.ptr<const float>(),
           options.target_is_logits ? argmax.data() : nullptr,
           args.draft() ? args.draft_probs.ptr<const float>() : nullptr,
           args.tokens.ptr<const int32_t>(),
           args.parents.ptr<const int32_t>(),
           args.tree_indptr.ptr<const int64_t>(),
           vocab,
           options.row_sum_tolerance};
  const int64_t* seed = args.seeds.ptr<const int64_t>();
  const int64_t* off = args.offsets.ptr<const int64_t>();
  int32_t* out_nodes = args.accepted_nodes.ptr<int32_t>();
  int32_t* out_tokens = args.emitted_tokens.ptr<int32_t>();
  int32_t* out_count = args.num_accepted.ptr<int32_t>();
  tp.ParallelFor(batch, 1, [&](int64_t begin, int64_t end) {
    WalkScratch s;
    if (!options.target_is_logits) {  // (the greedy walk over logits samples nothing)
      s.resid.resize(vocab);
      s.qcur.resize(vocab);
      s.tmp.resize(vocab);
    }
    for (int64_t b = begin; b < end; ++b) {
      WalkRequest(in, b, ReadFlag(greedy, b), ReadFlag(sampled_children, b),
                  static_cast<uint64_t>(seed[b]), static_cast<uint64_t>(off[b]), options, s);
      int32_t* nodes_row = out_nodes + b * width;
      int32_t* tokens_row = out_tokens + b * width;
      std::fill(nodes_row, nodes_row + width, -1);
      std::fill(tokens_row, tokens_row + width, -1);
      std::copy(s.path.begin(), s.path.end(), nodes_row);
      std::copy(s.emitted.begin(), s.emitted.end(), tokens_row);
      out_count[b] = static_cast<int32_t>(s.path.size()) - 1;
    }
  });
}

int32_t TreeBatchMaxDepth(const TensorView& parents, const TensorView& tree_indptr) {
  return MaxDepthChecked(parents, tree_indptr, DeviceType::kCPU, nullptr, nullptr, nullptr);
}

}  // namespace pyspec
