#include <vector>

#include "common.cuh"
#include "materialize.cuh"
#include "pyspec/cuda_ops.h"
#include "pyspec/kv_ops.h"

namespace pyspec {
namespace cuda {

namespace {
std::vector<int64_t> CopyIndicesToHost(const TensorView& t, cudaStream_t stream) {
  if (t.dtype == DType::kInt64) {
    std::vector<int64_t> out = ToHost<int64_t>(t, stream);
    PYSPEC_CUDA_CALL(cudaStreamSynchronize(stream));
    return out;
  }
  const std::vector<int32_t> narrow = ToHost<int32_t>(t, stream);
  PYSPEC_CUDA_CALL(cudaStreamSynchronize(stream));
  return std::vector<int64_t>(narrow.begin(), narrow.end());
}
}  // namespace

void MaterializeKV(const TensorView& scratch, const TensorView& pages, const TensorView& src_rows,
                   const TensorView& dst_slots, void* stream_ptr) {
  CheckDevice(scratch, "scratch", DeviceType::kCUDA);
  const auto s = detail::CheckMaterializeArgs(scratch, pages, src_rows, dst_slots);
  RequireDevice("materialize_kv");
  DeviceGuard guard(scratch.device.index);
  cudaStream_t stream = static_cast<cudaStream_t>(stream_ptr);
  const auto src = CopyIndicesToHost(src_rows, stream);
  const auto dst = CopyIndicesToHost(dst_slots, stream);
  for (int64_t i = 0; i < s.n; ++i) {
    PYSPEC_CHECK(src[i] >= 0 && src[i] < s.scratch_rows, "src_rows[", i, "] = ", src[i],
                 " is out of range [0, ", s.scratch_rows, ")");
    PYSPEC_CHECK(dst[i] >= 0 && dst[i] < s.slots, "dst_slots[", i, "] = ", dst[i],
                 " is out of range [0, ", s.slots, ") (num_blocks * block_size)");
  }
  if (s.n == 0) return;
  cudaError_t err;
  if (src_rows.dtype != dst_slots.dtype) {
    // Mixed int32/int64 indices (allowed, as on the CPU): launch on int64 copies of the indices
    // checked above. The pageable source is staged before cudaMemcpyAsync returns.
    std::vector<int64_t> both(src);
    both.insert(both.end(), dst.begin(), dst.end());
    int64_t* dev = nullptr;
    const size_t bytes = sizeof(int64_t) * both.size();
    PYSPEC_CUDA_CALL(cudaMallocAsync(reinterpret_cast<void**>(&dev), bytes, stream));
    err = cudaMemcpyAsync(dev, both.data(), bytes, cudaMemcpyHostToDevice, stream);
    if (err == cudaSuccess) {
      err = kernels::LaunchMaterialize<int64_t>(scratch.data, pages.data, dev, dev + s.n, s.n,
                                                s.layers, s.scratch_rows, s.slots, s.row_bytes,
                                                stream);
    }
    const cudaError_t freed = cudaFreeAsync(dev, stream);
    PYSPEC_CUDA_CALL(err);
    PYSPEC_CUDA_CALL(freed);
    return;
  }
  if (src_rows.dtype == DType::kInt64) {
    err = kernels::LaunchMaterialize<int64_t>(scratch.data, pages.data, src_rows.ptr<int64_t>(),
                                              dst_slots.ptr<int64_t>(), s.n, s.layers, s.scratch_rows,
                                              s.slots, s.row_bytes, stream);
  } else {
    err = kernels::LaunchMaterialize<int32_t>(scratch.data, pages.data, src_rows.ptr<int32_t>(),
                                              dst_slots.ptr<int32_t>(), s.n, s.layers, s.scratch_rows,
                                              s.slots, s.row_bytes, stream);
  }
  PYSPEC_CUDA_CALL(err);
}

}  // namespace cuda
}  // namespace pyspec
