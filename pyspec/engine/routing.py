"""Which drafter serves a request: the :class:`Router` picks one when the request arrives, and
:func:`switch_drafters` moves a request to the next drafter of the router's ``switch_order`` when
the scheduler says its current one does not pay (``Scheduler.switch_reason``: its acceptance
average stays below ``switch_below``, or it started plain on its drafter's losing record)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

__all__ = ["Router", "RouteFeatures", "switch_drafters"]


@dataclass
class RouteFeatures:
    prompt_len: int
    batch_size: int  # requests queued or running when this one arrived


class Router:
    """Picks a request's drafter from simple features; the first matching rule wins.

    ``rules``: ``[(predicate(RouteFeatures) -> bool, drafter_name), ...]``; ``default``: the
    drafter otherwise. ``switch_order``: drafters a request moves to (in order) when its
    acceptance stays low with the current one. Example: long prompts to prompt lookup::

        Router([(lambda f: f.prompt_len > 1024, "ngram")], default="eagle",
               switch_order=["ngram"])
    """

    def __init__(self, rules=(), default: Optional[str] = None, switch_order: Sequence[str] = ()):
        self.rules = list(rules)
        self.default = default
        self.switch_order = list(switch_order)

    def route(self, f: RouteFeatures) -> Optional[str]:
        for pred, name in self.rules:
            if pred(f):
                return name
        return self.default

    def names(self):
        """Every drafter name the router refers to."""
        return [n for _, n in self.rules] + [self.default] + self.switch_order


def switch_drafters(engine, request_ids) -> None:
    """Moves each of ``request_ids`` (the step's decoding requests) whose scheduler evidence says
    so to the next drafter of the router's switch order it has not tried yet."""
    router = engine.router
    order = router.switch_order if router is not None else []
    if not order:
        return
    sched = engine.scheduler
    for rid in request_ids:
        r = engine._reqs.get(rid)
        if r is None or r.finished or r.failed or r.drafter is None:
            continue
        nxt = next((n for n in order if n not in r.tried), None)
        if nxt is None:
            continue
        reason = sched.switch_reason(rid, engine.switch_below)
        if not reason:
            continue
        engine.drafting.release_one(r.drafter, rid)
        r.drafter = nxt
        r.tried.append(nxt)
        # The scheduler's acceptance evidence was about the previous drafter: the new one starts
        # from the initial draft length (and speculates even if the old one had fallen back).
        sched.reset_acceptance(rid, engine.drafting.evidence_group[nxt])
        r.stats.drafter = nxt
        r.stats.drafters_used.append(nxt)
        r.stats.switches[reason] = r.stats.switches.get(reason, 0) + 1
        es = engine._stats
        es.switches[reason] = es.switches.get(reason, 0) + 1
