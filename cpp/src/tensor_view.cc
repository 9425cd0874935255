#include "pyspec/tensor_view.h"


#include "pyspec/check.h"

namespace pyspec {

const char* DTypeName(DType dtype) {
  switch (dtype) {
    case DType::kFloat32: return "float32";
    case DType::kFloat16: return "float16";
    case DType::kBFloat16: return "bfloat16";
    case DType::kFloat64: return "float64";
    case DType::kInt32: return "int32";
    case DType::kInt64: return "int64";
    case DType::kUInt8: return "uint8";
    case DType::kInt8: return "int8";
    case DType::kBool: return "bool";
  }
  return "unknown";
}

int DTypeSize(DType dtype) {
  switch (dtype) {
    case DType::kFloat32: case DType::kInt32: return 4;
    case DType::kFloat16: case DType::kBFloat16: return 2;
    case DType::kFloat64: case DType::kInt64: return 8;
    case DType::kUInt8: case DType::kInt8: case DType::kBool: return 1;
  }
  return 0;
}

std::string DeviceName(const Device& device) {
  if (device.type == DeviceType::kCPU) return "cpu";
  return detail::StrCat("cuda:", device.index);
}

TensorView TensorView::Contiguous(void* data, DType dtype, std::initializer_list<int64_t> shape,
                                  Device device) {
  PYSPEC_CHECK(shape.size() <= static_cast<size_t>(kMaxDims), "at most ", kMaxDims, " dims");
  TensorView t;
  t.data = data;
  t.dtype = dtype;
  t.device = device;
  t.ndim = static_cast<int>(shape.size());
  int i = 0;
  for (int64_t s : shape) t.shape[i++] = s;
  int64_t stride = 1;
  for (int d = t.ndim - 1; d >= 0; --d) {
    t.strides[d] = stride;
    stride *= t.shape[d];
  }
  return t;
}

int64_t TensorView::numel() const {
  int64_t n = 1;
  for (int d = 0; d < ndim; ++d) n *= shape[d];
  return n;
}

bool TensorView::is_contiguous() const {
  // Like torch: a tensor without elements is contiguous whatever its strides (torch gives an
  // empty [M, 0] tensor strides (1, 1), which no row-major layout would have).
  if (numel() == 0) return true;
  int64_t expected = 1;
  for (int d = ndim - 1; d >= 0; --d) {
    if (shape[d] != 1 && strides[d] != expected) return false;
    expected *= shape[d];
  }
  return true;
}

std::string TensorView::ShapeString() const {
  std::string s = "[";
  for (int d = 0; d < ndim; ++d) detail::AppendAll(s, d ? ", " : "", shape[d]);
  return s + "]";
}

void CheckDType(const TensorView& t, const char* name, std::initializer_list<DType> allowed) {
  for (DType d : allowed) {
    if (t.dtype == d) return;
  }
  std::string s = detail::StrCat("'", name, "' has dtype ", DTypeName(t.dtype), "; allowed: ");
  int i = 0;
  for (DType d : allowed) detail::AppendAll(s, i++ ? ", " : "", DTypeName(d));
  throw ValueError(s);
}

void CheckShape(const TensorView& t, const char* name, std::initializer_list<int64_t> dims) {
  bool ok = t.ndim == static_cast<int>(dims.size());
  int i = 0;
  for (int64_t d : dims) {
    if (!ok) break;
    if (d >= 0 && t.shape[i] != d) ok = false;
    ++i;
  }
  if (ok) return;
  std::string s = detail::StrCat("'", name, "' has shape ", t.ShapeString(), "; expected [");
  i = 0;
  for (int64_t d : dims) {
    s += i++ ? ", " : "";
    if (d >= 0) detail::AppendOne(s, d); else s += "*";
  }
  throw ValueError(s + "]");
}

void CheckContiguous(const TensorView& t, const char* name) {
  PYSPEC_CHECK(t.is_contiguous(), "'", name, "' must be contiguous (call .contiguous() first)");
}

void CheckSameDevice(const TensorView& a, const char* a_name, const TensorView& b,
                     const char* b_name) {
  PYSPEC_CHECK(a.device == b.device, "'", a_name, "' is on ", DeviceName(a.device), " but '", b_name,
               "' is on ", DeviceName(b.device), "; all tensors of one op must share a device");
}

void CheckDevice(const TensorView& t, const char* name, DeviceType type) {
  PYSPEC_CHECK(t.device.type == type, "'", name, "' is on ", DeviceName(t.device), "; this op needs ",
               type == DeviceType::kCPU ? "cpu" : "cuda", " tensors");
}

}  // namespace pyspec
