"""The long-prompt channel: prompts over the threshold are drafted by the channel's drafter (or
decoded plainly), before the router sees them; every request says its channel; the output stays
plain decoding's."""

import pytest

import pyspec
from pyspec.engine import Engine, Router, SamplingParams
from pyspec.runner import ModelRunner

from drafters_support import MAX_TOKENS, prompts


def _engine(model, **kw):
    runner = ModelRunner(model, num_blocks=64, block_size=8)
    return Engine(runner, adaptive=False, **kw)


def test_long_prompts_take_the_channels_drafter(model, plain):
    eng = _engine(model, drafter="ngram", drafters={"long": "lookahead"},
                  long_prompt=(20, "long"))
    ps = prompts()
    res = eng.generate(ps, SamplingParams(max_tokens=MAX_TOKENS))
    for p, r, ref in zip(ps, res, plain):
        assert r.token_ids == ref
        want = ("long", "long") if len(p) > 20 else ("short", "ngram")
        assert (r.stats.channel, r.stats.drafter) == want, len(p)
    assert {r.stats.channel for r in res} == {"long", "short"}


def test_the_channel_comes_before_the_router_and_may_decode_plainly(model, plain):
    router = Router([(lambda f: True, "other")], default="ngram")
    eng = _engine(model, drafter="ngram", drafters={"other": "ngram:2"}, router=router,
                  long_prompt=(20, None))
    ps = prompts()
    res = eng.generate(ps, SamplingParams(max_tokens=MAX_TOKENS))
    for p, r, ref in zip(ps, res, plain):
        assert r.token_ids == ref
        if len(p) > 20:
            assert r.stats.channel == "long" and r.stats.drafter is None
            assert r.stats.drafts == 0
        else:
            assert r.stats.channel == "short" and r.stats.drafter == "other"


def test_channel_errors(model):
    with pytest.raises(ValueError, match="long-prompt channel names drafter 'nope'"):
        _engine(model, drafter="ngram", long_prompt=(20, "nope"))
    with pytest.raises(ValueError, match="long-prompt threshold must be an int >= 1"):
        _engine(model, drafter="ngram", drafters={"long": "ngram"}, long_prompt=(0, "long"))
    for field, value, match in (("long_prompt_tokens", 0, "long_prompt_tokens must be an int"),
                                ("long_prompt_tokens", 2.5, "long_prompt_tokens must be an int"),
                                ("long_prompt_draft", "", "long_prompt_draft must be a drafter")):
        with pytest.raises(ValueError, match=match):
            pyspec.SpecConfig(**{field: value}).validate()


def test_llm_channel_defaults_and_settings(tmp_path):
    from models_support import write_tiny_model

    path = write_tiny_model(tmp_path)
    long_ids = list(range(3, 40))
    sp = SamplingParams(max_tokens=8)
    llm = pyspec.LLM(path, draft="default", spec=pyspec.SpecConfig(long_prompt_tokens=32),
                     kv_cache_tokens=256)
    assert llm.engine.long_prompt == (32, "long")
    assert llm.engine.drafters["long"].name == "ngram"  # the default long-prompt drafter
    out = llm.generate([long_ids, long_ids[:10]], sp)
    assert [o.stats.channel for o in out] == ["long", "short"]
    assert out[0].stats.drafter == "long"
    off = pyspec.LLM(path, draft="ngram", kv_cache_tokens=256,
                     spec=pyspec.SpecConfig(long_prompt_draft=None))
    assert off.engine.long_prompt is None
    assert off.generate([long_ids], sp)[0].stats.channel == "short"
    plain = pyspec.LLM(path, draft="none", kv_cache_tokens=256,
                       spec=pyspec.SpecConfig(long_prompt_tokens=32))
    r = plain.generate([long_ids], sp)[0]
    assert r.stats.channel == "long" and r.stats.drafter is None  # no speculation at all
    assert r.token_ids == out[0].token_ids
