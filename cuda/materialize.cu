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
  // int32 or int64 each, as on the CPU.
  auto launch = [&](const auto* src_ptr, const auto* dst_ptr) {
    return kernels::LaunchMaterialize(scratch.data, pages.data, src_ptr, dst_ptr, s.n, s.layers,
                                      s.scratch_rows, s.slots, s.row_bytes, stream);
  };
  const bool src64 = src_rows.dtype == DType::kInt64, dst64 = dst_slots.dtype == DType::kInt64;
  cudaError_t err;
  if (src64) {
    err = dst64 ? launch(src_rows.ptr<const int64_t>(), dst_slots.ptr<const int64_t>())
                : launch(src_rows.ptr<const int64_t>(), dst_slots.ptr<const int32_t>());
  } else {
    err = dst64 ? launch(src_rows.ptr<const int32_t>(), dst_slots.ptr<const int64_t>())
                : launch(src_rows.ptr<const int32_t>(), dst_slots.ptr<const int32_t>());
  }
  PYSPEC_CUDA_CALL(err);
}

}  // namespace cuda
}  // namespace pyspec
