#include "pyspec/acceptance.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <numeric>
#include <random>
#include <vector>

#include "pyspec/check.h"
#include "pyspec/philox.h"
#include "pyspec/thread_pool.h"

namespace pyspec {
namespace {

// ---- Philox ---------------------------------------------------------------------------------------

// Random123's known-answer vectors for Philox4x32-10 (its tests/kat_vectors).
TEST(AcceptPhilox, KnownAnswers) {
  struct Kat {
    PhiloxCounter ctr;
    PhiloxKey key;
    uint32_t out[4];
  };
  const Kat kats[] = {
      {{{0, 0, 0, 0}}, {{0, 0}}, {0x6627e8d5, 0xe169c58d, 0xbc57ac4c, 0x9b00dbd8}},
      {{{0xffffffff, 0xffffffff, 0xffffffff, 0xffffffff}},
       {{0xffffffff, 0xffffffff}},
       {0x408f276d, 0x41c83b0e, 0xa20bc7c6, 0x6d5451fd}},
      {{{0x243f6a88, 0x85a308d3, 0x13198a2e, 0x03707344}},
       {{0xa4093822, 0x299f31d0}},
       {0xd16cfe09, 0x94fdcceb, 0x5001e420, 0x24126ea1}},
  };
  for (const Kat& k : kats) {
    PhiloxCounter got = Philox4x32_10(k.ctr, k.key);
    for (int i = 0; i < 4; ++i) EXPECT_EQ(got.v[i], k.out[i]) << "word " << i;
  }
}

TEST(AcceptPhilox, UniformsAreInRangeAndRoughlyUniform) {
  double sum = 0.0;
  int buckets[10] = {};
  const int n = 100000;
  for (int i = 0; i < n; ++i) {
    double u = PhiloxUniform(1234, 7, static_cast<uint32_t>(i / 8), static_cast<uint32_t>(i % 8));
    ASSERT_GE(u, 0.0);
    ASSERT_LT(u, 1.0);
    sum += u;
    ++buckets[static_cast<int>(u * 10)];
  }
  EXPECT_NEAR(sum / n, 0.5, 0.005);
  for (int b : buckets) EXPECT_NEAR(b, n / 10, 600);  // ~6 sigma
  // Each coordinate changes the draw.
  const double u0 = PhiloxUniform(1, 2, 3, 4);
  EXPECT_NE(u0, PhiloxUniform(2, 2, 3, 4));
  EXPECT_NE(u0, PhiloxUniform(1, 3, 3, 4));
  EXPECT_NE(u0, PhiloxUniform(1, 2, 4, 4));
  EXPECT_NE(u0, PhiloxUniform(1, 2, 3, 5));
  EXPECT_NE(u0, PhiloxUniform(1, 2 + (uint64_t{1} << 32), 3, 4));  // high offset bits count
}

// ---- a small batch builder ------------------------------------------------------------------------

struct Request {
  std::vector<int32_t> parents;
  std::vector<int32_t> tokens;
  std::vector<std::vector<float>> target;  // one row per node
  std::vector<std::vector<float>> draft;   // empty: no draft rows
  bool greedy = false;
  bool sampled = false;
  int64_t seed = 0;
  int64_t offset = 0;
};

struct Result {
  std::vector<std::vector<int32_t>> nodes, emitted;  // -1 padding stripped
  std::vector<int32_t> num_accepted;
};

Result RunAccept(const std::vector<Request>& reqs, int64_t vocab, bool with_draft,
           AcceptOptions opt = AcceptOptions(), ThreadPool* pool = nullptr, int64_t width = -1) {
  std::vector<float> target, draft;
  std::vector<int32_t> tokens, parents;
  std::vector<int64_t> indptr = {0}, seeds, offsets;
  std::vector<uint8_t> greedy, sampled;
  int64_t max_nodes = 1;
  for (const Request& r : reqs) {
    for (size_t i = 0; i < r.parents.size(); ++i) {
      parents.push_back(r.parents[i]);
      tokens.push_back(r.tokens[i]);
      target.insert(target.end(), r.target[i].begin(), r.target[i].end());
      if (with_draft) {
        if (r.draft.empty()) {
          draft.insert(draft.end(), r.target[i].begin(), r.target[i].end());
        } else {
          draft.insert(draft.end(), r.draft[i].begin(), r.draft[i].end());
        }
      }
    }
    indptr.push_back(static_cast<int64_t>(parents.size()));
    max_nodes = std::max<int64_t>(max_nodes, r.parents.size());
    greedy.push_back(r.greedy);
    sampled.push_back(r.sampled);
    seeds.push_back(r.seed);
    offsets.push_back(r.offset);
  }
  const int64_t B = static_cast<int64_t>(reqs.size()), N = static_cast<int64_t>(parents.size());
  if (width < 0) width = max_nodes;
  std::vector<int32_t> out_nodes(B * width), out_tokens(B * width), out_count(B);
  TensorView tv = TensorView::Contiguous(target.data(), DType::kFloat32, {N, vocab});
  TensorView dv = TensorView::Contiguous(draft.data(), DType::kFloat32, {N, vocab});
  AcceptTreesArgs a;
  a.target = tv;
  if (with_draft) a.draft_probs = dv;
  a.tokens = TensorView::Contiguous(tokens.data(), DType::kInt32, {N});
  a.parents = TensorView::Contiguous(parents.data(), DType::kInt32, {N});
  a.tree_indptr = TensorView::Contiguous(indptr.data(), DType::kInt64, {B + 1});
  a.greedy = TensorView::Contiguous(greedy.data(), DType::kUInt8, {B});
  a.sampled_children = TensorView::Contiguous(sampled.data(), DType::kUInt8, {B});
  a.seeds = TensorView::Contiguous(seeds.data(), DType::kInt64, {B});
  a.offsets = TensorView::Contiguous(offsets.data(), DType::kInt64, {B});
  a.accepted_nodes = TensorView::Contiguous(out_nodes.data(), DType::kInt32, {B, width});
  a.emitted_tokens = TensorView::Contiguous(out_tokens.data(), DType::kInt32, {B, width});
  a.num_accepted = TensorView::Contiguous(out_count.data(), DType::kInt32, {B});
  a.options = opt;
  AcceptTrees(a, pool);
  Result res;
  res.num_accepted = out_count;
  for (int64_t b = 0; b < B; ++b) {
    std::vector<int32_t> n, t;
    for (int64_t w = 0; w < width; ++w) {
      if (out_nodes[b * width + w] >= 0) n.push_back(out_nodes[b * width + w]);
      if (out_tokens[b * width + w] >= 0) t.push_back(out_tokens[b * width + w]);
    }
    // Padding is only at the end.
    for (int64_t w = static_cast<int64_t>(n.size()); w < width; ++w) EXPECT_EQ(out_nodes[b * width + w], -1);
    for (int64_t w = static_cast<int64_t>(t.size()); w < width; ++w) EXPECT_EQ(out_tokens[b * width + w], -1);
    EXPECT_EQ(t.size(), n.size()) << "emitted = accepted + 1 and the path includes the root";
    res.nodes.push_back(n);
    res.emitted.push_back(t);
  }
  return res;
}

std::vector<float> OneHotish(int64_t vocab, int32_t top, float mass = 0.6f) {
  std::vector<float> row(vocab, (1.0f - mass) / static_cast<float>(vocab - 1));
  row[top] = mass;
  return row;
}

// A chain whose target argmax after node i is argmax[i].
Request GreedyChain(int64_t vocab, std::vector<int32_t> tokens, std::vector<int32_t> argmax) {
  Request r;
  r.greedy = true;
  r.tokens = tokens;
  for (size_t i = 0; i < tokens.size(); ++i) {
    r.parents.push_back(static_cast<int32_t>(i) - 1);
    r.target.push_back(OneHotish(vocab, argmax[i]));
  }
  return r;
}

// ---- greedy -----------------------------------------------------------------------------------------

TEST(AcceptGreedy, FullAcceptThenBonus) {
  Result r = RunAccept({GreedyChain(5, {4, 2, 3, 1}, {2, 3, 1, 4})}, 5, false);
  EXPECT_EQ(r.nodes[0], (std::vector<int32_t>{0, 1, 2, 3}));
  EXPECT_EQ(r.emitted[0], (std::vector<int32_t>{2, 3, 1, 4}));  // 3 accepted + bonus 4
  EXPECT_EQ(r.num_accepted[0], 3);
}

TEST(AcceptGreedy, MissAtFirstPosition) {
  Result r = RunAccept({GreedyChain(5, {0, 2, 3, 1}, {0, 3, 1, 4})}, 5, false);
  EXPECT_EQ(r.nodes[0], (std::vector<int32_t>{0}));
  EXPECT_EQ(r.emitted[0], (std::vector<int32_t>{0}));  // recovered: the target's own choice
  EXPECT_EQ(r.num_accepted[0], 0);
}

TEST(AcceptGreedy, MissInTheMiddleOfABatch) {
  std::vector<Request> reqs = {
      GreedyChain(7, {0, 1, 2}, {1, 2, 6}),        // full accept, bonus 6
      GreedyChain(7, {0, 4, 5, 6}, {4, 3, 6, 0}),  // accepts 4, misses 5 -> recovered 3
      GreedyChain(7, {0, 6}, {6, 5}),              // full accept, bonus 5
  };
  Result r = RunAccept(reqs, 7, false);
  EXPECT_EQ(r.emitted[0], (std::vector<int32_t>{1, 2, 6}));
  EXPECT_EQ(r.emitted[1], (std::vector<int32_t>{4, 3}));
  EXPECT_EQ(r.nodes[1], (std::vector<int32_t>{0, 1}));
  EXPECT_EQ(r.emitted[2], (std::vector<int32_t>{6, 5}));
  EXPECT_EQ(r.num_accepted, (std::vector<int32_t>{2, 1, 1}));
}

TEST(AcceptGreedy, RootOnlyTree) {
  Result r = RunAccept({GreedyChain(4, {3}, {2})}, 4, false);
  EXPECT_EQ(r.nodes[0], (std::vector<int32_t>{0}));
  EXPECT_EQ(r.emitted[0], (std::vector<int32_t>{2}));
  EXPECT_EQ(r.num_accepted[0], 0);
}

TEST(AcceptGreedy, BranchyTreeSecondChildMatches) {
  // root -> {1: tok 1, 2: tok 3, 3: tok 4}; node 2 -> {4: tok 0, 5: tok 2}; node 5 is a leaf.
  Request r;
  r.greedy = true;
  r.parents = {-1, 0, 0, 0, 2, 2};
  r.tokens = {0, 1, 3, 4, 0, 2};
  const int32_t argmax[] = {3, 0, 2, 0, 0, 1};
  for (int i = 0; i < 6; ++i) r.target.push_back(OneHotish(6, argmax[i]));
  Result res = RunAccept({r}, 6, false);
  EXPECT_EQ(res.nodes[0], (std::vector<int32_t>{0, 2, 5}));
  EXPECT_EQ(res.emitted[0], (std::vector<int32_t>{3, 2, 1}));
  EXPECT_EQ(res.num_accepted[0], 2);
}

TEST(AcceptGreedy, TiesPickTheLowestTokenId) {
  Request r;
  r.greedy = true;
  r.parents = {-1, 0};
  r.tokens = {0, 2};
  r.target = {{0.1f, 0.4f, 0.4f, 0.1f}, {0.25f, 0.25f, 0.25f, 0.25f}};
  Result res = RunAccept({r}, 4, false);
  EXPECT_EQ(res.emitted[0], (std::vector<int32_t>{1}));  // 1 and 2 tie: 1 wins, child 2 missed
}

// ---- stochastic, hand-checkable cases -----------------------------------------------------------

TEST(AcceptStochastic, EqualTargetAndDraftAcceptsEverything) {
  std::mt19937 rng(3);
  std::vector<Request> reqs;
  for (int b = 0; b < 64; ++b) {
    Request r;
    r.sampled = true;
    r.seed = b;
    r.parents = {-1, 0, 1, 2};
    r.tokens = {0, int32_t(rng() % 6), int32_t(rng() % 6), int32_t(rng() % 6)};
    for (int i = 0; i < 4; ++i) {
      std::vector<float> row(6);
      for (float& x : row) x = 0.05f + static_cast<float>(rng() % 100) / 100.0f;
      float s = std::accumulate(row.begin(), row.end(), 0.0f);
      for (float& x : row) x /= s;
      r.target.push_back(row);
    }
    reqs.push_back(r);
  }
  Result res = RunAccept(reqs, 6, /*with_draft=*/true);  // draft rows = target rows
  for (int b = 0; b < 64; ++b) EXPECT_EQ(res.num_accepted[b], 3) << b;
}

TEST(AcceptStochastic, ZeroTargetMassRejectsAndRecoversFromResidual) {
  // p = [0, .5, .5], q = [1, 0, 0], child token 0: always rejected; residual = [0, .5, .5].
  std::vector<Request> reqs;
  for (int b = 0; b < 200; ++b) {
    Request r;
    r.sampled = true;
    r.seed = 1000 + b;
    r.parents = {-1, 0};
    r.tokens = {0, 0};
    r.target = {{0.0f, 0.5f, 0.5f}, {1.0f, 0.0f, 0.0f}};
    r.draft = {{1.0f, 0.0f, 0.0f}, {1.0f, 0.0f, 0.0f}};
    reqs.push_back(r);
  }
  Result res = RunAccept(reqs, 3, true);
  int ones = 0;
  for (int b = 0; b < 200; ++b) {
    ASSERT_EQ(res.num_accepted[b], 0);
    ASSERT_EQ(res.emitted[b].size(), 1u);
    ASSERT_NE(res.emitted[b][0], 0);
    ones += res.emitted[b][0] == 1;
  }
  EXPECT_GT(ones, 60);
  EXPECT_LT(ones, 140);
}

TEST(AcceptStochastic, TargetOnlyWalkFollowsTheChildHoldingTheSampledToken) {
  // Deterministic children {0, 1} of the root; p = [.5, .5, 0, 0]: the sampled token is 0 or 1
  // with probability .5 each and the walk moves to the child holding it (both are children).
  std::vector<Request> reqs;
  for (int b = 0; b < 400; ++b) {
    Request r;
    r.seed = b;
    r.offset = 5;
    r.parents = {-1, 0, 0};
    r.tokens = {3, 0, 1};
    r.target = {{0.5f, 0.5f, 0.0f, 0.0f}, {0.0f, 0.0f, 0.0f, 1.0f}, {0.0f, 0.0f, 1.0f, 0.0f}};
    reqs.push_back(r);
  }
  Result res = RunAccept(reqs, 4, false);
  int first = 0;
  for (int b = 0; b < 400; ++b) {
    ASSERT_EQ(res.num_accepted[b], 1);
    if (res.nodes[b][1] == 1) {
      ++first;
      EXPECT_EQ(res.emitted[b], (std::vector<int32_t>{0, 3}));
    } else {
      EXPECT_EQ(res.emitted[b], (std::vector<int32_t>{1, 2}));
    }
  }
  EXPECT_GT(first, 150);
  EXPECT_LT(first, 250);
}

TEST(AcceptStochastic, TargetOnlyWalkEmitsWhatPlainSamplingWould) {
  // A Markov-chain target (the row after token x is T[x]). Per request: plain sampling one token
  // per call (root-only trees at positions 20, 21, ...) versus speculative calls with random
  // deterministic trees, some children holding the plain token. Draws are keyed by position, so
  // every request's speculative output equals its plain output token for token, however the
  // tokens were split into calls. (Keying by call or by tree node would break this.)
  constexpr int64_t V = 6;
  std::mt19937 rng(21);
  std::vector<std::vector<float>> T(V, std::vector<float>(V));
  for (auto& row : T) {
    float s = 0.0f;
    for (float& x : row) s += x = 0.05f + static_cast<float>(rng() % 100);
    for (float& x : row) x /= s;
  }
  constexpr int kRequests = 200, kTokens = 12, kStart = 20;
  std::vector<std::vector<int32_t>> plain(kRequests);
  for (int b = 0; b < kRequests; ++b) {
    int32_t last = b % V;
    for (int i = 0; i < kTokens; ++i) {
      Request r;
      r.seed = 1000 + b;
      r.offset = kStart + i;
      r.parents = {-1};
      r.tokens = {last};
      r.target = {T[last]};
      last = RunAccept({r}, V, false).emitted[0][0];
      plain[b].push_back(last);
    }
  }
  int64_t accepted = 0;
  for (int b = 0; b < kRequests; ++b) {
    std::vector<int32_t> out;
    int32_t last = b % V;
    while (static_cast<int>(out.size()) < kTokens) {
      Request r;
      r.seed = 1000 + b;
      r.offset = kStart + static_cast<int64_t>(out.size());
      r.parents = {-1};
      r.tokens = {last};
      r.target = {T[last]};
      // A random tree of up to 8 nodes; a child holds the plain token at its depth half the time.
      const int n = 1 + static_cast<int>(rng() % 8);
      std::vector<int> depth = {0};
      for (int i = 1; i < n; ++i) {
        const int parent = static_cast<int>(rng() % i);
        const size_t at = out.size() + depth[parent];
        int32_t tok = static_cast<int32_t>(rng() % V);
        if (rng() % 2 == 0 && at < plain[b].size()) tok = plain[b][at];
        r.parents.push_back(parent);
        r.tokens.push_back(tok);
        r.target.push_back(T[tok]);
        depth.push_back(depth[parent] + 1);
      }
      Result res = RunAccept({r}, V, false);
      accepted += res.num_accepted[0];
      for (int32_t t : res.emitted[0]) out.push_back(t);
      last = out.back();
    }
    out.resize(kTokens);
    ASSERT_EQ(out, plain[b]) << "request " << b;
  }
  EXPECT_GT(accepted, kRequests * 2) << "the trees should be accepted often";
}

// ---- determinism and batch independence ---------------------------------------------------------

std::vector<Request> RandomBatch(int batch, int64_t vocab, uint32_t seed) {
  std::mt19937 rng(seed);
  auto row = [&] {
    std::vector<float> r(vocab);
    double s = 0;
    for (float& x : r) {
      x = (rng() % 4 == 0) ? 0.0f : static_cast<float>(rng() % 1000 + 1);
      s += x;
    }
    if (s == 0) r[0] = 1.0f, s = 1.0;
    for (float& x : r) x = static_cast<float>(x / s);
    return r;
  };
  std::vector<Request> reqs;
  for (int b = 0; b < batch; ++b) {
    Request r;
    int n = 1 + static_cast<int>(rng() % 12);
    r.parents.push_back(-1);
    r.tokens.push_back(0);
    for (int i = 1; i < n; ++i) {
      r.parents.push_back(static_cast<int32_t>(rng() % i));
      r.tokens.push_back(static_cast<int32_t>(rng() % vocab));
    }
    for (int i = 0; i < n; ++i) r.target.push_back(row());
    r.greedy = b % 5 == 0;
    r.sampled = false;
    r.seed = static_cast<int64_t>(rng());
    r.offset = b;
    reqs.push_back(r);
  }
  return reqs;
}

TEST(AcceptDeterminism, SameSeedsSameOutputAnyThreadCount) {
  auto reqs = RandomBatch(300, 17, 11);
  ThreadPool one(1), four(4);
  Result a = RunAccept(reqs, 17, false, AcceptOptions(), &one);
  Result b = RunAccept(reqs, 17, false, AcceptOptions(), &four);
  Result c = RunAccept(reqs, 17, false);
  EXPECT_EQ(a.emitted, b.emitted);
  EXPECT_EQ(a.nodes, b.nodes);
  EXPECT_EQ(a.emitted, c.emitted);
  // A new step (offset) draws fresh numbers.
  for (auto& r : reqs) r.offset += 1000;
  Result d = RunAccept(reqs, 17, false);
  EXPECT_NE(a.emitted, d.emitted);
}

TEST(AcceptDeterminism, RequestIndependentOfTheRestOfTheBatch) {
  auto reqs = RandomBatch(120, 13, 5);
  Result full = RunAccept(reqs, 13, false);
  // Reverse the batch, drop every third request and replace others: each surviving request keeps
  // its output.
  std::vector<Request> other;
  std::vector<int> from;
  auto extra = RandomBatch(40, 13, 99);
  for (int b = 119; b >= 0; --b) {
    if (b % 3 == 0) continue;
    other.push_back(reqs[b]);
    from.push_back(b);
    if (b % 7 == 0) {
      other.push_back(extra[b % 40]);
      from.push_back(-1);
    }
  }
  Result part = RunAccept(other, 13, false);
  for (size_t i = 0; i < from.size(); ++i) {
    if (from[i] < 0) continue;
    EXPECT_EQ(part.emitted[i], full.emitted[from[i]]) << "request " << from[i];
    EXPECT_EQ(part.nodes[i], full.nodes[from[i]]);
  }
}

// ---- bad input ------------------------------------------------------------------------------------

TEST(AcceptErrors, BadInputThrowsValueError) {
  Request good;
  good.parents = {-1, 0};
  good.tokens = {0, 1};
  good.target = {{0.5f, 0.5f}, {0.5f, 0.5f}};
  EXPECT_NO_THROW(RunAccept({good}, 2, false));

  Request r = good;
  r.target[0] = {0.5f, 0.4f};  // sum 0.9
  EXPECT_THROW(RunAccept({r}, 2, false), ValueError);
  r = good;
  r.target[0] = {NAN, 1.0f};
  EXPECT_THROW(RunAccept({r}, 2, false), ValueError);
  r = good;
  r.target[0] = {1.5f, -0.5f};
  EXPECT_THROW(RunAccept({r}, 2, false), ValueError);
  r = good;
  r.tokens[1] = 2;  // out of [0, V)
  EXPECT_THROW(RunAccept({r}, 2, false), ValueError);
  r = good;
  r.parents[1] = 1;
  EXPECT_THROW(RunAccept({r}, 2, false), ValueError);
  r = good;
  r.sampled = true;  // without draft_probs
  EXPECT_THROW(RunAccept({r}, 2, false), ValueError);
  r.draft = {{1.0f, 0.0f}, {0.5f, 0.5f}};  // child token 1 has q = 0
  EXPECT_THROW(RunAccept({r}, 2, true), ValueError);
  // Duplicate sibling tokens cannot come from sampling without replacement.
  Request dup;
  dup.sampled = true;
  dup.parents = {-1, 0, 0};
  dup.tokens = {0, 1, 1};
  dup.target = {{1.0f, 0.0f}, {0.5f, 0.5f}, {0.5f, 0.5f}};  // p(1) = 0: both children rejected
  dup.draft = {{0.5f, 0.5f}, {0.5f, 0.5f}, {0.5f, 0.5f}};
  EXPECT_THROW(RunAccept({dup}, 2, true), ValueError);
  // Output too narrow for the tree depth.
  EXPECT_THROW(RunAccept({good}, 2, false, AcceptOptions(), nullptr, /*width=*/1), ValueError);

  // Rows the walk never reads are not validated: a rejected-at-root request never reads row 1.
  Request lazy = good;
  lazy.greedy = true;
  lazy.target = {{1.0f, 0.0f}, {7.0f, 7.0f}};
  EXPECT_NO_THROW(RunAccept({lazy}, 2, false));
}

// ---- greedy from logits -------------------------------------------------------------------------

// The greedy walk straight from logits (AcceptOptions::target_is_logits) against the walk over the
// temperature-0 rows the filters make of the same logits, on random trees of random batches, with
// ties (a few distinct values) and -inf entries.
TEST(AcceptGreedyLogits, EqualsTheWalkOverOneHotRows) {
  std::mt19937 rng(5);
  const int64_t V = 37;
  for (int trial = 0; trial < 50; ++trial) {
    std::vector<Request> one_hot, logits;
    const int batch = 1 + static_cast<int>(rng() % 5);
    for (int b = 0; b < batch; ++b) {
      Request r;
      r.greedy = true;
      const int n = 1 + static_cast<int>(rng() % 9);
      for (int i = 0; i < n; ++i) {
        r.parents.push_back(i == 0 ? -1 : static_cast<int32_t>(rng() % i));
        r.tokens.push_back(static_cast<int32_t>(rng() % 4));  // small ids: children often hit
        std::vector<float> z(V);
        for (float& x : z) x = (rng() % 8 == 0) ? -INFINITY : static_cast<float>(rng() % 5);
        z[rng() % V] = 2.0f;  // at least one finite entry
        r.target.push_back(z);
      }
      logits.push_back(r);
      for (auto& row : r.target) {
        std::vector<float> p(V, 0.0f);
        p[std::max_element(row.begin(), row.end()) - row.begin()] = 1.0f;  // first maximum
        row = p;
      }
      one_hot.push_back(r);
    }
    AcceptOptions opt;
    opt.target_is_logits = true;
    const Result want = RunAccept(one_hot, V, false);
    const Result got = RunAccept(logits, V, false, opt);
    EXPECT_EQ(got.nodes, want.nodes) << "trial " << trial;
    EXPECT_EQ(got.emitted, want.emitted) << "trial " << trial;
    EXPECT_EQ(got.num_accepted, want.num_accepted) << "trial " << trial;
  }
}

TEST(AcceptGreedyLogits, BadRowsAndNonGreedyRequestsThrow) {
  AcceptOptions opt;
  opt.target_is_logits = true;
  Request r = GreedyChain(4, {0, 1}, {1, 2});
  r.target[0] = {0.0f, NAN, 1.0f, 0.0f};
  EXPECT_THROW(RunAccept({r}, 4, false, opt), ValueError);
  r.target[0] = {0.0f, INFINITY, 1.0f, 0.0f};
  EXPECT_THROW(RunAccept({r}, 4, false, opt), ValueError);
  r.target[0] = {-INFINITY, -INFINITY, -INFINITY, -INFINITY};
  EXPECT_THROW(RunAccept({r}, 4, false, opt), ValueError);
  Request s = GreedyChain(4, {0, 1}, {1, 2});
  s.greedy = false;
  EXPECT_THROW(RunAccept({s}, 4, false, opt), ValueError);
  s.greedy = true;
  EXPECT_THROW(RunAccept({s}, 4, true, opt), ValueError);  // draft rows given
}

TEST(AcceptGreedyLogits, BadRowsThrowEvenWhereTheWalkDoesNotGo) {
  AcceptOptions opt;
  opt.target_is_logits = true;
  // The root's argmax (1) misses the child (token 3): the walk reads row 0 only.
  Request r = GreedyChain(4, {0, 3}, {1, 2});
  EXPECT_EQ(RunAccept({r}, 4, false, opt).num_accepted[0], 0);
  for (float bad : {NAN, INFINITY}) {
    Request b = r;
    b.target[1][2] = bad;
    EXPECT_THROW(RunAccept({b}, 4, false, opt), ValueError);
    EXPECT_THROW(RunAccept({GreedyChain(4, {0, 1}, {1, 2}), b}, 4, false, opt), ValueError);
  }
  Request all_inf = r;
  all_inf.target[1] = {-INFINITY, -INFINITY, -INFINITY, -INFINITY};
  EXPECT_THROW(RunAccept({all_inf}, 4, false, opt), ValueError);
}

}  // namespace
}  // namespace pyspec
