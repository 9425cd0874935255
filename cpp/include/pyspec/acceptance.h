// Acceptance sampling on the CPU (DESIGN section 2): sampling filters and the batched tree walk that
// decides which draft tokens a request keeps.
//
// Terms: *accepted* = draft tokens kept; *recovered* = the token sampled at the first rejection (from
// the residual); *bonus* = the token sampled after a fully accepted path (from the leaf's target
// row). Every request emits num_accepted + 1 tokens.
//
// Every stochastic mode is exactly lossless: the emitted tokens are distributed as if each had been
// sampled from the target alone.
#pragma once

#include <cstdint>
#include <string>

#include "pyspec/tensor_view.h"

namespace pyspec {

class LinearKernels;
class ThreadPool;

// ---- sampling filters ---------------------------------------------------------------------------

// probs[r] = the filtered target distribution of row r of `logits`, in this order:
//   1. temperature: z = logits / T. T == 0 means greedy: a one-hot row at the argmax (the lowest
//      index among equal maxima), and the other filters are ignored for that row.
//   2. top-k (k > 0 and k < V): keep exactly k tokens, the largest z; among equal values at the
//      boundary the lower token ids are kept.
//   3. top-p (p < 1): on the distribution renormalised over the top-k survivors, keep the smallest
//      set of most likely tokens whose mass is >= p (order: probability desc, then token id asc), so
//      the token that crosses p is kept.
//   4. min-p (m > 0): keep tokens with prob >= m * max prob (scale-free, so renormalising earlier
//      does not change it).
//   5. renormalise the survivors.
// No filter fully sorts the vocabulary: top-k uses nth_element, top-p a mass-weighted quickselect.
// Shapes / dtypes:
//   logits      [N, V] float32, float16 or bfloat16, contiguous; -inf entries are allowed (masked)
//   temperature [N] float32, finite, >= 0
//   top_k       [N] int32, >= 0 (0 = off; k >= V is off)
//   top_p       [N] float32, in (0, 1] (1 = off)
//   min_p       [N] float32, in [0, 1] (0 = off)
//   probs       [N, V] float32, contiguous, written (output)
// Throws ValueError naming the argument on a bad shape/dtype/device, a NaN or +inf logit, a row with
// no finite logit, or a parameter out of range. `pool` = nullptr uses ThreadPool::Default().
// `kernels`: the CPU builds the row passes run (a model's, see pyspec/linear.h: its vector level,
// AVX-512 at most; every build gives the same bits); nullptr: this CPU's best.
void ApplySamplingFilters(const TensorView& logits, const TensorView& temperature,
                          const TensorView& top_k, const TensorView& top_p, const TensorView& min_p,
                          const TensorView& probs, ThreadPool* pool = nullptr,
                          const LinearKernels* kernels = nullptr);

// ---- tree acceptance ----------------------------------------------------------------------------

struct AcceptOptions {
  // Tolerance of |sum(row) - 1| for the probability rows that are read.
  double row_sum_tolerance = 1e-3;
  // Every request greedy, and `target` holds the target's logits (float32) instead of its
  // probabilities: each node's token is its row's first maximal logit, what temperature 0 gives,
  // without building the one-hot rows (at 16 nodes x 49k tokens those cost about as much as the
  // rest of a step's bookkeeping). A row holding a NaN or +inf, or only -inf, is a ValueError as
  // in ApplySamplingFilters. CPU only.
  bool target_is_logits = false;
  // FOR TESTS ONLY: on a rejection keep sampling from the unmodified target row instead of the
  // residual (sampled children), and test deterministic children one by one against the
  // unmodified target (accept x with probability p(x), then sample p). This makes the sampler wrong
  // (not lossless); the statistical tests use it to show that they can detect a broken sampler.
  bool debug_skip_residual = false;
};

// Walks each request's draft tree from the root and decides the accepted path.
//
// Per request b (trees flattened: node j of tree b is row tree_indptr[b] + j):
//   greedy[b] != 0: at node i take t = argmax target[i] (lowest id on ties); if a child has
//     token t move to it (the first such child), else emit t and stop; at a leaf emit t (bonus).
//   sampled_children[b] != 0 (the children of node i were drawn WITHOUT replacement from q =
//     draft_probs[i], in index order): recursive rejection sampling (Jeon et al. 2024, "Recursive
//     Speculative Decoding"); with one child per node this is exactly Leviathan et al. 2023 / Chen et
//     al. 2023. For child x_j: accept with prob min(1, p(x_j) / q(x_j)); on rejection
//     p <- normalize(max(p - q, 0)) and q <- q without x_j, renormalised. If every child is rejected
//     the recovered token is sampled from the current p; at a leaf the bonus from target_probs[leaf].
//   otherwise (deterministic children, e.g. top-k of the drafter, or no children): the target-only
//     walk. Sample t from target_probs[i] with the draw plain decoding uses at that position; if a
//     child has token t move to it (the first such child), else emit t and stop. Every emitted token
//     is a sample of the target given the tokens before it, drawn with the same number that plain
//     decoding would use, so for a seed the output equals plain sampling's (up to float rounding
//     at a CDF boundary). It accepts child x with probability p(x) as the recursive rule does.
// Degenerate cases:
//   - a sampled child with q(x_j) == 0 (after removing earlier siblings, so also a repeated sibling
//     token) cannot have been drawn from q: ValueError naming draft_probs / tokens.
//   - a residual with no mass (p <= q everywhere up to rounding, total < 1e-9) falls back to the
//     current p (the rejection had probability ~0, so this does not bias the output measurably).
// Randomness: draws are keyed by sequence position, not by step: the node at depth k of tree b
// decides the token at position offsets[b] + k, and its draws are PhiloxUniform(seeds[b],
// offsets[b] + k, stream, d) (philox.h): stream kDrawSample, d = 0 for the token sampled there
// (target-only walk, recovered or bonus token) and stream kDrawChildTest, d = j for the test of
// sampled child j. So a request's result depends only on its own inputs and on positions, never on
// the rest of the batch, the thread count or how earlier tokens were split into steps.
// Validation: shapes, dtypes, devices, trees (ValidateTreeBatch), token ids of non-root nodes in
// [0, V). Probability rows are checked where they are read, i.e. along the walk (non-finite or
// negative entries, |sum - 1| > row_sum_tolerance); rows the walk never reaches are not read.
// Shapes / dtypes (all CPU, contiguous), the fields of AcceptTreesArgs:
//   target           [N, V] float32: row i = target distribution of the token after node i (or
//                    its logits, with options.target_is_logits)
//   draft_probs      [N, V] float32, or data == nullptr: row i = distribution node i's children
//                    were drawn from
//   tokens           [N] int32 (root token ignored)
//   parents          [N] int32, tree-local (-1 at each root)
//   tree_indptr      [B + 1] int64
//   greedy           [B] bool/uint8
//   sampled_children [B] bool/uint8 (must be 0 where draft_probs is absent, unless greedy)
//   seeds, offsets   [B] int64 (offsets[b]: the sequence position of the token the root decides)
//   accepted_nodes   [B, W] int32 out, W >= max tree depth + 1: accepted path from the root (0), -1 pad
//   emitted_tokens   [B, W] int32 out: accepted draft tokens then the recovered/bonus token, -1 pad
//   num_accepted     [B] int32 out: accepted draft tokens (emitted = num_accepted + 1)
struct AcceptTreesArgs {
  TensorView target;
  TensorView draft_probs;  // data == nullptr: none
  TensorView tokens, parents, tree_indptr;
  TensorView greedy, sampled_children, seeds, offsets;
  TensorView accepted_nodes, emitted_tokens, num_accepted;
  AcceptOptions options;

  const TensorView* draft() const { return draft_probs.data != nullptr ? &draft_probs : nullptr; }
};
void AcceptTrees(const AcceptTreesArgs& args, ThreadPool* pool = nullptr);

// The largest tree depth in a flattened tree batch (validates it first); the output width of
// AcceptTrees must be at least this + 1.
//   parents [N] int32, tree_indptr [B + 1] int64
int32_t TreeBatchMaxDepth(const TensorView& parents, const TensorView& tree_indptr);

namespace detail {
// Shared argument validation of the CPU and CUDA ops. Shapes, dtypes and devices are checked on the
// views (all on `device`); values are read from the host pointers given (the CUDA op passes host
// copies of the small metadata tensors) or, where a pointer is null, from the views themselves.
struct FilterParams {
  const float* temperature = nullptr;
  const int32_t* top_k = nullptr;
  const float* top_p = nullptr;
  const float* min_p = nullptr;
};
void CheckFilterArgs(const TensorView& logits, const TensorView& temperature,
                     const TensorView& top_k, const TensorView& top_p, const TensorView& min_p,
                     const TensorView& probs, DeviceType device, const FilterParams& params);

struct AcceptMeta {
  const int32_t* tokens = nullptr;
  const int32_t* parents = nullptr;
  const int64_t* indptr = nullptr;
  const uint8_t* greedy = nullptr;
  const uint8_t* sampled = nullptr;
};
struct AcceptShape {
  int64_t batch, total, vocab, width;
};
AcceptShape CheckAcceptArgs(const AcceptTreesArgs& args, DeviceType device, const AcceptMeta& meta);

// The build of ApplySamplingFilters' passes over a row that runs with `kernels` (nullptr: this
// CPU's best): "generic", "avx2" or "avx512".
std::string SamplingIsa(const LinearKernels* kernels = nullptr);
}  // namespace detail

}  // namespace pyspec
