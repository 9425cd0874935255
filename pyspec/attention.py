"""Tree attention over the paged KV cache: plan once per step, run once per layer.

A step is a ragged batch of ``B`` requests. Request ``b`` has ``prefix_lens[b]`` committed tokens
whose K/V live in the paged pool ``[num_blocks, block_size, kv_heads, head_dim]`` (addressed through
its row of ``block_tables``) and ``q_len[b] = q_indptr[b+1] - q_indptr[b]`` new tokens: rows of the
flattened query whose K/V are in the per-step scratch tensors ``k_new``/``v_new`` (same row order as
``q``). The new tokens of a request are either

* a causal chunk (a prefill chunk, or one plain-decode token): token ``j`` sees the prefix and new
  tokens ``0..j``; give it no tree nodes; or
* a token tree (node 0 = root, parents before children, at most 256 nodes): node ``j`` sees the
  prefix and exactly its ancestors-or-self; give it ``q_len[b]`` tree-local parent indices.

Example::

    plan = plan_attention(q_indptr, prefix_lens, block_tables, block_size=16,
                          tree_parents=parents, tree_indptr=tree_indptr,
                          num_blocks=k_pages.shape[1], num_q_heads=9, num_kv_heads=3)
    for layer in layers:
        out = tree_attention(plan, q, k_pages[layer], v_pages[layer], k_new, v_new)

The CPU kernel is multi-threaded (``PYSPEC_NUM_THREADS``) and accumulates in float32. With CUDA
tensors (in a CUDA build of pyspec) the same call runs on the GPU: the plan's metadata and GPU work
partition are uploaded once per step and head layout (cached on the plan) and reused by every
layer; bfloat16/float16 with head_dim 64 or 128 run on tensor cores, other dtypes and head dims up
to 256 on a generic kernel. The plan itself is always built from cpu metadata.
"""

from __future__ import annotations

import math
from numbers import Integral
from typing import Optional, Sequence, Union

import torch

from pyspec import _C
from pyspec.linear import resolve_kernels
from pyspec.triton_attention import StaticAttention

__all__ = ["AttentionPlan", "plan_attention", "tree_attention"]

# tree_attention's kernels: pyspec's own (cpu and CUDA), its CUDA tensor-core kernel with two
# cp.async stages, or the Triton kernel (pyspec.triton_attention)
ATTENTION_BACKENDS = ("native", "pipelined", "triton")


def check_attention_backend(backend) -> str:
    if backend not in ATTENTION_BACKENDS:
        raise ValueError(f"the attention backend must be one of {', '.join(ATTENTION_BACKENDS)}; "
                         f"got {backend!r}")
    return backend

AttentionPlan = _C.AttentionPlan

_IndexLike = Union[torch.Tensor, Sequence[int], Sequence[Sequence[int]]]


def _index(x, name: str) -> torch.Tensor:
    if isinstance(x, torch.Tensor):
        if x.dtype not in (torch.int32, torch.int64):
            raise ValueError(f"'{name}' must be an int32/int64 tensor; got {x.dtype}")
        return x.contiguous()
    try:
        return torch.as_tensor(x, dtype=torch.int64)
    except (TypeError, ValueError, RuntimeError) as e:
        raise ValueError(f"'{name}' must be a tensor or a (nested) list of ints: {e}") from None


def plan_attention(
    q_indptr: _IndexLike,
    prefix_lens: _IndexLike,
    block_tables: _IndexLike,
    block_size: int,
    tree_parents: Optional[_IndexLike] = None,
    tree_indptr: Optional[_IndexLike] = None,
    num_blocks: Optional[int] = None,
    *,
    num_q_heads: Optional[int] = None,
    num_kv_heads: Optional[int] = None,
    num_threads: int = 0,
    min_kv_chunk: int = 0,
) -> AttentionPlan:
    """Validate one step's metadata and precompute masks, page indices and the work partition.

    Args:
        q_indptr: ``[B + 1]`` offsets of each request's rows in the flattened query.
        prefix_lens: ``[B]`` committed tokens per request (their K/V are in the pages).
        block_tables: ``[B, max_blocks]`` page ids per request, ``-1`` for unused entries.
        block_size: tokens per page.
        tree_parents: ``[total_nodes]`` tree-local parent indices (root ``-1``) of all trees, or
            ``None`` when every request is a causal chunk.
        tree_indptr: ``[B + 1]`` offsets into ``tree_parents``; request ``b`` has either 0 nodes
            (causal chunk) or exactly ``q_len[b]`` nodes (a tree).
        num_blocks: pages in the pool (``k_pages.shape[0]``); bounds the block table entries.
        num_q_heads, num_kv_heads: head counts of the layers the plan will run on (recommended: the
            query tiles are sized for the group and ``tree_attention`` checks them).
        num_threads, min_kv_chunk: work-partition knobs (0 = defaults).

    Index arguments are cpu int32/int64 tensors or lists. Raises ``ValueError`` naming the bad
    argument (pages outside the pool or missing, invalid trees, node counts that do not match
    ``q_len``, negative lengths).
    """
    if num_blocks is None:
        raise ValueError("'num_blocks' is required (the number of pages in the KV pool)")
    for name, v in (("block_size", block_size), ("num_blocks", num_blocks),
                    ("num_q_heads", num_q_heads), ("num_kv_heads", num_kv_heads),
                    ("num_threads", num_threads), ("min_kv_chunk", min_kv_chunk)):
        # int(4.9) would silently plan with 4; a value past int32 gets pybind's signature dump
        if v is not None and (not isinstance(v, Integral) or isinstance(v, bool)
                              or not -(1 << 31) <= v < (1 << 31)):
            raise ValueError(f"'{name}' must be an int (32-bit); got {v!r}")
    if (num_q_heads is None) != (num_kv_heads is None):
        raise ValueError("give both 'num_q_heads' and 'num_kv_heads' or neither")
    q_indptr = _index(q_indptr, "q_indptr")
    batch = q_indptr.shape[0] - 1 if q_indptr.dim() == 1 else -1
    if tree_parents is None:
        tree_parents = torch.empty(0, dtype=torch.int32)
        if tree_indptr is None and batch >= 0:
            tree_indptr = torch.zeros(batch + 1, dtype=torch.int64)
    if tree_indptr is None:
        raise ValueError("'tree_indptr' is required when 'tree_parents' is given")
    return _C.plan_attention(
        q_indptr,
        _index(prefix_lens, "prefix_lens"),
        _index(block_tables, "block_tables"),
        int(block_size),
        _index(tree_parents, "tree_parents"),
        _index(tree_indptr, "tree_indptr"),
        int(num_blocks),
        num_q_heads=int(num_q_heads or 0),
        num_kv_heads=int(num_kv_heads or 0),
        num_threads=int(num_threads),
        min_kv_chunk=int(min_kv_chunk),
    )


def tree_attention(
    plan: AttentionPlan,
    q: torch.Tensor,
    k_pages: torch.Tensor,
    v_pages: torch.Tensor,
    k_new: torch.Tensor,
    v_new: torch.Tensor,
    *,
    scale: Optional[float] = None,
    out: Optional[torch.Tensor] = None,
    lse: Optional[torch.Tensor] = None,
    return_lse: bool = False,
    backend: str = "native",
    kernels=None,
):
    """Attention of every new token over its prefix (from pages) and visible new tokens.

    Args:
        plan: from :func:`plan_attention` for this step, or a
            :class:`pyspec.triton_attention.StaticAttention` holding it (fixed launches for CUDA
            graphs; no ``lse``).
        q: ``[T, Hq, D]`` float32/bfloat16/float16, ``T = q_indptr[-1]``.
        k_pages, v_pages: ``[num_blocks, block_size, Hkv, D]`` (float32/bfloat16/float16).
        k_new, v_new: ``[T, Hkv, D]``: the new tokens' K/V in ``q``'s row order, same dtype as
            the pages. ``Hq`` must be a multiple of ``Hkv`` (grouped-query attention).
        scale: score scale, default ``1 / sqrt(D)``.
        out: optional ``[T, Hq, D]`` output with ``q``'s dtype (allocated when ``None``).
        lse: optional float32 ``[T, Hq]`` receiving the natural log-sum-exp of the scaled scores.
        return_lse: also return ``lse`` (allocated when not given).
        backend: ``"native"`` (pyspec's own CPU and CUDA kernels), ``"pipelined"`` (CUDA
            tensors: pyspec's tensor-core kernel with two cp.async K/V stages instead of one
            synchronous one, the same results bit for bit; other dtypes and head dims as
            ``"native"``) or ``"triton"``: the Triton kernel of :mod:`pyspec.triton_attention`
            (CUDA tensors; q, K and V of one dtype).
        kernels: on the CPU, the :class:`pyspec._C.LinearKernels` (or an ISA name) whose vector
            build the kernel runs (a model's own, ``model.kernels``; AVX-512 at most); None:
            this CPU's best.

    Returns:
        ``out``, or ``(out, lse)`` when ``return_lse`` is true or ``lse`` was given.

    All tensors must be contiguous and on one device (cpu, or one cuda device; a CUDA tensor in a
    build without CUDA raises ``RuntimeError``).
    """
    check_attention_backend(backend)
    if kernels is not None and not isinstance(kernels, _C.LinearKernels):
        kernels = resolve_kernels(kernels)
    for name, t in (("q", q), ("k_pages", k_pages), ("v_pages", v_pages), ("k_new", k_new),
                    ("v_new", v_new)):
        if not isinstance(t, torch.Tensor):
            raise ValueError(f"'{name}' must be a torch.Tensor; got {type(t).__name__}")
    if q.dim() != 3:
        raise ValueError(f"'q' must be [num_queries, num_q_heads, head_dim]; got {tuple(q.shape)}")
    if q.shape[-1] < 1:
        raise ValueError(f"the head size (last dim of 'q') must be > 0; got {tuple(q.shape)}")
    if scale is None:
        scale = 1.0 / math.sqrt(q.shape[-1])
    if isinstance(plan, StaticAttention):
        if return_lse or lse is not None:
            raise ValueError("tree_attention with a StaticAttention plan returns no lse")
        return plan.run(q, k_pages, v_pages, k_new, v_new, float(scale), out)
    if out is None:
        out = torch.empty_like(q, memory_format=torch.contiguous_format)
    want_lse = return_lse or lse is not None
    if return_lse and lse is None:
        lse = torch.empty(q.shape[0], q.shape[1], dtype=torch.float32, device=q.device)
    if backend == "triton":
        from pyspec.triton_attention import tree_attention_triton
        tree_attention_triton(plan, q, k_pages, v_pages, k_new, v_new, float(scale), out, lse)
    elif q.is_cuda and getattr(_C, "built_with_cuda", False):
        if k_pages.dim() != 4:
            raise ValueError("'k_pages' must be [num_blocks, block_size, num_kv_heads, head_dim]; "
                             f"got {tuple(k_pages.shape)}")
        stream = torch.cuda.current_stream(q.device).cuda_stream
        key = ("_cuda_plan", q.device.index, q.shape[1], k_pages.shape[2], q.shape[2], stream)
        dplan = plan.__dict__.get(key)
        if dplan is None:
            # One upload per step, head layout and stream; the plan object lives for one step.
            dplan = _C.CudaAttentionPlan(plan, q.device.index, q.shape[1], k_pages.shape[2],
                                         q.shape[2], stream)
            plan.__dict__[key] = dplan
        _C.run_attention_cuda(dplan, q, k_pages, v_pages, k_new, v_new, out, lse, float(scale),
                              stream, "pipelined" if backend == "pipelined" else "simple")
    elif backend == "pipelined":
        raise ValueError(f"backend='pipelined' runs on CUDA tensors; got {q.device}")
    else:
        _C.run_attention(plan, q, k_pages, v_pages, k_new, v_new, out, lse, float(scale),
                         kernels)
    return (out, lse) if want_lse else out
