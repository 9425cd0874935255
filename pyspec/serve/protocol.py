"""The OpenAI protocol of ``pyspec serve``: request bodies in, sampling parameters and prompts out,
errors in OpenAI's shape. Nothing here touches the engine: a request that fails these checks gets
a 4xx and never reaches the engine loop.
"""

from __future__ import annotations

import asyncio
import json
import logging
import sys
from typing import List, Optional

from pyspec.params import SamplingParams

__all__ = ["RequestError", "RequestReader", "error_response", "context_tokens", "usage",
           "spec_stats", "stream_usage"]


class RequestError(Exception):
    def __init__(self, status: int, message: str, param: Optional[str] = None,
                 code: Optional[str] = None, kind: str = "invalid_request_error"):
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.kind = (status, message, param,
                                                                       code, kind)
        self.headers: Optional[dict] = None  # extra response headers (Retry-After)

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param,
                          "code": self.code}}


def error_response(e: RequestError, headers=None):
    """The OpenAI-style error response. Rendered with ``ensure_ascii``: a message may quote
    client text holding a lone surrogate (a model name, a chat role), which has no UTF-8."""
    from fastapi.responses import Response

    if e.headers:
        headers = {**(headers or {}), **e.headers}
    return Response(json.dumps(e.body(), ensure_ascii=True, separators=(",", ":")),
                    status_code=e.status, headers=headers, media_type="application/json")


def sse(obj) -> str:
    """One server-sent event carrying ``obj`` as JSON (a stream's chunk or error event)."""
    return "data: " + json.dumps(obj) + "\n\n"


# Prompts one completion request may hold (a list of prompts).
MAX_PROMPTS = 64
# Chat roles served, and the role the chat template sees for each ("developer" is OpenAI's newer
# name for the system message). Tool and function messages have no meaning without tool calls.
CHAT_ROLES = {"system": "system", "developer": "system", "user": "user", "assistant": "assistant"}

# Request bodies up to this size are parsed on the event loop; larger ones in a worker thread
# (json.loads of megabytes takes long enough to stall every other client's stream).
PARSE_INLINE_BYTES = 256 * 1024


def parse_json(raw: bytes):
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


async def disconnected(request) -> bool:
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
UNSUPPORTED = {"logit_bias": {}, "presence_penalty": 0, "frequency_penalty": 0, "best_of": 1,
               "echo": False, "suffix": "", "tools": [], "tool_choice": "none", "functions": [],
               "function_call": "none", "response_format": {"type": "text"}}


def get_field(body: dict, key: str, types, default=None, check=None, what=""):
    """``body[key]`` of one of ``types`` passing ``check`` (a 400 naming ``what`` is allowed
    otherwise); ``default`` when absent or null."""
    if key not in body or body[key] is None:
        return default
    v = body[key]
    if not isinstance(v, types) or isinstance(v, bool) and bool not in (
            types if isinstance(types, tuple) else (types,)):
        raise RequestError(400, f"'{key}' must be {what}; got {json.dumps(v)[:80]}", key)
    if check is not None and not check(v):
        raise RequestError(400, f"'{key}' must be {what}; got {json.dumps(v)[:80]}", key)
    return v


def context_tokens(llm) -> int:
    """The longest sequence (prompt + completion) a served request may ask for: the model's
    positions, and the KV pool less the one slot the last step writes."""
    return min(llm.model.cfg.max_position_embeddings,
               llm.runner.kv.num_blocks * llm.runner.block_size - 1)


def chat_overhead(tokenizer):
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


def chat_chars(msgs, overhead) -> int:
    """A lower bound on the characters the chat template renders for ``msgs``: roles (when the
    template renders them), the text of the content (a string, or a list of text parts), and the
    template's per-message overhead, so that many tiny messages count too. Compared against the
    context (see ``RequestReader.tokenize``) before anything is rendered or tokenized."""
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


def chat_messages(msgs) -> List[dict]:
    """OpenAI chat ``messages`` as the chat template takes them: ``{"role", "content"}`` with a
    known role (:data:`CHAT_ROLES`) and text content (a string, or a list of text parts, joined
    by newlines); anything else is a 400 naming the message."""
    if not isinstance(msgs, list) or not msgs:
        raise RequestError(400, "'messages' must be a non-empty list of {\"role\", \"content\"} "
                                "objects", "messages")
    out = []
    for i, m in enumerate(msgs):
        if not isinstance(m, dict):
            raise RequestError(400, f"messages[{i}] must be an object with 'role' and "
                                    "'content'", "messages")
        role = m.get("role")
        if role not in CHAT_ROLES:
            raise RequestError(400, f"messages[{i}].role must be one of {sorted(CHAT_ROLES)}; got "
                                    f"{json.dumps(role)[:40]}", "messages")
        c = m.get("content")
        if isinstance(c, list):
            texts = []
            for j, part in enumerate(c):
                if not (isinstance(part, dict) and part.get("type") == "text" and
                        isinstance(part.get("text"), str)):
                    kind = part.get("type") if isinstance(part, dict) else None
                    raise RequestError(400, f"messages[{i}].content[{j}] must be a text part "
                                            "{\"type\": \"text\", \"text\": ...}"
                                            + (f"; this server does not take {kind!r} parts"
                                               if isinstance(kind, str) and kind != "text"
                                               else ""), "messages")
                texts.append(part["text"])
            c = "\n".join(texts)
        elif c is None and role == "assistant":
            c = ""
        if not isinstance(c, str):
            raise RequestError(400, f"messages[{i}].content must be a string or a list of text "
                                    "parts", "messages")
        out.append({"role": CHAT_ROLES[role], "content": c})
    return out


def stream_usage(body) -> bool:
    """Whether a streamed response ends with a usage chunk (``stream_options.include_usage``)."""
    so = body.get("stream_options")
    if so is None:
        return False
    if not isinstance(so, dict) or not isinstance(so.get("include_usage", False), bool):
        raise RequestError(400, "'stream_options' must be an object like "
                                "{\"include_usage\": true}", "stream_options")
    return bool(so.get("include_usage"))


def usage(n_prompt: int, results) -> dict:
    """OpenAI's usage object for results ``[(text, token ids, finish reason), ...]``."""
    c = sum(len(r[1]) for r in results)
    return {"prompt_tokens": n_prompt, "completion_tokens": c, "total_tokens": n_prompt + c}


def spec_stats(handles) -> List[dict]:
    """The response's ``speculation`` field: each sample's drafts and acceptance."""
    out = []
    for h in handles:
        s = h.stats
        if s is None:
            continue
        out.append({"drafts": s.drafts, "draft_tokens": s.draft_tokens,
                    "accepted_tokens": s.accepted_tokens,
                    "acceptance_length": round(s.acceptance_length, 4)})
    return out


class RequestReader:
    """Reads and checks one server's requests: bodies (size limit, JSON, model name), sampling
    parameters (OpenAI fields, then :func:`pyspec.params.validate_params` through the LLM),
    prompts (tokenized off the event loop, bounded by the context before and after).

    Args:
        llm: the served :class:`pyspec.LLM`.
        state: the server's ``{"config": ServerConfig}`` (replaced on a reload).
        model_name: the name requests must use (or leave out).
        max_body_bytes: larger bodies get a 413 while they arrive.
        body_timeout: seconds a body may take to arrive; slower ones get a 408.
    """

    def __init__(self, llm, state: dict, model_name: str, max_body_bytes: int,
                 body_timeout: float = 30.0):
        if not isinstance(max_body_bytes, int) or max_body_bytes < 1:
            raise ValueError(f"max_body_bytes must be an int >= 1; got {max_body_bytes!r}")
        self.llm = llm
        self.state = state
        self.model_name = model_name
        self.max_body_bytes = max_body_bytes
        self.body_timeout = body_timeout
        self.ctx_limit = context_tokens(llm)
        self.chat_overhead = chat_overhead(llm.tokenizer)

    async def read_json(self, request) -> dict:
        from starlette.requests import ClientDisconnect

        limit = self.max_body_bytes
        too_big = RequestError(413, f"the request body is larger than this server's limit of "
                                    f"{limit} bytes", None, "request_too_large")
        declared = request.headers.get("content-length")
        if declared is not None and declared.isdigit() and int(declared) > limit:
            raise too_big  # refused before any of it is read
        chunks = []

        async def read():
            size = 0
            async for chunk in request.stream():  # chunked bodies have no Content-Length
                size += len(chunk)
                if size > limit:
                    raise too_big
                chunks.append(chunk)

        try:
            await asyncio.wait_for(read(), self.body_timeout)
        except ClientDisconnect:  # gone before its body arrived: nobody reads the answer
            raise RequestError(499, "the client closed the connection") from None
        except asyncio.TimeoutError:
            e = RequestError(408, f"the request body did not arrive within {self.body_timeout:g} "
                                  "s", None, "request_timeout")
            e.headers = {"Connection": "close"}
            raise e from None
        raw = b"".join(chunks)
        if len(raw) > PARSE_INLINE_BYTES:
            body = await asyncio.to_thread(parse_json, raw)
        else:
            body = parse_json(raw)
        if not isinstance(body, dict):
            raise RequestError(400, "the request body must be a JSON object")
        model = body.get("model")
        if model is not None and model != self.model_name:
            raise RequestError(404, f"the model '{model}' does not exist; this server serves "
                                    f"'{self.model_name}'", "model", "model_not_found")
        return body

    def params(self, body: dict, tenant: Optional[str],
               default_max_tokens: int = 16) -> SamplingParams:
        g = get_field
        max_tokens = g(body, "max_tokens", int, default_max_tokens, lambda v: v >= 1,
                       "an integer >= 1")
        if "max_completion_tokens" in body and body["max_completion_tokens"] is not None:
            max_tokens = g(body, "max_completion_tokens", int, default_max_tokens,
                           lambda v: v >= 1, "an integer >= 1")
        temperature = float(g(body, "temperature", (int, float), 1.0,
                              lambda v: 0 <= v <= 100, "a number in [0, 100]"))
        top_p = float(g(body, "top_p", (int, float), 1.0, lambda v: 0 < v <= 1,
                        "a number in (0, 1]"))
        top_k = g(body, "top_k", int, 0, lambda v: v >= 0, "an integer >= 0")
        min_p = float(g(body, "min_p", (int, float), 0.0, lambda v: 0 <= v <= 1,
                        "a number in [0, 1]"))
        n = g(body, "n", int, 1, lambda v: 1 <= v <= 16, "an integer in [1, 16]")
        seed = g(body, "seed", int, None, lambda v: -(1 << 63) <= v < (1 << 63),
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
        for key, default in UNSUPPORTED.items():
            if key in body and body[key] is not None and body[key] != default and not (
                    key == "best_of" and body[key] == n):
                raise RequestError(400, f"'{key}' is not supported by this server (allowed: "
                                        f"leave it out, or {json.dumps(default)})", key)
        # Whether it speculates is decided per prompt when it is submitted (its prompt class).
        p = SamplingParams(max_tokens=max_tokens, temperature=temperature, top_p=top_p,
                           top_k=top_k, min_p=min_p, seed=seed, stop=stop, n=n,
                           ignore_eos=g(body, "ignore_eos", bool, False, None, "true or false"),
                           learn_partition=tenant or None)
        try:
            return self.llm._params(p)  # validates
        except ValueError as e:  # its message starts with the field's name
            key = str(e).split(" ", 1)[0]
            raise RequestError(400, str(e), key if key in body else None) from None

    async def tokenize(self, fn, arg, chars: int, field: str) -> List[int]:
        """``fn(arg)`` off the event loop (a long text takes a while to tokenize and must not
        stall other requests' streams); text too long to fit the context in any tokenization
        is refused without tokenizing it."""
        limit = self.ctx_limit
        if chars > limit * self.llm.tokenizer.max_token_chars:
            what = "prompt has" if field == "prompt" else "messages render to at least"
            raise RequestError(400, f"this model's maximum context length is {limit} "
                                    f"tokens; the {what} {chars} characters, more than "
                                    "that many tokens can hold", field, "context_length_exceeded")
        try:
            return await asyncio.to_thread(fn, arg)
        except ValueError as e:
            raise RequestError(400, str(e), field) from None

    @staticmethod
    def prompt_text(body: dict) -> Optional[str]:
        """A completion request's (first) ``prompt`` when it is text, else None."""
        prompt = body.get("prompt")
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], str):
            prompt = prompt[0]
        return prompt if isinstance(prompt, str) else None

    async def prompts(self, body: dict) -> List[List[int]]:
        """The token ids of a completion request's prompts: ``prompt`` is a string, a list of
        token ids, or a list of either (several prompts; their choices come in prompt order,
        ``n`` each)."""
        prompt = body.get("prompt")
        if isinstance(prompt, list) and prompt and all(isinstance(x, (str, list))
                                                       for x in prompt):
            items = prompt
        else:
            items = [prompt]
        if len(items) > MAX_PROMPTS:
            raise RequestError(400, f"'prompt' holds {len(items)} prompts; at most {MAX_PROMPTS} "
                                    "per request", "prompt")
        out = []
        for x in items:
            if isinstance(x, str):
                if not x:
                    raise RequestError(400, "'prompt' is empty", "prompt")
                out.append(await self.tokenize(self.llm.tokenizer.encode, x, len(x), "prompt"))
            elif isinstance(x, list) and x and all(
                    isinstance(t, int) and not isinstance(t, bool) for t in x):
                out.append(list(x))
            else:
                raise RequestError(400, "'prompt' must be a string, a list of token ids, or a "
                                        "list of strings or of token-id lists", "prompt")
        return out

    def check_samples(self, prompts: int, p: SamplingParams) -> None:
        """A request may not ask for more samples (prompts x n) than the engine runs at once."""
        most = self.llm.engine.max_num_seqs
        if prompts * p.n > most:
            raise RequestError(400, f"the request asks for {prompts * p.n} samples "
                                    f"({prompts} prompts x n={p.n}); this server runs at most "
                                    f"{most} at once (--max-num-seqs)", "n")

    async def chat_prompt(self, body: dict) -> List[int]:
        """The token ids of a chat request's ``messages`` rendered by the chat template."""
        msgs = chat_messages(body.get("messages"))
        limit = self.ctx_limit
        if len(msgs) > limit:  # each renders to a token or more
            raise RequestError(400, f"this model's maximum context length is {limit} "
                                    f"tokens; the request has {len(msgs)} messages",
                               "messages", "context_length_exceeded")
        return await self.tokenize(self.llm.chat_prompt, msgs,
                                   chat_chars(msgs, self.chat_overhead), "messages")

    def check_prompt(self, ids: List[int], p: SamplingParams, field: str = "prompt") -> None:
        vocab, limit = self.llm.engine.vocab_size, self.ctx_limit
        if not ids:
            raise RequestError(400, "the prompt is empty", field)
        if any(not 0 <= t < vocab for t in ids):
            raise RequestError(400, f"prompt token ids must be in [0, {vocab})", field)
        if len(ids) >= limit:  # no room for one token, whatever max_tokens says
            what = "prompt has" if field == "prompt" else "messages render to"
            raise RequestError(400, f"this model's maximum context length is {limit} "
                                    f"tokens; the {what} {len(ids)} tokens, which leaves no "
                                    "room for a completion", field, "context_length_exceeded")
        if len(ids) + p.max_tokens > limit:
            raise RequestError(400, f"this model's maximum context length is {limit} "
                                    f"tokens; the prompt has {len(ids)} and max_tokens is "
                                    f"{p.max_tokens}",
                               "max_tokens", "context_length_exceeded")
