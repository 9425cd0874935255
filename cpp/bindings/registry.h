// One register function per bound unit; module.cc only calls them.
#pragma once

#include <pybind11/pybind11.h>

namespace pyspec {
namespace bindings {

void RegisterCore(pybind11::module_& m);
void RegisterTree(pybind11::module_& m);
void RegisterCuda(pybind11::module_& m);
void RegisterBlockManager(pybind11::module_& m);
void RegisterAttention(pybind11::module_& m);
void RegisterAcceptance(pybind11::module_& m);
void RegisterLinear(pybind11::module_& m);
void RegisterScheduler(pybind11::module_& m);
void RegisterSuffix(pybind11::module_& m);

}  // namespace bindings
}  // namespace pyspec
