"""Which drafter serves a request: the :class:`Router` picks one when the request arrives, and
:func:`switch_drafters` moves a request to the next drafter of the router's ``switch_order`` when
the scheduler says its current one does not pay (``Scheduler.switch_reason``: its acceptance
average stays below ``switch_below``, or it started plain on its drafter's losing record)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, Optional, Sequence

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
        if isinstance(rules, (str, bytes)) or not isinstance(rules, Iterable):
            raise ValueError(f"Router rules must be a list of (predicate, drafter name) pairs; "
                             f"got {type(rules).__name__}")
        self.rules = list(rules)
        for k, rule in enumerate(self.rules):
            if not (isinstance(rule, (tuple, list)) and len(rule) == 2 and callable(rule[0])
                    and (rule[1] is None or isinstance(rule[1], str))):
                raise ValueError(f"Router rule {k} must be a (predicate, drafter name) pair: a "
                                 f"callable taking RouteFeatures and a str (None: decode "
                                 f"plainly); got {rule!r:.120}")
        if default is not None and not isinstance(default, str):
            raise ValueError(f"Router default must be a drafter name (str) or None; got "
                             f"{default!r:.120}")
        if isinstance(switch_order, (str, bytes)) or not isinstance(switch_order, Iterable):
            raise ValueError(f"Router switch_order must be a list of drafter names; got "
                             f"{switch_order!r:.120}")
        self.switch_order = list(switch_order)
        if not all(isinstance(n, str) for n in self.switch_order):
            raise ValueError(f"Router switch_order must hold drafter names (str); got "
                             f"{self.switch_order!r:.120}")
        self.default = default

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
