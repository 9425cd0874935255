"""N-gram / prompt-lookup drafting (no weights): the tokens that followed the latest earlier
occurrence of the context's last n tokens, n = max_ngram .. 1 (Saxena 2023, "prompt lookup
decoding"; HF transformers' ``prompt_lookup_num_tokens``). Drafts are deterministic chains, so the
target verifies them with the target-only walk when sampling.

A continuation copied after a 3-token match (a passage being quoted) is right far more often than
one after a single repeated token: each match length is its own draft source, so the scheduler
keeps an acceptance estimate and a draft length per match length."""

from __future__ import annotations

from typing import List, Optional, Tuple

from pyspec.drafters.base import Draft, Drafter, DraftRequest


def prompt_lookup_match(context: List[int], max_ngram: int = 3,
                        min_ngram: int = 1) -> Tuple[int, int]:
    """(n, where): the longest n in [min_ngram, max_ngram] whose last-n-token suffix occurred
    earlier in ``context`` with a token after it, and the index right after that latest
    occurrence (the copied continuation starts there); (0, -1) when none did."""
    n_ctx = len(context)
    for n in range(min(max_ngram, n_ctx - 1), min_ngram - 1, -1):
        tail = context[n_ctx - n:]
        for start in range(n_ctx - n - 1, -1, -1):
            if context[start:start + n] == tail:
                return n, start + n
    return 0, -1


class NgramDrafter(Drafter):
    name = "ngram"

    def __init__(self, max_ngram: int = 3, min_ngram: int = 1):
        if not isinstance(max_ngram, int) or not 1 <= max_ngram <= 16:
            raise ValueError(f"max_ngram (N of the spec ngram:N) must be an int in [1, 16]; "
                             f"got {max_ngram!r}")
        if not isinstance(min_ngram, int) or not 1 <= min_ngram <= max_ngram:
            raise ValueError(f"min_ngram (M of ngram:N@min=M) must be an int in [1, "
                             f"max_ngram={max_ngram}]; got "
                             f"{min_ngram!r}")
        self.max_ngram, self.min_ngram = max_ngram, min_ngram
        self.num_draft_sources = max_ngram  # source k: a match of max_ngram - k tokens

    def propose(self, reqs: List[DraftRequest]) -> List[Draft]:
        out = []
        for r in reqs:
            ctx = r.context if isinstance(r.context, list) else list(r.context)
            n, where = prompt_lookup_match(ctx, self.max_ngram, self.min_ngram)
            chain = ctx[where:where + min(r.budget, r.depth_limit)] if n else []
            out.append(Draft([int(ctx[-1])] + [int(t) for t in chain],
                             list(range(-1, len(chain)))))
        return out

    def draft_source(self, context, partition=None) -> Optional[int]:
        ctx = context if isinstance(context, list) else list(context)
        n = prompt_lookup_match(ctx, self.max_ngram, self.min_ngram)[0]
        return self.max_ngram - n if n else None

    def describe(self) -> str:
        lo = f"{self.min_ngram} <= " if self.min_ngram > 1 else ""
        return f"ngram (prompt lookup, {lo}n <= {self.max_ngram})"
