"""pyspec serve's tracing (pyspec.serve.tracing): a request's span with its prefill, draft,
verify and accept spans."""

from serve_support import require_serve_deps

require_serve_deps()

import httpx  # noqa: E402

import pyspec  # noqa: E402
from helpers import require_module  # noqa: E402
from pyspec.serve.app import create_app  # noqa: E402
from serve_support import _start  # noqa: E402


def test_traces_have_request_draft_verify_accept_spans(server):
    require_module("opentelemetry.sdk")
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    from pyspec.serve.tracing import tracer_from_env

    assert tracer_from_env(None) is None or "OTEL_EXPORTER_OTLP_ENDPOINT" in __import__("os").environ
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    llm = pyspec.LLM(server["path"], draft="ngram", kv_cache_tokens=4096)
    app = create_app(llm, tracer=provider.get_tracer("test"))
    srv, th, base = _start(app)
    try:
        r = httpx.post(base + "/v1/completions", json={"prompt": "abc abc abc abc",
                                                         "max_tokens": 12, "temperature": 0},
                       timeout=30).json()
        assert r["choices"][0]["finish_reason"] in ("length", "stop")
    finally:
        srv.should_exit = True
        th.join(timeout=10)
    spans = exporter.get_finished_spans()
    roots = [s for s in spans if s.name == "pyspec.request"]
    assert len(roots) == 1
    root = roots[0]
    kids = [s for s in spans if s.parent is not None and s.parent.span_id == root.context.span_id]
    names = {s.name for s in kids}
    assert {"pyspec.prefill", "pyspec.verify", "pyspec.accept", "pyspec.draft"} <= names, names
    acc = [s for s in kids if s.name == "pyspec.accept"]
    assert sum(s.attributes["pyspec.emitted"] for s in acc) >= root.attributes[
        "pyspec.completion_tokens"]
    assert all(s.start_time >= root.start_time and s.end_time <= root.end_time for s in kids)
    assert root.attributes["pyspec.finish_reason"] in ("length", "stop")
    assert root.attributes["pyspec.channel"] == "short"  # a short prompt (the long-prompt channel)
