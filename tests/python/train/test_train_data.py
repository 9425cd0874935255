"""Training data (pyspec.train.data): seed prompt sets that must not drift, the 'self' set the
target writes, corpora given with --data (files and corpus drafter folders) and files that are
not a corpus."""

import hashlib
import json
import os
import shutil

import pytest
import torch

from pyspec import cli
from pyspec.train.data import load_sequences

from train_support import _lossless


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
    seqs = load_sequences(data)
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
    feats = load_sequences(os.path.join(out, "features-2.pt"))
    assert [f.tokens for f in feats] == [s.tokens for s in seqs]
    for a, b in zip(feats, seqs):  # the recomputed features are the recorded ones
        torch.testing.assert_close(a.hidden.float(), b.hidden.float(), atol=0.1, rtol=0.05)
    _lossless(tiny, out)
    capsys.readouterr()
    assert cli.main(args) == 0  # a rerun trains on the features it computed before
    assert f"loaded the layer [2] features of {len(seqs)} sequences" in capsys.readouterr().out
    # A folder that is not a corpus drafter, and a missing one, are refused by name.
    assert cli.main(["train-draft", "--target", tiny, "--out", str(tmp_path / "x"),
                     "--data", trained]) == 2
    assert "is not a corpus" in capsys.readouterr().err
    assert cli.main(["train-draft", "--target", tiny, "--out", str(tmp_path / "x"),
                     "--data", str(tmp_path / "nowhere")]) == 2
    assert "neither a file nor a folder" in capsys.readouterr().err


def test_train_tokens_draws_nested_subsets(tiny, trained, tmp_path, capsys, monkeypatch):
    """--train-tokens N trains on whole sequences drawn in a seeded order until they hold N
    tokens: with one seed a smaller subset is part of a larger one (a data-scaling curve's
    points differ only in the data they add), another seed draws others, and more than the
    corpus is all of it."""
    from pyspec.train import data as D
    from pyspec.train.data import token_subset

    seqs = load_sequences(os.path.join(trained, "data.pt"))
    total = sum(len(s.tokens) for s in seqs)
    keys = lambda sub: [tuple(s.tokens) for s in sub]
    order = {tuple(s.tokens): k for k, s in enumerate(seqs)}
    previous = set()
    for n in (1, total // 4, total // 2, total - 1):
        sub = token_subset(seqs, n, seed=3)
        got = sum(len(s.tokens) for s in sub)
        assert got >= n and got - len(max(sub, key=lambda s: len(s.tokens)).tokens) < n
        assert previous <= set(keys(sub))  # nested
        assert [order[k] for k in keys(sub)] == sorted(order[k] for k in keys(sub))
        previous = set(keys(sub))
    assert keys(token_subset(seqs, total * 2, seed=3)) == keys(seqs)
    assert any(keys(token_subset(seqs, total // 2, seed=s)) != keys(token_subset(
        seqs, total // 2, seed=3)) for s in range(4, 10))
    # The CLI records the subset's size and the option in the manifest.
    out = str(tmp_path / "head")
    assert cli.main(["train-draft", "--target", tiny, "--out", out, "--data",
                     os.path.join(trained, "data.pt"), "--train-tokens", str(total // 2),
                     "--epochs", "1", "--draft-vocab", "80", "--intermediate-size", "32",
                     "--tree-nodes", "8"]) == 0
    recipe = json.load(open(os.path.join(out, "drafter.json")))["manifest"]["recipe"]
    want = token_subset(seqs, total // 2, seed=0)
    assert recipe["sequences"] == len(want) < len(seqs)
    assert recipe["tokens"] == sum(len(s.tokens) for s in want)
    assert f"--train-tokens {total // 2}" in recipe["command"]
    # Its checkpoint is of that subset: a rerun in the same folder on other data is refused
    # (resuming would write the old head under the new run's manifest), the same one resumes.
    rerun = ["train-draft", "--target", tiny, "--out", out, "--data",
             os.path.join(trained, "data.pt"), "--epochs", "1", "--draft-vocab", "80",
             "--intermediate-size", "32", "--tree-nodes", "8", "--train-tokens"]
    capsys.readouterr()
    assert cli.main(rerun + [str(total // 4)]) == 2
    assert "trained on other data or options" in capsys.readouterr().err
    assert cli.main(rerun + [str(total // 2), "--seed", "1"]) == 2
    assert cli.main(rerun + [str(total // 2)]) == 0
    assert "resumed from" in capsys.readouterr().out
    # Features: a run on a corpus drafter folder computes them for its subset only; a larger
    # run given that cache computes only the sequences it lacks.
    corpus = str(tmp_path / "corpus")
    assert cli.main(["train-draft", "--target", tiny, "--out", corpus, "--method", "suffix",
                     "--data", os.path.join(trained, "data.pt")]) == 0
    head = ["--data", corpus, "--epochs", "1", "--draft-vocab", "80", "--intermediate-size",
            "32", "--tree-nodes", "8"]
    small, full = tmp_path / "small", tmp_path / "full"
    assert cli.main(["train-draft", "--target", tiny, "--out", str(small), "--train-tokens",
                     str(total // 2)] + head) == 0
    assert len(load_sequences(str(small / "features-2.pt"))) == len(want)
    os.makedirs(full)
    os.symlink(small / "features-2.pt", full / "features-2.pt")
    capsys.readouterr()
    computed = []
    real = D.with_feature_layers

    def counted(llm, part, layers, **kw):
        computed.extend(part)
        return real(llm, part, layers, **kw)

    monkeypatch.setattr(D, "with_feature_layers", counted)
    assert cli.main(["train-draft", "--target", tiny, "--out", str(full)] + head) == 0
    assert f"features of {len(want)} sequences" in capsys.readouterr().out
    assert sorted(s.tokens for s in computed) == sorted(
        s.tokens for s in seqs if s.tokens not in [w.tokens for w in want])  # only the rest
    feats = load_sequences(str(full / "features-2.pt"))
    assert sorted(f.tokens for f in feats) == sorted(s.tokens for s in seqs)
    recorded = {tuple(s.tokens): s.hidden for s in seqs}
    for a in feats:
        torch.testing.assert_close(a.hidden.float(), recorded[tuple(a.tokens)].float(),
                                   atol=0.1, rtol=0.05)
    assert len(load_sequences(str(small / "features-2.pt"))) == len(want)  # the link's target
    # A smaller run in that folder on another subset computes nothing and keeps the whole cache.
    computed.clear()
    os.remove(full / "checkpoint.pt")
    assert cli.main(["train-draft", "--target", tiny, "--out", str(full), "--train-tokens",
                     str(total // 3), "--seed", "5"] + head) == 0
    assert not computed and len(load_sequences(str(full / "features-2.pt"))) == len(seqs)
    assert cli.main(["train-draft", "--target", tiny, "--out", str(tmp_path / "x"),
                     "--train-tokens", "0"]) == 2
    assert "--train-tokens must be >= 1" in capsys.readouterr().err
    assert not (tmp_path / "x").exists()


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
    seqs = load_sequences(os.path.join(out, "data.pt"))
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
    seqs = load_sequences(os.path.join(out, "data.pt"))
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
    seqs = load_sequences(os.path.join(again, "data.pt"))
    assert [q.tokens[:q.num_prompt] for q in seqs] == [
        llm.chat_prompt([{"role": "user", "content": q}]) for q in written[:2]]
    monkeypatch.setattr(D, "self_prompts", lambda llm, n, **kw: [])
    assert cli.main(["train-draft", "--target", tiny, "--out", str(tmp_path / "none"),
                     "--prompt-set", "self", "--prompts", "3"]) == 2
    assert "wrote no complete request" in capsys.readouterr().err


def test_sharded_generation_resumes_and_equals_one_run(tiny, tmp_path, monkeypatch):
    """train-draft --shard-prompts saves each shard as it finishes; a run stopped mid-corpus
    resumes from the finished shards, and the corpus equals an unsharded run's."""
    from pyspec.train import data as D

    args = ["--target", tiny, "--prompt-set", "basic", "--prompts", "5", "--max-tokens", "4",
            "--epochs", "1", "--draft-vocab", "80", "--intermediate-size", "32", "--batch", "2"]
    whole = str(tmp_path / "whole")
    assert cli.main(["train-draft", "--out", whole] + args) == 0
    sharded = str(tmp_path / "sharded")
    real = D.generate_corpus
    calls = []

    def stop_at_third(llm, prompts, **kw):
        calls.append(kw.get("first", 0))
        if len(calls) == 3:
            raise KeyboardInterrupt  # stopped mid-corpus
        return real(llm, prompts, **kw)

    monkeypatch.setattr(D, "generate_corpus", stop_at_third)
    # Ctrl-C: one line and status 130 (the shards done are kept).
    assert cli.main(["train-draft", "--out", sharded, "--shard-prompts", "2"] + args) == 130
    assert sorted(os.listdir(os.path.join(sharded, "shards"))) == ["set0-00000.pt",
                                                                   "set0-00001.pt", "set0.json"]
    calls.clear()
    monkeypatch.setattr(D, "generate_corpus", lambda llm, prompts, **kw: (
        calls.append(kw.get("first", 0)), real(llm, prompts, **kw))[1])
    assert cli.main(["train-draft", "--out", sharded, "--shard-prompts", "2"] + args) == 0
    assert calls == [4]  # only the last shard was generated again
    assert not os.path.exists(os.path.join(sharded, "shards"))
    a = load_sequences(os.path.join(whole, "data.pt"))
    b = load_sequences(os.path.join(sharded, "data.pt"))
    assert [x.tokens for x in a] == [x.tokens for x in b]
    assert cli.main(["train-draft", "--out", str(tmp_path / "x"), "--shard-prompts", "0"]
                    + args) == 2
    # Shards of other options are not mixed in: a rerun with another seed generates again.
    other = str(tmp_path / "other")
    monkeypatch.setattr(D, "generate_corpus", stop_at_third)
    calls.clear()
    assert cli.main(["train-draft", "--out", other, "--shard-prompts", "2"] + args) == 130
    calls.clear()
    monkeypatch.setattr(D, "generate_corpus", lambda llm, prompts, **kw: (
        calls.append(kw.get("first", 0)), real(llm, prompts, **kw))[1])
    assert cli.main(["train-draft", "--out", other, "--shard-prompts", "2", "--seed", "5"]
                    + args) == 0
    assert calls == [0, 2, 4]


def test_tokens_only_generation(tiny, tmp_path):
    """generate_corpus(hidden=False) (what --method suffix generates) writes the same tokens as
    a run that records the hidden states (greedy and sampled, seeds per prompt), without them;
    --method suffix's data.pt holds none, and a head trained on it computes them."""
    import pyspec
    from pyspec.train import data as D

    llm = pyspec.LLM(tiny, draft="none", kv_cache_tokens=1024)
    prompts = D.seed_prompts(6, seed=2)
    full = D.generate_corpus(llm, prompts, max_tokens=12, batch=4, progress=False)
    lean = D.generate_corpus(llm, prompts, max_tokens=12, batch=4, progress=False, hidden=False)
    assert [s.tokens for s in lean] == [s.tokens for s in full]
    assert [s.num_prompt for s in lean] == [s.num_prompt for s in full]
    assert all(s.hidden is None for s in lean) and all(s.hidden is not None for s in full)
    corpus = str(tmp_path / "corpus")
    assert cli.main(["train-draft", "--target", tiny, "--out", corpus, "--method", "suffix",
                     "--prompts", "6", "--max-tokens", "12", "--batch", "4"]) == 0
    assert all(s.hidden is None for s in load_sequences(os.path.join(corpus, "data.pt")))
    head = str(tmp_path / "head")
    assert cli.main(["train-draft", "--target", tiny, "--out", head, "--data",
                     os.path.join(corpus, "data.pt"), "--epochs", "1", "--draft-vocab", "80",
                     "--intermediate-size", "32", "--tree-nodes", "8"]) == 0
    assert os.path.isfile(os.path.join(head, "features-2.pt"))
    _lossless(tiny, head)
