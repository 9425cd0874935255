"""Helpers of the serve tests: the optional packages they need, a uvicorn server on a free port,
reading /metrics, and a request's output from a plain engine of its own."""

import contextlib
import socket
import threading
import time

import pyspec
from helpers import require_module

SERVE_DEPS = ("fastapi", "uvicorn", "openai", "prometheus_client", "httpx")


def require_serve_deps() -> None:
    """At a test module's import: skip it without a package the server needs (under CI, fail)."""
    for name in SERVE_DEPS:
        require_module(name)


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _start(app, **server_kwargs):
    """Serve ``app`` on a free port in a thread: a plain uvicorn server, or with
    ``server_kwargs`` pyspec's own (:func:`pyspec.serve.http.make_server`: header and drain
    deadlines)."""
    import uvicorn

    port = _free_port()
    if server_kwargs:
        from pyspec.serve.http import make_server

        srv = make_server(app, host="127.0.0.1", port=port, **server_kwargs)
    else:
        srv = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port,
                                            log_level="warning"))
    th = threading.Thread(target=srv.run, daemon=True)
    th.start()
    for _ in range(200):
        if srv.started:
            break
        time.sleep(0.05)
    return srv, th, f"http://127.0.0.1:{port}"


@contextlib.contextmanager
def served(app):
    """``app`` served on a free port (:func:`_start`) for the ``with`` block; yields its base
    URL and stops the server after."""
    srv, th, base = _start(app)
    try:
        yield base
    finally:
        srv.should_exit = True
        th.join(timeout=10)


def metric(base, name):
    import httpx

    text = httpx.get(base + "/metrics").text
    for line in text.splitlines():
        if line.startswith(name + " ") or ("{" not in name and line.startswith(name + "{")):
            return float(line.split()[-1])
    raise AssertionError(f"{name} not exported")


def metric_or_zero(base, name):
    try:
        return metric(base, name)
    except AssertionError:
        return 0.0


def alone(llm, prompt, max_tokens, chat=False):
    ref = pyspec.LLM(llm.model_path, draft="none", kv_cache_tokens=2048)
    p = {"max_tokens": max_tokens}
    if chat:
        return ref.chat([{"role": "user", "content": prompt}], p).text
    return ref.generate(prompt, p)[0].text
