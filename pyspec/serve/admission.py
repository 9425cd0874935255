"""Admission control: whether a request may join the engine's queue, decided before it is
submitted (on the event loop, so in the order requests arrive).

* the engine is down (it failed and has not restarted): 503 with ``Retry-After``;
* ``max_waiting_requests``: requests that hold no KV yet (queued or waiting in the scheduler)
  would pass it: 503 with ``Retry-After`` (a full queue only grows everyone's wait);
* a tenant's ``max_concurrency`` (samples in flight) or ``tokens_per_minute`` (prompt tokens plus
  ``max_tokens`` per sample, a token bucket refilled continuously) would pass: 429 with
  ``Retry-After``.

The queue limit is checked twice: when a request arrives, before its body is read or its prompt
tokenized (:meth:`Admission.reserve`: a burst past the limit is refused for the cost of routing
it, and requests still being read count as waiting), and with its sample count at
:meth:`Admission.admit`. An admitted request holds a :class:`Ticket` until each of its samples
has ended (finished, failed or aborted); the tenant's concurrency is given back then.
"""

from __future__ import annotations

import math
import time
from typing import Dict, Optional

from pyspec.serve.protocol import RequestError, error_response

__all__ = ["Admission", "AdmissionGate", "Reservation", "Ticket"]


class _Bucket:
    def __init__(self, per_minute: int):
        self.rate = per_minute / 60.0
        self.capacity = float(per_minute)
        self.level = float(per_minute)
        self.t = time.monotonic()

    def take(self, n: int) -> float:
        """Take ``n`` tokens: 0.0 on success, else the seconds until they would be there."""
        now = time.monotonic()
        self.level = min(self.capacity, self.level + (now - self.t) * self.rate)
        self.t = now
        if self.level >= n:
            self.level -= n
            return 0.0
        return (n - self.level) / self.rate


class Reservation:
    """A request's place among the waiting while it is read and checked (see
    :meth:`Admission.reserve`); ``release`` once it is submitted or refused (idempotent)."""

    def __init__(self, admission: "Admission"):
        self._adm = admission
        self.held = True

    def release(self) -> None:
        if self.held:
            self.held = False
            self._adm.pending -= 1


class Ticket:
    """An admitted request's hold on its tenant's concurrency; ``sample_done`` per sample."""

    def __init__(self, admission: "Admission", tenant: str, samples: int):
        self._adm, self._tenant, self._left = admission, tenant, samples

    def sample_done(self) -> None:
        if self._left > 0:
            self._left -= 1
            self._adm._release(self._tenant, 1)


class Admission:
    """Args:
        loop: the :class:`~pyspec.serve.engine_loop.EngineLoop` (its ``healthy`` and
            ``waiting()``).
        state: the server's ``{"config": ServerConfig}`` (tenant limits; a reload applies).
        max_waiting_requests: None for no limit.
    """

    def __init__(self, loop, state: dict, metrics, max_waiting_requests: Optional[int] = None):
        if max_waiting_requests is not None and (not isinstance(max_waiting_requests, int) or
                                                 isinstance(max_waiting_requests, bool) or
                                                 max_waiting_requests < 1):
            raise ValueError(f"max_waiting_requests must be an int >= 1 or None; got "
                             f"{max_waiting_requests!r}")
        self.loop, self.state, self.metrics = loop, state, metrics
        self.max_waiting = max_waiting_requests
        self.in_flight: Dict[str, int] = {}
        self._buckets: Dict[str, _Bucket] = {}
        self.pending = 0  # requests reserved (being read and checked), not yet submitted

    def _refuse(self, status: int, reason: str, message: str, retry_after: float):
        self.metrics.rejected.labels(reason=reason).inc()
        e = RequestError(status, message, None, reason,
                         "server_error" if status >= 500 else "rate_limit_error")
        e.headers = {"Retry-After": str(max(1, math.ceil(retry_after)))}
        raise e

    def _check_engine(self, extra: int) -> None:
        if not self.loop.healthy:
            self._refuse(503, "unavailable", "the engine is not serving (it failed); retry "
                                             "later", 5)
        if self.max_waiting is not None and \
                self.loop.waiting() + self.pending + extra > self.max_waiting:
            self._refuse(503, "queue_full", f"the server's queue is full ({self.max_waiting} "
                                            "requests waiting); retry later", 1)

    def reserve(self) -> Reservation:
        """A request has arrived: refuse it at once if the engine is down or the queue (with the
        requests being read) is full, else hold its place until :meth:`admit`."""
        self._check_engine(1)
        self.pending += 1
        return Reservation(self)

    def admit(self, tenant: Optional[str], samples: int, tokens: int,
              reservation: Optional[Reservation] = None) -> Ticket:
        """Admit ``samples`` samples costing ``tokens`` (prompt + max_tokens, per sample) or
        raise the :class:`RequestError` that refuses them. ``reservation``: the request's
        (its place is counted once); the caller releases it once the samples are submitted."""
        self._check_engine(samples - (1 if reservation is not None and reservation.held else 0))
        key = tenant or ""
        lim = self.state["config"].limits_for(tenant)
        if lim.max_concurrency is not None and \
                self.in_flight.get(key, 0) + samples > lim.max_concurrency:
            self._refuse(429, "tenant_concurrency",
                         f"tenant {tenant!r} has {self.in_flight.get(key, 0)} requests in flight; "
                         f"its limit is {lim.max_concurrency}"
                         + (" (n counts each sample)" if samples > 1 else ""), 1)
        if lim.tokens_per_minute is not None:
            cost = tokens * samples
            if cost > lim.tokens_per_minute:
                self._refuse(429, "tenant_rate",
                             f"the request needs {cost} tokens (prompt + max_tokens, per "
                             f"sample), more than tenant {tenant!r}'s tokens_per_minute of "
                             f"{lim.tokens_per_minute}: lower max_tokens or n", 60)
            b = self._buckets.get(key)
            if b is None or b.capacity != lim.tokens_per_minute:
                b = self._buckets[key] = _Bucket(lim.tokens_per_minute)
            wait = b.take(cost)
            if wait > 0:
                self._refuse(429, "tenant_rate", f"tenant {tenant!r} is over its "
                                                 f"tokens_per_minute of {lim.tokens_per_minute}",
                             wait)
        self.in_flight[key] = self.in_flight.get(key, 0) + samples
        return Ticket(self, key, samples)

    def _release(self, key: str, n: int) -> None:
        left = self.in_flight.get(key, 0) - n
        if left > 0:
            self.in_flight[key] = left
        else:
            self.in_flight.pop(key, None)


class AdmissionGate:
    """ASGI middleware: a generation request (POST to one of ``paths``) takes its
    :meth:`Admission.reserve` place before anything else runs for it (routing, body, prompt),
    so a burst past the queue limit is refused for the least work the server can do; the
    route reads it from ``request.state.reservation`` and it is released when the route ends."""

    def __init__(self, app, admission: Admission, paths=("/v1/completions",
                                                         "/v1/chat/completions")):
        self.app, self.admission, self.paths = app, admission, frozenset(paths)

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or scope["method"] != "POST" or scope["path"] not in self.paths:
            return await self.app(scope, receive, send)
        try:
            reservation = self.admission.reserve()
        except RequestError as e:
            return await error_response(e)(scope, receive, send)
        scope.setdefault("state", {})["reservation"] = reservation
        try:
            return await self.app(scope, receive, send)
        finally:
            reservation.release()
