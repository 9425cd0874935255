// Tree attention over the paged KV cache, on the CPU (DESIGN section 2, "Tree attention").
//
// "Plan once per step, run once per layer." A step is a ragged batch of B requests. Request b has
// prefix_len[b] committed tokens whose K/V live in the paged pool (addressed through its block
// table) and q_len[b] = q_indptr[b+1] - q_indptr[b] NEW tokens: rows of the flattened query whose
// K/V live in the per-step scratch area (k_new/v_new, same row order as q). The new tokens are
// either
//   - a causal chunk (prefill chunk or one plain-decode token): new token j sees the whole prefix
//     and new tokens 0..j; or
//   - a token tree (node 0 = root, parents before children, at most TokenTree::kMaxNodes nodes):
//     node j sees the whole prefix and exactly its ancestors-or-self among the new tokens.
// Both are one code path; only the mask source differs.
//
// The kernel is flash-attention style (Dao et al. 2022): online softmax over KV tiles with fp32
// accumulators. For each KV head the whole query group (Hq / Hkv heads) of a tile of query rows is
// processed together, so every K/V row is read and converted once per KV head and query tile. Long
// contexts are split into KV chunks processed in parallel and merged with log-sum-exp
// (FlashDecoding, split-KV). The CPU implementation is the oracle of the CUDA kernel.
//
// On the CPU, a tree node's output is bit for bit what a one-token decode step of that node
// computes once its ancestors are committed to the pool: the node's prefix and ancestors are
// walked in the same position-aligned tiles, then its own key alone. A draft tree verified in one
// step then scores every node exactly as plain decoding of its path would. One condition: the two
// steps must split the prefix into the same KV chunks. Prefixes shorter than two `min_kv_chunk`s
// (1,024 keys by default) are never split; longer ones into chunks of min_kv_chunk * 2^k keys,
// which stay put as the prefix grows, except where it crosses 2^k * min_kv_chunk keys (1,024,
// 2,048, 4,096, ...) between the two steps, or where the batch beside a request changes how many
// pieces it is cut into; results then agree to rounding, not bit for bit.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "pyspec/tensor_view.h"

namespace pyspec {

class ThreadPool;
class LinearKernels;
class AttentionPlan;

// Knobs of PlanAttention. Zero means "decide".
struct AttentionPlanOptions {
  // Head counts of the layers the plan will run on. Known counts size query tiles for the group
  // and let RunAttention check the tensors; 0 = unknown (tiles sized for a group of 4).
  int64_t num_q_heads = 0;
  int64_t num_kv_heads = 0;
  // Threads the split-KV partition aims to keep busy; 0 = ThreadPool::Default().
  int num_threads = 0;
  // Smallest KV chunk (keys) a long context is split into; 0 = 512.
  int64_t min_kv_chunk = 0;
  // Query vectors (rows x group heads) per tile; 0 = 256. Larger tiles read K/V fewer times.
  int64_t target_tile_queries = 0;
};

// Validates the step's metadata and precomputes masks, page indices and the work partition.
// All index tensors live on the CPU, are 1-D/2-D contiguous, int32 or int64:
//   q_indptr      [B + 1]          rows of request b are q_indptr[b] .. q_indptr[b+1]
//   prefix_lens   [B]              committed tokens of each request (K/V in pages), >= 0
//   block_tables  [B, max_blocks]  page ids, -1 = unused; entries 0 .. ceil(prefix/bs)-1 are used
//   tree_parents  [total_nodes]    per request either no nodes (causal chunk) or exactly q_len[b]
//   tree_indptr   [B + 1]          nodes (tree-local parent indices, root's parent -1)
// block_size > 0 and num_blocks (pages in the pool) bound the table entries.
// Throws ValueError naming the offending argument.
AttentionPlan PlanAttention(const TensorView& q_indptr, const TensorView& prefix_lens,
                            const TensorView& block_tables, int64_t block_size,
                            const TensorView& tree_parents, const TensorView& tree_indptr,
                            int64_t num_blocks, const AttentionPlanOptions& options = {});

// Runs one layer with a plan. Shapes (T = q_indptr[B], all contiguous, CPU):
//   q        [T, Hq, D]                           float32 / bfloat16 / float16
//   k_pages  [num_blocks, block_size, Hkv, D]     float32 / bfloat16 / float16 (the "KV dtype")
//   v_pages  [num_blocks, block_size, Hkv, D]     KV dtype
//   k_new    [T, Hkv, D]                          KV dtype (the new tokens' K, same row order as q)
//   v_new    [T, Hkv, D]                          KV dtype
//   out      [T, Hq, D]                           dtype of q (written)
//   lse      [T, Hq] float32, or nullptr          natural-log sum of exp(scale * q.k) (written)
// Hq must be a multiple of Hkv; query head hq uses KV head hq / (Hq / Hkv). Accumulation is fp32.
// `pool` defaults to ThreadPool::Default(). `kernels`: the CPU builds to run (a model's own, see
// pyspec/linear.h: the widest vector build they allow, AVX-512 at most); nullptr: the best this CPU
// has. Throws ValueError on bad arguments.
void RunAttention(const AttentionPlan& plan, const TensorView& q, const TensorView& k_pages,
                  const TensorView& v_pages, const TensorView& k_new, const TensorView& v_new,
                  const TensorView& out, const TensorView* lse, float scale,
                  ThreadPool* pool = nullptr, const LinearKernels* kernels = nullptr);

// Built by PlanAttention; immutable afterwards, so one plan may serve concurrent RunAttention
// calls.
class AttentionPlan {
 public:
  // One unit of parallel work (run once per KV head): query rows [q_begin, q_end) of one request
  // against prefix keys [kv_begin, kv_end) and, when with_new, the new tokens under the mask.
  struct WorkItem {
    int32_t request;
    int32_t with_new;
    int64_t q_begin, q_end;    // global query rows
    int64_t kv_begin, kv_end;  // prefix positions
    int64_t partial_row;       // -1: writes `out` directly; else first row in the partial buffer
  };
  // A query tile whose prefix was split: its `num_chunks` partial results (consecutive items'
  // partial rows, each q_end - q_begin rows) are merged with log-sum-exp.
  struct Merge {
    int64_t q_begin, q_end;
    int64_t partial_row;
    int32_t num_chunks;
  };

  AttentionPlan() = default;

  int64_t batch_size() const { return static_cast<int64_t>(prefix_lens_.size()); }
  int64_t num_queries() const { return q_indptr_.empty() ? 0 : q_indptr_.back(); }
  int64_t block_size() const { return block_size_; }
  int64_t num_blocks() const { return num_blocks_; }
  int64_t num_q_heads() const { return num_q_heads_; }    // 0 = not fixed by the plan
  int64_t num_kv_heads() const { return num_kv_heads_; }  // 0 = not fixed by the plan
  bool is_tree(int64_t b) const { return is_tree_[b] != 0; }
  const std::vector<WorkItem>& work_items() const { return items_; }
  const std::vector<Merge>& merges() const { return merges_; }
  int64_t num_partial_rows() const { return num_partial_rows_; }
  std::string ToString() const;

  // The validated step metadata, for device back ends that lay out their own work partition
  // (pyspec::cuda): rows per request, committed lengths, the used page ids of every request
  // (pages()[page_indptr()[b] ..]), tree flags and the packed ancestor-or-self mask rows
  // ([num_queries, TokenTree::kMaskWords]; empty when no request is a tree).
  const std::vector<int64_t>& q_indptr() const { return q_indptr_; }
  const std::vector<int64_t>& prefix_lens() const { return prefix_lens_; }
  const std::vector<int64_t>& page_indptr() const { return page_indptr_; }
  const std::vector<int32_t>& pages() const { return pages_; }
  const std::vector<uint8_t>& tree_flags() const { return is_tree_; }
  const std::vector<uint64_t>& masks() const { return masks_; }

 private:
  friend AttentionPlan PlanAttention(const TensorView&, const TensorView&, const TensorView&,
                                     int64_t, const TensorView&, const TensorView&, int64_t,
                                     const AttentionPlanOptions&);
  friend void RunAttention(const AttentionPlan&, const TensorView&, const TensorView&,
                           const TensorView&, const TensorView&, const TensorView&,
                           const TensorView&, const TensorView*, float, ThreadPool*,
                           const LinearKernels*);

  int64_t block_size_ = 0;
  int64_t num_blocks_ = 0;
  int64_t num_q_heads_ = 0;
  int64_t num_kv_heads_ = 0;
  std::vector<int64_t> q_indptr_;     // [B + 1]
  std::vector<int64_t> prefix_lens_;  // [B]
  std::vector<int64_t> page_indptr_;  // [B + 1] into pages_
  std::vector<int32_t> pages_;        // used page ids of every request, in order
  std::vector<uint8_t> is_tree_;      // [B]
  std::vector<uint64_t> masks_;       // [T, kMaskWords]: ancestor-or-self rows of tree nodes
  std::vector<WorkItem> items_;       // sorted by decreasing cost
  std::vector<Merge> merges_;
  int64_t num_partial_rows_ = 0;
};

namespace detail {
// Shared argument validation of the CPU and CUDA RunAttention: every tensor on `device` (and one
// device), float dtypes, shapes against the plan, K/V dtypes equal, `out` in q's dtype, lse float32.
struct AttentionShape {
  int64_t T, Hq, Hkv, D;
};
AttentionShape CheckAttentionArgs(const AttentionPlan& plan, const TensorView& q,
                                  const TensorView& k_pages, const TensorView& v_pages,
                                  const TensorView& k_new, const TensorView& v_new,
                                  const TensorView& out, const TensorView* lse, float scale,
                                  DeviceType device);

// The CPU kernel build RunAttention runs with `kernels` (nullptr: this CPU's best): "generic",
// "avx2" or "avx512".
std::string AttentionIsa(const LinearKernels* kernels = nullptr);
}  // namespace detail

}  // namespace pyspec
