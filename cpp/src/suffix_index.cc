#include "pyspec/suffix_index.h"

#include <algorithm>
#include <queue>

#include "pyspec/check.h"

namespace pyspec {

SuffixIndex::SuffixIndex(const std::vector<int32_t>& tokens, const std::vector<int64_t>& offsets) {
  PYSPEC_CHECK(!offsets.empty() && offsets.front() == 0, "offsets must start with 0");
  PYSPEC_CHECK(offsets.back() == static_cast<int64_t>(tokens.size()),
               "offsets must end with the number of tokens (", tokens.size(), "); got ",
               offsets.back());
  for (size_t d = 1; d < offsets.size(); ++d) {
    PYSPEC_CHECK(offsets[d] >= offsets[d - 1], "offsets must be ascending; offsets[", d, "] = ",
                 offsets[d], " < ", offsets[d - 1]);
  }
  const int64_t total = static_cast<int64_t>(tokens.size() + offsets.size() - 1);
  PYSPEC_CHECK(total < (int64_t{1} << 31), "a suffix index holds fewer than 2^31 tokens; got ",
               total);
  num_tokens_ = static_cast<int64_t>(tokens.size());
  num_docs_ = static_cast<int64_t>(offsets.size()) - 1;
  text_.reserve(total);
  for (int64_t d = 0; d < num_docs_; ++d) {
    for (int64_t i = offsets[d]; i < offsets[d + 1]; ++i) {
      PYSPEC_CHECK(tokens[i] >= 0, "tokens must be >= 0; tokens[", i, "] = ", tokens[i]);
      text_.push_back(tokens[i]);
    }
    text_.push_back(-1);
  }
  // Prefix doubling: after the round with step h, rank orders positions by their first 2h tokens.
  const int64_t n = total;
  std::vector<uint32_t> rank(n);
  for (int64_t i = 0; i < n; ++i) rank[i] = static_cast<uint32_t>(text_[i] + 1);  // separator 0
  std::vector<std::pair<uint64_t, int64_t>> keyed(n);
  for (int h = 1; h < kSortDepth; h *= 2) {
    for (int64_t i = 0; i < n; ++i) {
      const uint64_t next = i + h < n ? rank[i + h] : 0;
      keyed[i] = {(static_cast<uint64_t>(rank[i]) << 32) | next, i};
    }
    std::sort(keyed.begin(), keyed.end());
    uint32_t r = 0;
    bool distinct = true;
    for (int64_t k = 0; k < n; ++k) {
      if (k > 0 && keyed[k].first != keyed[k - 1].first) ++r;
      else if (k > 0) distinct = false;
      rank[keyed[k].second] = r;
    }
    if (distinct) break;
  }
  sa_.reserve(num_tokens_);
  for (int64_t k = 0; k < n; ++k) {
    if (text_[keyed[k].second] >= 0) sa_.push_back(keyed[k].second);
  }
}

int SuffixIndex::Compare(int64_t pos, const int32_t* pattern, int m) const {
  for (int k = 0; k < m; ++k) {
    const int32_t t = At(pos + k);
    if (t != pattern[k]) return t < pattern[k] ? -1 : 1;
  }
  return 0;
}

SuffixIndex::Match SuffixIndex::LongestMatch(const int32_t* ctx, int64_t n, int max_len,
                                             int min_len) const {
  Match out;
  const int top = static_cast<int>(std::min<int64_t>({n, max_len, kSortDepth}));
  for (int m = top; m >= std::max(min_len, 1); --m) {
    const int32_t* pat = ctx + n - m;
    auto lo = std::partition_point(sa_.begin(), sa_.end(),
                                   [&](int64_t p) { return Compare(p, pat, m) < 0; });
    auto hi = std::partition_point(lo, sa_.end(),
                                   [&](int64_t p) { return Compare(p, pat, m) == 0; });
    // Entries whose next token is a separator sort first: the last one tells whether any goes on.
    if (lo != hi && At(*(hi - 1) + m) >= 0) {
      out.length = m;
      out.lo = lo - sa_.begin();
      out.hi = hi - sa_.begin();
      return out;
    }
  }
  return out;
}

void SuffixIndex::Children(int64_t lo, int64_t hi, int offset, std::vector<Child>* out) const {
  out->clear();
  int64_t i = lo;
  while (i < hi) {
    const int32_t c = At(sa_[i] + offset);
    const int64_t j = std::partition_point(sa_.begin() + i, sa_.begin() + hi,
                                           [&](int64_t p) { return At(p + offset) <= c; }) -
                      sa_.begin();
    if (c >= 0) out->push_back({c, i, j});
    i = j;
  }
}

SuffixIndex::Draft SuffixIndex::Propose(const int32_t* ctx, int64_t n, int max_nodes,
                                        int max_depth, int max_match, int min_match,
                                        float min_prob, int max_children) const {
  PYSPEC_CHECK(max_match >= 1 && min_match >= 1 && min_match <= max_match,
               "need 1 <= min_match <= max_match; got min_match=", min_match,
               ", max_match=", max_match);
  PYSPEC_CHECK(max_depth >= 0 && static_cast<int64_t>(max_match) + max_depth <= kSortDepth,
               "max_match + max_depth must be <= ", kSortDepth, "; got ", max_match, " + ",
               max_depth);
  PYSPEC_CHECK(max_children >= 1, "max_children must be >= 1; got ", max_children);
  // A draft is a token tree: at most 256 nodes are verified, so a much larger bound only
  // guards the search's memory against a mistyped argument.
  PYSPEC_CHECK(max_nodes <= 4096, "max_nodes must be <= 4096; got ", max_nodes);
  Draft out;
  if (max_nodes <= 0 || max_depth <= 0 || n <= 0 || sa_.empty()) return out;
  const Match match = LongestMatch(ctx, n, max_match, min_match);
  out.match_length = match.length;
  if (!match.length) return out;
  struct Cand {
    float score;
    int32_t parent, token, depth;
    int64_t lo, hi;
    bool operator<(const Cand& o) const { return score < o.score; }
  };
  std::priority_queue<Cand> heap;
  std::vector<Child> kids;
  auto expand = [&](int32_t node, int depth, float score, int64_t lo, int64_t hi) {
    Children(lo, hi, match.length + depth, &kids);
    int64_t total = 0;
    for (const Child& c : kids) total += c.hi - c.lo;
    if (total == 0) return;
    if (static_cast<int>(kids.size()) > max_children) {
      std::partial_sort(kids.begin(), kids.begin() + max_children, kids.end(),
                        [](const Child& a, const Child& b) { return a.hi - a.lo > b.hi - b.lo; });
      kids.resize(max_children);
    }
    for (const Child& c : kids) {
      const float s = score * static_cast<float>(c.hi - c.lo) / static_cast<float>(total);
      if (s >= min_prob) heap.push({s, node, c.token, depth + 1, c.lo, c.hi});
    }
  };
  expand(-1, 0, 1.0f, match.lo, match.hi);
  while (!heap.empty() && static_cast<int>(out.tokens.size()) < max_nodes) {
    const Cand c = heap.top();
    heap.pop();
    const int32_t node = static_cast<int32_t>(out.tokens.size());
    out.tokens.push_back(c.token);
    out.parents.push_back(c.parent);
    out.probs.push_back(c.score);
    if (c.depth < max_depth) expand(node, c.depth, c.score, c.lo, c.hi);
  }
  return out;
}

}  // namespace pyspec
