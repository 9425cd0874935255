// Shared helpers of the CUDA sub-target. Kernel templates (*.cuh) take raw pointers and a stream and
// return cudaError_t; host ops (*.cu) validate and dispatch (DESIGN section 4).
#pragma once

#include <cuda_runtime.h>

#include <vector>

#include "pyspec/check.h"
#include "pyspec/tensor_view.h"

// Wraps a CUDA runtime call; a failure becomes pyspec::RuntimeError naming the call and the error.
#define PYSPEC_CUDA_CALL(expr)                                                                \
  do {                                                                                        \
    cudaError_t pyspec_err_ = (expr);                                                         \
    if (pyspec_err_ != cudaSuccess) {                                                         \
      throw ::pyspec::RuntimeError(::pyspec::detail::StrCat(                                  \
          "CUDA error in ", #expr, " (", __FILE__, ":", __LINE__, "): ",                      \
          cudaGetErrorName(pyspec_err_), ": ", cudaGetErrorString(pyspec_err_)));             \
    }                                                                                         \
  } while (0)

namespace pyspec {
namespace cuda {

// Makes `device` current for a scope and restores the caller's device after, so an op on cuda:1
// never leaves the calling thread (and torch) on the wrong GPU.
class DeviceGuard {
 public:
  explicit DeviceGuard(int device) {
    PYSPEC_CUDA_CALL(cudaGetDevice(&previous_));
    if (device != previous_) PYSPEC_CUDA_CALL(cudaSetDevice(device));
  }
  ~DeviceGuard() { cudaSetDevice(previous_); }
  DeviceGuard(const DeviceGuard&) = delete;
  DeviceGuard& operator=(const DeviceGuard&) = delete;

 private:
  int previous_ = 0;
};

// Enqueues a copy of a small contiguous device tensor of element type T into a host vector on
// `stream`; the caller synchronizes the stream before reading it.
template <typename T>
std::vector<T> ToHost(const TensorView& t, cudaStream_t stream) {
  std::vector<T> out(static_cast<size_t>(t.numel()));
  if (!out.empty()) {
    PYSPEC_CUDA_CALL(cudaMemcpyAsync(out.data(), t.data, out.size() * sizeof(T),
                                     cudaMemcpyDeviceToHost, stream));
  }
  return out;
}

}  // namespace cuda
}  // namespace pyspec
