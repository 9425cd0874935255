// Token corpus indexed for longest-suffix lookup: the datastore behind corpus drafting (a
// retrieval drafter in the manner of REST / SuffixDecoding, built from text the target wrote).
//
// Documents are concatenated with a separator after each; a suffix array orders every position by
// its first kSortDepth tokens, so every token string of up to kSortDepth tokens that occurs in the
// corpus owns one contiguous range of the array, and the tokens that follow it within that range
// are sorted: a range's continuations and their counts are read off with binary searches. Matches
// never cross a document boundary.
//
// Drafting: find the longest suffix of the context (max_match tokens at most) that occurs in the
// corpus with a continuation, then grow a tree best first, a node's score being the empirical
// probability of its path (the product of continuation frequencies along it), until the node
// budget is spent or no candidate scores min_prob. Construction O(N log N log kSortDepth); a draft
// costs O(nodes x distinct continuations x log N).
#pragma once

#include <cstdint>
#include <vector>

namespace pyspec {

class SuffixIndex {
 public:
  static constexpr int kSortDepth = 32;  // max_match + max_depth may not exceed it

  SuffixIndex() = default;
  // tokens: all documents back to back; offsets: document boundaries (offsets[0] = 0, ascending,
  // offsets.back() = tokens.size()). Tokens must be >= 0. Throws ValueError on bad input.
  SuffixIndex(const std::vector<int32_t>& tokens, const std::vector<int64_t>& offsets);

  int64_t num_tokens() const { return num_tokens_; }
  int64_t num_documents() const { return num_docs_; }

  // Longest suffix of ctx[0..n) of length min_len..max_len that occurs with a continuation.
  struct Match {
    int length = 0;  // 0: none
    int64_t lo = 0, hi = 0;  // suffix-array range of its occurrences (some may end a document)
  };
  Match LongestMatch(const int32_t* ctx, int64_t n, int max_len, int min_len) const;

  struct Draft {
    std::vector<int32_t> tokens;   // draft nodes, parents before children (the root excluded)
    std::vector<int32_t> parents;  // -1: a child of the root; else an index into tokens
    std::vector<float> probs;      // each node's path score
    int match_length = 0;
  };
  // A draft tree of at most max_nodes nodes and max_depth levels; each node gets at most
  // max_children children. Empty when no suffix of min_match tokens or more matches.
  Draft Propose(const int32_t* ctx, int64_t n, int max_nodes, int max_depth, int max_match,
                int min_match, float min_prob, int max_children) const;

  // Continuations of the range [lo, hi) whose entries share their first `offset` tokens:
  // (token, count, sub-range) in token order, separators skipped.
  struct Child {
    int32_t token;
    int64_t lo, hi;
  };
  void Children(int64_t lo, int64_t hi, int offset, std::vector<Child>* out) const;

 private:
  int32_t At(int64_t pos) const { return pos < num_tokens_ + num_docs_ ? text_[pos] : -1; }
  // Compare the suffix at `pos` with pattern[0..m): <0, 0 (pattern is its prefix), >0.
  int Compare(int64_t pos, const int32_t* pattern, int m) const;

  std::vector<int32_t> text_;  // documents, each followed by -1
  std::vector<int64_t> sa_;    // positions of non-separator tokens, sorted
  int64_t num_tokens_ = 0;
  int64_t num_docs_ = 0;
};

}  // namespace pyspec
