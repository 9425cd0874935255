"""`pyspec train-draft` (pyspec.train.cli) on a tiny model (a few steps): a loadable drafter
with its manifest and recipe, --prompt-file and --init-from, the target check of a trained
drafter, and bad options refused before the target loads or anything is generated."""

import json
import os
import shutil

import pytest
import torch

from pyspec import cli

from models_support import write_tiny_model
from train_support import _lossless


def test_train_writes_a_loadable_drafter_with_manifest(tiny, trained):
    from pyspec.models.loader import weights_sha256

    conf = json.load(open(os.path.join(trained, "drafter.json")))
    assert conf["method"] == "eagle" and conf["format"] == "pyspec-drafter"
    man = conf["manifest"]
    assert man["target"]["sha256"] == weights_sha256(tiny)
    assert man["recipe"]["sequences"] == 12 and man["recipe"]["draft_vocab"] == 80
    assert "pyspec train-draft" in man["recipe"]["command"]
    from pyspec.train.loop import native_bf16  # --gen-dtype auto: what this CPU runs fastest

    dtype = "bfloat16" if native_bf16() else "float32"
    assert man["recipe"]["gen_dtype"] == dtype
    assert f"--gen-dtype {dtype}" in man["recipe"]["command"]
    # The recorded command lists what this run used: no other method's options.
    assert "--unroll-steps" in man["recipe"]["command"] and "--prompt-set" in man["recipe"]["command"]
    assert "--draft-layers" not in man["recipe"]["command"]
    assert "--medusa-heads" not in man["recipe"]["command"]
    # The head's default step size: many small optimizer steps (README: 6,144 undertrained it).
    assert man["recipe"]["batch_tokens"] == 256
    assert "--batch-tokens 256" in man["recipe"]["command"]
    assert conf["eagle"]["draft_vocab_size"] == 80
    _lossless(tiny, trained)


def test_prompt_file_and_init_from(tiny, trained, tmp_path):
    """--prompt-file generates from given requests (the format eval-draft reads, e.g. a served
    prompt log); --init-from starts a head from a trained one (its draft vocabulary and sizes
    kept): before any step it computes exactly what the initial head computes."""
    from safetensors.torch import load_file

    from pyspec.train.eagle import EagleHead

    reqs = tmp_path / "requests.jsonl"
    with open(reqs, "w") as f:
        for i, t in enumerate(["write a poem about rain", "what is 2 + 2?", "list three birds",
                               "explain gravity to a child", "sort [3, 1, 2] in python",
                               "act as a tour guide in rome"]):
            f.write(json.dumps({"prompt": t} if i % 2 else {"category": "x", "turns": [t]}) + "\n")
    out = str(tmp_path / "ft")
    rc = cli.main(["train-draft", "--target", tiny, "--out", out, "--prompt-file", str(reqs),
                   "--max-tokens", "10", "--batch", "3", "--epochs", "1", "--init-from", trained,
                   "--tree-nodes", "8", "--seed", "1"])
    assert rc == 0
    man = json.load(open(os.path.join(out, "drafter.json")))["manifest"]
    rec = man["recipe"]
    assert rec["sequences"] == 6 and rec["prompt_file"] == str(reqs)
    assert rec["init_from"]["path"] == trained and "--init-from" in rec["command"]
    assert "--prompt-set" not in rec["command"] and "--prompts " not in rec["command"]
    a = load_file(os.path.join(trained, "drafter.safetensors"))
    b = load_file(os.path.join(out, "drafter.safetensors"))
    assert torch.equal(a["draft_vocab"], b["draft_vocab"])  # the initial head's vocabulary
    assert a["layer.mlp.gate_proj.weight"].shape == b["layer.mlp.gate_proj.weight"].shape
    assert not torch.equal(a["fc.weight"], b["fc.weight"])  # and it trained from there
    _lossless(tiny, out)
    # load_exported is export's inverse.
    import pyspec

    llm = pyspec.LLM(tiny, draft="none", kv_cache_tokens=256)
    conf = json.load(open(os.path.join(trained, "drafter.json")))
    head = EagleHead(llm.model, a["draft_vocab"], conf["eagle"]["intermediate_size"])
    head.load_exported(a)
    for k, v in head.export().items():
        assert torch.equal(v.to(a[k].dtype), a[k]), k
    with pytest.raises(ValueError, match="shape"):
        EagleHead(llm.model, a["draft_vocab"][:10], 32).load_exported(a)
    # Bad uses: another method, a folder without a drafter, a missing prompt file, sizes given
    # explicitly that differ from the initial head's (the same ones are accepted: the run above
    # recorded them).
    size = conf["eagle"]["intermediate_size"]
    vocab = int(a["draft_vocab"].numel())
    assert f"--intermediate-size {size}" in rec["command"]
    assert f"--draft-vocab {vocab}" in rec["command"]
    for extra in (["--method", "medusa", "--init-from", trained],
                  ["--init-from", str(tmp_path)],
                  ["--prompt-file", str(tmp_path / "none.jsonl")],
                  ["--init-from", trained, "--intermediate-size", str(size + 8)],
                  ["--init-from", trained, "--draft-vocab", str(vocab - 1)]):
        assert cli.main(["train-draft", "--target", tiny, "--out", str(tmp_path / "bad")]
                        + extra) == 2, extra
    assert not os.path.exists(tmp_path / "bad")  # refused before anything was written
    # A request past the target's context is named by its line before any generation.
    long_reqs = tmp_path / "long.jsonl"
    long_reqs.write_text(json.dumps({"prompt": "short one"}) + "\n"
                         + json.dumps({"prompt": "x " * 2000}) + "\n")
    out = tmp_path / "long"
    assert cli.main(["train-draft", "--target", tiny, "--out", str(out), "--prompt-file",
                     str(long_reqs), "--max-tokens", "4"]) == 2
    assert not (out / "data.pt").exists()


def test_target_mismatch_warns_vocab_mismatch_fails(trained, tmp_path):
    import pyspec

    other = write_tiny_model(tmp_path / "other", seed=5)
    with pytest.warns(UserWarning, match="trained for target"):
        pyspec.LLM(other, draft=trained, kv_cache_tokens=1024)
    bad = str(tmp_path / "badvocab")
    shutil.copytree(trained, bad)
    conf = json.load(open(os.path.join(bad, "drafter.json")))
    conf["vocab_size"] = 999
    json.dump(conf, open(os.path.join(bad, "drafter.json"), "w"))
    with pytest.raises(ValueError, match="vocab_size"):
        pyspec.LLM(other, draft=bad, kv_cache_tokens=1024)


def test_train_bad_arguments(tiny, tmp_path):
    assert cli.main(["train-draft", "--target", tiny, "--out", str(tmp_path / "x"),
                     "--method", "hydra"]) == 2
    assert cli.main(["train-draft", "--target", tiny, "--out", str(tmp_path / "x"),
                     "--method", "medusa", "--medusa-heads", "0"]) == 2
    assert cli.main(["train-draft", "--target", tiny, "--out", str(tmp_path / "x"),
                     "--epochs", "0"]) == 2
    assert cli.main(["train-draft", "--target", tiny, "--out", str(tmp_path / "x"),
                     "--batch-tokens", "0"]) == 2


@pytest.mark.parametrize("opts, message", [
    (["--feature-layers", ","], "--feature-layers must be comma-separated layer numbers"),
    (["--data", ","], "--data names no file or folder"),
    (["--tree-width", "0"], "--tree-width must be in [1, 16]"),
    (["--tree-width", "17"], "--tree-width must be in [1, 16]"),
    (["--tree-depth", "33"], "--tree-depth must be in [1, 32]"),
    (["--tree-nodes", "256"], "--tree-nodes must be in [1, 255]"),
    (["--method", "suffix", "--tree-depth", "17"], "--tree-depth must be in [1, 16]"),
    (["--method", "suffix", "--tree-nodes", "0"], "--tree-nodes must be in [1, 255]"),
    (["--method", "medusa", "--medusa-heads", "17"], "--medusa-heads must be in [1, 16]"),
    (["--lr", "0"], "--lr must be a finite number > 0"),
    (["--lr", "nan"], "--lr must be a finite number > 0"),
])
def test_train_option_ranges_are_checked_before_loading(tmp_path, capsys, opts, message):
    """Values the written drafter could not load with (EagleDrafter: width 1..16, depth 1..32,
    nodes 1..255; a corpus: depth 1..16; Medusa: 1..16 heads) are refused before the target
    loads (here it does not even exist) and before the output folder is created."""
    out = tmp_path / "x"
    assert cli.main(["train-draft", "--target", str(tmp_path / "no-such-model"), "--out",
                     str(out)] + opts) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err, err
    assert not out.exists()


def test_train_target_dependent_options_are_checked_before_generating(tiny, trained, tmp_path,
                                                                       capsys):
    """--draft-layers beyond the target's layers (it would silently copy all of them) and bad
    --feature-layers are refused once the target's config is known, before any generation."""
    out = tmp_path / "dm"
    assert cli.main(["train-draft", "--target", tiny, "--out", str(out), "--method",
                     "draft-model", "--data", os.path.join(trained, "data.pt"), "--draft-layers",
                     "3"]) == 2
    assert "--draft-layers must be in [1, 2]" in capsys.readouterr().err
    out = tmp_path / "fl"
    assert cli.main(["train-draft", "--target", tiny, "--out", str(out), "--prompts", "2",
                     "--max-tokens", "4", "--feature-layers", "1,5"]) == 2
    assert "--feature-layers 1,5" in capsys.readouterr().err
    assert not (out / "data.pt").exists()  # refused before the corpus was generated


def test_an_out_folder_belongs_to_one_target_method_and_corpus(tiny, trained, tmp_path, capsys):
    """Rerunning train-draft into an --out folder resumes only the same run: another target's
    weights, another --method, other generation options for its data.pt, another head shape
    for its checkpoint, or another target's --data corpus are each refused with one line
    (resuming would label the old drafter or data as the new run's)."""
    other = write_tiny_model(tmp_path / "other", seed=5)
    base = ["--prompts", "12", "--max-tokens", "12", "--batch", "6", "--epochs", "1",
            "--draft-vocab", "80", "--intermediate-size", "32", "--tree-nodes", "8"]
    cases = [(["--target", other] + base, "was made for other target weights"),
             (["--target", tiny, "--method", "draft-model", "--draft-layers", "1"] + base[:6],
              "holds a eagle drafter; this run trains --method draft-model"),
             (["--target", tiny] + base + ["--seed", "5"],
              "data.pt was generated with other options (seed differ)"),
             (["--target", tiny] + base[:-4] + ["--intermediate-size", "16", "--tree-nodes", "8"],
              "trained with other head options")]
    for k, (argv, message) in enumerate(cases):
        out = str(tmp_path / f"copy{k}")
        shutil.copytree(trained, out)
        if k == 3:  # the same data, another head: the checkpoint is what differs
            os.remove(os.path.join(out, "drafter.json"))
        before = {f: os.path.getmtime(os.path.join(out, f)) for f in os.listdir(out)}
        assert cli.main(["train-draft", "--out", out] + argv) == 2, message
        err = capsys.readouterr().err
        assert message in err and "Traceback" not in err, err
        if k < 3:  # refused before anything in the folder was written
            assert {f: os.path.getmtime(os.path.join(out, f))
                    for f in os.listdir(out) if f in before} == before
    assert cli.main(["train-draft", "--target", other, "--out", str(tmp_path / "fresh"),
                     "--data", os.path.join(trained, "data.pt")] + base[4:]) == 2
    assert "was generated by other target weights" in capsys.readouterr().err
    # Other generation options with the same seed: data.pt is reused (as documented), and the
    # manifest's recipe says how it was generated, not what this rerun asked.
    out = str(tmp_path / "adopt")
    shutil.copytree(trained, out)
    for f in ("drafter.json", "drafter.safetensors", "checkpoint.pt"):
        if os.path.exists(os.path.join(out, f)):
            os.remove(os.path.join(out, f))
    assert cli.main(["train-draft", "--target", tiny, "--out", out] + base[:2]
                    + ["--max-tokens", "7"] + base[4:]) == 0
    assert "reusing" in capsys.readouterr().out
    recipe = json.load(open(os.path.join(out, "drafter.json")))["manifest"]["recipe"]
    assert recipe["max_tokens"] == 12 and "--max-tokens 12" in recipe["command"], recipe


def test_data_and_prompt_file_together_are_refused(tmp_path, capsys):
    """Two sources for one corpus: refused before anything loads, not one silently ignored."""
    reqs = tmp_path / "r.jsonl"
    reqs.write_text(json.dumps({"prompt": "hi"}) + "\n")
    data = tmp_path / "data.pt"
    data.write_bytes(b"")
    assert cli.main(["train-draft", "--target", str(tmp_path / "no-model"), "--out",
                     str(tmp_path / "x"), "--data", str(data), "--prompt-file", str(reqs)]) == 2
    assert "--data and --prompt-file both say where the corpus comes from" in \
        capsys.readouterr().err
    assert not (tmp_path / "x").exists()
