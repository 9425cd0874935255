"""Drafting with a model of another tokenizer: proposals re-tokenized through text.

Per request and step: the target's context is decoded to text and encoded with the draft model's
tokenizer; the draft model (its own KV pool, its own positions) runs what is new since its last
step (the longest common prefix of draft tokens keeps its KV) and greedily writes a few tokens;
their text is encoded with the target's tokenizer after the context's last few tokens, and the
target tokens past those are the draft: a chain the target verifies like any other. The step's
requests run the draft model together (one batched step per token position). The target
decides every token, so the output is plain decoding's whatever the draft model writes (greedy
and sampled alike: the chain is deterministic, verified by the target-only walk).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, List, Optional, Tuple

import torch

from pyspec.drafters.base import Draft, Drafter, slots_of
from pyspec.runner import ModelRunner, SeqStep

__all__ = ["CrossTokenizerDrafter", "same_vocabulary"]

# Context tokens decoded with the continuation: the target's, to re-encode the proposal against
# (the re-encoding may merge the context's last tokens with the proposal's first characters, so
# the proposal starts after the tokens that came back unchanged); the draft's, to read the
# continuation's text as it follows the context.
WINDOW = 8


def same_vocabulary(a, b) -> bool:
    """Two tokenizers (pyspec.tokenizer.Tokenizer) map every token to the same id."""
    return a.vocab_size == b.vocab_size and \
        a._tk.get_vocab(with_added_tokens=True) == b._tk.get_vocab(with_added_tokens=True)


def _strip_partial(text: str) -> str:
    """``text`` without the replacement characters a cut-off UTF-8 sequence decodes to at its
    end."""
    return text.rstrip("\ufffd")


@dataclass
class _Run:
    """One request's continuation while the draft model writes it."""

    rid: int
    ids: List[int]  # the context's draft tokens
    table: List[int]  # its pages in the draft model's pool
    new: List[int]  # tokens the next draft-model step runs
    start: int  # their first position
    out: List[int]  # the continuation so far
    n: int  # its most tokens


class CrossTokenizerDrafter(Drafter):
    """Args:
        model: the draft model (any vocabulary).
        draft_tokenizer, target_tokenizer: :class:`pyspec.tokenizer.Tokenizer` of each.
        max_depth: most target tokens drafted per step (the request's budget caps it too).
        kv_tokens: the draft model's KV pool, in tokens, shared by the requests in flight (a
            request that does not fit gets no draft until others finish).
    """

    name = "cross-tokenizer"

    def __init__(self, model, draft_tokenizer, target_tokenizer, *, target_vocab: int,
                 max_depth: int = 5, kv_tokens: int = 16384, block_size: int = 16):
        if not isinstance(max_depth, int) or not 1 <= max_depth <= 64:
            raise ValueError(f"max_depth must be an int in [1, 64]; got {max_depth!r}")
        if not isinstance(kv_tokens, int) or kv_tokens < block_size:
            raise ValueError(f"kv_tokens must be an int >= {block_size}; got {kv_tokens!r}")
        self.model = model
        self.dtok, self.ttok = draft_tokenizer, target_tokenizer
        self.target_vocab = int(target_vocab)
        self.max_draft_depth = max_depth
        self.block_size = block_size
        self.runner = ModelRunner(model, -(-kv_tokens // block_size), block_size)
        self._free = list(range(self.runner.kv.num_blocks))[::-1]
        self._tables: Dict[int, List[int]] = {}
        self._ids: Dict[int, List[int]] = {}  # draft tokens whose KV is in the request's pages
        self._limit = int(model.cfg.context_limit)
        self._eos = set(int(e) for e in draft_tokenizer.eos_token_ids)

    def describe(self) -> str:
        return f"cross-tokenizer draft model (draft vocabulary {self.dtok.vocab_size})"

    # ---- the draft model's KV ----

    def release(self, request_id: int) -> None:
        self._free.extend(self._tables.pop(request_id, []))
        self._ids.pop(request_id, None)

    def _reserve(self, rid: int, tokens: int) -> Optional[List[int]]:
        table = self._tables.setdefault(rid, [])
        need = -(-tokens // self.block_size) - len(table)
        if need > len(self._free):
            return None
        for _ in range(max(0, need)):
            table.append(self._free.pop())
        return table

    def _continue(self, items: List[Tuple[int, List[int], int]]) -> List[List[int]]:
        """The draft model's greedy continuations of each ``(request id, draft tokens ids, n)``:
        up to ``n`` tokens, stopping at its end-of-sequence; [] for one that does not fit. The
        requests run together: one draft-model step per token position for all of them."""
        outs: List[List[int]] = [[] for _ in items]
        live: List[_Run] = []
        for (rid, ids, n), out in zip(items, outs):
            if len(ids) + n > self._limit:
                n = self._limit - len(ids)
            table = self._reserve(rid, len(ids) + n) if n > 0 else None
            if table is None:
                continue
            have = self._ids.get(rid, [])
            p = 0
            while p < min(len(have), len(ids) - 1) and have[p] == ids[p]:
                p += 1
            live.append(_Run(rid, ids, table, list(ids[p:]), p, out, n))
        running = live
        while running:
            o = self.runner.step([SeqStep(r.new, r.start, r.table, None, "last")
                                  for r in running])
            src: List[int] = []
            dst: List[int] = []
            for j, r in enumerate(running):
                base = o.row_indptr[j]
                src.extend(range(base, base + len(r.new)))
                dst.extend(slots_of(r.table, self.block_size, r.start, len(r.new)))
            self.runner.commit_kv(o, 0, src, dst)
            rows = torch.tensor([o.logits_indptr[j] for j in range(len(running))])
            toks = o.logits.index_select(0, rows).argmax(-1).tolist()
            more = []
            for r, tok in zip(running, toks):
                r.start += len(r.new)
                if tok in self._eos:
                    continue
                r.out.append(int(tok))
                r.new = [int(tok)]
                if len(r.out) < r.n:
                    more.append(r)
            running = more
        for r in live:
            # KV is written for ids and every token of out but the last (all of out when the
            # loop stopped at an end-of-sequence token: keeping one fewer only reruns it).
            self._ids[r.rid] = list(r.ids) + r.out[:-1] if r.out else list(r.ids)
        return outs

    # ---- drafting ----

    def propose(self, reqs) -> List[Draft]:
        # Per request, the context as the draft tokenizer reads it; then every continuation in
        # one batched run of the draft model; then each one's text as target tokens.
        plans = []
        for r in reqs:
            ctx = [int(t) for t in r.context]
            depth = min(self.max_draft_depth, r.depth_limit)
            ids = self.dtok.encode(self.ttok.decode(ctx), add_special_tokens=False) \
                if depth >= 1 else []
            plans.append((ctx, depth, ids))
        todo = [k for k, (_, _, ids) in enumerate(plans) if ids]
        # A few more draft tokens than target ones: the vocabularies cut text differently.
        conts = self._continue([(reqs[k].request_id, plans[k][2], plans[k][1] + 2)
                                for k in todo])
        cont_of = dict(zip(todo, conts))
        return [self._proposal(ctx, depth, ids, cont_of.get(k, []))
                for k, (ctx, depth, ids) in enumerate(plans)]

    def _proposal(self, ctx: List[int], depth: int, ids: List[int], cont: List[int]) -> Draft:
        """The draft's continuation ``cont`` of the context's draft tokens ``ids`` as a chain of
        target tokens after the context ``ctx`` (at most ``depth``)."""
        root = Draft([ctx[-1]], [-1])
        if not cont:
            return root
        # The continuation's text as it reads after the context's last tokens (decoded alone, a
        # SentencePiece vocabulary would drop its first token's leading space).
        before = self.dtok.decode(ids[-WINDOW:])
        after = self.dtok.decode(ids[-WINDOW:] + cont)
        text = _strip_partial(after[len(before):] if after.startswith(before)
                              else self.dtok.decode(cont))
        if not text:
            return root
        tail = ctx[-WINDOW:]
        enc = self.ttok.encode(self.ttok.decode(tail) + text, add_special_tokens=False)
        if enc[:len(tail)] == tail:
            prop = enc[len(tail):]
        else:  # the context's last tokens re-tokenize otherwise: the text alone
            prop = self.ttok.encode(text, add_special_tokens=False)
        prop = prop[:depth]
        for i, t in enumerate(prop):
            if not 0 <= t < self.target_vocab:
                prop = prop[:i]
                break
        return Draft([ctx[-1]] + prop, list(range(-1, len(prop))))
