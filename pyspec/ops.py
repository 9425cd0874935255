"""Tensor ops of the core, dispatched on the tensors' device (CPU or CUDA).

Every op validates its arguments and raises ``ValueError`` naming the bad argument; a CUDA tensor
in a build or on a machine without CUDA raises ``RuntimeError`` saying why.
"""

from __future__ import annotations

import contextlib
import threading

import torch

from pyspec import _C

__all__ = ["cuda_available", "materialize_kv", "rms_norm", "rotary_qkv"]


_threads_saved = threading.local()  # per Python thread: the counts torch_threads replaced


@contextlib.contextmanager
def torch_threads(n: int):
    """Run the block with torch's intra-op thread count set to ``n`` (restored after)."""
    prev = torch.get_num_threads()
    if prev == n:
        yield
        return
    stack = _threads_saved.__dict__.setdefault("stack", [])
    stack.append(prev)
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(prev)
        stack.pop()


def outer_torch_threads() -> int:
    """torch's thread count outside every :func:`torch_threads` block this Python thread is in (a
    large step nested in a small one's block takes its threads back with it)."""
    stack = getattr(_threads_saved, "stack", None)
    return stack[0] if stack else torch.get_num_threads()


def cuda_available() -> bool:
    """True when this build has CUDA support and a CUDA device is usable."""
    return bool(_C.built_with_cuda) and _C.cuda_device_count() > 0


def _stream_of(t) -> int:
    dev = getattr(t, "device", None)
    if dev is not None and getattr(dev, "type", None) == "cuda":
        import torch

        return torch.cuda.current_stream(dev).cuda_stream
    return 0


def materialize_kv(scratch, pages, src_rows, dst_slots) -> None:
    """Copy accepted draft rows from the per-step scratch area into the paged KV pool, in place.

    ``pages.view(-1, H, D)[dst_slots[i]] = scratch[src_rows[i]]`` for every i (and every layer).

    Args:
        scratch: ``[S, kv_heads, head_dim]`` or ``[L, S, kv_heads, head_dim]``, fp32/fp16/bf16.
        pages: ``[num_blocks, block_size, kv_heads, head_dim]`` (or with a leading ``L``), same dtype.
        src_rows: int32/int64 ``[n]``, rows of ``scratch``.
        dst_slots: int32/int64 ``[n]``, flat slots ``block_id * block_size + offset``.
    """
    _C.materialize_kv(scratch, pages, src_rows, dst_slots, _stream_of(scratch))


def kv_storable(act_dtype, kv_dtype) -> bool:
    """Whether K/V computed in ``act_dtype`` may be stored as ``kv_dtype``: the same dtype, or
    float16 / bfloat16 under float32 activations (a 16-bit KV cache; the core's rotary op,
    decoder stack and attention take that pair)."""
    import torch

    return kv_dtype == act_dtype or (act_dtype == torch.float32
                                     and kv_dtype in (torch.float16, torch.bfloat16))


def _core_ok(*tensors) -> bool:
    """True when the core's CPU layer ops can take these tensors: CPU, contiguous, float32 /
    bfloat16 / float16, and no autograd in play."""
    import torch

    grad = torch.is_grad_enabled()
    for t in tensors:
        if (not t.is_cpu or not t.is_contiguous() or (grad and t.requires_grad)
                or t.dtype not in (torch.float32, torch.bfloat16, torch.float16)):
            return False
    return True


def rms_norm(x, w, eps: float):
    """RMSNorm over the last dim, as Hugging Face's Llama computes it: ``w * (x * rsqrt(mean(x**2)
    + eps))`` in float32, the normalized value rounded to ``x``'s dtype before the weight multiplies.

    CPU tensors (contiguous, no autograd) take the core's one-call op (``_C.rms_norm``); others the
    same formula in torch ops. Either way a row's result depends only on that row.
    """
    import torch

    if x.dim() >= 1 and x.dtype == w.dtype and _core_ok(x, w) and x.numel():
        out = torch.empty_like(x)
        _C.rms_norm(x.view(-1, x.shape[-1]), w, float(eps), out.view(-1, x.shape[-1]))
        return out
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return w * xf.to(x.dtype)


def silu_mul(gu, inter: int):
    """``silu(gu[:, :inter]) * gu[:, inter:]`` for a fused gate/up projection ``gu`` ``[T, 2 *
    inter]``. CPU tensors (contiguous, no autograd) take the core's one-call op
    (``_C.silu_mul``); others torch ops. Each result is rounded to the dtype as torch's
    ``silu(gate) * up`` does; the core computes ``exp`` with the C library, so a value can differ
    from torch's in its last bit."""
    import torch
    import torch.nn.functional as F

    if gu.dim() == 2 and gu.shape[1] == 2 * inter and _core_ok(gu) and gu.numel():
        out = torch.empty(gu.shape[0], inter, dtype=gu.dtype)
        _C.silu_mul(gu, out)
        return out
    return F.silu(gu[:, :inter]) * gu[:, inter:]


def rotary_qkv(qkv, cos, sin, num_heads: int, num_kv_heads: int, k_out, v_out):
    """Split a fused projection ``qkv`` ``[T, (H + 2 Hkv) D]`` into rotated ``q`` (returned,
    ``[T, H, D]``), rotated ``k`` and plain ``v`` (written into ``k_out`` / ``v_out``,
    ``[T, Hkv, D]``). ``cos``/``sin``: float32 ``[T, D]`` in rotate-half layout.

    CPU tensors (contiguous, no autograd) take the core's one-call op (``_C.rotary_qkv``); others
    torch ops with the same float32 arithmetic.
    """
    import torch

    t = qkv.shape[0]
    d = cos.shape[-1]
    if (_core_ok(qkv, k_out, v_out) and cos.dtype == sin.dtype == torch.float32
            and cos.is_cpu and cos.is_contiguous() and sin.is_contiguous()
            and k_out.dtype == v_out.dtype and kv_storable(qkv.dtype, k_out.dtype)):
        q = torch.empty(t, num_heads, d, dtype=qkv.dtype)
        _C.rotary_qkv(qkv, cos, sin, q, k_out, v_out)
        return q
    qs, ks = num_heads * d, num_kv_heads * d
    c, s = cos[:, None, :], sin[:, None, :]

    def rotate(x):
        half = d // 2
        rot = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
        return x * c + rot * s

    q = rotate(qkv[:, :qs].view(t, num_heads, d).float()).to(qkv.dtype)
    k_out.copy_(rotate(qkv[:, qs:qs + ks].view(t, num_kv_heads, d).float()))
    v_out.copy_(qkv[:, qs + ks:].view(t, num_kv_heads, d))
    return q
