"""OpenTelemetry traces for served requests: one span per request, with child spans for each
prefill chunk, each draft and verify phase, and the acceptance decision (draft length, tree size,
accepted count). Exported over OTLP/HTTP when an endpoint is configured (``--otlp-endpoint`` or
``OTEL_EXPORTER_OTLP_TRACES_ENDPOINT`` / ``OTEL_EXPORTER_OTLP_ENDPOINT``); otherwise tracing is off
and costs nothing (the engine builds no step records).
"""

from __future__ import annotations

import os
import time
from typing import Optional


def tracer_from_env(endpoint: Optional[str] = None):
    """A tracer exporting to the configured OTLP endpoint, or None when none is configured."""
    endpoint = endpoint or os.environ.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT") or \
        os.environ.get("OTEL_EXPORTER_OTLP_ENDPOINT")
    if not endpoint:
        return None
    try:
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor
    except ImportError as e:
        raise ImportError("an OTLP endpoint is configured but the OpenTelemetry SDK is missing: "
                          "pip install opentelemetry-sdk opentelemetry-exporter-otlp-proto-http"
                          ) from e
    if not endpoint.rstrip("/").endswith("/v1/traces"):
        endpoint = endpoint.rstrip("/") + "/v1/traces"
    provider = TracerProvider(resource=Resource.create({"service.name": "pyspec"}))
    provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter(endpoint=endpoint)))
    return provider.get_tracer("pyspec.serve")


class RequestTracer:
    """Maps the engine's step records onto per-request spans (runs in the engine thread)."""

    def __init__(self, tracer):
        self.tracer = tracer
        # perf_counter seconds -> epoch nanoseconds
        self._offset = time.time_ns() - int(time.perf_counter() * 1e9)

    def ns(self, t: float) -> int:
        return self._offset + int(t * 1e9)

    def start(self, h, attrs: dict) -> None:
        h.span = self.tracer.start_span("pyspec.request", start_time=self.ns(h.track.t0),
                                        attributes=attrs)

    def event(self, name: str, attrs: dict) -> None:
        """A deployment event (a rollback): a span of its own, of no duration."""
        self.tracer.start_span(name, attributes=attrs).end()

    def _child(self, h, name, t0, t1, attrs=None):
        from opentelemetry import trace

        ctx = trace.set_span_in_context(h.span)
        s = self.tracer.start_span(name, context=ctx, start_time=self.ns(t0),
                                   attributes=attrs or {})
        s.end(end_time=self.ns(t1))

    def step(self, st, live) -> None:
        # A profiled step (Engine.profile): every span of it names the Chrome trace and the step.
        prof = {} if st.profile is None else {"pyspec.profile.file": st.profile[0],
                                              "pyspec.profile.step": st.profile[1]}
        for rid, n in st.prefill.items():
            h = live.get(rid)
            if h is not None and getattr(h, "span", None) is not None:
                self._child(h, "pyspec.prefill", st.verify[0], st.verify[1],
                            {"pyspec.prefill.tokens": n, **prof})
        for name, t0, t1, rids in st.drafts:
            for rid in rids:
                h = live.get(rid)
                if h is not None and getattr(h, "span", None) is not None:
                    self._child(h, "pyspec.draft", t0, t1, {"pyspec.drafter": name,
                                                             "pyspec.batch_requests": len(rids),
                                                             **prof})
        for rid, (nodes, depth, acc, emitted) in st.decisions.items():
            h = live.get(rid)
            if h is None or getattr(h, "span", None) is None:
                continue
            self._child(h, "pyspec.verify", st.verify[0], st.verify[1],
                        {"pyspec.tree_size": nodes + 1, **prof})
            self._child(h, "pyspec.accept", st.verify[1], st.end,
                        {"pyspec.draft_length": depth, "pyspec.tree_size": nodes + 1,
                         "pyspec.accepted": acc, "pyspec.emitted": emitted, **prof})

    def finish(self, h, reason, n_tokens) -> None:
        s = getattr(h, "span", None)
        if s is None:
            return
        s.set_attribute("pyspec.finish_reason", reason or "unknown")
        s.set_attribute("pyspec.completion_tokens", n_tokens)
        if h.stats is not None:
            s.set_attribute("pyspec.channel", h.stats.channel)
            if h.stats.predicted_acceptance is not None:
                s.set_attribute("pyspec.predicted_acceptance", h.stats.predicted_acceptance)
                s.set_attribute("pyspec.predictor_plain", h.stats.predictor_plain)
            s.set_attribute("pyspec.drafts", h.stats.drafts)
            s.set_attribute("pyspec.accepted_tokens", h.stats.accepted_tokens)
            s.set_attribute("pyspec.acceptance_length", float(h.stats.acceptance_length))
        s.end()
        h.span = None
