"""Tensor ops of the core, dispatched on the tensors' device (CPU or CUDA).

Every op validates its arguments and raises ``ValueError`` naming the bad argument; a CUDA tensor
in a build or on a machine without CUDA raises ``RuntimeError`` saying why.
"""

from __future__ import annotations

from pyspec import _C

__all__ = ["cuda_available", "materialize_kv"]


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
