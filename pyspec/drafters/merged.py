"""Drafters combined: trees merged into one per step (``A+B``, :class:`MergedDrafter`), or the first
drafter that has a draft for the step (``A|B``, :class:`FirstDrafter`).

Merged: a trie over token paths from the root.

A prompt-lookup chain is nearly free and, when the context repeats, right for several tokens at
once; a trained head is right more often for the next one or two tokens of new text. Merged, each
covers the other's misses within one verification. Parts are taken in order: every node of the
first part's draft, then the next part's nodes (parents first, the order drafters already emit,
so the kept set stays ancestor-closed) until the step's node budget is spent; a path two parts
share is verified once.

Merging needs deterministic children (top-k trees, prompt-lookup chains). A part that *sampled*
its children (``draft_probs``) is verified by rejection sampling against the distribution it drew
from, which a merged tree no longer has; such a step uses that part's draft alone.
"""

from __future__ import annotations

import dataclasses
from typing import Dict, List, Optional, Sequence, Tuple

from pyspec.drafters.base import (Draft, Drafter, DraftRequest, PrefillChunk, Verified,
                                  draft_source_of, layers_of, select_layers, union_layers)


class MergedDrafter(Drafter):
    def __init__(self, parts: Sequence[Drafter]):
        parts = list(parts)
        if len(parts) < 2 or not all(isinstance(p, Drafter) for p in parts):
            raise ValueError("a merged drafter needs at least two drafters")
        self.parts = parts
        self.name = "+".join(p.name for p in parts)
        self.needs_hidden = any(p.needs_hidden for p in parts)
        self.wants_predictions = any(p.wants_predictions for p in parts)
        # Parts may read different target layers: this drafter asks for their union and hands
        # each part its own. An explicit layer list ends with the final layer, which names the
        # target's depth for the parts that read the final hidden state alone.
        explicit = [p.hidden_layers for p in parts if p.needs_hidden and p.hidden_layers]
        self._depth = max(int(x[-1]) for x in explicit) if explicit else None
        self.hidden_layers = union_layers(parts, self._depth) if explicit else None
        # What reports and manifests read: the first part that carries them (a trained drafter).
        for key in ("manifest", "path"):
            val = next((getattr(p, key) for p in parts if getattr(p, key, None)), None)
            if val is not None:
                setattr(self, key, val)

    @property
    def max_draft_depth(self) -> int:
        return max(int(p.max_draft_depth) for p in self.parts)

    def node_budget(self, depth: int) -> int:
        return max(int(p.node_budget(depth)) for p in self.parts)

    def kv_pools(self) -> list:
        return [q for p in self.parts for q in p.kv_pools()]

    def _own(self, part: Drafter, items):
        """``items`` (prefill chunks or verifications) with the hidden states ``part`` reads."""
        if self.hidden_layers is None or not part.needs_hidden:
            return items
        want = layers_of(part, self._depth)
        return [dataclasses.replace(x, hidden=select_layers(x.hidden, self.hidden_layers, want))
                for x in items]

    def prefill(self, chunks: List[PrefillChunk]) -> None:
        for p in self.parts:
            p.prefill(self._own(p, chunks))

    def observe(self, results: List[Verified]) -> None:
        for p in self.parts:
            p.observe(self._own(p, results))

    def release(self, request_id: int) -> None:
        for p in self.parts:
            p.release(request_id)

    def learn(self, request_id: int, tokens, partition=None) -> None:
        for p in self.parts:
            p.learn(request_id, tokens, partition)

    def propose(self, reqs: List[DraftRequest]) -> List[Draft]:
        drafts = [p.propose(reqs) for p in self.parts]
        for p, ds in zip(self.parts, drafts):
            if len(ds) != len(reqs):
                raise ValueError(f"drafter {p.name!r} returned {len(ds)} drafts for {len(reqs)} "
                                 "requests")
        return [merge_drafts([ds[i] for ds in drafts], r.budget) for i, r in enumerate(reqs)]

    def describe(self) -> str:
        return " + ".join(p.describe() for p in self.parts)


class FirstDrafter(MergedDrafter):
    """Per request and step, the draft of the first part that proposes anything (more than the
    root). Prompt lookup first, a trained head otherwise: the head's drafting cost is paid only on
    steps where the context offers no continuation to copy, and a copied continuation (often long
    and right when it exists) is verified without the head's nodes competing for the budget. Every
    part still sees every prefill and verification, so a part that did not draft for a while
    catches up on its next draft."""

    def __init__(self, parts: Sequence[Drafter]):
        super().__init__(parts)
        self.name = "|".join(p.name for p in self.parts)
        # Every part's sources, numbered part after part.
        self._offsets = [0]
        for p in self.parts:
            self._offsets.append(self._offsets[-1] + int(p.num_draft_sources))
        self.num_draft_sources = self._offsets[-1]

    def draft_source(self, context: Sequence[int], partition=None) -> Optional[int]:
        """The source, within the first part that will (or may: it cannot tell) draft for
        ``context``. Prompt lookup copying a repeated run and a head guessing new text are right
        at very different rates: the scheduler keeps an estimate for each, so one's misses do not
        shorten the other's drafts."""
        for k, p in enumerate(self.parts):
            src = draft_source_of(p, context, partition)
            if src is not None:
                return self._offsets[k] + int(src)
        return None

    def propose(self, reqs: List[DraftRequest]) -> List[Draft]:
        out: List[Draft] = [None] * len(reqs)  # type: ignore[list-item]
        todo = list(range(len(reqs)))
        for p in self.parts:
            ds = p.propose([reqs[i] for i in todo])
            if len(ds) != len(todo):
                raise ValueError(f"drafter {p.name!r} returned {len(ds)} drafts for {len(todo)} "
                                 "requests")
            rest = []
            for i, d in zip(todo, ds):
                out[i] = d
                if len(d.tokens) <= 1:
                    rest.append(i)
            todo = rest
            if not todo:
                break
        return out

    def describe(self) -> str:
        return ", else ".join(p.describe() for p in self.parts)


def merge_drafts(drafts: Sequence[Draft], budget: int) -> Draft:
    """One tree holding the drafts' paths (the first draft's nodes first), at most ``budget``
    nodes beyond the root. All drafts must share the root token; a sampled draft is returned
    alone (see the module docstring)."""
    root = drafts[0].tokens[0]
    for d in drafts:
        if d.tokens[0] != root:
            raise ValueError("merged drafts must share the root token")
        if d.draft_probs is not None:
            return d
    tokens, parents = [root], [-1]
    index: Dict[Tuple[int, int], int] = {}
    for d in drafts:
        where = {0: 0}  # this draft's node -> merged node
        for i in range(1, len(d.tokens)):
            pm = where.get(d.parents[i])
            if pm is None:  # its parent was cut by the budget
                continue
            key = (pm, int(d.tokens[i]))
            node = index.get(key)
            if node is None:
                if len(tokens) - 1 >= budget:
                    continue
                node = len(tokens)
                tokens.append(int(d.tokens[i]))
                parents.append(pm)
                index[key] = node
            where[i] = node
    return Draft(tokens, parents)
