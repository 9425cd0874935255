#include <pybind11/pybind11.h>

#include <cstdint>
#include <string>

#include "dispatch.h"
#include "dlpack_view.h"
#ifdef PYSPEC_WITH_CUDA
#include "pyspec/cuda_ops.h"
#endif
#include "pyspec/kv_ops.h"
#include "pyspec/thread_pool.h"
#include "pyspec/version.h"
#include "registry.h"

namespace py = pybind11;

namespace pyspec {
namespace bindings {

void RegisterCore(py::module_& m) {
  m.attr("__version__") = Version();
  m.def("num_threads", [] { return ThreadPool::Default().num_threads(); },
        "Worker threads of the CPU ops (set PYSPEC_NUM_THREADS before import to change).");
  m.def("spin_us", [] { return ThreadPool::Default().spin_us(); },
        "How long (microseconds) an idle worker of the CPU ops polls for the next job before "
        "sleeping (PYSPEC_SPIN_US in the environment at import; default 500).");
  m.def(
      "set_spin_us",
      [](int us) {
        if (us < 0 || us > 100000) {
          throw py::value_error("set_spin_us: us must be in [0, 100000] microseconds; got " +
                                std::to_string(us));
        }
        return ThreadPool::Default().set_spin_us(us);
      },
      py::arg("us"),
      "Set the CPU ops' polling window in microseconds (0: idle workers sleep at once); returns "
      "the previous value.");
  m.def(
      "materialize_kv",
      [](py::handle scratch, py::handle pages, py::handle src_rows, py::handle dst_slots,
         std::uintptr_t stream) {
        TensorView s = ToView(scratch, "scratch"), p = ToView(pages, "pages");
        TensorView r = ToView(src_rows, "src_rows"), d = ToView(dst_slots, "dst_slots");
        py::gil_scoped_release release;
        if (IsCuda(s)) {
#ifdef PYSPEC_WITH_CUDA
          cuda::MaterializeKV(s, p, r, d, reinterpret_cast<void*>(stream));
#else
          CudaNotBuilt("materialize_kv");
#endif
        } else {
          MaterializeKV(s, p, r, d);
        }
      },
      py::arg("scratch"), py::arg("pages"), py::arg("src_rows"), py::arg("dst_slots"),
      py::arg("stream") = 0,
      "Copy accepted rows scratch[src_rows[i]] into the paged pool at flat slots dst_slots[i]. "
      "Shapes: scratch [S,H,D] or [L,S,H,D]; pages [B,bs,H,D] or [L,B,bs,H,D]. Runs on the "
      "tensors' device; `stream` is a cudaStream_t for CUDA tensors.");
}

}  // namespace bindings
}  // namespace pyspec
