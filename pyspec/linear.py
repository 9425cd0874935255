"""Dense layer ``x @ w.T + bias`` with a fast CPU path for decoding.

Decoding multiplies a handful of activation rows (one token, or a small draft tree) by every
weight matrix, so it is bound by how fast the weights stream from memory. ``torch.nn.functional
.linear`` reaches about half of the machine's read bandwidth there; the core kernel
(``pyspec._C.linear``, see ``cpp/include/pyspec/linear.h``) reads each weight row once per call
with all input rows in registers and splits the output over the core's thread pool.

``linear`` uses the core kernel for CPU tensors of one dtype (float32, bfloat16 or float16) with
at most ``max_fast_rows(dtype)`` input rows and no autograd, and ``torch.nn.functional.linear``
otherwise.
It is called several times per layer per token, so it checks only what decides the route; the core
validates shapes and contiguity and raises ``ValueError`` naming the argument.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from pyspec import _C

__all__ = ["linear", "max_fast_rows", "MAX_FAST_ROWS"]

# Rows up to which the core kernel beats torch's GEMM (which blocks over M), by the build that runs
# the dtype here (``_C._linear_kernel``). Measured on the SmolLM2-135M shapes (bench/bench_linear.py
# --rows, 2 threads, AMD EPYC with AVX-512): float32 stays ahead of torch at every M up to 64 in
# both the AVX2 and the AVX-512 builds (e.g. 37.6 vs 70.7 ms per model pass at 16 rows); bfloat16
# through vdpbf16ps clearly up to 16 (23.8 vs 34.3 ms), level with torch at 32-64 (40.4 vs 43.6,
# 58.4 vs 49.7 in two runs at 32), but widened to fp32 (AVX2) only up to 8; float16 (widened)
# ahead from 8 rows on. bfloat16 on AMX tiles (Intel Xeon with AMX, 2 threads; torch's GEMM also
# uses AMX there): 11.0 / 12.7 / 25.2 ms at 1 / 16 / 64 rows against torch's 21.4 / 23.2 / 30.1,
# behind it from 96 rows (38.7 vs 36.3). Up to the limit every row is computed alike, so a draft
# tree of that many nodes is scored exactly as plain decoding scores its rows.
_ROW_LIMITS = {("float32", "avx512"): 64, ("float32", "avx2"): 64, ("float32", "generic"): 16,
               ("bfloat16", "amx-bf16"): 64, ("bfloat16", "avx512-bf16"): 32,
               ("bfloat16", "avx2"): 8, ("bfloat16", "generic"): 8,
               ("float16", "avx512"): 64, ("float16", "avx2"): 64, ("float16", "generic"): 8}
_DTYPE_NAMES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}


def max_fast_rows(dtype) -> int:
    """Input rows up to which ``linear`` runs the core kernel for ``dtype`` on this machine."""
    name = _DTYPE_NAMES[dtype]
    return _ROW_LIMITS[name, _C._linear_kernel(name)]


_MAX_ROWS = {dt: max_fast_rows(dt) for dt in _DTYPE_NAMES}  # for this process's CPU
MAX_FAST_ROWS = max(_MAX_ROWS.values())


def fast_rows(dtype) -> int:
    """``max_fast_rows(dtype)`` for this process's CPU, 0 for a dtype the core kernel lacks."""
    return _MAX_ROWS.get(dtype, 0)

_FAST_DTYPES = frozenset((torch.float32, torch.bfloat16, torch.float16))
_core_linear = _C.linear
_is_grad_enabled = torch.is_grad_enabled
_empty = torch.empty


def linear(x, w, bias=None, out=None):
    """Return ``x @ w.T + bias`` (like ``torch.nn.functional.linear``).

    Args:
        x: ``[..., K]`` input.
        w: ``[N, K]`` weight.
        bias: ``[N]`` or None.
        out: optional ``[..., N]`` contiguous output tensor to write (fast path only; otherwise
            the result is copied into it).

    The fast path applies when all tensors are contiguous CPU tensors of one supported dtype,
    ``x`` has at most ``max_fast_rows(dtype)`` rows (leading dims flattened) and no input needs a
    gradient. It accumulates in fp32 and rounds each output once.
    """
    dtype = x.dtype
    if (
        not x.is_cpu
        or dtype not in _FAST_DTYPES
        or (_is_grad_enabled() and (x.requires_grad or w.requires_grad
                                    or (bias is not None and bias.requires_grad)))
    ):
        return _fallback(x, w, bias, out)
    shape = x.shape
    if len(shape) == 2:
        rows = shape[0]
        x2 = x
    else:
        rows = x.numel() // shape[-1] if shape and shape[-1] else 0
        if len(shape) == 0 or rows == 0 or not x.is_contiguous():
            return _fallback(x, w, bias, out)
        x2 = x.view(rows, shape[-1])
    if rows > _MAX_ROWS[dtype] or not x2.is_contiguous() or not w.is_contiguous():
        return _fallback(x, w, bias, out)
    n = w.shape[0]
    if out is None:
        res = _empty((rows, n), dtype=dtype)
        _core_linear(x2, w, bias, res)
        return res if len(shape) == 2 else res.view(*shape[:-1], n)
    _core_linear(x2, w, bias, out if out.dim() == 2 else out.view(rows, n))
    return out


def _fallback(x, w, bias, out):
    res = F.linear(x, w, bias)
    if out is None:
        return res
    out.copy_(res)
    return out
