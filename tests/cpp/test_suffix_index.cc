#include <gtest/gtest.h>

#include <map>
#include <random>
#include <vector>

#include "pyspec/check.h"
#include "pyspec/suffix_index.h"

namespace pyspec {
namespace {

using Docs = std::vector<std::vector<int32_t>>;

SuffixIndex Build(const Docs& docs) {
  std::vector<int32_t> tokens;
  std::vector<int64_t> offsets{0};
  for (const auto& d : docs) {
    tokens.insert(tokens.end(), d.begin(), d.end());
    offsets.push_back(static_cast<int64_t>(tokens.size()));
  }
  return SuffixIndex(tokens, offsets);
}

// Counts of the tokens that follow `pat` inside any document (brute force).
std::map<int32_t, int64_t> Follow(const Docs& docs, const std::vector<int32_t>& pat) {
  std::map<int32_t, int64_t> out;
  for (const auto& d : docs) {
    for (size_t i = 0; i + pat.size() < d.size(); ++i) {
      if (std::equal(pat.begin(), pat.end(), d.begin() + i)) ++out[d[i + pat.size()]];
    }
  }
  return out;
}

int BruteLongest(const Docs& docs, const std::vector<int32_t>& ctx, int max_len) {
  for (int m = std::min<int>(max_len, ctx.size()); m >= 1; --m) {
    std::vector<int32_t> pat(ctx.end() - m, ctx.end());
    if (!Follow(docs, pat).empty()) return m;
  }
  return 0;
}

TEST(SuffixIndex, RejectsBadInput) {
  EXPECT_THROW(SuffixIndex({1, 2}, {0, 3}), ValueError);
  EXPECT_THROW(SuffixIndex({1, 2}, {1, 2}), ValueError);
  EXPECT_THROW(SuffixIndex({1, -2}, {0, 2}), ValueError);
  EXPECT_THROW(SuffixIndex({1, 2, 3}, {0, 2, 1, 3}), ValueError);
  SuffixIndex s({1, 2, 3}, {0, 3});
  const int32_t ctx[] = {1, 2};
  EXPECT_THROW(s.Propose(ctx, 2, 4, 30, 8, 1, 0.f, 4), ValueError);  // 8 + 30 > 32
  EXPECT_THROW(s.Propose(ctx, 2, 4, 4, 2, 3, 0.f, 4), ValueError);   // min > max match
  // max_match + max_depth is summed without int overflow; max_nodes is bounded.
  EXPECT_THROW(s.Propose(ctx, 2, 4, 2147483647, 2147483647, 1, 0.f, 4), ValueError);
  EXPECT_THROW(s.Propose(ctx, 2, 4097, 4, 8, 1, 0.f, 4), ValueError);
}

TEST(SuffixIndex, EmptyCorpusAndNoMatch) {
  SuffixIndex empty({}, {0});
  const int32_t ctx[] = {5};
  EXPECT_EQ(empty.LongestMatch(ctx, 1, 8, 1).length, 0);
  EXPECT_TRUE(empty.Propose(ctx, 1, 4, 4, 8, 1, 0.f, 4).tokens.empty());
  SuffixIndex s({1, 2, 3}, {0, 3});
  EXPECT_EQ(s.LongestMatch(ctx, 1, 8, 1).length, 0);
  const int32_t last[] = {3};  // occurs only at the end of its document: nothing follows it
  EXPECT_EQ(s.LongestMatch(last, 1, 8, 1).length, 0);
}

TEST(SuffixIndex, MatchesNeverCrossDocuments) {
  SuffixIndex s = Build({{7, 8}, {9, 4}});
  const int32_t ctx[] = {8, 9};  // 8 ends doc 0, 9 starts doc 1
  auto m = s.LongestMatch(ctx, 2, 8, 1);
  EXPECT_EQ(m.length, 1);  // only "9" (followed by 4)
  auto d = s.Propose(ctx, 2, 4, 4, 8, 1, 0.f, 4);
  ASSERT_EQ(d.tokens.size(), 1u);
  EXPECT_EQ(d.tokens[0], 4);
}

TEST(SuffixIndex, AgreesWithBruteForce) {
  std::mt19937 rng(7);
  for (int trial = 0; trial < 20; ++trial) {
    const int vocab = 2 + trial % 5;
    Docs docs(1 + rng() % 6);
    for (auto& d : docs) {
      d.resize(rng() % 40);
      for (auto& t : d) t = rng() % vocab;
    }
    SuffixIndex s = Build(docs);
    for (int q = 0; q < 30; ++q) {
      std::vector<int32_t> ctx(1 + rng() % 10);
      for (auto& t : ctx) t = rng() % vocab;
      const int max_len = 1 + rng() % 8;
      auto m = s.LongestMatch(ctx.data(), ctx.size(), max_len, 1);
      ASSERT_EQ(m.length, BruteLongest(docs, ctx, max_len));
      auto d = s.Propose(ctx.data(), ctx.size(), 12, 4, max_len, 1, 0.f, 3);
      if (!m.length) {
        EXPECT_TRUE(d.tokens.empty());
        continue;
      }
      std::vector<int32_t> pat(ctx.end() - m.length, ctx.end());
      ASSERT_FALSE(d.tokens.empty());
      // The best first child is the most frequent continuation, scored by its frequency.
      auto follow = Follow(docs, pat);
      int64_t total = 0, best = 0;
      for (auto& kv : follow) total += kv.second, best = std::max(best, kv.second);
      EXPECT_EQ(d.parents[0], -1);
      EXPECT_EQ(follow[d.tokens[0]], best);
      EXPECT_FLOAT_EQ(d.probs[0], static_cast<float>(best) / total);
      // Every node's path follows the match somewhere in the corpus; scores never rise.
      for (size_t i = 0; i < d.tokens.size(); ++i) {
        ASSERT_LT(d.parents[i], static_cast<int32_t>(i));
        std::vector<int32_t> path;
        for (int j = static_cast<int>(i); j >= 0; j = d.parents[j]) path.insert(path.begin(), d.tokens[j]);
        ASSERT_LE(static_cast<int>(path.size()), 4);
        std::vector<int32_t> head = pat;
        head.insert(head.end(), path.begin(), path.end() - 1);
        EXPECT_GT(Follow(docs, head)[path.back()], 0);
        if (d.parents[i] >= 0) EXPECT_LE(d.probs[i], d.probs[d.parents[i]] + 1e-6f);
      }
    }
  }
}

TEST(SuffixIndex, BudgetAndThreshold) {
  // "1 2" is followed by 3 three times and by 4 once.
  SuffixIndex s = Build({{1, 2, 3, 5}, {1, 2, 3, 6}, {1, 2, 3, 5}, {1, 2, 4}});
  const int32_t ctx[] = {0, 1, 2};
  auto d = s.Propose(ctx, 3, 1, 4, 8, 1, 0.f, 4);
  ASSERT_EQ(d.tokens.size(), 1u);
  EXPECT_EQ(d.tokens[0], 3);
  EXPECT_EQ(d.match_length, 2);
  d = s.Propose(ctx, 3, 8, 4, 8, 1, 0.f, 4);
  // 3 (0.75), 3-5 (0.5), 4 (0.25), 3-6 (0.25); deeper nodes end their documents.
  ASSERT_EQ(d.tokens.size(), 4u);
  EXPECT_EQ(d.tokens[1], 5);
  EXPECT_EQ(d.parents[1], 0);
  d = s.Propose(ctx, 3, 8, 4, 8, 1, 0.3f, 4);
  EXPECT_EQ(d.tokens.size(), 2u);  // 3 and 3-5 only
  d = s.Propose(ctx, 3, 8, 4, 8, 3, 0.f, 4);
  EXPECT_TRUE(d.tokens.empty());  // no 3-token match
}

}  // namespace
}  // namespace pyspec
