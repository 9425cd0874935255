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

__all__ = ["StaticAttention", "available", "tree_attention_triton"]

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


def _splits(tiles: int, num_kv_heads: int, num_sms: int) -> int:
    """Most chunks per tile's prefix (FlashDecoding's rule of thumb): split only while the
    tiles leave SMs idle, then into about two waves."""
    base = tiles * num_kv_heads
    return 1 if base == 0 or base >= 0.8 * num_sms else -(-2 * num_sms // base)


def _partition(q_indptr, prefix_lens, group, num_kv_heads, num_sms, min_chunk=MIN_CHUNK,
               max_block_m=MAX_BLOCK_M, block_m=None, splits=None):
    """The work of one step, grouped by tile height (a decode request's 4 packed rows get a
    16-row tile, not the 128 rows of a 64-node tree beside it in the batch):
    ``({block_m: (items, merges)}, partial rows)``. An item is ``[b, row_begin, kv_begin,
    kv_end, with_new, slot]``, a merge ``[b, row_begin, slot, chunks]``; chunk ``c`` of a split
    tile writes partial rows ``slot + c * block_m``. ``block_m`` / ``splits``: one tile height
    for every request and a fixed most chunks per tile, instead of the step's own (the fixed
    launches of :class:`StaticAttention`)."""
    lens = [q_indptr[i + 1] - q_indptr[i] for i in range(len(prefix_lens))]
    heights = [block_m or _tile_rows(n * group, max_block_m) for n in lens]
    tiles = [-(-n * group // m) for n, m in zip(lens, heights)]
    if splits is None:
        splits = _splits(sum(tiles), num_kv_heads, num_sms)
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
    max_block_m = _max_block_m(d)
    key = ("_triton_step", str(q.device), hq, hkv, sms, min_chunk, max_block_m)
    step = plan.__dict__.get(key)
    if step is None:
        step = _Step(plan, q.device, hq, hkv, sms, min_chunk, max_block_m)
        plan.__dict__[key] = step
    _check_interpreter(q.device)
    part_o = part_lse = out  # placeholders the kernel never touches without a split
    if step.part_rows:
        part_o = torch.empty(hkv * step.part_rows * _block_d(d), dtype=torch.float32,
                             device=q.device)
        part_lse = torch.empty(hkv * step.part_rows, dtype=torch.float32, device=q.device)
    _launch(step, q, k_pages, v_pages, k_new, v_new, scale, out, lse, part_o, part_lse)


def _block_d(d: int) -> int:
    return max(16, _pow2(d))


def _max_block_m(d: int) -> int:
    # Head dims over 128 keep every register (sm_90, no spill) only with 16-row tiles.
    return MAX_BLOCK_M if _block_d(d) <= 128 else 16


def _check_interpreter(device: torch.device) -> None:
    if device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
        raise ValueError("backend='triton' runs on CUDA tensors (on cpu tensors only in Triton's "
                         f"interpreter, TRITON_INTERPRET=1, for tests); got {device}")


def _launch(step, q, k_pages, v_pages, k_new, v_new, scale, out, lse, part_o, part_lse) -> None:
    """The kernels of one layer: per tile height of ``step`` (a :class:`_Step` or a
    :class:`StaticAttention`), the attention items and, where prefixes are split, the merges."""
    from pyspec._triton_kernels import merge, tree_attn as attn

    hq, d = q.shape[1], q.shape[2]
    hkv, page = k_pages.shape[2], k_pages.shape[1]
    block_d = _block_d(d)
    interpret = q.device.type != "cuda"
    prec = "ieee" if q.dtype == torch.float32 else "tf32"
    lse_arg = lse if lse is not None else out
    # Triton launches on torch's current device: the tensors' own, for a model on cuda:N.
    with torch.cuda.device(q.device) if not interpret else contextlib.nullcontext():
        for block_m, num_items, num_merges, items, merges in step.groups:
            extra = {} if interpret else {"num_warps": 4 if block_m <= 64 else 8,
                                          "num_stages": 3 if block_d <= 128 else 2,
                                          "enable_fp_fusion": True}
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
                    **({} if interpret else {"num_warps": 4, "enable_fp_fusion": True}))


class StaticAttention:
    """Tree attention with fixed launches over fixed buffers, for steps captured in a CUDA graph.

    A graph replays the kernel launches it recorded: the same grids, the same pointers. This
    object sizes everything for a bucket of steps (at most ``max_requests`` requests of at most
    ``max_rows`` new tokens each, pages of ``block_size`` tokens, at most ``max_pages`` pages
    over all requests) once, and :meth:`write` puts each step's metadata into its buffer (one
    copy to the device) before the replay:

    * every request gets tiles of one height (that of ``max_rows`` rows times the GQA group),
      and every tile's prefix at most a fixed number of chunks (the split rule applied to the
      full bucket), so the launches are one attention launch of ``capacity`` items and, where
      prefixes may split, one merge launch;
    * items and merges a step does not need point at a request past the step's last one, which
      has no rows: they load nothing and store nothing.

    ``run(q, k_pages, v_pages, k_new, v_new, scale)`` launches the kernels on this buffer (what
    ``tree_attention`` does when given this object as its plan); the metadata of the last
    :meth:`write` is what they read.

    ``inputs``: int64 values of the caller's own that go up in the same copy (a graphed step's
    token ids and positions): :meth:`write` takes them, :attr:`inputs` is their device copy.
    """

    def __init__(self, device, max_requests: int, max_rows: int, num_q_heads: int,
                 num_kv_heads: int, head_dim: int, block_size: int, max_pages: int,
                 num_sms: Optional[int] = None, min_chunk: int = MIN_CHUNK, inputs: int = 0):
        if not available():
            raise ValueError("StaticAttention needs the 'triton' package (pip install triton)")
        for name, v, low in (("max_requests", max_requests, 1), ("max_rows", max_rows, 1),
                             ("block_size", block_size, 1), ("max_pages", max_pages, 1),
                             ("inputs", inputs, 0)):
            if not isinstance(v, int) or isinstance(v, bool) or v < low:
                raise ValueError(f"{name} must be an int >= {low}; got {v!r}")
        if num_kv_heads < 1 or num_q_heads % num_kv_heads:
            raise ValueError(f"num_q_heads ({num_q_heads}) must be a multiple of num_kv_heads "
                             f"({num_kv_heads})")
        self.device = torch.device(device)
        if self.device.type == "cuda" and self.device.index is None:
            self.device = torch.device("cuda", torch.cuda.current_device())
        self.max_requests, self.max_rows, self.max_pages = max_requests, max_rows, max_pages
        self.num_q_heads, self.num_kv_heads, self.head_dim = num_q_heads, num_kv_heads, head_dim
        self.block_size = block_size
        self.group = num_q_heads // num_kv_heads
        self.num_sms = num_sms or _num_sms(self.device)
        self.min_chunk = min_chunk
        self.block_m = _tile_rows(max_rows * self.group, _max_block_m(head_dim))
        tiles = -(-max_rows * self.group // self.block_m)
        self.splits = _splits(max_requests * tiles, num_kv_heads, self.num_sms)
        self.num_items = max_requests * tiles * self.splits
        self.num_merges = max_requests * tiles if self.splits > 1 else 0
        self.part_rows = self.num_merges * self.splits * self.block_m
        self.mask_words = None  # from the first plan (the core's words per tree row)
        self.max_tokens = max_requests * max_rows
        pad = max_requests  # the request every unused item and merge points at: no rows
        self._pad = pad
        self.num_inputs = inputs
        self.inputs: Optional[torch.Tensor] = None  # the device copy of write()'s inputs
        sizes = {"inputs": inputs, "q_indptr": pad + 2, "page_indptr": pad + 2, "pages": max_pages,
                 "tree_flags": pad + 1, "masks": None, "items": self.num_items * 6,
                 "merges": max(1, self.num_merges) * 4}
        self._sizes = sizes
        self._buffer = None
        pin = self.device.type == "cuda"
        self._copied = None  # the event after the last upload (the host buffer is reused)
        self._pin = pin
        f32 = dict(dtype=torch.float32, device=self.device)
        self._part_o = torch.empty(max(1, num_kv_heads * self.part_rows * _block_d(head_dim)),
                                   **f32)
        self._part_lse = torch.empty(max(1, num_kv_heads * self.part_rows), **f32)

    def _allocate(self, mask_words: int) -> None:
        self.mask_words = mask_words
        sizes = dict(self._sizes, masks=self.max_tokens * mask_words)
        # The page list last: a step uploads the buffer only up to its own pages.
        order = ("inputs", "q_indptr", "page_indptr", "tree_flags", "masks", "items", "merges",
                 "pages")
        # Each section padded to 16 bytes, as the one-shot upload of _Step.
        lens = [sizes[n] + sizes[n] % 2 for n in order]
        self._pages_at = sum(lens[:-1])
        self._host = torch.zeros(sum(lens), dtype=torch.int64, pin_memory=self._pin)
        self._buffer = torch.zeros(sum(lens), dtype=torch.int64, device=self.device)
        self._host_views = dict(zip(order, torch.split(self._host, lens)))
        views = dict(zip(order, torch.split(self._buffer, lens)))
        self.q_indptr, self.page_indptr, self.pages = (views["q_indptr"], views["page_indptr"],
                                                       views["pages"])
        self.tree_flags, self.masks = views["tree_flags"], views["masks"]
        self.inputs = views["inputs"][:self.num_inputs]
        self.groups = [(self.block_m, self.num_items, self.num_merges, views["items"],
                        views["merges"])]

    def fits(self, rows_per_request, pages: int) -> bool:
        """Whether a step of requests with these new-token counts, reading ``pages`` pages in
        all, fits this object's buffers."""
        return (0 < len(rows_per_request) <= self.max_requests and pages <= self.max_pages
                and max(rows_per_request) <= self.max_rows)

    def write(self, plan, inputs: Optional[torch.Tensor] = None) -> None:
        """The metadata of ``plan`` (from :func:`pyspec.attention.plan_attention`, for these head
        counts and pages) into the buffer the launches read, in one copy to the device with
        ``inputs`` (int64, as many values as the constructor's ``inputs``; required when that is
        not 0); ValueError where they do not fit."""
        if (inputs is None) != (self.num_inputs == 0) or (
                inputs is not None and (inputs.dtype != torch.int64
                                        or inputs.numel() != self.num_inputs)):
            got = "none" if inputs is None else f"{inputs.numel()} {inputs.dtype}"
            raise ValueError(f"this StaticAttention uploads {self.num_inputs} int64 inputs with "
                             f"each step; got {got}")
        arrays = plan._step_arrays()

        def host(name, dt):
            return torch.frombuffer(bytearray(arrays[name]), dtype=dt) if arrays[name] \
                else torch.zeros(0, dtype=dt)

        q_indptr = host("q_indptr", torch.int64)
        prefix = host("prefix_lens", torch.int64)
        page_indptr = host("page_indptr", torch.int64)
        batch = prefix.numel()
        lens = (q_indptr[1:] - q_indptr[:-1]).tolist()
        pages = int(page_indptr[-1]) if batch else 0
        if plan.block_size != self.block_size:
            raise ValueError(f"the plan's pages hold {plan.block_size} tokens; this "
                             f"StaticAttention's {self.block_size}")
        if plan.num_kv_heads and (plan.num_q_heads, plan.num_kv_heads) != (
                self.num_q_heads, self.num_kv_heads):
            raise ValueError(f"the plan was built for {plan.num_q_heads}/{plan.num_kv_heads} "
                             f"q/kv heads; this StaticAttention is for {self.num_q_heads}/"
                             f"{self.num_kv_heads}")
        if not self.fits(lens, pages):
            raise ValueError(f"a step of {batch} requests with up to {max(lens, default=0)} new "
                             f"tokens each and {pages} pages does not fit a StaticAttention of "
                             f"{self.max_requests} requests, {self.max_rows} tokens each and "
                             f"{self.max_pages} pages")
        if self._buffer is None:
            self._allocate(int(arrays["mask_words"]))
        if self._copied is not None:
            self._copied.synchronize()  # the last upload has left the host buffer
        groups, _ = _partition(q_indptr.tolist(), prefix.tolist(), self.group,
                               self.num_kv_heads, self.num_sms, self.min_chunk,
                               block_m=self.block_m, splits=self.splits)
        items, merges = groups.get(self.block_m, ([], []))
        v = self._host_views
        if inputs is not None:
            v["inputs"][:self.num_inputs] = inputs.reshape(-1)
        t = int(q_indptr[-1])
        v["q_indptr"][:batch + 1] = q_indptr
        v["q_indptr"][batch + 1:] = t
        v["page_indptr"][:batch + 1] = page_indptr
        v["page_indptr"][batch + 1:] = pages
        v["pages"][:pages] = host("pages", torch.int32).to(torch.int64)
        v["tree_flags"].zero_()
        v["tree_flags"][:batch] = host("tree_flags", torch.uint8).to(torch.int64)
        masks = host("masks", torch.int64)
        v["masks"][:masks.numel()] = masks
        pad_item = [self._pad, 0, 0, 0, 0, -1]
        rows = torch.tensor(items + [pad_item] * (self.num_items - len(items)),
                            dtype=torch.int64).view(-1)
        v["items"][:rows.numel()] = rows
        if self.num_merges:
            rows = torch.tensor(merges + [[self._pad, 0, 0, 0]] * (self.num_merges - len(merges)),
                                dtype=torch.int64).view(-1)
            v["merges"][:rows.numel()] = rows
        used = self._pages_at + pages + pages % 2
        self._buffer[:used].copy_(self._host[:used], non_blocking=self._pin)
        self._rows, self._num_blocks = t, plan.num_blocks
        if self._pin:
            self._copied = torch.cuda.Event()
            self._copied.record(torch.cuda.current_stream(self.device))

    def run(self, q, k_pages, v_pages, k_new, v_new, scale: float, out=None):
        """One layer's attention with the last written metadata, into ``out`` (allocated when
        None; returned). Shapes as for ``tree_attention``; ``q`` has ``max_requests * max_rows``
        rows (a step's rows first, the rest unused: their output is left as it was)."""
        if self._buffer is None:
            raise ValueError("StaticAttention.run before any write(plan)")
        pages = (self._num_blocks, self.block_size, self.num_kv_heads, self.head_dim)
        if q.dim() != 3 or tuple(q.shape[1:]) != (self.num_q_heads, self.head_dim) or \
                not self._rows <= q.shape[0] <= self.max_tokens or \
                tuple(k_new.shape) != (q.shape[0], self.num_kv_heads, self.head_dim) or \
                tuple(v_new.shape) != tuple(k_new.shape) or tuple(k_pages.shape) != pages or \
                tuple(v_pages.shape) != pages:
            raise ValueError(f"StaticAttention for {self._rows} .. {self.max_tokens} rows of "
                             f"{self.num_q_heads} q heads of {self.head_dim} ({self._rows}: the "
                             f"last write's step), K/V pages {list(pages)}; got q "
                             f"{tuple(q.shape)}, k_new {tuple(k_new.shape)}, v_new "
                             f"{tuple(v_new.shape)}, k_pages {tuple(k_pages.shape)}, v_pages "
                             f"{tuple(v_pages.shape)}")
        if q.dtype not in (torch.float32, torch.bfloat16, torch.float16):
            raise ValueError(f"StaticAttention supports float32/bfloat16/float16; got {q.dtype}")
        for name, t in (("q", q), ("k_pages", k_pages), ("v_pages", v_pages), ("k_new", k_new),
                        ("v_new", v_new), ("out", out)):
            if t is not None and (t.dtype != q.dtype or t.device != self.device
                                  or not t.is_contiguous()):
                raise ValueError(f"'{name}' must be contiguous, in q's dtype and on "
                                 f"{self.device}")
        if out is not None and tuple(out.shape) != tuple(q.shape):
            raise ValueError(f"'out' must be shaped as q {tuple(q.shape)}; got {tuple(out.shape)}")
        _check_interpreter(q.device)
        if out is None:
            out = torch.empty_like(q)
        _launch(self, q, k_pages, v_pages, k_new, v_new, scale, out, None, self._part_o,
                self._part_lse)
        return out
