"""train-draft --method draft-model (pyspec.train.draft_model): a smaller draft model trained
on concatenated corpora, with its manifest, lossless."""

import json
import os

from pyspec import cli
from pyspec.train.data import load_sequences

from train_support import _lossless


def test_train_draft_model_method(tiny, trained, tmp_path):
    out = str(tmp_path / "dm")
    corpus = os.path.join(trained, "data.pt")
    assert cli.main(["train-draft", "--target", tiny, "--out", out, "--method", "draft-model",
                     "--data", corpus + "," + str(tmp_path / "missing.pt")]) == 2
    assert not os.path.exists(out)  # refused before anything was written
    # Several corpora (comma-separated) are concatenated.
    rc = cli.main(["train-draft", "--target", tiny, "--out", out, "--method", "draft-model",
                   "--data", corpus + "," + corpus, "--draft-layers", "1", "--epochs", "1"])
    assert rc == 0
    man = json.load(open(os.path.join(out, "pyspec_manifest.json")))
    assert man["method"] == "draft-model" and man["recipe"]["draft_layers"] == 1
    command = man["recipe"]["command"]
    assert "--draft-layers 1" in command and f"--data {corpus},{corpus}" in command
    for other in ("--draft-vocab", "--unroll-steps", "--tree-width", "--medusa-heads",
                  "--prompt-set", "--prompts", "--gen-dtype"):  # unused: another method's, or
        assert other not in command, other                   # generation's (it trained on --data)
    assert "gen_dtype" not in man["recipe"] and "max_tokens" not in man["recipe"]
    assert man["recipe"]["data_commands"] == {corpus: json.load(open(os.path.join(
        trained, "drafter.json")))["manifest"]["recipe"]["command"]}
    assert man["recipe"]["sequences"] == 2 * len(load_sequences(corpus))
    assert json.load(open(os.path.join(out, "config.json")))["num_hidden_layers"] == 1
    llm, _ = _lossless(tiny, out, max_tokens=10)
    assert "draft model" in llm.drafter_name
