// Bound classes refuse instances whose C++ object was never constructed.
//
// `Cls.__new__(Cls)` makes an instance without running __init__. pybind11 hands such an instance
// to a method as freshly allocated, unconstructed storage: the method reads garbage or crashes the
// interpreter. pybind11 allocates that storage through the type's `operator_new` hook, which
// nothing else calls (py::init and returned values construct their objects themselves), so a hook
// that throws turns every use of an uninitialized instance (a method, a property, len/repr,
// passing it as an argument) into a TypeError.
#pragma once

#include <pybind11/pybind11.h>

#include <cstddef>
#include <string>
#include <typeinfo>

namespace pyspec {
namespace bindings {

template <typename T>
void* RefuseUninitializedNew(std::size_t) {
  const std::string name = pybind11::detail::get_type_info(typeid(T), true)->type->tp_name;
  throw pybind11::type_error(name + " object is not initialized: it was made by __new__ "
                             "without __init__");
}

// Call after registering py::class_<T>.
template <typename T>
void RefuseUninitialized() {
  pybind11::detail::get_type_info(typeid(T), /*throw_if_missing=*/true)->operator_new =
      &RefuseUninitializedNew<T>;
}

}  // namespace bindings
}  // namespace pyspec
