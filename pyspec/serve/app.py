"""``pyspec serve``: an OpenAI-compatible HTTP server (FastAPI + uvicorn) over one engine loop.

:func:`create_app` wires the parts: the protocol (:mod:`pyspec.serve.protocol`: bodies,
parameters, prompts, errors), the engine thread (:mod:`pyspec.serve.engine_loop`), metrics,
the quality gate, shadow mode and tracing, and registers the routes. Bad requests get a 4xx with
an OpenAI-style error body; they never reach the engine loop.
"""


import asyncio
import json
import logging
import math
import random
import threading
import time
import uuid
from contextlib import asynccontextmanager
from dataclasses import replace
from typing import List, Optional

from pyspec.params import SamplingParams, sample_seed
from pyspec.serve.admission import Admission, AdmissionGate
from pyspec.serve.config import ServerConfig
from pyspec.serve.engine_loop import EngineLoop, Handle
from pyspec.serve.guard import Guard
from pyspec.serve.metrics import Metrics, set_memory_gauges
from pyspec.serve.options import ServeOptions
from pyspec.serve.protocol import (RequestError, RequestReader, disconnected, error_response,
                                   get_field, spec_stats, sse, stream_usage, usage)
from pyspec.serve.rollback import Rollbacks

__all__ = ["create_app"]

_log = logging.getLogger("pyspec.serve")


class _Responder:
    """Admits a request, submits its samples to the engine loop and answers with their outputs:
    a stream of server-sent events, or one JSON body (racing the client's disconnect, which
    aborts)."""

    def __init__(self, loop: EngineLoop, tokenizer, gate, shadow, admission: Admission,
                 options: ServeOptions, state: dict):
        self.loop, self.tokenizer, self.gate, self.shadow = loop, tokenizer, gate, shadow
        self.admission, self.options, self.state = admission, options, state

    def deadlines(self, body: dict):
        """(deadline, queue deadline) in perf_counter seconds for a request arriving now: its own
        ``timeout`` field (seconds), at most the server's ``request_timeout``."""
        t = get_field(body, "timeout", (int, float), None,
                      lambda v: math.isfinite(v) and v > 0, "a number of seconds > 0")
        limit = self.options.request_timeout
        if t is not None and limit is not None:
            t = min(float(t), limit)
        elif t is None:
            t = limit
        now = time.perf_counter()
        q = self.options.queue_timeout
        return (None if t is None else now + t), (None if q is None else now + q)

    def submit(self, prompts: List[List[int]], p: SamplingParams, req_id: str, tenant,
               deadlines, reservation=None) -> List[Handle]:
        cost = max(len(ids) for ids in prompts) + p.max_tokens
        ticket = self.admission.admit(tenant, len(prompts) * p.n, cost, reservation)
        aloop = asyncio.get_running_loop()
        handles = []
        cfg = self.state["config"]
        try:
            for ids in prompts:
                # The config's decision for this tenant and prompt class (deterministic by id).
                spec = cfg.speculates(req_id, tenant, self.loop.engine.channel_of(len(ids)))
                for k in range(p.n):
                    sp = replace(p, n=1, seed=None if p.seed is None else sample_seed(p.seed, k),
                                 speculative=spec)
                    key = f"{req_id}-{len(handles)}"
                    h = Handle(aloop, ids, sp, self.tokenizer)
                    h.deadline, h.queue_deadline = deadlines
                    h.score = self.gate.wants(key, sp.speculative)
                    if self.shadow is not None and self.shadow.wants(key):
                        h.shadow_key = key
                        self.shadow.mirror(h.shadow_key, ids, sp)
                    h.on_close = ticket.sample_done
                    handles.append(h)
                    self.loop.submit(h)
        except BaseException:  # the submitted samples are aborted; the others' slots given back
            for h in handles:
                self.loop.abort(h)
            for _ in range(len(prompts) * p.n - len(handles)):
                ticket.sample_done()
            raise
        finally:
            if reservation is not None:
                reservation.release()  # (the submitted samples count as waiting now)
        return handles

    def stream(self, handles: List[Handle], n_prompt: int, make_chunk, usage_chunk):
        """Server-sent events: each sample's deltas as they come, then the usage chunk (when
        ``usage_chunk``), then ``[DONE]``. Starlette cancels the response (running the
        ``finally``, which aborts the unfinished samples) when the client goes away."""
        from fastapi.responses import StreamingResponse

        loop = self.loop

        async def gen():
            done = [False] * len(handles)
            pending = {}
            try:
                pending = {asyncio.ensure_future(h.queue.get()): i for i, h in enumerate(handles)}
                while pending:
                    finished, _ = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
                    for fut in finished:
                        i = pending.pop(fut)
                        item = fut.result()
                        if item[0] == "error":
                            yield sse(item[1].body())
                            done[i] = True
                            continue
                        _, delta, toks, fin, reason = item
                        if delta or fin:
                            yield sse(make_chunk(i, delta, reason))
                        if fin:
                            done[i] = True
                        else:
                            pending[asyncio.ensure_future(handles[i].queue.get())] = i
                if usage_chunk is not None:
                    n_out = sum(len(h.track.tokens) for h in handles)
                    yield sse(usage_chunk({"prompt_tokens": n_prompt, "completion_tokens": n_out,
                                            "total_tokens": n_prompt + n_out}))
                yield "data: [DONE]\n\n"
            finally:
                for fut in list(pending):
                    fut.cancel()
                for i, h in enumerate(handles):
                    if not done[i]:
                        loop.abort(h)

        return StreamingResponse(gen(), media_type="text/event-stream")

    async def collect(self, request, handles: List[Handle], make_final):
        """One JSON body once every sample finished. Nothing is sent until then, so nothing
        notices a client that went away unless we watch the connection, racing it against the
        handles' queues: gone, the samples are aborted and nobody is answered (499)."""
        from fastapi.responses import Response

        loop = self.loop
        watcher = asyncio.ensure_future(disconnected(request))
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
                            for h2 in handles:
                                loop.abort(h2)
                            return Response(status_code=499)  # as nginx logs it
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
                loop.abort(h)
            raise
        finally:
            watcher.cancel()
            if getter is not None:
                getter.cancel()
        return make_final(results, handles)

    async def respond(self, request, body: dict, head: dict, prompts, p, make_chunk,
                      make_final):
        """The response to a request (``body``) for ``prompts`` (token-id lists; ``p.n`` samples
        each, numbered in that order): a stream of ``make_chunk`` chunks (and, when asked, a usage
        chunk after ``head``'s fields) or ``make_final``'s object."""
        stream = get_field(body, "stream", bool, False, None, "true or false")
        usage_chunk = ((lambda u: {**head, "choices": [], "usage": u}) if stream_usage(body)
                       else None)
        deadlines = self.deadlines(body)
        handles = self.submit(prompts, p, head["id"], request.state.tenant, deadlines,
                              getattr(request.state, "reservation", None))
        n_prompt = sum(len(ids) for ids in prompts)
        if stream:
            return self.stream(handles, n_prompt, make_chunk, usage_chunk)
        return await self.collect(request, handles, make_final)

    def speculation(self, handles):
        """The response's ``speculation`` field, when this server exposes it."""
        return {"speculation": spec_stats(handles)} if self.options.speculation_stats else {}


class _PromptLog:
    """Appends a sampled share of served prompts to a JSONL file (``pyspec eval-draft --prompts``
    replays it)."""

    def __init__(self, path: Optional[str], ratio: float):
        self.path, self.ratio = path, ratio
        self.lock = threading.Lock()

    def __call__(self, kind: str, payload) -> None:
        if not self.path or self.ratio <= 0 or random.random() >= self.ratio:
            return
        text = payload if isinstance(payload, str) else (
            payload[-1]["content"] if isinstance(payload, list) and payload and
            isinstance(payload[-1], dict) else None)
        if not isinstance(text, str):
            return
        line = json.dumps({"category": kind, "prompt": text, "time": time.time()}) + "\n"
        with self.lock:
            try:
                with open(self.path, "a", encoding="utf-8") as f:
                    f.write(line)
            except OSError as e:  # the log is a side channel: the request goes on regardless
                _log.warning("prompt log %s: %s; the prompt was not logged", self.path, e)


def create_app(llm, config: Optional[ServerConfig] = None, *, model_name: str = "pyspec",
               prompt_log: Optional[str] = None, prompt_log_ratio: float = 0.0, tracer=None,
               shadow_draft: Optional[str] = None, shadow_ratio: float = 0.1,
               max_body_bytes: int = 16 << 20, options: Optional[ServeOptions] = None):
    """The ASGI app serving ``llm`` (a :class:`pyspec.LLM`). ``prompt_log``: append a sampled
    share of served prompts to this JSONL file (``pyspec eval-draft --prompts`` replays it).
    ``tracer``: an OpenTelemetry tracer (see :mod:`pyspec.serve.tracing`); None: no tracing.
    ``shadow_draft``: a candidate drafter run on ``shadow_ratio`` of the traffic, mirrored, its
    acceptance and speedup exported (:mod:`pyspec.serve.shadow`). ``max_body_bytes``: larger
    request bodies get a 413 (checked while they arrive, not after buffering them).
    ``options``: access, limits, deadlines and failure handling (:class:`ServeOptions`)."""
    from fastapi import FastAPI, Request
    from fastapi.responses import JSONResponse, PlainTextResponse
    from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
    from starlette.exceptions import HTTPException as StarletteHTTPException

    from pyspec.serve.quality import QualityGate

    options = options or ServeOptions()
    if not isinstance(options, ServeOptions):
        raise ValueError(f"options must be a ServeOptions; got {type(options).__name__}")
    state = {"config": config or ServerConfig()}
    reader = RequestReader(llm, state, model_name, max_body_bytes, options.body_timeout)
    metrics = Metrics()
    gate = QualityGate(metrics, state)
    loop_ = EngineLoop(llm, metrics, gate, tracer, on_failure=options.on_engine_failure,
                       max_restarts=options.max_engine_restarts)
    shadow = None
    if shadow_draft:
        from pyspec.serve.shadow import Shadow

        shadow = Shadow(llm, shadow_draft, shadow_ratio, metrics)
    loop_.shadow = shadow
    set_memory_gauges(metrics, llm, shadow)
    admission = Admission(loop_, state, metrics, options.max_waiting_requests)
    responder = _Responder(loop_, llm.tokenizer, gate, shadow, admission, options, state)
    rollbacks = Rollbacks(metrics, state, loop_)
    gate.roll_back = rollbacks.speculation
    loop_.rollbacks = rollbacks
    rollbacks.apply_config(None, state["config"])
    log_prompt = _PromptLog(prompt_log, prompt_log_ratio)

    @asynccontextmanager
    async def lifespan(app):
        loop_.start()
        if shadow is not None:
            shadow.start()
        yield
        loop_.stop()
        if shadow is not None:
            shadow.stop()

    docs = {} if options.docs else {"docs_url": None, "redoc_url": None, "openapi_url": None}
    app = FastAPI(title="pyspec", lifespan=lifespan, **docs)
    # Outermost first: access, then the admission gate, then the routes.
    app.add_middleware(AdmissionGate, admission=admission)
    app.add_middleware(Guard, policy=options.access, state=state, metrics=metrics)
    app.state.engine_loop = loop_
    app.state.metrics = metrics
    app.state.config = state
    app.state.quality_gate = gate
    app.state.rollbacks = rollbacks
    app.state.shadow = shadow
    app.state.admission = admission
    app.state.draining = False  # set on SIGTERM: /ready answers 503, new requests get a 503

    @app.exception_handler(RequestError)
    async def _on_request_error(request, exc: RequestError):
        return error_response(exc)

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
        return error_response(RequestError(exc.status_code, msg, None, code, kind),
                              headers=exc.headers)

    def check_draining():
        if app.state.draining:
            e = RequestError(503, "the server is shutting down; retry on another replica", None,
                             "shutting_down", "server_error")
            e.headers = {"Retry-After": "1", "Connection": "close"}
            raise e

    @app.post("/v1/completions")
    async def completions(request: Request):
        check_draining()
        body = await reader.read_json(request)
        rid = "cmpl-" + uuid.uuid4().hex
        prompts = await reader.prompts(body)
        p = reader.params(body, request.state.tenant)
        reader.check_samples(len(prompts), p)
        for ids in prompts:
            reader.check_prompt(ids, p)
        log_prompt("completions", reader.prompt_text(body))
        created = int(time.time())
        head = {"id": rid, "object": "text_completion", "created": created, "model": model_name}

        def chunk(i, delta, reason):
            return {**head, "choices": [{"index": i, "text": delta, "finish_reason": reason,
                                         "logprobs": None}]}

        def final(results, handles):
            n_prompt = sum(len(ids) for ids in prompts)
            return {**head,
                    "choices": [{"index": i, "text": r[0], "finish_reason": r[2], "logprobs": None}
                                for i, r in enumerate(results)],
                    "usage": usage(n_prompt, results), **responder.speculation(handles)}

        return await responder.respond(request, body, head, prompts, p, chunk, final)

    @app.post("/v1/chat/completions")
    async def chat(request: Request):
        check_draining()
        body = await reader.read_json(request)
        rid = "chatcmpl-" + uuid.uuid4().hex
        ids = await reader.chat_prompt(body)
        # OpenAI's chat API has no max_tokens default: the reply may fill the context.
        p = reader.params(body, request.state.tenant, max(1, reader.ctx_limit - len(ids)))
        reader.check_samples(1, p)
        reader.check_prompt(ids, p, "messages")
        log_prompt("chat", body.get("messages"))
        created = int(time.time())
        head = {"id": rid, "object": "chat.completion.chunk", "created": created,
                "model": model_name}
        first = set()

        def chunk(i, delta, reason):
            d = {"content": delta}
            if i not in first:
                first.add(i)
                d["role"] = "assistant"
            return {**head, "choices": [{"index": i, "delta": d, "finish_reason": reason}]}

        def final(results, handles):
            return {**head, "object": "chat.completion",
                    "choices": [{"index": i, "message": {"role": "assistant", "content": r[0]},
                                 "finish_reason": r[2], "logprobs": None}
                                for i, r in enumerate(results)],
                    "usage": usage(len(ids), results), **responder.speculation(handles)}

        return await responder.respond(request, body, head, [ids], p, chunk, final)

    model_card = {"id": model_name, "object": "model", "created": 0, "owned_by": "pyspec"}

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [model_card]}

    @app.get("/v1/models/{model_id:path}")
    async def model(model_id: str):
        if model_id != model_name:
            raise RequestError(404, f"the model '{model_id}' does not exist; this server serves "
                                    f"'{model_name}'", "model", "model_not_found")
        return model_card

    @app.api_route("/health", methods=["GET", "HEAD"], include_in_schema=False)  # HEAD: probes
    async def health():
        """Liveness: the engine thread serves (an orchestrator restarts the server if not)."""
        if loop_.healthy:
            return {"status": "ok"}
        return JSONResponse({"status": "unhealthy", "error": loop_.failure or "engine stopped"},
                            status_code=503)

    @app.api_route("/ready", methods=["GET", "HEAD"], include_in_schema=False)
    async def ready():
        """Readiness: the server takes new requests (healthy, not draining, queue not full)."""
        why = None
        if not loop_.healthy:
            why = f"engine down: {loop_.failure or 'engine stopped'}"
        elif app.state.draining:
            why = "shutting down"
        elif options.max_waiting_requests is not None and \
                loop_.waiting() >= options.max_waiting_requests:
            why = "queue full"
        if why is None:
            return {"status": "ready"}
        return JSONResponse({"status": "not ready", "reason": why}, status_code=503)

    def profiling_allowed(request: Request):
        """Profiles write files on the server: only with --profile-dir, and where keys are on
        only with a server-wide key (a tenant's key is refused)."""
        if options.profile_dir is None:
            raise RequestError(404, "profiling is off: start the server with --profile-dir DIR",
                               None, "profiling_off")
        keys_on = bool(options.access.api_keys) or bool(state["config"].tenant_keys())
        if keys_on and getattr(request.state, "tenant", None) is not None:
            raise RequestError(403, "profiles take a server-wide key (--api-key), not a tenant's",
                               None, "forbidden", "permission_error")

    @app.post("/admin/profile")
    async def profile_start(request: Request):
        """Record the engine's next steps (``{"steps": N}``, default 20) as a Chrome trace in
        --profile-dir; answers its path at once (the file appears when the last step ends)."""
        profiling_allowed(request)
        empty = request.headers.get("content-length", "0") == "0" and \
            "transfer-encoding" not in request.headers
        body = {} if empty else await reader.read_json(request)
        steps = get_field(body, "steps", int, 20, lambda v: v >= 1, "an int >= 1")
        try:
            path = loop_.engine.profile(options.profile_dir, steps)
        except ValueError as e:
            raise RequestError(400, str(e), "steps") from None
        except RuntimeError as e:
            raise RequestError(409, str(e), None, "profile_in_progress") from None
        return {"object": "profile", **loop_.engine.profile_status(), "path": path}

    @app.get("/admin/profile")
    async def profile_status(request: Request):
        """The last profile's state (null before any)."""
        profiling_allowed(request)
        return {"object": "profile", "profile": loop_.engine.profile_status()}

    @app.get("/metrics")
    async def prom():
        return PlainTextResponse(generate_latest(metrics.registry).decode(),
                                 media_type=CONTENT_TYPE_LATEST)

    return app
