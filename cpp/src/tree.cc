#include "pyspec/tree.h"

#include <algorithm>
#include <map>

#include "pyspec/check.h"

namespace pyspec {

TokenTree TokenTree::FromParents(std::vector<int32_t> parents, std::vector<int32_t> tokens) {
  const int64_t n = static_cast<int64_t>(parents.size());
  PYSPEC_CHECK(n >= 1, "a tree needs at least the root node (parents = [-1])");
  PYSPEC_CHECK(n <= kMaxNodes, "a tree has at most ", kMaxNodes, " nodes; got ", n);
  PYSPEC_CHECK(parents[0] == -1, "parents[0] must be -1 (node 0 is the root); got ", parents[0]);
  PYSPEC_CHECK(tokens.empty() || static_cast<int64_t>(tokens.size()) == n,
               "tokens must be empty or have one entry per node (", n, "); got ", tokens.size());
  TokenTree t{Uninit{}};
  t.parents_ = std::move(parents);
  t.tokens_ = tokens.empty() ? std::vector<int32_t>(n, -1) : std::move(tokens);
  t.depths_.assign(n, 0);
  t.ranks_.assign(n, 0);
  t.masks_.assign(n * kMaskWords, 0);
  t.child_indptr_.assign(n + 1, 0);
  std::vector<int32_t> num_children(n, 0);
  t.max_depth_ = 0;
  t.masks_[0] = 1;
  for (int64_t i = 1; i < n; ++i) {
    int32_t p = t.parents_[i];
    PYSPEC_CHECK(p >= 0 && p < i, "parents[", i, "] = ", p, " is invalid: each node's parent must ",
                 "come before it (0 <= parent < index), and only node 0 may have parent -1");
    t.depths_[i] = t.depths_[p] + 1;
    PYSPEC_CHECK(t.depths_[i] <= kMaxDepth, "tree depth exceeds ", kMaxDepth, " at node ", i);
    t.max_depth_ = std::max(t.max_depth_, t.depths_[i]);
    t.ranks_[i] = num_children[p]++;
    uint64_t* row = &t.masks_[i * kMaskWords];
    const uint64_t* prow = &t.masks_[p * kMaskWords];
    for (int w = 0; w < kMaskWords; ++w) row[w] = prow[w];
    row[i >> 6] |= uint64_t{1} << (i & 63);
  }
  for (int64_t i = 0; i < n; ++i) t.child_indptr_[i + 1] = t.child_indptr_[i] + num_children[i];
  t.child_list_.assign(n > 0 ? n - 1 : 0, 0);
  std::vector<int32_t> fill(t.child_indptr_.begin(), t.child_indptr_.end() - 1);
  for (int64_t i = 1; i < n; ++i) t.child_list_[fill[t.parents_[i]]++] = static_cast<int32_t>(i);
  return t;
}

TokenTree TokenTree::Chain(int gamma) {
  PYSPEC_CHECK(gamma >= 0 && gamma < kMaxNodes && gamma <= kMaxDepth,
               "chain length gamma must be in [0, ", std::min(kMaxNodes - 1, kMaxDepth), "]; got ",
               gamma);
  std::vector<int32_t> parents(gamma + 1);
  for (int i = 0; i <= gamma; ++i) parents[i] = i - 1;
  return FromParents(std::move(parents));
}

TokenTree TokenTree::KAry(int width, int depth) {
  PYSPEC_CHECK(width >= 1, "tree width must be >= 1; got ", width);
  PYSPEC_CHECK(depth >= 0 && depth <= kMaxDepth, "tree depth must be in [0, ", kMaxDepth, "]; got ",
               depth);
  std::vector<int32_t> parents = {-1};
  int64_t level_begin = 0, level_end = 1;
  for (int d = 0; d < depth; ++d) {
    for (int64_t p = level_begin; p < level_end; ++p) {
      for (int c = 0; c < width; ++c) {
        PYSPEC_CHECK(parents.size() < static_cast<size_t>(kMaxNodes), "a ", width, "-ary tree of depth ",
                     depth, " has more than ", kMaxNodes, " nodes");
        parents.push_back(static_cast<int32_t>(p));
      }
    }
    level_begin = level_end;
    level_end = static_cast<int64_t>(parents.size());
  }
  return FromParents(std::move(parents));
}

TokenTree TokenTree::FromPaths(const std::vector<std::vector<int32_t>>& paths) {
  PYSPEC_CHECK(paths.size() + 1 <= static_cast<size_t>(kMaxNodes), "a tree has at most ", kMaxNodes,
               " nodes; got ", paths.size(), " paths + the root");
  std::vector<std::vector<int32_t>> sorted = paths;
  for (size_t i = 0; i < sorted.size(); ++i) {
    PYSPEC_CHECK(!sorted[i].empty(), "paths[", i, "] is empty; the root is implicit");
    PYSPEC_CHECK(sorted[i].size() <= static_cast<size_t>(kMaxDepth), "paths[", i, "] is deeper than ",
                 kMaxDepth);
    for (int32_t r : sorted[i]) PYSPEC_CHECK(r >= 0, "paths[", i, "] has a negative rank ", r);
  }
  std::sort(sorted.begin(), sorted.end(), [](const auto& a, const auto& b) {
    if (a.size() != b.size()) return a.size() < b.size();
    return a < b;
  });
  std::map<std::vector<int32_t>, int32_t> index;
  std::vector<int32_t> parents = {-1};
  std::vector<int32_t> ranks = {0};
  for (const auto& path : sorted) {
    PYSPEC_CHECK(index.find(path) == index.end(), "path listed twice in the choices");
    int32_t parent = 0;
    if (path.size() > 1) {
      std::vector<int32_t> prefix(path.begin(), path.end() - 1);
      auto it = index.find(prefix);
      if (it == index.end()) {
        std::string listed;
        for (size_t i = 0; i < path.size(); ++i) detail::AppendAll(listed, i ? "," : "", path[i]);
        throw ValueError("path [" + listed + "] has no parent path listed; every proper prefix "
                         "of a path must be in the choices");
      }
      parent = it->second;
    }
    int32_t id = static_cast<int32_t>(parents.size());
    index[path] = id;
    parents.push_back(parent);
    ranks.push_back(path.back());
  }
  TokenTree t = FromParents(std::move(parents));
  t.ranks_ = std::move(ranks);  // keep the declared ranks (a path may skip a rank)
  return t;
}

std::vector<std::vector<int32_t>> TokenTree::ToPaths() const {
  std::vector<std::vector<int32_t>> out(num_nodes());
  for (int i = 1; i < num_nodes(); ++i) {
    out[i] = out[parents_[i]];
    out[i].push_back(ranks_[i]);
  }
  out.erase(out.begin());
  return out;
}

bool TokenTree::is_chain() const {
  for (int i = 0; i < num_nodes(); ++i) {
    if (num_children(i) > 1) return false;
  }
  return true;
}

std::vector<int32_t> TokenTree::PathTo(int node) const {
  PYSPEC_CHECK(node >= 0 && node < num_nodes(), "node ", node, " out of range [0, ", num_nodes(), ")");
  std::vector<int32_t> path(depths_[node] + 1);
  for (int i = node, k = depths_[node]; i >= 0; i = parents_[i], --k) path[k] = i;
  return path;
}

void TokenTree::SetTokens(std::vector<int32_t> tokens) {
  PYSPEC_CHECK(static_cast<int>(tokens.size()) == num_nodes(), "tokens must have one entry per node (",
               num_nodes(), "); got ", tokens.size());
  tokens_ = std::move(tokens);
}

std::string TokenTree::ToString() const {
  std::string s =
      detail::StrCat("TokenTree(num_nodes=", num_nodes(), ", max_depth=", max_depth_, ", parents=[");
  for (int i = 0; i < num_nodes(); ++i) detail::AppendAll(s, i ? ", " : "", parents_[i]);
  return s + "])";
}

void ValidateTreeBatch(const int32_t* parents, const int64_t* tree_indptr, int64_t batch,
                       int64_t total_nodes, const char* name) {
  PYSPEC_CHECK(tree_indptr[0] == 0, "'", name, "' indptr must start at 0; got ", tree_indptr[0]);
  PYSPEC_CHECK(tree_indptr[batch] == total_nodes, "'", name, "' indptr must end at the node count ",
               total_nodes, "; got ", tree_indptr[batch]);
  for (int64_t b = 0; b < batch; ++b) {
    const int64_t begin = tree_indptr[b], end = tree_indptr[b + 1];
    // begin is in [0, total_nodes] (tree_indptr[0] == 0, and every later entry was checked as the
    // previous tree's end), so end - begin cannot overflow once end > begin; an arbitrary end
    // (e.g. near INT64_MIN) is compared before any subtraction.
    PYSPEC_CHECK(end > begin, "'", name, "' tree ", b, " has no nodes (indptr [", begin, ", ", end,
                 ")); allowed 1..", TokenTree::kMaxNodes);
    const int64_t n = end - begin;
    PYSPEC_CHECK(n <= TokenTree::kMaxNodes, "'", name, "' tree ", b, " has ", n,
                 " nodes; allowed 1..", TokenTree::kMaxNodes);
    // indptr must stay inside the node array before any parent is read.
    PYSPEC_CHECK(end <= total_nodes, "'", name, "' indptr entry ", b + 1, " = ", end,
                 " is outside [0, ", total_nodes, "]");
    PYSPEC_CHECK(parents[begin] == -1, "'", name, "' tree ", b, ": node 0 must be the root (parent -1)");
    for (int64_t i = 1; i < n; ++i) {
      int32_t p = parents[begin + i];
      PYSPEC_CHECK(p >= 0 && p < i, "'", name, "' tree ", b, ": parent of node ", i, " is ", p,
                   "; must be in [0, ", i, ")");
    }
  }
}

}  // namespace pyspec
