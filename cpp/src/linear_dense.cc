// Linear: the dense layer for few input rows (pyspec/linear.h; the kernel is linear_kernel.h).
#include <algorithm>
#include <cstdint>
#include <cstring>
#include <initializer_list>
#include <vector>

#include "half.h"
#include "linear_amx.h"
#include "linear_kernel.h"
#include "pyspec/check.h"
#include "pyspec/linear.h"
#include "pyspec/thread_pool.h"

namespace pyspec {
namespace linear_kernel {

void RunBlocksGeneric(const Ctx& c, int64_t b0, int64_t b1) {
  RunBlocksDispatch<GenericIsa>(c, b0, b1);
}

#ifdef PYSPEC_X86
__attribute__((target("avx2,fma"))) void RunBlocksAvx2(const Ctx& c, int64_t b0, int64_t b1) {
  RunBlocksDispatch<Avx2Isa>(c, b0, b1);
}

__attribute__((target("avx512f,avx2,fma"))) void RunBlocksAvx512(const Ctx& c, int64_t b0,
                                                                  int64_t b1) {
  RunBlocksDispatch<Avx512Isa>(c, b0, b1);
}
#endif

}  // namespace linear_kernel

namespace {

using namespace linear_kernel;  // NOLINT(build/namespaces)



// Copies rows of x into a zero-padded buffer of row length ldx: bf16 bits as they are for a `dot`
// kernel, else fp32. Widened 16-bit inputs are stored per group of `step` (= 2L) as the group's
// even elements then its odd ones, the order LoadW16 produces the weights in.
void WidenRows(const TensorView& x, int64_t M, int64_t K, int64_t ldx, const Kernel& kernel,
               void* dst_buf) {
  if (kernel.dot) {
    for (int64_t m = 0; m < M; ++m) {
      uint16_t* d = static_cast<uint16_t*>(dst_buf) + m * ldx;
      std::memcpy(d, x.ptr<uint16_t>() + m * K, K * sizeof(uint16_t));
      std::fill(d + K, d + ldx, uint16_t{0});
    }
    return;
  }
  const int64_t step = kernel.step16;
  for (int64_t m = 0; m < M; ++m) {
    float* d = static_cast<float*>(dst_buf) + m * ldx;
    std::fill(d, d + ldx, 0.0f);
    if (x.dtype == DType::kFloat32) {
      std::memcpy(d, x.ptr<float>() + m * K, K * sizeof(float));
      continue;
    }
    const uint16_t* s = x.ptr<uint16_t>() + m * K;
    const bool bf16 = x.dtype == DType::kBFloat16;
    const int64_t half_step = step / 2;
    for (int64_t k = 0; k < K; ++k) {
      const int64_t g = k / step * step, j = k - g;
      d[g + (j & 1) * half_step + j / 2] = bf16 ? half::BF16ToFloat(s[k]) : half::HalfToFloat(s[k]);
    }
  }
}

void CheckArg(const TensorView& t, const char* name, DType dtype,
              std::initializer_list<int64_t> dims) {
  PYSPEC_CHECK(t.dtype == dtype, "'", name, "' has dtype ", DTypeName(t.dtype), " but 'x' has ",
               DTypeName(dtype), "; x, w, bias and out must share one dtype");
  CheckShape(t, name, dims);
  CheckContiguous(t, name);
}

}  // namespace

void Linear(const TensorView& x, const TensorView& w, const TensorView* bias,
            const TensorView& out, ThreadPool* pool, const LinearKernels* kernels) {
  const LinearKernels& lk = kernels != nullptr ? *kernels : LinearKernels::Default();
  for (const TensorView* t : {&x, &w, bias, &out}) {
    if (t != nullptr && t->device.type == DeviceType::kCUDA) {
      throw RuntimeError("pyspec linear: got CUDA tensors; linear is not implemented on CUDA "
                         "(use torch.nn.functional.linear or cpu tensors)");
    }
  }
  CheckDType(x, "x", {DType::kFloat32, DType::kBFloat16, DType::kFloat16});
  PYSPEC_CHECK(x.ndim == 2, "'x' must be 2-D [M, K]; got shape ", x.ShapeString());
  CheckContiguous(x, "x");
  const int64_t M = x.shape[0], K = x.shape[1];
  PYSPEC_CHECK(w.ndim == 2, "'w' must be 2-D [N, K]; got shape ", w.ShapeString());
  const int64_t N = w.shape[0];
  CheckArg(w, "w", x.dtype, {N, K});
  if (bias != nullptr) CheckArg(*bias, "bias", x.dtype, {N});
  CheckArg(out, "out", x.dtype, {M, N});
  if (M == 0 || N == 0) return;

  // Widened, padded inputs and fp32 bias, shared read-only by the workers. Thread-local so
  // concurrent callers do not share them, and reused across calls.
  thread_local std::vector<float> xbuf, bbuf;
  const float* bias_f = nullptr;
  if (bias != nullptr) {
    if (bias->dtype == DType::kFloat32) {
      bias_f = bias->ptr<float>();
    } else {
      if (static_cast<int64_t>(bbuf.size()) < N) bbuf.resize(N);
      const uint16_t* s = bias->ptr<uint16_t>();
      for (int64_t n = 0; n < N; ++n) {
        bbuf[n] = bias->dtype == DType::kBFloat16 ? half::BF16ToFloat(s[n])
                                                  : half::HalfToFloat(s[n]);
      }
      bias_f = bbuf.data();
    }
  }
  ThreadPool& tp = pool != nullptr ? *pool : ThreadPool::Default();

  // The AMX path depends on the dtype and the layer's shape only, never on M, so every row of a
  // layer is computed by one kernel whatever the rows beside it.
  if (UseAmx(x.dtype, lk) && detail::AmxShapeOk(N, K)) {
    thread_local std::vector<uint16_t> packed;
    const int64_t elems = detail::AmxPackedElems(M, K);
    if (static_cast<int64_t>(packed.size()) < elems) packed.resize(elems);
    detail::AmxPackInputs(x.ptr<uint16_t>(), M, K, packed.data());
    const uint16_t* pk = packed.data();
    const uint16_t* wp = w.ptr<uint16_t>();
    uint16_t* op = static_cast<uint16_t*>(out.data);
    detail::RunBlocks(&tp, N / 16, 16 * K * 2, [&](int64_t b0, int64_t b1) {
      detail::AmxLinearBlocks(pk, wp, bias_f, op, M, N, K, b0, b1);
    });
    return;
  }

  const Kernel kernel = SelectKernel(x.dtype, lk);
  const int64_t ldx = RoundUp(std::max<int64_t>(K, 1), kPad);
  // 16 floats of slack let the rows start on a 64-byte boundary; ldx is a multiple of 32
  // elements, so every row then starts a cache line and no vector load of x splits one (about
  // 10% of the time of a 16-row step on an L2-resident layer).
  if (static_cast<int64_t>(xbuf.size()) < M * ldx + 16) xbuf.resize(M * ldx + 16);
  float* xa = xbuf.data();
  xa += ((64 - reinterpret_cast<uintptr_t>(xa) % 64) % 64) / sizeof(float);
  WidenRows(x, M, K, ldx, kernel, xa);

  Ctx c{xa, w.data, bias_f, out.data, M, N, K, ldx, x.dtype};
  const BlocksFn fn = kernel.fn;
  const int64_t blocks = (N + kNr - 1) / kNr;
  const int64_t block_bytes = std::max<int64_t>(1, kNr * K * DTypeSize(x.dtype));
  detail::RunBlocks(&tp, blocks, block_bytes, [&](int64_t b0, int64_t b1) { fn(c, b0, b1); });
}


}  // namespace pyspec
