"""Drafting with a smaller causal LM: an independent draft model, or the target's own first layers
(self-speculative layer skipping, Zhang et al. 2023 "Draft & Verify"; LayerSkip, Elhoushi et al.
2024: the first L layers + the final norm + lm_head).

The draft model's KV uses the target's block geometry and the same block tables (its own pool, or
for layer skipping the target pool's first L layers, which hold exactly the values the truncated
model computes for committed tokens). Each level of drafting runs the tree grown so far as scratch
rows over the committed pages (tree attention), so rejected draft nodes never touch the pages; the
tokens the target committed since the last step (normally the accepted path) are run first, as a
causal chain, and their KV is written into the pages in the same forward.
"""

from __future__ import annotations

from typing import Dict, List

import torch

from pyspec import TokenTree
from pyspec.drafters.base import (Draft, Drafter, DraftRequest, PrefillChunk, batch_children,
                                  batch_probs, draft_key, slots_of)
from pyspec.drafters.tree_builder import TreeBuilder
from pyspec.runner import KVPool, ModelRunner, SeqStep


class ModelDrafter(Drafter):
    """Args:
        model: the draft model (same vocabulary as the target).
        target_runner: the target's runner (block geometry; its pool when ``share_target_kv``).
        share_target_kv: the draft model is the target truncated to its first layers.
        width: 1 = chain (sampled requests draw it from the draft distribution); > 1 = a dynamic
            top-``width`` tree (deterministic children).
        max_depth: deepest draft level (the request's budget caps it too).
        same_tokenizer: the two models' tokenizer.json files are the same, so their vocabulary
            tables may differ in size (a family's sizes pad the embedding table differently, as
            Qwen2.5-0.5B's 151,936 rows against Qwen2.5-7B's 152,064): drafts come from the ids
            the target has (the draft's rows past them are never proposed; a smaller draft table
            reads as probability 0 past its end). Without it the sizes must be equal.
    """

    name = "draft-model"

    def __init__(self, model, target_runner: ModelRunner, *, share_target_kv: bool = False,
                 width: int = 1, max_depth: int = 8, name: str = "draft-model",
                 same_tokenizer: bool = False):
        tcfg = target_runner.model.cfg
        if model.cfg.vocab_size != tcfg.vocab_size and not same_tokenizer:
            raise ValueError(f"the draft model's vocabulary ({model.cfg.vocab_size} tokens) differs "
                             f"from the target's ({tcfg.vocab_size}); a draft model must share the "
                             "target's tokenizer (with both folders' tokenizer.json the same, the "
                             "table sizes may differ)")
        if not isinstance(width, int) or not 1 <= width <= 16:
            raise ValueError(f"width must be an int in [1, 16]; got {width!r}")
        if not isinstance(max_depth, int) or not 1 <= max_depth <= 64:
            raise ValueError(f"max_depth must be an int in [1, 64]; got {max_depth!r}")
        self.name = name
        self.model = model
        self.width = width
        self.max_depth = max_depth
        self.share = share_target_kv
        nb, bs = target_runner.kv.num_blocks, target_runner.block_size
        self.block_size = bs
        self.vocab_size = tcfg.vocab_size
        if share_target_kv:
            if getattr(target_runner, "tensor_parallel_size", 1) > 1:
                raise ValueError("a layer-skip drafter shares the target's KV pool, which "
                                 "tensor parallelism splits across ranks; with "
                                 "tensor_parallel_size > 1 use another drafter (ngram, "
                                 "default, an EAGLE / Medusa head or a draft model)")
            if model.device != target_runner.kv.k.device:
                raise ValueError(f"share_target_kv needs the draft model on the target's KV "
                                 f"device ({target_runner.kv.k.device}); it is on {model.device}")
            n = model.cfg.num_hidden_layers
            pool = KVPool(target_runner.kv.k[:n], target_runner.kv.v[:n])
            self.runner = ModelRunner(model, nb, bs, kv=pool)
        else:
            self.runner = ModelRunner(model, nb, bs)
        self._dc: Dict[int, int] = {}  # request -> positions whose draft KV is in the pages

    def kv_pools(self) -> list:
        return [] if self.share else [self.runner.kv]

    @property
    def max_draft_depth(self) -> int:
        return self.max_depth

    def node_budget(self, depth: int) -> int:
        return depth if self.width == 1 else min(255, depth * self.width)

    def prefill(self, chunks: List[PrefillChunk]) -> None:
        if self.share or not chunks:
            return
        out = self.runner.step([SeqStep(list(c.tokens), c.start, c.block_table, None, "none")
                                for c in chunks])
        slots: List[int] = []
        for c in chunks:
            slots.extend(slots_of(c.block_table, self.block_size, c.start, len(c.tokens)))
            self._dc[c.request_id] = c.start + len(c.tokens)
        self.runner.commit_kv(out, 0, range(len(slots)), slots)

    def release(self, request_id: int) -> None:
        self._dc.pop(request_id, None)

    def propose(self, reqs: List[DraftRequest]) -> List[Draft]:
        builders: List[TreeBuilder] = []
        pend: List[List[int]] = []
        for r in reqs:
            sample = not r.greedy and self.width == 1
            depth = min(r.depth_limit, self.max_depth)
            builders.append(TreeBuilder(r.context[-1], width=self.width, depth=depth,
                                        budget=r.budget, sample=sample))
            if self.share:
                pend.append([])
            else:
                # Unknown (e.g. the request was switched to this drafter): recompute everything.
                dc = self._dc.get(r.request_id, 0)
                if dc > r.start:
                    dc = 0
                pend.append([int(t) for t in r.context[dc:r.start]])
        # Long catch-ups run first as causal chunks (a tree holds at most 256 nodes).
        long_ = [i for i, p in enumerate(pend) if len(p) > 16]
        if long_:
            seqs = [SeqStep(pend[i], reqs[i].start - len(pend[i]), reqs[i].block_table, None,
                            "none") for i in long_]
            out = self.runner.step(seqs)
            dst: List[int] = []
            for i in long_:
                dst.extend(slots_of(reqs[i].block_table, self.block_size,
                                    reqs[i].start - len(pend[i]), len(pend[i])))
                self._dc[reqs[i].request_id] = reqs[i].start
                pend[i] = []
            self.runner.commit_kv(out, 0, range(len(dst)), dst)
        first = True
        while True:
            active = [i for i, b in enumerate(builders) if not b.done]
            if not active:
                break
            seqs = []
            for i in active:
                r, b = reqs[i], builders[i]
                m = len(pend[i]) if first else 0
                toks = (pend[i] if first else []) + [b.tokens[n] for n in b.run]
                parents = list(range(-1, m - 1)) + [p + m if p >= 0 else m - 1
                                                     for p in b.run_parents()]
                if m == 0:
                    parents[0] = -1
                seqs.append(SeqStep(toks, r.start - m, r.block_table, TokenTree(parents), "all"))
            out = self.runner.step(seqs)
            if first and not self.share:
                # The pending committed tokens and the root are final: write their KV now.
                src, dst = [], []
                for j, i in enumerate(active):
                    r, m = reqs[i], len(pend[i])
                    base = out.row_indptr[j]
                    src.extend(range(base, base + m + 1))
                    dst.extend(slots_of(r.block_table, self.block_size, r.start - m, m + 1))
                    self._dc[r.request_id] = r.start + 1
                self.runner.commit_kv(out, 0, src, dst)
            # One batched filter + child choice over every frontier row of the level.
            rows, row_req, keys, counts = [], [], [], []
            for j, i in enumerate(active):
                b = builders[i]
                m = len(pend[i]) if first else 0
                base = out.logits_indptr[j]
                fr = b.frontier_rows()
                rows.extend(base + m + k for k in fr)
                row_req.extend([reqs[i]] * len(fr))
                keys.extend(draft_key(reqs[i], n) for n in b.frontier)
                counts.append(len(fr))
            probs = batch_probs(self._target_vocab(out.logits.index_select(0, torch.tensor(rows))),
                                row_req)
            if not bool(torch.isfinite(probs).all()):
                raise FloatingPointError("the draft model produced non-finite probabilities")
            sample = [builders[i].sample for i, c in zip(active, counts) for _ in range(c)]
            kids = batch_children(probs, self.width, sample, keys)
            pos = 0
            for i, c in zip(active, counts):
                builders[i].expand(probs[pos:pos + c], kids[pos:pos + c], check=False)
                pos += c
            first = False
        return [b.draft(self.vocab_size) for b in builders]

    def _target_vocab(self, logits: torch.Tensor) -> torch.Tensor:
        """Draft logits over the target's vocabulary: cut past it, or -inf past a smaller
        draft table's end."""
        extra = self.vocab_size - logits.shape[1]
        if extra < 0:
            return logits[:, :self.vocab_size]
        if extra > 0:
            return torch.nn.functional.pad(logits, (0, extra), value=float("-inf"))
        return logits

    def describe(self) -> str:
        kind = "layer skip" if self.share else "draft model"
        return (f"{self.name} ({kind}, {self.model.cfg.num_hidden_layers} layers, "
                f"{'chain' if self.width == 1 else f'top-{self.width} dynamic tree'})")


class LayerSkipDrafter(ModelDrafter):
    """Self-speculation: the target's first ``num_layers`` layers + final norm + lm_head."""

    def __init__(self, target_runner: ModelRunner, num_layers: int, **kw):
        kw.setdefault("name", "layer-skip")
        super().__init__(target_runner.model.truncated(num_layers), target_runner,
                         share_target_kv=True, **kw)
