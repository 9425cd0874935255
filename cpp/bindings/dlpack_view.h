// Zero-copy conversion of Python tensors (torch, numpy: anything with __dlpack__) to TensorView.
#pragma once

#include <pybind11/pybind11.h>

#include "pyspec/tensor_view.h"

namespace pyspec {
namespace bindings {

// Reads the tensor's DLPack description without copying data. The caller must keep `obj` alive while
// the view is used (Python arguments are alive for the whole call). `name` is used in errors.
TensorView ToView(pybind11::handle obj, const char* name);

}  // namespace bindings
}  // namespace pyspec
