"""Dense layers held as block codes, on a GPU: one Triton kernel reads the codes.

A 4-bit AWQ / GPTQ checkpoint (or any :class:`pyspec.linear.PackedWeight` of 4-bit or 8-bit
codes) keeps its layers' matrices as codes on the device: ``x @ W.T`` rebuilds each weight
tile in registers (``q * d + m`` in float32, rounded once to ``x``'s dtype: the value the float
matrix would hold in that dtype) and multiplies it on the tensor cores. A decoding step then
reads a quarter (4-bit) or half (8-bit) of a 16-bit matrix's bytes, and no float copy of the
matrix exists on the device, for one call or longer. The launch has a fixed grid for a given
input shape, so it replays in CUDA graphs.

Tiles: 64 output columns x 64 inputs, and 16, 32 or 64 input rows (the smallest that holds a
decode or verify step's rows; larger steps take several row tiles). Under
``TRITON_INTERPRET=1`` the kernel runs in Triton's interpreter on cpu tensors (tests).
"""

from __future__ import annotations

import contextlib
from typing import Optional

import torch

from pyspec.triton_attention import _check_interpreter, available

__all__ = ["packed_linear"]

BLOCK_N = 64
BLOCK_K = 64


def _block_m(rows: int) -> int:
    return 16 if rows <= 16 else 32 if rows <= 32 else 64


def packed_linear(x: torch.Tensor, w, bias: Optional[torch.Tensor] = None,
                  out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """``x @ W.T + bias`` for ``w`` a 4-bit or 8-bit :class:`pyspec.linear.PackedWeight` whose
    codes are on ``x``'s device: ``x`` ``[..., K]`` (float32 / bfloat16 / float16) with its
    columns in the codes' stored order (a GPTQ act-order matrix's ``perm`` already applied);
    returns ``[..., N]`` in ``x``'s dtype (into ``out`` when given)."""
    if not available():
        raise ValueError("packed_linear needs the 'triton' package (pip install triton)")
    if w.bits not in (4, 8) or w.d is None or (w.bits == 4 and w.m is None):
        raise ValueError(f"packed_linear reads 4-bit or 8-bit block codes; got {w.bits}-bit")
    n, k = w.shape
    if x.shape[-1] != k:
        raise ValueError(f"x has {x.shape[-1]} columns but the matrix {k}")
    if x.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise ValueError(f"packed_linear takes float32 / bfloat16 / float16 inputs; got {x.dtype}")
    for name, t in (("q", w.q), ("d", w.d), ("m", w.m), ("bias", bias)):
        if t is not None and (t.device != x.device or not t.is_contiguous()):
            raise ValueError(f"the codes' '{name}' must be contiguous and on x's device "
                             f"({x.device}); got {t.device}")
    if bias is not None and tuple(bias.shape) != (n,):
        raise ValueError(f"bias must be [{n}]; got {tuple(bias.shape)}")
    _check_interpreter(x.device)
    lead = x.shape[:-1]
    x2 = x.reshape(-1, k)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    rows = x2.shape[0]
    res = torch.empty(rows, n, dtype=x.dtype, device=x.device)
    if rows:
        from pyspec._triton_kernels import packed_matmul

        interpret = x.device.type != "cuda"
        bm = _block_m(rows)
        # No FMA contraction: q * d + m rounds twice, as the float matrix the codes stand for
        # was rebuilt (PackedWeight.unpack), so every weight is that matrix's value exactly.
        extra = {} if interpret else {"num_warps": 4, "num_stages": 3, "enable_fp_fusion": False}
        with torch.cuda.device(x.device) if not interpret else contextlib.nullcontext():
            packed_matmul[(-(-n // BLOCK_N), -(-rows // bm))](
                x2, w.q, w.d, w.m if w.m is not None else w.d,
                bias if bias is not None else w.d, res, rows, n, k, x2.stride(0), res.stride(0),
                BITS=w.bits, BLOCK_M=bm, BLOCK_N=BLOCK_N, BLOCK_K=BLOCK_K,
                HAS_BIAS=bias is not None,
                PREC="ieee" if x.dtype == torch.float32 else "tf32",
                WIDEN=interpret and x.dtype == torch.bfloat16, **extra)
    res = res.view(*lead, n)
    if out is None:
        return res
    out.copy_(res)
    return out
