"""pyspec serve's quality gate (pyspec.serve.quality): sampled requests are scored against plain
decoding, and a violation switches speculation off for new requests."""

from serve_support import require_serve_deps

require_serve_deps()

import httpx  # noqa: E402
import torch  # noqa: E402

import pyspec  # noqa: E402
from pyspec.serve.app import create_app  # noqa: E402
from pyspec.serve.options import ServeOptions  # noqa: E402
from pyspec.serve.config import parse_config  # noqa: E402
from serve_support import _start, metric  # noqa: E402


def test_quality_gate_scores_and_rolls_back(server, monkeypatch):
    llm = pyspec.LLM(server["path"], draft="ngram", kv_cache_tokens=4096)
    app = create_app(llm, parse_config({"speculative": {"enabled_ratio": 1.0, "quality_gate": {
        "kl_threshold": 0.05, "rollback_on_violation": True, "sample_ratio": 1.0}}}),
        options=ServeOptions(speculation_stats=True))
    srv, th, base = _start(app)
    try:
        body = {"model": "pyspec", "prompt": "abc abc abc abc", "max_tokens": 24,
                "temperature": 0.8, "seed": 3}
        r = httpx.post(base + "/v1/completions", json=body, timeout=30).json()
        assert r["speculation"][0]["drafts"] > 0
        assert metric(base, "pyspec_quality_gate_checks_total") == 1
        kl = metric(base, "pyspec_quality_gate_kl")
        assert 0 <= kl < 1e-4  # a correct engine: rounding noise only
        assert metric(base, "pyspec_quality_gate_violations_total") == 0
        # Corrupt what the engine served (a broken verification path): the gate must notice
        # and switch speculation off for new requests.
        real = llm.engine.recorded_logits

        def broken(rid):
            x = real(rid)
            return None if x is None else x + 3.0 * torch.randn_like(x)

        monkeypatch.setattr(llm.engine, "recorded_logits", broken)
        httpx.post(base + "/v1/completions", json=body, timeout=30)
        assert metric(base, "pyspec_quality_gate_violations_total") == 1
        assert metric(base, "pyspec_quality_gate_rollbacks_total") == 1
        assert app.state.config["config"].plain_only  # the speculation rollback
        assert metric(base, 'pyspec_rollbacks_total{direction="speculation",'
                            'reason="quality_gate"}') == 1
        after = httpx.post(base + "/v1/completions", json=body, timeout=30).json()
        assert after["speculation"][0]["drafts"] == 0  # plain decoding now
    finally:
        srv.should_exit = True
        th.join(timeout=10)
