// The logic of the CUDA sampling-filter and acceptance kernels (cuda/accept_logic.h), run on the
// host with serial row operations and compared with the CPU ops, which are the oracle. The CUDA
// kernels run this same code with block-wide row operations, so this tests everything but those
// operations on machines without a GPU.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <random>
#include <vector>

#include "../../cuda/accept_logic.h"
#include "pyspec/acceptance.h"

namespace pyspec {
namespace {

using accept_logic::SerialRowOps;

TensorView F32(std::vector<float>& v, std::initializer_list<int64_t> shape) {
  return TensorView::Contiguous(v.data(), DType::kFloat32, shape);
}

struct FilterCase {
  int64_t vocab;
  float temperature;
  int32_t top_k;
  float top_p;
  float min_p;
  bool ties;  // logits from a small set of values: many ties at the boundaries
  bool masked;
};

TEST(CudaLogic, FiltersMatchTheCpuOp) {
  const FilterCase cases[] = {
      {1, 1.0f, 0, 1.0f, 0.0f, false, false},   {7, 0.0f, 3, 0.5f, 0.0f, false, false},
      {111, 1.0f, 0, 1.0f, 0.0f, false, false}, {111, 0.7f, 5, 1.0f, 0.0f, true, false},
      {111, 1.3f, 0, 0.9f, 0.0f, true, false},  {1000, 0.7f, 40, 0.9f, 0.05f, false, true},
      {1000, 1.0f, 1, 1.0f, 0.0f, true, false}, {4099, 0.5f, 0, 0.3f, 0.0f, false, false},
      {4099, 2.0f, 4098, 0.99f, 0.01f, true, true}, {257, 1.0f, 0, 1.0f, 0.2f, false, false},
      {50, 1.0f, 50, 0.001f, 0.0f, true, false}, {333, 1e-30f, 0, 1.0f, 0.0f, false, false},
  };
  std::mt19937 rng(5);
  for (int rep = 0; rep < 4; ++rep) {
    for (const FilterCase& c : cases) {
      std::vector<float> z(c.vocab);
      std::normal_distribution<float> normal(0.0f, 3.0f);
      for (int64_t v = 0; v < c.vocab; ++v) {
        z[v] = c.ties ? static_cast<float>(std::uniform_int_distribution<int>(0, 4)(rng))
                      : normal(rng);
        if (c.masked && v % 3 == 1) z[v] = -INFINITY;
      }
      std::vector<float> temp{c.temperature}, tp{c.top_p}, mp{c.min_p}, want(c.vocab);
      std::vector<int32_t> k{c.top_k};
      ApplySamplingFilters(F32(z, {1, c.vocab}), F32(temp, {1}),
                           TensorView::Contiguous(k.data(), DType::kInt32, {1}), F32(tp, {1}),
                           F32(mp, {1}), F32(want, {1, c.vocab}));
      std::vector<float> got(c.vocab, -1.0f);
      uint32_t counts[256];
      double masses[256];
      int64_t bad = -1;
      SerialRowOps ops;
      const int st = accept_logic::FilterRow(
          ops, c.vocab, [&](int64_t v) { return z[v]; }, c.temperature, c.top_k, c.top_p,
          c.min_p, got.data(), got.data(), counts, masses, &bad);
      ASSERT_EQ(st, accept_logic::kFilterOk);
      for (int64_t v = 0; v < c.vocab; ++v) {
        // Same support exactly; probabilities equal up to the rounding of the normaliser.
        ASSERT_EQ(got[v] > 0.0f, want[v] > 0.0f)
            << "vocab " << c.vocab << " k " << c.top_k << " p " << c.top_p << " token " << v;
        ASSERT_NEAR(got[v], want[v], 2e-7f * std::max(1.0f, want[v] * 8)) << "token " << v;
      }
    }
  }
}

TEST(CudaLogic, FilterStatusForBadRows) {
  SerialRowOps ops;
  uint32_t counts[256];
  double masses[256];
  std::vector<float> row = {0.0f, NAN, 1.0f}, out(3);
  int64_t bad = -1;
  EXPECT_EQ(accept_logic::FilterRow(ops, 3, [&](int64_t v) { return row[v]; }, 1.0f, 0, 1.0f,
                                    0.0f, out.data(), out.data(), counts, masses, &bad),
            accept_logic::kFilterBadValue);
  EXPECT_EQ(bad, 1);
  row = {-INFINITY, -INFINITY, -INFINITY};
  EXPECT_EQ(accept_logic::FilterRow(ops, 3, [&](int64_t v) { return row[v]; }, 1.0f, 0, 1.0f,
                                    0.0f, out.data(), out.data(), counts, masses, &bad),
            accept_logic::kFilterNoFinite);
}

// A random batch of trees with target/draft rows; modes cycle through greedy, sampled children
// (drawn from q without replacement) and deterministic children.
struct Batch {
  int64_t vocab;
  std::vector<float> target, draft;
  std::vector<int32_t> tokens, parents;
  std::vector<int64_t> indptr{0}, seeds, offsets;
  std::vector<uint8_t> greedy, sampled;
};

std::vector<float> RandomRow(int64_t V, std::mt19937& rng, float sharp) {
  std::vector<float> r(V);
  std::gamma_distribution<float> g(sharp, 1.0f);
  double s = 0;
  for (auto& x : r) s += (x = g(rng));
  for (auto& x : r) x = static_cast<float>(x / s);
  return r;
}

Batch MakeBatch(int64_t B, int64_t V, uint32_t seed) {
  std::mt19937 rng(seed);
  Batch bt;
  bt.vocab = V;
  for (int64_t b = 0; b < B; ++b) {
    const int mode = static_cast<int>(b % 3);
    const int n = std::uniform_int_distribution<int>(1, 24)(rng);
    std::vector<std::vector<int32_t>> kids(n);
    for (int i = 0; i < n; ++i) {
      // At most V - 1 children per node, so siblings can carry distinct tokens.
      int par = i == 0 ? -1 : std::uniform_int_distribution<int>(0, i - 1)(rng);
      while (par >= 0 && static_cast<int64_t>(kids[par].size()) >= V - 1) par = (par + 1) % i;
      bt.parents.push_back(par);
      if (par >= 0) kids[par].push_back(i);
    }
    std::vector<std::vector<float>> t_rows, d_rows;
    for (int i = 0; i < n; ++i) {
      // Sharp rows make acceptance likely enough to walk deep; flat ones make rejections.
      t_rows.push_back(RandomRow(V, rng, i % 2 ? 0.3f : 1.0f));
      d_rows.push_back(RandomRow(V, rng, 0.5f));
    }
    std::vector<int32_t> tok(n, 0);
    for (int i = 0; i < n; ++i) {
      // Children's tokens: distinct draws from the parent's draft row (sampled mode), the target's
      // likely tokens (greedy: sometimes the argmax) or random distinct ids.
      std::vector<float> q = d_rows[i];
      for (int c : kids[i]) {
        int32_t x;
        if (mode == 1) {
          std::discrete_distribution<int32_t> dist(q.begin(), q.end());
          x = dist(rng);
        } else {
          std::discrete_distribution<int32_t> dist(t_rows[i].begin(), t_rows[i].end());
          x = dist(rng);
          if (mode == 2) {
            while (q[x] == 0.0f) x = (x + 1) % V;  // distinct among siblings
          }
        }
        q[x] = 0.0f;
        tok[c] = x;
      }
    }
    for (int i = 0; i < n; ++i) {
      bt.tokens.push_back(tok[i]);
      bt.target.insert(bt.target.end(), t_rows[i].begin(), t_rows[i].end());
      bt.draft.insert(bt.draft.end(), d_rows[i].begin(), d_rows[i].end());
    }
    bt.indptr.push_back(bt.indptr.back() + n);
    bt.greedy.push_back(mode == 0);
    bt.sampled.push_back(mode == 1);
    bt.seeds.push_back(static_cast<int64_t>(rng()));
    bt.offsets.push_back(b * 7);
  }
  return bt;
}

void ExpectWalkMatchesCpu(Batch& bt, bool skip_residual) {
  const int64_t B = static_cast<int64_t>(bt.greedy.size());
  const int64_t N = static_cast<int64_t>(bt.tokens.size()), V = bt.vocab;
  const int64_t W = 26;
  std::vector<int32_t> nodes(B * W), emitted(B * W), count(B);
  AcceptOptions opt;
  opt.debug_skip_residual = skip_residual;
  TensorView draft = F32(bt.draft, {N, V});
  AcceptTreesArgs a;
  a.target = F32(bt.target, {N, V});
  a.draft_probs = draft;
  a.tokens = TensorView::Contiguous(bt.tokens.data(), DType::kInt32, {N});
  a.parents = TensorView::Contiguous(bt.parents.data(), DType::kInt32, {N});
  a.tree_indptr = TensorView::Contiguous(bt.indptr.data(), DType::kInt64, {B + 1});
  a.greedy = TensorView::Contiguous(bt.greedy.data(), DType::kUInt8, {B});
  a.sampled_children = TensorView::Contiguous(bt.sampled.data(), DType::kUInt8, {B});
  a.seeds = TensorView::Contiguous(bt.seeds.data(), DType::kInt64, {B});
  a.offsets = TensorView::Contiguous(bt.offsets.data(), DType::kInt64, {B});
  a.accepted_nodes = TensorView::Contiguous(nodes.data(), DType::kInt32, {B, W});
  a.emitted_tokens = TensorView::Contiguous(emitted.data(), DType::kInt32, {B, W});
  a.num_accepted = TensorView::Contiguous(count.data(), DType::kInt32, {B});
  a.options = opt;
  AcceptTrees(a);
  accept_logic::WalkInputs in{bt.target.data(), bt.draft.data(), bt.tokens.data(),
                              bt.parents.data(), bt.indptr.data(), V, 1e-3, skip_residual};
  std::vector<double> resid(V), qcur(V);
  int64_t accepted_total = 0;
  for (int64_t b = 0; b < B; ++b) {
    std::vector<int32_t> path(W, -1), emit(W, -1);
    int32_t len = 0;
    accept_logic::WalkError err{};
    SerialRowOps ops;
    const int st = accept_logic::WalkRequest(ops, in, b, bt.greedy[b] != 0, bt.sampled[b] != 0,
                                             static_cast<uint64_t>(bt.seeds[b]),
                                             static_cast<uint64_t>(bt.offsets[b]), resid.data(),
                                             qcur.data(), path.data(), emit.data(), &len,
                                             &err);
    ASSERT_EQ(st, accept_logic::kWalkOk) << "request " << b;
    ASSERT_EQ(len - 1, count[b]) << "request " << b;
    for (int64_t i = 0; i < W; ++i) {
      ASSERT_EQ(path[i], nodes[b * W + i]) << "request " << b << " path " << i;
      ASSERT_EQ(emit[i], emitted[b * W + i]) << "request " << b << " token " << i;
    }
    accepted_total += count[b];
  }
  EXPECT_GT(accepted_total, B / 4) << "the batch should accept drafts";
}

TEST(CudaLogic, WalkMatchesTheCpuOpInEveryMode) {
  for (uint32_t seed : {1u, 2u, 3u}) {
    Batch bt = MakeBatch(600, seed == 3 ? 5 : 97, seed);
    ExpectWalkMatchesCpu(bt, false);
  }
}

TEST(CudaLogic, WalkMatchesTheCpuOpWithTheResidualSkipped) {
  Batch bt = MakeBatch(300, 41, 9);
  ExpectWalkMatchesCpu(bt, true);
}

TEST(CudaLogic, WalkReportsBadRows) {
  Batch bt = MakeBatch(3, 11, 4);
  bt.target[3] = -0.5f;  // row 0 of request 0 (greedy)
  accept_logic::WalkInputs in{bt.target.data(), bt.draft.data(), bt.tokens.data(),
                              bt.parents.data(), bt.indptr.data(), 11, 1e-3, false};
  std::vector<double> resid(11), qcur(11);
  int32_t path[32], emit[32], len = 0;
  accept_logic::WalkError err{};
  SerialRowOps ops;
  EXPECT_EQ(accept_logic::WalkRequest(ops, in, 0, true, false, 1, 0, resid.data(), qcur.data(),
                                      path, emit, &len, &err),
            accept_logic::kWalkBadEntry);
  EXPECT_EQ(err.row, 0);
  EXPECT_EQ(err.token, 3);
  bt.target[3] = 0.5f;  // now the row sums to ~1.5
  EXPECT_EQ(accept_logic::WalkRequest(ops, in, 0, true, false, 1, 0, resid.data(), qcur.data(),
                                      path, emit, &len, &err),
            accept_logic::kWalkBadSum);
}

}  // namespace
}  // namespace pyspec
