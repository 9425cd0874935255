"""Lookahead decoding (Fu et al. 2024, "Break the Sequential Dependency of LLM Inference Using
Lookahead Decoding"): Jacobi iteration over a window of guessed tokens, with an n-gram pool
built from the iteration's own trajectory, and no weights.

Jacobi decoding guesses the next ``window`` tokens and lets the target predict every position
of the guess in one forward; the predictions are the next guess (a fixed-point iteration that
converges to greedy decoding). Lookahead keeps what the iteration produces along the way: the
target's prediction after a guessed (n-1)-gram becomes an n-gram in a pool, and later steps
draft the pool's n-grams that start with the current token.

Here the guess is verified in the same step, as one branch of the draft tree, beside the pool's
candidate n-grams (the verification branch of the paper); no separate lookahead branch is run.
Every verified node's target prediction comes back to the drafter (:attr:`Verified.predicted`):

* the new Jacobi window is the target's predictions along the branch beyond the accepted path
  (the positions after the new root), padded by walking the pool;
* every node that was not accepted yields an n-gram: the (n-1) tokens ending at it (its tree
  path after the request's context) followed by the target's prediction there.

The committed text's own n-grams enter the pool too (``context=1``, the default: prompt lookup
with a one-token key; ``context=0`` keeps the pool to the iteration's n-grams, as in the paper).
A pool entry also remembers the token before its key, and candidates whose remembered token
matches the context's are tried first. The paper's window keeps several past iterations to form
its n-grams; this one keeps the latest, so the n-grams pair the previous guess with the new
prediction. The pool is per request (bounded), forgotten when the request finishes.

Drafts are deterministic chains and trees (no draft distribution): sampled requests are verified
with the target-only walk, greedy ones with the greedy walk; both lossless.
"""

from __future__ import annotations

import collections
from typing import Dict, List, Sequence, Tuple

from pyspec.drafters.base import Draft, Drafter, DraftRequest, Verified
from pyspec.drafters.merged import merge_drafts

__all__ = ["LookaheadDrafter", "OPTIONS"]

# Spec options (``lookahead@window=W,ngram=N,pool=P,nodes=M,context=0|1``) -> arguments.
OPTIONS = {"window": "window", "ngram": "ngram", "pool": "pool", "nodes": "max_nodes",
           "context": "context"}
MAX_KEYS = 8192  # distinct key tokens kept per request (least recently used dropped)


class _State:
    __slots__ = ("pool", "seen", "window", "window_pos", "tail", "root_pos")

    def __init__(self):
        # key token -> {(token before the key, continuation...): None}, newest last.
        self.pool: "collections.OrderedDict[int, collections.OrderedDict]" = \
            collections.OrderedDict()
        self.seen = 0  # context tokens whose n-grams are in the pool
        self.window: List[int] = []  # guesses for the positions after the root at window_pos
        self.window_pos = -1
        self.tail: List[int] = []  # the context's last tokens at the latest proposal
        self.root_pos = -1


class LookaheadDrafter(Drafter):
    name = "lookahead"
    wants_predictions = True  # the engine returns the target's argmax at every verified node

    def __init__(self, window: int = 4, ngram: int = 3, pool: int = 4, max_nodes: int = 8,
                 context: int = 1):
        for key, val, lo, hi in (("window", window, 1, 16), ("ngram", ngram, 2, 8),
                                 ("pool", pool, 1, 64), ("nodes", max_nodes, 1, 255),
                                 ("context", context, 0, 1)):
            if not isinstance(val, int) or isinstance(val, bool) or not lo <= val <= hi:
                raise ValueError(f"lookahead drafter: {key} must be an int in [{lo}, {hi}]; "
                                 f"got {val!r}")
        self.window, self.ngram, self.pool_size = window, ngram, pool
        self.max_nodes, self.use_context = max_nodes, bool(context)
        self._states: Dict[int, _State] = {}

    @property
    def max_draft_depth(self) -> int:
        return max(self.window, self.ngram - 1)

    def node_budget(self, depth: int) -> int:
        return min(self.max_nodes,
                   max(depth, round(self.max_nodes * depth / self.max_draft_depth)))

    # ---- the pool ----

    def _add(self, st: _State, prev: int, gram: Sequence[int]) -> None:
        """n-gram ``gram`` (key first) seen after token ``prev`` (-1: none)."""
        key = int(gram[0])
        entries = st.pool.get(key)
        if entries is None:
            entries = st.pool[key] = collections.OrderedDict()
            if len(st.pool) > MAX_KEYS:
                st.pool.popitem(last=False)
        else:
            st.pool.move_to_end(key)
        entry = (int(prev),) + tuple(int(t) for t in gram[1:])
        entries.pop(entry, None)
        entries[entry] = None
        while len(entries) > self.pool_size:
            entries.popitem(last=False)

    def _candidates(self, st: _State, key: int, prev: int) -> List[Tuple[int, ...]]:
        """Continuations of ``key`` in the pool: those seen after ``prev`` first, newest first
        within each kind, distinct."""
        entries = st.pool.get(int(key))
        if not entries:
            return []
        newest = list(reversed(entries))
        first = [e[1:] for e in newest if e[0] == prev]
        rest = [e[1:] for e in newest if e[0] != prev]
        return list(dict.fromkeys(first + rest))

    def _harvest_context(self, st: _State, ctx: List[int]) -> None:
        n = self.ngram
        if self.use_context:
            for i in range(max(0, st.seen - n + 1), len(ctx) - n + 1):
                self._add(st, ctx[i - 1] if i else -1, ctx[i:i + n])
        st.seen = len(ctx)

    def _walk(self, st: _State, seq: List[int], prev: int, want: int) -> List[int]:
        """``seq`` extended to ``want`` tokens by the pool's newest continuations."""
        seq = list(seq)
        last = seq[-1] if seq else None
        while len(seq) < want and last is not None:
            cands = self._candidates(st, last, prev)
            if not cands:
                break
            prev = last
            for t in cands[0]:
                if len(seq) >= want:
                    break
                prev, last = last, t
                seq.append(t)
        return seq

    # ---- the drafter interface ----

    def propose(self, reqs: List[DraftRequest]) -> List[Draft]:
        out = []
        for r in reqs:
            ctx = r.context if isinstance(r.context, list) else list(r.context)
            st = self._states.get(r.request_id)
            if st is None or st.seen > len(ctx):
                st = self._states[r.request_id] = _State()
            self._harvest_context(st, ctx)
            root = int(ctx[-1])
            prev = int(ctx[-2]) if len(ctx) > 1 else -1
            budget, depth = int(r.budget), int(r.depth_limit)
            # The Jacobi guess: the latest iterate when it belongs to this root, else the pool's
            # continuation of the root; without either, the tokens that followed the root's
            # latest earlier occurrence, else the context's last tokens (a first guess to iterate).
            guess = st.window if st.window_pos == r.start else []
            guess = self._walk(st, [root] + guess, prev, self.window + 1)[1:]
            if not guess:
                where = max((i for i in range(len(ctx) - 1) if ctx[i] == root), default=-1)
                guess = ctx[where + 1:where + 1 + self.window] if where >= 0 else \
                    ctx[-self.window:]
            cands = self._candidates(st, root, prev)
            chain = guess[:min(depth, budget if not cands else max(1, budget // 2))]
            parts = [Draft([root] + chain, list(range(-1, len(chain))))]
            for c in cands:
                c = list(c[:depth])
                parts.append(Draft([root] + c, list(range(-1, len(c)))))
            draft = merge_drafts(parts, budget) if len(parts) > 1 else parts[0]
            st.window, st.window_pos = list(chain), r.start
            st.tail, st.root_pos = ctx[-self.ngram:], r.start
            out.append(draft)
        return out

    def observe(self, results: List[Verified]) -> None:
        for v in results:
            st = self._states.get(v.request_id)
            tree, pred = v.tree, v.predicted
            if st is None or tree is None or pred is None or st.root_pos != v.start:
                continue
            toks, parents = tree.tokens, tree.parents
            children: Dict[int, List[int]] = {}
            for i in range(1, len(toks)):
                children.setdefault(parents[i], []).append(i)
            # The accepted path (the committed tokens after the root).
            node, accepted = 0, {0}
            for t in v.committed[1:]:
                node = next((c for c in children.get(node, ()) if toks[c] == t), -1)
                if node < 0:  # not this tree's path: nothing to learn from it
                    break
                accepted.add(node)
            if node < 0:
                continue
            # n-grams at every node not accepted: its last (n-1) tokens, then the target's
            # prediction there.
            base = st.tail  # ends with the root
            for i in range(1, len(toks)):
                if i in accepted:
                    continue
                path = []
                j = i
                while j > 0:
                    path.append(toks[j])
                    j = parents[j]
                seq = base + path[::-1] + [int(pred[i])]
                if len(seq) > self.ngram:
                    self._add(st, seq[-self.ngram - 1], seq[-self.ngram:])
            # The next Jacobi iterate: the predictions beyond the accepted path, along the
            # branch that continues the previous guess where it can.
            a = len(v.committed) - 1
            old = st.window
            window = []
            k = a
            kids = children.get(node, [])
            while kids:
                want = old[k] if k < len(old) else None
                node = next((c for c in kids if toks[c] == want), kids[0])
                window.append(int(pred[node]))
                k += 1
                kids = children.get(node, [])
            st.window, st.window_pos = window, v.start + a + 1

    def release(self, request_id: int) -> None:
        self._states.pop(request_id, None)

    def describe(self) -> str:
        ctx = "" if self.use_context else ", iteration n-grams only"
        return (f"lookahead (Jacobi window {self.window}, {self.ngram}-grams, pool {self.pool_size}"
                f" per token, <= {self.max_nodes} nodes{ctx})")
