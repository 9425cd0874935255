"""The acceptance predictor (pyspec.predictor): its features, its fit, its file and errors."""

import json
import math

import numpy as np
import pytest

from pyspec import _C
from pyspec.predictor import FEATURES, AcceptancePredictor, prompt_features, spearman


def test_features():
    f = dict(zip(FEATURES, prompt_features([1, 2, 3, 1, 2, 3, 1, 2])))
    assert f["log2_len"] == 3.0
    assert f["repeat2"] == pytest.approx(4 / 7)  # (1,2) (2,3) (3,1) new, then 4 repeats
    assert f["repeat3"] == pytest.approx(3 / 6)
    assert f["distinct"] == pytest.approx(3 / 8)
    assert f["corpus_mean"] == f["corpus_tail"] == 0.0  # no corpus
    assert dict(zip(FEATURES, prompt_features(list(range(10)))))["repeat2"] == 0.0
    corpus = _C.SuffixIndex(np.array([5, 6, 7, 8, 9, 1, 2, 3], np.int32), np.array([0, 8]))
    g = dict(zip(FEATURES, prompt_features([40, 41, 5, 6, 7], corpus)))
    assert g["corpus_tail"] == pytest.approx(3 / 8)  # 5 6 7 is continued in the corpus
    assert 0 < g["corpus_mean"] <= g["corpus_tail"]
    with pytest.raises(ValueError, match="at least one token"):
        prompt_features([])


def test_spearman():
    assert spearman([1, 2, 3, 4], [10, 20, 30, 40]) == pytest.approx(1.0)
    assert spearman([1, 2, 3, 4], [4, 3, 2, 1]) == pytest.approx(-1.0)
    assert spearman([1, 1, 2], [3, 3, 5]) == pytest.approx(1.0)  # ties ranked alike
    assert math.isnan(spearman([1, 1, 1], [1, 2, 3]))


def test_fit_recovers_a_linear_relation_and_round_trips(tmp_path):
    rng = np.random.default_rng(0)
    x = rng.normal(size=(200, len(FEATURES)))
    y = 1.5 + 0.3 * x[:, 1] - 0.2 * x[:, 4]
    m = AcceptancePredictor.fit(x, y, ridge=1e-6, manifest={"draft": "default"})
    pred = [m.predict_features(r) for r in x]
    assert np.allclose(pred, y, atol=1e-4)
    path = str(tmp_path / "p.json")
    m.save(path)
    back = AcceptancePredictor.load(path)
    assert back.manifest == {"draft": "default"}
    assert back.predict_features(x[0]) == pytest.approx(m.predict_features(x[0]))
    assert back.predict([1, 2, 3]) == pytest.approx(m.predict_features(prompt_features([1, 2, 3])))


def test_errors(tmp_path):
    with pytest.raises(ValueError, match="rows of 6 features"):
        AcceptancePredictor.fit([[1.0, 2.0]], [1.0])
    with pytest.raises(ValueError, match="finite"):
        AcceptancePredictor.fit([[float("nan")] * 6, [0.0] * 6], [1.0, 2.0])
    bad = tmp_path / "bad.json"
    bad.write_text("{nope")
    with pytest.raises(ValueError, match="not a readable predictor file"):
        AcceptancePredictor.load(str(bad))
    bad.write_text(json.dumps({"format": "other"}))
    with pytest.raises(ValueError, match="not a pyspec predictor"):
        AcceptancePredictor.load(str(bad))
    bad.write_text(json.dumps({"format": "pyspec-predictor", "features": ["x"]}))
    with pytest.raises(ValueError, match="features"):
        AcceptancePredictor.load(str(bad))
    bad.write_text(json.dumps({"format": "pyspec-predictor", "features": list(FEATURES)}))
    with pytest.raises(ValueError, match="without"):
        AcceptancePredictor.load(str(bad))


def test_online_updates_equal_a_fit_over_all_rows():
    rng = np.random.default_rng(1)
    x = rng.normal(size=(120, len(FEATURES)))
    y = 1.4 + 0.2 * x[:, 0] + 0.1 * rng.normal(size=120)
    first = AcceptancePredictor.fit(x[:60], y[:60], ridge=0.5)
    for r, t in zip(x[60:], y[60:]):
        first.update(r, t)
    # The same standardization, all rows at once.
    z1 = np.hstack([(x - first.mean) / first.std, np.ones((120, 1))])
    once = AcceptancePredictor(first.mean, first.std, z1.T @ z1, z1.T @ y, 0.5)
    assert np.allclose(first.coef, once.coef) and first.intercept == pytest.approx(once.intercept)
    before = first.coef.copy()
    first.update(x[0], float("nan"))  # ignored
    first.update(x[0], 2.0, weight=0.0)  # ignored
    assert np.array_equal(before, first.coef)


@pytest.mark.slow
def test_kinds_bench_measures_the_engine_with_and_without_a_predictor(tmp_path):
    """bench/bench_kinds.py --predictor: one more engine, the drafter with the predictor, in the
    same run; a predictor that expects no acceptance decodes the requests plainly (one in 8
    explores), its outputs still plain decoding's."""
    import os
    import subprocess
    import sys

    rng = np.random.default_rng(0)
    x = rng.normal(size=(20, len(FEATURES)))
    path = str(tmp_path / "never.json")
    AcceptancePredictor.fit(x, np.ones(20)).save(path)
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"category": k, "prompt": p}) + "\n" for k, p in
                               [("chat", "How are you today?"), ("chat", "Tell me a joke."),
                                ("translate", "Translate into French: the cat sleeps.")]))
    out = str(tmp_path / "kinds.json")
    bench = os.path.join(os.path.dirname(__file__), "..", "..", "bench", "bench_kinds.py")
    subprocess.run([sys.executable, bench, "--prompts", str(prompts), "--per-kind", "0",
                    "--max-tokens", "4", "--drafters", "default", "--predictor", path,
                    "--out", out], check=True, capture_output=True, timeout=600)
    doc = json.load(open(out))
    assert doc["config"]["drafters"] == ["none", "default", "default+predictor"]
    row = doc["overall"]["default+predictor"]
    requests = doc["config"]["requests"]
    assert row["identical_to_plain"] == f"{requests}/{requests}"
    plain, total = map(int, row["predicted_plain"].split("/"))
    assert total == requests and plain >= requests - 1 - requests // 8, row
    assert "predicted_plain" not in doc["overall"]["default"]
