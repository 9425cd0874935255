// The GPU work partition of tree attention, built on the host from a validated AttentionPlan.
//
// Plain C++ (no CUDA types): the CUDA op uses it to lay out one step's launch, and the ctest suite
// (tests/cpp/test_attention.cc) runs the partition through a scalar emulation of the kernel's
// per-item rules (masks, page lookup, split-KV merge) against the CPU oracle, so the host-side
// logic of the GPU path is tested on machines without a GPU.
//
// One CUDA block computes one work item for one KV head: a tile of query rows of one request,
// packed with the whole query group (GQA: the tile's rows x G query heads share every K/V tile the
// block loads), against one chunk of the request's prefix and, for the last chunk, the request's
// new tokens under the tree / causal mask. Prefixes that are long compared with the parallelism the
// device offers are split into chunks (FlashDecoding) whose partial results are merged with
// log-sum-exp by a second kernel.
#pragma once

#include <algorithm>
#include <cstdint>
#include <vector>

#if defined(__CUDACC__)
#define PYSPEC_PLAN_HD __host__ __device__
#else
#define PYSPEC_PLAN_HD
#endif

namespace pyspec {
namespace gpu_plan {

// Query vectors (rows x group heads) a block processes: the tensor-core tile height.
constexpr int64_t kTileVectors = 64;
// Keys per K/V tile loaded into shared memory; split chunks are multiples of it.
constexpr int64_t kTileKeys = 64;

// Field order is the device layout: 8 x int64 per item.
struct Item {
  int64_t request;
  int64_t q_begin, q_end;    // global query rows
  int64_t kv_begin, kv_end;  // prefix positions of this chunk
  int64_t with_new;          // 1 for the request's last chunk: also the new tokens
  int64_t partial_row;       // -1: write out/lse directly; else first row in the partial buffers
  int64_t pad = 0;
};
// Field order is the device layout: 4 x int64 per merge.
struct Merge {
  int64_t q_begin, q_end;  // the tile's rows
  int64_t partial_row;     // first partial row; chunk c's rows start at partial_row + c * rows
  int64_t num_chunks;
};

struct Partition {
  std::vector<Item> items;
  std::vector<Merge> merges;
  int64_t rows_per_tile = 1;
  int64_t num_partial_rows = 0;
  int64_t kv_chunk = 0;  // 0 = no prefix was split
};

PYSPEC_PLAN_HD inline int64_t CeilDiv(int64_t x, int64_t m) { return x / m + (x % m != 0); }

// q_indptr [B + 1] and prefix_lens [B] of a validated plan; `group` = Hq / Hkv; `num_sms` = the
// device's multiprocessors; `blocks_per_sm` = resident blocks the kernel reaches per SM.
// Split-KV rule: when tiles x KV heads would leave the device under-filled (fewer than
// 2 waves of blocks), every prefix is cut into chunks of one common size (a multiple of kTileKeys,
// at least `min_chunk`) chosen so the longest prefix yields enough blocks.
inline Partition Build(const std::vector<int64_t>& q_indptr,
                       const std::vector<int64_t>& prefix_lens, int64_t group, int64_t num_kv_heads, int64_t num_sms, int64_t blocks_per_sm,
                       int64_t min_chunk = 256) {
  Partition part;
  const int64_t B = static_cast<int64_t>(prefix_lens.size());
  group = std::max<int64_t>(group, 1);
  num_kv_heads = std::max<int64_t>(num_kv_heads, 1);
  part.rows_per_tile = std::max<int64_t>(1, kTileVectors / group);
  struct Tile {
    int64_t b, q_begin, q_end;
  };
  std::vector<Tile> tiles;
  int64_t max_prefix = 0;
  for (int64_t b = 0; b < B; ++b) {
    const int64_t q_len = q_indptr[b + 1] - q_indptr[b];
    if (q_len <= 0) continue;
    for (int64_t r = 0; r < q_len; r += part.rows_per_tile) {
      tiles.push_back({b, q_indptr[b] + r, q_indptr[b] + std::min(q_len, r + part.rows_per_tile)});
    }
    max_prefix = std::max(max_prefix, prefix_lens[b]);
  }
  const int64_t want_blocks =
      2 * std::max<int64_t>(num_sms, 1) * std::max<int64_t>(blocks_per_sm, 1);
  const int64_t base_blocks = static_cast<int64_t>(tiles.size()) * num_kv_heads;
  min_chunk = std::max<int64_t>(kTileKeys, CeilDiv(min_chunk, kTileKeys) * kTileKeys);
  int64_t chunk = 0;
  if (base_blocks > 0 && base_blocks < want_blocks && max_prefix > min_chunk) {
    const int64_t splits = CeilDiv(want_blocks, base_blocks);
    chunk = std::max(min_chunk, CeilDiv(CeilDiv(max_prefix, splits), kTileKeys) * kTileKeys);
  }
  part.kv_chunk = chunk;
  for (const Tile& t : tiles) {
    const int64_t p = prefix_lens[t.b];
    const int64_t n = chunk > 0 && p > chunk ? CeilDiv(p, chunk) : 1;
    const int64_t rows = t.q_end - t.q_begin;
    if (n > 1) part.merges.push_back({t.q_begin, t.q_end, part.num_partial_rows, n});
    for (int64_t c = 0; c < n; ++c) {
      Item it;
      it.request = t.b;
      it.q_begin = t.q_begin;
      it.q_end = t.q_end;
      it.kv_begin = n > 1 ? c * chunk : 0;
      it.kv_end = n > 1 ? std::min(p, (c + 1) * chunk) : p;
      it.with_new = c + 1 == n;
      it.partial_row = n > 1 ? part.num_partial_rows + c * rows : -1;
      part.items.push_back(it);
    }
    if (n > 1) part.num_partial_rows += n * rows;
  }
  // Long items first, so the tail of the grid is short work (blocks are issued in index order).
  std::stable_sort(part.items.begin(), part.items.end(), [](const Item& a, const Item& b) {
    return (a.kv_end - a.kv_begin) + (a.with_new ? a.q_end - a.q_begin : 0) >
           (b.kv_end - b.kv_begin) + (b.with_new ? b.q_end - b.q_begin : 0);
  });
  return part;
}

// The visibility rule every kernel applies to the new tokens of a request: query i (request-local
// index) sees new token t iff t is an ancestor-or-self of i in its tree (bit t of i's packed mask
// row, `kMaskWords` x 64 bits) or, for a causal chunk, t <= i.
template <int kMaskWords>
PYSPEC_PLAN_HD inline bool SeesNewToken(bool is_tree, const uint64_t* mask_row, int64_t i,
                                        int64_t t) {
  if (!is_tree) return t <= i;
  return t < kMaskWords * 64 && ((mask_row[t >> 6] >> (t & 63)) & 1u) != 0;
}

}  // namespace gpu_plan
}  // namespace pyspec
