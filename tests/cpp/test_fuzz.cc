// Randomized property tests ("fuzz" tests without libFuzzer) of the C++ core: the token-tree ops
// (tree.h), the block manager (block_manager.h) against a simple model, and the acceptance ops
// (acceptance.h: AcceptTrees, ApplySamplingFilters) on random and malformed inputs.
//
// Every case is generated from its own seed, so a failure names the seed that reproduces it. The
// default case counts keep the whole file to a few seconds in a Release build; the sanitizer build
// (PYSPEC_SANITIZE=ON) runs the same cases, so an out-of-bounds read or undefined behaviour on any
// of these inputs fails there. Environment:
//   PYSPEC_FUZZ_ITERS=N   run N cases per test instead of each test's default (longer runs)
//   PYSPEC_FUZZ_SEED=S    base seed (default 0): case i uses seed S * 1000003 + i
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <exception>
#include <limits>
#include <map>
#include <numeric>
#include <random>
#include <set>
#include <string>
#include <utility>
#include <vector>

#include "pyspec/acceptance.h"
#include "pyspec/attention.h"
#include "pyspec/block_manager.h"
#include "pyspec/check.h"
#include "pyspec/thread_pool.h"
#include "pyspec/tree.h"

namespace pyspec {
namespace {

constexpr float kInf = std::numeric_limits<float>::infinity();
constexpr float kNaN = std::numeric_limits<float>::quiet_NaN();

int64_t FuzzIters(int64_t default_iters) {
  const char* e = std::getenv("PYSPEC_FUZZ_ITERS");
  if (e != nullptr && *e != '\0') {
    const long long v = std::atoll(e);
    if (v > 0) return v;
  }
  return default_iters;
}

uint64_t CaseSeed(int64_t i) {
  const char* e = std::getenv("PYSPEC_FUZZ_SEED");
  const uint64_t base = (e != nullptr && *e != '\0') ? std::strtoull(e, nullptr, 10) : 0;
  return base * 1000003ull + static_cast<uint64_t>(i);
}

// Runs case(seed, i) for every case; stops at the first failing case and names its seed.
template <typename F>
void RunCases(int64_t default_iters, F&& one_case) {
  const int64_t n = FuzzIters(default_iters);
  for (int64_t i = 0; i < n; ++i) {
    const uint64_t seed = CaseSeed(i);
    try {
      one_case(seed);
    } catch (const std::exception& e) {
      ADD_FAILURE() << "unexpected exception: " << e.what();
    }
    if (::testing::Test::HasFailure()) {
      ADD_FAILURE() << "failing case " << i << " (seed " << seed
                    << "; PYSPEC_FUZZ_SEED and PYSPEC_FUZZ_ITERS reproduce it)";
      return;
    }
  }
}

struct Rng {
  explicit Rng(uint64_t seed) : g(seed * 0x9e3779b97f4a7c15ull + 12345) {}
  int64_t Int(int64_t lo, int64_t hi) {  // inclusive
    return std::uniform_int_distribution<int64_t>(lo, hi)(g);
  }
  bool Chance(double p) { return std::uniform_real_distribution<double>(0.0, 1.0)(g) < p; }
  double Real() { return std::uniform_real_distribution<double>(0.0, 1.0)(g); }
  template <typename T>
  const T& Pick(const std::vector<T>& v) {
    return v[static_cast<size_t>(Int(0, static_cast<int64_t>(v.size()) - 1))];
  }
  std::mt19937_64 g;
};

// ==== token trees ================================================================================

// A random parent array with n nodes in one of several shapes (wide, deep, local, k-ary).
std::vector<int32_t> RandomParents(Rng& rng, int n) {
  std::vector<int32_t> parents(n);
  parents[0] = -1;
  const int style = static_cast<int>(rng.Int(0, 3));
  const int k = static_cast<int>(rng.Int(1, 5));
  for (int i = 1; i < n; ++i) {
    switch (style) {
      case 0: parents[i] = static_cast<int32_t>(rng.Int(0, i - 1)); break;
      case 1: parents[i] = rng.Chance(0.85) ? i - 1 : static_cast<int32_t>(rng.Int(0, i - 1)); break;
      case 2: parents[i] = static_cast<int32_t>(rng.Int(std::max(0, i - 3), i - 1)); break;
      default: parents[i] = (i - 1) / k; break;
    }
  }
  return parents;
}

int RandomTreeSize(Rng& rng) {
  const int r = static_cast<int>(rng.Int(0, 9));
  if (r < 6) return static_cast<int>(rng.Int(1, 24));
  if (r < 9) return static_cast<int>(rng.Int(1, 100));
  return static_cast<int>(rng.Int(200, TokenTree::kMaxNodes));
}

// Depth of every node by walking the parent array (the model).
std::vector<int32_t> NaiveDepths(const std::vector<int32_t>& parents) {
  std::vector<int32_t> d(parents.size(), 0);
  for (size_t i = 1; i < parents.size(); ++i) d[i] = d[parents[i]] + 1;
  return d;
}

// rank_is_position: ranks are the child-list positions (FromParents); FromPaths keeps the declared
// ranks instead (a path may skip a rank), which the caller checks.
void CheckTree(const TokenTree& t, const std::vector<int32_t>& parents,
               const std::vector<int32_t>& tokens, bool rank_is_position = true) {
  const int n = static_cast<int>(parents.size());
  ASSERT_EQ(t.num_nodes(), n);
  EXPECT_EQ(t.parents(), parents);
  if (tokens.empty()) {
    EXPECT_EQ(t.tokens(), std::vector<int32_t>(n, -1));
  } else {
    EXPECT_EQ(t.tokens(), tokens);
  }
  const std::vector<int32_t> depth = NaiveDepths(parents);
  EXPECT_EQ(t.depths(), depth);
  EXPECT_EQ(t.max_depth(), *std::max_element(depth.begin(), depth.end()));
  // Children: in increasing order, each child's parent is the node, ranks are the list positions.
  int total_children = 0;
  bool chain = true;
  for (int i = 0; i < n; ++i) {
    const int32_t* b = t.children_begin(i);
    const int32_t* e = t.children_end(i);
    ASSERT_EQ(e - b, t.num_children(i));
    ASSERT_GE(t.num_children(i), 0);
    chain = chain && t.num_children(i) <= 1;
    total_children += t.num_children(i);
    for (const int32_t* c = b; c != e; ++c) {
      ASSERT_GT(*c, i);
      ASSERT_LT(*c, n);
      EXPECT_EQ(parents[*c], i);
      if (rank_is_position) EXPECT_EQ(t.ranks()[*c], c - b);
      if (c != b) EXPECT_LT(c[-1], c[0]);
    }
  }
  EXPECT_EQ(total_children, n - 1);
  EXPECT_EQ(t.ranks()[0], 0);
  EXPECT_EQ(t.is_chain(), chain);
  // Ancestor masks and paths against the parent walk; no bit set past the node count.
  for (int i = 0; i < n; ++i) {
    std::vector<int32_t> walk;
    for (int j = i; j >= 0; j = parents[j]) walk.push_back(j);
    std::reverse(walk.begin(), walk.end());
    EXPECT_EQ(t.PathTo(i), walk);
    std::vector<uint64_t> want(TokenTree::kMaskWords, 0);
    for (int32_t j : walk) want[j >> 6] |= uint64_t{1} << (j & 63);
    for (int w = 0; w < TokenTree::kMaskWords; ++w) {
      ASSERT_EQ(t.ancestor_mask(i)[w], want[w]) << "node " << i << " word " << w;
    }
  }
  for (int probe = 0; probe < 8; ++probe) {
    const int a = probe % std::max(1, n), b = (probe * 7 + 3) % n;
    bool anc = false;
    for (int j = b; j >= 0; j = parents[j]) anc = anc || j == a;
    EXPECT_EQ(t.IsAncestorOrSelf(a, b), anc);
  }
  EXPECT_THROW(t.PathTo(n), ValueError);
  EXPECT_THROW(t.PathTo(-1), ValueError);
  // Rank paths: one per non-root node, as long as its depth; FromPaths gives the same set in its
  // canonical order (depth, then lexicographic), which is a fixed point.
  const auto paths = t.ToPaths();
  ASSERT_EQ(static_cast<int>(paths.size()), n - 1);
  for (int i = 1; i < n; ++i) EXPECT_EQ(static_cast<int>(paths[i - 1].size()), depth[i]);
  const TokenTree u = TokenTree::FromPaths(paths);
  ASSERT_EQ(u.num_nodes(), n);
  auto a = paths, b = u.ToPaths();
  std::sort(a.begin(), a.end());
  std::sort(b.begin(), b.end());
  EXPECT_EQ(a, b);
  EXPECT_TRUE(std::is_sorted(u.depths().begin(), u.depths().end()));
  EXPECT_EQ(TokenTree::FromPaths(u.ToPaths()).ToPaths(), u.ToPaths());
  EXPECT_EQ(u.max_depth(), t.max_depth());
}

TEST(FuzzTree, RandomTreesMatchTheParentWalk) {
  RunCases(1500, [](uint64_t seed) {
    Rng rng(seed);
    const int n = RandomTreeSize(rng);
    const std::vector<int32_t> parents = RandomParents(rng, n);
    std::vector<int32_t> tokens;
    if (rng.Chance(0.5)) {
      tokens.resize(n);
      for (auto& x : tokens) x = static_cast<int32_t>(rng.Int(-5, 1000));
    }
    const std::vector<int32_t> depth = NaiveDepths(parents);
    if (*std::max_element(depth.begin(), depth.end()) > TokenTree::kMaxDepth) {
      EXPECT_THROW(TokenTree::FromParents(parents, tokens), ValueError);
      return;
    }
    TokenTree t = TokenTree::FromParents(parents, tokens);
    CheckTree(t, parents, tokens);
    // SetTokens: one per node, else a ValueError that changes nothing.
    std::vector<int32_t> other(n + (rng.Chance(0.5) ? 1 : -1));
    EXPECT_THROW(t.SetTokens(other), ValueError);
    other.assign(n, 7);
    t.SetTokens(other);
    EXPECT_EQ(t.tokens(), other);
  });
}

TEST(FuzzTree, MalformedParentsAreValueErrors) {
  RunCases(3000, [](uint64_t seed) {
    Rng rng(seed);
    int n = static_cast<int>(rng.Int(1, 40));
    std::vector<int32_t> parents(n);
    for (int i = 0; i < n; ++i) parents[i] = i == 0 ? -1 : static_cast<int32_t>(rng.Int(0, i - 1));
    std::vector<int32_t> tokens;
    const int what = static_cast<int>(rng.Int(0, 5));
    if (what == 0 || n == 1) {  // a bad root
      parents[0] = static_cast<int32_t>(rng.Pick<int64_t>({-2, 0, 1, 5, INT32_MIN, INT32_MAX}));
    } else if (what <= 2) {  // a parent that is not an earlier node
      const int i = static_cast<int>(rng.Int(1, n - 1));
      parents[i] = static_cast<int32_t>(rng.Pick<int64_t>(
          {int64_t{i}, int64_t{i} + rng.Int(1, 300), -1, -2 - rng.Int(0, 100), INT32_MIN,
           INT32_MAX}));
    } else if (what == 3) {  // no nodes / too many nodes
      if (rng.Chance(0.5)) {
        parents.clear();
      } else {
        parents.resize(TokenTree::kMaxNodes + rng.Int(1, 50));
        for (size_t i = 0; i < parents.size(); ++i) parents[i] = static_cast<int32_t>(i) - 1;
        for (size_t i = 1; i < parents.size(); ++i) parents[i] = static_cast<int32_t>(i / 2);
      }
    } else {  // tokens of the wrong length
      tokens.resize(static_cast<size_t>(rng.Chance(0.5) ? n + rng.Int(1, 3) : n - 1));  // n >= 2
    }
    EXPECT_THROW(TokenTree::FromParents(parents, tokens), ValueError);
    if (what == 4 || what == 5) return;  // the tree itself is valid
    // The same parents inside a batch of valid trees: ValidateTreeBatch must reject them without
    // reading outside the arrays (exact-size heap buffers: ASan checks that).
    std::vector<int32_t> flat;
    std::vector<int64_t> indptr = {0};
    const int before = static_cast<int>(rng.Int(0, 2)), after = static_cast<int>(rng.Int(0, 2));
    auto add_valid = [&] {
      const auto p = RandomParents(rng, static_cast<int>(rng.Int(1, 10)));
      flat.insert(flat.end(), p.begin(), p.end());
      indptr.push_back(static_cast<int64_t>(flat.size()));
    };
    for (int k = 0; k < before; ++k) add_valid();
    flat.insert(flat.end(), parents.begin(), parents.end());
    indptr.push_back(static_cast<int64_t>(flat.size()));
    for (int k = 0; k < after; ++k) add_valid();
    const int64_t batch = static_cast<int64_t>(indptr.size()) - 1;
    std::vector<int32_t> exact(flat.begin(), flat.end());
    EXPECT_THROW(ValidateTreeBatch(exact.empty() ? nullptr : exact.data(), indptr.data(), batch,
                                   static_cast<int64_t>(exact.size()), "parents"),
                 ValueError);
  });
}

TEST(FuzzTree, MalformedIndptrIsValueError) {
  RunCases(3000, [](uint64_t seed) {
    Rng rng(seed);
    std::vector<int32_t> flat;
    std::vector<int64_t> indptr = {0};
    const int batch = static_cast<int>(rng.Int(1, 5));
    for (int b = 0; b < batch; ++b) {
      const auto p = RandomParents(rng, static_cast<int>(rng.Int(1, 12)));
      flat.insert(flat.end(), p.begin(), p.end());
      indptr.push_back(static_cast<int64_t>(flat.size()));
    }
    const int64_t total = static_cast<int64_t>(flat.size());
    ValidateTreeBatch(flat.data(), indptr.data(), batch, total, "parents");  // valid as built
    const int k = static_cast<int>(rng.Int(0, batch));
    const int64_t old = indptr[k];
    const std::vector<int64_t> extremes = {std::numeric_limits<int64_t>::min(),
                                           std::numeric_limits<int64_t>::max(),
                                           std::numeric_limits<int64_t>::min() + 1,
                                           std::numeric_limits<int64_t>::max() - 1,
                                           -1,
                                           total + 1,
                                           total + 1000,
                                           int64_t{1} << 40};
    int64_t v = rng.Chance(0.5) ? rng.Pick(extremes) : old + rng.Int(-3, 3);
    if (v == old) v = old + 1;
    indptr[k] = v;
    // Still valid only if it moved one tree boundary to another valid one: check by the rules.
    bool valid = indptr[0] == 0 && indptr[batch] == total;
    for (int b = 0; valid && b < batch; ++b) {
      const int64_t lo = indptr[b], hi = indptr[b + 1];
      valid = lo >= 0 && hi <= total && hi > lo && hi - lo <= TokenTree::kMaxNodes &&
              flat[lo] == -1;
      for (int64_t i = lo + 1; valid && i < hi; ++i) valid = flat[i] >= 0 && flat[i] < i - lo;
    }
    if (valid) {
      ValidateTreeBatch(flat.data(), indptr.data(), batch, total, "parents");
    } else {
      EXPECT_THROW(ValidateTreeBatch(flat.data(), indptr.data(), batch, total, "parents"),
                   ValueError);
    }
    // The same through the tensor entry point.
    TensorView pv = TensorView::Contiguous(flat.data(), DType::kInt32, {total});
    TensorView iv = TensorView::Contiguous(indptr.data(), DType::kInt64, {batch + 1});
    if (valid) {
      TreeBatchMaxDepth(pv, iv);
    } else {
      EXPECT_THROW(TreeBatchMaxDepth(pv, iv), ValueError);
    }
  });
}

TEST(FuzzTree, BatchesOfValidTrees) {
  RunCases(1000, [](uint64_t seed) {
    Rng rng(seed);
    std::vector<int32_t> flat;
    std::vector<int64_t> indptr = {0};
    int32_t max_depth = 0;
    const int batch = static_cast<int>(rng.Int(0, 6));
    for (int b = 0; b < batch; ++b) {
      auto p = RandomParents(rng, static_cast<int>(rng.Int(1, 70)));
      auto d = NaiveDepths(p);
      max_depth = std::max(max_depth, *std::max_element(d.begin(), d.end()));
      flat.insert(flat.end(), p.begin(), p.end());
      indptr.push_back(static_cast<int64_t>(flat.size()));
    }
    const int64_t total = static_cast<int64_t>(flat.size());
    std::vector<int32_t> exact = flat;
    exact.reserve(1);
    ValidateTreeBatch(exact.data(), indptr.data(), batch, total, "parents");
    TensorView pv = TensorView::Contiguous(exact.data(), DType::kInt32, {total});
    TensorView iv = TensorView::Contiguous(indptr.data(), DType::kInt64, {batch + 1});
    EXPECT_EQ(TreeBatchMaxDepth(pv, iv), max_depth);
  });
}

TEST(FuzzTree, FromPathsValidAndMalformed) {
  RunCases(1500, [](uint64_t seed) {
    Rng rng(seed);
    // A valid set of rank paths: grow from random existing paths with random ranks.
    std::vector<std::vector<int32_t>> paths;
    std::set<std::vector<int32_t>> have = {{}};
    const int n = static_cast<int>(rng.Int(0, 60));
    std::vector<std::vector<int32_t>> pool = {{}};
    for (int i = 0; i < n; ++i) {
      std::vector<int32_t> p = rng.Pick(pool);
      if (static_cast<int>(p.size()) >= 8) continue;
      p.push_back(static_cast<int32_t>(rng.Int(0, 4)));
      if (!have.insert(p).second) continue;
      paths.push_back(p);
      pool.push_back(p);
    }
    std::shuffle(paths.begin(), paths.end(), rng.g);
    const TokenTree t = TokenTree::FromPaths(paths);
    ASSERT_EQ(t.num_nodes(), static_cast<int>(paths.size()) + 1);
    const auto got = t.ToPaths();
    auto sorted_got = got;
    auto want = paths;
    std::sort(sorted_got.begin(), sorted_got.end());
    std::sort(want.begin(), want.end());
    EXPECT_EQ(sorted_got, want);
    CheckTree(t, t.parents(), {}, /*rank_is_position=*/false);
    for (int i = 1; i < t.num_nodes(); ++i) EXPECT_EQ(t.ranks()[i], got[i - 1].back());
    if (paths.empty()) return;
    // Malformed: an orphan, a duplicate, a negative rank, an empty path, too deep, too many.
    auto bad = paths;
    const int what = static_cast<int>(rng.Int(0, 5));
    if (what == 0) {
      std::vector<int32_t> orphan = rng.Pick(paths);
      orphan.push_back(99);
      orphan.push_back(0);
      bad.push_back(orphan);
    } else if (what == 1) {
      bad.push_back(rng.Pick(paths));
    } else if (what == 2) {
      std::vector<int32_t> neg = rng.Pick(paths);
      neg.back() = static_cast<int32_t>(-rng.Int(1, 1000));
      bad.push_back(neg);
    } else if (what == 3) {
      bad.insert(bad.begin() + rng.Int(0, static_cast<int64_t>(bad.size())), std::vector<int32_t>{});
    } else if (what == 4) {
      std::vector<int32_t> deep;
      for (int d = 0; d <= TokenTree::kMaxDepth; ++d) {
        deep.push_back(0);
        if (!have.count(deep)) bad.push_back(deep);
      }
    } else {
      for (int32_t r = 0; static_cast<int>(bad.size()) < TokenTree::kMaxNodes; ++r) {
        bad.push_back({1000 + r});
      }
    }
    EXPECT_THROW(TokenTree::FromPaths(bad), ValueError);
  });
}

TEST(FuzzTree, ChainAndKAryShapes) {
  RunCases(1000, [](uint64_t seed) {
    Rng rng(seed);
    const int gamma = static_cast<int>(rng.Int(-3, 300));
    if (gamma >= 0 && gamma <= TokenTree::kMaxDepth) {
      const TokenTree c = TokenTree::Chain(gamma);
      EXPECT_EQ(c.num_nodes(), gamma + 1);
      EXPECT_EQ(c.max_depth(), gamma);
      EXPECT_TRUE(c.is_chain());
    } else {
      EXPECT_THROW(TokenTree::Chain(gamma), ValueError);
    }
    const int width = static_cast<int>(rng.Int(-1, 20)), depth = static_cast<int>(rng.Int(-2, 70));
    int64_t nodes = 1, level = 1;
    for (int d = 0; d < depth && nodes <= TokenTree::kMaxNodes; ++d) {
      level *= std::max(width, 0);
      nodes += level;
    }
    if (width >= 1 && depth >= 0 && depth <= TokenTree::kMaxDepth && nodes <= TokenTree::kMaxNodes) {
      const TokenTree k = TokenTree::KAry(width, depth);
      EXPECT_EQ(k.num_nodes(), nodes);
      EXPECT_EQ(k.max_depth(), depth);
      for (int i = 0; i < k.num_nodes(); ++i) {
        EXPECT_EQ(k.num_children(i), k.depths()[i] < depth ? width : 0);
      }
    } else {
      EXPECT_THROW(TokenTree::KAry(width, depth), ValueError);
    }
  });
}

// ==== block manager ==============================================================================

uint64_t WeakHash(uint64_t prev, const int32_t* tokens, int n) {  // collides all the time
  uint64_t s = prev & 3;
  for (int i = 0; i < n; ++i) s += static_cast<uint64_t>(tokens[i]) & 1;
  return s & 3;
}

uint64_t Fingerprint(uint64_t prev, int32_t token) {
  uint64_t x = prev * 0x9e3779b97f4a7c15ull + static_cast<uint64_t>(token) + 1;
  x ^= x >> 29;
  return x * 0xbf58476d1ce4e5b9ull;
}

// Random operation sequences against a model: the requests' tokens and computed counts, a KV pool
// of per-position fingerprints written the way the runner writes it (so a prefix hit or a
// copy-on-write that hands out the wrong block shows as wrong content), and the block ownership
// recomputed from the block tables and the pending copies after every operation.
class BlockFuzz {
 public:
  BlockFuzz(uint64_t seed)
      : rng_(seed),
        num_blocks_(rng_.Int(1, 48)),
        bs_(static_cast<int>(rng_.Pick<int64_t>({1, 1, 2, 3, 4, 4, 5, 8, 16}))),
        bm_(num_blocks_, bs_, rng_.Chance(0.8)),
        kv_(static_cast<size_t>(num_blocks_ * bs_), 0) {
    if (rng_.Chance(0.25)) bm_.SetHashFunction(&WeakHash);
    alphabet_ = static_cast<int32_t>(rng_.Int(1, 4));
    for (int k = 0; k < 4; ++k) {
      std::vector<int32_t> p(static_cast<size_t>(rng_.Int(0, 4 * bs_)));
      for (auto& t : p) t = Token();
      prefixes_.push_back(p);
    }
  }

  void Run(int ops) {
    const int64_t initial_free = bm_.num_free_blocks();
    ASSERT_EQ(initial_free, num_blocks_);
    for (int op = 0; op < ops; ++op) {
      Step();
      if (::testing::Test::HasFatalFailure()) return;
      Check();
      if (::testing::Test::HasFailure()) return;
    }
    // Everything freed: no block leaked, no pending copy left, the pool whole again.
    while (!model_.empty()) Free(model_.begin()->first);
    Check();
    EXPECT_TRUE(bm_.PeekPendingCopies().empty());
    EXPECT_EQ(bm_.num_used_blocks(), 0);
    EXPECT_EQ(bm_.num_free_blocks(), initial_free);
    const int64_t evictable = bm_.num_evictable_blocks();
    EXPECT_EQ(bm_.ResetPrefixCache(), evictable);
    EXPECT_EQ(bm_.num_cached_blocks(), 0);
    EXPECT_EQ(bm_.num_free_blocks(), initial_free);
    bm_.CheckInvariants();
    // The whole pool can be handed to one request.
    std::vector<int32_t> all(static_cast<size_t>(num_blocks_ * bs_), 1);
    EXPECT_EQ(bm_.AddRequest(1 << 30, all), 0);
    EXPECT_EQ(bm_.num_free_blocks(), 0);
    EXPECT_EQ(bm_.AddRequest((1 << 30) + 1, {1}), BlockManager::kNoSpace);
    bm_.Free(1 << 30);
    EXPECT_EQ(bm_.num_free_blocks(), initial_free);
  }

  int64_t ok_ops = 0, hits = 0, copies = 0, rejected = 0, errors = 0;

 private:
  struct Req {
    std::vector<int32_t> tokens;
    int64_t computed = 0;
  };

  int32_t Token() { return static_cast<int32_t>(rng_.Int(0, alphabet_)); }
  int64_t AnyId() {
    if (model_.empty() || rng_.Chance(0.05)) return rng_.Int(-2, next_id_ + 2);
    auto it = model_.begin();
    std::advance(it, rng_.Int(0, static_cast<int64_t>(model_.size()) - 1));
    return it->first;
  }
  int64_t LiveId() {
    auto it = model_.begin();
    std::advance(it, rng_.Int(0, static_cast<int64_t>(model_.size()) - 1));
    return it->first;
  }

  void ApplyCopies() {
    for (auto c : bm_.TakePendingCopies()) {
      ASSERT_NE(c.first, c.second);
      ASSERT_TRUE(c.first >= 0 && c.first < num_blocks_ && c.second >= 0 && c.second < num_blocks_);
      std::copy(kv_.begin() + int64_t{c.first} * bs_, kv_.begin() + int64_t{c.first + 1} * bs_,
                kv_.begin() + int64_t{c.second} * bs_);
      ++copies;
    }
  }

  // The runner writes positions [computed, computed + n) of `tokens`.
  void Write(int64_t id, const std::vector<int32_t>& tokens, int64_t n) {
    const int64_t start = model_[id].computed;
    const std::vector<int64_t> slots = bm_.SlotsFor(id, start, n);
    ASSERT_EQ(static_cast<int64_t>(slots.size()), n);
    uint64_t fp = 0;
    for (int64_t p = 0; p < start + n; ++p) {
      fp = Fingerprint(fp, tokens[p]);
      if (p >= start) {
        ASSERT_TRUE(slots[p - start] >= 0 && slots[p - start] < num_blocks_ * bs_);
        kv_[slots[p - start]] = fp;
      }
    }
  }

  void Free(int64_t id) {
    bm_.Free(id);
    model_.erase(id);
  }

  // Calls that must be a ValueError and change nothing.
  template <typename F>
  void ExpectRejected(F f) {
    const int64_t free_before = bm_.num_free_blocks();
    const auto pending_before = bm_.PeekPendingCopies();
    EXPECT_THROW(f(), ValueError);
    EXPECT_EQ(bm_.num_free_blocks(), free_before);
    EXPECT_EQ(bm_.PeekPendingCopies(), pending_before);
    ++errors;
  }

  void Step() {
    const int r = static_cast<int>(rng_.Int(0, 99));
    if (model_.empty() || r < 16) {  // add a request (prompt from a shared prefix: cache hits)
      std::vector<int32_t> prompt = rng_.Pick(prefixes_);
      for (int64_t k = rng_.Int(prompt.empty() ? 1 : 0, 2 * bs_); k > 0; --k) prompt.push_back(Token());
      const int64_t free_before = bm_.num_free_blocks();
      const int64_t id = next_id_++;
      const int64_t got = bm_.AddRequest(id, prompt);
      if (got == BlockManager::kNoSpace) {
        ++rejected;
        ASSERT_FALSE(bm_.HasRequest(id));
        ASSERT_EQ(bm_.num_free_blocks(), free_before);
        if (!model_.empty() && rng_.Chance(0.7)) Free(LiveId());
        return;
      }
      const int64_t n = static_cast<int64_t>(prompt.size());
      ASSERT_GE(got, 0);
      ASSERT_EQ(got % bs_, 0);
      ASSERT_LE(got, (n - 1) / bs_ * bs_);
      ASSERT_EQ(bm_.Capacity(id), (n + bs_ - 1) / bs_ * bs_);
      if (!bm_.prefix_cache_enabled()) ASSERT_EQ(got, 0);
      hits += got;
      model_[id] = Req{prompt, got};
    } else if (r < 28) {  // reserve: the pool shrinks by exactly what it said it needs
      const int64_t id = LiveId();
      const int64_t extra = rng_.Int(0, 3 * bs_);
      const int64_t need = bm_.BlocksNeededToReserve(id, extra);
      const int64_t free_before = bm_.num_free_blocks();
      const bool can = bm_.CanReserve(id, extra);
      ASSERT_EQ(can, need <= free_before);
      const auto table_before = bm_.BlockTable(id);
      const bool ok = bm_.Reserve(id, extra);
      ASSERT_EQ(ok, can);
      if (ok) {
        ASSERT_GE(bm_.Capacity(id), bm_.NumTokens(id) + extra);
        ASSERT_EQ(bm_.num_free_blocks(), free_before - need);
        ASSERT_EQ(bm_.BlocksNeededToReserve(id, extra), 0);
        ++ok_ops;
      } else {
        ++rejected;
        ASSERT_EQ(bm_.BlockTable(id), table_before);
        ASSERT_EQ(bm_.num_free_blocks(), free_before);
      }
    } else if (r < 42) {  // prefill chunk
      const int64_t id = LiveId();
      const int64_t todo = bm_.NumTokens(id) - bm_.NumComputed(id);
      if (todo == 0 || !bm_.Reserve(id, 0)) return;
      ApplyCopies();
      const int64_t n = rng_.Int(1, todo);
      Write(id, model_[id].tokens, n);
      bm_.MarkComputed(id, n);
      model_[id].computed += n;
      ++ok_ops;
    } else if (r < 60) {  // speculative step: reserve, write the accepted path, commit with bonus
      const int64_t id = LiveId();
      const int64_t depth = rng_.Int(0, 2 * bs_);
      if (!bm_.Reserve(id, depth + 1)) {
        ++rejected;
        if (model_.size() > 1 && rng_.Chance(0.5)) Free(LiveId());
        return;
      }
      ApplyCopies();
      const int64_t a = rng_.Int(0, depth);
      std::vector<int32_t> accepted(static_cast<size_t>(a + 1));
      for (auto& t : accepted) t = Token();
      Req& m = model_[id];
      std::vector<int32_t> all = m.tokens;
      all.insert(all.end(), accepted.begin(), accepted.end());
      // Everything up to the bonus token is written and marked computed.
      const int64_t written = static_cast<int64_t>(all.size()) - 1 - m.computed;
      Write(id, all, written);
      ASSERT_TRUE(bm_.Commit(id, accepted, written));
      m.tokens = all;
      m.computed += written;
      ++ok_ops;
      if (bm_.NumTokens(id) > 10 * bs_ && rng_.Chance(0.5)) Free(id);
    } else if (r < 66) {  // commit without reserve, nothing computed: all or nothing
      const int64_t id = LiveId();
      std::vector<int32_t> add(static_cast<size_t>(rng_.Int(0, 3 * bs_)));
      for (auto& t : add) t = Token();
      const int64_t free_before = bm_.num_free_blocks();
      const auto table_before = bm_.BlockTable(id);
      if (bm_.Commit(id, add)) {
        model_[id].tokens.insert(model_[id].tokens.end(), add.begin(), add.end());
        ++ok_ops;
      } else {
        ++rejected;
        ASSERT_EQ(bm_.BlockTable(id), table_before);
        ASSERT_EQ(bm_.num_free_blocks(), free_before);
      }
    } else if (r < 74) {  // fork: never allocates
      const int64_t parent = LiveId();
      const int64_t free_before = bm_.num_free_blocks();
      const int64_t child = next_id_++;
      bm_.Fork(parent, child);
      ASSERT_EQ(bm_.num_free_blocks(), free_before);
      ASSERT_EQ(bm_.BlockTable(child), bm_.BlockTable(parent));
      model_[child] = model_[parent];
    } else if (r < 84) {
      Free(LiveId());
    } else if (r < 88) {
      ApplyCopies();
    } else if (r < 90) {
      const int64_t evictable = bm_.num_evictable_blocks();
      ASSERT_EQ(bm_.ResetPrefixCache(), evictable);
      ASSERT_EQ(bm_.num_evictable_blocks(), 0);
    } else {
      Invalid();
    }
  }

  // Random invalid calls: each is a ValueError that changes nothing.
  void Invalid() {
    const int64_t id = AnyId();
    const bool live = bm_.HasRequest(id);
    const int64_t big = rng_.Pick<int64_t>({int64_t{1} << 48, std::numeric_limits<int64_t>::max(),
                                            (int64_t{1} << 48) + 1});
    const int64_t neg = rng_.Pick<int64_t>({-1, -2, std::numeric_limits<int64_t>::min()});
    switch (rng_.Int(0, 13)) {
      case 0:
        if (!live) ExpectRejected([&] { bm_.Reserve(id, 1); });
        else ExpectRejected([&] { bm_.Reserve(id, rng_.Chance(0.5) ? neg : big); });
        break;
      case 1:
        if (live) ExpectRejected([&] { bm_.CanReserve(id, rng_.Chance(0.5) ? neg : big); });
        break;
      case 2:
        if (live) {
          ExpectRejected([&] { bm_.SlotsFor(id, 0, bm_.Capacity(id) + rng_.Int(1, 5)); });
          ExpectRejected([&] { bm_.SlotsFor(id, neg, 1); });
          ExpectRejected([&] { bm_.SlotsFor(id, 0, neg); });
          ExpectRejected([&] { bm_.SlotsFor(id, big, big); });
        } else {
          ExpectRejected([&] { bm_.SlotsFor(id, 0, 1); });
        }
        break;
      case 3:
        if (live) {
          ExpectRejected(
              [&] { bm_.MarkComputed(id, bm_.NumTokens(id) - bm_.NumComputed(id) + rng_.Int(1, 3)); });
          ExpectRejected([&] { bm_.MarkComputed(id, neg); });
        } else {
          ExpectRejected([&] { bm_.MarkComputed(id, 0); });
        }
        break;
      case 4:
        if (live) ExpectRejected([&] { bm_.AddRequest(id, {1, 2}); });
        else ExpectRejected([&] { bm_.AddRequest(id, nullptr, rng_.Chance(0.5) ? 0 : neg); });
        break;
      case 5:
        if (live) {
          ExpectRejected([&] { bm_.Commit(id, nullptr, rng_.Chance(0.5) ? neg : 2); });
          const std::vector<int32_t> one = {1};
          ExpectRejected([&] { bm_.Commit(id, one, neg); });
          ExpectRejected([&] { bm_.Commit(id, one, bm_.NumTokens(id) + 2 - bm_.NumComputed(id)); });
          ExpectRejected([&] { bm_.Commit(id, one.data(), big, 0); });
        } else {
          ExpectRejected([&] { bm_.Commit(id, {1}); });
        }
        break;
      case 6:
        if (live) ExpectRejected([&] { bm_.Fork(id, id); });
        else ExpectRejected([&] { bm_.Fork(id, next_id_ + 100); });
        break;
      case 7:
        if (!live) ExpectRejected([&] { bm_.Free(id); });
        break;
      case 8:
        ExpectRejected([&] { bm_.RefCount(static_cast<int32_t>(rng_.Chance(0.5) ? -1 : num_blocks_)); });
        ExpectRejected([&] { bm_.IsCached(std::numeric_limits<int32_t>::min()); });
        break;
      case 9:
        if (!live) {
          ExpectRejected([&] { bm_.BlockTable(id); });
          ExpectRejected([&] { bm_.Tokens(id); });
          ExpectRejected([&] { bm_.NumComputed(id); });
          ExpectRejected([&] { bm_.Capacity(id); });
          ExpectRejected([&] { bm_.BlocksNeededToReserve(id, 0); });
        }
        break;
      case 10:
        ExpectRejected([&] { bm_.SetHashFunction(&WeakHash); });  // requests or cache exist
        break;
      default: {
        // Writing into a shared block without Reserve: a fork's tail (if not computed to its end).
        if (!live) break;
        const int64_t nc = bm_.NumComputed(id), nt = bm_.NumTokens(id);
        if (nc == nt) break;
        const int32_t b = bm_.BlockTable(id)[nc / bs_];
        if (bm_.RefCount(b) < 2) break;
        // Shared through a block table (not only pinned) if another table holds it.
        int tables = 0;
        for (const auto& kv : model_) {
          for (int32_t x : bm_.BlockTable(kv.first)) tables += x == b;
        }
        if (tables < 2) break;
        ExpectRejected([&] { bm_.MarkComputed(id, 1); });
        ExpectRejected([&] { bm_.SlotsFor(id, nc, 1); });
        ExpectRejected([&] { bm_.Commit(id, {1}, 1); });
        break;
      }
    }
  }

  void Check() {
    bm_.CheckInvariants();
    ASSERT_EQ(bm_.num_requests(), static_cast<int64_t>(model_.size()));
    // Ownership: every block's count is its block-table references plus the pending copies that
    // read it; a block appears at most once in a table; free = unreferenced.
    std::vector<int32_t> refs(static_cast<size_t>(num_blocks_), 0);
    for (const auto& kv : model_) {
      const int64_t id = kv.first;
      ASSERT_TRUE(bm_.HasRequest(id));
      ASSERT_EQ(bm_.Tokens(id), kv.second.tokens) << "request " << id;
      ASSERT_EQ(bm_.NumTokens(id), static_cast<int64_t>(kv.second.tokens.size()));
      ASSERT_EQ(bm_.NumComputed(id), kv.second.computed) << "request " << id;
      ASSERT_GE(bm_.Capacity(id), bm_.NumTokens(id));
      const auto& table = bm_.BlockTable(id);
      ASSERT_EQ(bm_.Capacity(id), static_cast<int64_t>(table.size()) * bs_);
      std::set<int32_t> seen;
      for (int32_t b : table) {
        ASSERT_TRUE(b >= 0 && b < num_blocks_) << b;
        ASSERT_TRUE(seen.insert(b).second) << "block " << b << " twice in request " << id;
        ++refs[b];
      }
    }
    const auto pending = bm_.PeekPendingCopies();
    for (size_t i = 0; i < pending.size(); ++i) {
      const auto c = pending[i];
      ASSERT_TRUE(c.first >= 0 && c.first < num_blocks_);
      ASSERT_TRUE(c.second >= 0 && c.second < num_blocks_);
      // A copy's destination is held by a block table, or read by a later copy (a chain through
      // a fork whose first owner was freed before the copies ran).
      bool read_later = false;
      for (size_t j = i + 1; j < pending.size(); ++j) read_later = read_later || pending[j].first == c.second;
      ASSERT_TRUE(refs[c.second] > 0 || read_later) << "a pending copy into a block nobody needs";
    }
    for (auto c : pending) ++refs[c.first];
    int64_t used = 0;
    for (int32_t b = 0; b < num_blocks_; ++b) {
      ASSERT_EQ(bm_.RefCount(b), refs[b]) << "block " << b;
      used += refs[b] > 0;
    }
    ASSERT_EQ(bm_.num_used_blocks(), used);
    ASSERT_EQ(bm_.num_free_blocks(), num_blocks_ - used);
    ASSERT_LE(bm_.num_evictable_blocks(), bm_.num_free_blocks());
    // KV content of every computed position, reading through the copies still pending.
    std::vector<uint64_t> view = kv_;
    for (auto c : pending) {
      std::copy(view.begin() + int64_t{c.first} * bs_, view.begin() + int64_t{c.first + 1} * bs_,
                view.begin() + int64_t{c.second} * bs_);
    }
    for (const auto& kv : model_) {
      const int64_t nc = kv.second.computed;
      if (nc == 0) continue;
      const std::vector<int64_t> slots = bm_.SlotsFor(kv.first, 0, nc);
      uint64_t fp = 0;
      for (int64_t p = 0; p < nc; ++p) {
        fp = Fingerprint(fp, kv.second.tokens[p]);
        ASSERT_EQ(view[slots[p]], fp) << "request " << kv.first << " position " << p;
      }
    }
  }

  Rng rng_;
  int64_t num_blocks_;
  int bs_;
  BlockManager bm_;
  std::vector<uint64_t> kv_;
  int32_t alphabet_ = 1;
  std::vector<std::vector<int32_t>> prefixes_;
  std::map<int64_t, Req> model_;
  int64_t next_id_ = 1;
};

TEST(FuzzBlockManager, RandomOpsAgainstModel) {
  int64_t ok = 0, hits = 0, copies = 0, rejected = 0, errors = 0;
  RunCases(250, [&](uint64_t seed) {
    BlockFuzz f(seed);
    f.Run(400);
    ok += f.ok_ops;
    hits += f.hits;
    copies += f.copies;
    rejected += f.rejected;
    errors += f.errors;
  });
  // The runs reach every path they are meant to test.
  if (FuzzIters(250) >= 250) {
    EXPECT_GT(ok, 1000);
    EXPECT_GT(hits, 100);
    EXPECT_GT(copies, 50);
    EXPECT_GT(rejected, 100);
    EXPECT_GT(errors, 500);
  }
}

TEST(FuzzBlockManager, ConstructorArguments) {
  RunCases(300, [](uint64_t seed) {
    Rng rng(seed);
    const int64_t nb = rng.Pick<int64_t>({-5, 0, 1, 2, 17, int64_t{1} << 31,
                                          std::numeric_limits<int64_t>::max(),
                                          std::numeric_limits<int64_t>::min(),
                                          std::numeric_limits<int32_t>::max()});
    const int bs = static_cast<int>(rng.Pick<int64_t>({-1, 0, 1, 16, 65536, 65537, INT32_MAX}));
    const bool valid = nb >= 1 && nb <= std::numeric_limits<int32_t>::max() && bs >= 1 &&
                       bs <= 65536 && nb * bs <= (int64_t{1} << 31);
    if (!valid) {
      EXPECT_THROW({ BlockManager bm(nb, bs); }, ValueError) << nb << " x " << bs;
    } else if (nb * bs <= (int64_t{1} << 20)) {  // (the large valid pools would allocate GBs)
      BlockManager bm(nb, bs, rng.Chance(0.5));
      EXPECT_EQ(bm.num_free_blocks(), nb);
      bm.CheckInvariants();
    }
  });
}

// ==== attention plan: index offsets ==============================================================

// PlanAttention's q_indptr / tree_indptr with arbitrary int64 entries (extremes included): a plan
// or a ValueError, with no signed overflow on the way (UBSan) and no read outside tree_parents
// (ASan).
TEST(FuzzAttentionPlan, ArbitraryOffsetsAreCleanErrors) {
  int64_t planned = 0, rejected = 0;
  RunCases(1500, [&](uint64_t seed) {
    Rng rng(seed);
    const int64_t B = rng.Int(1, 5);
    std::vector<int64_t> qp = {0}, tp = {0}, prefix(static_cast<size_t>(B), 0);
    std::vector<int32_t> parents;
    for (int64_t b = 0; b < B; ++b) {
      const int64_t q_len = rng.Int(0, 6);
      qp.push_back(qp.back() + q_len);
      if (q_len > 0 && rng.Chance(0.5)) {  // a tree over the request's rows
        const auto p = RandomParents(rng, static_cast<int>(q_len));
        parents.insert(parents.end(), p.begin(), p.end());
      }
      tp.push_back(static_cast<int64_t>(parents.size()));
    }
    const bool mutate = rng.Chance(0.8);
    if (mutate) {
      const std::vector<int64_t> extremes = {std::numeric_limits<int64_t>::min(),
                                             std::numeric_limits<int64_t>::max(),
                                             std::numeric_limits<int64_t>::min() + 3, -1,
                                             int64_t{1} << 62, -(int64_t{1} << 62), 300};
      for (int64_t k = rng.Int(1, 3); k > 0; --k) {
        std::vector<int64_t>& v = rng.Chance(0.5) ? qp : tp;
        v[rng.Int(0, B)] = rng.Chance(0.7) ? rng.Pick(extremes) : rng.Int(-3, 20);
      }
    }
    std::vector<int32_t> tables;  // [B, 0]: no prefix pages
    const std::vector<int32_t> exact_parents = parents;
    try {
      PlanAttention(TensorView::Contiguous(qp.data(), DType::kInt64, {B + 1}),
                    TensorView::Contiguous(prefix.data(), DType::kInt64, {B}),
                    TensorView::Contiguous(tables.data(), DType::kInt32, {B, 0}), 16,
                    TensorView::Contiguous(const_cast<int32_t*>(exact_parents.data()),
                                           DType::kInt32,
                                           {static_cast<int64_t>(exact_parents.size())}),
                    TensorView::Contiguous(tp.data(), DType::kInt64, {B + 1}), 1);
      ++planned;
    } catch (const ValueError&) {
      ASSERT_TRUE(mutate) << "a valid plan was rejected";
      ++rejected;
    }
  });
  if (FuzzIters(1500) >= 1500) {
    EXPECT_GT(planned, 200);
    EXPECT_GT(rejected, 200);
  }
}

// ==== acceptance =================================================================================

// A random probability row (float32, sums to 1 within float rounding) of one of several shapes.
std::vector<float> RandomProbRow(Rng& rng, int64_t V) {
  std::vector<double> w(static_cast<size_t>(V), 0.0);
  switch (rng.Int(0, 5)) {
    case 0:  // one-hot
      w[static_cast<size_t>(rng.Int(0, V - 1))] = 1.0;
      break;
    case 1:  // uniform: every entry ties
      std::fill(w.begin(), w.end(), 1.0);
      break;
    case 2:  // a few tied maxima
      for (auto& x : w) x = static_cast<double>(rng.Int(0, 2));
      break;
    case 3:  // tiny entries next to big ones
      for (auto& x : w) x = rng.Chance(0.5) ? 1e-30 : rng.Real();
      break;
    default:  // sparse random
      for (auto& x : w) x = rng.Chance(0.3) ? 0.0 : rng.Real();
      break;
  }
  double s = std::accumulate(w.begin(), w.end(), 0.0);
  if (s <= 0.0) {
    w[static_cast<size_t>(rng.Int(0, V - 1))] = 1.0;
    s = 1.0;
  }
  std::vector<float> row(static_cast<size_t>(V));
  for (int64_t v = 0; v < V; ++v) row[v] = static_cast<float>(w[v] / s);
  return row;
}

// A flattened batch and its owned buffers (exactly sized: ASan sees any read past them).
struct AcceptCase {
  int64_t V = 1, B = 0, N = 0, width = 1;
  std::vector<int32_t> parents, tokens;
  std::vector<int64_t> indptr = {0}, seeds, offsets;
  std::vector<uint8_t> greedy, sampled;
  std::vector<float> target, draft;
  bool has_draft = false;
  AcceptOptions opt;
  std::vector<int32_t> out_nodes, out_tokens, out_count;

  AcceptTreesArgs Args() {
    out_nodes.assign(static_cast<size_t>(B * width), -7);
    out_tokens.assign(static_cast<size_t>(B * width), -7);
    out_count.assign(static_cast<size_t>(B), -7);
    AcceptTreesArgs a;
    a.target = TensorView::Contiguous(target.data(), DType::kFloat32, {N, V});
    if (has_draft) a.draft_probs = TensorView::Contiguous(draft.data(), DType::kFloat32, {N, V});
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
    return a;
  }
};

int64_t FirstMax(const float* row, int64_t V) {
  int64_t best = 0;
  for (int64_t v = 1; v < V; ++v) {
    if (row[v] > row[best]) best = v;
  }
  return best;
}

// A valid random batch: greedy, target-only (deterministic children) and sampled-children requests.
// Sampled children are distinct tokens with positive draft probability, as if drawn without
// replacement. `logits`: every request greedy and the target rows are logits (target_is_logits).
AcceptCase RandomAcceptCase(Rng& rng, bool logits) {
  AcceptCase c;
  c.V = rng.Pick<int64_t>({1, 2, 3, 5, 8, 17, 33, 64});
  c.B = rng.Int(1, 6);
  c.has_draft = !logits && rng.Chance(0.7);
  c.opt.target_is_logits = logits;
  int32_t max_depth = 0;
  for (int64_t b = 0; b < c.B; ++b) {
    const int n = rng.Chance(0.05) ? static_cast<int>(rng.Int(100, TokenTree::kMaxNodes))
                                   : static_cast<int>(rng.Int(1, 20));
    std::vector<int32_t> p = RandomParents(rng, n);
    std::vector<int32_t> d = NaiveDepths(p);
    // (No depth limit here: the batch op takes any depth a tree of at most 256 nodes has.)
    max_depth = std::max(max_depth, *std::max_element(d.begin(), d.end()));
    const bool greedy = logits || rng.Chance(0.3);
    const bool sampled = !greedy && c.has_draft && rng.Chance(0.7);
    c.greedy.push_back(greedy);
    c.sampled.push_back(sampled);
    c.seeds.push_back(static_cast<int64_t>(rng.g()));
    c.offsets.push_back(rng.Chance(0.1) ? static_cast<int64_t>(rng.g()) : rng.Int(0, 4096));
    // Children lists to give sampled children distinct tokens.
    std::vector<std::vector<int32_t>> kids(static_cast<size_t>(n));
    for (int i = 1; i < n; ++i) kids[p[i]].push_back(i);
    std::vector<int32_t> tok(static_cast<size_t>(n));
    tok[0] = static_cast<int32_t>(rng.Int(0, c.V - 1));
    std::vector<std::vector<float>> trows(static_cast<size_t>(n)), drows(static_cast<size_t>(n));
    for (int i = 0; i < n; ++i) {
      if (logits) {
        std::vector<float> z(static_cast<size_t>(c.V));
        const int kind = static_cast<int>(rng.Int(0, 3));
        for (auto& x : z) {
          x = kind == 0 ? static_cast<float>(rng.Int(-2, 2))  // ties
              : kind == 1 ? (rng.Chance(0.5) ? -kInf : static_cast<float>(rng.Real() * 10 - 5))
                          : static_cast<float>(rng.Real() * 40 - 20);
        }
        if (kind == 1 && std::all_of(z.begin(), z.end(), [](float x) { return x == -kInf; })) {
          z[static_cast<size_t>(rng.Int(0, c.V - 1))] = -1e30f;
        }
        if (kind == 3) z.assign(z.size(), std::numeric_limits<float>::lowest());
        trows[i] = z;
      } else {
        trows[i] = RandomProbRow(rng, c.V);
      }
      if (c.has_draft) drows[i] = RandomProbRow(rng, c.V);
    }
    // Tokens: for sampled requests the children of a node are distinct tokens that its draft row
    // gives positive probability; the row is widened to cover them when needed.
    for (int i = 0; i < n; ++i) {
      const auto& ks = kids[i];
      if (ks.empty()) continue;
      if (sampled && static_cast<int64_t>(ks.size()) <= c.V) {
        std::vector<int32_t> perm(static_cast<size_t>(c.V));
        std::iota(perm.begin(), perm.end(), 0);
        std::shuffle(perm.begin(), perm.end(), rng.g);
        std::vector<double> w(drows[i].begin(), drows[i].end());
        for (size_t j = 0; j < ks.size(); ++j) {
          tok[ks[j]] = perm[j];
          if (w[perm[j]] <= 0.0) w[perm[j]] = rng.Chance(0.5) ? 1e-6 : rng.Real();
        }
        const double s = std::accumulate(w.begin(), w.end(), 0.0);
        for (int64_t v = 0; v < c.V; ++v) drows[i][v] = static_cast<float>(w[v] / s);
        for (size_t j = 0; j < ks.size(); ++j) {  // float rounding must not zero a child's entry
          if (drows[i][perm[j]] <= 0.0f) drows[i][perm[j]] = 1e-7f;
        }
      } else {
        for (int32_t k : ks) {
          // Deterministic children: often the target's likely tokens, duplicates allowed.
          tok[k] = rng.Chance(0.5) ? static_cast<int32_t>(FirstMax(trows[i].data(), c.V))
                                   : static_cast<int32_t>(rng.Int(0, c.V - 1));
        }
      }
    }
    if (sampled) {
      // More sampled children than tokens cannot be distinct draws: make the request target-only.
      for (int i = 0; i < n; ++i) {
        if (static_cast<int64_t>(kids[i].size()) > c.V) c.sampled.back() = 0;
      }
    }
    for (int i = 0; i < n; ++i) {
      c.parents.push_back(p[i]);
      c.tokens.push_back(tok[i]);
      c.target.insert(c.target.end(), trows[i].begin(), trows[i].end());
      if (c.has_draft) c.draft.insert(c.draft.end(), drows[i].begin(), drows[i].end());
    }
    c.indptr.push_back(static_cast<int64_t>(c.parents.size()));
  }
  c.N = static_cast<int64_t>(c.parents.size());
  c.width = max_depth + 1 + (rng.Chance(0.3) ? rng.Int(1, 3) : 0);
  return c;
}

// The properties every successful result has: a root-first path of parent-child steps, the
// accepted tokens are the path's tokens, a final token in range, -1 padding; greedy requests take
// the first maximum everywhere and stop only where no child holds it; stochastic requests emit only
// tokens the target gives positive probability.
void CheckAcceptResult(const AcceptCase& c) {
  for (int64_t b = 0; b < c.B; ++b) {
    const int64_t base = c.indptr[b], n = c.indptr[b + 1] - base;
    const int32_t acc = c.out_count[b];
    ASSERT_GE(acc, 0);
    ASSERT_LT(acc, c.width);
    const int32_t* nodes = &c.out_nodes[b * c.width];
    const int32_t* toks = &c.out_tokens[b * c.width];
    ASSERT_EQ(nodes[0], 0) << "request " << b;
    for (int32_t k = 1; k <= acc; ++k) {
      ASSERT_TRUE(nodes[k] > 0 && nodes[k] < n) << "request " << b;
      ASSERT_EQ(c.parents[base + nodes[k]], nodes[k - 1]) << "request " << b;
      ASSERT_EQ(toks[k - 1], c.tokens[base + nodes[k]]) << "request " << b;
    }
    ASSERT_TRUE(toks[acc] >= 0 && toks[acc] < c.V) << "request " << b;
    for (int64_t w = acc + 1; w < c.width; ++w) {
      ASSERT_EQ(nodes[w], -1);
      ASSERT_EQ(toks[w], -1);
    }
    // Per step along the path: the emitted token at depth k was decided at node nodes[k].
    for (int32_t k = 0; k <= acc; ++k) {
      const int64_t row = base + nodes[k];
      const float* p = &c.target[row * c.V];
      const int32_t t = toks[k];
      if (c.greedy[b]) {
        ASSERT_EQ(t, FirstMax(p, c.V)) << "request " << b << " depth " << k;
      } else {
        ASSERT_GT(p[t], 0.0f) << "request " << b << " emitted a token of target probability 0";
      }
    }
    // The walk stops at the first node with no child holding the emitted token (greedy and
    // target-only walks: the first matching child is taken).
    if (!c.sampled[b] || c.greedy[b]) {
      for (int32_t k = 0; k <= acc; ++k) {
        int32_t first = -1;
        for (int64_t i = 1; i < n && first < 0; ++i) {
          if (c.parents[base + i] == nodes[k] && c.tokens[base + i] == toks[k]) {
            first = static_cast<int32_t>(i);
          }
        }
        if (k < acc) {
          ASSERT_EQ(first, nodes[k + 1]) << "request " << b;
        } else {
          ASSERT_EQ(first, -1) << "request " << b << " stopped though a child holds the token";
        }
      }
    }
  }
}

TEST(FuzzAccept, RandomValidBatches) {
  ThreadPool one(1, 0), two(2, 0);
  RunCases(1500, [&](uint64_t seed) {
    Rng rng(seed);
    const bool logits = rng.Chance(0.25);
    AcceptCase c = RandomAcceptCase(rng, logits);
    AcceptTrees(c.Args(), &two);
    CheckAcceptResult(c);
    if (::testing::Test::HasFailure()) return;
    // Same result on one thread, and for every request alone (results depend only on a request's
    // own inputs and positions).
    const auto nodes = c.out_nodes, toks = c.out_tokens, count = c.out_count;
    AcceptTrees(c.Args(), &one);
    ASSERT_EQ(c.out_nodes, nodes);
    ASSERT_EQ(c.out_tokens, toks);
    ASSERT_EQ(c.out_count, count);
    if (c.B > 1 && rng.Chance(0.3)) {
      const int64_t b = rng.Int(0, c.B - 1);
      AcceptCase s;
      s.V = c.V;
      s.B = 1;
      s.width = c.width;
      s.has_draft = c.has_draft;
      s.opt = c.opt;
      const int64_t lo = c.indptr[b], hi = c.indptr[b + 1];
      s.parents.assign(c.parents.begin() + lo, c.parents.begin() + hi);
      s.tokens.assign(c.tokens.begin() + lo, c.tokens.begin() + hi);
      s.target.assign(c.target.begin() + lo * c.V, c.target.begin() + hi * c.V);
      if (c.has_draft) s.draft.assign(c.draft.begin() + lo * c.V, c.draft.begin() + hi * c.V);
      s.indptr = {0, hi - lo};
      s.N = hi - lo;
      s.greedy = {c.greedy[b]};
      s.sampled = {c.sampled[b]};
      s.seeds = {c.seeds[b]};
      s.offsets = {c.offsets[b]};
      AcceptTrees(s.Args(), &one);
      ASSERT_EQ(s.out_count[0], count[b]);
      for (int64_t w = 0; w < c.width; ++w) {
        ASSERT_EQ(s.out_nodes[w], nodes[b * c.width + w]);
        ASSERT_EQ(s.out_tokens[w], toks[b * c.width + w]);
      }
    }
  });
}

// Random non-finite, negative or unnormalised entries: a ValueError or a valid result, never
// anything else. A bad entry in a root row (always read) must be a ValueError; in logits mode,
// every row is checked, so a NaN or +inf anywhere, or a row with no finite entry, must be one.
TEST(FuzzAccept, CorruptedRowsAreCleanErrors) {
  ThreadPool two(2, 0);
  int64_t thrown = 0, passed = 0;
  RunCases(2000, [&](uint64_t seed) {
    Rng rng(seed);
    const bool logits = rng.Chance(0.3);
    AcceptCase c = RandomAcceptCase(rng, logits);
    bool must_throw = false;
    const int hits = static_cast<int>(rng.Int(1, 3));
    for (int h = 0; h < hits; ++h) {
      const bool in_draft = c.has_draft && rng.Chance(0.3);
      const int64_t row = rng.Int(0, c.N - 1);
      std::vector<float>& m = in_draft ? c.draft : c.target;
      float* r = &m[row * c.V];
      const int kind = static_cast<int>(rng.Int(0, 5));
      const int64_t v = rng.Int(0, c.V - 1);
      bool bad_probs = true;  // as a probability row
      switch (kind) {
        case 0: r[v] = kNaN; break;
        case 1: r[v] = kInf; break;
        case 2: r[v] = -kInf; break;
        case 3: r[v] = static_cast<float>(-rng.Real()) - 1e-3f; break;
        case 4: std::fill(r, r + c.V, -kInf); break;
        default:  // entries zeroed or scaled
          for (int64_t x = 0; x < c.V; ++x) r[x] *= rng.Chance(0.5) ? 0.0f : 1.5f;
          bad_probs = std::abs(std::accumulate(r, r + c.V, 0.0) - 1.0) > c.opt.row_sum_tolerance;
          break;
      }
      // A root row is read by every walk (a bad row elsewhere may or may not be reached).
      if (!logits && !in_draft && bad_probs) {
        for (int64_t b = 0; b < c.B; ++b) must_throw = must_throw || c.indptr[b] == row;
      }
    }
    if (logits) {  // every logits row is checked: the exact rule over all rows
      for (int64_t row = 0; row < c.N; ++row) {
        const float* r = &c.target[row * c.V];
        must_throw = must_throw || std::any_of(r, r + c.V, [](float x) {
                       return std::isnan(x) || x == kInf;
                     }) || std::none_of(r, r + c.V, [](float x) { return std::isfinite(x); });
      }
    }
    bool threw = false;
    try {
      AcceptTrees(c.Args(), &two);
    } catch (const ValueError&) {
      threw = true;
    }
    if (must_throw) ASSERT_TRUE(threw) << "a bad row that is always read was accepted";
    if (logits) ASSERT_EQ(threw, must_throw);
    if (!threw) {
      ++passed;
      CheckAcceptResult(c);
    } else {
      ++thrown;
    }
  });
  if (FuzzIters(2000) >= 2000) {
    EXPECT_GT(thrown, 100);
    EXPECT_GT(passed, 20);
  }
}

// Malformed arguments (shapes, dtypes, trees, offsets, tokens, widths, options): always a
// ValueError, raised before anything is read out of bounds.
TEST(FuzzAccept, MalformedArgumentsAreValueErrors) {
  ThreadPool two(2, 0);
  RunCases(3000, [&](uint64_t seed) {
    Rng rng(seed);
    AcceptCase c = RandomAcceptCase(rng, rng.Chance(0.2));
    // Buffers for views whose dtype or length is changed: sized for what the view claims.
    std::vector<int64_t> wide(static_cast<size_t>(std::max<int64_t>(c.N, c.B) + 4) * 2, 0);
    std::vector<float> longer(static_cast<size_t>((c.N + 2) * (c.V + 2)), 0.0f);
    std::vector<int32_t> ibuf(static_cast<size_t>(c.N + 2), 0);
    std::vector<int32_t> obuf(static_cast<size_t>(c.B * (c.width + 1)), 0);
    std::vector<double> dbl(static_cast<size_t>(c.N * c.V), 0.0);
    const int what = static_cast<int>(rng.Int(0, 21));
    const int64_t b = rng.Int(0, c.B - 1);
    switch (what) {
      case 0: {  // a bad parent (non-root: not an earlier node; root: not -1)
        const int64_t lo = c.indptr[b], n = c.indptr[b + 1] - lo;
        if (n == 1 || rng.Chance(0.3)) {
          c.parents[lo] = static_cast<int32_t>(rng.Pick<int64_t>({0, 1, -2, INT32_MIN, INT32_MAX}));
        } else {
          const int64_t i = rng.Int(1, n - 1);
          c.parents[lo + i] = static_cast<int32_t>(
              rng.Pick<int64_t>({i, i + rng.Int(1, 1000), -1, -2, INT32_MIN, INT32_MAX}));
        }
        break;
      }
      case 1: {  // tree offsets (indptr): not starting at 0, not ending at N, non-monotone, huge
        const int64_t k = rng.Int(0, c.B);
        const std::vector<int64_t> vals = {-1, c.N + 1, c.N + 1000, std::numeric_limits<int64_t>::max(),
                                           std::numeric_limits<int64_t>::min(),
                                           (k > 0 ? c.indptr[k - 1] : 1)};
        int64_t v = rng.Pick(vals);
        if (v == c.indptr[k]) v = c.indptr[k] - 1;
        c.indptr[k] = v;
        break;
      }
      case 2: {  // a non-root token out of range
        int64_t i = -1;
        for (int64_t t = 0; t < 20 && i < 0; ++t) {
          const int64_t j = rng.Int(0, c.N - 1);
          if (c.parents[j] != -1) i = j;
        }
        if (i < 0) {  // only roots: a bad parent instead
          c.parents[0] = 0;
          break;
        }
        c.tokens[i] = static_cast<int32_t>(rng.Pick<int64_t>({-1, c.V, c.V + 7, INT32_MIN, INT32_MAX}));
        break;
      }
      case 3: {  // output width below max depth + 1
        int32_t depth = 0;
        std::vector<int32_t> d(c.parents.size(), 0);
        for (int64_t bb = 0; bb < c.B; ++bb) {
          for (int64_t i = c.indptr[bb] + 1; i < c.indptr[bb + 1]; ++i) {
            d[i] = d[c.indptr[bb] + c.parents[i]] + 1;
            depth = std::max(depth, d[i]);
          }
        }
        c.width = rng.Int(0, depth);
        break;
      }
      case 4: c.opt.row_sum_tolerance = rng.Pick<double>({0.0, -1e-3, 0.51, 1.0, std::nan("")}); break;
      case 5:  // sampled children without draft rows
        c.has_draft = false;
        c.opt.target_is_logits = false;
        c.greedy[b] = 0;
        c.sampled[b] = 1;
        break;
      case 6:  // logits mode with a non-greedy request, or with draft rows
        c.opt.target_is_logits = true;
        if (rng.Chance(0.5) || !c.has_draft) {
          c.greedy[b] = 0;
        }
        break;
      default:
        break;
    }
    AcceptTreesArgs a = c.Args();
    switch (what) {
      case 7: a.tokens = TensorView::Contiguous(ibuf.data(), DType::kInt32, {c.N + rng.Pick<int64_t>({-1, 1, 2})}); break;
      case 8: a.parents = TensorView::Contiguous(ibuf.data(), DType::kInt32, {c.N + 1}); break;
      case 9: a.tokens = TensorView::Contiguous(wide.data(), DType::kInt64, {c.N}); break;
      case 10: a.parents = TensorView::Contiguous(wide.data(), DType::kInt64, {c.N}); break;
      case 11: a.tree_indptr = TensorView::Contiguous(ibuf.data(), DType::kInt32, {c.B + 1}); break;
      case 12:
        a.tree_indptr = TensorView::Contiguous(c.indptr.data(), DType::kInt64, {rng.Chance(0.5) ? c.B : 0});
        break;
      case 13: a.target = TensorView::Contiguous(dbl.data(), DType::kFloat64, {c.N, c.V}); break;
      case 14:
        a.draft_probs = TensorView::Contiguous(longer.data(), DType::kFloat32,
                                               {c.N + rng.Int(0, 1), c.V + 1});
        break;
      case 15: a.target = TensorView::Contiguous(longer.data(), DType::kFloat32, {c.N * c.V}); break;
      case 16: a.greedy = TensorView::Contiguous(ibuf.data(), DType::kInt32, {c.B}); break;
      case 17: a.seeds = TensorView::Contiguous(wide.data(), DType::kInt64, {c.B + 1}); break;
      case 18: a.emitted_tokens = TensorView::Contiguous(obuf.data(), DType::kInt32, {c.B, c.width + 1}); break;
      case 19: {  // a non-contiguous view
        TensorView* views[] = {&a.target, &a.tokens, &a.parents, &a.seeds, &a.accepted_nodes};
        TensorView* v = views[rng.Int(0, 4)];
        v->strides[v->ndim - 1] = 2;
        if (v->is_contiguous()) v->device.type = DeviceType::kCUDA;  // (a size-1 dim: a device)
        break;
      }
      case 20: a.offsets.device.type = DeviceType::kCUDA; break;
      case 21: a.num_accepted = TensorView::Contiguous(ibuf.data(), DType::kInt32, {c.B, 1}); break;
      default: break;
    }
    EXPECT_THROW(AcceptTrees(a, &two), ValueError) << "mutation " << what;
  });
}

// A sampled child whose token the draft row gives probability 0 (or a repeated sibling token)
// cannot have been drawn: a ValueError when the walk tests it (the root's first child always is).
TEST(FuzzAccept, ImpossibleSampledChildIsValueError) {
  ThreadPool two(2, 0);
  RunCases(1000, [&](uint64_t seed) {
    Rng rng(seed);
    AcceptCase c = RandomAcceptCase(rng, false);
    int64_t b = -1;
    for (int64_t k = 0; k < c.B && b < 0; ++k) {
      if (c.sampled[k] && !c.greedy[k] && c.indptr[k + 1] - c.indptr[k] > 1 && c.V > 1) b = k;
    }
    if (b < 0) return;
    const int64_t lo = c.indptr[b];
    int64_t first = -1;  // the root's first child
    for (int64_t i = lo + 1; i < c.indptr[b + 1] && first < 0; ++i) {
      if (c.parents[i] == 0) first = i;
    }
    float* q = &c.draft[lo * c.V];
    const int32_t x = c.tokens[first];
    q[x] = 0.0f;
    double s = std::accumulate(q, q + c.V, 0.0);
    if (s <= 0.0) {
      q[(x + 1) % c.V] = 1.0f;
      s = 1.0;
    }
    for (int64_t v = 0; v < c.V; ++v) q[v] = static_cast<float>(q[v] / s);
    EXPECT_THROW(AcceptTrees(c.Args(), &two), ValueError);
  });
}

// ApplySamplingFilters on random logits (ties, -inf, NaN, +inf, rows without a finite entry) and
// random parameters (some out of range): a ValueError exactly when an input is invalid, else
// distributions that sum to 1, are 0 where the logit is -inf, and are one-hot at the first maximum
// for temperature 0.
TEST(FuzzAccept, SamplingFiltersOnRandomRows) {
  ThreadPool two(2, 0);
  int64_t filtered = 0, rejected = 0;
  RunCases(2000, [&](uint64_t seed) {
    Rng rng(seed);
    const int64_t V = rng.Pick<int64_t>({1, 2, 3, 7, 16, 33, 100});
    const int64_t N = rng.Int(1, 6);
    std::vector<float> z(static_cast<size_t>(N * V)), temp(N), tp(N), mp(N),
        out(static_cast<size_t>(N * V), -1.0f);
    std::vector<int32_t> tk(N);
    bool bad = false;
    // About one case in four gets a bad row (NaN, +inf, or no finite entry).
    const int64_t bad_row = rng.Chance(0.25) ? rng.Int(0, N - 1) : -1;
    for (int64_t r = 0; r < N; ++r) {
      const int kind = static_cast<int>(rng.Int(0, 6));
      float* row = &z[r * V];
      for (int64_t v = 0; v < V; ++v) {
        row[v] = kind < 3 ? static_cast<float>(rng.Int(-2, 2))  // ties
                 : kind < 6 ? (rng.Chance(0.4) ? -kInf : static_cast<float>(rng.Real() * 20 - 10))
                            : static_cast<float>(rng.Real() * 200 - 100);
      }
      if (r == bad_row) {
        switch (rng.Int(0, 2)) {
          case 0: row[rng.Int(0, V - 1)] = kNaN; break;
          case 1: row[rng.Int(0, V - 1)] = kInf; break;
          default: std::fill(row, row + V, -kInf); break;
        }
      } else if (std::none_of(row, row + V, [](float x) { return std::isfinite(x); })) {
        row[rng.Int(0, V - 1)] = static_cast<float>(rng.Int(-3, 3));
      }
      bad = bad || r == bad_row;
      temp[r] = rng.Chance(0.25) ? 0.0f : static_cast<float>(rng.Real() * 2 + 0.05);
      tk[r] = static_cast<int32_t>(rng.Chance(0.5) ? 0 : rng.Int(1, V + 2));
      tp[r] = rng.Chance(0.5) ? 1.0f : static_cast<float>(rng.Real() * 0.99 + 0.01);
      mp[r] = rng.Chance(0.6) ? 0.0f : static_cast<float>(rng.Real());
      if (rng.Chance(0.05)) {  // a parameter out of range
        switch (rng.Int(0, 5)) {
          case 0: temp[r] = rng.Chance(0.5) ? -0.5f : kNaN; break;
          case 1: temp[r] = kInf; break;
          case 2: tk[r] = -1; break;
          case 3: tp[r] = rng.Chance(0.5) ? 0.0f : 1.5f; break;
          case 4: tp[r] = kNaN; break;
          default: mp[r] = rng.Chance(0.5) ? -0.1f : 1.1f; break;
        }
        bad = true;
      }
    }
    auto call = [&] {
      ApplySamplingFilters(TensorView::Contiguous(z.data(), DType::kFloat32, {N, V}),
                           TensorView::Contiguous(temp.data(), DType::kFloat32, {N}),
                           TensorView::Contiguous(tk.data(), DType::kInt32, {N}),
                           TensorView::Contiguous(tp.data(), DType::kFloat32, {N}),
                           TensorView::Contiguous(mp.data(), DType::kFloat32, {N}),
                           TensorView::Contiguous(out.data(), DType::kFloat32, {N, V}), &two);
    };
    if (bad) {
      EXPECT_THROW(call(), ValueError);
      ++rejected;
      return;
    }
    call();
    ++filtered;
    for (int64_t r = 0; r < N; ++r) {
      const float* p = &out[r * V];
      const float* row = &z[r * V];
      double s = 0.0;
      for (int64_t v = 0; v < V; ++v) {
        ASSERT_TRUE(std::isfinite(p[v]) && p[v] >= 0.0f) << "row " << r << " token " << v;
        if (row[v] == -kInf) ASSERT_EQ(p[v], 0.0f);
        s += p[v];
      }
      ASSERT_NEAR(s, 1.0, 1e-5) << "row " << r;
      if (temp[r] == 0.0f) {
        const int64_t m = FirstMax(row, V);
        for (int64_t v = 0; v < V; ++v) ASSERT_EQ(p[v], v == m ? 1.0f : 0.0f);
      } else if (tk[r] > 0 && tk[r] < V) {
        ASSERT_LE(std::count_if(p, p + V, [](float x) { return x > 0.0f; }), tk[r]);
      }
    }
  });
  if (FuzzIters(2000) >= 2000) {
    EXPECT_GT(filtered, 800);
    EXPECT_GT(rejected, 300);
  }
}

}  // namespace
}  // namespace pyspec
