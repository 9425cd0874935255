"""Tree attention written in Triton: one pass over each request's prefix for all of its tree rows.

``tree_attention(..., backend="triton")`` runs this kernel instead of pyspec's CUDA kernels. It
reads the same plan (:func:`pyspec.attention.plan_attention`) and tensors and returns the same
result within float rounding. The layout follows ``shared/research/gpu-tree-attention.md``:

* A request's new rows and the query heads of one KV head are packed as the rows of one tile,
  ``row = node * group + g``, up to 128 rows per tile (16 for head dims over 128). A 16-node tree
  of a GQA-4 model is one 64-row tile, so each K/V page of its prefix is read once per KV head
  (the CUDA kernel's 64-vector tiles read a 64-node tree's prefix four times). Each request gets
  the smallest tile that holds its rows (16 to 128), one launch per tile height in the step.
* The prefix is streamed in 64-key tiles gathered through the page table (Triton pipelines the
  loads), with no mask but the bounds; the request's own new tokens come last, under the tree's
  ancestor bits (or the causal rule for a chunk), only up to the tile's last node.
* When the step has too few tiles to fill the GPU, each request's prefix is split into chunks of
  at least 512 keys whose partial results are merged by log-sum-exp in a second kernel.

Triton compiles the kernels for the GPU. In a process started with ``TRITON_INTERPRET=1`` they run
in Triton's interpreter on cpu tensors instead, which is how they are tested where no GPU is present
(slowly: for tests only).
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
from typing import Optional

import torch

__all__ = ["available", "tree_attention_triton"]

BLOCK_N = 64  # keys per tile
MAX_BLOCK_M = 128  # packed rows per tile
MIN_CHUNK = 512  # fewest prefix keys per split


def available() -> bool:
    """True when the ``triton`` package is installed."""
    return importlib.util.find_spec("triton") is not None


def _pow2(x: int) -> int:
    return 1 << max(0, int(x) - 1).bit_length()


def _tile_rows(rows: int, max_block_m: int) -> int:
    """The tile height for a request of ``rows`` packed rows: the power of two that holds them,
    16 (the MMA's least) to ``max_block_m``."""
    return min(max_block_m, max(16, _pow2(rows)))


def _partition(q_indptr, prefix_lens, group, num_kv_heads, num_sms, min_chunk=MIN_CHUNK,
               max_block_m=MAX_BLOCK_M):
    """The work of one step, grouped by tile height (a decode request's 4 packed rows get a
    16-row tile, not the 128 rows of a 64-node tree beside it in the batch):
    ``({block_m: (items, merges)}, partial rows)``. An item is ``[b, row_begin, kv_begin,
    kv_end, with_new, slot]``, a merge ``[b, row_begin, slot, chunks]``; chunk ``c`` of a split
    tile writes partial rows ``slot + c * block_m``."""
    lens = [q_indptr[i + 1] - q_indptr[i] for i in range(len(prefix_lens))]
    heights = [_tile_rows(n * group, max_block_m) for n in lens]
    tiles = [-(-n * group // m) for n, m in zip(lens, heights)]
    base = sum(tiles) * num_kv_heads
    # FlashDecoding's rule of thumb: split the prefix only while the tiles leave SMs idle.
    splits = 1 if base == 0 or base >= 0.8 * num_sms else -(-2 * num_sms // base)
    groups, part_rows = {}, 0
    for b, (n, pre, block_m) in enumerate(zip(lens, prefix_lens, heights)):
        if n == 0:
            continue
        items, merges = groups.setdefault(block_m, ([], []))
        chunks = max(1, min(splits, pre // min_chunk))
        size = -(-pre // chunks) if chunks > 1 else pre
        size = -(-size // BLOCK_N) * BLOCK_N
        chunks = -(-pre // size) if chunks > 1 else 1
        for t in range(tiles[b]):
            row = t * block_m
            if chunks == 1:
                items.append((b, row, 0, pre, 1, -1))
                continue
            merges.append((b, row, part_rows, chunks))
            for c in range(chunks):
                items.append((b, row, c * size, min(pre, (c + 1) * size), int(c == chunks - 1),
                              part_rows + c * block_m))
            part_rows += chunks * block_m
    for items, _ in groups.values():
        items.sort(key=lambda it: -(it[3] - it[2]))  # longest first: the last wave is short
    return groups, part_rows


class _Step:
    """A plan's metadata and partition on one device, for one head layout (cached on the plan)."""

    def __init__(self, plan, device, num_q_heads, num_kv_heads, num_sms, min_chunk, max_block_m):
        arrays = plan._step_arrays()
        host = {n: torch.frombuffer(bytearray(arrays[n]), dtype=dt) if arrays[n]
                else torch.zeros(0, dtype=dt)
                for n, dt in (("q_indptr", torch.int64), ("prefix_lens", torch.int64),
                              ("page_indptr", torch.int64), ("pages", torch.int32),
                              ("tree_flags", torch.uint8), ("masks", torch.int64))}
        self.group = num_q_heads // num_kv_heads
        groups, self.part_rows = _partition(host["q_indptr"].tolist(),
                                            host["prefix_lens"].tolist(), self.group,
                                            num_kv_heads, num_sms, min_chunk, max_block_m)
        groups = sorted(groups.items())
        # One upload per step: every array the kernels read, as int64, in one buffer (each part
        # padded to 16 bytes and to at least one element, so that every pointer is valid).
        parts = [host[n].to(torch.int64) for n in ("q_indptr", "page_indptr", "pages",
                                                    "tree_flags", "masks")]
        for _, (items, merges) in groups:
            parts += [torch.tensor(items, dtype=torch.int64).view(-1),
                      torch.tensor(merges or [[0] * 4], dtype=torch.int64).view(-1)]
        sizes = [max(2, p.numel() + p.numel() % 2) for p in parts]
        flat = torch.zeros(sum(sizes), dtype=torch.int64)
        for p, v in zip(parts, torch.split(flat, sizes)):
            v[:p.numel()] = p
        views = torch.split(flat.to(device), sizes)
        self.q_indptr, self.page_indptr, self.pages, self.tree_flags, self.masks = views[:5]
        # Per tile height: (block_m, items, merges, their device tensors).
        self.groups = [(m, len(items), len(merges), views[5 + 2 * k], views[6 + 2 * k])
                       for k, (m, (items, merges)) in enumerate(groups)]
        self.num_items = sum(g[1] for g in self.groups)
        self.num_merges = sum(g[2] for g in self.groups)
        self.mask_words = int(arrays["mask_words"])


def _num_sms(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 4  # the interpreter: small, so that tests exercise split prefixes


def tree_attention_triton(plan, q, k_pages, v_pages, k_new, v_new, scale: float,
                          out: torch.Tensor, lse: Optional[torch.Tensor],
                          num_sms: Optional[int] = None, min_chunk: int = MIN_CHUNK) -> None:
    """Runs the Triton tree-attention kernel into ``out`` (and ``lse``); see the module doc.

    Arguments are those of :func:`pyspec.attention.tree_attention` after its checks; ``num_sms``
    and ``min_chunk`` override the processor count the split rule aims at and the fewest keys of a
    prefix chunk (for tests)."""
    if not available():
        raise ValueError("backend='triton' needs the 'triton' package (pip install triton)")
    tensors = {"q": q, "k_pages": k_pages, "v_pages": v_pages, "k_new": k_new, "v_new": v_new,
               "out": out}
    if lse is not None:
        tensors["lse"] = lse
    for name, t in tensors.items():
        if t.device != q.device:
            raise ValueError(f"'{name}' is on {t.device} but 'q' is on {q.device}")
        if not t.is_contiguous():
            raise ValueError(f"'{name}' must be contiguous")
    if q.dim() != 3 or k_pages.dim() != 4 or k_new.dim() != 3:
        raise ValueError("expected q [T, Hq, D], k_pages [num_blocks, block_size, Hkv, D] and "
                         f"k_new [T, Hkv, D]; got {tuple(q.shape)}, {tuple(k_pages.shape)} and "
                         f"{tuple(k_new.shape)}")
    t_rows, hq, d = q.shape
    nb, page, hkv, dk = k_pages.shape
    if q.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise ValueError(f"backend='triton' supports float32/bfloat16/float16; got {q.dtype}")
    for name, t in (("k_pages", k_pages), ("v_pages", v_pages), ("k_new", k_new),
                    ("v_new", v_new), ("out", out)):
        if t.dtype != q.dtype:
            raise ValueError(f"backend='triton' needs '{name}' in q's dtype {q.dtype}; "
                             f"got {t.dtype}")
    if tuple(v_pages.shape) != tuple(k_pages.shape) or dk != d or \
            tuple(k_new.shape) != (t_rows, hkv, d) or tuple(v_new.shape) != (t_rows, hkv, d) or \
            tuple(out.shape) != tuple(q.shape):
        raise ValueError("tensor shapes do not agree: q/out [T, Hq, D], k/v pages "
                         "[num_blocks, block_size, Hkv, D], k/v new [T, Hkv, D]; got "
                         f"q {tuple(q.shape)}, k_pages {tuple(k_pages.shape)}, v_pages "
                         f"{tuple(v_pages.shape)}, k_new {tuple(k_new.shape)}, v_new "
                         f"{tuple(v_new.shape)}, out {tuple(out.shape)}")
    if hkv < 1 or hq % hkv != 0:
        raise ValueError(f"num_q_heads ({hq}) must be a multiple of num_kv_heads ({hkv})")
    if not 1 <= d <= 256:
        raise ValueError(f"backend='triton' supports head_dim 1..256; got {d}")
    if t_rows != plan.num_queries or page != plan.block_size or nb != plan.num_blocks:
        raise ValueError(f"the plan is for {plan.num_queries} rows, pages of "
                         f"{plan.block_size} and {plan.num_blocks} blocks; got q with "
                         f"{t_rows} rows and k_pages {tuple(k_pages.shape)}")
    if plan.num_kv_heads and (plan.num_q_heads, plan.num_kv_heads) != (hq, hkv):
        raise ValueError(f"the plan was built for {plan.num_q_heads}/{plan.num_kv_heads} q/kv "
                         f"heads but the tensors have {hq}/{hkv}")
    if lse is not None and (lse.dtype != torch.float32 or tuple(lse.shape) != (t_rows, hq)):
        raise ValueError(f"'lse' must be float32 [{t_rows}, {hq}]; got {lse.dtype} "
                         f"{tuple(lse.shape)}")
    if t_rows == 0:
        return
    sms = num_sms or _num_sms(q.device)
    block_d = max(16, _pow2(d))
    # Head dims over 128 keep every register (sm_90, no spill) only with 16-row tiles.
    max_block_m = MAX_BLOCK_M if block_d <= 128 else 16
    key = ("_triton_step", str(q.device), hq, hkv, sms, min_chunk, max_block_m)
    step = plan.__dict__.get(key)
    if step is None:
        step = _Step(plan, q.device, hq, hkv, sms, min_chunk, max_block_m)
        plan.__dict__[key] = step
    interpret = q.device.type != "cuda"
    if interpret and os.environ.get("TRITON_INTERPRET") != "1":
        raise ValueError("backend='triton' runs on CUDA tensors (on cpu tensors only in Triton's "
                         f"interpreter, TRITON_INTERPRET=1, for tests); got {q.device}")
    from pyspec._triton_kernels import merge, tree_attn as attn
    prec = "ieee" if q.dtype == torch.float32 else "tf32"
    part_o = part_lse = out  # placeholders the kernel never touches without a split
    if step.part_rows:
        part_o = torch.empty(hkv * step.part_rows * block_d, dtype=torch.float32,
                             device=q.device)
        part_lse = torch.empty(hkv * step.part_rows, dtype=torch.float32, device=q.device)
    lse_arg = lse if lse is not None else out
    # Triton launches on torch's current device: the tensors' own, for a model on cuda:N.
    with torch.cuda.device(q.device) if not interpret else contextlib.nullcontext():
        for block_m, num_items, num_merges, items, merges in step.groups:
            extra = {} if interpret else {"num_warps": 4 if block_m <= 64 else 8,
                                          "num_stages": 3 if block_d <= 128 else 2}
            attn[(num_items, hkv)](
                items, step.q_indptr, step.page_indptr, step.pages, step.tree_flags, step.masks,
                q, k_pages, v_pages, k_new, v_new, out, lse_arg, part_o, part_lse,
                float(scale) * 1.4426950408889634, step.part_rows, hq,
                q.stride(0), q.stride(1), k_pages.stride(0), k_pages.stride(1),
                k_pages.stride(2), k_new.stride(0), k_new.stride(1), out.stride(0),
                out.stride(1), GROUP=step.group, D=d, BLOCK_D=block_d, BLOCK_M=block_m,
                BLOCK_N=BLOCK_N, PAGE=page, MASK_WORDS=step.mask_words,
                HAS_LSE=lse is not None, PREC=prec,
                WIDEN=interpret and q.dtype == torch.bfloat16, **extra)
            if num_merges:
                merge[(num_merges, hkv)](
                    merges, step.q_indptr, part_o, part_lse, out, lse_arg, step.part_rows, hq,
                    out.stride(0), out.stride(1), GROUP=step.group, D=d, BLOCK_D=block_d,
                    BLOCK_M=block_m, HAS_LSE=lse is not None,
                    **({} if interpret else {"num_warps": 4}))
