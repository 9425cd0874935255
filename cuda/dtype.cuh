// float <-> storage-dtype conversions shared by the kernels.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

namespace pyspec {
namespace kernels {

template <typename T>
__device__ __forceinline__ float ToF(T x);
template <>
__device__ __forceinline__ float ToF<float>(float x) { return x; }
template <>
__device__ __forceinline__ float ToF<__half>(__half x) { return __half2float(x); }
template <>
__device__ __forceinline__ float ToF<__nv_bfloat16>(__nv_bfloat16 x) { return __bfloat162float(x); }

template <typename T>
__device__ __forceinline__ T FromF(float x);
template <>
__device__ __forceinline__ float FromF<float>(float x) { return x; }
template <>
__device__ __forceinline__ __half FromF<__half>(float x) { return __float2half_rn(x); }
template <>
__device__ __forceinline__ __nv_bfloat16 FromF<__nv_bfloat16>(float x) {
  return __float2bfloat16_rn(x);
}

}  // namespace kernels
}  // namespace pyspec
