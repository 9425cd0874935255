// Integer arguments read by hand, so that a bad one gets a ValueError naming it (pybind11's own
// int caster answers a float with its whole signature dump and truncates float-like objects).
#pragma once

#include <pybind11/pybind11.h>

#include <cstdint>
#include <limits>
#include <string>
#include <vector>

#include "dlpack_view.h"
#include "pyspec/check.h"
#include "pyspec/tensor_view.h"

namespace pyspec {
namespace bindings {

// `obj` as an integer: a Python int or anything with __index__ (numpy, torch integer scalars);
// not a bool or a float. False when it is not an int; *overflow when it does not fit in int64.
inline bool AsInt64(pybind11::handle obj, int64_t* value, bool* overflow) {
  PyObject* index =
      pybind11::isinstance<pybind11::bool_>(obj) ? nullptr : PyNumber_Index(obj.ptr());
  if (index == nullptr) {
    PyErr_Clear();
    return false;
  }
  int over = 0;
  const long long v = PyLong_AsLongLongAndOverflow(index, &over);
  Py_DECREF(index);
  if (PyErr_Occurred()) PyErr_Clear();
  *value = static_cast<int64_t>(v);
  *overflow = over != 0;
  return true;
}

// An int argument (int64). `allowed` completes "must be ..." in the error.
inline int64_t IntArg(pybind11::handle obj, const char* name, const char* allowed = "an int") {
  int64_t v = 0;
  bool overflow = false;
  if (!AsInt64(obj, &v, &overflow)) {
    throw ValueError(detail::StrCat("'", name, "' must be ", allowed, "; got ", TypeName(obj)));
  }
  PYSPEC_CHECK(!overflow, "'", name, "' = ", std::string(pybind11::str(obj)),
               " does not fit in int64");
  return v;
}

// Token ids from a list/tuple of ints or a 1-D int32/int64 CPU tensor (copied).
inline std::vector<int32_t> TokensArg(pybind11::handle obj, const char* name) {
  namespace py = pybind11;
  std::vector<int32_t> out;
  if (py::hasattr(obj, "__dlpack__")) {
    TensorView v = ToView(obj, name);
    CheckDevice(v, name, DeviceType::kCPU);
    CheckDType(v, name, {DType::kInt32, DType::kInt64});
    PYSPEC_CHECK(v.ndim == 1, "'", name, "' must be 1-D; got shape ", v.ShapeString());
    out.resize(static_cast<size_t>(v.shape[0]));
    for (int64_t i = 0; i < v.shape[0]; ++i) {
      int64_t t = v.dtype == DType::kInt32 ? v.ptr<int32_t>()[i * v.strides[0]]
                                           : v.ptr<int64_t>()[i * v.strides[0]];
      PYSPEC_CHECK(t >= std::numeric_limits<int32_t>::min() &&
                       t <= std::numeric_limits<int32_t>::max(),
                   "'", name, "'[", i, "] = ", t, " does not fit in int32");
      out[i] = static_cast<int32_t>(t);
    }
    return out;
  }
  PYSPEC_CHECK(py::isinstance<py::sequence>(obj) && !py::isinstance<py::str>(obj), "'", name,
               "' must be a list of ints or a 1-D int32/int64 tensor; got ", TypeName(obj));
  py::sequence seq = py::reinterpret_borrow<py::sequence>(obj);
  out.reserve(seq.size());
  for (size_t i = 0; i < seq.size(); ++i) {
    py::object item = seq[i];
    int64_t t = 0;
    bool overflow = false;
    if (!AsInt64(item, &t, &overflow)) {
      throw ValueError(
          detail::StrCat("'", name, "'[", i, "] must be an int; got ", TypeName(item)));
    }
    PYSPEC_CHECK(!overflow && t >= std::numeric_limits<int32_t>::min() &&
                     t <= std::numeric_limits<int32_t>::max(),
                 "'", name, "'[", i, "] = ", std::string(py::str(item)), " does not fit in int32");
    out.push_back(static_cast<int32_t>(t));
  }
  return out;
}

}  // namespace bindings
}  // namespace pyspec
