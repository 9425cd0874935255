"""Sampling filters and lossless acceptance of draft token trees (CPU ops of the C++ core).

Two ops, batched over requests:

* :func:`apply_sampling_filters` turns logits into the target's filtered distribution
  (temperature, top-k, top-p, min-p; temperature 0 = greedy one-hot).
* :func:`accept` walks each request's draft tree and returns the accepted path and the emitted
  tokens: the accepted draft tokens followed by one *recovered* token (sampled from the residual at
  the first rejection) or one *bonus* token (sampled after a fully accepted path).

Every stochastic mode is exactly lossless: the emitted tokens are distributed as if sampled from
the target alone. Randomness is counter-based (Philox4x32-10 keyed by the request's seed, counter
= sequence position of the token being decided, stream, draw), so a request's result never
depends on the rest of the batch, and with deterministic drafts (the target-only walk) it equals
plain sampling with the same seed token for token, however the tokens were split into steps.

Both ops take CPU or CUDA tensors (one device per call; the CUDA build runs the same algorithm and
draws). Validation errors raise ``ValueError`` naming the argument.
"""

from __future__ import annotations

from dataclasses import dataclass
from numbers import Integral, Real
from typing import List, Optional, Sequence, Union

import torch

from pyspec import _C
from pyspec.linear import resolve_kernels
from pyspec.ops import _stream_of

__all__ = ["AcceptResult", "accept", "accept_greedy", "apply_sampling_filters",
           "draft_probs_problem"]

_FLOAT_LOGITS = (torch.float32, torch.float16, torch.bfloat16)
_INT_DTYPES = (torch.int8, torch.int16, torch.int32, torch.int64, torch.uint8)


def _is_scalar(x, kind) -> bool:
    return isinstance(x, kind) and not isinstance(x, bool)


def _require_tensor(x, name: str) -> torch.Tensor:
    if not isinstance(x, torch.Tensor):
        raise ValueError(f"'{name}' must be a torch.Tensor; got {type(x).__name__}")
    return x


def _int_tensor(x, name: str, dtype: torch.dtype, ndim: int) -> torch.Tensor:
    x = _require_tensor(x, name)
    if x.dtype not in _INT_DTYPES:
        raise ValueError(f"'{name}' must have an integer dtype; got {x.dtype}")
    if x.dim() != ndim:
        raise ValueError(f"'{name}' must be {ndim}-D; got shape {list(x.shape)}")
    _check_fits(x, name, dtype)
    return x.to(dtype).contiguous()


def _check_fits(x: torch.Tensor, name: str, dtype: torch.dtype) -> None:
    """ValueError when an integer tensor holds values ``dtype`` cannot (a cast would wrap them:
    2^32 + 1 to 1, silently another token or another tree)."""
    if x.dtype == dtype or x.numel() == 0 or dtype not in (torch.int32, torch.int64):
        return
    info = torch.iinfo(dtype)
    lo, hi = int(x.min()), int(x.max())
    if lo < info.min or hi > info.max:
        raise ValueError(f"'{name}' holds {lo if lo < info.min else hi}, outside the "
                         f"{dtype} range the kernel reads")


def _per_row(value, n: int, name: str, dtype: torch.dtype, device, kind) -> torch.Tensor:
    """A scalar broadcast to [n] or a [n] tensor, as a contiguous tensor of `dtype`."""
    if isinstance(value, torch.Tensor):
        if value.dim() == 0:
            value = value.reshape(1).expand(n)
        if value.shape != (n,):
            raise ValueError(f"'{name}' must be a scalar or have shape [{n}]; got {list(value.shape)}")
        if kind is Integral and value.is_floating_point():
            raise ValueError(f"'{name}' must have an integer dtype; got {value.dtype}")
        if kind is Integral:
            _check_fits(value, name, dtype)
        return value.to(device=device, dtype=dtype).contiguous()
    if kind is bool:
        if not isinstance(value, (bool, Integral)):
            raise ValueError(f"'{name}' must be a bool or a [{n}] tensor; got {type(value).__name__}")
        return torch.full((n,), bool(value), dtype=dtype, device=device)
    if not _is_scalar(value, kind):
        raise ValueError(f"'{name}' must be a number or a [{n}] tensor; got {type(value).__name__}")
    limit = torch.iinfo(dtype) if kind is Integral else torch.finfo(dtype)
    if not limit.min <= value <= limit.max:  # torch.full would raise an overflow RuntimeError
        raise ValueError(f"'{name}' = {value!r} is outside the {dtype} range the kernel reads")
    return torch.full((n,), value, dtype=dtype, device=device)


def apply_sampling_filters(
    logits: torch.Tensor,
    temperature: Union[float, torch.Tensor] = 1.0,
    top_k: Union[int, torch.Tensor] = 0,
    top_p: Union[float, torch.Tensor] = 1.0,
    min_p: Union[float, torch.Tensor] = 0.0,
    *,
    out: Optional[torch.Tensor] = None,
    kernels=None,
) -> torch.Tensor:
    """The filtered target distribution of each row of ``logits``.

    Order: temperature (``T == 0`` is greedy: a one-hot row at the argmax, lowest token id on ties,
    and the other filters are ignored), then top-k, top-p and min-p on the tempered distribution,
    then renormalisation. Ties are broken deterministically: top-k keeps exactly ``k`` tokens, the
    lower ids among equal logits at the boundary; top-p keeps the smallest set of most likely
    tokens (probability desc, id asc) whose mass reaches ``top_p``, computed on the top-k
    survivors; min-p keeps tokens with ``p >= min_p * max p``. No filter sorts the vocabulary.

    Args:
        logits: ``[N, V]`` (or ``[V]``) float32/float16/bfloat16; ``-inf`` marks banned tokens.
        temperature: float >= 0, or a float ``[N]`` tensor (per row).
        top_k: int >= 0 (0 = off), or an int ``[N]`` tensor.
        top_p: float in (0, 1] (1 = off), or a float ``[N]`` tensor.
        min_p: float in [0, 1] (0 = off), or a float ``[N]`` tensor.
        out: optional float32 ``[N, V]`` tensor to write into.
        kernels: on the CPU, the :class:`pyspec._C.LinearKernels` (a model's; or an ISA name)
            whose vector build the row passes run (AVX-512 at most; every build gives the same
            bits); None: this CPU's best.

    Returns:
        float32 probabilities with the shape of ``logits``.
    """
    logits = _require_tensor(logits, "logits")
    if kernels is not None and not isinstance(kernels, _C.LinearKernels):
        kernels = resolve_kernels(kernels)
    if logits.dtype not in _FLOAT_LOGITS:
        raise ValueError(f"'logits' must be float32, float16 or bfloat16; got {logits.dtype}")
    squeeze = logits.dim() == 1
    if squeeze:
        logits = logits.unsqueeze(0)
    if logits.dim() != 2:
        raise ValueError(f"'logits' must be [N, V] or [V]; got shape {list(logits.shape)}")
    logits = logits.contiguous()
    n, dev = logits.shape[0], logits.device
    t = _per_row(temperature, n, "temperature", torch.float32, dev, Real)
    if _is_scalar(top_k, Integral) and top_k > logits.shape[-1]:
        top_k = logits.shape[-1]  # keeps every token either way; fits the kernel's int32
    elif isinstance(top_k, torch.Tensor) and not top_k.is_floating_point() and top_k.numel() \
            and int(top_k.max()) > logits.shape[-1]:
        top_k = top_k.clamp(max=logits.shape[-1])
    k = _per_row(top_k, n, "top_k", torch.int32, dev, Integral)
    p = _per_row(top_p, n, "top_p", torch.float32, dev, Real)
    m = _per_row(min_p, n, "min_p", torch.float32, dev, Real)
    if out is None:
        out = torch.empty(logits.shape, dtype=torch.float32, device=dev)
    else:
        out = _require_tensor(out, "out")
        want = list(logits.shape[1:] if squeeze else logits.shape)
        if out.dtype != torch.float32 or list(out.shape) != want:
            raise ValueError(f"'out' must be float32 with shape {want}; got "
                             f"{out.dtype} {list(out.shape)}")
        if not out.is_contiguous():
            raise ValueError("'out' must be contiguous")
        result = out
        out = out.view(logits.shape)
        _C.apply_sampling_filters(logits, t, k, p, m, out, _stream_of(logits), kernels)
        return result
    _C.apply_sampling_filters(logits, t, k, p, m, out, _stream_of(logits), kernels)
    return out[0] if squeeze else out


@dataclass(frozen=True)
class AcceptResult:
    """Outcome of :func:`accept` for a batch of ``B`` requests (``W`` = max tree depth + 1).

    Attributes:
        accepted_nodes: int32 ``[B, W]``, tree-local node indices of the accepted path, starting
            with the root (0); ``-1`` padded.
        emitted_tokens: int32 ``[B, W]``, the accepted draft tokens followed by the recovered or
            bonus token; ``-1`` padded.
        num_accepted: int32 ``[B]``, accepted draft tokens; each request emits ``num_accepted + 1``.
    """

    accepted_nodes: torch.Tensor
    emitted_tokens: torch.Tensor
    num_accepted: torch.Tensor

    @property
    def num_emitted(self) -> torch.Tensor:
        """int32 ``[B]``: tokens emitted per request (``num_accepted + 1``)."""
        return self.num_accepted + 1

    def emitted_lists(self) -> List[List[int]]:
        """The emitted tokens of every request as Python lists (padding removed)."""
        counts = self.num_emitted.tolist()
        rows = self.emitted_tokens.tolist()
        return [row[:c] for row, c in zip(rows, counts)]


def _seed_tensor(value, n: int, name: str, device) -> torch.Tensor:
    if isinstance(value, torch.Tensor):
        return _per_row(value, n, name, torch.int64, device, Integral)
    if not _is_scalar(value, Integral):
        raise ValueError(f"'{name}' must be an int or a [{n}] int tensor; got {type(value).__name__}")
    v = int(value)
    if not -(1 << 63) <= v < (1 << 64):
        raise ValueError(f"'{name}' = {v} does not fit in 64 bits")
    if v >= (1 << 63):  # a uint64 seed: same bits as an int64
        v -= 1 << 64
    return torch.full((n,), v, dtype=torch.int64, device=device)


def accept(
    target_probs: torch.Tensor,
    tokens: torch.Tensor,
    parents: torch.Tensor,
    tree_indptr: torch.Tensor,
    *,
    draft_probs: Optional[torch.Tensor] = None,
    greedy: Union[bool, torch.Tensor] = False,
    seeds: Union[int, torch.Tensor],
    offsets: Union[int, torch.Tensor] = 0,
    sampled_children: Union[None, bool, torch.Tensor] = None,
    row_sum_tolerance: float = 1e-3,
    debug_skip_residual: bool = False,
) -> AcceptResult:
    """Decide which draft tokens each request keeps (lossless speculative-decoding acceptance).

    Trees are flattened: node ``j`` of request ``b`` is row ``tree_indptr[b] + j``; node 0 is the
    root (the last accepted token, whose token id is ignored), parents come before children.

    Modes, per request:

    * ``greedy``: follow the child whose token is the argmax of ``target_probs`` (lowest id on
      ties); emit that argmax where no child matches or at a leaf.
    * ``sampled_children`` (children drawn *without replacement* from ``draft_probs[parent]``):
      recursive rejection sampling (Jeon et al. 2024); with one child per node it is exactly the
      Leviathan et al. / Chen et al. 2023 chain rule. Child ``x`` is accepted with probability
      ``min(1, p(x) / q(x))``; on rejection ``p <- norm(max(p - q, 0))`` and ``x`` is removed from
      ``q``.
    * otherwise (deterministic children, e.g. the drafter's top-k): the target-only walk: sample
      the target with the draw plain decoding uses at that position and move to the child holding
      the sampled token (child ``x`` is accepted with probability ``p(x)``).

    Probability rows are validated where the walk reads them (finite, non-negative, sum within
    ``row_sum_tolerance`` of 1); a sampled child with ``q(x) == 0`` (including a repeated sibling)
    is a ``ValueError``. The result depends only on the request's own inputs, its seed and offset.

    Args:
        target_probs: float32 ``[N, V]``; row ``i`` is the target's (filtered) distribution of the
            token following node ``i``.
        tokens: int ``[N]`` token ids of the nodes.
        parents: int ``[N]`` tree-local parent indices (-1 at each root).
        tree_indptr: int ``[B + 1]`` node offsets of the trees.
        draft_probs: float32 ``[N, V]`` or None; row ``i`` is the distribution node ``i``'s
            children were sampled from.
        greedy: bool, or bool ``[B]``.
        seeds: int (all requests) or int64 ``[B]``; the Philox key.
        offsets: int or int64 ``[B]``; the sequence position of the token each root decides (the
            context length); the node at depth ``k`` decides position ``offset + k``.
        sampled_children: bool or bool ``[B]``; default: True when ``draft_probs`` is given.
        row_sum_tolerance: allowed ``|sum(row) - 1|`` of the probability rows read.
        debug_skip_residual: FOR TESTS ONLY: a deliberately wrong rule (the recovered token is
            sampled from the unmodified target, not the residual), which the statistical tests use
            to show that they detect a broken sampler.

    Returns:
        An :class:`AcceptResult`.
    """
    target_probs = _require_tensor(target_probs, "target_probs")
    if target_probs.dtype != torch.float32:
        raise ValueError(f"'target_probs' must be float32; got {target_probs.dtype}")
    if target_probs.dim() != 2:
        raise ValueError(f"'target_probs' must be [N, V]; got shape {list(target_probs.shape)}")
    target_probs = target_probs.contiguous()
    dev = target_probs.device
    if draft_probs is not None:
        draft_probs = _require_tensor(draft_probs, "draft_probs")
        if draft_probs.dtype != torch.float32:
            raise ValueError(f"'draft_probs' must be float32; got {draft_probs.dtype}")
        draft_probs = draft_probs.contiguous()
    tokens, parents, tree_indptr = _tree_tensors(tokens, parents, tree_indptr)
    b = tree_indptr.numel() - 1
    if sampled_children is None:
        sampled_children = draft_probs is not None
    elif draft_probs is None and sampled_children is True:
        raise ValueError("'sampled_children' is True but 'draft_probs' is None; pass the draft "
                         "distributions or use sampled_children=False (deterministic children)")
    greedy_t = _per_row(greedy, b, "greedy", torch.bool, dev, bool)
    sampled_t = _per_row(sampled_children, b, "sampled_children", torch.bool, dev, bool)
    seeds_t = _seed_tensor(seeds, b, "seeds", dev)
    offsets_t = _seed_tensor(offsets, b, "offsets", dev)
    if not _is_scalar(row_sum_tolerance, Real) or not 0 < row_sum_tolerance <= 0.5:
        raise ValueError(f"'row_sum_tolerance' must be a number in (0, 0.5]; got "
                         f"{row_sum_tolerance!r}")

    return _accept_trees(target_probs, draft_probs, tokens, parents, tree_indptr, greedy_t,
                         sampled_t, seeds_t, offsets_t, float(row_sum_tolerance),
                         debug_skip_residual=bool(debug_skip_residual))


def draft_probs_problem(tokens: Sequence[int], parents: Sequence[int],
                        draft_probs: torch.Tensor, row_sum_tolerance: float = 1e-3) -> Optional[str]:
    """Why :func:`accept` could refuse one tree's sampled-children ``draft_probs`` (None: it
    cannot; the walk reads a child's entry only when it gets to that child, this checks every
    child), checked before the tree joins a batch, where one request's bad rows would fail the
    whole call: ``[len(tokens), V]`` floating point, and each row of a node with children
    finite, non-negative, summing to 1 within ``row_sum_tolerance``, giving every child's token a
    positive probability, with no two siblings holding the same token (a sampled child is a draw
    without replacement)."""
    n = len(tokens)
    if not isinstance(draft_probs, torch.Tensor) or draft_probs.dim() != 2 or \
            draft_probs.shape[0] != n or not draft_probs.is_floating_point():
        return (f"draft_probs must be a floating-point [{n}, V] tensor; got "
                f"{getattr(draft_probs, 'dtype', type(draft_probs).__name__)} "
                f"{list(getattr(draft_probs, 'shape', []))}")
    kids = [c for c in range(1, n) if parents[c] >= 0]
    if not kids:
        return None
    rows = sorted({int(parents[c]) for c in kids})
    q = draft_probs[rows].to(torch.float32)
    # One pass for NaN, infinities and negatives (NaN compares false; probabilities are <= 1).
    if not bool(((q >= 0) & (q <= 1 + row_sum_tolerance)).all()):
        return "a draft_probs row of a node with children has a NaN, infinite, negative or > 1 entry"
    sums = q.sum(dim=1, dtype=torch.float64)
    if bool(((sums - 1.0).abs() > row_sum_tolerance).any()):
        return (f"draft_probs rows of nodes with children must sum to 1 within "
                f"{row_sum_tolerance}; got sums {[round(float(x), 4) for x in sums]}")
    where = {r: i for i, r in enumerate(rows)}  # rows as the walk reads them: float32
    seen = set()
    for c in kids:
        key = (int(parents[c]), int(tokens[c]))
        if key in seen:
            return f"node {c} repeats a sibling's token {key[1]}"
        seen.add(key)
        if not float(q[where[key[0]], key[1]]) > 0.0:
            return f"node {c}'s token {key[1]} has probability 0 in its parent's draft_probs row"
    return None


def accept_greedy(logits: torch.Tensor, tokens: torch.Tensor, parents: torch.Tensor,
                  tree_indptr: torch.Tensor) -> AcceptResult:
    """Greedy acceptance straight from the target's logits: what :func:`accept` gives for
    ``greedy=True`` on the temperature-0 rows of ``logits``, without building those rows. Each
    node's token is its row's first maximal logit (lowest id on ties); the walk moves to the first
    child holding it and emits it where none does or at a leaf.

    Args:
        logits: float32 ``[N, V]`` CPU tensor; row ``i`` the target's logits after node ``i``.
        tokens, parents, tree_indptr: the trees, as for :func:`accept`.

    A row holding a NaN or ``+inf``, or only ``-inf``, is a ``ValueError`` (as in
    :func:`apply_sampling_filters`)."""
    logits = _require_tensor(logits, "logits")
    if logits.dtype != torch.float32 or logits.dim() != 2 or logits.device.type != "cpu":
        raise ValueError(f"'logits' must be a float32 [N, V] cpu tensor; got {logits.dtype} "
                         f"{list(logits.shape)} on {logits.device}")
    tokens, parents, tree_indptr = _tree_tensors(tokens, parents, tree_indptr)
    b = tree_indptr.numel() - 1
    zeros = torch.zeros((b,), dtype=torch.int64)
    return _accept_trees(logits.contiguous(), None, tokens, parents, tree_indptr,
                         torch.ones((b,), dtype=torch.bool), torch.zeros((b,), dtype=torch.bool),
                         zeros, zeros, 1e-3, target_is_logits=True)


def _tree_tensors(tokens, parents, tree_indptr):
    """A flattened tree batch as the op reads it: int32 tokens and parents, int64 offsets."""
    tokens = _int_tensor(tokens, "tokens", torch.int32, 1)
    parents = _int_tensor(parents, "parents", torch.int32, 1)
    tree_indptr = _int_tensor(tree_indptr, "tree_indptr", torch.int64, 1)
    if tree_indptr.numel() < 1:
        raise ValueError("'tree_indptr' must have batch + 1 >= 1 entries")
    return tokens, parents, tree_indptr


def _accept_trees(target, draft_probs, tokens, parents, tree_indptr, greedy, sampled, seeds,
                  offsets, row_sum_tolerance, **flags) -> AcceptResult:
    dev = target.device
    b = tree_indptr.numel() - 1
    # (from the host copies where the trees were given on the cpu: no device round trip)
    width = _C.tree_batch_max_depth(parents.cpu(), tree_indptr.cpu()) + 1
    if dev.type == "cuda":
        # Tree metadata may be given on the cpu; the op wants one device.
        tokens, parents, tree_indptr = (x.to(dev) for x in (tokens, parents, tree_indptr))
    accepted_nodes = torch.empty((b, width), dtype=torch.int32, device=dev)
    emitted_tokens = torch.empty((b, width), dtype=torch.int32, device=dev)
    num_accepted = torch.empty((b,), dtype=torch.int32, device=dev)
    _C.accept_trees(target, draft_probs, tokens, parents, tree_indptr, greedy, sampled, seeds,
                    offsets, accepted_nodes, emitted_tokens, num_accepted, row_sum_tolerance,
                    stream=_stream_of(target), **flags)
    return AcceptResult(accepted_nodes, emitted_tokens, num_accepted)
