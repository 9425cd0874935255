"""The drafter interface: every draft method proposes a token tree per request per step.

The engine calls a drafter at four points of a step (DESIGN section 2):

* :meth:`Drafter.prefill` after the target ran prefill chunks (with the target's hidden states
  when :attr:`Drafter.needs_hidden`), so drafters that keep their own KV (an independent draft
  model, an EAGLE head) fill it for the same positions and the same block ids as the target —
  a prefix-cache hit then restores target and draft KV together.
* :meth:`Drafter.propose` before the target's verification forward: one :class:`Draft` (a tree,
  root first, with the draft distributions when children were sampled) per :class:`DraftRequest`.
* :meth:`Drafter.observe` after acceptance: the tokens the target committed (root + accepted draft
  tokens), the emitted tokens and, when asked, the target's hidden states of the accepted path.
* :meth:`Drafter.release` when a request finishes or is preempted (its KV is gone), and
  :meth:`Drafter.learn` with its text when it finished normally.

A drafter never affects what is generated, only how fast: the target verifies every draft with
lossless acceptance. A drafter that raises or returns a malformed draft (bad token, bad tree,
NaN probabilities) is caught by the engine, which decodes that request plainly from then on.

Drafter KV lives in pools with the target's block geometry (same block ids). A drafter writes KV
only at positions the target has committed (so a block entering the prefix cache holds both);
draft-tree nodes live in per-step scratch, exactly like the target's.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import List, Optional, Sequence, Tuple

import torch

from pyspec.sampling import apply_sampling_filters

__all__ = ["Drafter", "DraftRequest", "Draft", "PrefillChunk", "Verified", "slots_of",
           "batch_probs", "batch_children", "top_children"]


@dataclass
class DraftRequest:
    """One request to draft for. ``context[-1]`` is the root token, at position ``start``."""

    request_id: int
    context: Sequence[int]  # prompt + generated tokens (the root last)
    start: int  # the root's position = tokens whose target KV is committed
    block_table: Sequence[int]
    budget: int  # most draft nodes beyond the root (>= 1)
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    seed: int = 0
    step: int = 0  # the request's decode step (fresh randomness per step)
    max_depth: int = 0  # deepest allowed draft level (its KV slots are reserved); 0: = budget
    partition: Optional[str] = None  # the request's learned-text partition (SamplingParams)

    @property
    def depth_limit(self) -> int:
        return self.max_depth or self.budget

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


@dataclass
class Draft:
    """A draft tree: node 0 is the root (``tokens[0]`` is the root token), parents before
    children. ``draft_probs`` (float32 ``[N, vocab]``): row ``i`` is the distribution node ``i``'s
    children were *sampled* from (without replacement); ``None`` when children are deterministic
    (top-k), which the target verifies with the target-only walk."""

    tokens: List[int]
    parents: List[int]
    draft_probs: Optional[torch.Tensor] = None

    @property
    def num_draft_tokens(self) -> int:
        return len(self.tokens) - 1


@dataclass
class PrefillChunk:
    request_id: int
    tokens: Sequence[int]  # the chunk, at positions start .. start + len - 1
    start: int
    block_table: Sequence[int]
    context: Sequence[int]  # the whole prompt + generated tokens (the chunk's successors)
    # [len, hidden] target hidden states (needs_hidden), on the target's device
    hidden: Optional[torch.Tensor] = None


@dataclass
class Verified:
    request_id: int
    start: int  # position of the root
    committed: List[int]  # root + accepted draft tokens (positions start ..)
    emitted: List[int]  # accepted draft tokens + the bonus/recovered token
    block_table: Sequence[int]
    # [len(committed), hidden] of the accepted path, on the target's device
    hidden: Optional[torch.Tensor] = None
    # For drafters with ``wants_predictions``: the verified tree, and the target's most likely
    # token at each of its nodes (its argmax there, whatever was sampled).
    tree: Optional["Draft"] = None
    predicted: Optional[List[int]] = None


class Drafter:
    """Base class; subclasses override :meth:`propose` and what they need of the rest."""

    name = "drafter"
    needs_hidden = False  # wants the target's hidden states in prefill/observe
    # Which target layers' outputs those are (concatenated in this order; the last must be the
    # final layer); None: the final hidden state alone.
    hidden_layers: Optional[Tuple[int, ...]] = None
    max_draft_depth = 5  # deepest tree it drafts (the scheduler's draft length is in depth units)
    # Wants :attr:`Verified.tree` and :attr:`Verified.predicted` in :meth:`observe` (lookahead:
    # the target's predictions at rejected nodes are its next guesses).
    wants_predictions = False

    def node_budget(self, depth: int) -> int:
        """Tree nodes it may propose when the scheduler allows ``depth`` levels (chains: depth)."""
        return depth

    def kv_pools(self) -> list:
        """KV pools to keep in step with the target's (copy-on-write block copies)."""
        return []

    # Sources drafting at different rates (``A|B``'s parts, prompt lookup's match lengths): the
    # scheduler keeps an acceptance estimate and a draft length per source, and the engine names
    # the source of each request's next step (:meth:`draft_source`) before the scheduler sizes it.
    num_draft_sources = 1

    def draft_source(self, context: Sequence[int], partition: Optional[str] = None
                     ) -> Optional[int]:
        """Which source (``0 .. num_draft_sources - 1``) drafts the next step of a request whose
        context (the root last) is ``context`` (and learned-text partition ``partition``, passed
        only when the request has one); None when :meth:`propose` will draft nothing beyond the
        root. A drafter that cannot tell without drafting says 0."""
        return 0

    def prefill(self, chunks: List[PrefillChunk]) -> None:
        pass

    def propose(self, reqs: List[DraftRequest]) -> List[Draft]:
        raise NotImplementedError

    def observe(self, results: List[Verified]) -> None:
        pass

    def release(self, request_id: int) -> None:
        pass

    def learn(self, request_id: int, tokens: Sequence[int],
              partition: Optional[str] = None) -> None:
        """A request finished (not aborted, not failed): ``tokens`` is its prompt + output. A
        drafter that learns from served text (a corpus drafter with ``learn``) copies what it
        needs, into ``partition`` (the request's ``SamplingParams.learn_partition``: what it
        learns there drafts only requests of the same partition); the sequence is the engine's
        and must not be kept."""

    def describe(self) -> str:
        return self.name


def draft_source_of(d: Drafter, context: Sequence[int], partition: Optional[str]):
    """``d.draft_source`` for a request of ``partition`` (drafters written before partitions
    existed take the context alone, which is all they need for the shared partition)."""
    if partition is None:
        return d.draft_source(context)
    return d.draft_source(context, partition=partition)


def layers_of(drafter: Drafter, num_layers: int) -> Tuple[int, ...]:
    """The target layers whose outputs ``drafter`` reads (see :attr:`Drafter.hidden_layers`)."""
    return tuple(drafter.hidden_layers) if drafter.hidden_layers else (num_layers,)


def union_layers(drafters, num_layers: int) -> Optional[Tuple[int, ...]]:
    """Sorted union of the layers the drafters that need hidden states read (None: none do)."""
    want = {n for d in drafters if d.needs_hidden for n in layers_of(d, num_layers)}
    return tuple(sorted(want)) if want else None


def select_layers(hidden: Optional[torch.Tensor], have: Sequence[int], want: Sequence[int]):
    """The columns of layers ``want`` in ``hidden`` (``[T, len(have) * H]``, layers ``have``)."""
    if hidden is None or tuple(have) == tuple(want):
        return hidden
    t, h = hidden.shape[0], hidden.shape[-1] // len(have)
    idx = torch.tensor([list(have).index(n) for n in want], device=hidden.device)
    return hidden.view(t, len(have), h).index_select(1, idx).reshape(t, len(want) * h)


def slots_of(block_table: Sequence[int], block_size: int, start: int, n: int) -> List[int]:
    """Flat KV slots of positions start .. start + n - 1 under a block table."""
    return [int(block_table[p // block_size]) * block_size + p % block_size
            for p in range(start, start + n)]


def top_children(probs: torch.Tensor, k: int, sample: bool,
                 gen: Optional[torch.Generator]) -> List[List[int]]:
    """Children per row: the top ``k`` tokens, or ``k`` tokens sampled without replacement
    (Gumbel-top-k over ``probs``; zero-probability tokens are never drawn)."""
    k = max(1, min(k, probs.shape[-1]))
    if not sample:
        return probs.topk(k, dim=-1).indices.tolist()
    u = torch.rand(probs.shape, generator=gen, dtype=torch.float64).clamp_(1e-300, 1.0)
    keys = probs.double().log() - (-u.log()).log()  # log p + Gumbel
    keys[probs <= 0] = float("-inf")
    nz = int((probs > 0).sum(-1).min())
    idx = keys.topk(max(1, min(k, nz)), dim=-1).indices
    return idx.tolist()


def batch_probs(logits: torch.Tensor, reqs: Sequence[DraftRequest]) -> torch.Tensor:
    """The draft's distributions under each row's request filters (float32 ``[R, V]``): row ``i``
    under ``reqs[i]``'s temperature / top-k / top-p / min-p; greedy requests get the plain softmax
    (used for ranking only)."""
    logits = logits.float().contiguous()
    if all(r.greedy for r in reqs):
        return torch.softmax(logits, dim=-1)
    temp = torch.tensor([1.0 if r.greedy else float(r.temperature) for r in reqs])
    top_k = torch.tensor([0 if r.greedy else int(r.top_k) for r in reqs], dtype=torch.int32)
    top_p = torch.tensor([1.0 if r.greedy else float(r.top_p) for r in reqs])
    min_p = torch.tensor([0.0 if r.greedy else float(r.min_p) for r in reqs])
    return apply_sampling_filters(logits, temp, top_k, top_p, min_p)


_M64 = (1 << 64) - 1


def _mix(x: torch.Tensor) -> torch.Tensor:
    """splitmix64's finalizer on int64 tensors (wrapping arithmetic; logical shifts emulated)."""
    def shr(v, k):
        return (v >> k) & ((1 << (64 - k)) - 1)

    x = (x ^ shr(x, 30)) * -4658895280553007687  # 0xbf58476d1ce4e5b9 as int64
    x = (x ^ shr(x, 27)) * -7723592293110705685  # 0x94d049bb133111eb as int64
    return x ^ shr(x, 31)


def counter_uniform(keys: Sequence[int], n: int) -> torch.Tensor:
    """float64 ``[len(keys), n]`` uniforms in (0, 1), a pure function of (key, column): drafts
    sampled this way depend only on the request's seed and step, never on the batch."""
    signed = []
    for v in keys:
        v = (int(v) * 0x9E3779B97F4A7C15) & _M64
        signed.append(v - (1 << 64) if v >= (1 << 63) else v)
    k = torch.tensor(signed, dtype=torch.int64)
    x = _mix(k[:, None] + torch.arange(n, dtype=torch.int64)[None, :] * -7046029254386353131)
    bits = (x >> 11) & ((1 << 53) - 1)
    return (bits.double() + 0.5) / float(1 << 53)


def batch_children(probs: torch.Tensor, k: int, sample: Sequence[bool],
                   keys: Sequence[int]) -> List[List[int]]:
    """Children for every row: the top ``k`` tokens, or for rows with ``sample[i]`` ``k`` tokens
    drawn without replacement (Gumbel-top-k keyed by ``keys[i]``)."""
    k = max(1, min(k, probs.shape[-1]))
    if not any(sample):
        return probs.topk(k, dim=-1).indices.tolist()
    scores = probs.double().clone()
    rows = [i for i, s in enumerate(sample) if s]
    sub = probs[rows].double()
    u = counter_uniform([keys[i] for i in rows], probs.shape[-1])
    g = sub.log() - (-u.log()).log()
    g[sub <= 0] = float("-inf")
    # Sampled rows rank by their perturbed keys; others by probability (monotone either way).
    scores = scores.log()
    scores[rows] = g
    idx = scores.topk(k, dim=-1).indices
    out = idx.tolist()
    for i in rows:  # never hand out zero-probability children
        out[i] = [c for c in out[i] if float(probs[i, c]) > 0] or out[i][:1]
    return out


def draft_key(req: DraftRequest, node: int) -> int:
    return (int(req.seed) * 1_000_003 + int(req.step) * 7919 + node * 104729 + 17) & _M64
