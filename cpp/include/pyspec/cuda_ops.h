// Host entry points of the CUDA sub-target (pyspec::cuda). Declared here without CUDA types so C++
// embedders can call them from plain C++; link pyspec::cuda (present when pyspec was built with
// CUDA; the CMake variable PYSPEC_WITH_CUDA says so).
//
// Every op validates its arguments (ValueError) and raises pyspec::RuntimeError with a clear message
// when no CUDA device is usable (no driver, no GPU).
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>

#include "pyspec/acceptance.h"
#include "pyspec/attention.h"
#include "pyspec/tensor_view.h"

namespace pyspec {
namespace cuda {

// Number of usable CUDA devices; 0 when there is no driver or no GPU. Never throws.
int DeviceCount();
// Why DeviceCount() is 0 ("" when a device is usable).
std::string UnavailableReason();
// Throws RuntimeError naming `op` when no CUDA device is usable.
void RequireDevice(const char* op);

// Same contract as pyspec::MaterializeKV, for CUDA tensors. `stream` is a cudaStream_t (nullptr:
// the legacy default stream). Index arrays are validated on the host (one small device->host copy).
void MaterializeKV(const TensorView& scratch, const TensorView& pages, const TensorView& src_rows,
                   const TensorView& dst_slots, void* stream);

// ---- acceptance sampling ----------------------------------------------------------------------

// Same contracts, validation and errors as pyspec::ApplySamplingFilters / pyspec::AcceptTrees, for
// CUDA tensors (one device). The small parameter / tree tensors are copied to the host for
// validation; the call returns after the kernel has finished (its status is checked).
// Filters: no full sort of the vocabulary (radix selection for the top-k value and the top-p
// boundary); greedy rows and the weights are bit-identical to the CPU's, kept sets and
// probabilities equal up to float rounding of the sums. Acceptance: same algorithm and Philox
// draws as the CPU walk; greedy results are identical, stochastic ones identical except when a
// draw lands within rounding of a decision boundary.
void ApplySamplingFilters(const TensorView& logits, const TensorView& temperature,
                          const TensorView& top_k, const TensorView& top_p,
                          const TensorView& min_p, const TensorView& probs, void* stream);
void AcceptTrees(const AcceptTreesArgs& args, void* stream);

// ---- tree attention ---------------------------------------------------------------------------

// One step's attention metadata on a GPU: built once per step from the CPU plan (it copies the
// plan, lays out the GPU work partition for the head layout, uploads both and allocates the
// split-KV partial buffers), then used by every layer's RunAttention. Device memory is allocated
// and released stream-ordered on `stream` (a cudaStream_t; nullptr = the legacy default stream),
// which must outlive the plan. Not copyable; safe to use from several threads on one stream.
class DeviceAttentionPlan {
 public:
  DeviceAttentionPlan(const AttentionPlan& plan, int device, int64_t num_q_heads,
                      int64_t num_kv_heads, int64_t head_dim, void* stream);
  ~DeviceAttentionPlan();
  DeviceAttentionPlan(const DeviceAttentionPlan&) = delete;
  DeviceAttentionPlan& operator=(const DeviceAttentionPlan&) = delete;

  int device() const;
  int64_t num_q_heads() const;
  int64_t num_kv_heads() const;
  int64_t head_dim() const;
  int64_t num_work_items() const;   // CUDA blocks per KV head
  int64_t num_split_tiles() const;  // query tiles whose prefix is split (merged by log-sum-exp)
  int64_t kv_chunk() const;         // keys per split chunk (0: nothing split)
  // True when tensors of these dtypes take the tensor-core kernel (bf16/fp16, head_dim 64/128).
  bool UsesTensorCores(DType q_dtype, DType kv_dtype) const;

  struct Impl;

 private:
  friend void RunAttention(const DeviceAttentionPlan&, const TensorView&, const TensorView&,
                           const TensorView&, const TensorView&, const TensorView&,
                           const TensorView&, const TensorView*, float, void*, bool);
  std::unique_ptr<Impl> impl_;
  size_t merges_offset_ = 0;
};

// Same contract as pyspec::RunAttention for CUDA tensors on the plan's device (shapes, dtypes and
// errors identical; fp32 accumulation). bf16/fp16 with head_dim 64 or 128 run on tensor cores;
// other dtypes and head dims up to 256 on a generic kernel. `stream` must be the stream the plan
// was built on (ValueError otherwise): its buffers are ordered on that stream. `pipelined`: the
// tensor-core kernel with two cp.async K/V stages (warps holding no query skip the math) instead
// of the default one synchronously loaded stage; the same results bit for bit.
void RunAttention(const DeviceAttentionPlan& plan, const TensorView& q, const TensorView& k_pages,
                  const TensorView& v_pages, const TensorView& k_new, const TensorView& v_new,
                  const TensorView& out, const TensorView* lse, float scale, void* stream,
                  bool pipelined = false);

}  // namespace cuda
}  // namespace pyspec
