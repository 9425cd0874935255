"""``pyspec serve``: an OpenAI-compatible HTTP server (FastAPI + uvicorn) over one engine loop.

:func:`create_app` wires the parts: the protocol (:mod:`pyspec.serve.protocol`: bodies,
parameters, prompts, errors), the engine thread (:mod:`pyspec.serve.engine_loop`), metrics,
the quality gate, shadow mode and tracing, and registers the routes. Bad requests get a 4xx with
an OpenAI-style error body; they never reach the engine loop.
"""


import asyncio
import json
import random
import threading
import time
import uuid
from contextlib import asynccontextmanager
from dataclasses import replace
from typing import List, Optional

from pyspec.params import SamplingParams, sample_seed
from pyspec.serve.config import ServerConfig
from pyspec.serve.engine_loop import EngineLoop, Handle
from pyspec.serve.metrics import Metrics, set_memory_gauges
from pyspec.serve.protocol import (RequestError, RequestReader, disconnected, error_response,
                                   get_field, spec_stats, stream_usage, usage)

__all__ = ["create_app"]


def _sse(obj) -> str:
    return "data: " + json.dumps(obj) + "\n\n"


class _Responder:
    """Submits a request's samples to the engine loop and answers with their outputs: a stream
    of server-sent events, or one JSON body (racing the client's disconnect, which aborts)."""

    def __init__(self, loop: EngineLoop, tokenizer, gate, shadow):
        self.loop, self.tokenizer, self.gate, self.shadow = loop, tokenizer, gate, shadow

    def submit(self, ids: List[int], p: SamplingParams, req_id: str) -> List[Handle]:
        aloop = asyncio.get_running_loop()
        handles = []
        for k in range(p.n):
            sp = replace(p, n=1, seed=None if p.seed is None else sample_seed(p.seed, k))
            h = Handle(aloop, ids, sp, self.tokenizer)
            h.score = self.gate.wants(f"{req_id}-{k}", sp.speculative)
            if self.shadow is not None and self.shadow.wants(f"{req_id}-{k}"):
                h.shadow_key = f"{req_id}-{k}"
                self.shadow.mirror(h.shadow_key, ids, sp)
            handles.append(h)
            self.loop.submit(h)
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
                            yield _sse(item[1].body())
                            done[i] = True
                            continue
                        _, delta, toks, fin, reason = item
                        if delta or fin:
                            yield _sse(make_chunk(i, delta, reason))
                        if fin:
                            done[i] = True
                        else:
                            pending[asyncio.ensure_future(handles[i].queue.get())] = i
                if usage_chunk is not None:
                    n_out = sum(len(h.track.tokens) for h in handles)
                    yield _sse(usage_chunk({"prompt_tokens": n_prompt, "completion_tokens": n_out,
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

    async def respond(self, request, body: dict, head: dict, ids, p, make_chunk, make_final):
        """The response to a request (``body``): a stream of ``make_chunk`` chunks (and, when
        asked, a usage chunk after ``head``'s fields) or ``make_final``'s object."""
        stream = get_field(body, "stream", bool, False, None, "true or false")
        usage_chunk = ((lambda u: {**head, "choices": [], "usage": u}) if stream_usage(body)
                       else None)
        handles = self.submit(ids, p, head["id"])
        if stream:
            return self.stream(handles, len(ids), make_chunk, usage_chunk)
        return await self.collect(request, handles, make_final)


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
        with self.lock, open(self.path, "a", encoding="utf-8") as f:
            f.write(json.dumps({"category": kind, "prompt": text, "time": time.time()}) + "\n")


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
    from fastapi.responses import PlainTextResponse
    from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
    from starlette.exceptions import HTTPException as StarletteHTTPException

    from pyspec.serve.quality import QualityGate

    state = {"config": config or ServerConfig()}
    reader = RequestReader(llm, state, model_name, max_body_bytes)
    metrics = Metrics()
    gate = QualityGate(metrics, state)
    loop_ = EngineLoop(llm, metrics, gate, tracer)
    shadow = None
    if shadow_draft:
        from pyspec.serve.shadow import Shadow

        shadow = Shadow(llm, shadow_draft, shadow_ratio, metrics)
    loop_.shadow = shadow
    set_memory_gauges(metrics, llm, shadow)
    responder = _Responder(loop_, llm.tokenizer, gate, shadow)
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

    app = FastAPI(title="pyspec", lifespan=lifespan)
    app.state.engine_loop = loop_
    app.state.metrics = metrics
    app.state.config = state
    app.state.quality_gate = gate
    app.state.shadow = shadow

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

    @app.post("/v1/completions")
    async def completions(request: Request):
        body = await reader.read_json(request)
        rid = "cmpl-" + uuid.uuid4().hex
        ids = await reader.prompt(body)
        p = reader.params(body, request.headers.get("x-tenant"), rid)
        reader.check_prompt(ids, p)
        log_prompt("completions", reader.prompt_text(body))
        created = int(time.time())
        head = {"id": rid, "object": "text_completion", "created": created, "model": model_name}

        def chunk(i, delta, reason):
            return {**head, "choices": [{"index": i, "text": delta, "finish_reason": reason,
                                         "logprobs": None}]}

        def final(results, handles):
            return {**head,
                    "choices": [{"index": i, "text": r[0], "finish_reason": r[2], "logprobs": None}
                                for i, r in enumerate(results)],
                    "usage": usage(len(ids), results), "speculation": spec_stats(handles)}

        return await responder.respond(request, body, head, ids, p, chunk, final)

    @app.post("/v1/chat/completions")
    async def chat(request: Request):
        body = await reader.read_json(request)
        rid = "chatcmpl-" + uuid.uuid4().hex
        ids = await reader.chat_prompt(body)
        # OpenAI's chat API has no max_tokens default: the reply may fill the context.
        p = reader.params(body, request.headers.get("x-tenant"), rid,
                          max(1, reader.ctx_limit - len(ids)))
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
                    "usage": usage(len(ids), results), "speculation": spec_stats(handles)}

        return await responder.respond(request, body, head, ids, p, chunk, final)

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
