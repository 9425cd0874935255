// A non-owning view of a strided tensor, the way tensors cross the public C++ API.
//
// The Python bindings fill it from DLPack without copying; C++ embedders fill it from their own
// buffers. Strides are in elements, like DLPack and torch.
#pragma once

#include <cstdint>
#include <initializer_list>
#include <string>

namespace pyspec {

enum class DType : uint8_t { kFloat32, kFloat16, kBFloat16, kFloat64, kInt32, kInt64, kUInt8, kInt8, kBool };
enum class DeviceType : uint8_t { kCPU, kCUDA };

const char* DTypeName(DType dtype);
int DTypeSize(DType dtype);

struct Device {
  DeviceType type = DeviceType::kCPU;
  int index = 0;
  bool operator==(const Device& o) const { return type == o.type && index == o.index; }
  bool operator!=(const Device& o) const { return !(*this == o); }
};
std::string DeviceName(const Device& device);

struct TensorView {
  static constexpr int kMaxDims = 8;

  void* data = nullptr;
  DType dtype = DType::kFloat32;
  Device device;
  int ndim = 0;
  int64_t shape[kMaxDims] = {};
  int64_t strides[kMaxDims] = {};  // in elements

  // A contiguous (row-major) view over `data`.
  static TensorView Contiguous(void* data, DType dtype, std::initializer_list<int64_t> shape,
                               Device device = Device());

  int64_t size(int dim) const { return shape[dim < 0 ? dim + ndim : dim]; }
  int64_t numel() const;
  bool is_contiguous() const;
  template <typename T>
  T* ptr() const {
    return static_cast<T*>(data);
  }
  std::string ShapeString() const;
};

// Argument validation with errors that name the argument. `dims` entries of -1 match any size.
// All throw pyspec::ValueError.
void CheckDType(const TensorView& t, const char* name, std::initializer_list<DType> allowed);
void CheckShape(const TensorView& t, const char* name, std::initializer_list<int64_t> dims);
void CheckContiguous(const TensorView& t, const char* name);
void CheckSameDevice(const TensorView& a, const char* a_name, const TensorView& b, const char* b_name);
void CheckDevice(const TensorView& t, const char* name, DeviceType type);

}  // namespace pyspec
