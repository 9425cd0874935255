"""train-draft on a tiny model (a few steps), drafter manifests, eval-draft reports and the promotion
gate (a worse drafter fails it)."""

import hashlib
import json
import os
import shutil

import pytest
import torch

from pyspec import cli
from test_llm import write_tiny_model


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return write_tiny_model(tmp_path_factory.mktemp("tiny-target"))


def _train(target, out, seed=0, epochs=1):
    rc = cli.main(["train-draft", "--target", target, "--out", out, "--prompts", "12",
                   "--max-tokens", "12", "--batch", "6", "--epochs", str(epochs), "--draft-vocab",
                   "80", "--intermediate-size", "32", "--tree-nodes", "8", "--seed", str(seed)])
    assert rc == 0
    return out


def _random_head(target, kv_cache_tokens=512):
    """The tiny target and an EAGLE head on it with perturbed (not freshly initialised) weights."""
    import pyspec
    from pyspec.train.eagle import EagleHead

    llm = pyspec.LLM(target, draft="none", kv_cache_tokens=kv_cache_tokens)
    torch.manual_seed(0)
    head = EagleHead(llm.model, torch.arange(40), 32)
    with torch.no_grad():
        for p in head.parameters():
            p.add_(torch.randn_like(p) * 0.3)
    return llm, head


def _bench_module(name):
    """A script of bench/ imported as a module."""
    import importlib.util

    path = os.path.join(os.path.dirname(__file__), "..", "..", "bench", name + ".py")
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _lossless(target, draft, prompts=("the cat sat on the mat", "abc abc"), max_tokens=12):
    """Greedy output with ``draft`` equals plain greedy output; returns (drafting LLM, plain)."""
    import pyspec

    llm = pyspec.LLM(target, draft=draft, kv_cache_tokens=2048)
    ref = pyspec.LLM(target, draft="none", kv_cache_tokens=2048)
    p = list(prompts)
    assert [o.token_ids for o in llm.generate(p, {"max_tokens": max_tokens})] == \
        [o.token_ids for o in ref.generate(p, {"max_tokens": max_tokens})]
    return llm, ref


@pytest.fixture(scope="module")
def trained(tiny, tmp_path_factory):
    return _train(tiny, str(tmp_path_factory.mktemp("drafter") / "d"))


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


def test_training_is_deterministic_and_resumable(tiny, trained, tmp_path):
    from safetensors.torch import load_file

    again = _train(tiny, str(tmp_path / "again"))
    x = load_file(os.path.join(trained, "drafter.safetensors"))
    y = load_file(os.path.join(again, "drafter.safetensors"))
    assert x.keys() == y.keys()
    for k in x:
        assert torch.equal(x[k], y[k]), k
    # A second run in the same folder reuses the generated data and resumes after epoch 1.
    more = _train(tiny, again, epochs=2)
    conf = json.load(open(os.path.join(more, "drafter.json")))
    assert conf["manifest"]["recipe"]["epochs"] == 2


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


def test_train_data_that_is_not_a_corpus(tiny, tmp_path, capsys):
    """--data FILE that torch cannot load as a train-draft corpus: one line naming the file and
    what it should be, before the target loads or anything is written."""
    junk = tmp_path / "junk.pt"
    junk.write_text("garbage\n")
    other = tmp_path / "other.pt"
    torch.save({"weights": torch.zeros(2)}, other)
    out = tmp_path / "x"
    for path in (junk, other):
        assert cli.main(["train-draft", "--target", tiny, "--out", str(out), "--method",
                         "draft-model", "--data", str(path)]) == 2
        err = capsys.readouterr().err
        assert str(path) in err and "not a corpus saved by train-draft" in err, err
        assert "Traceback" not in err
        assert not out.exists()
    # A run resuming in a folder whose data.pt is not a corpus says so too.
    os.makedirs(out)
    shutil.copy(junk, out / "data.pt")
    assert cli.main(["train-draft", "--target", tiny, "--out", str(out), "--method",
                     "draft-model"]) == 2
    err = capsys.readouterr().err
    assert str(out / "data.pt") in err and "not a corpus saved by train-draft" in err, err


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


def test_sampling_options_are_checked_before_loading(tmp_path, capsys):
    """Bad sampling values fail naming the option before the model loads (here: none exists)."""
    missing = str(tmp_path / "no-such-model")
    prompts = tmp_path / "p.jsonl"
    prompts.write_text(json.dumps({"prompt": "hi"}) + "\n")
    for opts, message in ((["--temperature", "nan"], "--temperature must be"),
                          (["--temperature", "-1"], "--temperature must be")):
        assert cli.main(["eval-draft", "--target", missing, "--prompts", str(prompts), "--out",
                         str(tmp_path / "rep")] + opts) == 2
        err = capsys.readouterr().err
        assert message in err and "no-such-model" not in err, err
    for opts, message in ((["--temperature", "-1"], "--temperature must be"),
                          (["--top-p", "0"], "--top-p must be"),
                          (["--min-p", "2"], "--min-p must be"),
                          (["--top-k", "-1"], "--top-k must be")):
        assert cli.main(["generate", "x", "--model", missing] + opts) == 2
        err = capsys.readouterr().err
        assert message in err and "no-such-model" not in err, err


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
    assert ev["weights"] == "float32" and ev["command"].endswith(" --packed-weights auto")
    # A combined spec records into the folder it uses, under the spec that reproduces it.
    assert cli.main(["eval-draft", "--target", tiny, "--draft", "ngram|" + d, "--prompts",
                     str(prompts), "--max-tokens", "6", "--out", str(tmp_path / "r2"),
                     "--record-in-manifest"]) == 0
    ev = json.load(open(os.path.join(d, "drafter.json")))["manifest"]["evaluation"]
    assert ev["draft"] == "ngram|copy" and ev["max_tokens"] == 6
    assert ev["command"].startswith("pyspec eval-draft --draft 'ngram|copy' ")


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
    assert man["recipe"]["sequences"] == 2 * len(torch.load(corpus, weights_only=False))
    assert json.load(open(os.path.join(out, "config.json")))["num_hidden_layers"] == 1
    llm, _ = _lossless(tiny, out, max_tokens=10)
    assert "draft model" in llm.drafter_name


def test_train_medusa_method(tiny, trained, tmp_path):
    """Medusa heads trained on a corpus learn (loss falls), load as a drafter, stay lossless."""
    from pyspec.train import medusa as M

    out = str(tmp_path / "medusa")
    rc = cli.main(["train-draft", "--target", tiny, "--out", out, "--method", "medusa",
                   "--data", os.path.join(trained, "data.pt"), "--medusa-heads", "3",
                   "--epochs", "3", "--lr", "3e-3", "--draft-vocab", "80"])
    assert rc == 0
    conf = json.load(open(os.path.join(out, "drafter.json")))
    assert conf["method"] == "medusa" and conf["medusa"]["num_heads"] == 3
    assert conf["manifest"]["recipe"]["medusa_heads"] == 3
    command = conf["manifest"]["recipe"]["command"]
    assert "--medusa-heads 3" in command and "--draft-vocab 80" in command
    assert "--batch-tokens 2048" in command and conf["manifest"]["recipe"]["batch_tokens"] == 2048
    assert "--unroll-steps" not in command and "--tree-nodes" not in command
    assert all(len(p) <= 3 for p in conf["medusa"]["tree"])
    llm, ref = _lossless(tiny, out, ("the cat sat on the mat", "abc abc abc abc"))
    assert "medusa" in llm.drafter_name
    # Training lowers the distillation loss of every head (heads start as the target's own head).
    import torch

    seqs = torch.load(os.path.join(trained, "data.pt"), weights_only=False)
    vocab = torch.arange(ref.model.cfg.vocab_size)
    fresh = M.MedusaHeads(ref.model, 3, vocab)
    state = torch.load(os.path.join(out, "checkpoint.pt"), weights_only=False)["heads"]
    learned = M.MedusaHeads(ref.model, 3, vocab)
    learned.load_state_dict(state)
    feats, tgts = M._rows(seqs, list(range(len(seqs))), 3, 512)

    def loss(h):
        with torch.no_grad():
            t = torch.softmax(h.teacher(tgts), -1)
            return float(-(t * torch.log_softmax(h(feats), -1)).sum(-1).mean())

    assert loss(learned) < loss(fresh) - 1e-3


def test_train_on_a_corpus_drafter_folder(tiny, trained, tmp_path, capsys):
    """--data also takes corpus drafter folders (--method suffix): their token documents, with
    the target's features computed by one teacher-forced pass (kept next to the drafter, reused
    by a rerun), train a head without generating anything."""
    corpus = str(tmp_path / "corpus")
    data = os.path.join(trained, "data.pt")
    assert cli.main(["train-draft", "--target", tiny, "--out", corpus, "--method", "suffix",
                     "--data", data]) == 0
    out = str(tmp_path / "head")
    args = ["train-draft", "--target", tiny, "--out", out, "--data", corpus, "--epochs", "1",
            "--draft-vocab", "80", "--intermediate-size", "32", "--tree-nodes", "8"]
    assert cli.main(args) == 0
    conf = json.load(open(os.path.join(out, "drafter.json")))
    recipe = conf["manifest"]["recipe"]
    seqs = torch.load(data, weights_only=False)
    assert recipe["data"] == [corpus] and recipe["sequences"] == len(seqs)
    assert recipe["tokens"] == sum(len(s.tokens) for s in seqs)
    assert "generated_tokens" not in recipe  # a corpus does not record where its prompts end
    assert f"--data {corpus}" in recipe["command"] and "--gen-dtype" in recipe["command"]
    # Reused data is traced to the commands that made it: the corpus folder's own recipe, and
    # for that corpus the recipe of the run whose data.pt it read.
    made = json.load(open(os.path.join(corpus, "drafter.json")))["manifest"]["recipe"]
    assert recipe["data_commands"] == {corpus: made["command"]}
    assert made["data_commands"] == {data: json.load(open(os.path.join(
        trained, "drafter.json")))["manifest"]["recipe"]["command"]}
    assert "feature_layers" not in conf["eagle"]  # the final hidden state alone: a plain head
    feats = torch.load(os.path.join(out, "features-2.pt"), weights_only=False)
    assert [f.tokens for f in feats] == [s.tokens for s in seqs]
    for a, b in zip(feats, seqs):  # the recomputed features are the recorded ones
        torch.testing.assert_close(a.hidden.float(), b.hidden.float(), atol=0.1, rtol=0.05)
    _lossless(tiny, out)
    capsys.readouterr()
    assert cli.main(args) == 0  # a rerun trains on the features it computed before
    assert "loaded the layer [2] features" in capsys.readouterr().out
    # A folder that is not a corpus drafter, and a missing one, are refused by name.
    assert cli.main(["train-draft", "--target", tiny, "--out", str(tmp_path / "x"),
                     "--data", trained]) == 2
    assert "is not a corpus" in capsys.readouterr().err
    assert cli.main(["train-draft", "--target", tiny, "--out", str(tmp_path / "x"),
                     "--data", str(tmp_path / "nowhere")]) == 2
    assert "neither a file nor a folder" in capsys.readouterr().err


def test_train_eagle_on_fused_target_layers(tiny, trained, tmp_path):
    """--feature-layers: the corpus's features are recomputed for those target layers (kept next
    to the drafter), the head learns to read them fused (its fuse starts as "the final layer
    only"), the drafter records them and loads as a lossless drafter reading those layers."""
    from safetensors.torch import load_file

    from pyspec.train.eagle import EagleHead

    out = str(tmp_path / "fused")
    corpus = os.path.join(trained, "data.pt")
    base = ["train-draft", "--target", tiny, "--out", out, "--data", corpus]
    for bad in (["--feature-layers", "1"], ["--feature-layers", "1,x"],
                ["--feature-layers", "2,1"], ["--feature-layers", "1,2", "--method", "medusa"]):
        assert cli.main(base + bad) == 2, bad
    rc = cli.main(base + ["--feature-layers", "1,2", "--epochs", "2", "--lr", "3e-3",
                          "--draft-vocab", "80", "--intermediate-size", "32"])
    assert rc == 0
    conf = json.load(open(os.path.join(out, "drafter.json")))
    assert conf["eagle"]["feature_layers"] == [1, 2]
    assert conf["manifest"]["recipe"]["feature_layers"] == [1, 2]
    h = conf["hidden_size"]
    assert load_file(os.path.join(out, "drafter.safetensors"))["fuse.weight"].shape == (h, 2 * h)
    feats = torch.load(os.path.join(out, "features-1-2.pt"), weights_only=False)
    seqs = torch.load(corpus, weights_only=False)
    assert [s.tokens for s in feats] == [s.tokens for s in seqs]
    # The recomputed final layer is the recorded one (same target, bf16 storage).
    for a, b in zip(feats, seqs):
        torch.testing.assert_close(a.hidden[:, h:].float(), b.hidden.float(), atol=0.1, rtol=0.05)
    llm, ref = _lossless(tiny, out)
    assert "reads target layers 1,2" in llm.drafter_name
    # Training moved the fuse off its start (the final layer only) and lowered the loss.
    dv = load_file(os.path.join(out, "drafter.safetensors"))["draft_vocab"]
    fresh = EagleHead(ref.model, dv, 32, (1, 2))
    learned = EagleHead(ref.model, dv, 32, (1, 2))
    learned.load_state_dict(torch.load(os.path.join(out, "checkpoint.pt"),
                                       weights_only=False)["head"])
    assert float(learned.fuse.weight.detach()[:, :h].abs().sum()) > 0

    def loss(m):
        from pyspec.train.eagle import _rms, _tensors

        nxt, f, tgt, mask = _tensors(feats, list(range(len(feats))), 512, h)
        with torch.no_grad():
            t = torch.softmax(torch.nn.functional.linear(_rms(tgt, m.teacher_norm, m.eps),
                                                         m.teacher_head), -1)
            cos, sin = m.rope(f.shape[1])
            _, logits, _ = m(nxt, f, cos, sin)
            return float(-(t * torch.log_softmax(logits, -1)).sum(-1)[mask].mean())

    assert loss(learned) < loss(fresh) - 1e-3


def test_unrolled_training_passes_see_what_tree_nodes_see(tiny):
    """Pass k of the unrolled EAGLE training attends like a depth-k tree node at inference: row p
    equals the last row of a plain causal pass over the true rows 0..p followed by the row's own
    chain of predicted features (checked against that brute force, float32)."""
    llm, head = _random_head(tiny)
    b, t, h = 2, 9, llm.model.cfg.hidden_size
    toks = torch.randint(0, 40, (b, t + 3))
    feats = torch.randn(b, t, h)
    cos, sin = head.rope(t + 3)
    with torch.no_grad():
        g1, _, kv1 = head(toks[:, :t], feats, cos[:t], sin[:t])
        g2, _, kv2 = head(toks[:, 1:t + 1], g1, cos[1:t + 1], sin[1:t + 1], ctx=(*kv1, []))
        g3, l3, _ = head(toks[:, 2:t + 2], g2, cos[2:t + 2], sin[2:t + 2], ctx=(*kv1, [kv2]))
        for p in (0, 4, t - 1):
            seq_t = torch.cat([toks[:, :p + 1], toks[:, p + 1:p + 3]], dim=1)
            seq_f = torch.cat([feats[:, :p + 1], g1[:, p:p + 1], g2[:, p:p + 1]], dim=1)
            n = p + 3
            x, logits, _ = head(seq_t, seq_f, cos[:n], sin[:n])
            assert torch.allclose(x[:, p + 1], g2[:, p], atol=1e-4), p
            assert torch.allclose(x[:, p + 2], g3[:, p], atol=1e-4), p
            assert torch.allclose(logits[:, p + 2], l3[:, p], atol=1e-4), p


@pytest.mark.parametrize("layers", [None, (1, 2)])
def test_eagle_drafter_runs_the_head_as_trained(tiny, tmp_path, layers):
    """The inference drafter (its own paged KV, one tree step per level) computes what the training
    module computes: the width-1 chain EagleDrafter drafts equals the greedy chain of EagleHead run
    causally over the true features followed by its own predicted features. One batch of three
    requests whose pending entries reach the drafter differently: a short prompt; a long prompt
    (its head KV written at prefill); a short prompt followed by 79 verified tokens it did not
    draft for (as after plain steps, or steps prompt lookup served), caught up in one causal chunk
    at the draft (as part of the first tree they would exceed the tree depth limit). A fourth
    request shares the long prompt's first four blocks as a prefix-cache hit and drafts before it:
    it reads the head KV that the long prompt's prefill wrote into the shared pages. With
    ``layers`` the head reads the outputs of both target layers, fused (EAGLE-3)."""
    import pyspec
    from pyspec.drafters import DraftRequest, PrefillChunk, Verified, make_drafter
    from pyspec.runner import ModelRunner, SeqStep
    from pyspec.train.eagle import EagleHead, write_drafter

    llm = pyspec.LLM(tiny, draft="none", kv_cache_tokens=512)
    vocab = llm.model.cfg.vocab_size
    torch.manual_seed(1)
    dv = torch.randperm(vocab)[:48].sort().values
    head = EagleHead(llm.model, dv, 32, layers)
    with torch.no_grad():
        for p in head.parameters():
            p.add_(torch.randn_like(p) * 0.5)
    out = write_drafter(head, str(tmp_path / "d"), manifest={}, width=1, max_depth=3,
                        max_nodes=3, dtype=torch.float32)
    runner = ModelRunner(llm.model, num_blocks=32, block_size=16)
    drafter = make_drafter(out, runner)
    assert drafter.hidden_layers == layers
    # id: (length, prefilled part, cached prefix length)
    cases = {1: (12, None, 0), 2: (90, None, 0), 3: (90, 10, 0), 4: (80, None, 64)}
    reqs, expect, ctxs, tables = [], {}, {}, {}
    for rid, (length, part, cached) in cases.items():
        ctx = torch.randint(0, vocab, (length,)).tolist()
        table = list(range(8 * (rid - 1), 8 * rid))
        if cached:  # request 2's first blocks, tokens and pages
            ctx[:cached] = ctxs[2][:cached]
            table[:cached // 16] = tables[2][:cached // 16]
        ctxs[rid], tables[rid] = ctx, table
        n = len(ctx) - 1  # the committed tokens; ctx[-1] is the root
        res = runner.step([SeqStep(ctx[:n], 0, table, None, "last")],
                          return_hidden=layers or True)
        k = part or n
        drafter.prefill([PrefillChunk(rid, ctx[cached:k], cached, table, ctx,
                                      res.hidden[cached:k])])
        if part:  # the rest arrives as one verified step's worth of committed tokens
            drafter.observe([Verified(rid, k, ctx[k:n], ctx[k + 1:n + 1], table,
                                      res.hidden[k:n])])
        reqs.append(DraftRequest(rid, ctx, n, table, 3, max_depth=3))

        toks = torch.tensor(ctx[1:])[None]
        cos, sin = head.rope(n + 3)
        chain = []
        with torch.no_grad():
            feats = res.hidden[None].float()
            if layers:  # fused once; the head's own predicted features are appended as they are
                feats = head.fuse(feats)
            for _ in range(3):
                t = toks.shape[1]
                x, logits, _ = head(toks, feats, cos[:t], sin[:t])
                c = int(dv[int(logits[0, -1].argmax())])
                chain.append(c)
                toks = torch.cat([toks, torch.tensor([[c]])], dim=1)
                feats = torch.cat([feats, x[:, -1:]], dim=1)
        expect[rid] = [ctx[-1]] + chain
    drafts = drafter.propose(reqs[3:]) + drafter.propose(reqs[:3])  # the cache hit first
    for r, draft in zip(reqs[3:] + reqs[:3], drafts):
        assert draft.parents == [-1, 0, 1, 2]
        assert draft.tokens == expect[r.request_id], r.request_id


def test_seed_prompt_sets(tiny, tmp_path):
    from pyspec.train.data import DIVERSE_TEMPLATES, TEMPLATES, seed_prompts

    basic = seed_prompts(200, seed=0, prompt_set="basic")
    # The basic set is what earlier drafters' recorded recipes generated from: it must not drift.
    assert basic[0].startswith("A shop sells 67 items on Monday and 17 more each following day.")
    assert seed_prompts(200, seed=0, prompt_set="basic") == basic
    diverse = seed_prompts(400, seed=0)
    assert len(set(diverse)) == 400 and diverse == seed_prompts(400, seed=0)
    stems = [t.split("{")[0] for t in DIVERSE_TEMPLATES if t.split("{")[0]]
    assert sum(any(p.startswith(s) for s in stems) for p in diverse) > 100
    assert any("\n\nOn " in p for p in diverse)  # passages to extract from
    assert not any(p.startswith(t.split("{")[0]) for p in basic[:50]
                   for t in DIVERSE_TEMPLATES if len(t.split("{")[0]) > 12)
    assert len(TEMPLATES) == 32
    # The diverse set is the shipped drafter v3's recipe: it must not drift either.
    shipped = seed_prompts(2400, seed=0)
    assert shipped[:400] == diverse
    assert hashlib.sha256("\n".join(shipped).encode()).hexdigest() == (
        "351a90fe32b89d94717571fe733edab9fd5c550e50ead14f11c1b394069222a6")
    # The wide set: the same kinds of requests over far more distinct words (400 prompts name
    # over 200 of the pools' entries; the diverse set names at most its 78 topics and a few
    # pool words that happen to be among them).
    from pyspec.train import data as D

    wide = seed_prompts(400, seed=0, prompt_set="wide")
    assert len(set(wide)) == 400 and wide == seed_prompts(400, seed=0, prompt_set="wide")
    named = sum(any(w in p for p in wide) for w in D.WIDE_POOLS)
    assert named > 200 and named > 3 * sum(any(w in p for p in diverse) for w in D.WIDE_POOLS)
    assert sum(any(p.startswith(s) for s in stems) for p in wide) > 100
    with pytest.raises(ValueError, match="prompt_set"):
        seed_prompts(3, prompt_set="mt-bench")
    # Several sets in one run: one corpus per set, one after the other, from the same prompts
    # separate runs would use.
    import pyspec

    out = str(tmp_path / "two")
    assert cli.main(["train-draft", "--target", tiny, "--out", out, "--prompt-set", "basic,wide",
                     "--prompts", "3", "--max-tokens", "4", "--epochs", "1", "--draft-vocab",
                     "80", "--intermediate-size", "32"]) == 0
    recipe = json.load(open(os.path.join(out, "drafter.json")))["manifest"]["recipe"]
    assert recipe["prompt_set"] == "basic,wide" and recipe["sequences"] == 6
    llm = pyspec.LLM(tiny, draft="none", kv_cache_tokens=512)
    both = seed_prompts(3, seed=0, prompt_set="basic") + seed_prompts(3, prompt_set="wide")
    want = [llm.chat_prompt([{"role": "user", "content": q}]) for q in both]
    seqs = torch.load(os.path.join(out, "data.pt"), weights_only=False)
    assert [q.tokens[:q.num_prompt] for q in seqs] == want
    for bad in ("mt-bench", "wide,wide", "basic,"):
        with pytest.raises(SystemExit) as e:
            cli.main(["train-draft", "--target", tiny, "--out", str(tmp_path / "x"),
                      "--prompt-set", bad])
        assert e.value.code == 2
    with pytest.raises(SystemExit) as e:  # argparse: invalid choice, exit status 2
        cli.main(["train-draft", "--target", tiny, "--out", str(tmp_path / "x"),
                  "--prompt-set", "mt-bench"])
    assert e.value.code == 2


def test_self_prompt_set(tiny, tmp_path):
    """The 'self' set: requests the target writes after its chat template's user-turn header."""
    import pyspec
    from pyspec.train import data as D

    llm = pyspec.LLM(tiny, draft="none", kv_cache_tokens=2048)
    prefix = D.user_turn_prefix(llm)
    assert llm.tokenizer.decode(prefix).endswith("<|im_start|>user\n")
    assert llm.chat_prompt([{"role": "user", "content": "hi"}])[:len(prefix)] == prefix
    with pytest.raises(ValueError, match="self_prompts"):
        D.seed_prompts(3, prompt_set="self")
    with pytest.raises(ValueError, match="n must be"):
        D.self_prompts(llm, 0)
    # A random tiny model rarely ends a turn: let most byte tokens end it, so that short
    # requests (and duplicates among them) come back.
    llm.tokenizer.eos_token_ids = set(range(3, 259, 3)) | {2}
    kw = dict(batch=8, max_tokens=6, min_words=1, progress=False)
    a = D.self_prompts(llm, 6, seed=1, **kw)
    assert len(a) == 6 and len({" ".join(x.lower().split()) for x in a}) == 6
    assert all(x == x.strip() and x for x in a)
    assert a == D.self_prompts(llm, 6, seed=1, **kw)  # deterministic for a seed
    assert a != D.self_prompts(llm, 6, seed=2, **kw)
    # Too few complete requests: what there is comes back, with a note.
    llm.tokenizer.eos_token_ids = {2}
    few = D.self_prompts(llm, 4, seed=1, batch=8, max_tokens=2, min_words=50, progress=False)
    assert few == []
    # A model without a chat template cannot write them.
    bare = str(tmp_path / "bare")
    shutil.copytree(tiny, bare)
    conf_path = os.path.join(bare, "tokenizer_config.json")
    conf = json.load(open(conf_path))
    del conf["chat_template"]
    json.dump(conf, open(conf_path, "w"))
    with pytest.raises(ValueError, match="no chat template"):
        D.user_turn_prefix(pyspec.LLM(bare, draft="none", kv_cache_tokens=512))


def test_train_draft_self_prompt_set(tiny, tmp_path, monkeypatch, capsys):
    """train-draft --prompt-set self keeps the written requests beside the corpus, and fails
    clearly when the target writes none."""
    from pyspec.train import data as D

    real = D.self_prompts

    def short_requests(llm, n, **kw):  # a random tiny model rarely ends a turn: help it
        llm.tokenizer.eos_token_ids |= set(range(3, 259, 2))
        return real(llm, n, max_tokens=4, min_words=1, **kw)

    monkeypatch.setattr(D, "self_prompts", short_requests)
    out = str(tmp_path / "self")
    assert cli.main(["train-draft", "--target", tiny, "--out", out, "--prompt-set", "self",
                     "--prompts", "3", "--max-tokens", "4", "--epochs", "1", "--draft-vocab",
                     "80", "--intermediate-size", "32"]) == 0
    written = [json.loads(line)["prompt"] for line in open(os.path.join(out, "self-prompts.jsonl"))]
    assert len(written) == 3
    seqs = torch.load(os.path.join(out, "data.pt"), weights_only=False)
    import pyspec

    llm = pyspec.LLM(tiny, draft="none", kv_cache_tokens=512)
    assert [q.tokens[:q.num_prompt] for q in seqs] == [
        llm.chat_prompt([{"role": "user", "content": q}]) for q in written]
    # A rerun reuses the written requests (the first --prompts of them).
    again = str(tmp_path / "again")
    os.makedirs(again)
    shutil.copy(os.path.join(out, "self-prompts.jsonl"), again)
    monkeypatch.setattr(D, "self_prompts", lambda *a, **kw: pytest.fail("not reused"))
    assert cli.main(["train-draft", "--target", tiny, "--out", again, "--prompt-set", "self",
                     "--prompts", "2", "--max-tokens", "4", "--epochs", "1", "--draft-vocab",
                     "80", "--intermediate-size", "32"]) == 0
    seqs = torch.load(os.path.join(again, "data.pt"), weights_only=False)
    assert [q.tokens[:q.num_prompt] for q in seqs] == [
        llm.chat_prompt([{"role": "user", "content": q}]) for q in written[:2]]
    monkeypatch.setattr(D, "self_prompts", lambda llm, n, **kw: [])
    assert cli.main(["train-draft", "--target", tiny, "--out", str(tmp_path / "none"),
                     "--prompt-set", "self", "--prompts", "3"]) == 2
    assert "wrote no complete request" in capsys.readouterr().err


def test_offline_accuracy_bench_novel_topics_are_unseen(monkeypatch):
    """bench/eagle_offline_accuracy.py's "unseen topics" set names no entry of any word pool the
    prompt sets draw from (its README numbers would mean nothing otherwise)."""
    bench = _bench_module("eagle_offline_accuracy")
    prompts = bench.novel_prompts(12)
    assert len(prompts) == 12
    assert all(any(t in p for t in bench.NOVEL_TOPICS) for p in prompts)
    monkeypatch.setattr(bench, "NOVEL_TOPICS", bench.NOVEL_TOPICS + ["honey bees"])
    with pytest.raises(SystemExit, match="honey bees"):
        bench.novel_prompts(4)


def test_oracle_bench_acceptance_needed_for_a_speedup():
    """bench/bench_oracle.py's arithmetic: the expected tokens of a chain whose drafts each hold
    with probability a, and the smallest a reaching a speedup at a measured step cost."""
    import importlib.util

    path = os.path.join(os.path.dirname(__file__), "..", "..", "bench", "bench_oracle.py")
    spec = importlib.util.spec_from_file_location("bench_oracle", path)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    assert bench.chain_tokens(0.5, 2) == pytest.approx(1.75)  # 1 + 0.5 + 0.25
    assert bench.chain_tokens(1.0, 4) == 5.0
    assert bench.chain_tokens(0.0, 8) == 1.0
    need = bench.needed_acceptance(1.2, 4, 2.0)
    assert 0 < need < 1
    assert bench.chain_tokens(need, 4) / 1.2 == pytest.approx(2.0, abs=1e-6)
    assert bench.chain_tokens(need - 0.01, 4) / 1.2 < 2.0
    assert bench.needed_acceptance(1.01, 1, 2.0) == float("inf")  # 2 tokens at best, over 1.01
    assert bench.needed_acceptance(1.0, 1, 2.0) == pytest.approx(1.0)


def test_capacity_probe_heads_start_as_the_head_they_grow(tiny):
    """bench/eagle_capacity_probe.py's wider and deeper heads start from the grown head's
    function (its README comparison rests on it): loaded from a head's export, each gives that
    head's features and logits on the causal pass and on an unrolled pass, and still trains
    (the added parts get gradients)."""
    bench = _bench_module("eagle_capacity_probe")
    llm, base = _random_head(tiny)
    exported = base.export()
    b, t, h = 2, 7, llm.model.cfg.hidden_size
    toks = torch.randint(0, 40, (b, t + 1))
    feats = torch.randn(b, t, h)
    cos, sin = base.rope(t + 1)

    def passes(head):
        g1, l1, kv1 = head(toks[:, :t], feats, cos[:t], sin[:t])
        g2, l2, _ = head(toks[:, 1:], g1, cos[1:], sin[1:], ctx=(*kv1, []))
        return g1, l1, g2, l2

    with torch.no_grad():
        want = passes(base)
    for name, (cls, inter) in bench.head_classes().items():
        head = cls(llm.model, torch.arange(40), 2 * 32 if inter > 1024 else 32)
        head.load_exported(exported)
        with torch.no_grad():
            got = passes(head)
        for w, g in zip(want, got):
            assert torch.allclose(w, g, atol=1e-5), name
        head.zero_grad()
        passes(head)[3].float().pow(2).mean().backward()
        added = [p for n, p in head.named_parameters()
                 if n.startswith("second.") or (n in ("gate.weight", "up.weight", "down.weight")
                                                 and inter > 1024)]
        assert all(p.grad is not None for p in added), name
        assert any(float(p.grad.abs().sum()) > 0 for p in added) or not added, name
