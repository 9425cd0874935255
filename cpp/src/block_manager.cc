#include "pyspec/block_manager.h"

#include <algorithm>
#include <cstring>
#include <limits>

#include "pyspec/check.h"

namespace pyspec {
namespace {

constexpr uint64_t kGolden = 0x9e3779b97f4a7c15ull;

// The splitmix64 finalizer (Steele, Lea, Flood 2014): a bijection with full avalanche.
inline uint64_t Mix64(uint64_t x) {
  x ^= x >> 30;
  x *= 0xbf58476d1ce4e5b9ull;
  x ^= x >> 27;
  x *= 0x94d049bb133111ebull;
  x ^= x >> 31;
  return x;
}

constexpr int64_t kMaxTokenSlots = int64_t{1} << 31;

}  // namespace

BlockManager::BlockManager(int64_t num_blocks, int block_size, bool enable_prefix_cache)
    : block_size_(block_size), enable_prefix_cache_(enable_prefix_cache) {
  PYSPEC_CHECK(num_blocks >= 1 && num_blocks <= std::numeric_limits<int32_t>::max(),
               "num_blocks must be in [1, 2^31 - 1]; got ", num_blocks);
  PYSPEC_CHECK(block_size >= 1 && block_size <= 65536, "block_size must be in [1, 65536]; got ",
               block_size);
  // Token slots are allocated (and zeroed) up front: a bound far above any real KV pool keeps a
  // mistyped size an error instead of an allocation that exhausts the machine's memory.
  PYSPEC_CHECK(num_blocks * block_size <= kMaxTokenSlots, "num_blocks * block_size (",
               num_blocks * block_size, " token slots) must be at most ", kMaxTokenSlots);
  blocks_.resize(num_blocks);
  block_tokens_.assign(static_cast<size_t>(num_blocks) * block_size, 0);
  free_list_.reserve(num_blocks);
  // Popped from the back: hand out low block ids first (easier to read in tests and dumps).
  for (int64_t b = num_blocks - 1; b >= 0; --b) free_list_.push_back(static_cast<int32_t>(b));
}

uint64_t BlockManager::DefaultHash(uint64_t prev, const int32_t* tokens, int n) {
  // Two tokens per 64-bit word; the length is mixed in so that blocks of different sizes differ.
  uint64_t h = Mix64(prev + kGolden * static_cast<uint64_t>(n + 1));
  int i = 0;
  for (; i + 1 < n; i += 2) {
    uint64_t w = static_cast<uint64_t>(static_cast<uint32_t>(tokens[i])) |
                 (static_cast<uint64_t>(static_cast<uint32_t>(tokens[i + 1])) << 32);
    h = Mix64((h ^ w) + kGolden);
  }
  if (i < n) h = Mix64((h ^ static_cast<uint32_t>(tokens[i])) + kGolden);
  return h;
}

void BlockManager::SetHashFunction(HashFn fn) {
  PYSPEC_CHECK(fn != nullptr, "hash function must not be null");
  PYSPEC_CHECK(cache_.empty() && requests_.empty(),
               "the hash function can only be replaced on a fresh manager (no requests, no cache)");
  hash_fn_ = fn;
}

// ---- request lookup and helpers -----------------------------------------------------------------

namespace {
// Per-request token bound: keeps every position/slot computation far from int64 overflow
// (user-supplied counts are checked against it before any arithmetic).
constexpr int64_t kMaxTokens = int64_t{1} << 48;

void CheckExtraTokens(int64_t num_tokens, int64_t num_extra_tokens) {
  PYSPEC_CHECK(num_extra_tokens >= 0, "num_extra_tokens must be >= 0; got ", num_extra_tokens);
  PYSPEC_CHECK(num_extra_tokens <= kMaxTokens - num_tokens, "num_extra_tokens ", num_extra_tokens,
               " exceeds the per-request limit of ", kMaxTokens, " tokens");
}
}  // namespace

BlockManager::Request& BlockManager::Get(int64_t id, const char* what) {
  auto it = requests_.find(id);
  PYSPEC_CHECK(it != requests_.end(), "request_id ", id, " is not registered (", what, ")");
  return it->second;
}

const BlockManager::Request& BlockManager::Get(int64_t id, const char* what) const {
  auto it = requests_.find(id);
  PYSPEC_CHECK(it != requests_.end(), "request_id ", id, " is not registered (", what, ")");
  return it->second;
}

// Chained hash of the request's full token block i, extending the memo as needed.
uint64_t BlockManager::RequestHash(Request& r, int64_t i) const {
  PYSPEC_DCHECK((i + 1) * block_size_ <= static_cast<int64_t>(r.tokens.size()), "block ", i,
                " is not full");
  while (static_cast<int64_t>(r.hashes.size()) <= i) {
    int64_t k = static_cast<int64_t>(r.hashes.size());
    uint64_t prev = k == 0 ? kRootHash : r.hashes[k - 1];
    r.hashes.push_back(hash_fn_(prev, r.tokens.data() + k * block_size_, block_size_));
  }
  return r.hashes[i];
}

bool BlockManager::BlockTokensEqual(int32_t block, const int32_t* tokens) const {
  return std::memcmp(block_tokens_.data() + static_cast<size_t>(block) * block_size_, tokens,
                     sizeof(int32_t) * block_size_) == 0;
}

// Blocks that raising the request's capacity to `target_tokens` takes from the pool: new blocks
// past the table's end, plus a fresh copy of every shared block that positions [num_computed,
// target) would write into.
int64_t BlockManager::BlocksNeeded(const Request& r, int64_t target_tokens) const {
  const int64_t want = NumBlocksFor(target_tokens);
  const int64_t have = static_cast<int64_t>(r.table.size());
  int64_t need = std::max<int64_t>(0, want - have);
  for (int64_t i = r.num_computed / block_size_; i < std::min(want, have); ++i) {
    if (blocks_[r.table[i]].ref > 1) ++need;
  }
  return need;
}

void BlockManager::EnsureCapacity(Request& r, int64_t target_tokens) {
  const int64_t want = NumBlocksFor(target_tokens);
  const int64_t have = static_cast<int64_t>(r.table.size());
  for (int64_t i = r.num_computed / block_size_; i < std::min(want, have); ++i) {
    const int32_t old = r.table[i];
    if (blocks_[old].ref <= 1) continue;
    // Copy-on-write. Only the block holding position num_computed can hold computed positions of
    // this request; blocks wholly past it are replaced without a copy.
    const int32_t fresh = Allocate();
    if (r.num_computed > i * block_size_) {
      pending_.push_back({old, fresh});
      ++blocks_[old].pins;  // keeps `old` alive until the runner has copied it
    }
    r.table[i] = fresh;
    Unref(old);  // still referenced by the other table(s)
  }
  while (static_cast<int64_t>(r.table.size()) < want) r.table.push_back(Allocate());
}

// Takes a free block (never-cached or dropped ones first), else evicts the least recently used
// unreferenced cached block. The caller has checked num_free_blocks().
int32_t BlockManager::Allocate() {
  int32_t b;
  if (!free_list_.empty()) {
    b = free_list_.back();
    free_list_.pop_back();
  } else {
    b = LruPopFront();
    PYSPEC_ICHECK(b >= 0, "block pool exhausted; callers must check num_free_blocks() first");
    Uncache(b);
  }
  PYSPEC_DCHECK(blocks_[b].ref == 0 && blocks_[b].pins == 0, "allocated block ", b, " is in use");
  blocks_[b].ref = 1;
  return b;
}

void BlockManager::Unref(int32_t block) {
  PYSPEC_ICHECK(blocks_[block].ref > 0, "block ", block, " unreferenced twice");
  --blocks_[block].ref;
  MaybeRelease(block);
}

void BlockManager::Unpin(int32_t block) {
  PYSPEC_ICHECK(blocks_[block].pins > 0, "block ", block, " unpinned twice");
  --blocks_[block].pins;
  MaybeRelease(block);
}

// A block nobody references or pins returns to the pool: cached ones become evictable (LRU tail),
// others free. Pending copies into it are cancelled (nobody will read the destination), which may
// in turn release their sources.
void BlockManager::MaybeRelease(int32_t block) {
  const Block& blk = blocks_[block];
  if (blk.ref != 0 || blk.pins != 0) return;
  for (;;) {
    auto it = std::find_if(pending_.begin(), pending_.end(),
                           [block](const PendingCopy& c) { return c.dst == block; });
    if (it == pending_.end()) break;
    const int32_t src = it->src;
    pending_.erase(it);
    Unpin(src);  // may erase other entries: search again from the start
  }
  if (blk.cached) {
    LruPushBack(block);
  } else {
    free_list_.push_back(block);
  }
}

// ---- LRU list of evictable blocks (intrusive, oldest at the head) -------------------------------

void BlockManager::LruPushBack(int32_t block) {
  Block& blk = blocks_[block];
  blk.last_use = ++tick_;
  blk.lru_prev = lru_tail_;
  blk.lru_next = -1;
  if (lru_tail_ >= 0) {
    blocks_[lru_tail_].lru_next = block;
  } else {
    lru_head_ = block;
  }
  lru_tail_ = block;
  ++lru_size_;
}

void BlockManager::LruRemove(int32_t block) {
  Block& blk = blocks_[block];
  if (blk.lru_prev >= 0) {
    blocks_[blk.lru_prev].lru_next = blk.lru_next;
  } else {
    lru_head_ = blk.lru_next;
  }
  if (blk.lru_next >= 0) {
    blocks_[blk.lru_next].lru_prev = blk.lru_prev;
  } else {
    lru_tail_ = blk.lru_prev;
  }
  blk.lru_prev = blk.lru_next = -1;
  --lru_size_;
}

int32_t BlockManager::LruPopFront() {
  const int32_t b = lru_head_;
  if (b >= 0) LruRemove(b);
  return b;
}

void BlockManager::Uncache(int32_t block) {
  Block& blk = blocks_[block];
  auto it = cache_.find(blk.hash);
  PYSPEC_ICHECK(it != cache_.end() && it->second == block, "cached block ", block,
                " is missing from the hash map");
  cache_.erase(it);
  blk.cached = false;
  blk.hash = blk.prev_hash = blk.serial = blk.parent_serial = 0;
}

// ---- request lifecycle --------------------------------------------------------------------------

int64_t BlockManager::AddRequest(int64_t id, const int32_t* prompt, int64_t n) {
  PYSPEC_CHECK(requests_.count(id) == 0, "request_id ", id, " is already registered");
  PYSPEC_CHECK(n >= 1, "prompt must have at least 1 token; got ", n);
  PYSPEC_CHECK(prompt != nullptr, "prompt is null");
  Request r;
  r.tokens.assign(prompt, prompt + n);

  // Longest cached run of full blocks, leaving at least one token to compute. A hit needs equal
  // hash, equal tokens and the same predecessor registration: collisions only cause misses.
  std::vector<int32_t> hits;
  int64_t evictable_hits = 0;
  if (enable_prefix_cache_) {
    const int64_t max_hit_blocks = (n - 1) / block_size_;
    uint64_t prev_serial = 0;
    for (int64_t i = 0; i < max_hit_blocks; ++i) {
      auto it = cache_.find(RequestHash(r, i));
      if (it == cache_.end()) break;
      const Block& blk = blocks_[it->second];
      if (blk.parent_serial != prev_serial ||
          !BlockTokensEqual(it->second, r.tokens.data() + i * block_size_)) {
        break;
      }
      hits.push_back(it->second);
      r.serials.push_back(blk.serial);
      prev_serial = blk.serial;
      if (blk.ref == 0 && blk.pins == 0) ++evictable_hits;
    }
  }
  const int64_t need = NumBlocksFor(n) - static_cast<int64_t>(hits.size());
  // Hit blocks that are evictable now count as free but are about to be taken.
  if (need > num_free_blocks() - evictable_hits) return kNoSpace;

  for (int32_t b : hits) {
    Block& blk = blocks_[b];
    if (blk.ref == 0 && blk.pins == 0) LruRemove(b);
    ++blk.ref;
  }
  r.table = std::move(hits);
  r.num_computed = static_cast<int64_t>(r.table.size()) * block_size_;
  for (int64_t k = 0; k < need; ++k) r.table.push_back(Allocate());
  if (enable_prefix_cache_) {
    prefix_queries_ += n;
    prefix_hits_ += r.num_computed;
  }
  const int64_t computed = r.num_computed;
  requests_.emplace(id, std::move(r));
  return computed;
}

bool BlockManager::Reserve(int64_t id, int64_t num_extra_tokens) {
  Request& r = Get(id, "reserve");
  CheckExtraTokens(static_cast<int64_t>(r.tokens.size()), num_extra_tokens);
  const int64_t target = static_cast<int64_t>(r.tokens.size()) + num_extra_tokens;
  if (BlocksNeeded(r, target) > num_free_blocks()) return false;
  EnsureCapacity(r, target);
  return true;
}

int64_t BlockManager::BlocksNeededToReserve(int64_t id, int64_t num_extra_tokens) const {
  const Request& r = Get(id, "can_reserve");
  CheckExtraTokens(static_cast<int64_t>(r.tokens.size()), num_extra_tokens);
  return BlocksNeeded(r, static_cast<int64_t>(r.tokens.size()) + num_extra_tokens);
}

bool BlockManager::CanReserve(int64_t id, int64_t num_extra_tokens) const {
  return BlocksNeededToReserve(id, num_extra_tokens) <= num_free_blocks();
}

bool BlockManager::Commit(int64_t id, const int32_t* tokens, int64_t n, int64_t num_computed) {
  Request& r = Get(id, "commit");
  PYSPEC_CHECK(n >= 0, "number of committed tokens must be >= 0; got ", n);
  PYSPEC_CHECK(n == 0 || tokens != nullptr, "tokens is null");
  PYSPEC_CHECK(num_computed >= 0, "num_computed must be >= 0; got ", num_computed);
  const int64_t num_tokens = static_cast<int64_t>(r.tokens.size());
  PYSPEC_CHECK(n <= kMaxTokens - num_tokens, "committing ", n, " tokens would exceed ", kMaxTokens,
               " tokens for request_id ", id);
  PYSPEC_CHECK(num_computed <= num_tokens + n - r.num_computed, "num_computed ", num_computed,
               " would mark more tokens computed than known (computed ", r.num_computed,
               ", tokens after commit ", num_tokens + n, ") for request_id ", id);
  // Positions about to be marked computed were written through SlotsFor, so they must already lie
  // in reserved, private blocks; checking before the copy-on-write below keeps a missing Reserve()
  // visible instead of caching blocks whose KV was never written.
  const int64_t capacity = static_cast<int64_t>(r.table.size()) * block_size_;
  PYSPEC_CHECK(num_computed <= capacity - r.num_computed, "num_computed ", num_computed,
               " reaches past the reserved capacity ", capacity, " of request_id ", id,
               " (computed ", r.num_computed, "); call reserve() before writing KV");
  for (int64_t p = r.num_computed; p < r.num_computed + num_computed;
       p += block_size_ - p % block_size_) {
    PYSPEC_CHECK(blocks_[r.table[p / block_size_]].ref == 1, "position ", p, " of request_id ", id,
                 " lies in a shared block: call reserve() before writing KV (commit)");
  }
  const int64_t target = num_tokens + n;
  if (BlocksNeeded(r, target) > num_free_blocks()) return false;
  EnsureCapacity(r, target);
  r.tokens.insert(r.tokens.end(), tokens, tokens + n);
  r.num_computed += num_computed;
  RegisterComputed(r);
  return true;
}

void BlockManager::MarkComputed(int64_t id, int64_t n) {
  Request& r = Get(id, "mark_computed");
  PYSPEC_CHECK(n >= 0, "n must be >= 0; got ", n);
  const int64_t num_tokens = static_cast<int64_t>(r.tokens.size());
  PYSPEC_CHECK(n <= num_tokens - r.num_computed, "n = ", n,
               " would mark more tokens computed than known (computed ", r.num_computed,
               ", tokens ", num_tokens, ") for request_id ", id);
  for (int64_t p = r.num_computed; p < r.num_computed + n; p += block_size_ - p % block_size_) {
    PYSPEC_CHECK(blocks_[r.table[p / block_size_]].ref == 1, "position ", p, " of request_id ", id,
                 " lies in a shared block: call reserve() before writing KV (mark_computed)");
  }
  r.num_computed += n;
  RegisterComputed(r);
}

// Registers the request's full, computed blocks not yet registered. Policy on a duplicate (an equal
// block already cached): keep the existing entry, leave this block uncached, and chain later blocks
// to the existing registration, so that lookups keep walking the cached chain.
void BlockManager::RegisterComputed(Request& r) {
  if (!enable_prefix_cache_) return;
  const int64_t full = r.num_computed / block_size_;
  while (static_cast<int64_t>(r.serials.size()) < full) {
    const int64_t i = static_cast<int64_t>(r.serials.size());
    const uint64_t parent = i == 0 ? 0 : r.serials[i - 1];
    if (i > 0 && parent == 0) {  // the chain broke at a collision: nothing after it is cacheable
      r.serials.push_back(0);
      continue;
    }
    const uint64_t h = RequestHash(r, i);
    const int32_t b = r.table[i];
    const int32_t* toks = r.tokens.data() + i * block_size_;
    Block& blk = blocks_[b];
    if (blk.cached) {
      PYSPEC_ICHECK(blk.hash == h, "cached block ", b, " has a different hash");
      r.serials.push_back(blk.serial);
      continue;
    }
    auto it = cache_.find(h);
    if (it != cache_.end()) {
      const Block& other = blocks_[it->second];
      const bool same = other.parent_serial == parent && BlockTokensEqual(it->second, toks);
      r.serials.push_back(same ? other.serial : 0);
      continue;
    }
    blk.cached = true;
    blk.hash = h;
    blk.prev_hash = i == 0 ? kRootHash : r.hashes[i - 1];
    blk.serial = next_serial_++;
    blk.parent_serial = parent;
    std::memcpy(block_tokens_.data() + static_cast<size_t>(b) * block_size_, toks,
                sizeof(int32_t) * block_size_);
    cache_.emplace(h, b);
    r.serials.push_back(blk.serial);
  }
}

void BlockManager::SlotsFor(int64_t id, int64_t start, int64_t n, int64_t* out) const {
  const Request& r = Get(id, "slots_for");
  PYSPEC_CHECK(start >= 0, "start must be >= 0; got ", start);
  PYSPEC_CHECK(n >= 0, "n must be >= 0; got ", n);
  const int64_t capacity = static_cast<int64_t>(r.table.size()) * block_size_;
  PYSPEC_CHECK(n <= capacity - start, "positions [", start, ", ", start, " + ", n,
               ") exceed the reserved capacity ", capacity, " of request_id ", id,
               "; call reserve() first");
  PYSPEC_CHECK(n == 0 || out != nullptr, "out is null");
  const int64_t bs = block_size_;
  for (int64_t k = 0; k < n; ++k) {
    const int64_t p = start + k;
    const int32_t b = r.table[p / bs];
    // Positions not yet computed are about to be written: they must not be in a shared block.
    PYSPEC_CHECK(p < r.num_computed || blocks_[b].ref == 1, "position ", p, " of request_id ", id,
                 " lies in a shared block: call reserve() before writing KV (slots_for)");
    out[k] = static_cast<int64_t>(b) * bs + p % bs;
  }
}

std::vector<int64_t> BlockManager::SlotsFor(int64_t id, int64_t start, int64_t n) const {
  PYSPEC_CHECK(start >= 0, "start must be >= 0; got ", start);
  PYSPEC_CHECK(n >= 0, "n must be >= 0; got ", n);
  // The capacity check before the allocation (a huge n is a ValueError, not a huge vector).
  const int64_t capacity = static_cast<int64_t>(Get(id, "slots_for").table.size()) * block_size_;
  PYSPEC_CHECK(n <= capacity - start, "positions [", start, ", ", start, " + ", n,
               ") exceed the reserved capacity ", capacity, " of request_id ", id,
               "; call reserve() first");
  std::vector<int64_t> out(static_cast<size_t>(n));
  SlotsFor(id, start, n, out.data());
  return out;
}

void BlockManager::Fork(int64_t parent_id, int64_t child_id) {
  const Request& parent = Get(parent_id, "fork parent_id");
  PYSPEC_CHECK(requests_.count(child_id) == 0, "child_id ", child_id, " is already registered");
  Request child = parent;
  for (int32_t b : child.table) ++blocks_[b].ref;  // in use already: never on the LRU list
  requests_.emplace(child_id, std::move(child));
}

void BlockManager::Free(int64_t id) {
  auto it = requests_.find(id);
  PYSPEC_CHECK(it != requests_.end(), "request_id ", id, " is not registered (free)");
  const std::vector<int32_t> table = std::move(it->second.table);
  requests_.erase(it);
  for (auto b = table.rbegin(); b != table.rend(); ++b) Unref(*b);
}

std::vector<std::pair<int32_t, int32_t>> BlockManager::PeekPendingCopies() const {
  std::vector<std::pair<int32_t, int32_t>> out;
  out.reserve(pending_.size());
  for (const PendingCopy& c : pending_) out.emplace_back(c.src, c.dst);
  return out;
}

std::vector<std::pair<int32_t, int32_t>> BlockManager::TakePendingCopies() {
  std::vector<std::pair<int32_t, int32_t>> out = PeekPendingCopies();
  std::vector<PendingCopy> pending;
  pending.swap(pending_);
  for (const PendingCopy& c : pending) Unpin(c.src);
  return out;
}

int64_t BlockManager::ResetPrefixCache() {
  int64_t dropped = 0;
  for (int32_t b = LruPopFront(); b >= 0; b = LruPopFront()) {
    Uncache(b);
    free_list_.push_back(b);
    ++dropped;
  }
  return dropped;
}

// ---- queries ------------------------------------------------------------------------------------

const std::vector<int32_t>& BlockManager::BlockTable(int64_t id) const {
  return Get(id, "block_table").table;
}
const std::vector<int32_t>& BlockManager::Tokens(int64_t id) const {
  return Get(id, "tokens").tokens;
}
int64_t BlockManager::NumTokens(int64_t id) const {
  return static_cast<int64_t>(Get(id, "num_tokens").tokens.size());
}
int64_t BlockManager::NumComputed(int64_t id) const { return Get(id, "num_computed").num_computed; }
int64_t BlockManager::Capacity(int64_t id) const {
  return static_cast<int64_t>(Get(id, "capacity").table.size()) * block_size_;
}

int32_t BlockManager::RefCount(int32_t block) const {
  PYSPEC_CHECK(block >= 0 && block < num_total_blocks(), "block ", block, " is out of range [0, ",
               num_total_blocks(), ")");
  return blocks_[block].ref + blocks_[block].pins;
}

bool BlockManager::IsCached(int32_t block) const {
  PYSPEC_CHECK(block >= 0 && block < num_total_blocks(), "block ", block, " is out of range [0, ",
               num_total_blocks(), ")");
  return blocks_[block].cached;
}

// ---- invariants ---------------------------------------------------------------------------------

#define PYSPEC_BM_EXPECT(cond, ...)                                                              \
  do {                                                                                           \
    if (!(cond)) {                                                                               \
      throw RuntimeError(detail::StrCat("BlockManager invariant violated: ", __VA_ARGS__,        \
                                        " [", #cond, "]"));                                      \
    }                                                                                            \
  } while (0)

void BlockManager::CheckInvariants() const {
  const int64_t nb = num_total_blocks();
  const int bs = block_size_;
  enum : uint8_t { kNowhere = 0, kFree = 1, kLru = 2 };
  std::vector<uint8_t> where(nb, kNowhere);
  std::vector<int32_t> refs(nb, 0), pins(nb, 0);

  // Free list: uncached, unreferenced, listed once.
  for (int32_t b : free_list_) {
    PYSPEC_BM_EXPECT(b >= 0 && b < nb, "free list holds bad block id ", b);
    PYSPEC_BM_EXPECT(where[b] == kNowhere, "block ", b, " is listed twice in the free lists");
    where[b] = kFree;
    PYSPEC_BM_EXPECT(!blocks_[b].cached, "free block ", b, " is cached");
  }
  // LRU list: cached, unreferenced, linked both ways, oldest first.
  int64_t lru_count = 0;
  int32_t prev = -1;
  uint64_t last = 0;
  for (int32_t b = lru_head_; b >= 0; b = blocks_[b].lru_next) {
    PYSPEC_BM_EXPECT(b < nb, "LRU list holds bad block id ", b);
    PYSPEC_BM_EXPECT(where[b] == kNowhere, "block ", b, " is on the LRU list twice or also free");
    where[b] = kLru;
    PYSPEC_BM_EXPECT(blocks_[b].lru_prev == prev, "LRU back link of block ", b, " is broken");
    PYSPEC_BM_EXPECT(blocks_[b].cached, "evictable block ", b, " is not cached");
    PYSPEC_BM_EXPECT(blocks_[b].last_use >= last, "LRU list is not ordered by last use at ", b);
    last = blocks_[b].last_use;
    prev = b;
    ++lru_count;
  }
  PYSPEC_BM_EXPECT(prev == lru_tail_, "LRU tail is ", lru_tail_, ", the walk ends at ", prev);
  PYSPEC_BM_EXPECT(lru_count == lru_size_, "LRU size ", lru_size_, " but ", lru_count, " linked");

  // Cached blocks: map entries agree, hashes recompute, serials are unique.
  std::unordered_map<uint64_t, int32_t> by_serial;
  int64_t num_cached = 0;
  for (int32_t b = 0; b < nb; ++b) {
    const Block& blk = blocks_[b];
    if (!blk.cached) continue;
    ++num_cached;
    auto it = cache_.find(blk.hash);
    PYSPEC_BM_EXPECT(it != cache_.end() && it->second == b, "cached block ", b,
                     " is not the hash map's entry for its hash");
    const int32_t* toks = block_tokens_.data() + static_cast<size_t>(b) * bs;
    PYSPEC_BM_EXPECT(hash_fn_(blk.prev_hash, toks, bs) == blk.hash, "cached block ", b,
                     " has a stored hash that does not match H(prev_hash, tokens)");
    PYSPEC_BM_EXPECT(blk.serial != 0 && by_serial.emplace(blk.serial, b).second, "cached block ", b,
                     " has a zero or duplicate serial ", blk.serial);
    if (blk.parent_serial == 0) {
      PYSPEC_BM_EXPECT(blk.prev_hash == kRootHash, "first block ", b,
                       " is not chained to the root");
    }
  }
  PYSPEC_BM_EXPECT(num_cached == static_cast<int64_t>(cache_.size()), "hash map has ",
                   cache_.size(), " entries for ", num_cached, " cached blocks");
  for (const auto& kv : cache_) {
    PYSPEC_BM_EXPECT(kv.second >= 0 && kv.second < nb && blocks_[kv.second].cached,
                     "hash map entry points to non-cached block ", kv.second);
  }
  for (int32_t b = 0; b < nb; ++b) {
    const Block& blk = blocks_[b];
    if (!blk.cached || blk.parent_serial == 0) continue;
    auto p = by_serial.find(blk.parent_serial);
    if (p != by_serial.end()) {
      PYSPEC_BM_EXPECT(blocks_[p->second].hash == blk.prev_hash, "cached block ", b,
                       " has prev_hash that differs from its live predecessor ", p->second);
    }
  }

  // Requests: tables, token counts and the chained hashes recomputed from scratch.
  for (const auto& kv : requests_) {
    const int64_t id = kv.first;
    const Request& r = kv.second;
    const int64_t nt = static_cast<int64_t>(r.tokens.size());
    PYSPEC_BM_EXPECT(r.num_computed >= 0 && r.num_computed <= nt, "request ", id, " has computed ",
                     r.num_computed, " of ", nt, " tokens");
    PYSPEC_BM_EXPECT(static_cast<int64_t>(r.table.size()) * bs >= nt, "request ", id,
                     " has capacity below its token count");
    PYSPEC_BM_EXPECT(static_cast<int64_t>(r.hashes.size()) <= nt / bs, "request ", id,
                     " has hashes of blocks that are not full");
    const int64_t full_computed = r.num_computed / bs;
    PYSPEC_BM_EXPECT(static_cast<int64_t>(r.serials.size()) ==
                         (enable_prefix_cache_ ? full_computed : 0),
                     "request ", id, " registered ", r.serials.size(), " blocks, expected ",
                     full_computed);
    uint64_t h = kRootHash;
    for (int64_t i = 0; i < static_cast<int64_t>(r.table.size()); ++i) {
      const int32_t b = r.table[i];
      PYSPEC_BM_EXPECT(b >= 0 && b < nb, "request ", id, " holds bad block id ", b);
      ++refs[b];
      if ((i + 1) * bs > nt) {
        PYSPEC_BM_EXPECT(!blocks_[b].cached, "request ", id, " block ", i,
                         " is cached but not full");
        continue;
      }
      const int32_t* toks = r.tokens.data() + i * bs;
      h = hash_fn_(h, toks, bs);
      if (i < static_cast<int64_t>(r.hashes.size())) {
        PYSPEC_BM_EXPECT(r.hashes[i] == h, "request ", id, " memoized hash of block ", i,
                         " is stale");
      }
      if (blocks_[b].cached) {
        PYSPEC_BM_EXPECT(i < full_computed, "request ", id, " block ", i,
                         " is cached but not computed");
        PYSPEC_BM_EXPECT(blocks_[b].hash == h && BlockTokensEqual(b, toks), "request ", id,
                         " block ", i, " (", b, ") is cached with other content");
      }
      if (i < static_cast<int64_t>(r.serials.size()) && r.serials[i] != 0) {
        PYSPEC_BM_EXPECT(i == 0 || r.serials[i - 1] != 0, "request ", id, " chain resumes at ", i);
        auto s = by_serial.find(r.serials[i]);
        if (s != by_serial.end()) {
          PYSPEC_BM_EXPECT(blocks_[s->second].hash == h && BlockTokensEqual(s->second, toks),
                           "request ", id, " block ", i,
                           " is chained to a cached block with other content");
        }
      }
    }
  }
  for (size_t i = 0; i < pending_.size(); ++i) {
    const PendingCopy& c = pending_[i];
    PYSPEC_BM_EXPECT(c.src >= 0 && c.src < nb && c.dst >= 0 && c.dst < nb && c.src != c.dst,
                     "bad pending copy ", c.src, " -> ", c.dst);
    ++pins[c.src];
    // The destination is needed: a block table holds it, or a later pending copy reads it (a
    // fork of the request that got it reserved before the copies ran, then the request let it go:
    // src -> dst -> dst2 must still run in order to fill dst2).
    bool read_later = false;
    for (size_t j = i + 1; j < pending_.size() && !read_later; ++j) {
      read_later = pending_[j].src == c.dst;
    }
    PYSPEC_BM_EXPECT(refs[c.dst] > 0 || read_later, "pending copy into block ", c.dst,
                     " that no block table holds and no later copy reads");
  }

  // Every block is exactly one of: used (referenced or pinned), free, evictable.
  int64_t used = 0;
  for (int32_t b = 0; b < nb; ++b) {
    const Block& blk = blocks_[b];
    PYSPEC_BM_EXPECT(blk.ref == refs[b], "block ", b, " has refcount ", blk.ref, " but ", refs[b],
                     " block-table references");
    PYSPEC_BM_EXPECT(blk.pins == pins[b], "block ", b, " has ", blk.pins, " pins but ", pins[b],
                     " pending copies read it");
    const bool in_use = blk.ref + blk.pins > 0;
    PYSPEC_BM_EXPECT(in_use == (where[b] == kNowhere), "block ", b, " is ",
                     in_use ? "in use and listed free" : "unused and leaked (on no list)");
    used += in_use;
  }
  PYSPEC_BM_EXPECT(used == num_used_blocks() && used + num_free_blocks() == nb, "used ", used,
                   " + free ", num_free_blocks(), " != total ", nb);
}

#undef PYSPEC_BM_EXPECT

}  // namespace pyspec
