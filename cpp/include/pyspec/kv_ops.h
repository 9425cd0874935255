// KV-cache data movement on the CPU (DESIGN section 2, "lazy materialization").
#pragma once

#include "pyspec/tensor_view.h"

namespace pyspec {

class ThreadPool;

// Copies the accepted tree nodes' K or V rows from the per-step scratch area into the paged pool:
//   pages.flat_slot(dst_slots[i]) = scratch[src_rows[i]]   for every i (and every layer).
// Shapes (one layer or a stack of L layers):
//   scratch   [S, kv_heads, head_dim]             or [L, S, kv_heads, head_dim]
//   pages     [num_blocks, block_size, kv_heads, head_dim]  or [L, num_blocks, block_size, ...]
//   src_rows  [n] int32/int64, each in [0, S)
//   dst_slots [n] int32/int64, slot = block_id * block_size + offset, each in [0, num_blocks*block_size)
// scratch and pages share a dtype (float32/float16/bfloat16) and must be contiguous.
// Throws ValueError on any mismatch or out-of-range index. `pool`: worker threads (null: the default).
void MaterializeKV(const TensorView& scratch, const TensorView& pages, const TensorView& src_rows,
                   const TensorView& dst_slots, ThreadPool* pool = nullptr);

namespace detail {
// Shared argument validation of the CPU and CUDA materialize ops. Returns the number of layers L
// (1 for the 3-D/4-D form), rows per layer S, slots per layer and bytes per row.
struct MaterializeShape {
  int64_t layers, scratch_rows, slots, row_bytes, n;
};
MaterializeShape CheckMaterializeArgs(const TensorView& scratch, const TensorView& pages,
                                      const TensorView& src_rows, const TensorView& dst_slots);
}  // namespace detail

}  // namespace pyspec
