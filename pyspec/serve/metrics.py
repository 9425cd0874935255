"""Prometheus metrics of one server (its own registry: two servers in a process do not mix).

Speculative statistics live under ``pyspec_`` (OpenTelemetry owns ``gen_ai.`` and defines none);
request latencies use the OpenTelemetry GenAI server metric names.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from pyspec._C import BUDGET_PROBE_FIRST, BUDGET_PROBE_MAX, CALIBRATION_STEPS

# Fine enough for sub-10 ms tokens, up to minutes for whole requests.
TOKEN_BUCKETS = (0.001, 0.0025, 0.005, 0.0075, 0.01, 0.015, 0.02, 0.03, 0.04, 0.05, 0.075, 0.1,
                 0.15, 0.2, 0.3, 0.5, 0.75, 1.0, 2.5)
REQUEST_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0, 160.0,
                   320.0)

# The label values a counter can take, exported at 0 from the start: a series that appears only
# with its first event leaves alert and dashboard queries ({finish_reason="error"}, the refusals)
# without data until then, and rate() misses that first event.
FINISH_REASONS = ("stop", "length", "abort", "error")
FALLBACK_REASONS = ("low_acceptance", "cost_model", "drafter_error")
SWITCH_REASONS = ("low_acceptance", "cost_model")
REJECT_REASONS = ("queue_full", "tenant_concurrency", "tenant_rate", "unauthorized", "origin",
                  "host", "unavailable", "timeout", "queue_timeout", "shutdown")
CHANNELS = ("short", "long")


class Metrics:
    def __init__(self):
        r = self.registry = CollectorRegistry()
        p = "pyspec_spec_decode_"
        self.drafts = Counter(p + "num_drafts", "Speculative steps that verified draft tokens",
                              registry=r)
        self.draft_tokens = Counter(p + "num_draft_tokens", "Draft tokens verified", registry=r)
        self.accepted = Counter(p + "num_accepted_tokens", "Draft tokens accepted", registry=r)
        self.accepted_pos = Counter(p + "num_accepted_tokens_per_pos",
                                    "Speculative steps whose accepted path reached this draft "
                                    "position (1-based)", ["position"], registry=r)
        self.fallbacks = Counter(p + "fallbacks", "Requests moved to plain decoding", ["reason"],
                                 registry=r)
        self.switches = Counter(p + "drafter_switches", "Requests moved to another drafter",
                                ["reason"], registry=r)
        self.budget_probes = Counter(p + "budget_probes",
                                     "Times the memory-bound draft budget was lifted after it had "
                                     f"stopped every draft for {BUDGET_PROBE_FIRST}-"
                                     f"{BUDGET_PROBE_MAX} steps (to re-measure)", registry=r)
        self.calibration_steps = Counter(p + "calibration_steps",
                                         "Decode steps run without drafts after "
                                         f"{CALIBRATION_STEPS} steps in a row that all drafted "
                                         "(to measure a plain step)", registry=r)
        self.acceptance_ewma = Gauge(p + "acceptance_ewma",
                                     "Deployment-wide EWMA of accepted / drafted per step",
                                     registry=r)
        self.running = Gauge("pyspec_num_requests_running", "Requests holding KV", registry=r)
        self.waiting = Gauge("pyspec_num_requests_waiting", "Requests queued", registry=r)
        self.kv_usage = Gauge("pyspec_kv_cache_usage_ratio", "Share of KV blocks in use",
                              registry=r)
        self.prefix_hit = Gauge("pyspec_prefix_cache_hit_ratio",
                                "Prompt tokens served from the prefix cache / looked up",
                                registry=r)
        self.memory = Gauge("pyspec_memory_bytes", "Memory held, by component", ["component"],
                            registry=r)
        self.memory_limit = Gauge("pyspec_memory_limit_bytes",
                                  "Memory available to the process (cgroup limit or RAM)",
                                  registry=r)
        self.memory_limit.set(memory_limit())
        self.ttft = Histogram("gen_ai_server_time_to_first_token_seconds",
                              "Time from request arrival to its first output token",
                              buckets=REQUEST_BUCKETS, registry=r)
        self.tpot = Histogram("gen_ai_server_time_per_output_token_seconds",
                              "Decode time per output token after the first",
                              buckets=TOKEN_BUCKETS, registry=r)
        self.duration = Histogram("gen_ai_server_request_duration_seconds",
                                  "Time from request arrival to its last token",
                                  buckets=REQUEST_BUCKETS, registry=r)
        self.draft_latency = Histogram("pyspec_spec_decode_draft_seconds",
                                       "Drafting time per engine step", buckets=TOKEN_BUCKETS,
                                       registry=r)
        self.verify_latency = Histogram("pyspec_spec_decode_verify_seconds",
                                        "Target (verification) forward time per engine step",
                                        buckets=TOKEN_BUCKETS, registry=r)
        self.requests = Counter("pyspec_requests", "Finished requests by finish reason",
                                ["finish_reason"], registry=r)
        # The long-prompt channel ("long": prompts past the threshold; "short": the rest).
        self.channel_requests = Counter("pyspec_channel_requests",
                                        "Finished requests by prompt channel", ["channel"],
                                        registry=r)
        self.channel_drafts = Counter(p + "channel_drafts",
                                      "Speculative steps of finished requests, by prompt channel",
                                      ["channel"], registry=r)
        self.channel_accepted = Counter(p + "channel_accepted_tokens",
                                        "Draft tokens accepted in finished requests, by prompt "
                                        "channel", ["channel"], registry=r)
        self.predictor_decisions = Counter("pyspec_predictor_decisions",
                                           "Finished requests the acceptance predictor sent to "
                                           "plain decoding or let speculate", ["decision"],
                                           registry=r)
        self.channel_tpot = Histogram("pyspec_channel_time_per_output_token_seconds",
                                      "Decode time per output token after the first, by prompt "
                                      "channel", ["channel"], buckets=TOKEN_BUCKETS, registry=r)
        self.rejected = Counter("pyspec_requests_rejected",
                                "Requests refused before reaching the engine, by reason (queue_full, "
                                "tenant_concurrency, tenant_rate, unauthorized, origin, host, "
                                "unavailable) or ended by a deadline (timeout, queue_timeout, "
                                "shutdown)", ["reason"], registry=r)
        self.engine_healthy = Gauge("pyspec_engine_healthy",
                                    "1 while the engine thread serves, 0 after it failed",
                                    registry=r)
        self.engine_failures = Counter("pyspec_engine_failures",
                                       "Engine failures (the thread's loop ended by an error)",
                                       registry=r)
        self.engine_restarts = Counter("pyspec_engine_restarts",
                                       "Engine restarts after a failure", registry=r)
        for counter, label, values in (
                (self.requests, "finish_reason", FINISH_REASONS),
                (self.fallbacks, "reason", FALLBACK_REASONS),
                (self.switches, "reason", SWITCH_REASONS),
                (self.rejected, "reason", REJECT_REASONS),
                (self.channel_requests, "channel", CHANNELS),
                (self.channel_drafts, "channel", CHANNELS),
                (self.channel_accepted, "channel", CHANNELS),
                # every drafter drafts a first position: the per-position panel has data before
                # the first accepted token
                (self.accepted_pos, "position", ("1",))):
            for v in values:
                counter.labels(**{label: v})
        self._last = None

    def after_step(self, engine) -> None:
        """Counter deltas from the engine's cumulative stats, gauges from the scheduler."""
        st = engine.stats
        cur = (st.drafts, st.draft_tokens, st.accepted_tokens, list(st.accepted_per_position),
               dict(st.switches), dict(st.fallbacks), st.draft_seconds, st.verify_seconds,
               st.budget_probes, st.calibration_steps)
        last = self._last or (0, 0, 0, [], {}, {}, 0.0, 0.0, 0, 0)
        self.drafts.inc(cur[0] - last[0])
        self.draft_tokens.inc(cur[1] - last[1])
        self.accepted.inc(cur[2] - last[2])
        for i, c in enumerate(cur[3]):
            prev = last[3][i] if i < len(last[3]) else 0
            if c > prev:
                self.accepted_pos.labels(position=str(i + 1)).inc(c - prev)
        for k, v in cur[4].items():
            if v > last[4].get(k, 0):
                self.switches.labels(reason=k).inc(v - last[4].get(k, 0))
        for k, v in cur[5].items():
            if v > last[5].get(k, 0):
                self.fallbacks.labels(reason=k).inc(v - last[5].get(k, 0))
        if cur[6] > last[6]:
            self.draft_latency.observe(cur[6] - last[6])
        if cur[7] > last[7]:
            self.verify_latency.observe(cur[7] - last[7])
        if cur[8] > last[8]:
            self.budget_probes.inc(cur[8] - last[8])
        if cur[9] > last[9]:
            self.calibration_steps.inc(cur[9] - last[9])
        self._last = cur
        if st.acceptance_ewma is not None:
            self.acceptance_ewma.set(st.acceptance_ewma)
        s = engine.scheduler
        self.running.set(s.num_running)
        self.waiting.set(s.num_waiting)
        self.kv_usage.set(s.kv_usage_ratio)
        self.prefix_hit.set(s.prefix_cache_hit_ratio)

    def request_finished(self, stats, reason, ttft, duration, n_tokens) -> None:
        """Per-request observations (the scheduler's fallbacks are known once it finished)."""
        self.requests.labels(finish_reason=reason or "unknown").inc()
        for k in ("low_acceptance", "cost_model"):
            n = stats.fallbacks.get(k, 0) if stats is not None else 0
            if n:
                self.fallbacks.labels(reason=k).inc(n)
        channel = getattr(stats, "channel", None) or "short"
        if stats is not None and stats.predicted_acceptance is not None:
            self.predictor_decisions.labels(
                decision="plain" if stats.predictor_plain else "speculate").inc()
        self.channel_requests.labels(channel=channel).inc()
        if stats is not None and stats.drafts:
            self.channel_drafts.labels(channel=channel).inc(stats.drafts)
            self.channel_accepted.labels(channel=channel).inc(stats.accepted_tokens)
        if ttft is not None:
            self.ttft.observe(ttft)
            if n_tokens > 1:
                self.tpot.observe((duration - ttft) / (n_tokens - 1))
                self.channel_tpot.labels(channel=channel).observe(
                    (duration - ttft) / (n_tokens - 1))
        self.duration.observe(duration)


def memory_limit() -> int:
    """The cgroup (v2 or v1) memory limit when one is set, else physical RAM."""
    import os

    for path in ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory/memory.limit_in_bytes"):
        try:
            with open(path) as f:
                v = f.read().strip()
            if v.isdigit() and int(v) < (1 << 60):
                return int(v)
        except OSError:
            pass
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError):
        return 0


def model_tensors(model):
    """The tensors a loaded model holds (embedding, head, final norm, every layer's), each once.
    Codes-only matrices (packed_weights="codes", a tied table held as codes) count through the
    model's packed_bytes."""
    import torch

    seen = set()
    # (The held tensors themselves: a table held only as codes is not rebuilt to be counted.)
    tables = [getattr(model, "_embed", None), getattr(model, "_lm_head", None)] \
        if hasattr(model, "_embed") else [model.embed, model.lm_head]
    for t in tables + [model.norm] + [v for layer in model.layers for v in layer.values()]:
        if isinstance(t, torch.Tensor) and id(t) not in seen:
            seen.add(id(t))
            yield t


def kv_bytes(engine) -> int:
    """K and V pages of an engine's target pool and of its drafters' own pools (an EAGLE
    head's, a draft model's)."""
    return sum(2 * p.k.numel() * p.k.element_size()
               for p in [engine.runner.kv] + engine.drafting.pools)


def draft_bytes(engine) -> int:
    """Bytes of weights the drafters hold beyond the target's own tensors: a draft model's
    weights (unless it shares the target's), head weights, and the host copies of the target's
    embedding / norm / lm_head that heads keep when the target is on a GPU (on a CPU target those
    are the target's tensors and count once, as target weights). Each tensor counts once."""
    import torch

    seen = {id(t) for t in model_tensors(engine.runner.model)}
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
            for t in model_tensors(m):
                add(t)
            # A draft model's packed codes.
            for p in (m._packed_weights() if hasattr(m, "_packed_weights") else []):
                for t in (p.q, p.d, p.m):
                    add(t)
        head = getattr(d, "head", None)
        if head is not None:
            for t in model_tensors(head):
                add(t)
        for name in ("fc_w", "fc_b", "fuse_w", "embed_w", "norm_w", "lm_head", "w", "b",
                     "head_lm"):
            v = getattr(d, name, None)
            for t in (v if isinstance(v, (list, tuple)) else [v]):
                add(t)
    return total


def set_memory_gauges(metrics: Metrics, llm, shadow=None) -> None:
    """The memory gauges of a server of ``llm`` (and its shadow engine)."""
    metrics.memory.labels(component="target_weights").set(
        sum(t.numel() * t.element_size() for t in model_tensors(llm.model))
        + llm.model.packed_bytes)
    metrics.memory.labels(component="kv_pool").set(kv_bytes(llm.engine))
    metrics.memory.labels(component="draft_weights").set(draft_bytes(llm.engine))
    if shadow is not None:
        metrics.memory.labels(component="shadow_kv_pool").set(kv_bytes(shadow.engine))
        metrics.memory.labels(component="shadow_draft_weights").set(draft_bytes(shadow.engine))
