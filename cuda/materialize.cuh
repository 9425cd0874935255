// KV materialization kernel: copy the accepted tree nodes' rows from scratch into pages.
#pragma once

#include <cstdint>

#include <cuda_runtime.h>

namespace pyspec {
namespace kernels {

// One block per (row, layer). Rows are copied in VecT units (uint4 when the row and both bases are
// 16-byte aligned, else bytes). The two index arrays may differ in type (int32 / int64 each).
template <typename VecT, typename SrcT, typename DstT>
__global__ void MaterializeKernel(const char* __restrict__ scratch,  // [L, S, row_bytes]
                                  char* __restrict__ pages,           // [L, slots, row_bytes]
                                  const SrcT* __restrict__ src_rows,  // [n]
                                  const DstT* __restrict__ dst_slots, // [n]
                                  int64_t n, int64_t scratch_rows, int64_t slots,
                                  int64_t row_bytes) {
  const int64_t i = blockIdx.x;
  const int64_t layer = blockIdx.y;
  const int64_t vecs = row_bytes / static_cast<int64_t>(sizeof(VecT));
  const VecT* src = reinterpret_cast<const VecT*>(
      scratch + (layer * scratch_rows + static_cast<int64_t>(src_rows[i])) * row_bytes);
  VecT* dst = reinterpret_cast<VecT*>(
      pages + (layer * slots + static_cast<int64_t>(dst_slots[i])) * row_bytes);
  for (int64_t v = threadIdx.x; v < vecs; v += blockDim.x) dst[v] = src[v];
}

template <typename SrcT, typename DstT>
cudaError_t LaunchMaterialize(const void* scratch, void* pages, const SrcT* src_rows,
                              const DstT* dst_slots, int64_t n, int64_t layers,
                              int64_t scratch_rows, int64_t slots, int64_t row_bytes,
                              cudaStream_t stream) {
  if (n == 0 || layers == 0 || row_bytes == 0) return cudaSuccess;
  dim3 grid(static_cast<unsigned>(n), static_cast<unsigned>(layers));
  const bool aligned16 = row_bytes % 16 == 0 && reinterpret_cast<uintptr_t>(scratch) % 16 == 0 &&
                         reinterpret_cast<uintptr_t>(pages) % 16 == 0;
  const char* s = static_cast<const char*>(scratch);
  char* p = static_cast<char*>(pages);
  if (aligned16) {
    int threads = static_cast<int>(row_bytes / 16 < 256 ? (row_bytes / 16 + 31) / 32 * 32 : 256);
    MaterializeKernel<uint4, SrcT, DstT><<<grid, threads, 0, stream>>>(
        s, p, src_rows, dst_slots, n, scratch_rows, slots, row_bytes);
  } else {
    MaterializeKernel<unsigned char, SrcT, DstT><<<grid, 256, 0, stream>>>(
        s, p, src_rows, dst_slots, n, scratch_rows, slots, row_bytes);
  }
  return cudaGetLastError();
}

}  // namespace kernels
}  // namespace pyspec
