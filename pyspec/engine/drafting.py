"""The DRAFT stage of an engine step: the engine's drafters, the draft requests of a step, the
drafts they return (validated, failures isolated to the requests they happen on), what the
drafters are told afterwards (prefill chunks, verified paths, finished requests), and which draft
source drafts each request's next step.

A drafter that raises, or returns a malformed draft, fails only the requests it failed on: the
engine's ``fail`` callback marks those (``Scheduler.mark_drafter_failed``): nothing more is drafted
for them, so they decode plainly, and every other request goes on.
"""

from __future__ import annotations

import logging
import operator
import time
from typing import Callable, Dict, List, Mapping, Optional, Tuple, Union

import torch

from pyspec import TokenTree, _C
from pyspec.drafters import Drafter, make_drafter
from pyspec.drafters.base import (Draft, DraftRequest, draft_source_of, layers_of, select_layers,
                                  union_layers)
from pyspec.sampling import draft_probs_problem

__all__ = ["DraftStage"]

_log = logging.getLogger("pyspec.engine")

Drafts = Dict[int, Tuple[Draft, TokenTree]]  # request id -> (draft, its validated tree)


class DraftStage:
    """An engine's drafters and its drafting step.

    Args:
        runner: the target's runner (drafters may read its model and pools).
        drafter: the default drafter's spec (see :func:`pyspec.drafters.make_drafter`), or None.
        drafters: further named drafters (name -> spec or Drafter).
        fail: ``fail(request_id, detail)``, called for a request its drafter failed on.
    """

    def __init__(self, runner, drafter: Union[None, str, Drafter],
                 drafters: Optional[Mapping[str, Union[str, Drafter]]],
                 fail: Callable[[int, str], None]):
        self.vocab_size = int(runner.model.cfg.vocab_size)
        self.drafters: Dict[str, Drafter] = {}
        default = make_drafter(drafter, runner)
        if default is not None:
            self.drafters[default.name] = default
        for name, spec in (drafters or {}).items():
            d = make_drafter(spec, runner)
            if d is None:
                raise ValueError(f"drafters[{name!r}] is 'none'; leave it out instead")
            self.drafters[name] = d
        self.default = default.name if default is not None else None
        self._fail = fail
        # Each drafter's requests share a scheduler evidence group: its recent acceptance on this
        # engine is a new request's prior for the cost model's fallback test.
        self.evidence_group = {name: i for i, name in enumerate(self.drafters)}
        self.pools = [p for d in self.drafters.values() for p in d.kv_pools()]
        # The target layers any drafter reads (False: none); each drafter gets its own.
        depth = runner.model.cfg.num_hidden_layers
        self.hidden_layers = union_layers(self.drafters.values(), depth)
        self.need_hidden = self.hidden_layers or False
        # Drafters told the target's prediction at every verified node (Verified.predicted).
        self.wants_predictions = {name for name, d in self.drafters.items()
                                  if d.wants_predictions}
        self._layers_of = {name: layers_of(d, depth) for name, d in self.drafters.items()
                           if d.needs_hidden}
        from pyspec.models.llama import hidden_layers

        for name, layers in self._layers_of.items():
            try:  # a custom drafter's layer list is checked now, not at every request's step
                hidden_layers(layers, depth)
            except ValueError as e:
                raise ValueError(f"drafter {name!r} reads target layers {list(layers)}: {e}"
                                 ) from None
        # Drafters with several draft sources (`A|B` parts, prompt lookup's match lengths): name
        # -> number of sources. The scheduler keeps MAX_DRAFT_SOURCES estimates per request;
        # sources beyond share the last.
        self.sourced = {}
        for name, d in self.drafters.items():
            depth = d.max_draft_depth
            if not isinstance(depth, int) or isinstance(depth, bool) or not 0 <= depth <= 255:
                raise ValueError(f"drafter {name!r} has max_draft_depth {depth!r}; allowed: an "
                                 f"int in [0, 255] (draft tree levels per step)")
            n = d.num_draft_sources
            if not isinstance(n, int) or isinstance(n, bool) or n < 1:
                raise ValueError(f"drafter {name!r} has {n!r} draft sources; allowed: an int >= 1")
            if n > 1:
                self.sourced[name] = n
        self._chains: Dict[int, TokenTree] = {}

    def max_depth(self) -> int:
        """The deepest draft any drafter makes (0 without drafters)."""
        return max((int(d.max_draft_depth) for d in self.drafters.values()), default=0)

    def chain(self, n: int) -> TokenTree:
        """A chain of ``n`` draft tokens (cached)."""
        t = self._chains.get(n)
        if t is None:
            t = self._chains[n] = TokenTree.chain(n)
        return t

    # ---- what the drafters are told ----

    def release(self, rid: int) -> None:
        """Every drafter forgets request ``rid`` (its KV is gone or it finished)."""
        for d in self.drafters.values():
            try:
                d.release(rid)
            except Exception:  # noqa: BLE001 - a drafter's bookkeeping never fails a request
                pass

    def release_one(self, name: str, rid: int) -> None:
        self.drafters[name].release(rid)

    def learn(self, rid: int, context: List[int], partition: Optional[str] = None) -> None:
        """Drafters that learn from finished requests see this one's tokens (in its partition)."""
        for d in self.drafters.values():
            try:
                d.learn(rid, context, partition)
            except Exception:  # noqa: BLE001 - learning never fails a request
                _log.warning("drafter %r failed to learn from request %d", d.name, rid)

    def notify(self, name: str, what: str, items) -> None:
        """``drafter.prefill(items)`` / ``drafter.observe(items)``; a failure is retried item by
        item to find the requests it belongs to."""
        d = self.drafters[name]
        try:
            getattr(d, what)(items)
        except Exception:  # noqa: BLE001 - isolate: retry one by one
            for it in items:
                try:
                    getattr(d, what)([it])
                except Exception as e:  # noqa: BLE001
                    self._fail(it.request_id, f"{what}: {type(e).__name__}: {e}")

    def hidden_for(self, name: str, hidden, rows):
        """Rows ``rows`` of the step's hidden states, the layers drafter ``name`` reads."""
        want = self._layers_of.get(name)
        if hidden is None or want is None:
            return None
        return select_layers(hidden[rows], self.hidden_layers, want)

    def set_draft_sources(self, scheduler, reqs) -> None:
        """Tell the scheduler which source of its drafter (``A|B``'s part, prompt lookup's match
        length) drafts each running request's next step, so it sizes the step from that source's
        own acceptance estimate. ``reqs``: the engine's requests by id."""
        for rid in scheduler.running_queue:
            r = reqs.get(rid)
            if r is None or r.failed or r.drafter not in self.sourced:
                continue
            try:
                src = draft_source_of(self.drafters[r.drafter], r.context,
                                      r.params.learn_partition)
                if src is None:  # nothing will be drafted: no evidence to attribute
                    continue
                src = int(src)
                if not 0 <= src < self.sourced[r.drafter]:
                    raise ValueError(f"draft source {src} is not in [0, "
                                     f"{self.sourced[r.drafter]})")
            except Exception as e:  # noqa: BLE001 - a drafter's failure is its request's alone
                self._fail(rid, f"draft_source: {type(e).__name__}: {e}")
                continue
            scheduler.set_draft_source(rid, min(src, _C.MAX_DRAFT_SOURCES - 1))

    # ---- drafting ----

    def requests(self, so, reqs, gamma: int):
        """Each drafter's requests of the step, the requests' block tables, and an upper bound
        on the step's rows (its scheduled tokens plus every draft's node budget)."""
        kinds, starts, budgets = so.kinds, so.start_pos, so.draft_budget
        blk_ptr, all_blocks = so.block_indptr, so.block_tables
        rows = len(so.tokens)
        groups: Dict[str, List[DraftRequest]] = {}
        tables = {}
        for i, rid in enumerate(so.ids):
            table = all_blocks[blk_ptr[i]:blk_ptr[i + 1]]
            tables[i] = table
            r = reqs[rid]
            if kinds[i] == "prefill" or r.drafter is None or r.failed:
                continue
            depth = min(budgets[i], gamma)
            if depth <= 0:
                continue
            p = r.params
            try:
                nodes = max(1, operator.index(self.drafters[r.drafter].node_budget(depth)))
            except Exception as e:  # noqa: BLE001 - the drafter's fault: this request only
                self._fail(rid, f"node_budget: {type(e).__name__}: {e}")
                continue
            rows += nodes
            groups.setdefault(r.drafter, []).append(DraftRequest(
                rid, r.context, starts[i], table, nodes, float(p.temperature), int(p.top_k),
                float(p.top_p), float(p.min_p), r.seed, r.stats.steps, depth,
                p.learn_partition))
        return groups, tables, rows

    def draft(self, groups: Dict[str, List[DraftRequest]], trace, scheduler, stats) -> Drafts:
        """Every group's drafts; each drafter's time per draft level goes to the scheduler's cost
        model, and into ``stats.draft_seconds``."""
        drafts: Drafts = {}
        for name, reqs in groups.items():
            t0 = time.perf_counter()
            drafts.update(self._draft_group(self.drafters[name], reqs))
            t1 = time.perf_counter()
            if trace is not None:
                trace.drafts.append((name, t0, t1, [q.request_id for q in reqs]))
            stats.draft_seconds += t1 - t0
            scheduler.observe_draft_time(self.evidence_group[name], t1 - t0,
                                         sum(q.depth_limit for q in reqs))
        return drafts

    def _draft_group(self, d: Drafter, reqs: List[DraftRequest]) -> Drafts:
        """Drafts of one drafter, with failures isolated to the requests they happen on."""
        try:
            drafts = d.propose(reqs)
            if len(drafts) != len(reqs):
                raise RuntimeError(f"drafter {d.name} returned {len(drafts)} drafts for "
                                   f"{len(reqs)} requests")
            pairs = list(zip(reqs, drafts))
        except Exception:  # noqa: BLE001 - retry one by one to find the failing requests
            pairs = []
            for q in reqs:
                try:
                    pairs.append((q, d.propose([q])[0]))
                except Exception as e:  # noqa: BLE001
                    self._fail(q.request_id, f"propose: {type(e).__name__}: {e}")
        out = {}
        for q, dr in pairs:
            tree = self._valid(dr, q)
            if tree is not None:
                out[q.request_id] = (dr, tree)
            else:
                self._fail(q.request_id, "propose returned a malformed draft")
        return out

    def _valid(self, dr: Draft, q: DraftRequest) -> Optional[TokenTree]:
        """The draft's validated tree, or None when the draft is malformed."""
        try:
            n = len(dr.tokens)
            if n < 1 or n - 1 > q.budget or len(dr.parents) != n:
                return None
            if int(dr.tokens[0]) != int(q.context[-1]):
                return None
            if any(not 0 <= int(t) < self.vocab_size for t in dr.tokens):
                return None
            parents = [int(x) for x in dr.parents]
            tree = (self.chain(n - 1) if parents == list(range(-1, n - 1))
                    else TokenTree(parents))  # validates the shape (ValueError)
            if tree.max_depth > q.depth_limit:  # KV slots are reserved for depth_limit + 1
                return None
            if dr.draft_probs is not None:
                p = dr.draft_probs
                if tuple(p.shape) != (n, self.vocab_size):
                    return None
                if q.temperature > 0.0:
                    # The rows the batch's acceptance reads, which refuses the whole call for one
                    # bad row: checked here (at half its tolerance, so that the walk's float32
                    # sums cannot disagree), failing only this request.
                    if draft_probs_problem(dr.tokens, parents, p,
                                           row_sum_tolerance=0.5e-3) is not None:
                        return None
                elif not bool(torch.isfinite(p).all()):
                    return None
            return tree
        except Exception:  # noqa: BLE001
            return None
