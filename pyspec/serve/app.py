"""``pyspec serve``: an OpenAI-compatible HTTP server (FastAPI + uvicorn) over one engine loop.

All clients share one continuous-batching engine, driven by a dedicated thread: HTTP handlers
enqueue requests and read their outputs from per-request asyncio queues; the engine thread adds
them, steps the batch, detokenizes, applies stop strings and hands out deltas. A client that
disconnects (or closes its stream) aborts its request; its KV is freed in the next loop turn.
Bad requests get a 4xx with an OpenAI-style error body; they never reach the engine loop.
"""


import asyncio
import json
import logging
import queue
import sys
import threading
import time
import uuid
from dataclasses import replace
from typing import Dict, List, Optional

from pyspec.engine import SamplingParams, StepError, sample_seed
from pyspec.serve.config import ServerConfig
from pyspec.serve.metrics import Metrics


class RequestError(Exception):
    def __init__(self, status: int, message: str, param: Optional[str] = None,
                 code: Optional[str] = None, kind: str = "invalid_request_error"):
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.kind = (status, message, param,
                                                                       code, kind)

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param,
                          "code": self.code}}


class _Handle:
    """One engine request as seen by its HTTP handler."""

    def __init__(self, loop: asyncio.AbstractEventLoop, ids: List[int], params: SamplingParams,
                 llm):
        from pyspec.llm import _Track

        self.loop = loop
        self.queue: asyncio.Queue = asyncio.Queue()
        self.ids = ids
        self.params = params
        self.rid: Optional[int] = None
        self.t0 = time.perf_counter()
        self.track = _Track(llm, -1, params, self.t0)
        self.aborted = False
        self.stats = None
        self.score = False  # quality gate: also score this request with the target alone
        self.span = None  # OpenTelemetry request span, when tracing
        self.shadow_key = None  # mirrored to the shadow engine under this key

    def put(self, item) -> None:
        self.loop.call_soon_threadsafe(self.queue.put_nowait, item)


class EngineLoop:
    """The engine thread. ``submit``/``abort`` are thread-safe; everything else runs inside."""

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
        self._live: Dict[int, _Handle] = {}
        self._thread = threading.Thread(target=self._run, name="pyspec-engine", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop = True
        self._wake.set()
        self._thread.join(timeout=10)

    def submit(self, h: _Handle) -> None:
        self._cmds.put(("add", h))
        self._wake.set()

    def abort(self, h: _Handle) -> None:
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
                    import logging

                    logging.getLogger("pyspec.serve").exception("engine call failed")
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

    def _abort_shadow(self, h: _Handle) -> None:
        """The live request is gone: its mirrored copy has nothing left to be compared with (and
        would otherwise run to its max_tokens, holding the shadow engine's KV and compute)."""
        if h.shadow_key is not None and self.shadow is not None:
            self.shadow.abort(h.shadow_key)

    def _finish(self, h: _Handle, reason: Optional[str], abort: bool = False) -> None:
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
        dur = time.perf_counter() - h.t0
        ttft = (t.t_first - h.t0) if t.t_first else None
        self.metrics.request_finished(res.stats, reason, ttft, dur, len(t.tokens))
        if reason == "abort":
            self._abort_shadow(h)
        elif h.shadow_key is not None and self.shadow is not None and ttft is not None and \
                len(t.tokens) > 1:
            self.shadow.live_done(h.shadow_key, (dur - ttft) / (len(t.tokens) - 1))
        if self.tracer is not None:
            self.tracer.finish(h, reason, len(t.tokens))

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
                import logging

                logging.getLogger("pyspec.serve").exception("engine step failed")
                for h in list(self._live.values()):
                    try:
                        self._finish(h, "error", abort=True)
                    except Exception:  # noqa: BLE001
                        self._live.pop(h.rid, None)
                    h.put(("error", RequestError(500, f"engine error: {e}", kind="server_error")))
                continue
            for o in outs:
                h = self._live.get(o.request_id)
                if h is None:
                    continue
                delta, toks, stopped = h.track.push(o.new_tokens, o.finished, o.finish_reason)
                done = h.track.finished
                if done:
                    self._finish(h, h.track.reason, abort=stopped and not o.finished)
                h.put(("delta", delta, list(toks), done, h.track.reason if done else None))
            self.metrics.after_step(eng)


def _err(e: RequestError, headers=None):
    """The OpenAI-style error response. Rendered with ``ensure_ascii``: a message may quote
    client text holding a lone surrogate (a model name, a chat role), which has no UTF-8."""
    from fastapi.responses import Response

    return Response(json.dumps(e.body(), ensure_ascii=True, separators=(",", ":")),
                    status_code=e.status, headers=headers, media_type="application/json")


# Request bodies up to this size are parsed on the event loop; larger ones in a worker thread
# (json.loads of megabytes takes long enough to stall every other client's stream).
_PARSE_INLINE_BYTES = 256 * 1024


def _parse_json(raw: bytes):
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError:
        raise RequestError(400, "the request body is not valid UTF-8") from None
    try:
        return json.loads(text)
    except json.JSONDecodeError as e:
        raise RequestError(400, f"the request body is not valid JSON: {e}") from None
    except RecursionError:
        raise RequestError(400, "the request body nests JSON too deeply") from None
    except ValueError as e:  # int() of a literal past sys.get_int_max_str_digits()
        if "digits" not in str(e):
            raise RequestError(400, f"the request body is not valid JSON: {e}") from None
        raise RequestError(400, "the request body holds an integer with more than "
                                f"{sys.get_int_max_str_digits()} digits") from None


async def _disconnected(request) -> bool:
    """Returns when the client has gone away. The body has been read already, so the next ASGI
    ``receive`` only returns with ``http.disconnect`` (``request.is_disconnected()`` polls with a
    cancelled scope, which never sees it with Starlette 1.x over uvicorn's h11)."""
    try:
        while True:
            msg = await request.receive()
            if msg.get("type") == "http.disconnect":
                return True
    except asyncio.CancelledError:
        raise
    except Exception:  # noqa: BLE001 - a server whose receive fails: stop watching, serve on
        logging.getLogger("pyspec.serve").debug("cannot watch the connection", exc_info=True)
        await asyncio.Event().wait()
        return False


# OpenAI request fields this server does not implement, with the value that means "not used":
# a request that sets one otherwise gets a 400 rather than an answer that ignored it.
_UNSUPPORTED = {"logit_bias": {}, "presence_penalty": 0, "frequency_penalty": 0, "best_of": 1,
                "echo": False, "suffix": "", "tools": [], "tool_choice": "none", "functions": [],
                "function_call": "none", "response_format": {"type": "text"}}


def _get(body: dict, key: str, types, default=None, check=None, what=""):
    if key not in body or body[key] is None:
        return default
    v = body[key]
    if not isinstance(v, types) or isinstance(v, bool) and bool not in (
            types if isinstance(types, tuple) else (types,)):
        raise RequestError(400, f"'{key}' must be {what}; got {json.dumps(v)[:80]}", key)
    if check is not None and not check(v):
        raise RequestError(400, f"'{key}' must be {what}; got {json.dumps(v)[:80]}", key)
    return v


def create_app(llm, config: Optional[ServerConfig] = None, *, model_name: str = "pyspec",
               prompt_log: Optional[str] = None, prompt_log_ratio: float = 0.0, tracer=None,
               shadow_draft: Optional[str] = None, shadow_ratio: float = 0.1,
               max_body_bytes: int = 16 << 20):
    """The ASGI app serving ``llm`` (a :class:`pyspec.LLM`). ``prompt_log``: append a sampled
    share of served prompts to this JSONL file (``pyspec eval-draft --prompts`` replays it).
    ``tracer``: an OpenTelemetry tracer (see :mod:`pyspec.serve.tracing`); None: no tracing.
    ``shadow_draft``: a candidate drafter run on ``shadow_ratio`` of the traffic, mirrored, its
    acceptance and speedup exported (:mod:`pyspec.serve.shadow`). ``max_body_bytes``: larger
    request bodies get a 413 (checked while they arrive, not after buffering them)."""
    from fastapi import FastAPI, Request
    from fastapi.responses import PlainTextResponse, Response, StreamingResponse
    from prometheus_client import generate_latest, CONTENT_TYPE_LATEST
    from starlette.exceptions import HTTPException as StarletteHTTPException
    from starlette.requests import ClientDisconnect

    if not isinstance(max_body_bytes, int) or max_body_bytes < 1:
        raise ValueError(f"max_body_bytes must be an int >= 1; got {max_body_bytes!r}")

    state = {"config": config or ServerConfig()}
    metrics = Metrics()
    from pyspec.serve.quality import QualityGate

    gate = QualityGate(metrics, state)
    loop_ = EngineLoop(llm, metrics, gate, tracer)
    shadow = None
    if shadow_draft:
        from pyspec.serve.shadow import Shadow

        shadow = Shadow(llm, shadow_draft, shadow_ratio, metrics)
    loop_.shadow = shadow
    ctx_limit = context_tokens(llm)
    chat_overhead = _chat_overhead(llm.tokenizer)
    metrics.memory.labels(component="target_weights").set(
        sum(t.numel() * t.element_size() for t in _model_tensors(llm.model))
        + llm.model.packed_bytes)
    metrics.memory.labels(component="kv_pool").set(_kv_bytes(llm.engine))
    metrics.memory.labels(component="draft_weights").set(_draft_bytes(llm.engine))
    if shadow is not None:
        metrics.memory.labels(component="shadow_kv_pool").set(_kv_bytes(shadow.engine))
        metrics.memory.labels(component="shadow_draft_weights").set(_draft_bytes(shadow.engine))
    log_lock = threading.Lock()

    from contextlib import asynccontextmanager

    @asynccontextmanager
    async def lifespan(app):
        loop_.start()
        if shadow is not None:
            shadow.start()
        yield
        loop_.stop()
        if shadow is not None:
            shadow.stop()

    app = FastAPI(title="pyspec", lifespan=lifespan)
    app.state.engine_loop = loop_
    app.state.metrics = metrics
    app.state.config = state
    app.state.quality_gate = gate
    app.state.shadow = shadow

    async def read_json(request: Request) -> dict:
        too_big = RequestError(413, f"the request body is larger than this server's limit of "
                                    f"{max_body_bytes} bytes", None, "request_too_large")
        declared = request.headers.get("content-length")
        if declared is not None and declared.isdigit() and int(declared) > max_body_bytes:
            raise too_big  # refused before any of it is read
        chunks, size = [], 0
        try:
            async for chunk in request.stream():  # chunked bodies have no Content-Length
                size += len(chunk)
                if size > max_body_bytes:
                    raise too_big
                chunks.append(chunk)
        except ClientDisconnect:  # gone before its body arrived: nobody reads the answer
            raise RequestError(499, "the client closed the connection") from None
        raw = b"".join(chunks)
        if len(raw) > _PARSE_INLINE_BYTES:
            body = await asyncio.to_thread(_parse_json, raw)
        else:
            body = _parse_json(raw)
        if not isinstance(body, dict):
            raise RequestError(400, "the request body must be a JSON object")
        model = body.get("model")
        if model is not None and model != model_name:
            raise RequestError(404, f"the model '{model}' does not exist; this server serves "
                                    f"'{model_name}'", "model", "model_not_found")
        return body

    def params_from(body: dict, tenant: Optional[str], rid: str,
                    default_max_tokens: int = 16) -> SamplingParams:
        max_tokens = _get(body, "max_tokens", int, default_max_tokens, lambda v: v >= 1,
                          "an integer >= 1")
        if "max_completion_tokens" in body and body["max_completion_tokens"] is not None:
            max_tokens = _get(body, "max_completion_tokens", int, default_max_tokens,
                              lambda v: v >= 1, "an integer >= 1")
        temperature = float(_get(body, "temperature", (int, float), 1.0,
                                 lambda v: 0 <= v <= 100, "a number in [0, 100]"))
        top_p = float(_get(body, "top_p", (int, float), 1.0, lambda v: 0 < v <= 1,
                           "a number in (0, 1]"))
        top_k = _get(body, "top_k", int, 0, lambda v: v >= 0, "an integer >= 0")
        min_p = float(_get(body, "min_p", (int, float), 0.0, lambda v: 0 <= v <= 1,
                           "a number in [0, 1]"))
        n = _get(body, "n", int, 1, lambda v: 1 <= v <= 16, "an integer in [1, 16]")
        seed = _get(body, "seed", int, None, lambda v: -(1 << 63) <= v < (1 << 63),
                    "a 64-bit integer")
        stop = body.get("stop")
        if stop is not None:
            if isinstance(stop, str):
                stop = [stop]
            if not isinstance(stop, list) or not all(isinstance(s, str) and s for s in stop) or \
                    len(stop) > 16:
                raise RequestError(400, "'stop' must be a non-empty string or a list of at most "
                                        "16 of them", "stop")
        if body.get("logprobs") not in (None, False, 0) or body.get("top_logprobs"):
            raise RequestError(400, "'logprobs' is not supported by this server", "logprobs")
        for key, default in _UNSUPPORTED.items():
            if key in body and body[key] is not None and body[key] != default and not (
                    key == "best_of" and body[key] == n):
                raise RequestError(400, f"'{key}' is not supported by this server (allowed: "
                                        f"leave it out, or {json.dumps(default)})", key)
        settings = state["config"].for_tenant(tenant)
        p = SamplingParams(max_tokens=max_tokens, temperature=temperature, top_p=top_p,
                           top_k=top_k, min_p=min_p, seed=seed, stop=stop, n=n,
                           ignore_eos=_get(body, "ignore_eos", bool, False, None, "true or false"),
                           speculative=settings.speculates(rid))
        try:
            return llm._params(p)  # validates
        except ValueError as e:  # its message starts with the field's name
            key = str(e).split(" ", 1)[0]
            raise RequestError(400, str(e), key if key in body else None) from None

    async def tokenize(fn, arg, chars: int, field: str) -> List[int]:
        """``fn(arg)`` off the event loop (a long text takes a while to tokenize and must not
        stall other requests' streams); text too long to fit the context in any tokenization
        is refused without tokenizing it."""
        if chars > ctx_limit * llm.tokenizer.max_token_chars:
            what = "prompt has" if field == "prompt" else "messages render to at least"
            raise RequestError(400, f"this model's maximum context length is {ctx_limit} "
                                    f"tokens; the {what} {chars} characters, more than "
                                    "that many tokens can hold", field, "context_length_exceeded")
        try:
            return await asyncio.to_thread(fn, arg)
        except ValueError as e:
            raise RequestError(400, str(e), field) from None

    def check_prompt(ids: List[int], p: SamplingParams, field: str = "prompt") -> None:
        if not ids:
            raise RequestError(400, "the prompt is empty", field)
        if any(not 0 <= t < llm.engine.vocab_size for t in ids):
            raise RequestError(400, f"prompt token ids must be in [0, {llm.engine.vocab_size})",
                               field)
        if len(ids) >= ctx_limit:  # no room for one token, whatever max_tokens says
            what = "prompt has" if field == "prompt" else "messages render to"
            raise RequestError(400, f"this model's maximum context length is {ctx_limit} "
                                    f"tokens; the {what} {len(ids)} tokens, which leaves no "
                                    "room for a completion", field, "context_length_exceeded")
        if len(ids) + p.max_tokens > ctx_limit:
            raise RequestError(400, f"this model's maximum context length is {ctx_limit} "
                                    f"tokens; the prompt has {len(ids)} and max_tokens is "
                                    f"{p.max_tokens}",
                               "max_tokens", "context_length_exceeded")

    def log_prompt(kind: str, payload) -> None:
        if not prompt_log or prompt_log_ratio <= 0:
            return
        import random

        if random.random() >= prompt_log_ratio:
            return
        text = payload if isinstance(payload, str) else (
            payload[-1]["content"] if isinstance(payload, list) and payload and
            isinstance(payload[-1], dict) else None)
        if not isinstance(text, str):
            return
        with log_lock, open(prompt_log, "a", encoding="utf-8") as f:
            f.write(json.dumps({"category": kind, "prompt": text, "time": time.time()}) + "\n")

    async def run(request: Request, ids: List[int], p: SamplingParams, stream: bool,
                  make_chunk, make_final, req_id: str, include_usage: bool = False,
                  usage_chunk=None):
        aloop = asyncio.get_running_loop()
        handles = []
        for k in range(p.n):
            sp = replace(p, n=1, seed=None if p.seed is None else sample_seed(p.seed, k))
            h = _Handle(aloop, ids, sp, llm)
            h.score = gate.wants(f"{req_id}-{k}", sp.speculative)
            if shadow is not None and shadow.wants(f"{req_id}-{k}"):
                h.shadow_key = f"{req_id}-{k}"
                shadow.mirror(h.shadow_key, ids, sp)
            handles.append(h)
            loop_.submit(h)

        if stream:
            # Starlette cancels the response (and so runs the finally below) when the client goes
            # away; a watcher of our own here would race with its listener for the message.
            async def gen():
                done = [False] * len(handles)
                pending = {}
                try:
                    pending = {asyncio.ensure_future(h.queue.get()): i
                               for i, h in enumerate(handles)}
                    while pending:
                        finished, _ = await asyncio.wait(pending,
                                                         return_when=asyncio.FIRST_COMPLETED)
                        for fut in finished:
                            i = pending.pop(fut)
                            item = fut.result()
                            if item[0] == "error":
                                err = item[1]
                                yield "data: " + json.dumps(err.body()) + "\n\n"
                                done[i] = True
                                continue
                            _, delta, toks, fin, reason = item
                            if delta or fin:
                                yield "data: " + json.dumps(make_chunk(i, delta, reason)) + "\n\n"
                            if fin:
                                done[i] = True
                            else:
                                pending[asyncio.ensure_future(handles[i].queue.get())] = i
                    if include_usage:
                        n_out = sum(len(h.track.tokens) for h in handles)
                        yield "data: " + json.dumps(usage_chunk(
                            {"prompt_tokens": len(ids), "completion_tokens": n_out,
                             "total_tokens": len(ids) + n_out})) + "\n\n"
                    yield "data: [DONE]\n\n"
                finally:
                    for fut in list(pending):
                        fut.cancel()
                    for i, h in enumerate(handles):
                        if not done[i]:
                            loop_.abort(h)

            return StreamingResponse(gen(), media_type="text/event-stream")

        # Not streaming: nothing is sent until the end, so nothing notices a client that went
        # away unless we watch the connection, racing it against the handles' queues.
        watcher = asyncio.ensure_future(_disconnected(request))
        getter = None
        results = [None] * len(handles)
        try:
            for i, h in enumerate(handles):
                text, toks = "", []
                while True:
                    if h.queue.empty():
                        getter = asyncio.ensure_future(h.queue.get())
                        await asyncio.wait((getter, watcher), return_when=asyncio.FIRST_COMPLETED)
                        if not getter.done():
                            # The client is gone: free the engine, answer nobody (no traceback,
                            # 499 as nginx logs it).
                            for h2 in handles:
                                loop_.abort(h2)
                            return Response(status_code=499)
                        item = getter.result()
                        getter = None
                    else:
                        item = h.queue.get_nowait()
                    if item[0] == "error":
                        raise item[1]
                    _, delta, t, fin, reason = item
                    text += delta
                    toks += t
                    if fin:
                        results[i] = (text, toks, reason)
                        break
        except BaseException:
            for h in handles:
                loop_.abort(h)
            raise
        finally:
            watcher.cancel()
            if getter is not None:
                getter.cancel()
        return make_final(results, handles)

    def stream_usage(body) -> bool:
        so = body.get("stream_options")
        if so is None:
            return False
        if not isinstance(so, dict) or not isinstance(so.get("include_usage", False), bool):
            raise RequestError(400, "'stream_options' must be an object like "
                                    "{\"include_usage\": true}", "stream_options")
        return bool(so.get("include_usage"))

    def usage(n_prompt, results):
        c = sum(len(r[1]) for r in results)
        return {"prompt_tokens": n_prompt, "completion_tokens": c, "total_tokens": n_prompt + c}

    def spec_stats(handles):
        out = []
        for h in handles:
            s = h.stats
            if s is None:
                continue
            out.append({"drafts": s.drafts, "draft_tokens": s.draft_tokens,
                        "accepted_tokens": s.accepted_tokens,
                        "acceptance_length": round(s.acceptance_length, 4)})
        return out

    @app.exception_handler(RequestError)
    async def _on_request_error(request, exc: RequestError):
        return _err(exc)

    @app.exception_handler(StarletteHTTPException)
    async def _on_http_error(request, exc: StarletteHTTPException):
        # Unknown paths (404) and methods (405) in the OpenAI error shape, not FastAPI's
        # {"detail": ...}; the 405's Allow header is kept.
        if exc.status_code == 404:
            msg = f"unknown endpoint {request.method} {request.url.path}"
        elif exc.status_code == 405:
            msg = f"method {request.method} is not allowed on {request.url.path}"
        else:
            msg = str(exc.detail)
        code = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code)
        kind = "server_error" if exc.status_code >= 500 else "invalid_request_error"
        return _err(RequestError(exc.status_code, msg, None, code, kind), headers=exc.headers)

    @app.post("/v1/completions")
    async def completions(request: Request):
        body = await read_json(request)
        rid = "cmpl-" + uuid.uuid4().hex
        tenant = request.headers.get("x-tenant")
        prompt = body.get("prompt")
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
            prompt = prompt[0]
        if isinstance(prompt, str):
            if not prompt:
                raise RequestError(400, "'prompt' is empty", "prompt")
            ids = await tokenize(llm.tokenizer.encode, prompt, len(prompt), "prompt")
        elif isinstance(prompt, list) and prompt and all(
                isinstance(t, int) and not isinstance(t, bool) for t in prompt):
            ids = list(prompt)
        else:
            raise RequestError(400, "'prompt' must be a string or a list of token ids (one "
                                    "prompt per request)", "prompt")
        p = params_from(body, tenant, rid)
        check_prompt(ids, p)
        log_prompt("completions", prompt if isinstance(prompt, str) else None)
        created = int(time.time())

        def chunk(i, delta, reason):
            return {"id": rid, "object": "text_completion", "created": created,
                    "model": model_name,
                    "choices": [{"index": i, "text": delta, "finish_reason": reason,
                                 "logprobs": None}]}

        def final(results, handles):
            return {"id": rid, "object": "text_completion", "created": created,
                    "model": model_name,
                    "choices": [{"index": i, "text": r[0], "finish_reason": r[2], "logprobs": None}
                                for i, r in enumerate(results)],
                    "usage": usage(len(ids), results), "speculation": spec_stats(handles)}

        return await run(request, ids, p, _get(body, "stream", bool, False, None, "true or false"),
                         chunk, final, rid,
                         stream_usage(body),
                         lambda u: {"id": rid, "object": "text_completion", "created": created,
                                    "model": model_name, "choices": [], "usage": u})

    @app.post("/v1/chat/completions")
    async def chat(request: Request):
        body = await read_json(request)
        rid = "chatcmpl-" + uuid.uuid4().hex
        tenant = request.headers.get("x-tenant")
        msgs = body.get("messages")
        if isinstance(msgs, list) and len(msgs) > ctx_limit:  # each renders to a token or more
            raise RequestError(400, f"this model's maximum context length is {ctx_limit} "
                                    f"tokens; the request has {len(msgs)} messages",
                               "messages", "context_length_exceeded")
        ids = await tokenize(llm.chat_prompt, msgs, _chat_chars(msgs, chat_overhead), "messages")
        # OpenAI's chat API has no max_tokens default: the reply may fill the context.
        p = params_from(body, tenant, rid, max(1, ctx_limit - len(ids)))
        check_prompt(ids, p, "messages")
        log_prompt("chat", msgs)
        created = int(time.time())
        first = set()

        def chunk(i, delta, reason):
            d = {"content": delta}
            if i not in first:
                first.add(i)
                d["role"] = "assistant"
            return {"id": rid, "object": "chat.completion.chunk", "created": created,
                    "model": model_name,
                    "choices": [{"index": i, "delta": d, "finish_reason": reason}]}

        def final(results, handles):
            return {"id": rid, "object": "chat.completion", "created": created,
                    "model": model_name,
                    "choices": [{"index": i, "message": {"role": "assistant", "content": r[0]},
                                 "finish_reason": r[2], "logprobs": None}
                                for i, r in enumerate(results)],
                    "usage": usage(len(ids), results), "speculation": spec_stats(handles)}

        return await run(request, ids, p, _get(body, "stream", bool, False, None, "true or false"),
                         chunk, final, rid,
                         stream_usage(body),
                         lambda u: {"id": rid, "object": "chat.completion.chunk", "created": created,
                                    "model": model_name, "choices": [], "usage": u})

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": model_name, "object": "model",
                                            "created": 0, "owned_by": "pyspec"}]}

    @app.api_route("/health", methods=["GET", "HEAD"])  # HEAD: load balancers' probes
    async def health():
        return {"status": "ok"}

    @app.get("/metrics")
    async def prom():
        return PlainTextResponse(generate_latest(metrics.registry).decode(),
                                 media_type=CONTENT_TYPE_LATEST)

    return app


def _chat_overhead(tokenizer):
    """What the chat template adds per message besides its role and text, measured once by
    rendering one and two empty messages: (characters, whether the template renders the role).
    The second message is a user's, or an assistant's for templates that insist on alternating
    roles; (0, True) when the template cannot be measured (none, or it refuses both)."""
    if not getattr(tokenizer, "chat_template", None):
        return 0, True
    for second in ("user", "assistant"):
        try:
            one = tokenizer.apply_chat_template([{"role": "user", "content": ""}])
            two = tokenizer.apply_chat_template([{"role": "user", "content": ""},
                                                 {"role": second, "content": ""}])
        except Exception:  # noqa: BLE001 - any template error: try the next, then give up
            continue
        with_role = two.count(second) > one.count(second)
        return max(0, len(two) - len(one) - (len(second) if with_role else 0)), with_role
    return 0, True


def _chat_chars(msgs, overhead) -> int:
    """A lower bound on the characters the chat template renders for ``msgs``: roles (when the
    template renders them), the text of the content (a string, or a list of text parts), and the
    template's per-message overhead, so that many tiny messages count too. Compared against the
    context (see ``tokenize``) before anything is rendered or tokenized."""
    if not isinstance(msgs, list):
        return 0
    per_message, with_role = overhead
    chars = per_message * len(msgs)
    for m in msgs:
        if not isinstance(m, dict):
            continue
        if with_role and isinstance(m.get("role"), str):
            chars += len(m["role"])
        c = m.get("content")
        if isinstance(c, str):
            chars += len(c)
        elif isinstance(c, list):
            chars += sum(len(part["text"]) for part in c if isinstance(part, dict) and
                         isinstance(part.get("text"), str))
    return chars


def _model_tensors(model):
    import torch

    seen = set()
    # Codes-only matrices (packed_weights="codes") count through the model's packed_bytes.
    for t in [model.embed, model.lm_head, model.norm] + [v for layer in model.layers
                                                         for v in layer.values()]:
        if isinstance(t, torch.Tensor) and id(t) not in seen:
            seen.add(id(t))
            yield t


def context_tokens(llm) -> int:
    """The longest sequence (prompt + completion) a served request may ask for: the model's
    positions, and the KV pool less the one slot the last step writes."""
    return min(llm.model.cfg.max_position_embeddings,
               llm.runner.kv.num_blocks * llm.runner.block_size - 1)


def _kv_bytes(engine) -> int:
    """K and V pages of an engine's target pool and of its drafters' own pools (an EAGLE
    head's, a draft model's)."""
    return sum(2 * p.k.numel() * p.k.element_size() for p in [engine.runner.kv] + engine._pools)


def _draft_bytes(engine) -> int:
    """Bytes of weights the drafters hold beyond the target's own tensors: a draft model's
    weights (unless it shares the target's), head weights, and the host copies of the target's
    embedding / norm / lm_head that heads keep when the target is on a GPU (on a CPU target those
    are the target's tensors and count once, as target weights). Each tensor counts once."""
    import torch

    seen = {id(t) for t in _model_tensors(engine.runner.model)}
    total = 0

    def add(t):
        nonlocal total
        if isinstance(t, torch.Tensor) and id(t) not in seen:
            seen.add(id(t))
            total += t.numel() * t.element_size()

    def parts(d):
        # Combined drafters ('+', '|') hold their parts; a part may appear under several names.
        sub = getattr(d, "parts", None)
        if not sub:
            yield d
        for p in sub or ():
            yield from parts(p)

    for d in (p for top in engine.drafters.values() for p in parts(top)):
        m = getattr(d, "model", None)
        if m is not None and not getattr(d, "share", False):
            for t in _model_tensors(m):
                add(t)
            # A draft model's packed codes.
            for p in (m._packed_weights() if hasattr(m, "_packed_weights") else []):
                for t in (p.q, p.d, p.m):
                    add(t)
        head = getattr(d, "head", None)
        if head is not None:
            for t in _model_tensors(head):
                add(t)
        for name in ("fc_w", "fc_b", "fuse_w", "embed_w", "norm_w", "lm_head", "w", "b"):
            add(getattr(d, name, None))
    return total
