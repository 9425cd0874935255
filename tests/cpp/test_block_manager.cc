#include "pyspec/block_manager.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <chrono>
#include <map>
#include <random>
#include <set>
#include <vector>

#include "pyspec/check.h"

namespace pyspec {
namespace {

std::vector<int32_t> Range(int32_t start, int32_t n) {
  std::vector<int32_t> v(n);
  for (int32_t i = 0; i < n; ++i) v[i] = start + i;
  return v;
}

std::vector<int32_t> Concat(std::vector<int32_t> a, const std::vector<int32_t>& b) {
  a.insert(a.end(), b.begin(), b.end());
  return a;
}

TEST(BlockManager, ConstructorValidates) {
  EXPECT_THROW(BlockManager(0, 16), ValueError);
  EXPECT_THROW(BlockManager(-3, 16), ValueError);
  EXPECT_THROW(BlockManager(int64_t{1} << 32, 16), ValueError);
  EXPECT_THROW(BlockManager(8, 0), ValueError);
  EXPECT_THROW(BlockManager(8, 65537), ValueError);
  // Token slots are allocated up front: far beyond any real pool is an error, not an allocation.
  EXPECT_THROW(BlockManager(int64_t{1} << 28, 16), ValueError);
  BlockManager bm(7, 3);
  EXPECT_EQ(bm.num_total_blocks(), 7);
  EXPECT_EQ(bm.num_free_blocks(), 7);
  EXPECT_EQ(bm.num_used_blocks(), 0);
  EXPECT_EQ(bm.usage_ratio(), 0.0);
  bm.CheckInvariants();
}

TEST(BlockManager, AddReserveSlotsCommit) {
  BlockManager bm(10, 4);
  EXPECT_EQ(bm.AddRequest(1, Range(100, 10)), 0);
  EXPECT_EQ(bm.NumTokens(1), 10);
  EXPECT_EQ(bm.NumComputed(1), 0);
  ASSERT_EQ(bm.BlockTable(1).size(), 3u);
  EXPECT_EQ(bm.Capacity(1), 12);
  EXPECT_EQ(bm.num_used_blocks() + bm.num_free_blocks(), bm.num_total_blocks());
  EXPECT_EQ(bm.num_used_blocks(), 3);

  std::vector<int64_t> slots = bm.SlotsFor(1, 0, 12);
  const auto& t = bm.BlockTable(1);
  for (int p = 0; p < 12; ++p) EXPECT_EQ(slots[p], int64_t{t[p / 4]} * 4 + p % 4);
  EXPECT_THROW(bm.SlotsFor(1, 10, 3), ValueError);  // past capacity

  bm.MarkComputed(1, 9);  // prefill; the last prompt token is the next step's root
  EXPECT_EQ(bm.NumComputed(1), 9);
  EXPECT_EQ(bm.num_cached_blocks(), 2);

  // Speculative step with a depth-4 tree: 2 drafts accepted + 1 bonus token.
  ASSERT_TRUE(bm.Reserve(1, 5));
  EXPECT_EQ(bm.Capacity(1), 16);
  std::vector<int64_t> dst = bm.SlotsFor(1, 9, 3);
  EXPECT_EQ(dst.size(), 3u);
  ASSERT_TRUE(bm.Commit(1, {7, 8, 9}, /*num_computed=*/3));
  EXPECT_EQ(bm.NumTokens(1), 13);
  EXPECT_EQ(bm.NumComputed(1), 12);
  EXPECT_EQ(bm.num_cached_blocks(), 3);
  EXPECT_EQ(bm.Tokens(1).back(), 9);
  bm.CheckInvariants();

  bm.Free(1);
  EXPECT_FALSE(bm.HasRequest(1));
  EXPECT_EQ(bm.num_used_blocks(), 0);
  EXPECT_EQ(bm.num_evictable_blocks(), 3);
  EXPECT_EQ(bm.num_free_blocks(), 10);
  bm.CheckInvariants();
}

TEST(BlockManager, PrefixHitSharesBlocks) {
  BlockManager bm(16, 4);
  std::vector<int32_t> prefix = Range(1, 8);
  ASSERT_EQ(bm.AddRequest(1, Concat(prefix, {50, 51})), 0);
  bm.MarkComputed(1, 10);
  EXPECT_EQ(bm.prefix_queries(), 10);
  EXPECT_EQ(bm.prefix_hits(), 0);

  EXPECT_EQ(bm.AddRequest(2, Concat(prefix, {60, 61, 62})), 8);
  EXPECT_EQ(bm.NumComputed(2), 8);
  const std::vector<int32_t> a = bm.BlockTable(1);
  const std::vector<int32_t> b = bm.BlockTable(2);
  ASSERT_EQ(b.size(), 3u);
  EXPECT_EQ(a[0], b[0]);
  EXPECT_EQ(a[1], b[1]);
  EXPECT_NE(a[2], b[2]);
  EXPECT_EQ(bm.RefCount(a[0]), 2);
  EXPECT_EQ(bm.prefix_hits(), 8);
  EXPECT_EQ(bm.prefix_queries(), 21);

  // The whole prompt is cached: keep the last block to compute (logits need one token).
  EXPECT_EQ(bm.AddRequest(3, prefix), 4);
  EXPECT_EQ(bm.BlockTable(3)[0], a[0]);
  EXPECT_NE(bm.BlockTable(3)[1], a[1]);
  // One token past the cached blocks: both blocks hit.
  EXPECT_EQ(bm.AddRequest(4, Concat(prefix, {1})), 8);
  // A different first block misses everything, even when later blocks are equal.
  EXPECT_EQ(bm.AddRequest(5, Concat({9, 9, 9, 9}, Range(5, 8))), 0);
  EXPECT_DOUBLE_EQ(bm.hit_ratio(), double(8 + 4 + 8) / double(10 + 11 + 8 + 9 + 12));
  bm.CheckInvariants();

  // Hits survive the owner being freed (evictable blocks are still cached).
  bm.Free(1);
  bm.Free(2);
  bm.Free(3);
  bm.Free(4);
  EXPECT_EQ(bm.AddRequest(6, Concat(prefix, {70})), 8);
  EXPECT_EQ(bm.BlockTable(6)[0], a[0]);
  bm.CheckInvariants();
}

TEST(BlockManager, PrefixCacheDisabled) {
  BlockManager bm(16, 4, /*enable_prefix_cache=*/false);
  ASSERT_EQ(bm.AddRequest(1, Range(1, 10)), 0);
  bm.MarkComputed(1, 10);
  EXPECT_EQ(bm.num_cached_blocks(), 0);
  EXPECT_EQ(bm.AddRequest(2, Range(1, 10)), 0);
  EXPECT_EQ(bm.prefix_queries(), 0);
  bm.Free(1);
  EXPECT_EQ(bm.num_evictable_blocks(), 0);
  bm.CheckInvariants();
}

// Deliberately terrible hashes: every block collides.
uint64_t ConstantHash(uint64_t, const int32_t*, int) { return 42; }
uint64_t TokensOnlyHash(uint64_t, const int32_t* t, int n) {
  return BlockManager::DefaultHash(7, t, n);
}

TEST(BlockManager, CollisionsCompareTokens) {
  BlockManager bm(16, 4);
  bm.SetHashFunction(&ConstantHash);
  ASSERT_EQ(bm.AddRequest(1, Range(1, 9)), 0);
  bm.MarkComputed(1, 9);
  // Block 0 registered under 42; block 1 collides with it (other tokens): stays uncached.
  EXPECT_EQ(bm.num_cached_blocks(), 1);
  EXPECT_TRUE(bm.IsCached(bm.BlockTable(1)[0]));
  EXPECT_FALSE(bm.IsCached(bm.BlockTable(1)[1]));
  // Same hash, other tokens: a miss, not a wrong reuse.
  EXPECT_EQ(bm.AddRequest(2, Range(100, 9)), 0);
  EXPECT_EQ(bm.AddRequest(3, Range(1, 9)), 4);
  bm.CheckInvariants();
  EXPECT_THROW(bm.SetHashFunction(&TokensOnlyHash), ValueError);  // not on a used manager
}

TEST(BlockManager, CollisionsComparePredecessor) {
  // With a hash that ignores the predecessor, block 1 of [Z, Y] looks like block 1 of [X, Y]. Its
  // KV was computed after X, so it must not be reused after Z.
  BlockManager bm(16, 2);
  bm.SetHashFunction(&TokensOnlyHash);
  ASSERT_EQ(bm.AddRequest(1, {1, 1, 5, 5, 0}), 0);  // X Y
  bm.MarkComputed(1, 5);
  ASSERT_EQ(bm.AddRequest(2, {2, 2, 5, 5, 0}), 0);  // Z Y: Z registered, Y's hash already taken
  bm.MarkComputed(2, 5);
  EXPECT_EQ(bm.AddRequest(3, {2, 2, 5, 5, 9}), 2);  // Z hits, Y (after X) must not
  EXPECT_EQ(bm.AddRequest(4, {1, 1, 5, 5, 9}), 4);  // X Y hits in full
  bm.CheckInvariants();
}

TEST(BlockManager, ExhaustionChangesNothing) {
  BlockManager bm(4, 4);
  ASSERT_EQ(bm.AddRequest(1, Range(0, 12)), 0);
  EXPECT_EQ(bm.num_free_blocks(), 1);
  EXPECT_EQ(bm.AddRequest(2, Range(50, 8)), BlockManager::kNoSpace);
  EXPECT_FALSE(bm.HasRequest(2));
  EXPECT_EQ(bm.num_free_blocks(), 1);
  EXPECT_EQ(bm.prefix_queries(), 12);

  const std::vector<int32_t> table = bm.BlockTable(1);
  EXPECT_FALSE(bm.CanReserve(1, 8));
  EXPECT_EQ(bm.BlocksNeededToReserve(1, 8), 2);
  EXPECT_FALSE(bm.Reserve(1, 8));
  EXPECT_EQ(bm.BlockTable(1), table);
  EXPECT_FALSE(bm.Commit(1, Range(0, 5)));
  EXPECT_EQ(bm.NumTokens(1), 12);
  EXPECT_EQ(bm.BlockTable(1), table);
  EXPECT_TRUE(bm.CanReserve(1, 4));
  EXPECT_TRUE(bm.Commit(1, Range(0, 4)));
  EXPECT_EQ(bm.num_free_blocks(), 0);
  EXPECT_FALSE(bm.Reserve(1, 1));
  EXPECT_EQ(bm.AddRequest(3, {1}), BlockManager::kNoSpace);
  bm.CheckInvariants();
}

TEST(BlockManager, ExhaustionCountsHitBlocksOnce) {
  // The only cached block is evictable; a request that hits it must not also count it as free.
  BlockManager bm(3, 2);
  ASSERT_EQ(bm.AddRequest(1, {1, 2, 3}), 0);
  bm.MarkComputed(1, 3);
  bm.Free(1);  // block of {1, 2} evictable, the other free
  ASSERT_EQ(bm.AddRequest(2, {7, 7, 7, 7}), 0);  // the two free blocks
  EXPECT_EQ(bm.num_free_blocks(), 1);
  // Hits the evictable block and needs one more: none left.
  EXPECT_EQ(bm.AddRequest(3, {1, 2, 3}), BlockManager::kNoSpace);
  bm.CheckInvariants();
}

TEST(BlockManager, ForkCopyOnWrite) {
  BlockManager bm(16, 4);
  ASSERT_EQ(bm.AddRequest(1, Range(10, 6)), 0);
  ASSERT_TRUE(bm.Reserve(1, 0));
  bm.MarkComputed(1, 5);  // positions 0..4 computed: block 1 partially filled
  bm.Fork(1, 2);
  EXPECT_EQ(bm.BlockTable(1), bm.BlockTable(2));
  EXPECT_EQ(bm.NumComputed(2), 5);
  const std::vector<int32_t> shared = bm.BlockTable(1);
  EXPECT_EQ(bm.RefCount(shared[1]), 2);
  EXPECT_EQ(bm.num_used_blocks(), 2);
  // Writing position 5 into the shared block is refused until reserve() makes it private.
  EXPECT_THROW(bm.SlotsFor(2, 5, 1), ValueError);
  EXPECT_THROW(bm.MarkComputed(2, 1), ValueError);
  EXPECT_NO_THROW(bm.SlotsFor(2, 0, 5));  // reading the computed prefix is fine

  EXPECT_EQ(bm.BlocksNeededToReserve(2, 3), 2);  // one copy + one new block
  ASSERT_TRUE(bm.Reserve(2, 3));
  const auto& child = bm.BlockTable(2);
  EXPECT_EQ(child[0], shared[0]);
  EXPECT_NE(child[1], shared[1]);
  EXPECT_EQ(bm.BlockTable(1), shared);
  EXPECT_EQ(bm.num_pending_copies(), 1);
  bm.CheckInvariants();

  // The parent's old block is now private to it: no second copy.
  ASSERT_TRUE(bm.Reserve(1, 3));
  EXPECT_EQ(bm.BlockTable(1)[1], shared[1]);
  auto copies = bm.TakePendingCopies();
  ASSERT_EQ(copies.size(), 1u);
  EXPECT_EQ(copies[0], std::make_pair(shared[1], child[1]));
  EXPECT_EQ(bm.num_pending_copies(), 0);
  EXPECT_TRUE(bm.TakePendingCopies().empty());
  EXPECT_NO_THROW(bm.SlotsFor(2, 5, 4));
  EXPECT_TRUE(bm.Commit(2, {1, 2, 3}, 3));
  EXPECT_TRUE(bm.Commit(1, {4}, 1));
  EXPECT_NE(bm.Tokens(1), bm.Tokens(2));
  bm.CheckInvariants();
}

TEST(BlockManager, ForkAtBlockBoundaryNeedsNoCopy) {
  BlockManager bm(16, 4);
  ASSERT_EQ(bm.AddRequest(1, Range(10, 5)), 0);
  bm.MarkComputed(1, 4);
  bm.Fork(1, 2);
  ASSERT_TRUE(bm.Reserve(2, 1));
  EXPECT_EQ(bm.num_pending_copies(), 0);
  EXPECT_EQ(bm.BlockTable(1)[0], bm.BlockTable(2)[0]);
  EXPECT_NE(bm.BlockTable(1)[1], bm.BlockTable(2)[1]);
  bm.CheckInvariants();
}

TEST(BlockManager, FreeCancelsCopiesIntoItsBlocks) {
  BlockManager bm(8, 4);
  ASSERT_EQ(bm.AddRequest(1, Range(10, 6)), 0);
  bm.MarkComputed(1, 5);
  bm.Fork(1, 2);
  ASSERT_TRUE(bm.Reserve(2, 0));
  ASSERT_EQ(bm.num_pending_copies(), 1);
  const int32_t src = bm.BlockTable(1)[1];
  bm.Free(1);  // the source stays alive (pinned) until the copy is taken
  EXPECT_EQ(bm.RefCount(src), 1);
  bm.CheckInvariants();
  bm.Free(2);  // nobody needs the copy any more
  EXPECT_EQ(bm.num_pending_copies(), 0);
  EXPECT_EQ(bm.num_used_blocks(), 0);
  bm.CheckInvariants();
}

// A copy chain through a fork: request 1 gets a copy-on-write block d1 (copy s -> d1 pending), is
// forked again before the copies run, the fork gets its own copy d1 -> d2, and request 1 is freed.
// d1 is in no block table any more but must stay (pinned) and its incoming copy must stay pending:
// the runner performs s -> d1, then d1 -> d2. (CheckInvariants used to call this state corrupt; the
// randomized test in test_fuzz.cc found it.)
TEST(BlockManager, CopyChainThroughAForkKeepsTheMiddleBlock) {
  // Builds the chain; returns {s, d1, d2}.
  auto build = [](BlockManager& bm) {
    EXPECT_EQ(bm.AddRequest(1, Range(10, 6)), 0);
    EXPECT_TRUE(bm.Reserve(1, 0));
    bm.MarkComputed(1, 5);  // block 1 holds computed position 4
    bm.Fork(1, 2);
    const int32_t s = bm.BlockTable(1)[1];
    EXPECT_TRUE(bm.Reserve(1, 1));  // copy-on-write: s -> d1
    const int32_t d1 = bm.BlockTable(1)[1];
    bm.Fork(1, 3);
    EXPECT_TRUE(bm.Reserve(3, 1));  // copy-on-write of d1 (shared with 1): d1 -> d2
    const int32_t d2 = bm.BlockTable(3)[1];
    EXPECT_TRUE(s != d1 && d1 != d2 && s != d2);
    return std::vector<int32_t>{s, d1, d2};
  };
  BlockManager bm(10, 4);
  const std::vector<int32_t> b = build(bm);
  const std::vector<std::pair<int32_t, int32_t>> chain = {{b[0], b[1]}, {b[1], b[2]}};
  EXPECT_EQ(bm.PeekPendingCopies(), chain);
  bm.CheckInvariants();
  bm.Free(1);
  EXPECT_EQ(bm.PeekPendingCopies(), chain);  // both still needed, in this order
  EXPECT_EQ(bm.RefCount(b[1]), 1);           // pinned by d1 -> d2 only
  bm.CheckInvariants();
  const int64_t free_before = bm.num_free_blocks();
  EXPECT_EQ(bm.TakePendingCopies(), chain);
  EXPECT_EQ(bm.RefCount(b[1]), 0);  // released once the copies are taken
  EXPECT_EQ(bm.num_free_blocks(), free_before + 1);
  bm.CheckInvariants();
  bm.Free(2);
  bm.Free(3);
  EXPECT_EQ(bm.num_used_blocks(), 0);

  // The same chain dropped before the copies ran: freeing the fork cancels d1 -> d2, which
  // releases d1 and so cancels s -> d1.
  BlockManager bm2(10, 4);
  build(bm2);
  bm2.Free(1);
  bm2.Free(3);
  EXPECT_EQ(bm2.num_pending_copies(), 0);
  bm2.CheckInvariants();
  bm2.Free(2);
  EXPECT_EQ(bm2.num_used_blocks(), 0);
  bm2.CheckInvariants();
}

TEST(BlockManager, LruEvictsOldestUnreferenced) {
  BlockManager bm(6, 2);
  for (int64_t id = 1; id <= 3; ++id) {
    ASSERT_EQ(bm.AddRequest(id, {int32_t(id), int32_t(id), 0}), 0);
    bm.MarkComputed(id, 3);
  }
  const int32_t a0 = bm.BlockTable(1)[0], b0 = bm.BlockTable(2)[0], c0 = bm.BlockTable(3)[0];
  bm.Free(2);
  bm.Free(1);
  bm.Free(3);  // last use: b0 < a0 < c0
  EXPECT_EQ(bm.num_free_blocks(), 6);
  EXPECT_EQ(bm.num_evictable_blocks(), 3);
  // 4 blocks: the 3 never-cached free blocks first, then the least recently used cached one.
  ASSERT_EQ(bm.AddRequest(4, Range(100, 8)), 0);
  EXPECT_FALSE(bm.IsCached(b0));
  EXPECT_TRUE(bm.IsCached(a0));
  EXPECT_TRUE(bm.IsCached(c0));
  // A hit refreshes a block: after using and freeing a0 again, c0 is the oldest.
  ASSERT_EQ(bm.AddRequest(5, {1, 1, 9}), 2);
  bm.Free(5);
  bm.Free(4);
  bm.ResetCounters();
  ASSERT_EQ(bm.AddRequest(6, Range(200, 8)), 0);  // 4 free blocks (after 4's release): no eviction
  ASSERT_EQ(bm.AddRequest(7, Range(300, 2)), 0);  // evicts c0, the oldest
  EXPECT_FALSE(bm.IsCached(c0));
  EXPECT_TRUE(bm.IsCached(a0));
  bm.CheckInvariants();
}

TEST(BlockManager, FreeReleasesTailFirst) {
  // Freeing in reverse table order makes a request's tail evicted before its prefix.
  BlockManager bm(4, 2);
  ASSERT_EQ(bm.AddRequest(1, Range(0, 7)), 0);
  bm.MarkComputed(1, 7);
  const std::vector<int32_t> t = bm.BlockTable(1);
  bm.Free(1);
  EXPECT_EQ(bm.num_evictable_blocks(), 3);
  ASSERT_EQ(bm.AddRequest(2, Range(100, 4)), 0);  // the free partial block + evict t[2]
  EXPECT_FALSE(bm.IsCached(t[2]));
  EXPECT_TRUE(bm.IsCached(t[1]));
  // Hitting t[0], t[1] takes them off the evictable list: 2 more blocks are needed, none left.
  EXPECT_EQ(bm.AddRequest(3, Range(0, 7)), BlockManager::kNoSpace);
  bm.Free(2);
  EXPECT_EQ(bm.AddRequest(3, Range(0, 7)), 4);
  EXPECT_EQ(bm.BlockTable(3)[1], t[1]);
  EXPECT_EQ(bm.ResetPrefixCache(), 0);  // t[0], t[1] are in use
  bm.Free(3);
  EXPECT_EQ(bm.ResetPrefixCache(), 2);
  EXPECT_EQ(bm.num_cached_blocks(), 0);
  bm.CheckInvariants();
}

TEST(BlockManager, ArgumentErrors) {
  BlockManager bm(8, 4);
  ASSERT_EQ(bm.AddRequest(1, Range(0, 5)), 0);
  EXPECT_THROW(bm.AddRequest(1, Range(0, 5)), ValueError);
  EXPECT_THROW(bm.AddRequest(2, std::vector<int32_t>{}), ValueError);
  EXPECT_THROW(bm.Reserve(9, 1), ValueError);
  EXPECT_THROW(bm.Reserve(1, -1), ValueError);
  EXPECT_THROW(bm.Commit(1, Range(0, 2), -1), ValueError);
  EXPECT_THROW(bm.Commit(1, Range(0, 2), 8), ValueError);
  EXPECT_THROW(bm.MarkComputed(1, 6), ValueError);
  EXPECT_THROW(bm.MarkComputed(1, -1), ValueError);
  EXPECT_THROW(bm.SlotsFor(1, -1, 1), ValueError);
  EXPECT_THROW(bm.SlotsFor(1, 0, 9), ValueError);
  EXPECT_THROW(bm.Fork(1, 1), ValueError);
  EXPECT_THROW(bm.Fork(3, 4), ValueError);
  EXPECT_THROW(bm.Free(2), ValueError);
  EXPECT_THROW(bm.BlockTable(2), ValueError);
  EXPECT_THROW(bm.RefCount(8), ValueError);
  try {
    bm.Reserve(77, 0);
    FAIL();
  } catch (const ValueError& e) {
    EXPECT_NE(std::string(e.what()).find("request_id 77"), std::string::npos) << e.what();
  }
  EXPECT_EQ(bm.NumTokens(1), 5);
  bm.CheckInvariants();
}

// ---- property test ------------------------------------------------------------------------------
//
// Random operations under pool pressure with CheckInvariants() after each, plus a simulated KV
// pool: every slot holds a fingerprint of the token prefix its KV was computed from. After every
// operation, every computed position of every request must read back its own prefix's fingerprint.
// This checks end to end that prefix hits reuse the right KV, copy-on-write copies are complete and
// no request writes into a block another one reads.

uint64_t Fingerprint(uint64_t prev, int32_t token) {
  uint64_t x = prev ^ (static_cast<uint64_t>(static_cast<uint32_t>(token)) + 0x9e3779b97f4a7c15ull);
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
  return x ^ (x >> 31);
}

class Simulation {
 public:
  Simulation(int64_t num_blocks, int block_size, uint64_t seed)
      : bm_(num_blocks, block_size), rng_(seed), kv_(num_blocks * block_size, 0) {
    // A few shared prefixes (some block-aligned, some not) over a tiny vocabulary, so the prefix
    // cache hits, misses and sees duplicates.
    for (int k = 0; k < 5; ++k) {
      std::vector<int32_t> p(Uniform(0, 6 * block_size));
      for (auto& t : p) t = static_cast<int32_t>(Uniform(0, 3));
      prefixes_.push_back(p);
    }
  }

  int64_t Uniform(int64_t lo, int64_t hi) {  // inclusive
    return std::uniform_int_distribution<int64_t>(lo, hi)(rng_);
  }

  void Run(int num_ops) {
    for (int op = 0; op < num_ops; ++op) {
      Step();
      bm_.CheckInvariants();
      VerifyKV();
      if (::testing::Test::HasFailure()) return;
    }
  }

  int64_t adds = 0, rejected_adds = 0, hit_tokens = 0, forks = 0, copies = 0, failed_reserves = 0;

 private:
  int64_t RandomLive() {
    auto it = live_.begin();
    std::advance(it, Uniform(0, static_cast<int64_t>(live_.size()) - 1));
    return *it;
  }

  // The runner's part: perform pending copies before any write.
  void ApplyCopies() {
    const int bs = bm_.block_size();
    for (auto c : bm_.TakePendingCopies()) {
      ASSERT_NE(c.first, c.second);
      std::copy(kv_.begin() + int64_t{c.first} * bs, kv_.begin() + int64_t{c.first + 1} * bs,
                kv_.begin() + int64_t{c.second} * bs);
      ++copies;
    }
  }

  // Writes the KV of positions [num_computed, num_computed + n) of `tokens` (the request's tokens,
  // possibly extended by tokens about to be committed).
  void Write(int64_t id, const std::vector<int32_t>& tokens, int64_t n) {
    const int64_t start = bm_.NumComputed(id);
    std::vector<int64_t> slots = bm_.SlotsFor(id, start, n);
    uint64_t fp = 0;
    for (int64_t p = 0; p < start + n; ++p) {
      fp = Fingerprint(fp, tokens[p]);
      if (p >= start) kv_[slots[p - start]] = fp;
    }
  }

  void Step() {
    const int64_t r = Uniform(0, 999);
    if (live_.empty() || r < 180) {
      const auto& pre = prefixes_[Uniform(0, prefixes_.size() - 1)];
      std::vector<int32_t> prompt = pre;
      for (int64_t k = Uniform(pre.empty() ? 1 : 0, 2 * bm_.block_size()); k > 0; --k) {
        prompt.push_back(static_cast<int32_t>(Uniform(0, 3)));
      }
      const int64_t free_before = bm_.num_free_blocks();
      const int64_t got = bm_.AddRequest(next_id_, prompt);
      ++adds;
      if (got == BlockManager::kNoSpace) {
        ++rejected_adds;
        ASSERT_FALSE(bm_.HasRequest(next_id_));
        ASSERT_EQ(bm_.num_free_blocks(), free_before);
        if (!live_.empty()) Free(RandomLive());  // preempt: pool pressure frees someone
        return;
      }
      const int64_t n = static_cast<int64_t>(prompt.size());
      ASSERT_EQ(got % bm_.block_size(), 0);
      ASSERT_LE(got, (n - 1) / bm_.block_size() * bm_.block_size());
      ASSERT_EQ(bm_.NumComputed(next_id_), got);
      hit_tokens += got;
      live_.insert(next_id_++);
    } else if (r < 300) {  // reserve only: copies stay pending for a while
      const int64_t id = RandomLive();
      const int64_t extra = Uniform(0, 6);
      const bool can = bm_.CanReserve(id, extra);
      const std::vector<int32_t> before = bm_.BlockTable(id);
      const bool ok = bm_.Reserve(id, extra);
      ASSERT_EQ(ok, can);
      if (ok) {
        ASSERT_GE(bm_.Capacity(id), bm_.NumTokens(id) + extra);
      } else {
        ++failed_reserves;
        ASSERT_EQ(bm_.BlockTable(id), before);
      }
    } else if (r < 480) {  // prefill chunk
      const int64_t id = RandomLive();
      const int64_t todo = bm_.NumTokens(id) - bm_.NumComputed(id);
      if (todo == 0 || !bm_.Reserve(id, 0)) return;
      ApplyCopies();
      const int64_t n = Uniform(1, todo);
      Write(id, bm_.Tokens(id), n);
      bm_.MarkComputed(id, n);
    } else if (r < 700) {  // speculative step: root + a accepted drafts materialized, + bonus
      const int64_t id = RandomLive();
      const int64_t nt = bm_.NumTokens(id), nc = bm_.NumComputed(id);
      if (nc != nt - 1) return;  // still prefilling
      const int64_t depth = Uniform(0, 4);
      if (!bm_.Reserve(id, depth + 1)) {
        ++failed_reserves;
        if (live_.size() > 1) Free(RandomLive());
        return;
      }
      ApplyCopies();
      const int64_t a = Uniform(0, depth);
      std::vector<int32_t> accepted(a + 1);
      for (auto& t : accepted) t = static_cast<int32_t>(Uniform(0, 3));
      Write(id, Concat(bm_.Tokens(id), accepted), a + 1);
      ASSERT_TRUE(bm_.Commit(id, accepted, a + 1));
      if (bm_.NumTokens(id) > 12 * bm_.block_size()) Free(id);  // finished
    } else if (r < 760) {
      const int64_t parent = RandomLive();
      bm_.Fork(parent, next_id_);
      ++forks;
      live_.insert(next_id_++);
    } else if (r < 900) {
      Free(RandomLive());
    } else if (r < 940) {
      ApplyCopies();
    } else if (r < 945) {
      bm_.ResetPrefixCache();
    } else {  // invalid calls change nothing
      const int64_t free_before = bm_.num_free_blocks();
      EXPECT_THROW(bm_.Reserve(next_id_ + 5, 1), ValueError);
      const int64_t id = RandomLive();
      EXPECT_THROW(bm_.SlotsFor(id, 0, bm_.Capacity(id) + 1), ValueError);
      EXPECT_THROW(bm_.MarkComputed(id, bm_.NumTokens(id) - bm_.NumComputed(id) + 1), ValueError);
      EXPECT_THROW(bm_.AddRequest(id, {1}), ValueError);
      ASSERT_EQ(bm_.num_free_blocks(), free_before);
    }
  }

  void Free(int64_t id) {
    bm_.Free(id);
    live_.erase(id);
  }

  void VerifyKV() {
    // Copies still pending are performed before the next write: read through them.
    const std::vector<uint64_t>* kv = &kv_;
    std::vector<uint64_t> view;
    const auto pending = bm_.PeekPendingCopies();
    if (!pending.empty()) {
      view = kv_;
      const int bs = bm_.block_size();
      for (auto c : pending) {
        std::copy(view.begin() + int64_t{c.first} * bs, view.begin() + int64_t{c.first + 1} * bs,
                  view.begin() + int64_t{c.second} * bs);
      }
      kv = &view;
    }
    for (int64_t id : live_) {
      const auto& tokens = bm_.Tokens(id);
      const int64_t nc = bm_.NumComputed(id);
      if (nc == 0) continue;
      std::vector<int64_t> slots = bm_.SlotsFor(id, 0, nc);
      uint64_t fp = 0;
      for (int64_t p = 0; p < nc; ++p) {
        fp = Fingerprint(fp, tokens[p]);
        ASSERT_EQ((*kv)[slots[p]], fp) << "request " << id << " position " << p;
      }
    }
  }

  BlockManager bm_;
  std::mt19937_64 rng_;
  std::vector<uint64_t> kv_;  // [num_blocks * block_size] fingerprints
  std::vector<std::vector<int32_t>> prefixes_;
  std::set<int64_t> live_;
  int64_t next_id_ = 1;
};

TEST(BlockManagerProperty, RandomOpsKeepInvariants) {
  const auto t0 = std::chrono::steady_clock::now();
  Simulation sim(/*num_blocks=*/40, /*block_size=*/4, /*seed=*/20240611);
  sim.Run(100000);
  const double secs =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  // The run must exercise every path it is meant to test.
  EXPECT_GT(sim.hit_tokens, 1000);
  EXPECT_GT(sim.rejected_adds, 100);
  EXPECT_GT(sim.failed_reserves, 100);
  EXPECT_GT(sim.forks, 1000);
  EXPECT_GT(sim.copies, 100);
  RecordProperty("seconds", std::to_string(secs));
}

TEST(BlockManagerProperty, OddSizes) {
  for (int bs : {1, 3, 16}) {
    Simulation sim(/*num_blocks=*/bs == 1 ? 97 : 23, bs, /*seed=*/bs);
    sim.Run(10000);
    EXPECT_GT(sim.hit_tokens, 0) << bs;
  }
}

}  // namespace
}  // namespace pyspec
