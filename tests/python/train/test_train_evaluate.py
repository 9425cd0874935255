"""`pyspec eval-draft` (pyspec.train.evaluate): the acceptance report, the promotion gate (a
worse drafter fails it), prompt-file errors that name the line, and recording into a drafter's
manifest."""

import json
import os
import shutil

from models_support import write_tiny_model
from pyspec import cli


def test_eval_draft_report_and_promotion_gate(tiny, tmp_path, capsys):
    prompts = tmp_path / "p.jsonl"
    with open(prompts, "w") as f:
        for i, t in enumerate(["the cat sat on the mat", "one two three", "abc abc abc",
                               "hello world"]):
            f.write(json.dumps({"category": "a" if i % 2 else "b", "turns": [t, "x"]}) + "\n")
    good = str(tmp_path / "good")
    shutil.copytree(tiny, good)  # the target itself as a draft model: everything is accepted
    out = str(tmp_path / "rep")
    # Fixed draft lengths: the target as its own draft model costs about a target step per draft
    # token, so under the cost model whether it pays would hinge on measured timings.
    rc = cli.main(["eval-draft", "--target", tiny, "--draft", good, "--baseline", "ngram",
                   "--prompts", str(prompts), "--max-tokens", "16", "--out", out,
                   "--no-adaptive"])
    assert rc == 0, capsys.readouterr().out
    rep = json.load(open(os.path.join(out, "report.json")))
    assert rep["adaptive"] is False
    c = rep["drafters"]["candidate"]
    assert c["acceptance_length"] > rep["drafters"]["baseline"]["acceptance_length"]
    assert c["identical_to_plain"] == 4 and set(c["per_category"]) == {"a", "b"}
    assert c["per_position_acceptance"][0] == 1.0
    assert os.path.isfile(os.path.join(out, "report.md"))
    assert "promotion gate: passed" in capsys.readouterr().out
    # The worse drafter as the candidate fails the gate (exit 1) and says which metric.
    rc = cli.main(["eval-draft", "--target", tiny, "--draft", "ngram", "--baseline", good,
                   "--prompts", str(prompts), "--max-tokens", "16", "--out", out,
                   "--no-adaptive"])
    text = capsys.readouterr().out
    assert rc == 1 and "FAILED" in text and "tokens_per_target_step" in text
    assert cli.main(["eval-draft", "--target", tiny, "--prompts", str(tmp_path / "none.jsonl")]) == 2
    assert cli.main(["eval-draft", "--target", tiny, "--draft", "ngram", "--prompts",
                     str(prompts), "--record-in-manifest", "--out", out]) == 2
    # 'default' records into the package's shipped drafter: only for the embedded target.
    assert cli.main(["eval-draft", "--target", tiny, "--draft", "default", "--prompts",
                     str(prompts), "--record-in-manifest", "--out", out]) == 2
    capsys.readouterr()
    # Bad prompt lines, limits and report folders: one-line errors before anything runs.
    for line in ('[1, 2]', '5', '{"turns": 5}', '{"turns": {"a": 1}}', '{"turns": "hello"}',
                 '{"turns": []}', '{"prompt": ""}'):
        bad = tmp_path / "bad.jsonl"
        bad.write_text(line + "\n")
        assert cli.main(["eval-draft", "--target", tiny, "--prompts", str(bad), "--out",
                         out]) == 2, line
        err = capsys.readouterr().err
        assert "bad.jsonl:1" in err and "Traceback" not in err, (line, err)
    for opt in (["--limit", "0"], ["--limit", "-1"], ["--per-category", "-1"],
                ["--out", str(prompts)]):
        assert cli.main(["eval-draft", "--target", tiny, "--prompts", str(prompts),
                         "--out", out] + opt) == 2, opt
        assert opt[0] in capsys.readouterr().err


def test_eval_draft_prompt_file_errors_name_the_line(tiny, tmp_path, capsys, monkeypatch):
    """A prompts file that is not UTF-8, and a prompt longer than the target's context (1024
    tokens here), fail naming the file and line; the long one before any prompt is evaluated."""
    bad = tmp_path / "bad.jsonl"
    bad.write_bytes(json.dumps({"prompt": "fine"}).encode() + b"\n" + b'{"prompt": "\xff\xfe"}\n')
    out = str(tmp_path / "rep")
    assert cli.main(["eval-draft", "--target", tiny, "--draft", "ngram", "--prompts", str(bad),
                     "--out", out]) == 2
    err = capsys.readouterr().err
    assert f"{bad}:2" in err and "UTF-8" in err and "Traceback" not in err, err
    long = tmp_path / "long.jsonl"
    long.write_text(json.dumps({"prompt": "abc abc"}) + "\n\n"
                    + json.dumps({"prompt": "the cat sat on the mat " * 60}) + "\n")
    from pyspec.engine import Engine

    calls = []
    monkeypatch.setattr(Engine, "generate", lambda self, *a, **k: calls.append(1) or [])
    assert cli.main(["eval-draft", "--target", tiny, "--draft", "ngram", "--prompts", str(long),
                     "--max-tokens", "8", "--out", out]) == 2
    err = capsys.readouterr().err
    assert f"{long}:3" in err and "context of 1024 tokens" in err, err
    assert not calls  # refused before the warm-up and the first prompt


def test_eval_records_into_manifest(tiny, trained, tmp_path):
    prompts = tmp_path / "p.jsonl"
    prompts.write_text(json.dumps({"prompt": "abc abc abc", "category": "x"}) + "\n")
    d = str(tmp_path / "copy")
    shutil.copytree(trained, d)
    assert cli.main(["eval-draft", "--target", tiny, "--draft", d, "--prompts", str(prompts),
                     "--max-tokens", "8", "--out", str(tmp_path / "r"),
                     "--record-in-manifest"]) == 0
    ev = json.load(open(os.path.join(d, "drafter.json")))["manifest"]["evaluation"]
    assert ev["prompts"] == 1 and ev["acceptance_length"] >= 1.0 and "x" in ev[
        "per_category_acceptance_length"]
    assert ev["draft"] == "copy" and ev["max_tokens"] == 8
    assert ev["weights"] == "float32" and ev["command"].endswith(
        " --packed-weights codes --kv-cache-dtype auto")
    # A combined spec records into the folder it uses, under the spec that reproduces it.
    assert cli.main(["eval-draft", "--target", tiny, "--draft", "ngram|" + d, "--prompts",
                     str(prompts), "--max-tokens", "6", "--out", str(tmp_path / "r2"),
                     "--record-in-manifest"]) == 0
    ev = json.load(open(os.path.join(d, "drafter.json")))["manifest"]["evaluation"]
    assert ev["draft"] == "ngram|copy" and ev["max_tokens"] == 6
    assert ev["command"].startswith("pyspec eval-draft --draft 'ngram|copy' ")
    # Measured on another target, the result is not recorded (refused before it runs).
    other = write_tiny_model(tmp_path / "other", seed=5)
    before = open(os.path.join(d, "drafter.json")).read()
    assert cli.main(["eval-draft", "--target", other, "--draft", d, "--prompts", str(prompts),
                     "--max-tokens", "6", "--out", str(tmp_path / "r3"),
                     "--record-in-manifest"]) == 2
    assert open(os.path.join(d, "drafter.json")).read() == before
    assert not list((tmp_path / "r3").glob("*"))  # nothing was evaluated or reported


def test_eval_draft_reports_the_predictors_accuracy(tiny, tmp_path, capsys):
    """--predictor: each drafter's report says how the predictor's per-request estimates rank
    against the realized acceptance lengths (Spearman) and how far they are (mean error)."""
    import numpy as np

    from pyspec.predictor import FEATURES, AcceptancePredictor

    prompts = tmp_path / "p.jsonl"
    with open(prompts, "w") as f:
        for t in ["abc abc abc abc abc", "the cat sat", "one two one two one two", "hello"]:
            f.write(json.dumps({"prompt": t, "category": "x"}) + "\n")
    rng = np.random.default_rng(0)
    x = rng.random((20, len(FEATURES)))
    pred = AcceptancePredictor.fit(x, 1.0 + x[:, 1], ridge=0.1)  # more repeats, more accepted
    path = str(tmp_path / "pred.json")
    pred.save(path)
    out = str(tmp_path / "rep")
    assert cli.main(["eval-draft", "--target", tiny, "--draft", "ngram", "--prompts",
                     str(prompts), "--max-tokens", "12", "--out", out, "--no-adaptive",
                     "--predictor", path]) == 0
    c = json.load(open(os.path.join(out, "report.json")))["drafters"]["candidate"]
    assert set(c["predictor"]) == {"spearman", "mean_abs_error"}
    assert c["predictor"]["mean_abs_error"] >= 0
    assert "predictor Spearman" in capsys.readouterr().out
    assert cli.main(["eval-draft", "--target", tiny, "--draft", "ngram", "--prompts",
                     str(prompts), "--max-tokens", "4", "--out", out,
                     "--predictor", str(tmp_path / "missing.json")]) != 0
