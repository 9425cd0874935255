// Sampling filters and tree acceptance on CUDA: one thread block per row / request runs the shared
// logic of accept_logic.h with block-wide row operations (reductions, ordered scans, shared-memory
// histograms). Sums are deterministic: fixed per-thread segments or strides, warp trees and a
// fixed-order final sum, so a result never depends on timing.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "accept_logic.h"
#include "dtype.cuh"

namespace pyspec {
namespace kernels {

// Shared memory of BlockRowOps.
template <int kThreads>
struct RowShared {
  static constexpr int kWarps = kThreads / 32;
  double warp_d[kWarps];
  long long warp_i[kWarps];
  float warp_f[kWarps];
  double res_d;
  long long res_i;
  float res_f;
  unsigned long long res_u;
  unsigned int counts[256];
  double masses[256];
  unsigned long long mass_fx[256];  // Histogram's fixed-point masses (2^-40 units)
};

template <int kThreads>
struct BlockRowOps {
  static constexpr int kWarps = kThreads / 32;
  RowShared<kThreads>& sh;

  __device__ static double WarpSum(double x) {
#pragma unroll
    for (int off = 16; off > 0; off >>= 1) x += __shfl_xor_sync(0xffffffffu, x, off);
    return x;
  }
  __device__ static long long WarpSumI(long long x) {
#pragma unroll
    for (int off = 16; off > 0; off >>= 1) x += __shfl_xor_sync(0xffffffffu, x, off);
    return x;
  }

  // Block sum; every thread gets the result.
  __device__ double BlockSum(double x) {
    x = WarpSum(x);
    if (threadIdx.x % 32 == 0) sh.warp_d[threadIdx.x / 32] = x;
    __syncthreads();
    if (threadIdx.x == 0) {
      double t = 0.0;
      for (int w = 0; w < kWarps; ++w) t += sh.warp_d[w];
      sh.res_d = t;
    }
    __syncthreads();
    return sh.res_d;
  }
  __device__ long long BlockSumI(long long x) {
    x = WarpSumI(x);
    if (threadIdx.x % 32 == 0) sh.warp_i[threadIdx.x / 32] = x;
    __syncthreads();
    if (threadIdx.x == 0) {
      long long t = 0;
      for (int w = 0; w < kWarps; ++w) t += sh.warp_i[w];
      sh.res_i = t;
    }
    __syncthreads();
    return sh.res_i;
  }
  // Exclusive prefix sum over threads (in thread order) and the total.
  template <typename T>
  __device__ T BlockExclusiveScan(T x, T* total, T* warp_vals) {
    const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
    T incl = x;
#pragma unroll
    for (int off = 1; off < 32; off <<= 1) {
      const T y = __shfl_up_sync(0xffffffffu, incl, off);
      if (lane >= off) incl += y;
    }
    if (lane == 31) warp_vals[warp] = incl;
    __syncthreads();
    T before = 0, all = 0;
    for (int w = 0; w < kWarps; ++w) {
      if (w < warp) before += warp_vals[w];
      all += warp_vals[w];
    }
    __syncthreads();
    *total = all;
    return before + incl - x;
  }

  template <class F>
  __device__ double SumD(int64_t n, F f) {
    double a = 0.0;
    for (int64_t v = threadIdx.x; v < n; v += kThreads) a += f(v);
    return BlockSum(a);
  }
  template <class F>
  __device__ int64_t CountIf(int64_t n, F f) {
    long long c = 0;
    for (int64_t v = threadIdx.x; v < n; v += kThreads) c += f(v) ? 1 : 0;
    return BlockSumI(c);
  }
  template <class F>
  __device__ bool AnyOf(int64_t n, F f) {
    return CountIf(n, f) > 0;
  }
  template <class F>
  __device__ void ArgMaxFirst(int64_t n, F f, float* best, int64_t* idx) {
    float b = -INFINITY;
    long long i = LLONG_MAX;
    for (int64_t v = threadIdx.x; v < n; v += kThreads) {
      const float x = f(v);
      if (x > b || (x == b && v < i)) {
        b = x;
        i = v;
      }
    }
#pragma unroll
    for (int off = 16; off > 0; off >>= 1) {
      const float ob = __shfl_xor_sync(0xffffffffu, b, off);
      const long long oi = __shfl_xor_sync(0xffffffffu, i, off);
      if (ob > b || (ob == b && oi < i)) {
        b = ob;
        i = oi;
      }
    }
    if (threadIdx.x % 32 == 0) {
      sh.warp_f[threadIdx.x / 32] = b;
      sh.warp_i[threadIdx.x / 32] = i;
    }
    __syncthreads();
    if (threadIdx.x == 0) {
      float bb = sh.warp_f[0];
      long long bi = sh.warp_i[0];
      for (int w = 1; w < kWarps; ++w) {
        if (sh.warp_f[w] > bb || (sh.warp_f[w] == bb && sh.warp_i[w] < bi)) {
          bb = sh.warp_f[w];
          bi = sh.warp_i[w];
        }
      }
      sh.res_f = bb;
      sh.res_i = bi;
    }
    __syncthreads();
    *best = sh.res_f;
    *idx = sh.res_i;
    __syncthreads();
  }
  // Barriers on both sides: every thread has finished reading what f overwrites, and sees all
  // writes after.
  template <class F>
  __device__ void ForEach(int64_t n, F f) {
    __syncthreads();
    for (int64_t v = threadIdx.x; v < n; v += kThreads) f(v);
    __syncthreads();
  }
  // Thread t owns the contiguous segment [t * seg, (t + 1) * seg): ordered operations scan
  // segments in thread order.
  __device__ static void Segment(int64_t n, int64_t* begin, int64_t* end) {
    const int64_t seg = (n + kThreads - 1) / kThreads;
    *begin = threadIdx.x * seg < n ? threadIdx.x * seg : n;
    *end = *begin + seg < n ? *begin + seg : n;
  }
  template <class F>
  __device__ int64_t NthTrue(int64_t n, F pred, int64_t k) {
    if (k < 0) return -1;
    __syncthreads();  // the previous op's readers of the result slots are done
    int64_t begin, end;
    Segment(n, &begin, &end);
    long long c = 0;
    for (int64_t v = begin; v < end; ++v) c += pred(v) ? 1 : 0;
    if (threadIdx.x == 0) sh.res_u = ~0ull;
    long long total;
    const long long before = BlockExclusiveScan<long long>(c, &total, sh.warp_i);
    if (before <= k && k < before + c) {
      long long left = k - before;
      for (int64_t v = begin; v < end; ++v) {
        if (pred(v) && left-- == 0) {
          sh.res_u = static_cast<unsigned long long>(v);
          break;
        }
      }
    }
    __syncthreads();
    const unsigned long long r = sh.res_u;
    __syncthreads();
    return r == ~0ull ? -1 : static_cast<int64_t>(r);
  }
  template <class W>
  __device__ int64_t SampleCdf(int64_t n, W w, double target) {
    __syncthreads();  // the previous op's readers of the result slots are done
    int64_t begin, end;
    Segment(n, &begin, &end);
    double s = 0.0;
    long long last = -1;
    for (int64_t v = begin; v < end; ++v) {
      const double x = w(v);
      if (x > 0.0) {
        s += x;
        last = v;
      }
    }
    if (threadIdx.x == 0) {
      sh.res_u = ~0ull;
      sh.res_i = -1;
    }
    double total;
    const double before = BlockExclusiveScan<double>(s, &total, sh.warp_d);
    if (before + s > target) {
      double cum = before;
      for (int64_t v = begin; v < end; ++v) {
        const double x = w(v);
        if (x > 0.0) {
          cum += x;
          if (cum > target) {
            atomicMin(&sh.res_u, static_cast<unsigned long long>(v));
            break;
          }
        }
      }
    }
    if (last >= 0) atomicMax(&sh.res_i, last);
    __syncthreads();
    const unsigned long long hit = sh.res_u;
    const long long fallback = sh.res_i;
    __syncthreads();
    return hit != ~0ull ? static_cast<int64_t>(hit) : static_cast<int64_t>(fallback);
  }
  // Masses are summed in 2^-40 fixed point: integer atomics are associative, so the result does
  // not depend on the order threads arrive in (double atomics would).
  template <class Digit, class Mass>
  __device__ void Histogram(int64_t n, Digit digit, Mass mass, uint32_t* counts, double* masses) {
    constexpr double kScale = 1099511627776.0;  // 2^40
    __syncthreads();  // earlier readers of counts/masses are done
    for (int i = threadIdx.x; i < 256; i += kThreads) {
      counts[i] = 0;
      sh.mass_fx[i] = 0;
    }
    __syncthreads();
    for (int64_t v = threadIdx.x; v < n; v += kThreads) {
      const int d = digit(v);
      if (d >= 0) {
        atomicAdd(&counts[d], 1u);
        const double m = mass(v);
        const double c = m > 0.0 ? (m < 1.0 ? m : 1.0) : 0.0;
        atomicAdd(&sh.mass_fx[d], static_cast<unsigned long long>(c * kScale + 0.5));
      }
    }
    __syncthreads();
    for (int i = threadIdx.x; i < 256; i += kThreads) {
      masses[i] = static_cast<double>(sh.mass_fx[i]) / kScale;
    }
    __syncthreads();
  }
  __device__ bool Leader() const { return threadIdx.x == 0; }
};

constexpr int kFilterThreads = 512;
constexpr int kAcceptThreads = 512;

// grid: rows; block: kFilterThreads. status[2 * r] = FilterStatus, status[2 * r + 1] = bad token.
template <typename T>
__global__ void __launch_bounds__(kFilterThreads)
    FilterKernel(const T* __restrict__ logits, int64_t vocab, const float* __restrict__ temperature,
                 const int32_t* __restrict__ top_k, const float* __restrict__ top_p,
                 const float* __restrict__ min_p, float* __restrict__ probs,
                 long long* __restrict__ status) {
  __shared__ RowShared<kFilterThreads> sh;
  BlockRowOps<kFilterThreads> ops{sh};
  const int64_t r = blockIdx.x;
  const T* row = logits + r * vocab;
  float* out = probs + r * vocab;
  int64_t bad = -1;
  const int st = accept_logic::FilterRow(
      ops, vocab, [&](int64_t v) { return ToF<T>(row[v]); }, temperature[r], top_k[r],
      top_p[r], min_p[r], out, out, sh.counts, sh.masses, &bad);
  if (threadIdx.x == 0) {
    status[2 * r] = st;
    status[2 * r + 1] = bad;
  }
}

// Per-request device arguments of AcceptKernel.
struct AcceptArgs {
  accept_logic::WalkInputs in;
  const uint8_t* greedy;           // [B]
  const uint8_t* sampled;          // [B]
  const int64_t* seeds;            // [B]
  const int64_t* offsets;          // [B]
  const int32_t* scratch_slot;     // [B]: row of the double scratch, -1 = none needed
  double* scratch;                 // [slots, 2, V]
  int32_t* accepted_nodes;         // [B, W]
  int32_t* emitted_tokens;         // [B, W]
  int32_t* num_accepted;           // [B]
  accept_logic::WalkError* errors; // [B]
  int64_t width;
};

// grid: requests; block: kAcceptThreads.
__global__ void __launch_bounds__(kAcceptThreads) AcceptKernel(AcceptArgs a) {
  __shared__ RowShared<kAcceptThreads> sh;
  BlockRowOps<kAcceptThreads> ops{sh};
  const int64_t b = blockIdx.x;
  int32_t* path = a.accepted_nodes + b * a.width;
  int32_t* emitted = a.emitted_tokens + b * a.width;
  ops.ForEach(a.width, [&](int64_t i) {
    path[i] = -1;
    emitted[i] = -1;
  });
  const int32_t slot = a.scratch_slot[b];
  const int64_t V = a.in.vocab;
  double* resid = slot >= 0 ? a.scratch + static_cast<int64_t>(slot) * 2 * V : nullptr;
  double* qcur = resid != nullptr ? resid + V : nullptr;
  int32_t len = 0;
  accept_logic::WalkError err{0, 0, 0, 0, 0, 0.0, 0};
  const int st = accept_logic::WalkRequest(
      ops, a.in, b, a.greedy[b] != 0, a.sampled[b] != 0 && a.greedy[b] == 0,
      static_cast<uint64_t>(a.seeds[b]), static_cast<uint64_t>(a.offsets[b]), resid, qcur,
      path, emitted, &len, &err);
  if (threadIdx.x == 0) {
    if (st == accept_logic::kWalkOk) {
      a.num_accepted[b] = len - 1;
      err.status = 0;
    } else {
      a.num_accepted[b] = -1;
    }
    a.errors[b] = err;
  }
}

}  // namespace kernels
}  // namespace pyspec
