// Tree attention over the paged KV cache on CUDA (contract: pyspec/attention.h; partition:
// attention_plan.h).
//
// Two kernels compute a work item (a tile of query rows of one request x its whole query group,
// against one prefix chunk and, for the last chunk, the new tokens under the mask) for one KV head:
//   * TreeAttentionTC: the fast path, bf16/fp16 with head_dim 64 or 128 and groups up to 64.
//     Flash-attention style (Dao et al. 2022) on tensor cores through the WMMA API: the tile's
//     64 query vectors (rows x group heads, GQA packing: every K/V tile is loaded once for the
//     whole group) against 64-key K/V tiles in shared memory; S = Q K^T and O += P V in
//     m16n16k16 MMAs with fp32 accumulation; online softmax in base 2 on the fp32 scores.
//   * TreeAttentionGeneric: any head_dim <= 256, fp32/bf16/fp16, any group: one warp per query
//     vector, lanes split the head dimension, online softmax in fp32.
// A split tile's chunks write fp32 partial outputs and their log-sum-exp; MergeSplits combines them
// (FlashDecoding's split-KV reduction).
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>
#include <mma.h>

#include <cstdint>

#include "attention_plan.h"
#include "dtype.cuh"

namespace pyspec {
namespace kernels {

constexpr int kAttnMaskWords = 4;  // TokenTree::kMaskWords (256 nodes)

// Device view of one step (pointers into the uploaded plan; see attention.cu).
struct AttnStep {
  const int64_t* q_indptr;     // [B + 1]
  const int64_t* prefix_lens;  // [B]
  const int64_t* page_indptr;  // [B + 1]
  const int32_t* pages;        // [total used pages]
  const uint8_t* is_tree;      // [B]
  const uint64_t* masks;       // [T, kAttnMaskWords] (nullptr when no request is a tree)
  const gpu_plan::Item* items;
  int64_t block_size;
  int64_t hq, hkv, group, d;
  float scale_log2;            // scale * log2(e): scores are kept in base 2
  float* partial_o;            // [partial rows, Hq, D]
  float* partial_lse;          // [partial rows, Hq] (natural log)
};

// Row of key `key` (request-local position: prefix positions first, then new tokens at
// prefix_len + t) for KV head h, or nullptr when the key does not exist.
template <typename T>
__device__ __forceinline__ const T* KeyRow(const AttnStep& s, const T* pages_base,
                                           const T* new_base, int64_t b, int64_t prefix_len,
                                           int64_t q_first, int64_t key, int64_t h) {
  if (key < prefix_len) {
    const int32_t page = s.pages[s.page_indptr[b] + key / s.block_size];
    const int64_t slot = static_cast<int64_t>(page) * s.block_size + key % s.block_size;
    return pages_base + (slot * s.hkv + h) * s.d;
  }
  return new_base + ((q_first + key - prefix_len) * s.hkv + h) * s.d;
}

// ---- fast path: tensor cores -----------------------------------------------------------------

namespace tc {
constexpr int kWarps = 4;                // 4 x 16 = 64 query vectors
constexpr int kThreads = kWarps * 32;
constexpr int kM = 64;                   // gpu_plan::kTileVectors
constexpr int kN = 64;                   // gpu_plan::kTileKeys
constexpr int kSLd = kN + 4;             // fp32 score row stride (floats)
constexpr int kPLd = kSLd * 2;           // P rows alias S rows: same byte stride, 16-bit elements
constexpr int kOLd = 16 + 4;             // per-warp 16x16 fp32 staging
}  // namespace tc

template <int D>
constexpr int TcKvLd() { return D + 8; }  // padded K/V/Q row stride (16-bit elements)

// kPipe: two K/V stages (the next tile loads while this one is computed).
template <int D, bool kPipe = false>
constexpr size_t TcSmemBytes() {
  return sizeof(uint16_t) * 2 * tc::kN * TcKvLd<D>() * (kPipe ? 2 : 1)  // K/V tiles (Q staged in K)
         + sizeof(float) * tc::kM * tc::kSLd             // S (fp32), P aliases it
         + sizeof(float) * tc::kWarps * 16 * tc::kOLd    // per-warp PV staging
         + sizeof(float) * tc::kM * 3;                   // running max, sum, rescale
}

// Loads keys [key0, key0 + 64) of the K or V side into a [64, D] tile (zeros past `num_keys`).
template <typename T, int D>
__device__ __forceinline__ void LoadKvTile(const AttnStep& s, T* tile, const T* pages_base,
                                           const T* new_base, int64_t b, int64_t prefix_len,
                                           int64_t q_first, int64_t h, int64_t key0,
                                           int64_t key_end) {
  constexpr int kVec = 8;  // 16 bytes of 16-bit elements
  constexpr int kVecsPerRow = D / kVec;
  for (int i = threadIdx.x; i < tc::kN * kVecsPerRow; i += tc::kThreads) {
    const int r = i / kVecsPerRow, c = (i % kVecsPerRow) * kVec;
    const int64_t key = key0 + r;
    uint4 v = make_uint4(0, 0, 0, 0);
    if (key < key_end) {
      const T* row = KeyRow<T>(s, pages_base, new_base, b, prefix_len, q_first, key, h);
      v = *reinterpret_cast<const uint4*>(row + c);
    }
    *reinterpret_cast<uint4*>(tile + r * TcKvLd<D>() + c) = v;
  }
}

// 16-byte asynchronous global -> shared copy (sm_80+); `valid` false writes zeros instead
// (src-size 0: nothing is read from `gmem`, which must still be a valid address).
__device__ __forceinline__ void CpAsync16(void* smem, const void* gmem, bool valid) {
  const unsigned dst = static_cast<unsigned>(__cvta_generic_to_shared(smem));
  const int bytes = valid ? 16 : 0;
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(gmem),
               "r"(bytes));
}
__device__ __forceinline__ void CpAsyncCommit() { asm volatile("cp.async.commit_group;\n" ::); }
// Waits until at most N of this thread's committed groups are still in flight.
template <int N>
__device__ __forceinline__ void CpAsyncWait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(N));
}

// Where the tile's 64 keys live, one thread per key (threads 0..63): the element offset of the
// key's row for KV head h in the pages (>= 0), -2 - its offset in the new tokens' K/V, or -1 past
// `key_end`. Staged in shared memory so that the copies below need no dependent global load.
template <int D>
__device__ __forceinline__ void TileRowOffsets(const AttnStep& s, int64_t* offs, int64_t b,
                                               int64_t prefix_len, int64_t q_first, int64_t h,
                                               int64_t key0, int64_t key_end) {
  if (threadIdx.x < tc::kN) {
    const int64_t key = key0 + threadIdx.x;
    int64_t v = -1;
    if (key < key_end) {
      if (key < prefix_len) {
        const int32_t page = s.pages[s.page_indptr[b] + key / s.block_size];
        const int64_t slot = static_cast<int64_t>(page) * s.block_size + key % s.block_size;
        v = (slot * s.hkv + h) * D;
      } else {
        v = -2 - ((q_first + key - prefix_len) * s.hkv + h) * D;
      }
    }
    offs[threadIdx.x] = v;
  }
}

// Issues the cp.async copies of one K and one V tile from the staged row offsets (zeros past the
// keys' end); the caller commits and waits.
template <typename T, int D>
__device__ __forceinline__ void IssueKvTile(T* k_tile, T* v_tile, const int64_t* offs,
                                            const T* k_pages, const T* v_pages, const T* k_new,
                                            const T* v_new) {
  constexpr int kVecsPerRow = D / 8;  // 16-byte vectors of 16-bit elements
  for (int i = threadIdx.x; i < tc::kN * kVecsPerRow; i += tc::kThreads) {
    const int r = i / kVecsPerRow, c = (i % kVecsPerRow) * 8;
    // Past the keys' end: zeros, with row 0's address (always a real key) as the unread source.
    const int64_t o = offs[r], a = o == -1 ? offs[0] : o;
    const bool valid = o != -1, is_new = a < -1;
    const int64_t e = (is_new ? -2 - a : a) + c;
    CpAsync16(k_tile + r * TcKvLd<D>() + c, (is_new ? k_new : k_pages) + e, valid);
    CpAsync16(v_tile + r * TcKvLd<D>() + c, (is_new ? v_new : v_pages) + e, valid);
  }
}

// grid: (items, Hkv); block: tc::kThreads; dynamic shared memory TcSmemBytes<D, kPipe>().
// kPipe = false: one K/V stage, loaded synchronously; every warp computes all 16 of its rows.
// kPipe = true: two stages through cp.async (tile t + 1 loads while tile t is computed), and a
// warp whose 16 query vectors are all past the item's `vectors` skips the tile's math (a decode
// step of group G fills G of the 64 vectors: with G = 4, three of four warps idle), as do the
// rows past it inside a warp.
// Preconditions (checked by the host op): T is __half or __nv_bfloat16, D in {64, 128},
// group <= 64, rows per item <= 64 / group, q/k/v/out contiguous, 16-byte aligned rows.
template <typename T, int D, bool kPipe = false>
__global__ void __launch_bounds__(tc::kThreads)
    TreeAttentionTC(AttnStep s, const T* __restrict__ q, const T* __restrict__ k_pages,
                    const T* __restrict__ v_pages, const T* __restrict__ k_new,
                    const T* __restrict__ v_new, T* __restrict__ out, float* __restrict__ lse) {
  using namespace nvcuda;
  constexpr int kLd = TcKvLd<D>();
  constexpr int kFrags = D / 16;
  extern __shared__ __align__(128) unsigned char smem_raw[];
  constexpr int kStages = kPipe ? 2 : 1;
  T* const k_stage0 = reinterpret_cast<T*>(smem_raw);
  T* const v_stage0 = k_stage0 + kStages * tc::kN * kLd;
  T* ks = k_stage0;
  T* vs = v_stage0;
  float* ss = reinterpret_cast<float*>(v_stage0 + kStages * tc::kN * kLd);
  __shared__ int64_t tile_offs[kPipe ? tc::kN : 1];  // kPipe: the next tile's row offsets
  T* ps = reinterpret_cast<T*>(ss);
  float* ostage = ss + tc::kM * tc::kSLd;
  float* row_max = ostage + tc::kWarps * 16 * tc::kOLd;
  float* row_alpha = row_max + tc::kM;
  float* row_sum = row_alpha + tc::kM;

  const gpu_plan::Item it = s.items[blockIdx.x];
  const int64_t h = blockIdx.y;
  const int64_t b = it.request;
  const int64_t q_first = s.q_indptr[b];
  const int64_t prefix_len = s.prefix_lens[b];
  const bool is_tree = s.is_tree[b] != 0;
  const int64_t rows = it.q_end - it.q_begin;
  const int64_t G = s.group;
  const int64_t vectors = rows * G;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  // kPipe: whether any of the warp's 16 vectors is a real one (warp-uniform).
  const bool warp_active = !kPipe || warp * 16 < vectors;

  // Stage the tile's query vectors (vector m = local row m / G, head h * G + m % G) in the K
  // buffer and keep them as A fragments for the whole item.
  for (int i = threadIdx.x; i < tc::kM * (D / 8); i += tc::kThreads) {
    const int m = i / (D / 8), c = (i % (D / 8)) * 8;
    uint4 v = make_uint4(0, 0, 0, 0);
    if (m < vectors) {
      const int64_t row = it.q_begin + m / G, head = h * G + m % G;
      v = *reinterpret_cast<const uint4*>(q + (row * s.hq + head) * D + c);
    }
    *reinterpret_cast<uint4*>(ks + m * kLd + c) = v;
  }
  __syncthreads();
  wmma::fragment<wmma::matrix_a, 16, 16, 16, T, wmma::row_major> qf[kFrags];
#pragma unroll
  for (int f = 0; f < kFrags; ++f) {
    wmma::load_matrix_sync(qf[f], ks + warp * 16 * kLd + f * 16, kLd);
  }
  if (threadIdx.x < tc::kM) {
    row_max[threadIdx.x] = -INFINITY;
    row_sum[threadIdx.x] = 0.0f;
  }
  __syncthreads();

  // The lane's share of the output rows of its warp: elements e = lane + 32 * i of the warp's
  // 16 x 16 staging tile, i.e. local row (lane / 16) + 2 i, column lane % 16 of every fragment.
  float o[kFrags][8];
#pragma unroll
  for (int f = 0; f < kFrags; ++f)
#pragma unroll
    for (int i = 0; i < 8; ++i) o[f][i] = 0.0f;
  // Key tiles: the chunk's prefix positions, then (last chunk) the new tokens up to the tile's last
  // row. A tile holds keys of one side only; its tail past the side's end is zero and masked.
  const int64_t new_keys = it.with_new ? it.q_end - q_first : 0;
  const int64_t prefix_tiles = gpu_plan::CeilDiv(it.kv_end - it.kv_begin, tc::kN);
  const int64_t num_tiles = prefix_tiles + gpu_plan::CeilDiv(new_keys, tc::kN);
  // Tile t's first key and key bound (prefix tiles, then the new tokens' tiles).
  auto tile_keys = [&](int64_t t, int64_t* key0, int64_t* key_end) {
    const bool pre = t < prefix_tiles;
    *key0 = pre ? it.kv_begin + t * tc::kN : prefix_len + (t - prefix_tiles) * tc::kN;
    *key_end = pre ? it.kv_end : prefix_len + new_keys;
  };
  if constexpr (kPipe) {
    // Prologue: tile 0 into stage 0 (the Q staged there is already in fragments, and the
    // __syncthreads above ordered those reads before these writes).
    if (num_tiles > 0) {
      int64_t k0, ke;
      tile_keys(0, &k0, &ke);
      TileRowOffsets<D>(s, tile_offs, b, prefix_len, q_first, h, k0, ke);
      __syncthreads();
      IssueKvTile<T, D>(k_stage0, v_stage0, tile_offs, k_pages, v_pages, k_new, v_new);
    }
    CpAsyncCommit();
    __syncthreads();  // every thread has read tile_offs before iteration 0 rewrites it
  }
  for (int64_t tile = 0; tile < num_tiles; ++tile) {
    const bool in_prefix = tile < prefix_tiles;
    int64_t key0, key_end;
    tile_keys(tile, &key0, &key_end);
    if constexpr (kPipe) {
      const int stage = static_cast<int>(tile & 1);
      ks = k_stage0 + stage * tc::kN * kLd;
      vs = v_stage0 + stage * tc::kN * kLd;
      if (tile + 1 < num_tiles) {  // block-uniform
        // The other stage and tile_offs were last read in iteration tile - 1 (or the
        // prologue), each of which ends with __syncthreads. (The page ids read here are on the
        // critical path: one global load latency per tile before the math.)
        int64_t k0, ke;
        tile_keys(tile + 1, &k0, &ke);
        TileRowOffsets<D>(s, tile_offs, b, prefix_len, q_first, h, k0, ke);
        __syncthreads();
        IssueKvTile<T, D>(k_stage0 + (stage ^ 1) * tc::kN * kLd,
                          v_stage0 + (stage ^ 1) * tc::kN * kLd, tile_offs, k_pages, v_pages,
                          k_new, v_new);
      }
      CpAsyncCommit();   // possibly empty: one group per iteration keeps the count uniform
      CpAsyncWait<1>();  // this tile's group has landed (only the next one may be in flight)
    } else {
      LoadKvTile<T, D>(s, ks, k_pages, k_new, b, prefix_len, q_first, h, key0, key_end);
      LoadKvTile<T, D>(s, vs, v_pages, v_new, b, prefix_len, q_first, h, key0, key_end);
    }
    __syncthreads();  // the tile is visible to every warp
    if (warp_active) {

    // S = Q K^T for the warp's 16 vectors x 64 keys.
#pragma unroll
    for (int n = 0; n < tc::kN / 16; ++n) {
      wmma::fragment<wmma::accumulator, 16, 16, 16, float> acc;
      wmma::fill_fragment(acc, 0.0f);
#pragma unroll
      for (int f = 0; f < kFrags; ++f) {
        wmma::fragment<wmma::matrix_b, 16, 16, 16, T, wmma::col_major> kf;
        wmma::load_matrix_sync(kf, ks + n * 16 * kLd + f * 16, kLd);
        wmma::mma_sync(acc, qf[f], kf, acc);
      }
      wmma::store_matrix_sync(ss + warp * 16 * tc::kSLd + n * 16, acc, tc::kSLd,
                              wmma::mem_row_major);
    }
    __syncwarp();

    // Online softmax of the warp's rows; each lane owns keys lane and lane + 32. P (16-bit)
    // overwrites the S row it came from after the row has been read.
#pragma unroll 1
    for (int r = 0; r < 16; ++r) {
      const int m = warp * 16 + r;
      if (kPipe && m >= vectors) {
        // No query here: a zero P row (its O row is never written; the MMAs need it finite).
        ps[m * tc::kPLd + lane] = FromF<T>(0.0f);
        ps[m * tc::kPLd + lane + 32] = FromF<T>(0.0f);
        if (lane == 0) row_alpha[m] = 1.0f;
        continue;
      }
      const int64_t i = it.q_begin + m / G - q_first;  // request-local query index
      float sv[2];
#pragma unroll
      for (int k = 0; k < 2; ++k) {
        const int j = lane + 32 * k;
        bool valid = m < vectors;
        if (in_prefix) {
          valid = valid && key0 + j < key_end;
        } else {
          const int64_t t = key0 + j - prefix_len;
          valid = valid && t < new_keys &&
                  gpu_plan::SeesNewToken<kAttnMaskWords>(
                      is_tree, is_tree ? s.masks + (q_first + i) * kAttnMaskWords : nullptr, i, t);
        }
        sv[k] = valid ? ss[m * tc::kSLd + j] * s.scale_log2 : -INFINITY;
      }
      float mx = fmaxf(sv[0], sv[1]);
#pragma unroll
      for (int off = 16; off > 0; off >>= 1) mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, off));
      const float m_old = row_max[m];
      const float m_new = fmaxf(m_old, mx);
      // A row that has seen no visible key yet keeps max -inf: its p and alpha are 0 / 1.
      const float base = m_new == -INFINITY ? 0.0f : m_new;
      const float p0 = exp2f(sv[0] - base), p1 = exp2f(sv[1] - base);
      float sum = p0 + p1;
#pragma unroll
      for (int off = 16; off > 0; off >>= 1) sum += __shfl_xor_sync(0xffffffffu, sum, off);
      const float alpha = m_old == -INFINITY ? 0.0f : exp2f(m_old - base);
      __syncwarp();  // every lane has read row m of S before it is overwritten with P
      ps[m * tc::kPLd + lane] = FromF<T>(p0);
      ps[m * tc::kPLd + lane + 32] = FromF<T>(p1);
      if (lane == 0) {
        row_max[m] = m_new;
        row_alpha[m] = alpha;
        row_sum[m] = row_sum[m] * alpha + sum;
      }
    }
    __syncwarp();

    // O = O * alpha + P V, one 16-column fragment of D at a time through the staging tile.
    float* stage = ostage + warp * 16 * tc::kOLd;
#pragma unroll
    for (int f = 0; f < kFrags; ++f) {
      wmma::fragment<wmma::accumulator, 16, 16, 16, float> acc;
      wmma::fill_fragment(acc, 0.0f);
#pragma unroll
      for (int kk = 0; kk < tc::kN / 16; ++kk) {
        wmma::fragment<wmma::matrix_a, 16, 16, 16, T, wmma::row_major> pf;
        wmma::fragment<wmma::matrix_b, 16, 16, 16, T, wmma::row_major> vf;
        wmma::load_matrix_sync(pf, ps + warp * 16 * tc::kPLd + kk * 16, tc::kPLd);
        wmma::load_matrix_sync(vf, vs + kk * 16 * kLd + f * 16, kLd);
        wmma::mma_sync(acc, pf, vf, acc);
      }
      wmma::store_matrix_sync(stage, acc, tc::kOLd, wmma::mem_row_major);
      __syncwarp();
#pragma unroll
      for (int i = 0; i < 8; ++i) {
        const int e = lane + 32 * i, r = e / 16, c = e % 16;
        o[f][i] = o[f][i] * row_alpha[warp * 16 + r] + stage[r * tc::kOLd + c];
      }
      __syncwarp();
    }
    }  // warp_active
    __syncthreads();  // K/V tiles are overwritten by the next iteration
  }

  // Epilogue: out = O / l, lse = (max + log2 l) ln 2, or the chunk's partial result.
#pragma unroll
  for (int i = 0; i < 8; ++i) {
    const int r = (lane / 16) + 2 * i, c = lane % 16;
    const int m = warp * 16 + r;
    if (m >= vectors) continue;
    const float l = row_sum[m];
    const float inv = l > 0.0f ? 1.0f / l : 0.0f;
    const int64_t local = m / G, head = h * G + m % G;
    if (it.partial_row < 0) {
      T* dst = out + ((it.q_begin + local) * s.hq + head) * D + c;
#pragma unroll
      for (int f = 0; f < kFrags; ++f) dst[f * 16] = FromF<T>(o[f][i] * inv);
    } else {
      float* dst = s.partial_o + ((it.partial_row + local) * s.hq + head) * D + c;
#pragma unroll
      for (int f = 0; f < kFrags; ++f) dst[f * 16] = o[f][i] * inv;
    }
    if (c == 0) {
      const float mx = row_max[m];
      const float lse_v = l > 0.0f ? (mx + log2f(l)) * 0.6931471805599453f : -INFINITY;
      if (it.partial_row < 0) {
        if (lse != nullptr) lse[(it.q_begin + local) * s.hq + head] = lse_v;
      } else {
        s.partial_lse[(it.partial_row + local) * s.hq + head] = lse_v;
      }
    }
  }
}

// ---- generic path ----------------------------------------------------------------------------

constexpr int kGenericWarps = 8;
constexpr int kGenericMaxDim = 256;

// grid: (items, Hkv); block: 32 * kGenericWarps. Warp w handles vectors w, w + 8, ... of the item.
template <typename QT, typename KT>
__global__ void __launch_bounds__(32 * kGenericWarps)
    TreeAttentionGeneric(AttnStep s, const QT* __restrict__ q, const KT* __restrict__ k_pages,
                         const KT* __restrict__ v_pages, const KT* __restrict__ k_new,
                         const KT* __restrict__ v_new, QT* __restrict__ out,
                         float* __restrict__ lse) {
  constexpr int kPer = kGenericMaxDim / 32;
  const gpu_plan::Item it = s.items[blockIdx.x];
  const int64_t h = blockIdx.y;
  const int64_t b = it.request;
  const int64_t q_first = s.q_indptr[b];
  const int64_t prefix_len = s.prefix_lens[b];
  const bool is_tree = s.is_tree[b] != 0;
  const int64_t G = s.group, D = s.d;
  const int64_t vectors = (it.q_end - it.q_begin) * G;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int64_t chunk_keys = it.kv_end - it.kv_begin;
  const int64_t new_keys = it.with_new ? it.q_end - q_first : 0;

  for (int64_t m = warp; m < vectors; m += kGenericWarps) {
    const int64_t local = m / G, head = h * G + m % G;
    const int64_t i = it.q_begin + local - q_first;
    float qv[kPer], acc[kPer];
#pragma unroll
    for (int e = 0; e < kPer; ++e) {
      const int64_t d = lane + 32 * e;
      qv[e] = d < D ? ToF(q[((it.q_begin + local) * s.hq + head) * D + d]) * s.scale_log2 : 0.0f;
      acc[e] = 0.0f;
    }
    float mx = -INFINITY, l = 0.0f;
    const uint64_t* mask_row = is_tree ? s.masks + (q_first + i) * kAttnMaskWords : nullptr;
    for (int64_t j = 0; j < chunk_keys + new_keys; ++j) {
      int64_t key;
      if (j < chunk_keys) {
        key = it.kv_begin + j;
      } else {
        const int64_t t = j - chunk_keys;
        if (!gpu_plan::SeesNewToken<kAttnMaskWords>(is_tree, mask_row, i, t)) continue;
        key = prefix_len + t;
      }
      const KT* kr = KeyRow<KT>(s, k_pages, k_new, b, prefix_len, q_first, key, h);
      const KT* vr = KeyRow<KT>(s, v_pages, v_new, b, prefix_len, q_first, key, h);
      float dot = 0.0f;
#pragma unroll
      for (int e = 0; e < kPer; ++e) {
        const int64_t d = lane + 32 * e;
        if (d < D) dot += qv[e] * ToF(kr[d]);
      }
#pragma unroll
      for (int off = 16; off > 0; off >>= 1) dot += __shfl_xor_sync(0xffffffffu, dot, off);
      const float m_new = fmaxf(mx, dot);
      const float alpha = exp2f(mx - m_new);  // mx = -inf on the first key: alpha = 0
      const float p = exp2f(dot - m_new);
      l = l * alpha + p;
#pragma unroll
      for (int e = 0; e < kPer; ++e) {
        const int64_t d = lane + 32 * e;
        acc[e] = acc[e] * alpha + (d < D ? p * ToF(vr[d]) : 0.0f);
      }
      mx = m_new;
    }
    const float inv = l > 0.0f ? 1.0f / l : 0.0f;
    const float lse_v = l > 0.0f ? (mx + log2f(l)) * 0.6931471805599453f : -INFINITY;
#pragma unroll
    for (int e = 0; e < kPer; ++e) {
      const int64_t d = lane + 32 * e;
      if (d >= D) continue;
      if (it.partial_row < 0) {
        out[((it.q_begin + local) * s.hq + head) * D + d] = FromF<QT>(acc[e] * inv);
      } else {
        s.partial_o[((it.partial_row + local) * s.hq + head) * D + d] = acc[e] * inv;
      }
    }
    if (lane == 0) {
      if (it.partial_row < 0) {
        if (lse != nullptr) lse[(it.q_begin + local) * s.hq + head] = lse_v;
      } else {
        s.partial_lse[(it.partial_row + local) * s.hq + head] = lse_v;
      }
    }
  }
}

// ---- split-KV merge --------------------------------------------------------------------------

// grid: (merges, Hq); block: 128 threads over (row of the tile, head dim).
template <typename T>
__global__ void MergeSplits(const gpu_plan::Merge* __restrict__ merges, int64_t hq, int64_t d,
                            const float* __restrict__ partial_o,
                            const float* __restrict__ partial_lse, T* __restrict__ out,
                            float* __restrict__ lse) {
  const gpu_plan::Merge mg = merges[blockIdx.x];
  const int64_t head = blockIdx.y;
  const int64_t rows = mg.q_end - mg.q_begin;
  for (int64_t idx = threadIdx.x; idx < rows * d; idx += blockDim.x) {
    const int64_t r = idx / d, c = idx % d;
    float mx = -INFINITY;
    for (int64_t k = 0; k < mg.num_chunks; ++k) {
      mx = fmaxf(mx, partial_lse[(mg.partial_row + k * rows + r) * hq + head]);
    }
    float wsum = 0.0f, acc = 0.0f;
    if (mx != -INFINITY) {
      for (int64_t k = 0; k < mg.num_chunks; ++k) {
        const int64_t prow = mg.partial_row + k * rows + r;
        const float w = expf(partial_lse[prow * hq + head] - mx);
        wsum += w;
        acc += w * partial_o[(prow * hq + head) * d + c];
      }
    }
    const int64_t row = mg.q_begin + r;
    out[(row * hq + head) * d + c] = FromF<T>(wsum > 0.0f ? acc / wsum : 0.0f);
    if (c == 0 && lse != nullptr) lse[row * hq + head] = wsum > 0.0f ? mx + logf(wsum) : -INFINITY;
  }
}

}  // namespace kernels
}  // namespace pyspec
