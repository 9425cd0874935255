#include <string>

#include "common.cuh"
#include "pyspec/cuda_ops.h"

namespace pyspec {
namespace cuda {

namespace {
// The first query's result. cudaGetDeviceCount with the static runtime does not need a driver to be
// linked: on a machine without one it returns cudaErrorInsufficientDriver / NoDevice.
cudaError_t QueryCount(int* count) {
  *count = 0;
  cudaError_t err = cudaGetDeviceCount(count);
  if (err != cudaSuccess) {
    *count = 0;
    (void)cudaGetLastError();  // clear the sticky-free error so later calls are unaffected
  }
  return err;
}
}  // namespace

int DeviceCount() {
  int count = 0;
  QueryCount(&count);
  return count;
}

std::string UnavailableReason() {
  int count = 0;
  cudaError_t err = QueryCount(&count);
  if (err == cudaErrorInsufficientDriver) {
    // What the runtime says on a machine without an NVIDIA GPU too, not only an old driver.
    return detail::StrCat(cudaGetErrorName(err), ": no NVIDIA driver is loaded, or it is older "
                          "than the CUDA runtime this build uses (",
                          cudaGetErrorString(err), "); a machine without an NVIDIA GPU says this");
  }
  if (err != cudaSuccess) {
    return detail::StrCat(cudaGetErrorName(err), ": ", cudaGetErrorString(err));
  }
  if (count == 0) return "no CUDA device found";
  return "";
}

void RequireDevice(const char* op) {
  std::string why = UnavailableReason();
  if (!why.empty()) {
    throw RuntimeError(detail::StrCat("pyspec: '", op, "' needs a CUDA device, but none is usable (",
                                      why, "). Use CPU tensors on this machine."));
  }
}

}  // namespace cuda
}  // namespace pyspec
