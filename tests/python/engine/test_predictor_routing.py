"""The acceptance predictor in the engine: requests it predicts below the floor decode plainly
(one in 8 speculates anyway), the rest speculate, outputs stay plain decoding's, and finished
speculative requests update it."""

import numpy as np
import pytest

import pyspec
from pyspec.engine import Engine, SamplingParams
from pyspec.engine.engine import EXPLORE_EVERY
from pyspec.predictor import FEATURES, AcceptancePredictor
from pyspec.runner import ModelRunner

from drafters_support import MAX_TOKENS, prompts


def _constant(value):
    """A predictor that predicts ``value`` for every prompt."""
    k = len(FEATURES)
    a = np.eye(k + 1) * 1e6
    a[k, k] = 1.0
    b = np.zeros(k + 1)
    b[k] = value
    return AcceptancePredictor(np.zeros(k), np.ones(k), a, b, ridge=0.0)


def _run(model, predictor, ps):
    runner = ModelRunner(model, num_blocks=64, block_size=8)
    eng = Engine(runner, drafter="ngram", adaptive=False, predictor=predictor,
                 predictor_min_acceptance=1.5)
    return eng, eng.generate(ps, SamplingParams(max_tokens=MAX_TOKENS))


def test_low_predictions_decode_plainly_and_high_ones_speculate(model, plain):
    ps = (prompts() * 2)[:EXPLORE_EVERY + 1]
    _, res = _run(model, _constant(1.0), ps)
    assert [r.token_ids for r in res] == [plain[i % len(plain)] for i in range(len(ps))]
    assert all(r.stats.predicted_acceptance == pytest.approx(1.0) for r in res)
    plain_ones = [r.stats.predictor_plain for r in res]
    # Every EXPLORE_EVERY-th request it would make plain speculates anyway.
    assert plain_ones.count(False) == 1 and not plain_ones[EXPLORE_EVERY - 1]
    assert all(r.stats.drafts == 0 for r, p in zip(res, plain_ones) if p)
    pred = _constant(3.0)
    before = pred.b.copy()
    eng, res = _run(model, pred, prompts())
    assert [r.token_ids for r in res] == plain
    assert not any(r.stats.predictor_plain for r in res)
    assert sum(r.stats.drafts for r in res) > 0
    assert not np.array_equal(before, pred.b)  # finished speculative requests taught it


def test_predictor_settings_and_errors(tmp_path, model):
    runner = ModelRunner(model, num_blocks=8, block_size=8)
    with pytest.raises(ValueError, match="predictor must be a pyspec.predictor"):
        Engine(runner, drafter="ngram", predictor="x")
    with pytest.raises(ValueError, match="predictor_min_acceptance must be a number in"):
        Engine(runner, drafter="ngram", predictor=_constant(2.0), predictor_min_acceptance=0.5)
    for kw, match in (({"predictor": 3}, "predictor must be None"),
                      ({"predictor_min_acceptance": 100}, "predictor_min_acceptance")):
        with pytest.raises(ValueError, match=match):
            pyspec.SpecConfig(**kw).validate()
    from models_support import write_tiny_model

    path = write_tiny_model(tmp_path)
    with pytest.raises(ValueError, match="not a readable predictor file"):
        pyspec.LLM(path, draft="ngram", spec=pyspec.SpecConfig(predictor=str(tmp_path / "no")))
    saved = str(tmp_path / "p.json")
    _constant(1.0).save(saved)
    llm = pyspec.LLM(path, draft="ngram", kv_cache_tokens=256,
                     spec=pyspec.SpecConfig(predictor=saved, predictor_min_acceptance=1.5))
    out = llm.generate([[3, 4, 5, 3, 4, 5]], SamplingParams(max_tokens=8))[0]
    assert out.stats.predictor_plain and out.stats.drafts == 0
