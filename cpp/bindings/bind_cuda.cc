#include <pybind11/pybind11.h>

#include <cstdint>
#include <string>

#include "dispatch.h"
#include "pyspec/check.h"
#include "registry.h"
#ifdef PYSPEC_WITH_CUDA
#include "pyspec/cuda_ops.h"
#endif

namespace py = pybind11;

namespace pyspec {
namespace bindings {

void CudaNotBuilt(const char* op) {
  throw RuntimeError(detail::StrCat("pyspec: '", op, "' got CUDA tensors, but this build of pyspec ",
                                    "has no CUDA support (built with PYSPEC_ENABLE_CUDA=OFF or ",
                                    "without nvcc)"));
}

void RegisterCuda(py::module_& m) {
#ifdef PYSPEC_WITH_CUDA
  m.attr("built_with_cuda") = true;
  m.def("cuda_device_count", &cuda::DeviceCount, "Usable CUDA devices (0 without a driver/GPU).");
  m.def("cuda_unavailable_reason", &cuda::UnavailableReason,
        "Why no CUDA device is usable ('' when one is).");
  m.def("cuda_require_device", &cuda::RequireDevice, py::arg("op"),
        "Raise RuntimeError naming `op` when no CUDA device is usable.");
#else
  m.attr("built_with_cuda") = false;
  m.def("cuda_device_count", [] { return 0; }, "Usable CUDA devices (always 0: built without CUDA).");
  m.def("cuda_unavailable_reason", [] { return std::string("pyspec was built without CUDA"); });
  m.def("cuda_require_device", [](const std::string& op) { CudaNotBuilt(op.c_str()); },
        py::arg("op"), "Always raises RuntimeError: this build has no CUDA support.");
#endif
}

}  // namespace bindings
}  // namespace pyspec
