"""The server's engine thread: every client shares one continuous-batching engine, driven here.

HTTP handlers submit a :class:`Handle` per sample and read its deltas from an asyncio queue; the
engine thread adds requests, steps the batch, turns outputs into deltas through
:func:`pyspec.outputs.apply_outputs` (detokenization, stop strings) and hands them out. A client
that disconnects (or closes its stream) aborts its request; its KV is freed in the next loop turn.
A step that fails finishes only its own requests with an error; the others go on.
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

    def put(self, item) -> None:
        self.loop.call_soon_threadsafe(self.queue.put_nowait, item)


class _Trackers:
    """The live handles' trackers by request id, for :func:`apply_outputs` (a view, not a copy)."""

    def __init__(self, live: Dict[int, Handle]):
        self._live = live

    def get(self, rid: int) -> Optional[OutputTracker]:
        h = self._live.get(rid)
        return h.track if h is not None else None


class EngineLoop:
    """The engine thread. ``submit``/``abort``/``call`` are thread-safe; everything else runs
    inside it."""

    def __init__(self, llm, metrics: Metrics, gate=None, tracer=None):
        self.gate = gate
        self.shadow = None
        self.tracer = None
        if tracer is not None:
            from pyspec.serve.tracing import RequestTracer

            self.tracer = RequestTracer(tracer)
            llm.engine.trace_hook = lambda st: self.tracer.step(st, self._live)
        self.llm = llm
        self.engine = llm.engine
        self.metrics = metrics
        self._cmds = queue.SimpleQueue()
        self._wake = threading.Event()
        self._stop = False
        self._live: Dict[int, Handle] = {}
        self._trackers = _Trackers(self._live)
        self._thread = threading.Thread(target=self._run, name="pyspec-engine", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop = True
        self._wake.set()
        self._thread.join(timeout=10)

    def submit(self, h: Handle) -> None:
        self._cmds.put(("add", h))
        self._wake.set()

    def abort(self, h: Handle) -> None:
        self._cmds.put(("abort", h))
        self._wake.set()

    def call(self, fn) -> None:
        """Run ``fn(engine)`` in the engine thread (configuration changes)."""
        self._cmds.put(("call", fn))
        self._wake.set()

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
            if kind == "add":
                if h.aborted:
                    continue
                try:
                    h.rid = self.engine.add_request(h.ids, h.params)
                except ValueError as e:
                    self._abort_shadow(h)
                    h.put(("error", RequestError(400, str(e))))
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
        res = eng.result(h.rid, pop=True)
        self._live.pop(h.rid, None)
        h.stats = res.stats
        t = h.track
        dur = time.perf_counter() - t.t0
        ttft = t.time_to_first_token
        self.metrics.request_finished(res.stats, reason, ttft, dur, len(t.tokens))
        if reason == "abort":
            self._abort_shadow(h)
        elif h.shadow_key is not None and self.shadow is not None and ttft is not None and \
                len(t.tokens) > 1:
            self.shadow.live_done(h.shadow_key, (dur - ttft) / (len(t.tokens) - 1))
        if self.tracer is not None:
            self.tracer.finish(h, reason, len(t.tokens))

    def _fail_all(self, e: Exception) -> None:
        """A failure outside a step's own requests (a bug): fail every live request, serve on."""
        log.exception("engine step failed")
        for h in list(self._live.values()):
            try:
                self._finish(h, "error", abort=True)
            except Exception:  # noqa: BLE001
                self._live.pop(h.rid, None)
            h.put(("error", RequestError(500, f"engine error: {e}", kind="server_error")))

    def _run(self) -> None:
        eng = self.engine
        while not self._stop:
            self._drain()
            if not self._live:
                self.metrics.after_step(eng)
                self._wake.wait(0.05)
                self._wake.clear()
                continue
            try:
                outs = eng.step()
            except StepError as e:  # the step's requests finished with 'error'; others go on
                for rid in e.request_ids:
                    h = self._live.get(rid)
                    if h is None:
                        continue
                    try:
                        self._finish(h, "error")
                    except Exception:  # noqa: BLE001
                        self._live.pop(rid, None)
                    h.put(("error", RequestError(500, f"engine error: {e.cause}",
                                                 kind="server_error")))
                continue
            except Exception as e:  # noqa: BLE001 - fail the batch, keep serving
                self._fail_all(e)
                continue
            for d in apply_outputs(eng, outs, self._trackers):
                h = self._live.get(d.request_id)
                if h is None:  # not this loop's (or gone since)
                    continue
                if d.finished:
                    self._finish(h, d.finish_reason)
                h.put(("delta", d.text, d.token_ids, d.finished, d.finish_reason))
            self.metrics.after_step(eng)
