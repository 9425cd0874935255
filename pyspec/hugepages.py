"""CPU tensors on transparent huge pages.

Decoding streams every weight matrix from memory once per step, and attention walks the KV pool.
On 4 KiB pages that means a TLB miss every 4 KiB; Linux kernels set to ``transparent_hugepage=
madvise`` (a common default) back ordinary allocations with 4 KiB pages and give 2 MiB pages only
to ranges that ask for them. This module allocates one private anonymous mapping, asks for huge
pages on it (``MADV_HUGEPAGE``) before its pages are first touched, and places tensors in it.

The gain is measured in docs/experiments/2026-12-04-alignment-prefetch-hugepages.md (target steps
of a few rows and the dense layers alone, on huge pages against 4 KiB pages). A dense loop that
does more than stream its weights (several input rows) keeps fewer misses in flight and stalls on
the page walks; with 2 MiB pages there are 512 times fewer.

Where the platform has no ``MADV_HUGEPAGE`` (not Linux), where the mapping cannot be made, or with
``PYSPEC_HUGEPAGES=0``, tensors stay where they are. The contents and dtypes never change, so
results are the same bit for bit either way.
"""

from __future__ import annotations

import math
import mmap
import os
from typing import List, Optional, Sequence

import torch

__all__ = ["Arena", "enabled", "huge_page_copies", "huge_page_empty"]

_HUGE = 2 << 20
_ALIGN = 64  # bytes: every tensor starts on a cache line
# Smaller requests stay on ordinary pages: their TLB misses are few, and a mapping of its own
# costs a system call and a zeroed 2 MiB page at first touch (a test suite making thousands of
# tiny models and pools took 19% longer with every one of them mapped).
MIN_BYTES = 8 << 20


def enabled() -> bool:
    """Whether tensors are placed on huge pages: Linux's ``MADV_HUGEPAGE`` exists and
    ``PYSPEC_HUGEPAGES`` is not ``0``."""
    return (os.environ.get("PYSPEC_HUGEPAGES", "1") != "0" and hasattr(mmap, "MADV_HUGEPAGE")
            and hasattr(mmap, "MAP_PRIVATE") and hasattr(mmap, "MAP_ANONYMOUS"))


def _arena(nbytes: int) -> Optional[torch.Tensor]:
    """A uint8 tensor of ``nbytes`` starting on a 2 MiB boundary inside a fresh private mapping
    advised for huge pages (zero-filled, untouched), or None where that cannot be had."""
    if not enabled() or nbytes <= 0 or nbytes < MIN_BYTES:
        return None
    try:
        mm = mmap.mmap(-1, nbytes + _HUGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        mm.madvise(mmap.MADV_HUGEPAGE)
    except (OSError, ValueError):
        return None
    base = torch.frombuffer(mm, dtype=torch.uint8)  # keeps the mapping alive
    start = (-base.data_ptr()) % _HUGE
    return base[start:start + nbytes]


def _movable(t) -> bool:
    return (isinstance(t, torch.Tensor) and t.device.type == "cpu" and t.is_contiguous()
            and not t.requires_grad)


def _padded(t: torch.Tensor) -> int:
    return -(-t.numel() * t.element_size() // _ALIGN) * _ALIGN


class Arena:
    """Room for given tensors in one huge-page mapping; :meth:`copy` fills it in order, so a
    caller can drop each source as soon as its copy exists instead of holding every source until
    every copy is made."""

    def __init__(self, base: torch.Tensor):
        self._base = base
        self._off = 0

    @classmethod
    def for_tensors(cls, tensors: Sequence[torch.Tensor]) -> Optional["Arena"]:
        """An arena sized for ``tensors`` (each once), or None where huge pages are unavailable,
        the total is under ``MIN_BYTES``, or a tensor is not a contiguous CPU tensor without
        autograd."""
        if not all(_movable(t) for t in tensors):
            return None
        base = _arena(sum(_padded(t) for t in tensors))
        return None if base is None else cls(base)

    def copy(self, t: torch.Tensor) -> torch.Tensor:
        n = t.numel() * t.element_size()
        if self._off + n > self._base.numel():
            raise ValueError("the arena has no room left for this tensor")
        c = self._base[self._off:self._off + n].view(t.dtype).view(t.shape)
        c.copy_(t)
        self._off += _padded(t)
        return c


def huge_page_copies(tensors: Sequence[Optional[torch.Tensor]]) -> List[Optional[torch.Tensor]]:
    """Copies of contiguous CPU ``tensors`` packed into one huge-page mapping, in order (None
    stays None; a tensor given twice gets one copy, so ties like a shared embedding/lm_head are
    kept). Returns the tensors themselves when huge pages are not available, when they hold
    fewer than ``MIN_BYTES`` in all, or when any of them is not a contiguous CPU tensor without
    autograd.

    The copies are views of one storage: ``torch.save`` of one of them writes the whole mapping,
    and safetensors refuses to save several of them together; clone a tensor before saving it."""
    uniq = list({id(t): t for t in tensors if t is not None}.values())
    arena = Arena.for_tensors(uniq)
    if arena is None:
        return list(tensors)
    done = {id(t): arena.copy(t) for t in uniq}
    return [None if t is None else done[id(t)] for t in tensors]


def huge_page_empty(shape, dtype: torch.dtype, device="cpu") -> torch.Tensor:
    """An uninitialized-contract (in fact zero-filled) CPU tensor on huge pages, or
    ``torch.empty`` on another device, where huge pages are not available, or for fewer than
    ``MIN_BYTES``."""
    arena = (_arena(math.prod(int(s) for s in shape) * dtype.itemsize)
             if torch.device(device).type == "cpu" else None)
    if arena is None:
        return torch.empty(shape, dtype=dtype, device=device)
    return arena.view(dtype).view(shape)
