#include "pyspec/kv_ops.h"

#include <cstring>
#include <vector>

#include "pyspec/check.h"
#include "pyspec/thread_pool.h"

namespace pyspec {
namespace detail {

MaterializeShape CheckMaterializeArgs(const TensorView& scratch, const TensorView& pages,
                                      const TensorView& src_rows, const TensorView& dst_slots) {
  CheckDType(scratch, "scratch", {DType::kFloat32, DType::kFloat16, DType::kBFloat16});
  PYSPEC_CHECK(pages.dtype == scratch.dtype, "'pages' has dtype ", DTypeName(pages.dtype),
               " but 'scratch' has ", DTypeName(scratch.dtype), "; they must match");
  CheckDType(src_rows, "src_rows", {DType::kInt32, DType::kInt64});
  CheckDType(dst_slots, "dst_slots", {DType::kInt32, DType::kInt64});
  CheckSameDevice(scratch, "scratch", pages, "pages");
  CheckSameDevice(scratch, "scratch", src_rows, "src_rows");
  CheckSameDevice(scratch, "scratch", dst_slots, "dst_slots");
  CheckContiguous(scratch, "scratch");
  CheckContiguous(pages, "pages");
  CheckContiguous(src_rows, "src_rows");
  CheckContiguous(dst_slots, "dst_slots");
  PYSPEC_CHECK(src_rows.ndim == 1 && dst_slots.ndim == 1 && src_rows.shape[0] == dst_slots.shape[0],
               "'src_rows' and 'dst_slots' must be 1-D of equal length; got ", src_rows.ShapeString(),
               " and ", dst_slots.ShapeString());
  MaterializeShape s{};
  s.n = src_rows.shape[0];
  if (scratch.ndim == 3) {
    CheckShape(pages, "pages", {-1, -1, scratch.shape[1], scratch.shape[2]});
    s.layers = 1;
    s.scratch_rows = scratch.shape[0];
    s.slots = pages.shape[0] * pages.shape[1];
    s.row_bytes = scratch.shape[1] * scratch.shape[2] * DTypeSize(scratch.dtype);
  } else if (scratch.ndim == 4) {
    CheckShape(pages, "pages", {scratch.shape[0], -1, -1, scratch.shape[2], scratch.shape[3]});
    s.layers = scratch.shape[0];
    s.scratch_rows = scratch.shape[1];
    s.slots = pages.shape[1] * pages.shape[2];
    s.row_bytes = scratch.shape[2] * scratch.shape[3] * DTypeSize(scratch.dtype);
  } else {
    throw ValueError(StrCat("'scratch' must be [S, kv_heads, head_dim] or [L, S, kv_heads, head_dim]; ",
                            "got ", scratch.ShapeString()));
  }
  return s;
}

}  // namespace detail

namespace {
int64_t ReadIndex(const TensorView& t, int64_t i) {
  return t.dtype == DType::kInt32 ? t.ptr<int32_t>()[i] : t.ptr<int64_t>()[i];
}
}  // namespace

void MaterializeKV(const TensorView& scratch, const TensorView& pages, const TensorView& src_rows,
                   const TensorView& dst_slots, ThreadPool* pool) {
  CheckDevice(scratch, "scratch", DeviceType::kCPU);
  const detail::MaterializeShape s = detail::CheckMaterializeArgs(scratch, pages, src_rows, dst_slots);
  std::vector<int64_t> src(s.n), dst(s.n);
  for (int64_t i = 0; i < s.n; ++i) {
    src[i] = ReadIndex(src_rows, i);
    dst[i] = ReadIndex(dst_slots, i);
    PYSPEC_CHECK(src[i] >= 0 && src[i] < s.scratch_rows, "src_rows[", i, "] = ", src[i],
                 " is out of range [0, ", s.scratch_rows, ")");
    PYSPEC_CHECK(dst[i] >= 0 && dst[i] < s.slots, "dst_slots[", i, "] = ", dst[i],
                 " is out of range [0, ", s.slots, ") (num_blocks * block_size)");
  }
  const char* sbase = static_cast<const char*>(scratch.data);
  char* pbase = static_cast<char*>(pages.data);
  const int64_t total = s.layers * s.n;
  (pool != nullptr ? *pool : ThreadPool::Default()).ParallelFor(total, 64, [&](int64_t begin, int64_t end) {
    for (int64_t k = begin; k < end; ++k) {
      int64_t layer = k / s.n, i = k % s.n;
      std::memcpy(pbase + (layer * s.slots + dst[i]) * s.row_bytes,
                  sbase + (layer * s.scratch_rows + src[i]) * s.row_bytes, s.row_bytes);
    }
  });
}

}  // namespace pyspec
