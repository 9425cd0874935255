"""The alert rules and the dashboard against Prometheus itself: `promtool check rules` and
`promtool test rules` (deploy/prometheus-alerts.test.yaml), and a real Prometheus scraping a
running pyspec server, so that every dashboard query and every series an alert reads returns
data, and every rule evaluates without error."""

import json
import os
import re
import subprocess
import threading
import time

from helpers import require_module, require_program
from serve_support import require_serve_deps

require_serve_deps()
require_module("yaml")

import httpx  # noqa: E402
import yaml  # noqa: E402

DEPLOY = os.path.join(os.path.dirname(__file__), "..", "..", "..", "deploy")
ALERTS = os.path.join(DEPLOY, "prometheus-alerts.yaml")


def _promtool(*args, cwd=None):
    r = subprocess.run([require_program("promtool"), *args], capture_output=True, text=True,
                       cwd=cwd, timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr
    return r.stdout


def test_alert_rules_pass_promtool_check(tmp_path):
    out = _promtool("check", "rules", ALERTS)
    with open(ALERTS) as f:
        n = sum(len(g["rules"]) for g in yaml.safe_load(f)["groups"])
    assert f"SUCCESS: {n} rules found" in out, out
    # The Kubernetes PrometheusRule's groups are checked too (the same rules, another wrapper).
    with open(os.path.join(DEPLOY, "kubernetes", "prometheusrule.yaml")) as f:
        groups = yaml.safe_load(f)["spec"]["groups"]
    (tmp_path / "rule.yaml").write_text(yaml.safe_dump({"groups": groups}))
    assert f"SUCCESS: {n} rules found" in _promtool("check", "rules", str(tmp_path / "rule.yaml"))


def test_alert_rules_unit_tests():
    """Each alert fires on a series built to trip it and stays quiet where it must."""
    _promtool("test", "rules", "prometheus-alerts.test.yaml", cwd=DEPLOY)
    with open(os.path.join(DEPLOY, "prometheus-alerts.test.yaml")) as f:
        tested = {t["alertname"] for case in yaml.safe_load(f)["tests"]
                  for t in case["alert_rule_test"]}
    with open(ALERTS) as f:
        alerts = {r["alert"] for g in yaml.safe_load(f)["groups"] for r in g["rules"]}
    assert tested == alerts, f"alerts without a unit test: {sorted(alerts - tested)}"


def _dashboard_queries():
    with open(os.path.join(DEPLOY, "grafana-dashboard.json")) as f:
        panels = json.load(f)["panels"]
    return [(p["title"], t["expr"]) for p in panels for t in p.get("targets", [])]


# A metric name in a PromQL expression, with its label matchers when it has any.
_SELECTOR = re.compile(r"\b((?:pyspec|gen_ai)_[a-z0-9_]+)(\{[^}]*\})?")


def _alert_selectors():
    with open(ALERTS) as f:
        rules = [r for g in yaml.safe_load(f)["groups"] for r in g["rules"]]
    return sorted({m.group(1) + (m.group(2) or "") for r in rules
                   for m in _SELECTOR.finditer(r["expr"])})


def test_alert_selectors_are_found():
    """The selector scan below sees every alert's series (an alert reading none would pass)."""
    sel = _alert_selectors()
    assert 'pyspec_requests_total{finish_reason="error"}' in sel
    assert "pyspec_engine_healthy" in sel and len(sel) >= 10, sel


def test_prometheus_scrapes_a_running_server(tmp_path):
    """Prometheus (1 s scrapes, the alert rules loaded) scrapes a pyspec server with the quality
    gate on while requests run; then every dashboard query and every series an alert reads
    returns data, and every rule's evaluation is healthy."""
    import pyspec
    from models_support import write_tiny_model
    from pyspec.serve.app import create_app
    from pyspec.serve.config import parse_config
    from serve_support import _free_port, served

    prometheus = require_program("prometheus")
    path = write_tiny_model(tmp_path / "model")
    llm = pyspec.LLM(path, draft="ngram", kv_cache_tokens=4096)
    app = create_app(llm, parse_config({"speculative": {"enabled_ratio": 1.0, "quality_gate": {
        "kl_threshold": 0.05, "sample_ratio": 1.0}}}))
    with served(app) as base:
        for path_ in ("/health", "/ready", "/metrics"):  # what the Deployment's probes ask
            assert httpx.get(base + path_).status_code == 200, path_
        stop = threading.Event()
        errors = []

        def traffic():
            i = 0
            while not stop.is_set():
                i += 1
                body = {"prompt": [5, 6, 7, 8] * 6, "max_tokens": 24, "temperature": 0.8,
                        "seed": i}
                try:
                    r = httpx.post(base + "/v1/completions", json=body, timeout=30)
                    if r.status_code != 200:
                        errors.append(r.text)
                except Exception as e:  # noqa: BLE001
                    errors.append(repr(e))

        th = threading.Thread(target=traffic, daemon=True)
        th.start()
        port = _free_port()
        cfg = tmp_path / "prometheus.yml"
        cfg.write_text(yaml.safe_dump({
            "global": {"scrape_interval": "1s", "evaluation_interval": "1s"},
            "rule_files": [os.path.abspath(ALERTS)],
            "scrape_configs": [{"job_name": "pyspec", "static_configs": [
                {"targets": [base.split("//")[1]]}]}]}))
        log = open(tmp_path / "prometheus.log", "w")
        proc = subprocess.Popen([prometheus, f"--config.file={cfg}",
                                 f"--storage.tsdb.path={tmp_path / 'tsdb'}",
                                 f"--web.listen-address=127.0.0.1:{port}"],
                                stdout=log, stderr=subprocess.STDOUT)
        web = f"http://127.0.0.1:{port}"
        api = web + "/api/v1"

        def query(q):
            r = httpx.get(api + "/query", params={"query": q}, timeout=10).json()
            assert r["status"] == "success", (q, r)
            return r["data"]["result"]

        try:
            deadline = time.monotonic() + 60

            def up():
                try:
                    return httpx.get(web + "/-/ready", timeout=5).status_code == 200
                except httpx.HTTPError:
                    return False

            def scraped():  # six scrapes, and the quality gate has scored a request
                got = query("pyspec_engine_healthy[1m]")
                return got and len(got[0]["values"]) >= 6 and query("pyspec_quality_gate_kl")

            for ready in (up, scraped):
                while not ready():
                    assert proc.poll() is None, (tmp_path / "prometheus.log").read_text()[-2000:]
                    assert time.monotonic() < deadline, f"Prometheus: not {ready.__name__} in 60 s"
                    time.sleep(0.5)
            stop.set()
            th.join(timeout=30)
            assert not errors, errors[:3]
            empty = [(title, q) for title, q in _dashboard_queries() if not query(q)]
            assert not empty, f"dashboard queries without data: {empty}"
            no_series = [s for s in _alert_selectors() if not query(s)]
            assert not no_series, f"series the alerts read, not exported: {no_series}"
            rules = httpx.get(api + "/rules", timeout=10).json()["data"]["groups"]
            states = [(r["name"], r["health"], r.get("lastError", ""))
                      for g in rules for r in g["rules"]]
            assert len(states) == len(_alert_names()), states
            assert all(h == "ok" for _, h, _ in states), states
        finally:
            stop.set()
            proc.terminate()
            try:
                proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
            log.close()


def _alert_names():
    with open(ALERTS) as f:
        return [r["alert"] for g in yaml.safe_load(f)["groups"] for r in g["rules"]]
