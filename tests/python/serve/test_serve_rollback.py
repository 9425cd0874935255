"""pyspec serve's overrides per prompt class and region, and its rollbacks in three directions
(pyspec.serve.config, pyspec.serve.rollback): speculation to plain, the drafter to its previous
version, the adaptive policy to its start; each a metric reason and a trace span."""

import pytest

from serve_support import require_serve_deps

require_serve_deps()

import httpx  # noqa: E402

import pyspec  # noqa: E402
from helpers import require_module  # noqa: E402
from pyspec.serve.config import ConfigError, parse_config  # noqa: E402
from serve_support import metric, served  # noqa: E402


@pytest.mark.parametrize("cfg, key", [
    ({"classes": {"huge": {"speculative": {"enabled_ratio": 0}}}}, "classes.huge"),
    ({"classes": {"long": {"speculative": {"gamma": 2}}}}, "classes.long.speculative.gamma"),
    ({"classes": {"long": {"enabled_ratio": 0}}}, "classes.long"),
    ({"classes": ["long"]}, "classes"),
    ({"regions": {"eu": {"speculative": {"gamma": 0}}}}, "regions.eu.speculative.gamma"),
    ({"regions": {"eu": {"tenants": {}}}}, "regions.eu"),
    ({"rollback": {"drafter": True}}, "rollback.drafter"),
    ({"rollback": {"drafter_below_acceptance": 1.5}}, "rollback.drafter_below_acceptance"),
    ({"speculative": {"previous_draft_model": "ngram"},
      "rollback": {"drafter_below_acceptance": -1}}, "rollback.drafter_below_acceptance"),
    ({"speculative": {"previous_draft_model": "ngram"}, "rollback": {"window": 0}},
     "rollback.window"),
    ({"rollback": {"policy": "yes"}}, "rollback.policy"),
    ({"rollback": {"soon": True}}, "rollback.soon"),
    ({"speculative": {"previous_draft_model": ""}}, "speculative.previous_draft_model"),
])
def test_override_and_rollback_errors_name_the_key(cfg, key):
    with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
        parse_config(cfg)


def test_settings_precedence_region_class_tenant():
    d = {"speculative": {"enabled_ratio": 0.5, "draft_model": "ngram"},
         "regions": {"eu": {"speculative": {"enabled_ratio": 0.25, "draft_model": "lookahead"}},
                     "us": {"speculative": {"gamma": 3}}},
         "classes": {"long": {"speculative": {"enabled_ratio": 0.0}}},
         "tenants": {"vip": {"speculative": {"enabled_ratio": 1.0}}, "quiet": {}}}
    eu = parse_config(d, region="eu")
    assert (eu.region, eu.speculative.draft_model, eu.speculative.gamma) == ("eu", "lookahead",
                                                                            None)
    assert eu.settings_for(None, "short").enabled_ratio == 0.25  # the region's
    assert eu.settings_for(None, "long").enabled_ratio == 0.0  # the class's, over the region's
    assert eu.settings_for("vip", "long").enabled_ratio == 1.0  # the tenant's, over the class's
    assert eu.settings_for("quiet", "long").enabled_ratio == 0.0  # sets nothing: the class's
    assert eu.settings_for("vip", "short").draft_model == "lookahead"
    us = parse_config(d, region="us")
    assert (us.speculative.gamma, us.speculative.enabled_ratio) == (3, 0.5)
    assert parse_config(d, region="asia").speculative.enabled_ratio == 0.5  # no section: base
    assert parse_config(d).speculative.draft_model == "ngram"
    # A region's quality gate section keeps the sampling ratio it inherits.
    g = parse_config({"speculative": {"quality_gate": {"sample_ratio": 0.2}},
                      "regions": {"eu": {"speculative": {"quality_gate": {"kl_threshold": 0.1}}}}},
                     region="eu").speculative.quality_gate
    assert (g.sample_ratio, g.kl_threshold) == (0.2, 0.1)
    ids = [f"r{i}" for i in range(400)]
    assert not any(eu.speculates(i, "quiet", "long") for i in ids)
    assert all(eu.speculates(i, "vip", "long") for i in ids)
    assert 0.15 < sum(eu.speculates(i, None, "short") for i in ids) / len(ids) < 0.35
    eu.plain_only = True  # a speculation rollback overrides every layer
    assert not any(eu.speculates(i, "vip", "short") for i in ids)


def _llm(path, **spec):
    return pyspec.LLM(path, draft="ngram", kv_cache_tokens=4096,
                      spec=pyspec.SpecConfig(long_prompt_tokens=24, long_prompt_draft="ngram",
                                             drafters={"previous": "lookahead"}, **spec))


BODY = {"model": "pyspec", "prompt": "abc abc abc abc abc abc", "max_tokens": 16,
        "temperature": 0}


def _post(base, **kw):
    return httpx.post(base + "/v1/completions", json={**BODY, **kw}, timeout=60).json()


def test_class_overrides_follow_the_prompt_channel(server):
    from pyspec.serve.app import create_app
    from pyspec.serve.options import ServeOptions

    llm = _llm(server["path"])
    cfg = parse_config({"classes": {"long": {"speculative": {"enabled_ratio": 0.0}}}})
    app = create_app(llm, cfg, options=ServeOptions(speculation_stats=True))
    with served(app) as base:
        short = _post(base)
        assert short["speculation"][0]["drafts"] > 0
        long_prompt = "abc " * 40  # past the 24-token threshold: the long class
        assert len(llm.tokenizer.encode(long_prompt)) > 24
        r = _post(base, prompt=long_prompt)
        assert r["speculation"][0]["drafts"] == 0  # the class says plain
        assert metric(base, 'pyspec_channel_requests_total{channel="long"}') == 1


def test_drafter_rollback_from_config_and_back(server, tmp_path):
    from pyspec.serve.app import create_app
    from pyspec.serve.cli import reload_config

    llm = _llm(server["path"])
    d = {"speculative": {"previous_draft_model": "lookahead"}}
    app = create_app(llm, parse_config(d))
    name = 'pyspec_rollbacks_total{direction="drafter",reason="config"}'
    with served(app) as base:
        assert llm.engine.default_drafter == "ngram"
        assert metric(base, 'pyspec_rollback_active{direction="drafter"}') == 0
        p = tmp_path / "c.yaml"
        p.write_text("speculative: {previous_draft_model: lookahead}\nrollback: {drafter: true}\n")
        assert reload_config(app, str(p))
        _post(base)  # (the engine applies it between steps)
        assert llm.engine.default_drafter == "previous"
        assert metric(base, name) == 1
        assert metric(base, 'pyspec_rollback_active{direction="drafter"}') == 1
        p.write_text("speculative: {previous_draft_model: lookahead}\nrollback: {drafter: false}\n")
        assert reload_config(app, str(p))
        _post(base)
        assert llm.engine.default_drafter == "ngram"  # forward again
        assert metric(base, 'pyspec_rollback_active{direction="drafter"}') == 0
        assert metric(base, name) == 1  # going forward is not a rollback


def _auto_rollback_app(llm, window):
    """An app whose drafter rolls back by itself below an acceptance length no drafter reaches
    (64 tokens per step), over ``window`` requests."""
    from pyspec.serve.app import create_app

    return create_app(llm, parse_config({"speculative": {"previous_draft_model": "lookahead"},
                                         "rollback": {"drafter_below_acceptance": 64.0,
                                                      "window": window}}))


def test_drafter_rolls_back_by_itself_on_low_acceptance(server):
    llm = _llm(server["path"])
    with served(_auto_rollback_app(llm, 2)) as base:  # two requests trip it
        _post(base)
        assert llm.engine.default_drafter == "ngram"  # one request: the window is not full
        _post(base, seed=1)
        _post(base, seed=2)  # (the rollback is applied before this one is added)
        assert llm.engine.default_drafter == "previous"
        assert metric(base, 'pyspec_rollbacks_total{direction="drafter",reason="acceptance"}') \
            == 1


def test_rollback_settings_without_a_loaded_previous_drafter_never_fail_requests(server,
                                                                                  tmp_path):
    """A reload may name previous_draft_model (kept at its old value: the engine loads drafters
    once) with an automatic drafter rollback: it is logged and ignored, never a failed request;
    and a reload that leaves rollback.drafter as it was keeps an automatic rollback."""
    from pyspec.serve.app import create_app
    from pyspec.serve.cli import reload_config

    plain = pyspec.LLM(server["path"], draft="ngram", kv_cache_tokens=4096)
    app = create_app(plain, parse_config({}))
    with served(app) as base:
        p = tmp_path / "c.yaml"
        p.write_text("speculative: {previous_draft_model: lookahead}\n"
                     "rollback: {drafter_below_acceptance: 64.0, window: 1}\n")
        assert reload_config(app, str(p))
        for seed in range(3):
            r = _post(base, seed=seed)
            assert r["choices"][0]["finish_reason"] in ("length", "stop")
        assert plain.engine.default_drafter == "ngram"
    llm = _llm(server["path"])
    app = _auto_rollback_app(llm, 1)
    with served(app) as base:
        _post(base)
        _post(base, seed=1)
        assert llm.engine.default_drafter == "previous"  # rolled back by itself
        p = tmp_path / "d.yaml"
        p.write_text("speculative: {previous_draft_model: lookahead, enabled_ratio: 0.9}\n"
                     "rollback: {drafter_below_acceptance: 64.0, window: 1}\n")
        assert reload_config(app, str(p))  # an unrelated change
        _post(base, seed=2)
        assert llm.engine.default_drafter == "previous"  # still rolled back


def test_policy_rollback_resets_the_engine_once_per_config(server, tmp_path, monkeypatch):
    from pyspec.serve.app import create_app
    from pyspec.serve.cli import reload_config

    llm = _llm(server["path"])
    calls = []
    real = llm.engine.reset_policy
    monkeypatch.setattr(llm.engine, "reset_policy", lambda: (calls.append(1), real()))
    app = create_app(llm, parse_config({}))
    with served(app) as base:
        _post(base)
        assert llm.engine.scheduler.deployment_acceptance_ewma is not None  # something learned
        p = tmp_path / "c.yaml"
        p.write_text("rollback: {policy: true}\n")
        assert reload_config(app, str(p))
        _post(base)
        assert calls == [1]
        assert metric(base, 'pyspec_rollbacks_total{direction="policy",reason="config"}') == 1
        assert reload_config(app, str(p))  # still true: no second reset
        _post(base)
        assert calls == [1]


def test_quality_gate_rollback_is_the_speculation_direction_and_a_reload_ends_it(server,
                                                                                tmp_path):
    from pyspec.serve.app import create_app
    from pyspec.serve.cli import reload_config
    from pyspec.serve.options import ServeOptions

    llm = _llm(server["path"])
    app = create_app(llm, parse_config({}), options=ServeOptions(speculation_stats=True))
    with served(app) as base:
        assert app.state.rollbacks.speculation("quality_gate")
        assert not app.state.rollbacks.speculation("quality_gate")  # once
        assert _post(base)["speculation"][0]["drafts"] == 0
        assert metric(base, 'pyspec_rollbacks_total{direction="speculation",'
                            'reason="quality_gate"}') == 1
        assert metric(base, 'pyspec_rollback_active{direction="speculation"}') == 1
        p = tmp_path / "c.yaml"
        p.write_text("speculative: {enabled_ratio: 1.0}\n")
        assert reload_config(app, str(p))
        assert metric(base, 'pyspec_rollback_active{direction="speculation"}') == 0
        assert _post(base)["speculation"][0]["drafts"] > 0


def test_rollbacks_are_trace_spans(server):
    require_module("opentelemetry.sdk")
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    from pyspec.serve.app import create_app

    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    llm = _llm(server["path"])
    app = create_app(llm, parse_config({"speculative": {"previous_draft_model": "lookahead"},
                                        "rollback": {"drafter": True, "policy": True}}),
                     tracer=provider.get_tracer("test"))
    app.state.rollbacks.speculation("quality_gate")
    spans = [s for s in exporter.get_finished_spans() if s.name == "pyspec.rollback"]
    got = sorted((s.attributes["pyspec.rollback.direction"], s.attributes["pyspec.rollback.reason"])
                 for s in spans)
    assert got == [("drafter", "config"), ("policy", "config"), ("speculation", "quality_gate")]


def test_engine_default_drafter_and_policy_reset(server, tmp_path):
    from pyspec.predictor import FEATURES, AcceptancePredictor

    k = len(FEATURES)
    fitted = AcceptancePredictor.fit([[float(i + j) for j in range(k)] for i in range(4)],
                                     [5.0, 5.0, 5.0, 5.01])  # (~5 everywhere)
    fitted.save(str(tmp_path / "p.json"))
    # (min acceptance 1.0: the predictor never makes a request plain, and learns from each;
    # adaptive off: how often a request drafts must not hang on the cost model's timings)
    llm = _llm(server["path"], predictor=str(tmp_path / "p.json"), predictor_min_acceptance=1.0,
               adaptive=False)
    eng = llm.engine
    assert eng.channel_of(24) == "short" and eng.channel_of(25) == "long"
    with pytest.raises(ValueError, match="no drafter named 'nope'"):
        eng.set_default_drafter("nope")
    eng.set_default_drafter("previous")
    rid = eng.add_request([5, 6, 7, 5, 6, 7, 5, 6], pyspec.SamplingParams(max_tokens=12))
    assert eng._reqs[rid].stats.drafter == "previous"
    # (the predictor was fitted for the start's drafter: it does not judge another's requests)
    assert eng._reqs[rid].stats.predicted_acceptance is None
    eng.set_default_drafter("ngram")
    rid2 = eng.add_request([5, 6, 7, 5, 6, 7, 5, 6] * 3, pyspec.SamplingParams(max_tokens=40))
    assert eng._reqs[rid2].stats.drafter == "ngram"
    assert eng._reqs[rid2].stats.predicted_acceptance is not None
    eng.set_default_drafter(None)  # plain decoding
    rid3 = eng.add_request([5, 6, 7], pyspec.SamplingParams(max_tokens=4))
    assert eng._reqs[rid3].stats.drafter is None
    while eng.has_unfinished():
        eng.step()
    assert eng.scheduler.deployment_acceptance_ewma is not None
    assert eng._reqs[rid2].stats.drafts >= 4  # enough drafted steps to learn from (see the engine)
    assert not (eng.predictor.a == fitted.a).all()  # it learned online
    eng.reset_policy()
    assert eng.scheduler.deployment_acceptance_ewma is None
    assert (eng.predictor.a == fitted.a).all() and (eng.predictor.b == fitted.b).all()
