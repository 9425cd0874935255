// Zero-copy conversion of Python tensors (torch, numpy: anything with __dlpack__) to TensorView.
#pragma once

#include <pybind11/pybind11.h>

#include <cstdint>
#include <initializer_list>
#include <optional>
#include <string>
#include <utility>

#include "pyspec/tensor_view.h"

namespace pyspec {
namespace bindings {

// The name of obj's type, for error messages ("float", "Tensor").
inline std::string TypeName(pybind11::handle obj) {
  return std::string(pybind11::str(pybind11::type::of(obj).attr("__name__")));
}

// Reads the tensor's DLPack description without copying data. The caller must keep `obj` alive while
// the view is used (Python arguments are alive for the whole call). `name` is used in errors.
// A torch tensor with its negative bit set (a lazy negation DLPack drops) is refused.
TensorView ToView(pybind11::handle obj, const char* name);

// ToView for an optional tensor argument: empty for None.
std::optional<TensorView> OptionalView(pybind11::handle obj, const char* name);

// The view of an optional argument, or nullptr (what the ops and CheckNoOverlap take).
inline const TensorView* ViewPtr(const std::optional<TensorView>& v) { return v ? &*v : nullptr; }

// The bytes a view can touch, [lo, hi) (empty for a view without elements).
std::pair<uintptr_t, uintptr_t> ByteSpan(const TensorView& v);

// For ops that write outputs while still reading inputs (with the GIL released): ValueError when
// an output shares memory with an input or with another output. Null views (optional arguments
// left out) are skipped.
void CheckNoOverlap(std::initializer_list<std::pair<const TensorView*, const char*>> outs,
                    std::initializer_list<std::pair<const TensorView*, const char*>> ins);

}  // namespace bindings
}  // namespace pyspec
