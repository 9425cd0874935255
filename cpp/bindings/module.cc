#include <pybind11/pybind11.h>

#include "registry.h"

PYBIND11_MODULE(_C, m) {
  m.doc() = "pyspec core: token trees, paged KV, tree attention, acceptance sampling (C++17/CUDA)";
  pyspec::bindings::RegisterCore(m);
  pyspec::bindings::RegisterTree(m);
  pyspec::bindings::RegisterCuda(m);
  pyspec::bindings::RegisterBlockManager(m);
  pyspec::bindings::RegisterAttention(m);
  pyspec::bindings::RegisterAcceptance(m);
  pyspec::bindings::RegisterLinear(m);
  pyspec::bindings::RegisterScheduler(m);
  pyspec::bindings::RegisterSuffix(m);
}
