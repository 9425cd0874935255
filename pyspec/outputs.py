"""Engine steps -> what callers see: text deltas, stop strings, finish reasons, results.

The engine works on token ids and stops at stop *tokens*. Everything between its per-step
:class:`~pyspec.engine.RequestOutput` and a user (:class:`pyspec.LLM`, the OpenAI server, shadow
mode) happens here, once:

* :class:`OutputTracker`: one request's incremental detokenization and stop strings. A speculative
  step emits several tokens at once; they are taken one at a time, as plain decoding would emit
  them, so a stop string ends the output at the token that completed it (text and token ids are
  those of plain decoding, whatever the drafter), and text that could be the start of a stop
  string is held back until it is known not to be one.
* :func:`apply_outputs`: routes a step's outputs to their trackers and aborts at the engine a
  request a stop string ended (its KV freed at once); returns one :class:`Delta` per output.
* :class:`GenerationOutput`, :class:`Completion`, :class:`StreamChunk`: the results
  :class:`pyspec.LLM` returns.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable, List, Mapping, Optional

from pyspec.engine.stats import RequestStats
from pyspec.params import SamplingParams

__all__ = ["OutputTracker", "Delta", "apply_outputs", "Completion", "GenerationOutput",
           "StreamChunk"]


@dataclass
class Completion:
    text: str
    token_ids: List[int]
    finish_reason: Optional[str]
    stats: RequestStats


@dataclass
class GenerationOutput:
    """One prompt's result. ``text``/``token_ids``/``finish_reason``/``stats`` are those of the
    first sample; ``outputs`` holds all ``n`` samples."""

    prompt: Optional[str]
    prompt_token_ids: List[int]
    text: str
    token_ids: List[int]
    finish_reason: Optional[str]
    stats: RequestStats
    outputs: List[Completion]
    seconds: float  # wall time from submission to the last sample's end
    time_to_first_token: Optional[float]

    @property
    def tokens_per_second(self) -> float:
        return len(self.token_ids) / self.seconds if self.seconds > 0 else float("inf")


@dataclass
class StreamChunk:
    text: str  # new text since the previous chunk
    token_ids: List[int]  # new tokens
    finished: bool
    finish_reason: Optional[str]
    stats: Optional[RequestStats] = None  # on the final chunk


class OutputTracker:
    """One engine request as its caller sees it: the text so far (incrementally detokenized),
    its stop strings, the tokens output, the finish reason and timing.

    Args:
        tokenizer: a :class:`pyspec.tokenizer.Tokenizer`, or None (token ids only; stop strings
            then cannot apply).
        params: the request's parameters (``stop`` is read).
        t0: ``time.perf_counter()`` at submission.
    """

    def __init__(self, tokenizer, params: SamplingParams, t0: Optional[float] = None):
        self.dec = tokenizer.incremental_decoder() if tokenizer is not None else None
        stop = params.stop
        self.stops = [stop] if isinstance(stop, str) else list(stop or [])
        self._longest = max((len(s) for s in self.stops), default=0)
        self.text = ""
        self.sent = 0  # characters of text handed out so far
        self.tokens: List[int] = []
        self.finished = False
        self.reason: Optional[str] = None
        self.t0 = time.perf_counter() if t0 is None else t0
        self.t_first: Optional[float] = None
        self.t_end: Optional[float] = None
        # Whoever steps the engine hands this request's deltas to ``sink`` (a stream's buffer),
        # and a failed step's error to ``error``.
        self.sink: Optional[Callable[[str, List[int]], None]] = None
        self.error: Optional[BaseException] = None

    def push(self, new: List[int], finished: bool, reason: Optional[str]):
        """Returns (text delta, token delta, stopped-by-string) for a step's new tokens. Text that
        could be the start of a stop string is held back until it is known not to be one (never
        streamed, then cut); tokens a step accepted past the one that completed a stop string are
        not output."""
        if new and self.t_first is None:
            self.t_first = time.perf_counter()
        sent = self.sent
        if self.stops and self.dec is not None:
            # One pass per token (the last also flushes the decoder when the request ends; a
            # request that ends without a new token still flushes).
            for i in range(max(len(new), 1 if finished else 0)):
                before = len(self.text)
                if i < len(new):
                    self.text += self.dec.push(new[i])
                if finished and i >= len(new) - 1:
                    self.text += self.dec.flush()
                if len(self.text) == before:
                    continue
                # A new occurrence ends in the new text, so it starts at most len(s) - 1 before.
                lo = max(0, before - self._longest + 1)
                hits = [j for j in (self.text.find(s, lo) for s in self.stops) if j >= 0]
                if hits:
                    cut = min(hits)
                    kept = list(new[:i + 1])
                    self.tokens.extend(kept)
                    self.text = self.text[:cut]
                    self.sent = cut
                    self.finished, self.reason = True, "stop"
                    self.t_end = time.perf_counter()
                    return self.text[sent:cut], kept, True
        elif self.dec is not None:
            piece = "".join(self.dec.push(t) for t in new)
            if finished:
                piece += self.dec.flush()
            self.text += piece
        self.tokens.extend(new)
        if finished:
            self.finished, self.reason = True, reason
            self.t_end = time.perf_counter()
            self.sent = len(self.text)
            return self.text[sent:], new, False
        self.sent = max(sent, len(self.text) - self._held())
        return self.text[sent:self.sent], new, False

    def _held(self) -> int:
        """Characters at the end of the text that begin some stop string (the longest such
        run, shorter than the stop string itself)."""
        hold = 0
        for s in self.stops:
            if len(s) < 2:
                continue
            tail = self.text[max(0, len(self.text) - len(s) + 1):]
            # The earliest place in the tail from which the rest of it starts ``s``.
            j = tail.find(s[0])
            while j >= 0:
                if s.startswith(tail[j:]):
                    hold = max(hold, len(tail) - j)
                    break
                j = tail.find(s[0], j + 1)
        return hold

    @property
    def time_to_first_token(self) -> Optional[float]:
        return self.t_first - self.t0 if self.t_first is not None else None


@dataclass
class Delta:
    """What one step changed for one request, as its caller sees it."""

    request_id: int
    tracker: Optional[OutputTracker]
    text: str
    token_ids: List[int]
    finished: bool  # the request is done for its caller (engine finish or stop string)
    finish_reason: Optional[str]
    stopped: bool  # a stop string ended it (and the engine request was aborted)


def apply_outputs(engine, outs, trackers: Mapping[int, OutputTracker]) -> List[Delta]:
    """One step's engine outputs through their trackers (``trackers.get(request_id)``: a mapping,
    or any object with that method). A request a stop string ended before the engine finished it
    is aborted at the engine now (its KV freed). Outputs of requests without a tracker pass
    through as token deltas. Trackers that had already finished are skipped."""
    deltas = []
    for o in outs:
        t = trackers.get(o.request_id)
        if t is None:
            deltas.append(Delta(o.request_id, None, "", list(o.new_tokens), o.finished,
                                o.finish_reason, False))
            continue
        if t.finished:
            continue
        text, toks, stopped = t.push(o.new_tokens, o.finished, o.finish_reason)
        if stopped and not o.finished:
            engine.abort(o.request_id)
        deltas.append(Delta(o.request_id, t, text, list(toks), t.finished, t.reason, stopped))
    return deltas
