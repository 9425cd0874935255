#include "dlpack_view.h"

#include <cstdint>
#include <string>
#include <vector>

#include "pyspec/check.h"

namespace py = pybind11;

namespace pyspec {
namespace bindings {
namespace {

// The stable (unversioned) DLPack ABI, v0.8: the layout every producer's "dltensor" capsule uses.
struct DLDevice {
  int32_t device_type;  // 1 = CPU, 2 = CUDA, 3 = CUDA host (pinned)
  int32_t device_id;
};
struct DLDataType {
  uint8_t code;  // 0 int, 1 uint, 2 float, 4 bfloat, 6 bool
  uint8_t bits;
  uint16_t lanes;
};
struct DLTensor {
  void* data;
  DLDevice device;
  int32_t ndim;
  DLDataType dtype;
  int64_t* shape;
  int64_t* strides;
  uint64_t byte_offset;
};
struct DLManagedTensor {
  DLTensor dl_tensor;
  void* manager_ctx;
  void (*deleter)(DLManagedTensor*);
};

DType ToDType(const DLDataType& t, const char* name) {
  if (t.lanes == 1) {
    if (t.code == 2 && t.bits == 32) return DType::kFloat32;
    if (t.code == 2 && t.bits == 16) return DType::kFloat16;
    if (t.code == 2 && t.bits == 64) return DType::kFloat64;
    if (t.code == 4 && t.bits == 16) return DType::kBFloat16;
    if (t.code == 0 && t.bits == 32) return DType::kInt32;
    if (t.code == 0 && t.bits == 64) return DType::kInt64;
    if (t.code == 0 && t.bits == 8) return DType::kInt8;
    if (t.code == 1 && t.bits == 8) return DType::kUInt8;
    if (t.code == 6 && t.bits == 8) return DType::kBool;
  }
  throw ValueError(detail::StrCat("'", name, "' has an unsupported dtype (DLPack code ",
                                  int(t.code), ", ", int(t.bits), " bits, ", t.lanes, " lanes)"));
}

bool IsInstanceOfLoaded(py::handle obj, const char* module, const char* cls) {
  PyObject* mod = PyImport_GetModule(py::str(module).ptr());  // new ref or null; never imports
  if (mod == nullptr) {
    PyErr_Clear();
    return false;  // not imported: obj cannot be one of its instances
  }
  py::object m = py::reinterpret_steal<py::object>(mod);
  return py::hasattr(m, cls) && py::isinstance(obj, m.attr(cls));
}

// torch.Tensor and torch._C._to_dlpack, looked up once torch is imported (never imported here).
// torch's Tensor.__dlpack__ is a Python method, several times slower than torch._C._to_dlpack,
// which builds the same capsule; ops like the dense layer run ~8 times per layer per token, so it
// counts.
// Leaked references: they must outlive every call, including calls during interpreter shutdown.
struct TorchHooks {
  PyObject* tensor_type = nullptr;
  PyObject* to_dlpack = nullptr;
  PyObject* is_neg = nullptr;  // torch.Tensor.is_neg
};

const TorchHooks& Hooks() {
  static TorchHooks hooks;  // filled once, under the GIL
  if (hooks.to_dlpack != nullptr) return hooks;
  PyObject* modules = PyImport_GetModuleDict();  // borrowed
  PyObject* torch = PyDict_GetItemString(modules, "torch");
  if (torch == nullptr) return hooks;
  try {
    py::handle t(torch);
    py::object tensor = t.attr("Tensor");
    py::object fn = t.attr("_C").attr("_to_dlpack");
    py::object is_neg = tensor.attr("is_neg");
    hooks.tensor_type = tensor.release().ptr();
    hooks.is_neg = is_neg.release().ptr();
    hooks.to_dlpack = fn.release().ptr();
  } catch (py::error_already_set&) {
    // An unexpected torch: torch tensors then go through __dlpack__.
  }
  return hooks;
}

bool IsTorchTensor(py::handle obj, const TorchHooks& h) {
  return h.tensor_type != nullptr &&
         PyObject_TypeCheck(obj.ptr(), reinterpret_cast<PyTypeObject*>(h.tensor_type));
}

// torch's negative bit (Tensor.is_neg(): torch._neg_view, the .imag of a conjugate view) is a lazy
// negation that DLPack does not carry: the exported data lacks the sign, so an op would read (or
// write) the values negated. Refused for inputs and outputs alike. (The conjugate bit exists only
// on complex tensors, whose dtype ToDType refuses.)
void CheckNoNegBit(py::handle obj, const TorchHooks& hooks, const char* name) {
  py::object neg;
  try {
    if (hooks.is_neg != nullptr) {
      PyObject* r = PyObject_CallOneArg(hooks.is_neg, obj.ptr());
      if (r == nullptr) throw py::error_already_set();
      neg = py::reinterpret_steal<py::object>(r);
    } else {
      if (!py::hasattr(obj, "is_neg")) return;
      neg = obj.attr("is_neg")();
    }
  } catch (py::error_already_set& e) {
    throw ValueError(detail::StrCat("'", name, "': is_neg() failed: ", e.what()));
  }
  if (PyObject_IsTrue(neg.ptr()) == 1) {
    throw ValueError(detail::StrCat(
        "'", name, "' has torch's negative bit set (a lazy negation, e.g. torch._neg_view or the "
        ".imag of a conjugate view), which DLPack drops: its values would be used without the "
        "sign; pass a tensor without it (`", name, ".resolve_neg()` returns a resolved copy)"));
  }
}

}  // namespace

TensorView ToView(py::handle obj, const char* name) {
  if (obj.is_none()) throw ValueError(detail::StrCat("'", name, "' is None; expected a tensor"));
  if (!py::hasattr(obj, "__dlpack__")) {
    throw ValueError(detail::StrCat("'", name, "' must be a tensor (torch.Tensor or numpy array); got ",
                                    TypeName(obj)));
  }
  // The view outlives the capsule, so the data must be owned by `obj` itself. torch tensors and
  // numpy arrays export their own storage (never a private copy); other producers may hand out a
  // buffer only the capsule keeps alive, so they are refused rather than risk a dangling pointer.
  const TorchHooks& hooks = Hooks();
  const bool torch_tensor = IsTorchTensor(obj, hooks) || IsInstanceOfLoaded(obj, "torch", "Tensor");
  if (!torch_tensor && !IsInstanceOfLoaded(obj, "numpy", "ndarray")) {
    throw ValueError(detail::StrCat("'", name, "' must be a torch.Tensor or numpy.ndarray; got ",
                                    TypeName(obj)));
  }
  if (torch_tensor) CheckNoNegBit(obj, hooks, name);
  py::object capsule;
  try {
    if (torch_tensor && hooks.to_dlpack != nullptr) {
      PyObject* cap = PyObject_CallOneArg(hooks.to_dlpack, obj.ptr());
      if (cap == nullptr) throw py::error_already_set();
      capsule = py::reinterpret_steal<py::object>(cap);
    } else {
      capsule = obj.attr("__dlpack__")();
    }
  } catch (py::error_already_set& e) {
    throw ValueError(detail::StrCat("'", name, "' cannot be shared zero-copy: ", e.what()));
  }
  // Reading the capsule does not consume it: its own destructor releases the producer's reference.
  auto* managed = static_cast<DLManagedTensor*>(PyCapsule_GetPointer(capsule.ptr(), "dltensor"));
  if (managed == nullptr) {
    PyErr_Clear();
    throw ValueError(detail::StrCat("'", name, "' returned an unexpected DLPack capsule"));
  }
  const DLTensor& dl = managed->dl_tensor;
  TensorView v;
  v.dtype = ToDType(dl.dtype, name);
  if (dl.device.device_type == 1 || dl.device.device_type == 3) {
    v.device = Device{DeviceType::kCPU, 0};
  } else if (dl.device.device_type == 2) {
    v.device = Device{DeviceType::kCUDA, dl.device.device_id};
  } else {
    throw ValueError(detail::StrCat("'", name, "' is on an unsupported device (DLPack type ",
                                    dl.device.device_type, "); use cpu or cuda"));
  }
  if (dl.ndim > TensorView::kMaxDims) {
    throw ValueError(detail::StrCat("'", name, "' has ", dl.ndim, " dims; at most ",
                                    TensorView::kMaxDims, " are supported"));
  }
  v.ndim = dl.ndim;
  v.data = static_cast<char*>(dl.data) + dl.byte_offset;
  int64_t stride = 1;
  for (int d = v.ndim - 1; d >= 0; --d) {
    v.shape[d] = dl.shape[d];
    v.strides[d] = dl.strides ? dl.strides[d] : stride;
    stride *= dl.shape[d];
  }
  return v;
}

// The bytes a view can touch, [lo, hi) (empty for a view without elements).
std::pair<uintptr_t, uintptr_t> ByteSpan(const TensorView& v) {
  int64_t lo = 0, hi = 0;
  for (int d = 0; d < v.ndim; ++d) {
    if (v.shape[d] == 0) return {0, 0};
    const int64_t reach = (v.shape[d] - 1) * v.strides[d];
    (reach < 0 ? lo : hi) += reach;
  }
  const int64_t size = DTypeSize(v.dtype);
  const auto base = reinterpret_cast<uintptr_t>(v.data);
  return {base + static_cast<uintptr_t>(lo * size), base + static_cast<uintptr_t>((hi + 1) * size)};
}

// The op writes its outputs while it still reads its inputs (and the GIL is released): an output
// that shares memory with an input, or with another output, is refused.
std::optional<TensorView> OptionalView(pybind11::handle obj, const char* name) {
  if (obj.is_none()) return std::nullopt;
  return ToView(obj, name);
}

void CheckNoOverlap(std::initializer_list<std::pair<const TensorView*, const char*>> outs,
                    std::initializer_list<std::pair<const TensorView*, const char*>> ins) {
  std::vector<std::pair<const TensorView*, const char*>> seen;
  for (const auto& i : ins) {
    if (i.first != nullptr) seen.push_back(i);
  }
  for (const auto& o : outs) {
    if (o.first == nullptr) continue;
    const auto a = ByteSpan(*o.first);
    for (const auto& i : seen) {
      const auto b = ByteSpan(*i.first);
      PYSPEC_CHECK(a.first == a.second || b.first == b.second || a.second <= b.first ||
                       b.second <= a.first,
                   "'", o.second, "' shares memory with '", i.second,
                   "'; the outputs must be separate tensors");
    }
    seen.push_back(o);
  }
}

}  // namespace bindings
}  // namespace pyspec
