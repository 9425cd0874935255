// Host entry points of the CUDA sub-target (pyspec::cuda). Declared here without CUDA types so C++
// embedders can call them from plain C++; link pyspec::cuda (present when pyspec was built with
// CUDA; the CMake variable PYSPEC_WITH_CUDA says so).
//
// Every op validates its arguments (ValueError) and raises pyspec::RuntimeError with a clear message
// when no CUDA device is usable (no driver, no GPU).
#pragma once

#include <string>

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

}  // namespace cuda
}  // namespace pyspec
