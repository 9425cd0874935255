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
  AcceptTrees(tv, with_draft ? &dv : nullptr,
              TensorView::Contiguous(tokens.data(), DType::kInt32, {N}),
              TensorView::Contiguous(parents.data(), DType::kInt32, {N}),
              TensorView::Contiguous(indptr.data(), DType::kInt64, {B + 1}),
              TensorView::Contiguous(greedy.data(), DType::kUInt8, {B}),
              TensorView::Contiguous(sampled.data(), DType::kUInt8, {B}),
              TensorView::Contiguous(seeds.data(), DType::kInt64, {B}),
              TensorView::Contiguous(offsets.data(), DType::kInt64, {B}),
              TensorView::Contiguous(out_nodes.data(), DType::kInt32, {B, width}),
              TensorView::Contiguous(out_tokens.data(), DType::kInt32, {B, width}),
              TensorView::Contiguous(out_count.data(), DType::kInt32, {B}), opt, pool);
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

// ---- sampling filters -----------------------------------------------------------------------------

std::vector<float> Filter(const std::vector<float>& logits, int64_t vocab, float t, int32_t k, float p,
                          float m) {
  const int64_t n = static_cast<int64_t>(logits.size()) / vocab;
  std::vector<float> temp(n, t), tp(n, p), mp(n, m), out(n * vocab, -1.0f);
  std::vector<int32_t> tk(n, k);
  std::vector<float> in = logits;
  ApplySamplingFilters(TensorView::Contiguous(in.data(), DType::kFloat32, {n, vocab}),
                       TensorView::Contiguous(temp.data(), DType::kFloat32, {n}),
                       TensorView::Contiguous(tk.data(), DType::kInt32, {n}),
                       TensorView::Contiguous(tp.data(), DType::kFloat32, {n}),
                       TensorView::Contiguous(mp.data(), DType::kFloat32, {n}),
                       TensorView::Contiguous(out.data(), DType::kFloat32, {n, vocab}));
  return out;
}

int CountNonZero(const std::vector<float>& v) {
  return static_cast<int>(std::count_if(v.begin(), v.end(), [](float x) { return x != 0.0f; }));
}

TEST(AcceptFilters, TemperatureZeroIsOneHotAtLowestArgmax) {
  std::vector<float> out = Filter({1.0f, 3.0f, 3.0f, -2.0f}, 4, 0.0f, 2, 0.5f, 0.1f);
  EXPECT_EQ(out, (std::vector<float>{0.0f, 1.0f, 0.0f, 0.0f}));
}

TEST(AcceptFilters, NoFilterIsSoftmaxOfTemperedLogits) {
  std::vector<float> logits = {0.5f, -1.0f, 2.0f, 0.0f, -INFINITY};
  std::vector<float> out = Filter(logits, 5, 0.7f, 0, 1.0f, 0.0f);
  double z = 0;
  for (int v = 0; v < 4; ++v) z += std::exp(logits[v] / 0.7);
  for (int v = 0; v < 4; ++v) EXPECT_NEAR(out[v], std::exp(logits[v] / 0.7) / z, 1e-6);
  EXPECT_EQ(out[4], 0.0f);
}

TEST(AcceptFilters, TopKKeepsExactlyKWithLowIdsOnTies) {
  std::mt19937 rng(1);
  const int64_t V = 97;
  for (int32_t k : {1, 2, 5, 50, 96}) {
    std::vector<float> logits(V);
    for (float& x : logits) x = static_cast<float>(rng() % 7);  // many ties
    std::vector<float> out = Filter(logits, V, 1.3f, k, 1.0f, 0.0f);
    EXPECT_EQ(CountNonZero(out), k);
    // Reference: stable order by (logit desc, id asc), first k.
    std::vector<int> ids(V);
    std::iota(ids.begin(), ids.end(), 0);
    std::stable_sort(ids.begin(), ids.end(), [&](int a, int b) { return logits[a] > logits[b]; });
    for (int i = 0; i < V; ++i) EXPECT_EQ(out[ids[i]] != 0.0f, i < k) << "k=" << k << " rank " << i;
    EXPECT_NEAR(std::accumulate(out.begin(), out.end(), 0.0), 1.0, 1e-5);
  }
}

TEST(AcceptFilters, TopPBoundaryKeepsTheCrossingToken) {
  // probs (T=1) proportional to 4, 3, 2, 1 -> 0.4, 0.3, 0.2, 0.1.
  std::vector<float> logits = {std::log(3.0f), std::log(1.0f), std::log(4.0f), std::log(2.0f)};
  auto kept = [&](float p) { return CountNonZero(Filter(logits, 4, 1.0f, 0, p, 0.0f)); };
  EXPECT_EQ(kept(0.05f), 1);
  EXPECT_EQ(kept(0.39f), 1);
  EXPECT_EQ(kept(0.41f), 2);  // 0.4 < 0.41: the 0.3 token crosses it and is kept
  EXPECT_EQ(kept(0.69f), 2);
  EXPECT_EQ(kept(0.71f), 3);
  EXPECT_EQ(kept(0.95f), 4);
  std::vector<float> out = Filter(logits, 4, 1.0f, 0, 0.6f, 0.0f);
  EXPECT_NEAR(out[2], 4.0 / 7.0, 1e-6);
  EXPECT_NEAR(out[0], 3.0 / 7.0, 1e-6);
}

TEST(AcceptFilters, TopPMatchesSortedReferenceOnLargeRows) {
  std::mt19937 rng(2);
  std::normal_distribution<float> normal(0.0f, 2.0f);
  const int64_t V = 5000;
  for (float p : {0.1f, 0.5f, 0.9f, 0.999f}) {
    std::vector<float> logits(V);
    for (float& x : logits) x = normal(rng);
    std::vector<float> out = Filter(logits, V, 0.9f, 0, p, 0.0f);
    std::vector<int> ids(V);
    std::iota(ids.begin(), ids.end(), 0);
    std::stable_sort(ids.begin(), ids.end(), [&](int a, int b) { return logits[a] > logits[b]; });
    double z = 0, cum = 0;
    for (float x : logits) z += std::exp(x / 0.9);
    int expect = 0;
    while (cum < p * z) cum += std::exp(logits[ids[expect++]] / 0.9);
    EXPECT_EQ(CountNonZero(out), expect) << "p=" << p;
    for (int i = 0; i < expect; ++i) EXPECT_NE(out[ids[i]], 0.0f);
  }
}

TEST(AcceptFilters, TopKThenTopPThenMinP) {
  // probs 0.4, 0.3, 0.2, 0.1 (ids 2, 0, 3, 1).
  std::vector<float> logits = {std::log(3.0f), std::log(1.0f), std::log(4.0f), std::log(2.0f)};
  // top-k 3 -> {.4,.3,.2}/.9; top-p .75 on that: .444, .777 -> keeps 2 tokens.
  EXPECT_EQ(CountNonZero(Filter(logits, 4, 1.0f, 3, 0.75f, 0.0f)), 2);
  // min-p 0.45: keep p >= 0.18 -> ids 2, 0, 3.
  std::vector<float> out = Filter(logits, 4, 1.0f, 0, 1.0f, 0.45f);
  EXPECT_EQ(out[1], 0.0f);
  EXPECT_NEAR(out[2], 4.0 / 9.0, 1e-6);
  // min-p 0.76 keeps only the top token (0.3 / 0.4 = 0.75 < 0.76).
  EXPECT_EQ(CountNonZero(Filter(logits, 4, 1.0f, 0, 1.0f, 0.76f)), 1);
}

TEST(AcceptFilters, HalfAndBFloat16Inputs) {
  // 1.0, 2.0, -inf in fp16 and bf16.
  std::vector<uint16_t> half = {0x3C00, 0x4000, 0xFC00}, bf16 = {0x3F80, 0x4000, 0xFF80};
  std::vector<float> temp = {1.0f}, tp = {1.0f}, mp = {0.0f};
  std::vector<int32_t> tk = {0};
  for (auto* in : {&half, &bf16}) {
    std::vector<float> out(3);
    ApplySamplingFilters(
        TensorView::Contiguous(in->data(), in == &half ? DType::kFloat16 : DType::kBFloat16, {1, 3}),
        TensorView::Contiguous(temp.data(), DType::kFloat32, {1}),
        TensorView::Contiguous(tk.data(), DType::kInt32, {1}),
        TensorView::Contiguous(tp.data(), DType::kFloat32, {1}),
        TensorView::Contiguous(mp.data(), DType::kFloat32, {1}),
        TensorView::Contiguous(out.data(), DType::kFloat32, {1, 3}));
    EXPECT_NEAR(out[1], std::exp(2.0) / (std::exp(1.0) + std::exp(2.0)), 1e-6);
    EXPECT_EQ(out[2], 0.0f);
  }
}

TEST(AcceptFilters, BadInputThrowsValueError) {
  EXPECT_THROW(Filter({1.0f, NAN}, 2, 1.0f, 0, 1.0f, 0.0f), ValueError);
  EXPECT_THROW(Filter({-INFINITY, -INFINITY}, 2, 1.0f, 0, 1.0f, 0.0f), ValueError);
  EXPECT_THROW(Filter({1.0f, 2.0f}, 2, -1.0f, 0, 1.0f, 0.0f), ValueError);
  EXPECT_THROW(Filter({1.0f, 2.0f}, 2, 1.0f, -1, 1.0f, 0.0f), ValueError);
  EXPECT_THROW(Filter({1.0f, 2.0f}, 2, 1.0f, 0, 0.0f, 0.0f), ValueError);
  EXPECT_THROW(Filter({1.0f, 2.0f}, 2, 1.0f, 0, 1.0f, 1.5f), ValueError);
  std::vector<float> logits(4), temp(2), out(4);
  std::vector<int32_t> tk(2);
  EXPECT_THROW(ApplySamplingFilters(TensorView::Contiguous(logits.data(), DType::kFloat32, {2, 2}),
                                    TensorView::Contiguous(temp.data(), DType::kFloat32, {2}),
                                    TensorView::Contiguous(tk.data(), DType::kInt32, {2}),
                                    TensorView::Contiguous(temp.data(), DType::kFloat32, {1}),
                                    TensorView::Contiguous(temp.data(), DType::kFloat32, {2}),
                                    TensorView::Contiguous(out.data(), DType::kFloat32, {2, 2})),
               ValueError);
}

}  // namespace
}  // namespace pyspec
