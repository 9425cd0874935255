"""Shadow mode: a candidate drafter runs on mirrored traffic without touching responses.

A share of requests (``--shadow-ratio``, deterministic by request id) is mirrored to a second engine
that shares the target's weights (its own KV pool and scheduler) and drafts with the candidate.
Its outputs are discarded; its drafts, accepted tokens, acceptance length and speedup are exported
under ``drafter="<name>"``. The speedup is the live request's decode time per output token divided by
the mirrored copy's, both measured on this machine at the same time, so it reads "how much faster
would this traffic be with the candidate" (an estimate: the two engines share the CPU/GPU).
A mirrored copy ends where its live request does: at the live request's stop strings (applied
here as the live engine loop applies them), and at once when the live request is aborted.
"""

from __future__ import annotations

import hashlib
import logging
import math
import queue
import threading
import time
from dataclasses import replace
from typing import Dict, Optional

log = logging.getLogger("pyspec.serve")


def shadow_blocks(llm, ratio: float) -> int:
    """KV blocks for the shadow engine: the mirrored share of the live pool, but at least what
    one request at the live context limit needs (so any request the live engine takes can be
    mirrored alone), and never more than the live pool. A full-size copy would double the KV
    memory (on a GPU, device memory) for a small share of traffic; mirrored copies that do not
    fit at a moment wait or are preempted in the shadow engine, never touching live requests."""
    from pyspec.serve.protocol import context_tokens

    live = llm.runner.kv.num_blocks
    one = -(-(context_tokens(llm) + 1) // llm.runner.block_size)
    return int(min(live, max(one, math.ceil(live * ratio))))


class Shadow:
    def __init__(self, llm, draft_spec: str, ratio: float, metrics, name: str = "candidate"):
        from prometheus_client import Counter, Gauge

        from pyspec.engine import Engine
        from pyspec.runner import ModelRunner

        if not 0.0 <= ratio <= 1.0:
            raise ValueError(f"shadow ratio must be in [0, 1]; got {ratio}")
        self.llm = llm  # its tokenizer detokenizes for stop strings
        runner = ModelRunner(llm.model, shadow_blocks(llm, ratio), llm.runner.block_size,
                             kv_dtype=llm.runner.kv_dtype)
        self.engine = Engine(runner, drafter=draft_spec, max_num_seqs=16)
        self.name = name
        self.ratio = ratio
        r = metrics.registry
        lab = ["drafter"]
        self.m_drafts = Counter("pyspec_shadow_num_drafts", "Shadow engine speculative steps", lab,
                                registry=r).labels(drafter=name)
        self.m_draft_tokens = Counter("pyspec_shadow_num_draft_tokens", "Shadow draft tokens",
                                      lab, registry=r).labels(drafter=name)
        self.m_accepted = Counter("pyspec_shadow_num_accepted_tokens",
                                  "Shadow draft tokens accepted", lab, registry=r).labels(
            drafter=name)
        self.m_requests = Counter("pyspec_shadow_requests", "Mirrored requests finished", lab,
                                  registry=r).labels(drafter=name)
        self.m_al = Gauge("pyspec_shadow_acceptance_length",
                          "Shadow acceptance length (cumulative)", lab, registry=r).labels(
            drafter=name)
        self.m_speedup = Gauge("pyspec_shadow_speedup",
                               "Live decode time per token / shadow decode time per token (EWMA)",
                               lab, registry=r).labels(drafter=name)
        self._q: "queue.SimpleQueue" = queue.SimpleQueue()
        self._live_tpot: Dict[str, float] = {}
        self._shadow_tpot: Dict[str, float] = {}
        self._lock = threading.Lock()
        self._speedup: Optional[float] = None
        self._drafts = self._accepted = 0
        self._stop = False
        self._thread = threading.Thread(target=self._run, name="pyspec-shadow", daemon=True)

    def start(self):
        self._thread.start()

    def stop(self):
        self._stop = True
        self._q.put(None)
        self._thread.join(timeout=10)

    def wants(self, request_id: str) -> bool:
        if self.ratio <= 0:
            return False
        h = int.from_bytes(hashlib.sha256(b"shadow" + request_id.encode()).digest()[:8], "big")
        return h / float(1 << 64) < self.ratio

    def mirror(self, key: str, ids, params) -> None:
        self._q.put(("add", key, list(ids), replace(params, speculative=True)))

    def abort(self, key: str) -> None:
        """The live request ``key`` was aborted (its client went away): drop its copy (queued
        after the copy's ``mirror``, so it finds it however far it got)."""
        self._q.put(("abort", key))

    def live_done(self, key: str, tpot: Optional[float]) -> None:
        if tpot is None:
            return
        with self._lock:
            self._live_tpot[key] = tpot
            self._pair(key)

    def _pair(self, key):
        a, b = self._live_tpot.get(key), self._shadow_tpot.get(key)
        if a is None or b is None or b <= 0:
            return
        del self._live_tpot[key], self._shadow_tpot[key]
        x = a / b
        self._speedup = x if self._speedup is None else 0.9 * self._speedup + 0.1 * x
        self.m_speedup.set(self._speedup)

    def _run(self):
        from pyspec.outputs import OutputTracker, apply_outputs

        eng = self.engine
        live: Dict[int, str] = {}  # engine id -> key
        ids_of: Dict[str, int] = {}  # key -> engine id, for aborts
        # Each mirrored request's tokens and timing. The engine knows stop tokens only: stop
        # strings are applied here as the live loop applies them, else a copy would run on to
        # max_tokens past where its live request stopped (requests without stop strings need no
        # detokenizing).
        trackers: Dict[int, OutputTracker] = {}
        while not self._stop:
            block = not live
            while True:
                try:
                    item = self._q.get(timeout=0.05) if block else self._q.get_nowait()
                except queue.Empty:
                    break
                block = False
                if item is None:
                    return
                if item[0] == "abort":
                    self._drop(live, ids_of, trackers, item[1])
                    continue
                _, key, ids, p = item
                try:
                    rid = eng.add_request(ids, p)
                except ValueError as e:
                    log.warning("shadow: could not mirror a request: %s", e)
                    continue
                live[rid] = key
                ids_of[key] = rid
                trackers[rid] = OutputTracker(self.llm.tokenizer if p.stop else None, p)
            if not live:
                continue
            try:
                outs = eng.step()
            except Exception:  # noqa: BLE001 - the shadow never affects serving
                log.exception("shadow engine step failed; dropping mirrored requests")
                for rid in list(live):
                    eng.abort(rid)
                    eng.result(rid, pop=True)
                live.clear()
                ids_of.clear()
                trackers.clear()
                continue
            now = time.perf_counter()
            for d in apply_outputs(eng, outs, trackers):
                key = live.get(d.request_id)
                if key is None or not d.finished:
                    continue
                res = eng.result(d.request_id, pop=True)
                del live[d.request_id]
                t = trackers.pop(d.request_id)
                ids_of.pop(key, None)
                st = res.stats
                self.m_requests.inc()
                self.m_drafts.inc(st.drafts)
                self.m_draft_tokens.inc(st.draft_tokens)
                self.m_accepted.inc(st.accepted_tokens)
                self._drafts += st.drafts
                self._accepted += st.accepted_tokens
                if self._drafts:
                    self.m_al.set(1 + self._accepted / self._drafts)
                # The tokens output (not those a step accepted past a stop string).
                n = len(t.tokens)
                if n > 1 and t.t_first is not None:
                    with self._lock:
                        self._shadow_tpot[key] = (now - t.t_first) / (n - 1)
                        self._pair(key)

    def _drop(self, live, ids_of, trackers, key) -> None:
        rid = ids_of.pop(key, None)
        if rid is not None and rid in live:
            del live[rid]
            trackers.pop(rid, None)
            self.engine.abort(rid)
            self.engine.result(rid, pop=True)
        with self._lock:  # an aborted live request is never paired
            self._live_tpot.pop(key, None)
            self._shadow_tpot.pop(key, None)
