// Device dispatch for ops that exist on CPU and CUDA: the tensors' device picks the implementation.
#pragma once

#include "pyspec/check.h"
#include "pyspec/tensor_view.h"

namespace pyspec {
namespace bindings {

// Raises RuntimeError for a CUDA tensor in a build without CUDA.
[[noreturn]] void CudaNotBuilt(const char* op);

inline bool IsCuda(const TensorView& v) { return v.device.type == DeviceType::kCUDA; }

}  // namespace bindings
}  // namespace pyspec
