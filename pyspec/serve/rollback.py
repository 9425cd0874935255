"""Rollbacks: a served deployment steps back in one of three directions, each counted in
``pyspec_rollbacks_total{direction, reason}`` (with ``pyspec_rollback_active{direction}`` while it
holds) and recorded as a ``pyspec.rollback`` trace span when tracing is on.

* ``speculation``: every new request decodes plainly (the quality gate's rollback, reason
  ``quality_gate``), until the config is reloaded.
* ``drafter``: new requests are drafted by ``speculative.previous_draft_model`` (kept loaded beside
  the current drafter) instead of ``draft_model``: from the config (``rollback.drafter: true``,
  reason ``config``; a reload with ``false`` goes forward again) or by itself when the mean
  acceptance length of the current drafter's last ``rollback.window`` speculative requests falls
  below ``rollback.drafter_below_acceptance`` (reason ``acceptance``).
* ``policy``: the adaptive speculation policy back to where it started (``Engine.reset_policy``:
  the scheduler's measured costs and deployment-wide evidence, the acceptance predictor's online
  updates), when a config with ``rollback.policy: true`` is loaded (reason ``config``).

Requests in flight keep what they started with; engine changes run in the engine thread.
"""

from __future__ import annotations

import logging
import threading
from collections import deque

log = logging.getLogger("pyspec.serve")

__all__ = ["Rollbacks", "PREVIOUS_DRAFTER", "DIRECTIONS"]

PREVIOUS_DRAFTER = "previous"  # the engine's name for speculative.previous_draft_model
DIRECTIONS = ("speculation", "drafter", "policy")


class Rollbacks:
    def __init__(self, metrics, state: dict, loop):
        from prometheus_client import Counter, Gauge

        r = metrics.registry
        self.count = Counter("pyspec_rollbacks", "Rollbacks, by direction (speculation, drafter, "
                             "policy) and reason (quality_gate, acceptance, config)",
                             ["direction", "reason"], registry=r)
        self.active = Gauge("pyspec_rollback_active", "1 while a rollback holds, by direction "
                            "(speculation, drafter)", ["direction"], registry=r)
        for d in ("speculation", "drafter"):  # (a policy reset is an event: no gauge)
            self.active.labels(direction=d).set(0)
        self.state = state
        self.loop = loop
        self.current = loop.engine.default_drafter  # the drafter a rollback steps back from
        self.drafter_back = False
        self._recent: deque = deque()  # the current drafter's recent acceptance lengths
        # drafter() runs in the SIGHUP handler (reloads) and in the engine thread (observe).
        self._lock = threading.RLock()

    def _record(self, direction: str, reason: str) -> None:
        self.count.labels(direction=direction, reason=reason).inc()
        log.error("rollback: %s (%s)", direction, reason)
        tracer = self.loop.tracer
        if tracer is not None:
            tracer.event("pyspec.rollback", {"pyspec.rollback.direction": direction,
                                             "pyspec.rollback.reason": reason})

    def speculation(self, reason: str) -> bool:
        """Every new request decodes plainly until the config is reloaded; False if it already
        did."""
        cfg = self.state["config"]
        if cfg.plain_only:
            return False
        cfg.plain_only = True
        self.active.labels(direction="speculation").set(1)
        self._record("speculation", reason)
        return True

    def has_previous(self) -> bool:
        return PREVIOUS_DRAFTER in self.loop.engine.drafters

    def drafter(self, reason: str, back: bool = True) -> bool:
        """New requests drafted by the previous drafter (``back``) or the current one again;
        False when already so."""
        with self._lock:
            if back == self.drafter_back:
                return False
            if not self.has_previous():
                raise ValueError("a drafter rollback needs speculative.previous_draft_model (the "
                                 "drafter version to go back to), loaded when the server started")
            self.drafter_back = back
            name = PREVIOUS_DRAFTER if back else self.current
            self.loop.call(lambda engine: engine.set_default_drafter(name))
            self._recent.clear()
            self.active.labels(direction="drafter").set(int(back))
        if back:
            self._record("drafter", reason)
        else:
            log.warning("rollback: drafter forward again to %s (%s)", self.current, reason)
        return True

    def policy(self, reason: str) -> None:
        self.loop.call(lambda engine: engine.reset_policy())
        self._record("policy", reason)

    def apply_config(self, old, new) -> None:
        """A config was loaded (``old``: the one before, None at start): where its
        ``rollback.drafter`` changed it decides the drafter (an automatic rollback stays through
        reloads that leave the key as it was), and where it newly says ``rollback.policy`` the
        policy is reset. The speculation rollback ends with the old config object."""
        self.active.labels(direction="speculation").set(int(new.plain_only))
        rb = new.rollback
        if not self.has_previous():
            if rb.drafter or rb.drafter_below_acceptance > 0:
                # (named in a reload: the engine loads drafters once, when the server starts)
                log.error("config: rollback.drafter and rollback.drafter_below_acceptance need "
                          "speculative.previous_draft_model loaded at start; restart the server "
                          "to load it (ignored until then)")
        elif old is None or old.rollback.drafter != rb.drafter:
            self.drafter("config", back=rb.drafter)
        if rb.policy and not (old is not None and old.rollback.policy):
            self.policy("config")

    def observe(self, stats) -> None:
        """A request finished (engine thread): the automatic drafter rollback's evidence."""
        rb = self.state["config"].rollback
        if rb.drafter_below_acceptance <= 0 or not stats.drafts or not self.has_previous():
            return
        with self._lock:
            if self.drafter_back or stats.drafter != self.current:
                return
            self._recent.append(float(stats.acceptance_length))
            while len(self._recent) > rb.window:
                self._recent.popleft()
            low = len(self._recent) == rb.window and \
                sum(self._recent) / rb.window < rb.drafter_below_acceptance
            if low:
                self.drafter("acceptance")
