#include <gtest/gtest.h>

#include <algorithm>
#include <random>

#include "pyspec/check.h"
#include "pyspec/tree.h"

namespace pyspec {
namespace {

TEST(TokenTree, RootOnly) {
  TokenTree t;
  EXPECT_EQ(t.num_nodes(), 1);
  EXPECT_EQ(t.max_depth(), 0);
  EXPECT_TRUE(t.is_chain());
  EXPECT_TRUE(t.IsAncestorOrSelf(0, 0));
  EXPECT_TRUE(t.ToPaths().empty());
}

TEST(TokenTree, ChainIsTreeWithOneChildPerNode) {
  TokenTree t = TokenTree::Chain(5);
  ASSERT_EQ(t.num_nodes(), 6);
  EXPECT_TRUE(t.is_chain());
  EXPECT_EQ(t.max_depth(), 5);
  for (int i = 0; i < 6; ++i) {
    for (int j = 0; j < 6; ++j) EXPECT_EQ(t.IsAncestorOrSelf(j, i), j <= i) << i << " " << j;
  }
  EXPECT_EQ(t.PathTo(3), (std::vector<int32_t>{0, 1, 2, 3}));
}

TEST(TokenTree, KAryShapes) {
  TokenTree t = TokenTree::KAry(4, 3);
  EXPECT_EQ(t.num_nodes(), 1 + 4 + 16 + 64);
  EXPECT_EQ(t.max_depth(), 3);
  EXPECT_FALSE(t.is_chain());
  EXPECT_EQ(t.num_children(0), 4);
  EXPECT_EQ(t.num_children(84), 0);
  EXPECT_THROW(TokenTree::KAry(4, 4), ValueError);  // 341 nodes > 256
  EXPECT_THROW(TokenTree::KAry(0, 1), ValueError);
}

TEST(TokenTree, MasksMatchParentWalk) {
  std::mt19937 rng(7);
  for (int trial = 0; trial < 200; ++trial) {
    int n = 1 + rng() % TokenTree::kMaxNodes;
    std::vector<int32_t> parents(n);
    parents[0] = -1;
    for (int i = 1; i < n; ++i) {
      // Bias toward recent parents to get deep trees, but stay within depth 64.
      parents[i] = (rng() % 3 == 0) ? rng() % i : std::max(0, i - 1 - int(rng() % 4));
    }
    std::vector<int32_t> depth(n, 0);
    bool ok = true;
    for (int i = 1; i < n; ++i) {
      depth[i] = depth[parents[i]] + 1;
      ok = ok && depth[i] <= TokenTree::kMaxDepth;
    }
    if (!ok) {
      EXPECT_THROW(TokenTree::FromParents(parents), ValueError);
      continue;
    }
    TokenTree t = TokenTree::FromParents(parents);
    for (int i = 0; i < n; ++i) {
      std::vector<bool> anc(n, false);
      for (int a = i; a >= 0; a = parents[a]) anc[a] = true;
      for (int j = 0; j < n; ++j) ASSERT_EQ(t.IsAncestorOrSelf(j, i), anc[j]);
      ASSERT_EQ(t.depths()[i], depth[i]);
      int kids = 0;
      for (const int32_t* c = t.children_begin(i); c != t.children_end(i); ++c) {
        ASSERT_EQ(parents[*c], i);
        ++kids;
      }
      ASSERT_EQ(kids, static_cast<int>(std::count(parents.begin(), parents.end(), i)));
    }
    // Paths round trip through the choices format.
    TokenTree back = TokenTree::FromPaths(t.ToPaths());
    ASSERT_EQ(back.num_nodes(), n);
    ASSERT_EQ(back.ToPaths().size(), t.ToPaths().size());
  }
}

TEST(TokenTree, FromPathsMedusaStyle) {
  // Listed out of order on purpose: the tree sorts by (depth, lexicographic).
  TokenTree t = TokenTree::FromPaths({{0, 0}, {1}, {0}, {0, 1}, {2}, {0, 0, 0}});
  ASSERT_EQ(t.num_nodes(), 7);
  EXPECT_EQ(t.parents(), (std::vector<int32_t>{-1, 0, 0, 0, 1, 1, 4}));
  EXPECT_EQ(t.ranks(), (std::vector<int32_t>{0, 0, 1, 2, 0, 1, 0}));
  auto paths = t.ToPaths();
  EXPECT_EQ(paths[0], (std::vector<int32_t>{0}));
  EXPECT_EQ(paths[5], (std::vector<int32_t>{0, 0, 0}));
  // A rank may be skipped (top-3 child only): it is kept, not renumbered.
  TokenTree skip = TokenTree::FromPaths({{2}});
  EXPECT_EQ(skip.ranks()[1], 2);
}

TEST(TokenTree, BadInputIsValueError) {
  EXPECT_THROW(TokenTree::FromParents({}), ValueError);
  EXPECT_THROW(TokenTree::FromParents({0}), ValueError);
  EXPECT_THROW(TokenTree::FromParents({-1, 1}), ValueError);      // self parent
  EXPECT_THROW(TokenTree::FromParents({-1, 0, 3, 0}), ValueError);  // forward parent
  EXPECT_THROW(TokenTree::FromParents({-1, -1}), ValueError);     // two roots
  EXPECT_THROW(TokenTree::FromParents({-1, 0}, {1}), ValueError);  // token count
  EXPECT_THROW(TokenTree::FromParents(std::vector<int32_t>(257, 0)), ValueError);
  EXPECT_THROW(TokenTree::FromPaths({{0, 1}}), ValueError);  // missing prefix {0}
  EXPECT_THROW(TokenTree::FromPaths({{0}, {0}}), ValueError);
  EXPECT_THROW(TokenTree::FromPaths({{}}), ValueError);
  EXPECT_THROW(TokenTree::FromPaths({{-1}}), ValueError);
  EXPECT_THROW(TokenTree::Chain(-1), ValueError);
  EXPECT_THROW(TokenTree::Chain(65), ValueError);  // deeper than 64
  EXPECT_NO_THROW(TokenTree::Chain(64));
}

TEST(TokenTree, ValidateTreeBatch) {
  std::vector<int32_t> parents = {-1, 0, 1, -1, -1, 0, 0};
  std::vector<int64_t> indptr = {0, 3, 4, 7};
  EXPECT_NO_THROW(ValidateTreeBatch(parents.data(), indptr.data(), 3, 7, "trees"));
  parents[5] = 2;  // forward reference in tree 2
  EXPECT_THROW(ValidateTreeBatch(parents.data(), indptr.data(), 3, 7, "trees"), ValueError);
  parents[5] = 0;
  indptr = {0, 3, 3, 7};  // empty tree
  EXPECT_THROW(ValidateTreeBatch(parents.data(), indptr.data(), 3, 7, "trees"), ValueError);
}

}  // namespace
}  // namespace pyspec
