// Token trees: one draft tree per request per step (DESIGN section 2).
//
// Node 0 is the root: the last accepted token, whose KV is not yet in the cache. Nodes are in
// topological order (parent index < child index), so every walk from the root visits nodes in
// increasing index. A chain is a tree whose every node has at most one child; there is no separate
// chain type. Ancestor sets are bit-packed: row i has bit j set when j is i or an ancestor of i.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace pyspec {

class TokenTree {
 public:
  static constexpr int kMaxNodes = 256;
  static constexpr int kMaxDepth = 64;
  static constexpr int kMaskWords = kMaxNodes / 64;

  // The root alone.
  TokenTree() : TokenTree(FromParents({-1})) {}

  // parents[0] must be -1 and 0 <= parents[i] < i for i > 0. tokens: empty (a template whose tokens
  // are filled later, stored as -1) or one per node. Throws ValueError naming the bad entry.
  static TokenTree FromParents(std::vector<int32_t> parents, std::vector<int32_t> tokens = {});
  // Root + gamma nodes in a line (gamma >= 0).
  static TokenTree Chain(int gamma);
  // Full k-ary tree: every node above `depth` has `width` children. Nodes in breadth-first order.
  static TokenTree KAry(int width, int depth);
  // The "choices" format of Medusa/EAGLE: each path lists child ranks from the root, e.g. {0},{1},{0,0}
  // means the root's top-1 and top-2 children and the top-1 child of the first. Every proper prefix of
  // a path must be listed too. Nodes are ordered by (depth, lexicographic path), the root first.
  static TokenTree FromPaths(const std::vector<std::vector<int32_t>>& paths);

  // The inverse of FromPaths: the rank path of every non-root node, in node order.
  std::vector<std::vector<int32_t>> ToPaths() const;

  int num_nodes() const { return static_cast<int>(parents_.size()); }
  int max_depth() const { return max_depth_; }
  bool is_chain() const;
  const std::vector<int32_t>& parents() const { return parents_; }
  const std::vector<int32_t>& depths() const { return depths_; }
  const std::vector<int32_t>& tokens() const { return tokens_; }
  // Rank of each node among its siblings (its index in its parent's top-k); 0 for the root.
  const std::vector<int32_t>& ranks() const { return ranks_; }
  // Children of `node` in increasing index order.
  const int32_t* children_begin(int node) const { return child_list_.data() + child_indptr_[node]; }
  const int32_t* children_end(int node) const { return child_list_.data() + child_indptr_[node + 1]; }
  int num_children(int node) const { return child_indptr_[node + 1] - child_indptr_[node]; }

  // kMaskWords words: bit j of the row of `node` is set when j is `node` or one of its ancestors.
  const uint64_t* ancestor_mask(int node) const { return masks_.data() + node * kMaskWords; }
  bool IsAncestorOrSelf(int ancestor, int node) const {
    return (ancestor_mask(node)[ancestor >> 6] >> (ancestor & 63)) & 1u;
  }
  // Node indices from the root to `node`, both included.
  std::vector<int32_t> PathTo(int node) const;

  // Replaces the tokens (one per node).
  void SetTokens(std::vector<int32_t> tokens);

  std::string ToString() const;

 private:
  struct Uninit {};
  explicit TokenTree(Uninit) {}

  std::vector<int32_t> parents_;
  std::vector<int32_t> depths_;
  std::vector<int32_t> tokens_;
  std::vector<int32_t> ranks_;
  std::vector<int32_t> child_indptr_;
  std::vector<int32_t> child_list_;
  std::vector<uint64_t> masks_;
  int max_depth_ = 0;
};

// Validates a batch of trees given as flattened parent arrays: parents[tree_indptr[b] ..
// tree_indptr[b+1]) is tree b with tree-local indices. Throws ValueError naming `name`.
void ValidateTreeBatch(const int32_t* parents,     // [total_nodes]
                       const int64_t* tree_indptr,  // [batch + 1]
                       int64_t batch, int64_t total_nodes, const char* name);

}  // namespace pyspec
