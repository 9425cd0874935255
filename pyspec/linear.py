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

A float32 matrix whose values are exactly those of a 4-bit or 8-bit block format (groups of 32
along K: ``w = d * q + m`` with q in 0..15, or ``w = d * q`` with q in -128..127, d a float16
value; a model converted from a Q4_1 / Q8_0 GGUF, like the embedded default model, is one) can be
held as those codes too (:func:`pack_exact`, :class:`PackedWeight`): ``linear`` then reads about
5x fewer bytes per call (4-bit codes 5.3x, 8-bit 3.6x) and, rebuilding each weight exactly and
accumulating as the float32 kernel does, returns the float32 kernel's results bit for bit.
"""

from __future__ import annotations

import os
import threading
from typing import Optional

import torch
import torch.nn.functional as F

from pyspec import _C

__all__ = ["linear", "max_fast_rows", "MAX_FAST_ROWS", "PackedWeight", "pack_exact"]

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


class PackedWeight:
    """A float32 weight matrix ``dense`` [N, K] and the same values as block codes (see
    :func:`pack_exact`): ``q`` (4-bit: uint8 [N, K / 2], element j of a group of 32 in the low
    nibble of byte j, element j + 16 in its high nibble; 8-bit: int8 [N, K]), ``d`` and, for
    4-bit, ``m`` (float32 [N, K / 32]). :func:`linear` reads the codes for the few rows of decoding
    where the float32 kernel in use is the AVX2 or AVX-512 build and ``dense`` otherwise; both
    give the same bits.

    ``dense`` is None when only the codes are held (``drop_dense()``; a model loaded with
    ``packed_weights="codes"``): :func:`linear` then reads the codes wherever the core kernel
    runs and rebuilds the float32 matrix (:meth:`unpack`) for the rows beyond, the same bits as
    with ``dense`` at every M."""

    __slots__ = ("dense", "q", "d", "m", "bits", "_fixed")

    def __init__(self, dense, q, d, m, bits):
        self.dense, self.q, self.d, self.m, self.bits = dense, q, d, m, bits
        self._fixed = None

    def fixed_codes(self):
        """``(tq, td, tm)``: the codes in :func:`pyspec._C.linear_fixed`'s tile layout (made on
        first use, then kept: as many bytes again as the codes), for the ``"fixed"`` packed
        numerics (:func:`set_packed_numerics`)."""
        if self._fixed is None:
            tq, td = torch.empty_like(self.q), torch.empty_like(self.d)
            tm = None if self.m is None else torch.empty_like(self.m)
            _C.repack_fixed(self.q, self.d, self.m, tq, td, tm)
            self._fixed = (tq, td, tm)
        return self._fixed

    @property
    def shape(self):
        n, c = self.q.shape
        return torch.Size((n, c * 2 if self.bits == 4 else c))

    def unpack(self, out=None) -> torch.Tensor:
        """The float32 matrix [N, K] the codes stand for, equal bit for bit to the one packed
        (``dense`` itself when it is held and no ``out`` is given)."""
        if self.dense is not None and out is None:
            return self.dense
        if out is None:
            out = _empty(tuple(self.shape), dtype=torch.float32)
        _C.unpack_packed(self.q, self.d, self.m, out)
        return out

    def drop_dense(self) -> "PackedWeight":
        """Hold only the codes (about 5x fewer bytes for 4-bit, 3.6x for 8-bit); returns self."""
        self.dense = None
        return self

    @property
    def nbytes(self) -> int:
        """Bytes of the codes and scales (what a decoding step reads)."""
        return sum(t.numel() * t.element_size() for t in (self.q, self.d, self.m)
                   if t is not None)


def _pack4(w: torch.Tensor):
    n, k = w.shape
    g = w.view(n, k // 32, 32)
    lo = g.amin(-1, keepdim=True)
    d = ((g.amax(-1, keepdim=True) - lo) / 15).half().float()
    if not bool(torch.isfinite(d).all()):
        return None
    q = torch.round((g - lo) / torch.where(d == 0, torch.ones_like(d), d)).clamp_(0, 15)
    # Bit patterns, not values (-0.0 must stay -0.0); d * q is exact (11 x 4 significant bits).
    if not torch.equal((q * d + lo).view(torch.int32), g.view(torch.int32)):
        return None
    q = q.to(torch.uint8)
    codes = (q[..., :16] | (q[..., 16:] << 4)).reshape(n, k // 2).contiguous()
    return PackedWeight(w, codes, d.view(n, k // 32).contiguous(), lo.view(n, k // 32).contiguous(),
                        4)


def _pack8(w: torch.Tensor):
    n, k = w.shape
    g = w.view(n, k // 32, 32)
    amax = g.abs().amax(-1, keepdim=True)
    for div in (127.0, 128.0):
        d = (amax / div).half().float()
        if not bool(torch.isfinite(d).all()):
            return None
        q = torch.round(g / torch.where(d == 0, torch.ones_like(d), d))
        if not bool(((q >= -128) & (q <= 127)).all()):
            continue
        codes = q.to(torch.int8)
        # Rebuilt from the int8 codes, as the kernel does: a -0.0 weight (code 0) must fail.
        if torch.equal((codes.float() * d).view(torch.int32), g.view(torch.int32)):
            return PackedWeight(w, codes.view(n, k).contiguous(), d.view(n, k // 32).contiguous(),
                                None, 8)
    return None


def pack_exact(w, bits=(4, 8)) -> Optional["PackedWeight"]:
    """``w`` as block codes when its float32 values are exactly those of a 4-bit (``w = d * q +
    m``, q in 0..15, per group of 32 along K: m the group's minimum, d a float16 value) or else an
    8-bit (``w = d * q``, q in -128..127, d a float16 value) format, else None. Only contiguous
    float32 CPU matrices with K a multiple of 32 qualify; the check compares every value."""
    if (not isinstance(w, torch.Tensor) or w.dtype != torch.float32 or w.dim() != 2
            or not w.is_cpu or not w.is_contiguous() or w.shape[1] % 32 or w.shape[1] == 0
            or w.shape[0] == 0 or w.requires_grad):
        return None
    with torch.no_grad():
        for b in bits:
            pack = _pack4 if b == 4 else _pack8
            # A few rows first: a matrix of another format (or none) fails there, cheaply.
            if w.shape[0] > 64 and pack(w[:16]) is None:
                continue
            p = pack(w)
            if p is not None:
                return p
    return None


_packed_rows = _C._packed_max_rows
_core_packed = _C.linear_packed
_core_fixed = _C.linear_fixed
_FIXED = False  # the packed numerics (set_packed_numerics)


def set_packed_numerics(mode: str) -> str:
    """How :func:`linear` multiplies packed weights, process-wide: ``"exact"`` (the default:
    the float32 matrix's results bit for bit) or ``"fixed"`` (experimental: AMX int8 tiles with
    each float32 input row as a 32-bit fixed-point integer, :func:`pyspec._C.linear_fixed`, at
    every row count; a row's outputs never depend on the other rows of a call, so speculative
    decoding stays lossless against plain decoding in the same mode; about float32's accuracy,
    not its bits; matrices whose N is not a multiple of 16, and calls that need gradients, stay
    exact; the tile layout of a matrix's codes is kept beside them). Needs a CPU with AMX-INT8
    (ValueError elsewhere). ``PYSPEC_PACKED_NUMERICS`` sets it at import. Set it before loading a
    model or between requests, not while one is decoding. Returns the mode in use."""
    global _FIXED
    if mode not in ("exact", "fixed"):
        raise ValueError(f"packed numerics must be 'exact' or 'fixed'; got {mode!r}")
    if mode == "fixed" and not _C._fixed_available():
        raise ValueError("packed numerics 'fixed' needs a CPU with AMX-INT8 tiles (and the OS "
                         "granting their state); this one has none: use 'exact'")
    _FIXED = mode == "fixed"
    return mode


def packed_numerics() -> str:
    """The packed numerics in use: ``"exact"`` or ``"fixed"`` (:func:`set_packed_numerics`)."""
    return "fixed" if _FIXED else "exact"


if os.environ.get("PYSPEC_PACKED_NUMERICS"):
    set_packed_numerics(os.environ["PYSPEC_PACKED_NUMERICS"])


_tls = threading.local()


def _scratch(numel: int) -> torch.Tensor:
    """This thread's float32 buffer of at least ``numel`` elements, for a matrix rebuilt from its
    codes for one call: reused (no fresh pages to fault in on every prefill step) and on huge
    pages (the GEMM that reads it walks it many times)."""
    buf = getattr(_tls, "buf", None)
    if buf is None or buf.numel() < numel:
        from pyspec.hugepages import MIN_BYTES, huge_page_empty

        buf = _tls.buf = None  # the old one goes first
        # At least the size huge pages are given for (the default model's largest layer matrix,
        # 7 MB, is below it).
        buf = _tls.buf = huge_page_empty((max(numel, MIN_BYTES // 4),), torch.float32)
    return buf[:numel]


def _linear_packed(x, w: PackedWeight, bias, out):
    dense = w.dense
    if (x.dtype is not torch.float32 or not x.is_cpu
            or (_is_grad_enabled() and (x.requires_grad
                                        or (dense is not None and dense.requires_grad)
                                        or (bias is not None and bias.requires_grad)))):
        return linear(x, w.unpack(), bias, out)  # autograd keeps it: a tensor of its own
    shape = x.shape
    rows = x.numel() // shape[-1] if len(shape) and shape[-1] else 0
    # Up to the rows where the codes beat the float32 matrix with the kernel in use (32 on
    # AVX-512, 4 on AVX2, 0 where the packed kernel cannot run: other ISAs), and never past the
    # rows the dense route gives the core kernel (beyond them it takes torch's GEMM). With the
    # codes alone, up to the core kernel's rows (the packed kernel has its bits at every M).
    n, k = w.shape
    if _FIXED and n % 16 == 0:
        # Fixed numerics: the tiles at every M (a row's outputs never depend on its call).
        if shape[-1] != k or (bias is not None and bias.dtype is not torch.float32):
            raise ValueError(f"linear: x must be [..., {k}] and bias float32 for this packed "
                             f"weight; got x {tuple(shape)}, bias "
                             f"{None if bias is None else bias.dtype}")
        if rows == 0:
            res = x.new_empty((*shape[:-1], n))
            return res if out is None else out
        x2 = x.contiguous().view(rows, k)
        bias = None if bias is None else bias.contiguous()
        res = _empty((rows, n), dtype=torch.float32) if out is None else (
            out if out.dim() == 2 else out.view(rows, n))
        tq, td, tm = w.fixed_codes()
        _core_fixed(x2, tq, td, tm, bias, res)
        if out is not None:
            return out
        return res if len(shape) == 2 else res.view(*shape[:-1], n)
    limit = _packed_rows() if dense is not None else (_MAX_ROWS[torch.float32]
                                                      if _packed_rows() else 0)
    if (rows == 0 or rows > limit or rows > _MAX_ROWS[torch.float32]
            or shape[-1] != k or not x.is_contiguous()
            or (bias is not None and (bias.dtype is not torch.float32
                                      or not bias.is_contiguous()))):
        return linear(x, dense if dense is not None else w.unpack(_scratch(n * k).view(n, k)),
                      bias, out)
    x2 = x if len(shape) == 2 else x.view(rows, shape[-1])
    res = _empty((rows, n), dtype=torch.float32) if out is None else (
        out if out.dim() == 2 else out.view(rows, n))
    _core_packed(x2, w.q, w.d, w.m, bias, res)
    if out is not None:
        return out
    return res if len(shape) == 2 else res.view(*shape[:-1], n)


def linear(x, w, bias=None, out=None):
    """Return ``x @ w.T + bias`` (like ``torch.nn.functional.linear``).

    Args:
        x: ``[..., K]`` input.
        w: ``[N, K]`` weight.
        bias: ``[N]`` or None.
        out: optional ``[..., N]`` contiguous output tensor to write (fast path only; otherwise
            the result is copied into it).

    ``w`` may be a :class:`PackedWeight`: the codes are read for float32 inputs of at most
    ``_C._packed_max_rows()`` rows (32 with the AVX-512 build of the float32 kernel, 4 with the
    AVX2 one, 0 elsewhere), its dense matrix otherwise; without a dense matrix (codes only), the
    codes up to ``max_fast_rows(torch.float32)`` rows and the matrix rebuilt for the call beyond.

    The fast path applies when all tensors are contiguous CPU tensors of one supported dtype,
    ``x`` has at most ``max_fast_rows(dtype)`` rows (leading dims flattened) and no input needs a
    gradient. It accumulates in fp32 and rounds each output once.
    """
    if type(w) is PackedWeight:
        return _linear_packed(x, w, bias, out)
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
