// CPU tree attention over paged KV (see pyspec/attention.h for the contract).
//
// Layout of one work item (a tile of query rows of one request, one KV head, one KV range):
//   qt [D, Mp]    the tile's M = rows * G query vectors, transposed and pre-scaled by
//                 scale * log2(e) so the softmax works in base 2 (one exp2 per score)
//   kt [Nt, D]    one KV tile of keys, converted to fp32
//   vt [Nt, Dp]   the matching values, rows zero-padded to Dp
//   st [Nt, Mp]   scores, transposed: st = kt * qt, so the softmax reductions run down columns
//                 and vectorize across queries
//   o  [Mp, Dp]   fp32 output accumulator, o = o * alpha + p * vt (online softmax)
// Both products are register-blocked small GEMMs with the same micro-kernel. The kernel is
// written with GCC/Clang vector extensions and compiled three times: once for the x86-64 baseline
// (SSE2), once with target("avx2,fma,f16c") and once for AVX-512; a cpuid check picks one at run
// time.
#include "pyspec/attention.h"
#include "pyspec/linear.h"

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstring>
#include <limits>
#include <vector>

#include "cpu_isa.h"
#include "half.h"
#ifdef PYSPEC_X86
#include <immintrin.h>
#endif
#include "pyspec/check.h"
#include "pyspec/thread_pool.h"
#include "pyspec/tree.h"

#define PYSPEC_INLINE inline __attribute__((always_inline))

namespace pyspec {

namespace {
constexpr int64_t kMaxAttentionBlockSize = int64_t{1} << 20;
constexpr int64_t kMaxAttentionContext = int64_t{1} << 31;  // tokens before a request's new ones
}  // namespace
namespace {

using detail::StrCat;

constexpr int64_t kTileKeys = 64;  // keys per KV tile
constexpr int64_t kPad = 16;       // row lengths of qt/st/o/vt are multiples of this
constexpr int64_t kMaskWords = TokenTree::kMaskWords;
constexpr float kLog2e = 1.4426950408889634f;
constexpr float kLn2 = 0.6931471805599453f;
constexpr float kNegInf = -std::numeric_limits<float>::infinity();

int64_t RoundUp(int64_t x, int64_t m) { return (x + m - 1) / m * m; }
// Overflow-safe for any non-negative x (prefix lengths come from user input).
int64_t CeilDiv(int64_t x, int64_t m) { return x / m + (x % m != 0); }

// ---------------------------------------------------------------------------------------------
// Planning
// ---------------------------------------------------------------------------------------------

void CheckIndexTensor(const TensorView& t, const char* name, int ndim) {
  PYSPEC_CHECK(t.device.type == DeviceType::kCPU, "'", name, "' is on ", DeviceName(t.device),
               "; attention metadata must be on the cpu");
  CheckDType(t, name, {DType::kInt32, DType::kInt64});
  PYSPEC_CHECK(t.ndim == ndim, "'", name, "' must be ", ndim, "-D; got shape ", t.ShapeString());
  CheckContiguous(t, name);
}

std::vector<int64_t> ReadIndices(const TensorView& t) {
  std::vector<int64_t> v(t.numel());
  for (int64_t i = 0; i < t.numel(); ++i) {
    v[i] = t.dtype == DType::kInt32 ? t.ptr<int32_t>()[i] : t.ptr<int64_t>()[i];
  }
  return v;
}

// Cost model of a work item: query vectors times keys.
int64_t ItemCost(const AttentionPlan::WorkItem& w, int64_t q_first) {
  int64_t keys = w.kv_end - w.kv_begin + (w.with_new ? w.q_end - q_first : 0);
  return (w.q_end - w.q_begin) * std::max<int64_t>(keys, 1);
}

}  // namespace

AttentionPlan PlanAttention(const TensorView& q_indptr, const TensorView& prefix_lens,
                            const TensorView& block_tables, int64_t block_size,
                            const TensorView& tree_parents, const TensorView& tree_indptr,
                            int64_t num_blocks, const AttentionPlanOptions& options) {
  CheckIndexTensor(q_indptr, "q_indptr", 1);
  PYSPEC_CHECK(q_indptr.shape[0] >= 1, "'q_indptr' needs batch + 1 >= 1 entries");
  const int64_t B = q_indptr.shape[0] - 1;
  CheckIndexTensor(prefix_lens, "prefix_lens", 1);
  CheckShape(prefix_lens, "prefix_lens", {B});
  CheckIndexTensor(block_tables, "block_tables", 2);
  CheckShape(block_tables, "block_tables", {B, -1});
  CheckIndexTensor(tree_parents, "tree_parents", 1);
  CheckIndexTensor(tree_indptr, "tree_indptr", 1);
  CheckShape(tree_indptr, "tree_indptr", {B + 1});
  // Bounds that keep the plan's cost sums (tokens x context x heads) far from int64 overflow.
  PYSPEC_CHECK(block_size > 0 && block_size <= kMaxAttentionBlockSize,
               "'block_size' must be in [1, ", kMaxAttentionBlockSize, "]; got ", block_size);
  PYSPEC_CHECK(num_blocks >= 0 && num_blocks <= INT32_MAX,
               "'num_blocks' must be in [0, 2^31); got ", num_blocks);
  const int64_t hq = options.num_q_heads, hkv = options.num_kv_heads;
  PYSPEC_CHECK((hq == 0 && hkv == 0) || (hq > 0 && hkv > 0 && hq % hkv == 0),
               "'num_q_heads' (", hq, ") must be a positive multiple of 'num_kv_heads' (", hkv,
               "), or both 0 (unknown)");

  AttentionPlan plan;
  plan.block_size_ = block_size;
  plan.num_blocks_ = num_blocks;
  plan.num_q_heads_ = hq;
  plan.num_kv_heads_ = hkv;
  plan.q_indptr_ = ReadIndices(q_indptr);
  plan.prefix_lens_ = ReadIndices(prefix_lens);
  const std::vector<int64_t> tptr = ReadIndices(tree_indptr);
  const std::vector<int64_t> parents = ReadIndices(tree_parents);
  const auto& qp = plan.q_indptr_;

  PYSPEC_CHECK(qp[0] == 0, "'q_indptr' must start at 0; got ", qp[0]);
  // Bounds the plan's per-query buffers before anything is sized from user input.
  constexpr int64_t kMaxQueries = int64_t{1} << 24;
  PYSPEC_CHECK(qp[B] >= 0 && qp[B] <= kMaxQueries, "'q_indptr' ends at ", qp[B],
               "; a step holds at most ", kMaxQueries, " query rows");
  PYSPEC_CHECK(tptr[0] == 0, "'tree_indptr' must start at 0; got ", tptr[0]);
  PYSPEC_CHECK(tptr[B] == tree_parents.shape[0], "'tree_indptr' must end at the number of tree ",
               "nodes (len(tree_parents) = ", tree_parents.shape[0], "); got ", tptr[B]);
  const int64_t max_blocks = block_tables.shape[1];
  const std::vector<int64_t> table = ReadIndices(block_tables);
  plan.page_indptr_.assign(B + 1, 0);
  plan.is_tree_.assign(B, 0);
  for (int64_t b = 0; b < B; ++b) {
    // Compared before subtracting: arbitrary entries (e.g. near INT64_MIN) would overflow the
    // difference. Once non-decreasing from qp[0] == 0, every difference is of non-negatives.
    PYSPEC_CHECK(qp[b + 1] >= qp[b], "'q_indptr' must be non-decreasing; request ", b,
                 " has q_indptr [", qp[b], ", ", qp[b + 1], "]");
    const int64_t q_len = qp[b + 1] - qp[b];
    const int64_t p = plan.prefix_lens_[b];
    PYSPEC_CHECK(p >= 0 && p <= kMaxAttentionContext, "'prefix_lens[", b, "]' = ", p,
                 " must be in [0, ", kMaxAttentionContext, "]");
    const int64_t used = CeilDiv(p, block_size);
    PYSPEC_CHECK(used <= max_blocks, "'block_tables' has ", max_blocks, " columns but request ",
                 b, " needs ", used, " blocks for prefix_lens[", b, "] = ", p);
    for (int64_t j = 0; j < max_blocks; ++j) {
      const int64_t e = table[b * max_blocks + j];
      PYSPEC_CHECK(e < num_blocks && (e >= 0 || (e == -1 && j >= used)), "'block_tables[", b, ", ",
                   j, "]' = ", e, (j < used ? " is needed and" : ""), " is outside the pool [0, ",
                   num_blocks, ")", (j < used ? "" : " and is not -1"));
      if (j < used) plan.pages_.push_back(static_cast<int32_t>(e));
    }
    plan.page_indptr_[b + 1] = static_cast<int64_t>(plan.pages_.size());
    PYSPEC_CHECK(tptr[b + 1] >= tptr[b], "'tree_indptr' must be non-decreasing; request ", b,
                 " has tree_indptr [", tptr[b], ", ", tptr[b + 1], "]");
    const int64_t n = tptr[b + 1] - tptr[b];
    PYSPEC_CHECK(n == 0 || n == q_len, "'tree_indptr': request ", b, " has ", n,
                 " tree nodes but q_len ", q_len, " (give 0 nodes for a causal chunk or one node "
                 "per new token)");
    plan.is_tree_[b] = n > 0;
  }
  const int64_t T = qp[B];
  const bool any_tree =
      std::find(plan.is_tree_.begin(), plan.is_tree_.end(), 1) != plan.is_tree_.end();
  plan.masks_.assign(any_tree ? T * kMaskWords : 0, 0);
  for (int64_t b = 0; b < B; ++b) {
    if (!plan.is_tree_[b]) continue;
    const int64_t n = tptr[b + 1] - tptr[b];
    PYSPEC_CHECK(n <= TokenTree::kMaxNodes, "'tree_parents': tree ", b, " has ", n,
                 " nodes; at most ", TokenTree::kMaxNodes);
    const int64_t* par = parents.data() + tptr[b];
    PYSPEC_CHECK(par[0] == -1, "'tree_parents': tree ", b, ": node 0 must be the root (parent -1)",
                 "; got ", par[0]);
    uint64_t* rows = plan.masks_.data() + qp[b] * kMaskWords;
    rows[0] = 1;
    for (int64_t i = 1; i < n; ++i) {
      PYSPEC_CHECK(par[i] >= 0 && par[i] < i, "'tree_parents': tree ", b, ": parent of node ", i,
                   " is ", par[i], "; must be in [0, ", i, ")");
      const uint64_t* parent_row = rows + par[i] * kMaskWords;
      std::copy(parent_row, parent_row + kMaskWords, rows + i * kMaskWords);
      rows[i * kMaskWords + (i >> 6)] |= uint64_t{1} << (i & 63);
    }
  }

  // Work partition: query tiles of about `target_tile_queries` query vectors; prefixes split into
  // chunks when a tile would cost more than its share of the work (FlashDecoding-style split-KV).
  const int64_t group = hkv > 0 ? hq / hkv : 4;
  const int64_t heads = hkv > 0 ? hkv : 1;
  const int64_t tile_queries = options.target_tile_queries > 0 ? options.target_tile_queries : 256;
  const int64_t rows_per_tile = std::max<int64_t>(1, tile_queries / group);
  PYSPEC_CHECK(options.num_threads >= 0 && options.num_threads <= 4096,
               "'num_threads' must be in [0, 4096] (0 = the pool's size); got ", options.num_threads);
  const int64_t threads = options.num_threads > 0 ? options.num_threads
                                                  : ThreadPool::Default().num_threads();
  const int64_t min_chunk = RoundUp(options.min_kv_chunk > 0 ? options.min_kv_chunk : 512,
                                    kTileKeys);
  struct Tile {
    int64_t b, q_begin, q_end, cost;
  };
  std::vector<Tile> tiles;
  int64_t total_cost = 0;
  for (int64_t b = 0; b < B; ++b) {
    const int64_t q_len = qp[b + 1] - qp[b];
    if (q_len == 0) continue;
    const int64_t num = CeilDiv(q_len, rows_per_tile), rows = CeilDiv(q_len, num);
    for (int64_t r = 0; r < q_len; r += rows) {
      Tile t{b, qp[b] + r, qp[b] + std::min(q_len, r + rows), 0};
      t.cost = (t.q_end - t.q_begin) * (plan.prefix_lens_[b] + (t.q_end - qp[b]));
      total_cost += t.cost;
      tiles.push_back(t);
    }
  }
  // Aim for ~4 items per thread so the dynamic schedule balances uneven requests.
  // (In double: costs times heads can pass int64 for large head counts; the split needs no
  // exactness.)
  const double target_cost =
      std::max(1.0, std::floor(static_cast<double>(total_cost) * static_cast<double>(heads) /
                               (4.0 * static_cast<double>(threads))));
  for (const Tile& t : tiles) {
    const int64_t p = plan.prefix_lens_[t.b];
    const double want = std::ceil(static_cast<double>(t.cost) * static_cast<double>(heads) /
                                  target_cost);
    int64_t splits = std::min(want < 1e18 ? static_cast<int64_t>(want) : int64_t{1} << 60,
                              std::max<int64_t>(1, p / min_chunk));
    splits = std::max<int64_t>(splits, 1);
    // Chunks are min_chunk * 2^k keys, the smallest such that `splits` of them pass p: their
    // boundaries then stay put while the prefix grows by a few tokens (a draft tree's nodes are
    // scored with the split their own one-token steps get, except across p = 2^k * min_chunk).
    int64_t chunk = std::max<int64_t>(p, 1);
    if (splits > 1) {
      chunk = min_chunk;
      while (chunk * splits <= p) chunk *= 2;
    }
    splits = std::max<int64_t>(1, CeilDiv(p, chunk));
    const int64_t rows = t.q_end - t.q_begin;
    if (splits > 1) {
      plan.merges_.push_back({t.q_begin, t.q_end, plan.num_partial_rows_,
                              static_cast<int32_t>(splits)});
    }
    for (int64_t c = 0; c < splits; ++c) {
      AttentionPlan::WorkItem w;
      w.request = static_cast<int32_t>(t.b);
      w.with_new = c + 1 == splits;
      w.q_begin = t.q_begin;
      w.q_end = t.q_end;
      w.kv_begin = std::min(p, c * chunk);
      w.kv_end = std::min(p, (c + 1) * chunk);
      w.partial_row = splits > 1 ? plan.num_partial_rows_ + c * rows : -1;
      plan.items_.push_back(w);
    }
    if (splits > 1) plan.num_partial_rows_ += splits * rows;
  }
  // Longest first: with dynamic scheduling this is the LPT heuristic.
  std::stable_sort(plan.items_.begin(), plan.items_.end(),
                   [&](const AttentionPlan::WorkItem& a, const AttentionPlan::WorkItem& b) {
                     return ItemCost(a, qp[a.request]) > ItemCost(b, qp[b.request]);
                   });
  return plan;
}

std::string AttentionPlan::ToString() const {
  int64_t trees = 0;
  for (uint8_t t : is_tree_) trees += t;
  std::string s = detail::StrCat("AttentionPlan(batch=", batch_size(), ", queries=", num_queries(),
                                 ", trees=", trees, ", block_size=", block_size_,
                                 ", num_blocks=", num_blocks_, ", work_items=", items_.size(),
                                 ", split_tiles=", merges_.size());
  if (num_kv_heads_ > 0) detail::AppendAll(s, ", heads=", num_q_heads_, "/", num_kv_heads_);
  return s + ")";
}

// ---------------------------------------------------------------------------------------------
// Kernels
// ---------------------------------------------------------------------------------------------
namespace {

// Everything one RunAttention call shares between work items.
struct RunCtx {
  const int64_t* q_indptr;
  const int64_t* page_indptr;
  const int32_t* pages;
  const uint8_t* is_tree;
  const uint64_t* masks;
  const AttentionPlan::WorkItem* items;
  const char* q;   // [T, Hq, D]
  const char* kp;  // [num_blocks, bs, Hkv, D]
  const char* vp;
  const char* kn;  // [T, Hkv, D]
  const char* vn;
  char* out;            // [T, Hq, D]
  float* lse;           // [T, Hq] or nullptr
  float* partial_o;     // [partial rows, Hq, D]
  float* partial_lse;   // [partial rows, Hq]
  DType q_dtype, kv_dtype;
  int64_t q_esize, kv_esize;
  int64_t hq, hkv, group, d, dp, block_size;
  float scale2;  // scale * log2(e)
};

// Row loads in the kernel build `Isa`: float16 rows (a 16-bit KV cache under float32
// activations) through the build's vector conversion (Isa::LoadHalf).
template <class Isa>
PYSPEC_INLINE void LoadRow(const char* src, DType dtype, float* dst, int64_t n) {
  if (dtype == DType::kFloat32) {
    std::memcpy(dst, src, n * sizeof(float));
  } else if (dtype == DType::kBFloat16) {
    const uint16_t* s = reinterpret_cast<const uint16_t*>(src);
    for (int64_t i = 0; i < n; ++i) dst[i] = half::BF16ToFloat(s[i]);
  } else {
    Isa::LoadHalf(reinterpret_cast<const uint16_t*>(src), dst, n);
  }
}

void StoreRow(const float* src, float mul, DType dtype, char* dst, int64_t n) {
  if (dtype == DType::kFloat32) {
    float* o = reinterpret_cast<float*>(dst);
    for (int64_t i = 0; i < n; ++i) o[i] = src[i] * mul;
  } else if (dtype == DType::kBFloat16) {
    uint16_t* o = reinterpret_cast<uint16_t*>(dst);
    for (int64_t i = 0; i < n; ++i) o[i] = half::FloatToBF16(src[i] * mul);
  } else {
    uint16_t* o = reinterpret_cast<uint16_t*>(dst);
    for (int64_t i = 0; i < n; ++i) o[i] = half::FloatToHalf(src[i] * mul);
  }
}

// Unaligned loads/stores and lane selects of vector-extension values. Vectors are passed by
// pointer or reference, never returned from non-inlined code, so the psABI never changes.
template <class V>
PYSPEC_INLINE void VLoad(V* v, const float* p) {
  std::memcpy(v, p, sizeof(V));
}
template <class V>
PYSPEC_INLINE void VStore(float* p, const V& v) {
  std::memcpy(p, &v, sizeof(V));
}
// *dst = mask ? a : b per lane; mask lanes are all-ones or zero (a vector comparison).
template <class V, class M>
PYSPEC_INLINE void Select(V* dst, const M& mask, const V& a, const V& b) {
  *dst = reinterpret_cast<V>((reinterpret_cast<M>(a) & mask) | (reinterpret_cast<M>(b) & ~mask));
}

// 2^x, in place, for x <= 0 (scores minus their running max).
// Round-to-nearest splits x = n + r, |r| <= 1/2; 2^r by its degree-7 Taylor polynomial in r*ln2
// (relative error < 1e-8 plus rounding); 2^n by building the exponent bits. Inputs below -127
// (including -inf, i.e. masked scores) give exactly 0.
// Spelled with vector operations: a scalar version with its clamp is not if-converted under
// -ftrapping-math and its loops stay scalar.
template <class V>
PYSPEC_INLINE void Exp2V(V* v) {
  typedef int32_t VI __attribute__((vector_size(sizeof(V))));
  const V lo = V{} - 127.0f, round = V{} + 12582912.0f;
  V x;
  Select(&x, *v < lo, lo, *v);
  const V n = (x + round) - round;
  const V r = x - n;
  V p = V{} + 1.5252733804059841e-05f;
  p = p * r + 1.5403530393381606e-04f;
  p = p * r + 1.3333558146428443e-03f;
  p = p * r + 9.6181291076284772e-03f;
  p = p * r + 5.5504108664821580e-02f;
  p = p * r + 2.4022650695910071e-01f;
  p = p * r + 6.9314718055994531e-01f;
  p = p * r + 1.0f;
  const VI e = (__builtin_convertvector(n, VI) + 127) << 23;
  *v = p * reinterpret_cast<V>(e);
}

// C[MR, NV*L] (+)= sum_k A(i, k) * B[k, :], A(i, k) = a[i * sai + k * sak], B rows ldb apart.
// The accumulators stay in registers for all K steps.
template <class V, int MR, int NV>
PYSPEC_INLINE void MicroTile(int64_t K, const float* a, int64_t sai, int64_t sak, const float* b,
                             int64_t ldb, float* c, int64_t ldc, bool accumulate) {
  constexpr int L = sizeof(V) / sizeof(float);
  V acc[MR][NV];
#pragma GCC unroll 8
  for (int i = 0; i < MR; ++i) {
#pragma GCC unroll 4
    for (int j = 0; j < NV; ++j) {
      if (accumulate) {
        std::memcpy(&acc[i][j], c + i * ldc + j * L, sizeof(V));
      } else {
        acc[i][j] = V{};
      }
    }
  }
  for (int64_t k = 0; k < K; ++k) {
    V bv[NV];
#pragma GCC unroll 4
    for (int j = 0; j < NV; ++j) std::memcpy(&bv[j], b + k * ldb + j * L, sizeof(V));
#pragma GCC unroll 8
    for (int i = 0; i < MR; ++i) {
      // Broadcast. `s - 0` folds to s (exact for every s), so this is one broadcast load;
      // `0 + s` would keep a scalar add (it differs for s = -0).
      const V av = a[i * sai + k * sak] - V{};
#pragma GCC unroll 4
      for (int j = 0; j < NV; ++j) acc[i][j] += av * bv[j];
    }
  }
#pragma GCC unroll 8
  for (int i = 0; i < MR; ++i) {
#pragma GCC unroll 4
    for (int j = 0; j < NV; ++j) std::memcpy(c + i * ldc + j * L, &acc[i][j], sizeof(V));
  }
}

// C[M, N] (+)= A[M, K] * B[K, N] with N a multiple of NV * L.
template <class V, int MR, int NV>
PYSPEC_INLINE void Gemm(int64_t M, int64_t N, int64_t K, const float* a, int64_t sai, int64_t sak,
                        const float* b, int64_t ldb, float* c, int64_t ldc, bool accumulate) {
  constexpr int64_t NR = NV * (sizeof(V) / sizeof(float));
  int64_t i = 0;
  for (; i + MR <= M; i += MR) {
    for (int64_t j = 0; j < N; j += NR) {
      MicroTile<V, MR, NV>(K, a + i * sai, sai, sak, b + j, ldb, c + i * ldc + j, ldc, accumulate);
    }
  }
  if (MR > 4 && i + 4 <= M) {
    for (int64_t j = 0; j < N; j += NR) {
      MicroTile<V, 4, NV>(K, a + i * sai, sai, sak, b + j, ldb, c + i * ldc + j, ldc, accumulate);
    }
    i += 4;
  }
  for (; i < M; ++i) {
    for (int64_t j = 0; j < N; j += NR) {
      MicroTile<V, 1, NV>(K, a + i * sai, sai, sak, b + j, ldb, c + i * ldc + j, ldc, accumulate);
    }
  }
}

// Per-thread scratch, grown on demand and reused across calls.
struct Workspace {
  std::vector<float> buf;
  float* Get(int64_t n) {
    if (static_cast<int64_t>(buf.size()) < n) buf.resize(n);
    return buf.data();
  }
};
Workspace& ThreadWorkspace() {
  static thread_local Workspace ws;
  return ws;
}

// The state of one work item while it walks its KV tiles.
struct ItemState {
  int64_t m, mp, m_rows;  // query vectors, padded columns of qt/st, rows of o that are computed
  bool narrow;            // mp == 8: the narrow micro-kernel
  float *qt, *o, *st, *kt, *vt, *run_max, *run_sum, *alpha, *sub;
};

// Processes one KV tile of n keys already in kt/vt. When `masked`, visible(t, m) says whether key
// t of the tile is visible to query vector m; otherwise every key is.
template <class Isa, class MaskFn>
PYSPEC_INLINE void ProcessTile(const RunCtx& c, ItemState& s, int64_t n, const MaskFn& visible,
                               bool masked) {
  using V = typename Isa::V;
  const int64_t mp = s.mp, dp = c.dp;
  float* st = s.st;
  // Scores (already in log2 units): st[n, mp] = kt[n, D] * qt[D, mp].
  if (s.narrow) {
    Gemm<V, Isa::kMr, Isa::kNarrowNv>(n, mp, c.d, s.kt, c.d, 1, s.qt, mp, st, mp, false);
  } else {
    Gemm<V, Isa::kMr, Isa::kWideNv>(n, mp, c.d, s.kt, c.d, 1, s.qt, mp, st, mp, false);
  }
  if (masked) {
    for (int64_t t = 0; t < n; ++t) {
      for (int64_t m = 0; m < s.m; ++m) {
        if (!visible(t, m)) st[t * mp + m] = kNegInf;
      }
    }
  }
  // Online softmax (Milakov & Gimelshein 2018), one column block of L queries at a time: tile
  // max, new running max, rescale factor alpha, probabilities p = exp2(s - max), running sum.
  constexpr int L = sizeof(V) / sizeof(float);
  const V neg_inf = V{} + kNegInf;
  for (int64_t j = 0; j < mp; j += L) {
    V mx = neg_inf, x;
    for (int64_t t = 0; t < n; ++t) {
      VLoad(&x, st + t * mp + j);
      Select(&mx, mx < x, x, mx);
    }
    V old_max, sum;
    VLoad(&old_max, s.run_max + j);
    V new_max, sub;
    Select(&new_max, old_max < mx, mx, old_max);
    // A query that has seen only masked keys keeps max -inf; subtracting 0 keeps exp2 at 0.
    Select(&sub, new_max == neg_inf, V{}, new_max);
    V alpha = old_max - sub;
    Exp2V(&alpha);
    VStore(s.run_max + j, new_max);
    VStore(s.alpha + j, alpha);
    VLoad(&sum, s.run_sum + j);
    sum *= alpha;
    for (int64_t t = 0; t < n; ++t) {
      VLoad(&x, st + t * mp + j);
      x -= sub;
      Exp2V(&x);
      VStore(st + t * mp + j, x);
      sum += x;
    }
    VStore(s.run_sum + j, sum);
  }
  // o = o * alpha + p * vt
  for (int64_t m = 0; m < s.m_rows; ++m) {
    const float a = s.alpha[m];
    if (a == 1.0f) continue;
    float* orow = s.o + m * dp;
    for (int64_t k = 0; k < dp; ++k) orow[k] *= a;
  }
  Gemm<V, Isa::kMr, Isa::kWideNv>(s.m_rows, dp, n, st, 1, mp, s.vt, dp, s.o, dp, true);
}

template <class Isa>
PYSPEC_INLINE void ProcessItemImpl(const RunCtx& c, const AttentionPlan::WorkItem& w, int64_t h) {
  const int64_t rows = w.q_end - w.q_begin, G = c.group, D = c.d, dp = c.dp;
  ItemState s;
  s.m = rows * G;
  // The 8-column narrow tile exists only where a vector holds at most 8 floats.
  s.narrow = sizeof(typename Isa::V) <= 8 * sizeof(float) && s.m <= 8;
  s.mp = s.narrow ? 8 : RoundUp(s.m, kPad);
  s.m_rows = RoundUp(s.m, 4);  // <= mp; computed with blocks of kMr, then 4, then 1 rows
  const int64_t mp = s.mp;
  // A tree's tiles hold the last partial tile of the prefix and up to every node (see below).
  const bool tree_item = w.with_new && c.is_tree[w.request] != 0;
  const int64_t cap = tree_item ? kTileKeys + kMaskWords * 64 : kTileKeys;
  float* base = ThreadWorkspace().Get(D * mp + mp * dp + cap * (mp + D + dp) + 4 * mp + D);
  s.qt = base;
  s.o = s.qt + D * mp;
  s.st = s.o + mp * dp;
  s.kt = s.st + cap * mp;
  s.vt = s.kt + cap * D;
  s.run_max = s.vt + cap * dp;
  s.run_sum = s.run_max + mp;
  s.alpha = s.run_sum + mp;
  s.sub = s.alpha + mp;
  float* tmp = s.sub + mp;

  // Query tile, transposed and pre-scaled; padding columns are zero queries.
  std::fill(s.qt, s.qt + D * mp, 0.0f);
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t g = 0; g < G; ++g) {
      const int64_t m = r * G + g;
      LoadRow<Isa>(c.q + ((w.q_begin + r) * c.hq + h * G + g) * D * c.q_esize, c.q_dtype, tmp, D);
      for (int64_t k = 0; k < D; ++k) s.qt[k * mp + m] = tmp[k] * c.scale2;
    }
  }
  std::fill(s.o, s.o + mp * dp, 0.0f);
  std::fill(s.vt, s.vt + cap * dp, 0.0f);  // padding columns stay zero
  std::fill(s.run_max, s.run_max + mp, kNegInf);
  std::fill(s.run_sum, s.run_sum + mp, 0.0f);

  const int64_t kv_row = c.hkv * D * c.kv_esize;  // bytes between consecutive tokens
  const int64_t head_off = h * D * c.kv_esize;
  const int32_t* pages = c.pages + c.page_indptr[w.request];
  const int64_t bs = c.block_size;
  auto all = [](int64_t, int64_t) { return true; };
  // A tree item leaves the prefix's last partial tile to the tree tiles below.
  const int64_t prefix_end =
      tree_item ? std::max(w.kv_begin, w.kv_end / kTileKeys * kTileKeys) : w.kv_end;
  auto load_prefix_key = [&](int64_t pos, int64_t t) {
    const int64_t slot = static_cast<int64_t>(pages[pos / bs]) * bs + pos % bs;
    LoadRow<Isa>(c.kp + slot * kv_row + head_off, c.kv_dtype, s.kt + t * D, D);
    LoadRow<Isa>(c.vp + slot * kv_row + head_off, c.kv_dtype, s.vt + t * dp, D);
  };
  for (int64_t kv = w.kv_begin; kv < prefix_end; kv += kTileKeys) {
    const int64_t n = std::min(kTileKeys, w.kv_end - kv);
    for (int64_t t = 0; t < n; ++t) load_prefix_key(kv + t, t);
    ProcessTile<Isa>(c, s, n, all, false);
  }
  // Rows of this step's new tokens (flattened) -> tile slot t.
  auto load_new_key = [&](int64_t row, int64_t t) {
    LoadRow<Isa>(c.kn + row * kv_row + head_off, c.kv_dtype, s.kt + t * D, D);
    LoadRow<Isa>(c.vn + row * kv_row + head_off, c.kv_dtype, s.vt + t * dp, D);
  };
  const int64_t q0 = c.q_indptr[w.request];
  const int64_t first = w.q_begin - q0, last = w.q_end - 1 - q0;  // request-local rows
  if (tree_item) {
    // Tree nodes are scored exactly as decoding them one at a time would score them: a node at
    // depth d sits at position P + d (P = prefix length), and decoding it alone would walk its
    // prefix and ancestors in tiles of kTileKeys positions aligned to position 0, then its own
    // key as a tile of one. So the tiles here are those same position ranges: tile u holds the
    // prefix keys of [base + 64u, P) (u = 0 only) and every node whose position falls in
    // [base + 64u, base + 64u + 64), in node order (parents before children, so each row meets
    // its ancestors in position order), each row seeing the prefix keys and its strict
    // ancestors; a last tile holds each row's own key, seen by that row alone. The keys a row
    // does not see score -inf and add exact zeros, so every row's sums, maxima and rescalings
    // are the single-row decode's, bit for bit (given the same split of the prefix).
    const int64_t P = w.kv_end;
    const uint64_t* masks = c.masks + q0 * kMaskWords;
    const int64_t tile0 = prefix_end;
    // Each node's depth, then each tile slot's node (-1 for a prefix key).
    static thread_local std::vector<int32_t> tree_ints;
    tree_ints.resize(static_cast<size_t>(last + 1 + cap));
    int32_t* depth_of = tree_ints.data();
    int64_t max_depth = 0;
    for (int64_t j = 0; j <= last; ++j) {
      int64_t bits = 0;
      for (int64_t wd = 0; wd < kMaskWords; ++wd) {
        bits += __builtin_popcountll(masks[j * kMaskWords + wd]);
      }
      depth_of[j] = static_cast<int32_t>(bits - 1);
      max_depth = std::max<int64_t>(max_depth, bits - 1);
    }
    int32_t* tile_node = depth_of + (last + 1);
    for (int64_t lo = tile0; lo <= P + max_depth; lo += kTileKeys) {
      int64_t n = 0;
      if (lo == tile0) {
        for (int64_t pos = tile0; pos < P; ++pos, ++n) {
          load_prefix_key(pos, n);
          tile_node[n] = -1;
        }
      }
      for (int64_t j = 0; j <= last; ++j) {
        const int64_t pos = P + depth_of[j];
        if (pos < lo || pos >= lo + kTileKeys) continue;
        load_new_key(q0 + j, n);
        tile_node[n++] = static_cast<int32_t>(j);
      }
      if (n == 0) continue;
      auto visible = [&](int64_t t, int64_t m) {
        const int64_t j = tile_node[t];
        if (j < 0) return true;
        const int64_t i = first + m / G;
        return j != i && ((masks[i * kMaskWords + (j >> 6)] >> (j & 63)) & 1u) != 0;
      };
      ProcessTile<Isa>(c, s, n, visible, true);
    }
    const int64_t n = last + 1 - first;
    for (int64_t t = 0; t < n; ++t) load_new_key(q0 + first + t, t);
    auto own = [&](int64_t t, int64_t m) { return t == m / G; };
    ProcessTile<Isa>(c, s, n, own, n > 1);
  } else if (w.with_new) {
    // A causal chunk: key j is visible to row i when j <= i.
    for (int64_t j0 = 0; j0 <= last; j0 += kTileKeys) {
      const int64_t n = std::min(kTileKeys, last + 1 - j0);
      for (int64_t t = 0; t < n; ++t) load_new_key(q0 + j0 + t, t);
      auto visible = [&](int64_t t, int64_t m) { return j0 + t <= first + m / G; };
      ProcessTile<Isa>(c, s, n, visible, j0 + n - 1 > first);
    }
  }

  // Normalize and write: out = o / sum, lse = ln(sum) + max (natural log; max is in log2 units).
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t g = 0; g < G; ++g) {
      const int64_t m = r * G + g, hq = h * G + g;
      const float sum = s.run_sum[m];
      const float lse = (s.run_max[m] + std::log2(sum)) * kLn2;
      const float* orow = s.o + m * dp;
      if (w.partial_row < 0) {
        const int64_t row = w.q_begin + r;
        StoreRow(orow, 1.0f / sum, c.q_dtype, c.out + (row * c.hq + hq) * D * c.q_esize, D);
        if (c.lse != nullptr) c.lse[row * c.hq + hq] = lse;
      } else {
        const int64_t prow = w.partial_row + r;
        StoreRow(orow, 1.0f / sum, DType::kFloat32,
                 reinterpret_cast<char*>(c.partial_o + (prow * c.hq + hq) * D), D);
        c.partial_lse[prow * c.hq + hq] = lse;
      }
    }
  }
}

struct GenericIsa {
  typedef float V __attribute__((vector_size(16)));
  static constexpr int kMr = 4, kWideNv = 2, kNarrowNv = 2;  // 4 x 8 floats: 8 of 16 xmm
  static PYSPEC_INLINE void LoadHalf(const uint16_t* s, float* d, int64_t n) {
    for (int64_t i = 0; i < n; ++i) d[i] = half::HalfToFloat(s[i]);
  }
};

void ProcessItemGeneric(const RunCtx& c, const AttentionPlan::WorkItem& w, int64_t h) {
  ProcessItemImpl<GenericIsa>(c, w, h);
}

#ifdef PYSPEC_X86
// float16 -> float32, 8 at a time (F16C: every CPU with AVX2 has it; CpuHasAvx2 checks).
// Not inlined: the kernel's row-load lambdas are compiled for the baseline and call it.
__attribute__((target("avx2,fma,f16c"))) void LoadHalfF16c(const uint16_t* s, float* d,
                                                          int64_t n) {
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    _mm256_storeu_ps(d + i, _mm256_cvtph_ps(_mm_loadu_si128(
                                reinterpret_cast<const __m128i*>(s + i))));
  }
  for (; i < n; ++i) d[i] = half::HalfToFloat(s[i]);
}

struct Avx2Isa {
  typedef float V __attribute__((vector_size(32)));
  static constexpr int kMr = 6, kWideNv = 2, kNarrowNv = 1;  // 6 x 16 floats: 12 of 16 ymm
  static void LoadHalf(const uint16_t* s, float* d, int64_t n) { LoadHalfF16c(s, d, n); }
};

__attribute__((target("avx2,fma,f16c"))) void ProcessItemAvx2(const RunCtx& c,
                                                         const AttentionPlan::WorkItem& w,
                                                         int64_t h) {
  ProcessItemImpl<Avx2Isa>(c, w, h);
}

// 16 float lanes: score/output tiles are multiples of kPad = 16 columns, so one vector per column
// block (NV = 1) and no 8-column narrow tile.
struct Avx512Isa {
  typedef float V __attribute__((vector_size(64)));
  static constexpr int kMr = 8, kWideNv = 1, kNarrowNv = 1;  // 8 x 16 floats: 8 of 32 zmm
  static void LoadHalf(const uint16_t* s, float* d, int64_t n) { LoadHalfF16c(s, d, n); }
};

__attribute__((target("avx512f,avx2,fma,f16c"))) void ProcessItemAvx512(
    const RunCtx& c, const AttentionPlan::WorkItem& w, int64_t h) {
  ProcessItemImpl<Avx512Isa>(c, w, h);
}

#endif

using ItemFn = void (*)(const RunCtx&, const AttentionPlan::WorkItem&, int64_t);

// The vector build of `kernels` (a model's; nullptr: this CPU's best), AVX-512 at most.
int KernelLevel(const LinearKernels* kernels) {
  const int level = kernels != nullptr ? kernels->level() : detail::CpuIsaLevel();
  return std::min(level, detail::kIsaAvx512);
}

ItemFn SelectKernel(int level) {
#ifdef PYSPEC_X86
  if (level >= detail::kIsaAvx512) return &ProcessItemAvx512;
  if (level >= detail::kIsaAvx2) return &ProcessItemAvx2;
#endif
  (void)level;
  return &ProcessItemGeneric;
}


// Merges the split-KV partial results of one query row (all heads) with log-sum-exp.
void MergeRow(const RunCtx& c, const AttentionPlan::Merge& mg, int64_t r, float* acc) {
  const int64_t rows = mg.q_end - mg.q_begin, D = c.d;
  const int64_t row = mg.q_begin + r;
  for (int64_t hq = 0; hq < c.hq; ++hq) {
    float mx = kNegInf;
    for (int32_t k = 0; k < mg.num_chunks; ++k) {
      mx = std::max(mx, c.partial_lse[(mg.partial_row + k * rows + r) * c.hq + hq]);
    }
    std::fill(acc, acc + D, 0.0f);
    float total = 0.0f;
    for (int32_t k = 0; k < mg.num_chunks; ++k) {
      const int64_t prow = mg.partial_row + k * rows + r;
      const float wgt = std::exp(c.partial_lse[prow * c.hq + hq] - mx);
      total += wgt;
      const float* src = c.partial_o + (prow * c.hq + hq) * D;
      for (int64_t k2 = 0; k2 < D; ++k2) acc[k2] += wgt * src[k2];
    }
    StoreRow(acc, 1.0f / total, c.q_dtype, c.out + (row * c.hq + hq) * D * c.q_esize, D);
    if (c.lse != nullptr) c.lse[row * c.hq + hq] = mx + std::log(total);
  }
}

}  // namespace

namespace detail {

std::string AttentionIsa(const LinearKernels* kernels) {
  return detail::IsaLevelName(KernelLevel(kernels));
}

}  // namespace detail

namespace detail {
AttentionShape CheckAttentionArgs(const AttentionPlan& plan, const TensorView& q,
                                  const TensorView& k_pages, const TensorView& v_pages,
                                  const TensorView& k_new, const TensorView& v_new,
                                  const TensorView& out, const TensorView* lse, float scale,
                                  DeviceType device) {
  const std::initializer_list<DType> floats = {DType::kFloat32, DType::kBFloat16, DType::kFloat16};
  struct Arg {
    const TensorView* t;
    const char* name;
  };
  const Arg args[] = {{&q, "q"},         {&k_pages, "k_pages"}, {&v_pages, "v_pages"},
                      {&k_new, "k_new"}, {&v_new, "v_new"},     {&out, "out"}};
  for (const Arg& a : args) {
    CheckDevice(*a.t, a.name, device);
    CheckSameDevice(q, "q", *a.t, a.name);
    CheckDType(*a.t, a.name, floats);
    CheckContiguous(*a.t, a.name);
  }
  PYSPEC_CHECK(q.ndim == 3, "'q' must be [num_queries, num_q_heads, head_dim]; got ",
               q.ShapeString());
  PYSPEC_CHECK(k_pages.ndim == 4, "'k_pages' must be [num_blocks, block_size, num_kv_heads, ",
               "head_dim]; got ", k_pages.ShapeString());
  const int64_t T = plan.num_queries(), Hq = q.shape[1], D = q.shape[2], Hkv = k_pages.shape[2];
  CheckShape(q, "q", {T, -1, -1});
  CheckShape(k_pages, "k_pages", {plan.num_blocks(), plan.block_size(), -1, D});
  CheckShape(v_pages, "v_pages", {plan.num_blocks(), plan.block_size(), Hkv, D});
  CheckShape(k_new, "k_new", {T, Hkv, D});
  CheckShape(v_new, "v_new", {T, Hkv, D});
  PYSPEC_CHECK(D > 0 && Hkv > 0 && Hq > 0 && Hq % Hkv == 0, "'q' has ", Hq, " heads of dim ", D,
               "; the head count must be a positive multiple of the ", Hkv,
               " KV heads of 'k_pages'");
  CheckShape(out, "out", {T, Hq, D});
  PYSPEC_CHECK(plan.num_kv_heads() == 0 ||
                   (plan.num_q_heads() == Hq && plan.num_kv_heads() == Hkv),
               "the plan was built for ", plan.num_q_heads(), "/", plan.num_kv_heads(),
               " q/kv heads but 'q'/'k_pages' have ", Hq, "/", Hkv);
  PYSPEC_CHECK(out.dtype == q.dtype, "'out' has dtype ", DTypeName(out.dtype), " but 'q' has ",
               DTypeName(q.dtype));
  for (const Arg& a : {args[2], args[3], args[4]}) {
    PYSPEC_CHECK(a.t->dtype == k_pages.dtype, "'", a.name, "' has dtype ", DTypeName(a.t->dtype),
                 " but 'k_pages' has ", DTypeName(k_pages.dtype), "; K/V storage must share one");
  }
  if (lse != nullptr) {
    CheckDevice(*lse, "lse", device);
    CheckSameDevice(q, "q", *lse, "lse");
    CheckDType(*lse, "lse", {DType::kFloat32});
    CheckShape(*lse, "lse", {T, Hq});
    CheckContiguous(*lse, "lse");
  }
  PYSPEC_CHECK(std::isfinite(scale), "'scale' must be finite; got ", scale);
  return {T, Hq, Hkv, D};
}
}  // namespace detail

void RunAttention(const AttentionPlan& plan, const TensorView& q, const TensorView& k_pages,
                  const TensorView& v_pages, const TensorView& k_new, const TensorView& v_new,
                  const TensorView& out, const TensorView* lse, float scale, ThreadPool* pool,
                  const LinearKernels* kernels) {
  const detail::AttentionShape shape = detail::CheckAttentionArgs(
      plan, q, k_pages, v_pages, k_new, v_new, out, lse, scale, DeviceType::kCPU);
  const int64_t T = shape.T, Hq = shape.Hq, D = shape.D, Hkv = shape.Hkv;
  if (T == 0) return;

  RunCtx c;
  c.q_indptr = plan.q_indptr_.data();
  c.page_indptr = plan.page_indptr_.data();
  c.pages = plan.pages_.data();
  c.is_tree = plan.is_tree_.data();
  c.masks = plan.masks_.data();
  c.items = plan.items_.data();
  c.q = static_cast<const char*>(q.data);
  c.kp = static_cast<const char*>(k_pages.data);
  c.vp = static_cast<const char*>(v_pages.data);
  c.kn = static_cast<const char*>(k_new.data);
  c.vn = static_cast<const char*>(v_new.data);
  c.out = static_cast<char*>(out.data);
  c.lse = lse != nullptr ? lse->ptr<float>() : nullptr;
  std::vector<float> partial_o(plan.num_partial_rows_ * Hq * D);
  std::vector<float> partial_lse(plan.num_partial_rows_ * Hq);
  c.partial_o = partial_o.data();
  c.partial_lse = partial_lse.data();
  c.q_dtype = q.dtype;
  c.kv_dtype = k_pages.dtype;
  c.q_esize = DTypeSize(q.dtype);
  c.kv_esize = DTypeSize(k_pages.dtype);
  c.hq = Hq;
  c.hkv = Hkv;
  c.group = Hq / Hkv;
  c.d = D;
  c.dp = RoundUp(D, kPad);
  c.block_size = plan.block_size_;
  c.scale2 = scale * kLog2e;

  ThreadPool& tp = pool != nullptr ? *pool : ThreadPool::Default();
  const ItemFn fn = SelectKernel(KernelLevel(kernels));
  const int64_t num_items = static_cast<int64_t>(plan.items_.size());
  tp.ParallelFor(num_items * Hkv, 1, [&](int64_t begin, int64_t end) {
    for (int64_t k = begin; k < end; ++k) fn(c, c.items[k / Hkv], k % Hkv);
  });
  if (!plan.merges_.empty()) {
    // Flatten (merge, row) pairs so long tiles spread over threads.
    std::vector<std::pair<int32_t, int32_t>> rows;
    for (size_t i = 0; i < plan.merges_.size(); ++i) {
      const auto& mg = plan.merges_[i];
      for (int64_t r = 0; r < mg.q_end - mg.q_begin; ++r) rows.emplace_back(int32_t(i), int32_t(r));
    }
    tp.ParallelFor(static_cast<int64_t>(rows.size()), 4, [&](int64_t begin, int64_t end) {
      std::vector<float> acc(D);
      for (int64_t k = begin; k < end; ++k) {
        MergeRow(c, plan.merges_[rows[k].first], rows[k].second, acc.data());
      }
    });
  }
}

}  // namespace pyspec
