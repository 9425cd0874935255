// Host op of CUDA tree attention: uploads a plan's metadata and GPU work partition once per step,
// validates each layer's tensors and dispatches to the tensor-core or the generic kernel.
#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstring>
#include <vector>

#include "attention.cuh"
#include "common.cuh"
#include "pyspec/attention.h"
#include "pyspec/cuda_ops.h"
#include "pyspec/tree.h"

namespace pyspec {
namespace cuda {

static_assert(kernels::kAttnMaskWords == TokenTree::kMaskWords, "mask layout differs");
static_assert(sizeof(gpu_plan::Item) == 8 * sizeof(int64_t), "Item is 8 x int64 on the device");
static_assert(sizeof(gpu_plan::Merge) == 4 * sizeof(int64_t), "Merge is 4 x int64 on the device");

struct DeviceAttentionPlan::Impl {
  AttentionPlan host;
  gpu_plan::Partition part;
  int device = 0;
  cudaStream_t stream = nullptr;
  int64_t hq = 0, hkv = 0, d = 0;
  void* blob = nullptr;  // all metadata, one allocation
  float* partial_o = nullptr;
  float* partial_lse = nullptr;
  kernels::AttnStep step{};
  ~Impl() {
    if (blob != nullptr || partial_o != nullptr) {
      int previous = 0;
      if (cudaGetDevice(&previous) == cudaSuccess) {
        cudaSetDevice(device);
        if (blob != nullptr) cudaFreeAsync(blob, stream);
        if (partial_o != nullptr) cudaFreeAsync(partial_o, stream);
        cudaSetDevice(previous);
      }
    }
  }
};

namespace {

// Appends `n` elements of `src` to the byte image at a 16-byte aligned offset; returns the offset.
template <typename T>
size_t Append(std::vector<unsigned char>& image, const T* src, size_t n) {
  size_t off = (image.size() + 15) / 16 * 16;
  image.resize(off + n * sizeof(T));
  if (n > 0) std::memcpy(image.data() + off, src, n * sizeof(T));
  return off;
}

bool Aligned16(const TensorView& t) { return reinterpret_cast<uintptr_t>(t.data) % 16 == 0; }

}  // namespace

DeviceAttentionPlan::DeviceAttentionPlan(const AttentionPlan& plan, int device,
                                         int64_t num_q_heads, int64_t num_kv_heads,
                                         int64_t head_dim, void* stream)
    : impl_(new Impl) {
  PYSPEC_CHECK(num_q_heads > 0 && num_kv_heads > 0 && num_q_heads % num_kv_heads == 0,
               "'num_q_heads' (", num_q_heads, ") must be a positive multiple of 'num_kv_heads' (",
               num_kv_heads, ")");
  PYSPEC_CHECK(plan.num_kv_heads() == 0 ||
                   (plan.num_q_heads() == num_q_heads && plan.num_kv_heads() == num_kv_heads),
               "the plan was built for ", plan.num_q_heads(), "/", plan.num_kv_heads(),
               " q/kv heads but ", num_q_heads, "/", num_kv_heads, " were given");
  PYSPEC_CHECK(head_dim > 0 && head_dim <= kernels::kGenericMaxDim, "'head_dim' = ", head_dim,
               " is not supported on CUDA (1 .. ", kernels::kGenericMaxDim, ")");
  RequireDevice("tree_attention");
  DeviceGuard guard(device);
  Impl& p = *impl_;
  p.host = plan;
  p.device = device;
  p.stream = static_cast<cudaStream_t>(stream);
  p.hq = num_q_heads;
  p.hkv = num_kv_heads;
  p.d = head_dim;
  int sms = 0;
  PYSPEC_CUDA_CALL(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device));
  p.part = gpu_plan::Build(plan.q_indptr(), plan.prefix_lens(), num_q_heads / num_kv_heads,
                           num_kv_heads, sms, /*blocks_per_sm=*/2);

  std::vector<unsigned char> image;
  const size_t o_qi = Append(image, plan.q_indptr().data(), plan.q_indptr().size());
  const size_t o_pl = Append(image, plan.prefix_lens().data(), plan.prefix_lens().size());
  const size_t o_pi = Append(image, plan.page_indptr().data(), plan.page_indptr().size());
  const size_t o_pg = Append(image, plan.pages().data(), plan.pages().size());
  const size_t o_tr = Append(image, plan.tree_flags().data(), plan.tree_flags().size());
  const size_t o_mk = Append(image, plan.masks().data(), plan.masks().size());
  const size_t o_it = Append(image, p.part.items.data(), p.part.items.size());
  const size_t o_mg = Append(image, p.part.merges.data(), p.part.merges.size());
  image.resize(std::max<size_t>(image.size(), 16));
  PYSPEC_CUDA_CALL(cudaMallocAsync(&p.blob, image.size(), p.stream));
  // `image` is pageable host memory: cudaMemcpyAsync has staged it before returning, so it may be
  // released without waiting for the stream (no per-step host synchronisation).
  PYSPEC_CUDA_CALL(cudaMemcpyAsync(p.blob, image.data(), image.size(), cudaMemcpyHostToDevice,
                                   p.stream));
  if (p.part.num_partial_rows > 0) {
    const size_t rows = static_cast<size_t>(p.part.num_partial_rows);
    const size_t floats = rows * p.hq * p.d + rows * p.hq;
    PYSPEC_CUDA_CALL(cudaMallocAsync(reinterpret_cast<void**>(&p.partial_o),
                                     floats * sizeof(float), p.stream));
    p.partial_lse = p.partial_o + rows * p.hq * p.d;
  }
  const unsigned char* base = static_cast<const unsigned char*>(p.blob);
  kernels::AttnStep& s = p.step;
  s.q_indptr = reinterpret_cast<const int64_t*>(base + o_qi);
  s.prefix_lens = reinterpret_cast<const int64_t*>(base + o_pl);
  s.page_indptr = reinterpret_cast<const int64_t*>(base + o_pi);
  s.pages = reinterpret_cast<const int32_t*>(base + o_pg);
  s.is_tree = reinterpret_cast<const uint8_t*>(base + o_tr);
  s.masks = plan.masks().empty() ? nullptr : reinterpret_cast<const uint64_t*>(base + o_mk);
  s.items = reinterpret_cast<const gpu_plan::Item*>(base + o_it);
  s.block_size = plan.block_size();
  s.hq = p.hq;
  s.hkv = p.hkv;
  s.group = p.hq / p.hkv;
  s.d = p.d;
  s.partial_o = p.partial_o;
  s.partial_lse = p.partial_lse;
  merges_offset_ = o_mg;
}

DeviceAttentionPlan::~DeviceAttentionPlan() = default;

int DeviceAttentionPlan::device() const { return impl_->device; }
int64_t DeviceAttentionPlan::num_q_heads() const { return impl_->hq; }
int64_t DeviceAttentionPlan::num_kv_heads() const { return impl_->hkv; }
int64_t DeviceAttentionPlan::head_dim() const { return impl_->d; }
int64_t DeviceAttentionPlan::num_work_items() const {
  return static_cast<int64_t>(impl_->part.items.size());
}
int64_t DeviceAttentionPlan::num_split_tiles() const {
  return static_cast<int64_t>(impl_->part.merges.size());
}
int64_t DeviceAttentionPlan::kv_chunk() const { return impl_->part.kv_chunk; }

namespace {

template <typename T, int D, bool kPipe>
cudaError_t LaunchTcVariant(const kernels::AttnStep& s, int64_t items, const TensorView& q,
                            const TensorView& kp, const TensorView& vp, const TensorView& kn,
                            const TensorView& vn, const TensorView& out, float* lse,
                            cudaStream_t stream) {
  constexpr size_t smem = kernels::TcSmemBytes<D, kPipe>();
  auto kernel = kernels::TreeAttentionTC<T, D, kPipe>;
  // Once per kernel instantiation and device is enough; the attribute call is cheap but not free.
  static std::atomic<unsigned> configured{0};  // bit per device (devices 0..31)
  int dev = 0;
  cudaError_t err = cudaGetDevice(&dev);
  if (err != cudaSuccess) return err;
  const unsigned bit = dev < 32 ? 1u << dev : 0u;
  if (bit == 0 || (configured.load() & bit) == 0) {
    err = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                               static_cast<int>(smem));
    if (err != cudaSuccess) return err;
    configured.fetch_or(bit);
  }
  dim3 grid(static_cast<unsigned>(items), static_cast<unsigned>(s.hkv));
  kernel<<<grid, kernels::tc::kThreads, smem, stream>>>(
      s, q.ptr<const T>(), kp.ptr<const T>(), vp.ptr<const T>(), kn.ptr<const T>(),
      vn.ptr<const T>(), out.ptr<T>(), lse);
  return cudaGetLastError();
}

template <typename T, int D>
cudaError_t LaunchTc(const kernels::AttnStep& s, int64_t items, const TensorView& q,
                     const TensorView& kp, const TensorView& vp, const TensorView& kn,
                     const TensorView& vn, const TensorView& out, float* lse,
                     cudaStream_t stream, bool pipelined) {
  return pipelined
             ? LaunchTcVariant<T, D, true>(s, items, q, kp, vp, kn, vn, out, lse, stream)
             : LaunchTcVariant<T, D, false>(s, items, q, kp, vp, kn, vn, out, lse, stream);
}

template <typename QT, typename KT>
cudaError_t LaunchGeneric(const kernels::AttnStep& s, int64_t items, const TensorView& q,
                          const TensorView& kp, const TensorView& vp, const TensorView& kn,
                          const TensorView& vn, const TensorView& out, float* lse,
                          cudaStream_t stream) {
  dim3 grid(static_cast<unsigned>(items), static_cast<unsigned>(s.hkv));
  kernels::TreeAttentionGeneric<QT, KT><<<grid, 32 * kernels::kGenericWarps, 0, stream>>>(
      s, q.ptr<const QT>(), kp.ptr<const KT>(), vp.ptr<const KT>(), kn.ptr<const KT>(),
      vn.ptr<const KT>(), out.ptr<QT>(), lse);
  return cudaGetLastError();
}

template <typename QT>
cudaError_t LaunchGenericKv(DType kv, const kernels::AttnStep& s, int64_t items,
                            const TensorView& q, const TensorView& kp, const TensorView& vp,
                            const TensorView& kn, const TensorView& vn, const TensorView& out,
                            float* lse, cudaStream_t stream) {
  switch (kv) {
    case DType::kFloat32:
      return LaunchGeneric<QT, float>(s, items, q, kp, vp, kn, vn, out, lse, stream);
    case DType::kBFloat16:
      return LaunchGeneric<QT, __nv_bfloat16>(s, items, q, kp, vp, kn, vn, out, lse, stream);
    default:
      return LaunchGeneric<QT, __half>(s, items, q, kp, vp, kn, vn, out, lse, stream);
  }
}

template <typename T>
cudaError_t LaunchMerge(const gpu_plan::Merge* merges, int64_t num_merges,
                        const kernels::AttnStep& s, const TensorView& out, float* lse,
                        cudaStream_t stream) {
  dim3 grid(static_cast<unsigned>(num_merges), static_cast<unsigned>(s.hq));
  kernels::MergeSplits<T><<<grid, 128, 0, stream>>>(merges, s.hq, s.d, s.partial_o,
                                                    s.partial_lse, out.ptr<T>(), lse);
  return cudaGetLastError();
}

}  // namespace

bool DeviceAttentionPlan::UsesTensorCores(DType q_dtype, DType kv_dtype) const {
  const int64_t d = impl_->d, group = impl_->hq / impl_->hkv;
  return q_dtype == kv_dtype && (q_dtype == DType::kBFloat16 || q_dtype == DType::kFloat16) &&
         (d == 64 || d == 128) && group <= gpu_plan::kTileVectors;
}

void RunAttention(const DeviceAttentionPlan& dplan, const TensorView& q, const TensorView& k_pages,
                  const TensorView& v_pages, const TensorView& k_new, const TensorView& v_new,
                  const TensorView& out, const TensorView* lse, float scale, void* stream_ptr,
                  bool pipelined) {
  const DeviceAttentionPlan::Impl& p = *dplan.impl_;
  const detail::AttentionShape shape = detail::CheckAttentionArgs(
      p.host, q, k_pages, v_pages, k_new, v_new, out, lse, scale, DeviceType::kCUDA);
  PYSPEC_CHECK(q.device.index == p.device, "'q' is on cuda:", q.device.index,
               " but the device plan was built for cuda:", p.device);
  PYSPEC_CHECK(shape.Hq == p.hq && shape.Hkv == p.hkv && shape.D == p.d, "the device plan was ",
               "built for ", p.hq, "/", p.hkv, " heads of dim ", p.d, " but the tensors have ",
               shape.Hq, "/", shape.Hkv, " heads of dim ", shape.D);
  cudaStream_t stream = static_cast<cudaStream_t>(stream_ptr);
  // The plan's buffers are allocated, used and freed in the order of its stream.
  PYSPEC_CHECK(stream == p.stream, "the device plan was built for another CUDA stream; build one ",
               "per stream (pyspec.attention.tree_attention does)");
  if (shape.T == 0) return;
  DeviceGuard guard(p.device);
  kernels::AttnStep s = p.step;
  s.scale_log2 = scale * 1.4426950408889634f;
  float* lse_ptr = lse != nullptr ? lse->ptr<float>() : nullptr;
  const int64_t items = static_cast<int64_t>(p.part.items.size());
  const bool aligned = Aligned16(q) && Aligned16(k_pages) && Aligned16(v_pages) &&
                       Aligned16(k_new) && Aligned16(v_new);
  cudaError_t err = cudaSuccess;
  if (items > 0) {
    if (aligned && dplan.UsesTensorCores(q.dtype, k_pages.dtype)) {
      if (q.dtype == DType::kBFloat16) {
        err = p.d == 64
                  ? LaunchTc<__nv_bfloat16, 64>(s, items, q, k_pages, v_pages, k_new, v_new, out,
                                                lse_ptr, stream, pipelined)
                  : LaunchTc<__nv_bfloat16, 128>(s, items, q, k_pages, v_pages, k_new, v_new,
                                                 out, lse_ptr, stream, pipelined);
      } else {
        err = p.d == 64 ? LaunchTc<__half, 64>(s, items, q, k_pages, v_pages, k_new, v_new, out,
                                               lse_ptr, stream, pipelined)
                        : LaunchTc<__half, 128>(s, items, q, k_pages, v_pages, k_new, v_new, out,
                                                lse_ptr, stream, pipelined);
      }
    } else {
      switch (q.dtype) {
        case DType::kFloat32:
          err = LaunchGenericKv<float>(k_pages.dtype, s, items, q, k_pages, v_pages, k_new, v_new,
                                       out, lse_ptr, stream);
          break;
        case DType::kBFloat16:
          err = LaunchGenericKv<__nv_bfloat16>(k_pages.dtype, s, items, q, k_pages, v_pages, k_new,
                                               v_new, out, lse_ptr, stream);
          break;
        default:
          err = LaunchGenericKv<__half>(k_pages.dtype, s, items, q, k_pages, v_pages, k_new,
                                        v_new, out, lse_ptr, stream);
      }
    }
  }
  PYSPEC_CUDA_CALL(err);
  if (!p.part.merges.empty()) {
    const auto* merges = reinterpret_cast<const gpu_plan::Merge*>(
        static_cast<const unsigned char*>(p.blob) + dplan.merges_offset_);
    const int64_t n = static_cast<int64_t>(p.part.merges.size());
    switch (q.dtype) {
      case DType::kFloat32:
        err = LaunchMerge<float>(merges, n, s, out, lse_ptr, stream);
        break;
      case DType::kBFloat16:
        err = LaunchMerge<__nv_bfloat16>(merges, n, s, out, lse_ptr, stream);
        break;
      default:
        err = LaunchMerge<__half>(merges, n, s, out, lse_ptr, stream);
    }
    PYSPEC_CUDA_CALL(err);
  }
}

}  // namespace cuda
}  // namespace pyspec
