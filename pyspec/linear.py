"""Dense layer ``x @ w.T + bias`` with a fast CPU path for decoding.

Decoding multiplies a handful of activation rows (one token, or a small draft tree) by every
weight matrix, so it is bound by how fast the weights stream from memory. ``torch.nn.functional
.linear`` reaches about half of the machine's read bandwidth there; the core kernel
(``pyspec._C.linear``, see ``cpp/include/pyspec/linear.h``) reads each weight row once per call
with all input rows in registers and splits the output over the core's thread pool.

``linear`` uses the core kernel for CPU tensors of one dtype (float32, bfloat16 or float16) with
at most ``MAX_FAST_ROWS`` input rows and no autograd, and ``torch.nn.functional.linear`` otherwise.
It is called several times per layer per token, so it checks only what decides the route; the core
validates shapes and contiguity and raises ``ValueError`` naming the argument.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from pyspec import _C

__all__ = ["linear", "MAX_FAST_ROWS"]

# Above this many input rows torch's GEMM (which blocks over M) beats a kernel that re-reads the
# inputs once per block of weight rows; 16 covers decoding and draft trees. Half-precision weights
# are widened in the inner loop, which makes the kernel compute-bound sooner: measured on the
# SmolLM2 shapes (bench/bench_linear.py), bf16 is 1.4x torch at 4 rows and 0.7x at 16.
MAX_FAST_ROWS = 16
_MAX_ROWS = {torch.float32: 16, torch.bfloat16: 8, torch.float16: 8}

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
    ``x`` has at most ``MAX_FAST_ROWS`` rows (leading dims flattened) and no input needs a
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
