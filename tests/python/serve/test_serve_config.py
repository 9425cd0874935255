"""pyspec serve's configuration (pyspec.serve.config): errors that name the key, the shape of a
config and its deterministic speculation ratio, and reloading it on SIGHUP (pyspec.serve.cli's
reload_config) on a running server."""

import pytest

from serve_support import require_serve_deps

require_serve_deps()

import logging  # noqa: E402

from pyspec.serve.config import ConfigError, parse_config  # noqa: E402


@pytest.mark.parametrize("cfg, key", [
    ({"speculative": {"enabled_ratio": 2}}, "speculative.enabled_ratio"),
    ({"speculative": {"gamma": 0}}, "speculative.gamma"),
    ({"speculative": {"bogus": 1}}, "speculative.bogus"),
    ({"speculative": {"quality_gate": {"kl_threshold": "x"}}}, "quality_gate.kl_threshold"),
    ({"speculative": {"quality_gate": {"nope": 1}}}, "quality_gate.nope"),
    ({"tenants": {"a": {"speculative": {"gamma": 3}}}}, "tenants.a.speculative.gamma"),
    ({"other": 1}, "other"),
    ({"speculative": {"long_prompt": {"threshold_tokens": 0}}},
     "speculative.long_prompt.threshold_tokens"),
    ({"speculative": {"long_prompt": {"draft_model": ""}}}, "speculative.long_prompt.draft_model"),
    ({"speculative": {"long_prompt": {"drafter": "ngram"}}}, "speculative.long_prompt.drafter"),
    ({"speculative": {"long_prompt": 5}}, "speculative.long_prompt"),
    ({"speculative": {"predictor": 3}}, "speculative.predictor"),
    ({"speculative": {"predictor_min_acceptance": 0.5}}, "speculative.predictor_min_acceptance"),
    ({"tenants": {"a": {"speculative": {"long_prompt": None}}}},
     "tenants.a.speculative.long_prompt"),
])
def test_config_errors_name_the_key(cfg, key):
    with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
        parse_config(cfg)


def test_long_prompt_channel_config():
    s = parse_config({"speculative": {"long_prompt": {"threshold_tokens": 2048,
                                                      "draft_model": "lookahead"}}}).speculative
    assert (s.long_prompt_tokens, s.long_prompt_draft) == (2048, "lookahead")
    s = parse_config({"speculative": {"long_prompt": None}}).speculative
    assert s.long_prompt_draft is None  # no channel
    s = parse_config({}).speculative
    assert (s.long_prompt_tokens, s.long_prompt_draft) == (4096, "ngram")
    assert (s.predictor, s.predictor_min_acceptance) == (None, 1.2)
    s = parse_config({"speculative": {"predictor": "p.json",
                                      "predictor_min_acceptance": 1.4}}).speculative
    assert (s.predictor, s.predictor_min_acceptance) == ("p.json", 1.4)


def test_config_shape_and_ratio_is_deterministic():
    cfg = parse_config({"speculative": {
        "enabled_ratio": 0.1, "draft_model": "ngram", "target_model": "default", "gamma": 5,
        "tree_width": 3, "adaptive": True, "fallback_on_alpha_below": 0.3,
        "quality_gate": {"kl_threshold": 0.05, "rollback_on_violation": True}},
        "tenants": {"batch": {"speculative": {"enabled_ratio": 0.0}}}})
    s = cfg.speculative
    assert s.gamma == 5 and s.tree_width == 3 and s.quality_gate.kl_threshold == 0.05
    assert s.quality_gate.sample_ratio == 0.05  # the section is there: the gate samples
    assert parse_config({"speculative": {"gamma": 2}}).speculative.quality_gate.sample_ratio == 0
    ids = [f"req-{i}" for i in range(4000)]
    share = sum(s.speculates(i) for i in ids) / len(ids)
    assert 0.08 < share < 0.12
    # Deterministic by request id: a fresh config in another process (another hash seed) gives
    # every id the same answer.
    import json
    import os
    import subprocess
    import sys
    import tempfile

    code = ("import json, sys; from pyspec.serve.config import parse_config; "
            "s = parse_config({'speculative': {'enabled_ratio': 0.1}}).speculative; "
            "print(json.dumps([s.speculates(f'req-{i}') for i in range(400)]))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         env={**os.environ, "PYTHONHASHSEED": "12345"}, timeout=120,
                         cwd=tempfile.gettempdir())  # the installed package, not the checkout
    assert json.loads(out.stdout) == [s.speculates(i) for i in ids[:400]]
    assert not any(cfg.for_tenant("batch").speculates(i) for i in ids[:100])
    assert cfg.for_tenant("unknown") is s


def test_sighup_reload_applies_new_config(server, tmp_path):
    from pyspec.serve.cli import reload_config

    app = server["app"]
    old = app.state.config["config"]
    p = tmp_path / "c.yaml"
    p.write_text("speculative:\n  enabled_ratio: 0.0\n")
    assert reload_config(app, str(p))
    assert app.state.config["config"].speculative.enabled_ratio == 0.0
    p.write_text("speculative:\n  enabled_ratio: 7\n")
    assert not reload_config(app, str(p))  # invalid: the old config stays
    assert app.state.config["config"].speculative.enabled_ratio == 0.0
    app.state.config["config"] = old


def test_sighup_reload_keeps_engine_keys_and_says_so(server, tmp_path, caplog):
    from pyspec.serve.cli import reload_config

    app = server["app"]
    old = app.state.config["config"]
    p = tmp_path / "c.yaml"
    p.write_text("speculative:\n  enabled_ratio: 0.25\n  gamma: 2\n  adaptive: false\n")
    with caplog.at_level(logging.ERROR, logger="pyspec.serve"):
        assert reload_config(app, str(p))
    new = app.state.config["config"].speculative
    try:
        assert new.enabled_ratio == 0.25  # applied
        assert (new.gamma, new.adaptive) == (old.speculative.gamma, old.speculative.adaptive)
        assert "speculative.gamma, speculative.adaptive need a restart" in caplog.text
    finally:
        app.state.config["config"] = old
