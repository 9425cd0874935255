"""Growing a draft tree level by level from a drafter's distributions.

Deterministic mode (EAGLE-2, Li et al. 2024, "dynamic draft trees"): every level expands the
``width`` frontier nodes with the highest cumulative draft probability (the drafter's estimate of
the chance the target accepts the whole path) into their ``width`` most likely children; after the
last level all candidates are reranked by cumulative probability and the best ``budget`` kept.
Cumulative probabilities never increase along a path, so the kept set contains every kept node's
ancestors (ties broken by creation order, parents first).

Sampled mode (a chain, width 1): each child is drawn from the drafter's filtered distribution, whose
row is recorded for lossless verification by rejection sampling (Leviathan et al. 2023).
"""

from __future__ import annotations

import math
from typing import List, Optional

import torch

from pyspec.drafters.base import Draft, top_children


class TreeBuilder:
    def __init__(self, root_token: int, *, width: int, depth: int, budget: int, sample: bool,
                 gen: Optional[torch.Generator] = None, vocab_map: Optional[torch.Tensor] = None):
        self.tokens: List[int] = [int(root_token)]
        self.parents: List[int] = [-1]
        self.scores: List[float] = [0.0]
        self.run: List[int] = [0]  # nodes the drafter has run (root + expanded frontiers)
        self.frontier: List[int] = [0]
        self.width = 1 if sample else max(1, width)
        self.depth = max(0, depth)
        self.budget = max(0, budget)
        self.sample = sample
        self.gen = gen
        self.level = 0
        self.vocab_map = vocab_map  # draft-vocab index -> target token id (reduced vocabularies)
        self.qrows: dict = {}  # node -> the distribution its children were sampled from

    @property
    def done(self) -> bool:
        return self.level >= self.depth or not self.frontier or self.budget == 0

    def run_parents(self) -> List[int]:
        """Parents of the run nodes, as indices into ``self.run``."""
        where = {n: i for i, n in enumerate(self.run)}
        return [-1 if self.parents[n] < 0 else where[self.parents[n]] for n in self.run]

    def frontier_rows(self) -> List[int]:
        """Indices into ``self.run`` of the current frontier (rows whose distributions are next)."""
        where = {n: i for i, n in enumerate(self.run)}
        return [where[n] for n in self.frontier]

    def expand(self, probs: torch.Tensor, kids: Optional[List[List[int]]] = None,
               check: bool = True) -> None:
        """``probs`` [len(frontier), V]: each frontier node's draft distribution; ``kids``: the
        children chosen per row (default: chosen here)."""
        if probs.shape[0] != len(self.frontier):
            raise ValueError("expand: one distribution row per frontier node")
        if check and not bool(torch.isfinite(probs).all()):
            raise FloatingPointError("the drafter produced non-finite probabilities")
        if kids is None:
            kids = top_children(probs, self.width, self.sample, self.gen)
        pv = [[float(probs[row, c]) for c in ks] for row, ks in enumerate(kids)]
        new: List[int] = []
        for row, f in enumerate(self.frontier):
            if self.sample:
                self.qrows[f] = probs[row]
            for c, p in zip(kids[row], pv[row]):
                if p <= 0.0 and not self.sample:
                    continue
                tok = int(self.vocab_map[c]) if self.vocab_map is not None else int(c)
                self.tokens.append(tok)
                self.parents.append(f)
                self.scores.append(self.scores[f] + (math.log(p) if p > 0 else -1e30))
                new.append(len(self.tokens) - 1)
        self.level += 1
        new.sort(key=lambda n: (-self.scores[n], n))
        self.frontier = new[:self.width]
        self.run.extend(self.frontier)

    def draft(self, vocab_size: int) -> Draft:
        n = len(self.tokens)
        if n - 1 > self.budget:  # rerank: keep the `budget` most likely nodes (ancestor-closed)
            keep = sorted(range(1, n), key=lambda i: (-self.scores[i], i))[:self.budget]
            keep = [0] + sorted(keep)
        else:
            keep = list(range(n))
        where = {old: new for new, old in enumerate(keep)}
        tokens = [self.tokens[i] for i in keep]
        parents = [-1] + [where[self.parents[i]] for i in keep[1:]]
        probs = None
        if self.sample:
            probs = torch.zeros((len(keep), vocab_size), dtype=torch.float32)
            for old, row in self.qrows.items():
                if old in where:
                    q = row.float()
                    if self.vocab_map is not None:
                        full = torch.zeros(vocab_size, dtype=torch.float32)
                        full.index_add_(0, self.vocab_map.long(), q)
                        q = full
                    probs[where[old]] = q
        return Draft(tokens, parents, probs)
