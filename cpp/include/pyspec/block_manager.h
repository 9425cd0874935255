// Paged-KV block manager with a prefix cache (DESIGN section 2, "Paged KV with lazy
// materialization").
//
// The KV pool itself ([num_blocks, block_size, kv_heads, head_dim] per layer, K and V) is owned by
// the runner or the C++ embedder. This class only hands out block ids and keeps, per request, the
// block table, and globally the reference counts, the free list and the prefix cache:
//
//   * A block is in exactly one state: free (uncached, unreferenced), used (referenced by a block
//     table or pinned by a pending copy), or evictable (cached, unreferenced; LRU by last use).
//   * Prefix cache: a full block whose KV is computed is registered under a chained 64-bit hash,
//     hash(block i) = H(hash(block i-1), tokens of block i). A hit also compares the stored tokens
//     and the identity (serial number) of the predecessor, so a hash collision can only cause a
//     miss, never a wrong reuse.
//   * Draft tokens never get blocks: a step's tree lives in scratch; only the accepted path is
//     copied into pages ("materialized") and appended with Commit().
//   * Copy-on-write: Fork() shares every block. Before a request writes into a block that another
//     table also references (Reserve/Commit), it gets a fresh block; if the shared block already
//     holds computed positions the manager records a pending copy (src, dst) which the runner must
//     perform, in order, before the forward that writes the new block (TakePendingCopies()).
//
// Per request: num_tokens = tokens known (prompt + committed), num_computed = tokens whose KV is in
// the pages. A speculative step of a request with T tokens (root at position T-1, not computed):
//   Reserve(id, depth + 1)              capacity for the accepted path + bonus token
//   TakePendingCopies(); copy blocks    (copy-on-write after a fork)
//   ... draft, verify: tree K/V in scratch ...
//   SlotsFor(id, T - 1, a + 1, slots)   root + a accepted drafts -> materialize_kv(..., slots)
//   Commit(id, accepted + bonus, a + 1, /*num_computed=*/a + 1)
// A prefill chunk of c tokens:
//   Reserve(id, 0); SlotsFor(id, num_computed, c, slots); forward; MarkComputed(id, c)
//
// Not thread-safe: one scheduler thread owns an instance. Errors in arguments (unknown ids,
// negative counts, positions past capacity) throw ValueError; pool exhaustion is normal and is
// reported by return values (the scheduler preempts), never by an exception.
#pragma once

#include <cstdint>
#include <unordered_map>
#include <utility>
#include <vector>

namespace pyspec {

class BlockManager {
 public:
  // Chained block hash: H(prev, tokens[0..n)). Replaceable for tests (see SetHashFunction).
  using HashFn = uint64_t (*)(uint64_t prev, const int32_t* tokens, int n);
  // Hash of the (absent) predecessor of block 0.
  static constexpr uint64_t kRootHash = 0x5bd1e9955bd1e995ull;
  // AddRequest's result when the pool cannot hold the prompt (nothing was changed).
  static constexpr int64_t kNoSpace = -1;

  // num_blocks in [1, 2^31 - 1], block_size in [1, 65536]. Throws ValueError otherwise.
  BlockManager(int64_t num_blocks, int block_size, bool enable_prefix_cache = true);

  // The default hash: a splitmix64-style mix over the tokens, seeded with `prev`.
  static uint64_t DefaultHash(uint64_t prev, const int32_t* tokens, int n);

  // Registers a request with its prompt (n >= 1 tokens) and allocates blocks for all of it, reusing
  // the longest cached run of full prompt blocks. Returns the number of prompt tokens whose KV is
  // already cached (num_computed; a multiple of block_size, at most ((n-1)/block_size)*block_size
  // so that at least one token is computed and produces logits), or kNoSpace when the pool cannot
  // supply the blocks even after evicting unreferenced cached blocks; then nothing changed. Throws
  // ValueError if `id` is already registered or n < 1.
  int64_t AddRequest(int64_t id, const int32_t* prompt, int64_t n);  // prompt: [n]
  int64_t AddRequest(int64_t id, const std::vector<int32_t>& prompt) {
    return AddRequest(id, prompt.data(), static_cast<int64_t>(prompt.size()));
  }

  // Ensures blocks (private to this request) cover positions [num_computed, num_tokens + extra).
  // Returns false, changing nothing, when the pool cannot supply them.
  bool Reserve(int64_t id, int64_t num_extra_tokens);
  // Whether Reserve(id, num_extra_tokens) would succeed now. Changes nothing.
  bool CanReserve(int64_t id, int64_t num_extra_tokens) const;
  // Blocks Reserve(id, num_extra_tokens) would take from the pool (new + copy-on-write).
  int64_t BlocksNeededToReserve(int64_t id, int64_t num_extra_tokens) const;

  // Appends n accepted tokens (Reserve semantics for capacity: returns false, changing nothing, if
  // the pool cannot hold them), then advances num_computed by `num_computed` (see MarkComputed).
  bool Commit(int64_t id, const int32_t* tokens, int64_t n, int64_t num_computed = 0);  // [n]
  bool Commit(int64_t id, const std::vector<int32_t>& tokens, int64_t num_computed = 0) {
    return Commit(id, tokens.data(), static_cast<int64_t>(tokens.size()), num_computed);
  }

  // The KV of the next n tokens (positions [num_computed, num_computed + n)) is now in the pages.
  // Newly full blocks enter the prefix cache (unless an identical block is already cached). Throws
  // ValueError if n < 0, num_computed + n > num_tokens, or a written block is shared (Reserve was
  // not called before writing).
  void MarkComputed(int64_t id, int64_t n);

  // out[i] = block_table[p / bs] * bs + p % bs for p = start + i, i in [0, n). Positions must lie
  // in the reserved capacity, and positions >= num_computed (about to be written) in private
  // blocks.
  void SlotsFor(int64_t id, int64_t start, int64_t n, int64_t* out) const;  // out: [n]
  std::vector<int64_t> SlotsFor(int64_t id, int64_t start, int64_t n) const;

  // Registers `child_id` as a copy of `parent_id` sharing all its blocks (refcount++), tokens and
  // num_computed. Never allocates.
  void Fork(int64_t parent_id, int64_t child_id);

  // Releases the request's blocks (in reverse order, so that its tail blocks are evicted before its
  // prefix). Cached blocks whose refcount reaches 0 stay cached as evictable.
  void Free(int64_t id);

  // Pending copy-on-write copies (src_block, dst_block), oldest first; clears the list. The runner
  // copies every layer's K and V block src -> dst, in this order, before writing dst.
  std::vector<std::pair<int32_t, int32_t>> TakePendingCopies();
  int64_t num_pending_copies() const { return static_cast<int64_t>(pending_.size()); }
  // The pending copies without taking them.
  std::vector<std::pair<int32_t, int32_t>> PeekPendingCopies() const;

  // Drops every unreferenced cached block (back to the free list). Blocks in use stay cached.
  // Returns the number of blocks dropped.
  int64_t ResetPrefixCache();

  // ---- queries ----
  bool HasRequest(int64_t id) const { return requests_.count(id) != 0; }
  int64_t num_requests() const { return static_cast<int64_t>(requests_.size()); }
  const std::vector<int32_t>& BlockTable(int64_t id) const;
  const std::vector<int32_t>& Tokens(int64_t id) const;
  int64_t NumTokens(int64_t id) const;
  int64_t NumComputed(int64_t id) const;
  // Token positions covered by the request's blocks.
  int64_t Capacity(int64_t id) const;

  int block_size() const { return block_size_; }
  bool prefix_cache_enabled() const { return enable_prefix_cache_; }
  int64_t num_total_blocks() const { return static_cast<int64_t>(blocks_.size()); }
  // Blocks an allocation can take: free + evictable.
  int64_t num_free_blocks() const { return static_cast<int64_t>(free_list_.size()) + lru_size_; }
  int64_t num_evictable_blocks() const { return lru_size_; }
  int64_t num_used_blocks() const { return num_total_blocks() - num_free_blocks(); }
  double usage_ratio() const {
    return static_cast<double>(num_used_blocks()) / static_cast<double>(num_total_blocks());
  }
  int64_t num_cached_blocks() const { return static_cast<int64_t>(cache_.size()); }
  // Prefix-cache counters, in tokens: prompt tokens looked up by successful AddRequest calls, and
  // those found cached (the returned num_computed).
  int64_t prefix_queries() const { return prefix_queries_; }
  int64_t prefix_hits() const { return prefix_hits_; }
  double hit_ratio() const {
    return prefix_queries_ == 0
               ? 0.0
               : static_cast<double>(prefix_hits_) / static_cast<double>(prefix_queries_);
  }
  void ResetCounters() { prefix_queries_ = prefix_hits_ = 0; }
  // Per-block state (for tests and debugging). Throws ValueError for a bad block id.
  int32_t RefCount(int32_t block) const;  // block-table references + pending-copy pins
  bool IsCached(int32_t block) const;

  // Verifies every internal invariant (see block_manager.cc); throws RuntimeError naming the first
  // violation. O(total blocks + total tokens): for tests.
  void CheckInvariants() const;

  // Replaces the block hash. Only allowed while nothing is cached (tests use a deliberately weak
  // hash to exercise collision handling).
  void SetHashFunction(HashFn fn);

 private:
  struct Block {
    int32_t ref = 0;           // block-table references
    int32_t pins = 0;          // pending copies reading this block
    bool cached = false;       // registered in cache_
    uint64_t hash = 0;         // chained hash (cached only)
    uint64_t prev_hash = 0;    // hash of the predecessor (cached only)
    uint64_t serial = 0;       // unique id of this cache registration (cached only)
    uint64_t parent_serial = 0;  // serial of the predecessor's registration; 0 for block 0
    uint64_t last_use = 0;     // tick when it became evictable
    int32_t lru_prev = -1, lru_next = -1;
  };
  struct Request {
    std::vector<int32_t> tokens;
    std::vector<int32_t> table;
    int64_t num_computed = 0;
    std::vector<uint64_t> hashes;  // chained hash of each full token block (computed lazily)
    // Per registered block (num_computed / block_size of them): serial of the cached block with the
    // same content and prefix; 0 = none (after a hash collision: later blocks are not cached).
    std::vector<uint64_t> serials;
  };
  struct PendingCopy {
    int32_t src, dst;
  };

  Request& Get(int64_t id, const char* what);
  const Request& Get(int64_t id, const char* what) const;
  int64_t NumBlocksFor(int64_t tokens) const { return (tokens + block_size_ - 1) / block_size_; }
  uint64_t RequestHash(Request& r, int64_t i) const;
  bool BlockTokensEqual(int32_t block, const int32_t* tokens) const;
  int64_t BlocksNeeded(const Request& r, int64_t target_tokens) const;
  void EnsureCapacity(Request& r, int64_t target_tokens);  // caller checked BlocksNeeded
  int32_t Allocate();
  void Unref(int32_t block);
  void Unpin(int32_t block);
  void MaybeRelease(int32_t block);
  void RegisterComputed(Request& r);
  void LruPushBack(int32_t block);
  void LruRemove(int32_t block);
  int32_t LruPopFront();
  void Uncache(int32_t block);

  int block_size_;
  bool enable_prefix_cache_;
  HashFn hash_fn_ = &DefaultHash;
  std::vector<Block> blocks_;
  std::vector<int32_t> block_tokens_;  // [num_blocks, block_size], valid for cached blocks
  std::vector<int32_t> free_list_;     // uncached, unreferenced; popped from the back
  int32_t lru_head_ = -1, lru_tail_ = -1;
  int64_t lru_size_ = 0;
  std::unordered_map<uint64_t, int32_t> cache_;  // chained hash -> cached block
  std::unordered_map<int64_t, Request> requests_;
  std::vector<PendingCopy> pending_;
  uint64_t tick_ = 0;
  uint64_t next_serial_ = 1;
  int64_t prefix_queries_ = 0;
  int64_t prefix_hits_ = 0;
};

}  // namespace pyspec
