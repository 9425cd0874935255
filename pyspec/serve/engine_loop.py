"""The server's engine thread: every client shares one continuous-batching engine, driven here.

HTTP handlers submit a :class:`Handle` per sample and read its deltas from an asyncio queue; the
engine thread adds requests, steps the batch, turns outputs into deltas through
:func:`pyspec.outputs.apply_outputs` (detokenization, stop strings) and hands them out. A client
that disconnects (or closes its stream) aborts its request; its KV is freed in the next loop turn.

Failures are contained at three levels:

* a request's own failure (``add_request`` raising, its output failing to be handed out) ends that
  request with an error and nothing else;
* a failed step ends its requests with a 500 (a :class:`~pyspec.engine.StepError` names them;
  any other exception ends the whole batch) and the loop goes on;
* the loop itself failing (an error outside those, or ``max_batch_failures`` batch failures in a
  row) is an engine failure: every request in flight or queued gets a 503 at once, ``healthy``
  turns false, and the loop either restarts (aborting what the engine still holds;
  ``on_failure="restart"``, at most ``max_restarts`` times) or stays down and calls ``on_fatal``
  so the process can exit for its supervisor to replace it (``on_failure="exit"``).

Deadlines: a handle's ``deadline`` (whole request) and ``queue_deadline`` (until its first
token) end it with a 504 / 503 when they pass; :meth:`EngineLoop.shut_down` ends everything
still running with a 503 (the drain deadline).
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from typing import Dict, List, Optional

from pyspec.engine import StepError
from pyspec.outputs import OutputTracker, apply_outputs
from pyspec.params import SamplingParams
from pyspec.serve.metrics import Metrics
from pyspec.serve.protocol import RequestError

__all__ = ["Handle", "EngineLoop"]

log = logging.getLogger("pyspec.serve")


class Handle:
    """One engine request as seen by its HTTP handler."""

    def __init__(self, loop: asyncio.AbstractEventLoop, ids: List[int], params: SamplingParams,
                 tokenizer):
        self.loop = loop
        self.queue: asyncio.Queue = asyncio.Queue()
        self.ids = ids
        self.params = params
        self.rid: Optional[int] = None
        self.track = OutputTracker(tokenizer, params)  # its t0: when the handler submitted it
        self.aborted = False
        self.stats = None
        self.score = False  # quality gate: also score this request with the target alone
        self.span = None  # OpenTelemetry request span, when tracing
        self.shadow_key = None  # mirrored to the shadow engine under this key
        self.deadline: Optional[float] = None  # perf_counter time the whole request must end by
        self.queue_deadline: Optional[float] = None  # ... and its first token come by
        self.on_close = None  # called once, in its event loop, when the request has ended
        self._closed = False

    def put(self, item) -> None:
        try:
            self.loop.call_soon_threadsafe(self.queue.put_nowait, item)
        except RuntimeError:  # its event loop is closed (the server stopped): nobody to tell
            pass
        if item[0] == "error" or item[3]:  # an error, or the finishing delta
            self.close()

    def close(self) -> None:
        """The request has ended (finished, failed or aborted): ``on_close`` runs once."""
        if self._closed:
            return
        self._closed = True
        if self.on_close is not None:
            try:
                self.loop.call_soon_threadsafe(self.on_close)
            except RuntimeError:
                pass


class _Trackers:
    """The live handles' trackers by request id, for :func:`apply_outputs` (a view, not a copy)."""

    def __init__(self, live: Dict[int, Handle]):
        self._live = live

    def get(self, rid: int) -> Optional[OutputTracker]:
        h = self._live.get(rid)
        return h.track if h is not None else None


ON_FAILURE = ("restart", "exit")


class _Fatal(Exception):
    """The loop cannot go on (too many batch failures in a row)."""


class EngineLoop:
    """The engine thread. ``submit``/``abort``/``call``/``shut_down`` and the ``healthy`` /
    ``waiting`` readings are thread-safe; everything else runs inside it.

    Args:
        on_failure: ``"restart"`` (abort everything the engine holds and serve on, at most
            ``max_restarts`` times in the loop's life) or ``"exit"`` (stay down; ``on_fatal``).
        max_batch_failures: batch-wide step failures in a row that count as an engine failure.
        restart_delay: seconds a restart waits (unhealthy, refusing requests) so that a failure
            that repeats does not spin.
    """

    def __init__(self, llm, metrics: Metrics, gate=None, tracer=None, *,
                 on_failure: str = "restart", max_restarts: int = 3,
                 max_batch_failures: int = 3, restart_delay: float = 1.0):
        if on_failure not in ON_FAILURE:
            raise ValueError(f"on_failure must be one of {ON_FAILURE}; got {on_failure!r}")
        for name, v in (("max_restarts", max_restarts), ("max_batch_failures", max_batch_failures)):
            if not isinstance(v, int) or isinstance(v, bool) or v < (0 if name == "max_restarts"
                                                                     else 1):
                raise ValueError(f"{name} must be an int >= "
                                 f"{0 if name == 'max_restarts' else 1}; got {v!r}")
        self.gate = gate
        self.shadow = None
        self.rollbacks = None  # pyspec.serve.rollback.Rollbacks: told of every finished request
        self.tracer = None
        if tracer is not None:
            from pyspec.serve.tracing import RequestTracer

            self.tracer = RequestTracer(tracer)
            llm.engine.trace_hook = lambda st: self.tracer.step(st, self._live)
        self.llm = llm
        self.engine = llm.engine
        self.metrics = metrics
        self.on_failure, self.max_restarts = on_failure, max_restarts
        self.max_batch_failures = max_batch_failures
        self.restart_delay = float(restart_delay)
        self.on_fatal = None  # called (in the engine thread) with the error when it stays down
        self.failure: Optional[str] = None  # why the engine is down; None while it serves
        self.restarts = 0
        self._cmds = queue.SimpleQueue()
        self._wake = threading.Event()
        self._stop = False
        self._live: Dict[int, Handle] = {}
        self._trackers = _Trackers(self._live)
        self._submitted = 0  # handles submitted (written by the submitting thread only)
        self._taken = 0  # ... and taken from the command queue (engine thread only)
        self._engine_waiting = 0  # the scheduler's waiting requests after the last turn
        self._thread = threading.Thread(target=self._run, name="pyspec-engine", daemon=True)

    def start(self) -> None:
        self._thread.start()
        self.metrics.engine_healthy.set(1)

    def stop(self) -> None:
        self._stop = True
        self._wake.set()
        self._thread.join(timeout=10)

    @property
    def healthy(self) -> bool:
        """The engine thread runs and serves (liveness)."""
        return self.failure is None and self._thread.is_alive()

    def waiting(self) -> int:
        """Requests submitted that hold no KV yet: still queued here or waiting in the
        scheduler (as of the last loop turn)."""
        return max(0, self._submitted - self._taken) + self._engine_waiting

    def submit(self, h: Handle) -> None:
        if self.failure is not None:
            h.put(("error", self._down_error()))
            return
        self._submitted += 1
        self._cmds.put(("add", h))
        self._wake.set()

    def abort(self, h: Handle) -> None:
        self._cmds.put(("abort", h))
        self._wake.set()

    def call(self, fn) -> None:
        """Run ``fn(engine)`` in the engine thread (configuration changes)."""
        self._cmds.put(("call", fn))
        self._wake.set()

    def shut_down(self, message: str = "the server is shutting down") -> None:
        """End every request still queued or running with a 503 (the drain deadline passed)."""
        self._cmds.put(("shutdown", message))
        self._wake.set()

    def _down_error(self) -> RequestError:
        return RequestError(503, f"the engine failed and is not serving ({self.failure}); "
                                 "retry later", None, "engine_unavailable", "server_error")

    def _drain(self) -> None:
        while True:
            try:
                kind, h = self._cmds.get_nowait()
            except queue.Empty:
                return
            if kind == "call":
                try:
                    h(self.engine)
                except Exception:  # noqa: BLE001 - a bad reload must not stop serving
                    log.exception("engine call failed")
                continue
            if kind == "shutdown":
                self._fail_requests(RequestError(503, h, None, "shutting_down", "server_error"),
                                    "shutdown")
                continue
            if kind == "add":
                self._taken += 1
                if h.aborted:
                    h.close()
                    continue
                if self._expired(h, time.perf_counter()):
                    continue
                try:
                    h.rid = self.engine.add_request(h.ids, h.params)
                except ValueError as e:
                    self._abort_shadow(h)
                    h.put(("error", RequestError(400, str(e))))
                    continue
                except Exception as e:  # noqa: BLE001 - this request's failure only
                    log.exception("add_request failed")
                    self._abort_shadow(h)
                    h.put(("error", RequestError(500, f"engine error: {e}", kind="server_error")))
                    continue
                self._live[h.rid] = h
                if self.tracer is not None:
                    self.tracer.start(h, {"pyspec.request_id": h.rid,
                                          "pyspec.prompt_tokens": len(h.ids),
                                          "pyspec.speculative": bool(h.params.speculative),
                                          "gen_ai.request.max_tokens": h.params.max_tokens,
                                          "gen_ai.request.temperature": h.params.temperature})
                if h.score:
                    self.engine.record_logits(h.rid)
            elif kind == "abort":
                h.aborted = True
                if h.rid is not None and h.rid in self._live:
                    self._finish(h, "abort", abort=True)

    def _expired(self, h: Handle, now: float) -> bool:
        """End ``h`` with an error if one of its deadlines passed (True then)."""
        if h.deadline is not None and now >= h.deadline:
            err = RequestError(504, "the request did not finish within its timeout", "timeout",
                               "timeout", "server_error")
            reason = "timeout"
        elif h.queue_deadline is not None and now >= h.queue_deadline and \
                h.track.time_to_first_token is None:
            err = RequestError(503, "the request waited too long for the engine (the server's "
                                    "queue deadline); retry later", None, "queue_timeout",
                               "server_error")
            reason = "queue_timeout"
        else:
            return False
        self.metrics.rejected.labels(reason=reason).inc()
        if h.rid is not None and h.rid in self._live:
            self._end(h, err)
        else:
            self._abort_shadow(h)
            h.put(("error", err))
        return True

    def _check_deadlines(self) -> None:
        now = time.perf_counter()
        for h in list(self._live.values()):
            if h.deadline is not None or h.queue_deadline is not None:
                self._expired(h, now)

    def _abort_shadow(self, h: Handle) -> None:
        """The live request is gone: its mirrored copy has nothing left to be compared with (and
        would otherwise run to its max_tokens, holding the shadow engine's KV and compute)."""
        if h.shadow_key is not None and self.shadow is not None:
            self.shadow.abort(h.shadow_key)

    def _finish(self, h: Handle, reason: Optional[str], abort: bool = False) -> None:
        eng = self.engine
        if abort:
            eng.abort(h.rid)
        if h.score and self.gate is not None and not (abort and reason == "abort"):
            served = eng.recorded_logits(h.rid)
            if served is not None:
                gen = eng.result(h.rid).token_ids
                self.gate.score(self.llm.runner, h.ids, gen, served, h.params.temperature)
        self._live.pop(h.rid, None)
        h.close()
        res = eng.result(h.rid, pop=True)
        h.stats = res.stats
        t = h.track
        dur = time.perf_counter() - t.t0
        ttft = t.time_to_first_token
        self.metrics.request_finished(res.stats, reason, ttft, dur, len(t.tokens))
        if self.rollbacks is not None and reason != "abort":
            try:
                self.rollbacks.observe(res.stats)
            except Exception:  # noqa: BLE001 - a rollback's bookkeeping never fails a request
                log.exception("rollback evidence")
        if reason == "abort":
            self._abort_shadow(h)
        elif h.shadow_key is not None and self.shadow is not None and ttft is not None and \
                len(t.tokens) > 1:
            self.shadow.live_done(h.shadow_key, (dur - ttft) / (len(t.tokens) - 1))
        if self.tracer is not None:
            self.tracer.finish(h, reason, len(t.tokens))

    def _end(self, h: Handle, err: RequestError, abort: bool = True) -> None:
        """Finish ``h`` with ``err`` (its request aborted in the engine unless it finished)."""
        try:
            self._finish(h, "error", abort=abort)
        except Exception:  # noqa: BLE001 - it is gone either way
            log.debug("finishing a failed request", exc_info=True)
            self._live.pop(h.rid, None)
        self._abort_shadow(h)
        h.put(("error", err))

    def _fail_requests(self, err: RequestError, reason: Optional[str] = None) -> None:
        """End every live request and every queued one with ``err`` (configuration calls still
        queued stay queued)."""
        for h in list(self._live.values()):
            if reason is not None:
                self.metrics.rejected.labels(reason=reason).inc()
            self._end(h, err)
        calls = []
        while True:
            try:
                kind, h = self._cmds.get_nowait()
            except queue.Empty:
                break
            if kind == "add":
                self._taken += 1
                if h.aborted:
                    h.close()
                else:
                    if reason is not None:
                        self.metrics.rejected.labels(reason=reason).inc()
                    h.put(("error", err))
            elif kind == "call":
                calls.append((kind, h))
        for c in calls:
            self._cmds.put(c)

    def _fail_all(self, e: Exception) -> None:
        """A failure outside a step's own requests: fail every live request, serve on."""
        log.exception("engine step failed")
        self._fail_requests(RequestError(500, f"engine error: {e}", kind="server_error"))

    def _run(self) -> None:
        while True:
            try:
                self._serve()
                return
            except BaseException as e:  # noqa: BLE001 - the loop itself failed
                if not self._recover(e):
                    return

    def _recover(self, e: BaseException) -> bool:
        """An engine failure: fail everything in flight at once (503), then restart the loop
        (True) or stay down and tell ``on_fatal`` (False)."""
        self.failure = f"{type(e).__name__}: {e}"
        self.metrics.engine_healthy.set(0)
        self.metrics.engine_failures.inc()
        log.error("the engine failed: %s", self.failure, exc_info=e)
        err = self._down_error()
        self._fail_requests(err)  # (their requests aborted in the engine)
        if self.on_failure == "restart" and self.restarts < self.max_restarts and not self._stop:
            try:
                self._live.clear()
                if self.engine.has_unfinished():
                    raise RuntimeError("the engine still holds requests after aborting them")
            except Exception:  # noqa: BLE001 - cannot be brought back: stay down
                log.exception("the engine could not be restarted")
            else:
                t_end = time.perf_counter() + self.restart_delay
                while not self._stop and time.perf_counter() < t_end:
                    self._fail_requests(err)
                    self._wake.wait(min(0.05, max(0.0, t_end - time.perf_counter())))
                    self._wake.clear()
                self.restarts += 1
                self.metrics.engine_restarts.inc()
                log.warning("engine restarted (%d of at most %d)", self.restarts,
                            self.max_restarts)
                self.failure = None
                self.metrics.engine_healthy.set(1)
                return True
        if self.on_fatal is not None:
            try:
                self.on_fatal(e)
            except Exception:  # noqa: BLE001
                log.exception("on_fatal failed")
        # Down for good: anything submitted from now on is answered by submit() itself; what
        # raced in before the failure was visible is failed here until the loop is stopped.
        while not self._stop:
            self._fail_requests(err)
            self._wake.wait(0.05)
            self._wake.clear()
        return False

    def _serve(self) -> None:
        eng = self.engine
        batch_failures = 0
        while not self._stop:
            self._drain()
            self._check_deadlines()
            if not self._live:
                self.metrics.after_step(eng)
                self._engine_waiting = 0
                self._wake.wait(0.05)
                self._wake.clear()
                continue
            try:
                outs = eng.step()
            except StepError as e:  # the step's requests finished with 'error'; others go on
                for rid in e.request_ids:
                    h = self._live.get(rid)
                    if h is not None:
                        self._end(h, RequestError(500, f"engine error: {e.cause}",
                                                  kind="server_error"), abort=False)
                continue
            except Exception as e:  # noqa: BLE001 - fail the batch, keep serving
                batch_failures += 1
                if batch_failures >= self.max_batch_failures:
                    raise _Fatal(f"{batch_failures} engine steps failed in a row; the last: "
                                 f"{type(e).__name__}: {e}") from e
                self._fail_all(e)
                continue
            batch_failures = 0
            try:
                deltas = apply_outputs(eng, outs, self._trackers)
            except Exception as e:  # noqa: BLE001 - the step's outputs are lost: fail its batch
                self._fail_all(e)
                continue
            for d in deltas:
                h = self._live.get(d.request_id)
                if h is None:  # not this loop's (or gone since)
                    continue
                try:
                    if d.finished:
                        self._finish(h, d.finish_reason)
                    h.put(("delta", d.text, d.token_ids, d.finished, d.finish_reason))
                except Exception as e:  # noqa: BLE001 - this request's failure only
                    log.exception("handing out request %s's output failed", d.request_id)
                    if h.rid in self._live:
                        self._end(h, RequestError(500, f"engine error: {e}",
                                                  kind="server_error"))
                    else:
                        h.put(("error", RequestError(500, f"engine error: {e}",
                                                     kind="server_error")))
            self.metrics.after_step(eng)
            self._engine_waiting = eng.scheduler.num_waiting
