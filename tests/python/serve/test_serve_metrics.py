"""pyspec serve's metrics (pyspec.serve.metrics): the /metrics endpoint exports what the Grafana
dashboard and the alert rules in deploy/ query, and the engine's cumulative counters become
Prometheus increments."""

import pytest

from serve_support import require_serve_deps

require_serve_deps()

import json  # noqa: E402

import httpx  # noqa: E402

from serve_support import metric  # noqa: E402


@pytest.fixture(scope="module")
def server(server):
    """The shared server once it has served speculative requests (test_metrics_exported reads the
    draft counter: in a full run the serve tests before this module have sent them; run alone,
    this sends them, half of the requests speculating)."""
    for _ in range(64):
        if metric(server["base"], "pyspec_spec_decode_num_drafts_total") > 0:
            break
        server["client"].completions.create(model="pyspec", prompt="abc abc abc abc",
                                            max_tokens=8, temperature=0)
    return server


def test_metrics_exported(server):
    text = httpx.get(server["base"] + "/metrics").text
    for name in ["pyspec_spec_decode_num_drafts_total", "pyspec_spec_decode_num_draft_tokens_total",
                 "pyspec_spec_decode_num_accepted_tokens_total",
                 "pyspec_spec_decode_acceptance_ewma", "pyspec_num_requests_running",
                 "pyspec_num_requests_waiting", "pyspec_kv_cache_usage_ratio",
                 "pyspec_prefix_cache_hit_ratio", "gen_ai_server_time_to_first_token_seconds",
                 "gen_ai_server_time_per_output_token_seconds",
                 "gen_ai_server_request_duration_seconds", "pyspec_memory_bytes"]:
        assert name in text, name
    assert metric(server["base"], "pyspec_spec_decode_num_drafts_total") > 0
    assert 'pyspec_memory_bytes{component="target_weights"}' in text
    assert "gen_ai_server_time_per_output_token_seconds_bucket{le=\"0.005\"}" in text
    assert "gen_ai.pyspec" not in text and "gen_ai_server_spec" not in text


def test_dashboard_and_alert_rules_use_exported_metrics(server):
    import os
    import re

    import yaml

    root = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "..", "deploy")
    dash = json.load(open(os.path.join(root, "grafana-dashboard.json")))
    rules = yaml.safe_load(open(os.path.join(root, "prometheus-alerts.yaml")))
    exprs = [t["expr"] for p in dash["panels"] for t in p["targets"]]
    exprs += [r["expr"] for g in rules["groups"] for r in g["rules"]]
    assert len(exprs) > 10 and all(r.get("alert") for g in rules["groups"] for r in g["rules"])
    # Every metric the files query is one the server exports (gate metrics included).
    text = httpx.get(server["base"] + "/metrics").text
    exported = set(re.findall(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)", text, re.M))
    for name, kind in re.findall(r"^# TYPE (\S+) (\S+)", text, re.M):  # labelled, no samples yet
        exported |= {name, name + "_total"} if kind == "counter" else {
            name, name + "_bucket", name + "_sum", name + "_count"}
    for e in exprs:
        assert e.count("(") == e.count(")"), e
        for name in re.findall(r"\b((?:pyspec|gen_ai)_[a-z0-9_]+)", e):
            assert name in exported, (name, e)


def test_engine_counters_become_metric_deltas():
    """Metrics.after_step turns the engine's cumulative counters into Prometheus increments."""
    from types import SimpleNamespace

    from pyspec.engine import EngineStats
    from pyspec.serve.metrics import Metrics

    m = Metrics()
    st = EngineStats()
    sched = SimpleNamespace(num_running=1, num_waiting=0, kv_usage_ratio=0.5,
                            prefix_cache_hit_ratio=0.0)
    eng = SimpleNamespace(stats=st, scheduler=sched)
    m.after_step(eng)
    st.budget_probes, st.drafts, st.fallbacks = 2, 5, {"drafter_error": 1}
    m.after_step(eng)
    st.budget_probes, st.calibration_steps = 3, 4
    m.after_step(eng)
    get = m.registry.get_sample_value
    assert get("pyspec_spec_decode_budget_probes_total") == 3
    assert get("pyspec_spec_decode_calibration_steps_total") == 4
    assert get("pyspec_spec_decode_num_drafts_total") == 5
    assert get("pyspec_spec_decode_fallbacks_total", {"reason": "drafter_error"}) == 1
    assert get("pyspec_num_requests_running") == 1


def test_long_prompt_channel_metrics(tmp_path):
    """A server whose long-prompt channel starts at 24 tokens: a long and a short request are
    counted under their channels, with their TPOT and (long: prompt lookup) their drafts."""
    import pyspec
    from models_support import write_tiny_model
    from pyspec.serve.app import create_app
    from pyspec.serve.config import parse_config
    from serve_support import _start

    path = write_tiny_model(tmp_path)
    cfg = parse_config({"speculative": {"long_prompt": {"threshold_tokens": 24,
                                                        "draft_model": "ngram"}}})
    s = cfg.speculative
    llm = pyspec.LLM(path, draft="ngram:2", kv_cache_tokens=512,
                     spec=pyspec.SpecConfig(long_prompt_tokens=s.long_prompt_tokens,
                                            long_prompt_draft=s.long_prompt_draft))
    srv, th, base = _start(create_app(llm, cfg))
    try:
        for ids in ([5, 6, 7, 8] * 10, [9, 10, 11]):
            r = httpx.post(base + "/v1/completions", json={
                "model": "pyspec", "prompt": ids, "max_tokens": 12, "temperature": 0}, timeout=60)
            assert r.status_code == 200, r.text
        text = httpx.get(base + "/metrics").text
        assert metric(base, 'pyspec_channel_requests_total{channel="long"}') == 1
        assert metric(base, 'pyspec_channel_requests_total{channel="short"}') == 1
        assert metric(base, 'pyspec_spec_decode_channel_drafts_total{channel="long"}') > 0
        assert 'pyspec_channel_time_per_output_token_seconds_count{channel="long"} 1.0' in text
    finally:
        srv.should_exit = True
        th.join(timeout=10)


def test_predictor_decisions_metric(tmp_path):
    """A server with an acceptance predictor that predicts too little for every prompt: its
    requests decode plainly and are counted as the predictor's "plain" decisions."""
    import numpy as np

    import pyspec
    from models_support import write_tiny_model
    from pyspec.predictor import FEATURES, AcceptancePredictor
    from pyspec.serve.app import create_app
    from pyspec.serve.config import parse_config
    from serve_support import _start

    k = len(FEATURES)
    a = np.eye(k + 1) * 1e6
    a[k, k] = 1.0
    b = np.zeros(k + 1)
    b[k] = 1.0  # every prediction: 1.0 tokens per speculative step
    path_p = str(tmp_path / "pred.json")
    AcceptancePredictor(np.zeros(k), np.ones(k), a, b, ridge=0.0).save(path_p)
    cfg = parse_config({"speculative": {"predictor": path_p, "predictor_min_acceptance": 1.5}})
    path = write_tiny_model(tmp_path)
    llm = pyspec.LLM(path, draft="ngram", kv_cache_tokens=512,
                     spec=pyspec.SpecConfig(predictor=cfg.speculative.predictor,
                                            predictor_min_acceptance=1.5))
    srv, th, base = _start(create_app(llm, cfg))
    try:
        r = httpx.post(base + "/v1/completions", json={
            "model": "pyspec", "prompt": [5, 6, 7, 5, 6, 7], "max_tokens": 8,
            "temperature": 0}, timeout=60)
        assert r.status_code == 200, r.text
        assert metric(base, 'pyspec_predictor_decisions_total{decision="plain"}') == 1
    finally:
        srv.should_exit = True
        th.join(timeout=10)
