// _C.linear: binding of pyspec::Linear.
//
// The op runs ~8 times per layer per decoded token, so the binding's own cost matters: torch's
// Tensor.__dlpack__ is a Python method (~2 us a tensor), while torch._C._to_dlpack builds the same
// DLPack capsule in ~0.2 us. For torch tensors of the dtypes the op supports the binding reads
// that capsule; everything else goes through the generic ToView, which also produces the errors.
#include <pybind11/pybind11.h>

#include <cstdint>
#include <optional>

#include "dlpack_view.h"
#include "pyspec/check.h"
#include "pyspec/linear.h"
#include "registry.h"

namespace py = pybind11;

namespace pyspec {
namespace bindings {
namespace {

// The stable DLPack v0.8 ABI of a "dltensor" capsule (as in dlpack_view.cc).
struct DlDevice {
  int32_t device_type;  // 1 = CPU, 2 = CUDA, 3 = CUDA host
  int32_t device_id;
};
struct DlDataType {
  uint8_t code;  // 2 float, 4 bfloat
  uint8_t bits;
  uint16_t lanes;
};
struct DlTensor {
  void* data;
  DlDevice device;
  int32_t ndim;
  DlDataType dtype;
  int64_t* shape;
  int64_t* strides;
  uint64_t byte_offset;
};
struct DlManagedTensor {
  DlTensor dl_tensor;
  void* manager_ctx;
  void (*deleter)(DlManagedTensor*);
};

// torch.Tensor and torch._C._to_dlpack, looked up once torch is imported (never imported here).
// Leaked references: they must outlive every call, including calls during interpreter shutdown.
struct TorchHooks {
  PyObject* tensor_type = nullptr;
  PyObject* to_dlpack = nullptr;
};

const TorchHooks& Hooks() {
  static TorchHooks hooks;
  if (hooks.to_dlpack != nullptr) return hooks;
  PyObject* modules = PyImport_GetModuleDict();  // borrowed
  PyObject* torch = PyDict_GetItemString(modules, "torch");
  if (torch == nullptr) return hooks;
  try {
    py::handle t(torch);
    py::object tensor = t.attr("Tensor");
    py::object fn = t.attr("_C").attr("_to_dlpack");
    hooks.tensor_type = tensor.release().ptr();
    hooks.to_dlpack = fn.release().ptr();
  } catch (py::error_already_set&) {
    // An unexpected torch: the generic path still works.
  }
  return hooks;
}

// Fills `v` from a torch tensor's capsule; false when the fast path does not apply.
bool FastView(py::handle obj, TensorView* v) {
  const TorchHooks& h = Hooks();
  if (h.to_dlpack == nullptr || !PyObject_TypeCheck(obj.ptr(), reinterpret_cast<PyTypeObject*>(
                                                                   h.tensor_type))) {
    return false;
  }
  PyObject* cap = PyObject_CallOneArg(h.to_dlpack, obj.ptr());
  if (cap == nullptr) {
    PyErr_Clear();
    return false;
  }
  py::object capsule = py::reinterpret_steal<py::object>(cap);  // its destructor frees the tensor
  auto* managed = static_cast<DlManagedTensor*>(PyCapsule_GetPointer(cap, "dltensor"));
  if (managed == nullptr) {
    PyErr_Clear();
    return false;
  }
  const DlTensor& dl = managed->dl_tensor;
  if (dl.dtype.lanes != 1 || dl.ndim > TensorView::kMaxDims) return false;
  if (dl.dtype.code == 2 && dl.dtype.bits == 32) {
    v->dtype = DType::kFloat32;
  } else if (dl.dtype.code == 2 && dl.dtype.bits == 16) {
    v->dtype = DType::kFloat16;
  } else if (dl.dtype.code == 4 && dl.dtype.bits == 16) {
    v->dtype = DType::kBFloat16;
  } else {
    return false;
  }
  if (dl.device.device_type == 1 || dl.device.device_type == 3) {
    v->device = Device{DeviceType::kCPU, 0};
  } else if (dl.device.device_type == 2) {
    v->device = Device{DeviceType::kCUDA, dl.device.device_id};
  } else {
    return false;
  }
  v->ndim = dl.ndim;
  v->data = static_cast<char*>(dl.data) + dl.byte_offset;
  int64_t stride = 1;
  for (int d = v->ndim - 1; d >= 0; --d) {
    v->shape[d] = dl.shape[d];
    v->strides[d] = dl.strides != nullptr ? dl.strides[d] : stride;
    stride *= dl.shape[d];
  }
  return true;  // the tensor (not the capsule) owns the data; the caller keeps it alive
}

TensorView View(py::handle obj, const char* name) {
  TensorView v;
  if (FastView(obj, &v)) return v;
  return ToView(obj, name);
}

}  // namespace

void RegisterLinear(py::module_& m) {
  m.def(
      "linear",
      [](py::handle x, py::handle w, py::handle bias, py::handle out) {
        const TensorView xv = View(x, "x"), wv = View(w, "w"), ov = View(out, "out");
        std::optional<TensorView> bv;
        if (!bias.is_none()) bv = View(bias, "bias");
        py::gil_scoped_release release;
        Linear(xv, wv, bv ? &*bv : nullptr, ov);
      },
      py::arg("x"), py::arg("w"), py::arg("bias"), py::arg("out"),
      R"doc(Dense layer ``out = x @ w.T + bias``, written into ``out`` in place.

x [M, K], w [N, K], bias [N] or None, out [M, N]: contiguous cpu tensors of one dtype (float32,
bfloat16 or float16); fp32 accumulation, one rounding per output. Tuned for small M (decoding):
each weight row is read from memory once per call, output rows are split over the thread pool.
Correct for any M, but for M above ~16 a GEMM library is faster (pyspec.linear routes those to
torch). Raises ValueError naming the bad argument; RuntimeError for CUDA tensors (not implemented
on CUDA). Tensors that require grad are read as is (no autograd).)doc");

  m.def("_linear_isa", &detail::LinearIsa,
        "Instruction set of the CPU linear kernel in use ('generic' or 'avx2').");
  m.def("_set_linear_isa", &detail::SetLinearIsa, py::arg("isa"),
        "Force the CPU linear kernel: 'auto', 'generic' or 'avx2' (tests and benchmarks). Returns "
        "the kernel now in use.");
}

}  // namespace bindings
}  // namespace pyspec
