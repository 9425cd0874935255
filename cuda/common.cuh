// Shared helpers of the CUDA sub-target. Kernel templates (*.cuh) take raw pointers and a stream and
// return cudaError_t; host ops (*.cu) validate and dispatch (DESIGN section 4).
#pragma once

#include <cuda_runtime.h>

#include "pyspec/check.h"

// Wraps a CUDA runtime call; a failure becomes pyspec::RuntimeError naming the call and the error.
#define PYSPEC_CUDA_CALL(expr)                                                                \
  do {                                                                                        \
    cudaError_t pyspec_err_ = (expr);                                                         \
    if (pyspec_err_ != cudaSuccess) {                                                         \
      throw ::pyspec::RuntimeError(::pyspec::detail::StrCat(                                  \
          "CUDA error in ", #expr, " (", __FILE__, ":", __LINE__, "): ",                      \
          cudaGetErrorName(pyspec_err_), ": ", cudaGetErrorString(pyspec_err_)));             \
    }                                                                                         \
  } while (0)
