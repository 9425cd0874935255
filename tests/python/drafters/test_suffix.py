"""Corpus drafting (``--method suffix``): the C++ suffix index against a brute-force reference,
the drafter's files, options and errors, and train-draft writing one for a tiny target. Losslessness
through the engine is covered with every other drafter (test_drafters.py: greedy, batched, with
preemption; test_spec_sampling.py: seeded sampling equals plain sampling token for token)."""

import collections
import json
import os
import random
import shutil
import subprocess
import sys

import numpy as np
import pytest

from pyspec import _C, cli
from pyspec.drafters import DraftRequest, SuffixDrafter
from pyspec.drafters.suffix import load_corpus, save_corpus
from models_support import write_tiny_model


def _index(docs):
    flat = np.array([t for d in docs for t in d], dtype=np.int32)
    return _C.SuffixIndex(flat, np.cumsum([0] + [len(d) for d in docs]))


def _follow(docs, pat):
    c = collections.Counter()
    for d in docs:
        for i in range(len(d) - len(pat)):
            if d[i:i + len(pat)] == pat:
                c[d[i + len(pat)]] += 1
    return c


@pytest.mark.parametrize("seed", range(5))
def test_index_agrees_with_brute_force(seed):
    rng = random.Random(seed)
    vocab = rng.choice([2, 3, 5, 50])
    docs = [[rng.randrange(vocab) for _ in range(rng.randrange(60))]
            for _ in range(rng.randrange(1, 8))]
    ix = _index(docs)
    assert ix.num_tokens == sum(map(len, docs)) and ix.num_documents == len(docs)
    for _ in range(50):
        ctx = [rng.randrange(vocab) for _ in range(rng.randrange(1, 12))]
        max_len = rng.randrange(1, 9)
        want = next((m for m in range(min(max_len, len(ctx)), 0, -1)
                     if _follow(docs, ctx[-m:])), 0)
        m, occ = ix.longest_match(ctx, max_len, 1)
        assert m == want
        toks, parents, probs, mlen = ix.propose(ctx, 10, 5, max_len, 1, 0.0, 3)
        assert mlen == m and len(toks) == len(parents) == len(probs) <= 10
        if not m:
            assert toks == []
            continue
        follow = _follow(docs, ctx[-m:])
        assert occ >= sum(follow.values())
        assert follow[toks[0]] == max(follow.values()) and parents[0] == -1
        assert probs[0] == pytest.approx(max(follow.values()) / sum(follow.values()))
        for i, p in enumerate(parents):  # every path continues the match somewhere in the corpus
            assert p < i
            path, j = [], i
            while j >= 0:
                path.insert(0, toks[j])
                j = parents[j]
            assert len(path) <= 5
            assert _follow(docs, ctx[-m:] + path[:-1])[path[-1]] > 0
            if p >= 0:
                assert probs[i] <= probs[p] + 1e-6


def test_drafter_trees_sources_and_limits():
    docs = [[1, 2, 3, 4, 5, 6, 7, 8, 9], [1, 2, 3, 4, 5, 6, 7, 8, 0], [3, 9], [7, 7, 7]]
    d = SuffixDrafter(_index(docs), max_nodes=4, max_depth=3)
    req = DraftRequest(0, [9, 1, 2, 3], 3, [0], budget=10)
    (draft,) = d.propose([req])
    assert draft.tokens[0] == 3 and draft.parents[0] == -1
    # "1 2 3" continues with 4 5 6 twice; "3" alone also with 9 (1 of 3): the longest match rules.
    assert draft.tokens[1:4] == [4, 5, 6] and draft.parents[1:4] == [0, 1, 2]
    assert d.draft_source([1, 2, 3]) == 1  # a 3-token match
    assert d.draft_source([5, 5, 5, 5, 5, 5, 7]) == 3  # 1 token
    assert d.draft_source([4, 4, 4, 42]) is None
    assert d.propose([DraftRequest(0, [4, 42], 1, [0], budget=3)])[0].tokens == [42]
    small = d.propose([DraftRequest(0, [1, 2, 3], 2, [0], budget=2, max_depth=1)])[0]
    assert small.tokens == [3, 4] and small.parents == [-1, 0]
    assert d.node_budget(3) == 4 and d.node_budget(1) == 1 and d.max_draft_depth == 3
    for bad in (dict(max_nodes=0), dict(max_depth=17), dict(min_match=3, max_match=2),
                dict(min_prob=1.0), dict(max_children=0), dict(max_match=True),
                dict(learn=-1), dict(learn=1 << 31), dict(rebuild_tokens=2.5)):
        with pytest.raises(ValueError):
            SuffixDrafter(_index(docs), **bad)
    with pytest.raises(ValueError, match="offsets"):
        _C.SuffixIndex(np.array([1, 2], np.int32), np.array([0, 3]))
    with pytest.raises(ValueError, match=">= 0"):
        _C.SuffixIndex(np.array([1, -2], np.int32), np.array([0, 2]))


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return write_tiny_model(tmp_path_factory.mktemp("tiny-target"))


def test_index_checks_token_range_and_search_bounds():
    import numpy as np

    from pyspec import _C

    for bad in (np.array([1, 2, (1 << 32) + 5]), np.array([1, -3, 2]), [1, 1 << 31]):
        with pytest.raises(ValueError, match="tokens"):  # never wrapped into int32 quietly
            _C.SuffixIndex(bad, np.array([0, 3]))
    ix = _C.SuffixIndex(np.array([1, 2, 1, 2, 3]), np.array([0, 5]))
    with pytest.raises(ValueError, match="max_match \\+ max_depth"):  # no int overflow
        ix.propose([1], 8, (1 << 31) - 1, (1 << 31) - 1, 1, 0.0, 3)
    with pytest.raises(ValueError, match="max_nodes"):
        ix.propose([1], 5000, 4, 8, 1, 0.0, 3)
    assert ix.propose([1], 8, 4, 8, 1, 0.0, 3)[0][0] == 2


def test_corpus_files_options_and_errors(tiny, tmp_path):
    import pyspec

    cfg = json.load(open(os.path.join(tiny, "config.json")))
    vocab = cfg["vocab_size"]
    ref = pyspec.LLM(tiny, draft="none", kv_cache_tokens=2048)
    out = ref.generate(["the cat sat on the mat", "abc abc"], {"max_tokens": 16})
    docs = [o.prompt_token_ids + o.token_ids for o in out]
    path = save_corpus(str(tmp_path / "c"), docs, vocab, defaults={"max_nodes": 5})
    conf = json.load(open(os.path.join(path, "drafter.json")))
    assert conf["method"] == "suffix" and conf["corpus"]["tokens"] == sum(map(len, docs))
    ix = load_corpus(path, conf, vocab)
    assert ix.num_tokens == sum(map(len, docs))
    llm = pyspec.LLM(tiny, draft=path + "@nodes=3,depth=4,match=6,prob=0.1", kv_cache_tokens=2048)
    got = llm.generate(["the cat sat on the mat", "abc abc"], {"max_tokens": 16})
    assert [o.token_ids for o in got] == [o.token_ids for o in out]
    assert "suffix" in llm.drafter_name
    # Errors name what is wrong.
    for spec, match in ((path + "@width=3", "unknown corpus drafter option"),
                        (path + "@prob=x", "prob="), (path + "@nodes=0", "max_nodes"),
                        (path + "@match=2,min-match=3", "min_match")):
        with pytest.raises(ValueError, match=match):
            pyspec.LLM(tiny, draft=spec, kv_cache_tokens=1024)
    with pytest.raises(ValueError, match=r"\[0, "):
        save_corpus(str(tmp_path / "bad"), [[vocab]], vocab)
    bad = str(tmp_path / "badvocab")
    shutil.copytree(path, bad)
    conf["vocab_size"] = vocab + 1
    json.dump(conf, open(os.path.join(bad, "drafter.json"), "w"))
    with pytest.raises(ValueError, match="vocab_size"):
        pyspec.LLM(tiny, draft=bad, kv_cache_tokens=1024)
    # corpus.npz arrays that would change in a cast are refused, not wrapped or truncated.
    npz = os.path.join(path, "corpus.npz")
    saved = open(npz, "rb").read()
    conf = json.load(open(os.path.join(path, "drafter.json")))
    offsets = np.array([0, 2], dtype=np.int64)
    for tokens, match in ((np.array([2**32 + 6, 5], dtype=np.int64), r"must lie in \[0, "),
                          (np.array([-1, 5]), r"must lie in \[0, "),
                          (np.array([5.7, 1.0]), "integer arrays"),
                          (np.array(["a", "b"]), "integer arrays"),
                          (np.array([[1, 2]]), "one-dimensional")):
        np.savez(npz, tokens=tokens, offsets=offsets)
        with pytest.raises(ValueError, match=match):
            load_corpus(path, conf, vocab)
    open(npz, "wb").write(b"PK\x03\x04 damaged")
    with pytest.raises(ValueError, match="corpus.npz: not a readable .npz file"):
        load_corpus(path, conf, vocab)
    open(npz, "wb").write(saved)
    assert load_corpus(path, conf, vocab).num_tokens == sum(map(len, docs))
    os.remove(os.path.join(path, "corpus.npz"))
    with pytest.raises(ValueError, match="corpus.npz is missing"):
        pyspec.LLM(tiny, draft=path, kv_cache_tokens=1024)


def test_train_draft_suffix_method(tiny, tmp_path):
    import pyspec
    from pyspec.models.loader import weights_sha256

    out = str(tmp_path / "s")
    rc = cli.main(["train-draft", "--target", tiny, "--out", out, "--method", "suffix",
                   "--prompts", "12", "--max-tokens", "12", "--batch", "6"])
    assert rc == 0
    conf = json.load(open(os.path.join(out, "drafter.json")))
    man = conf["manifest"]
    assert conf["method"] == "suffix" and man["method"] == "suffix"
    assert man["target"]["sha256"] == weights_sha256(tiny)
    assert man["recipe"]["sequences"] == 12 == conf["corpus"]["documents"]
    assert conf["corpus"]["tokens"] == man["recipe"]["tokens"]
    assert conf["defaults"] == {"max_depth": 8, "max_nodes": 8}
    command = man["recipe"]["command"]
    assert "--method suffix" in command and "--tree-depth 8" in command
    for other in ("--epochs", "--lr", "--draft-vocab", "--unroll-steps", "--tree-width"):
        assert other not in command, other
    # A rerun reuses the generated corpus (data.pt) and writes the same datastore.
    first = np.load(os.path.join(out, "corpus.npz"))["tokens"]
    assert cli.main(["train-draft", "--target", tiny, "--out", out, "--method", "suffix",
                     "--tree-nodes", "4"]) == 0
    assert np.array_equal(np.load(os.path.join(out, "corpus.npz"))["tokens"], first)
    assert json.load(open(os.path.join(out, "drafter.json")))["defaults"]["max_nodes"] == 4
    p = ["the cat sat on the mat", "abc abc"]
    llm = pyspec.LLM(tiny, draft="ngram|" + out, kv_cache_tokens=2048)
    ref = pyspec.LLM(tiny, draft="none", kv_cache_tokens=2048)
    assert [o.token_ids for o in llm.generate(p, {"max_tokens": 12})] == \
        [o.token_ids for o in ref.generate(p, {"max_tokens": 12})]
    assert cli.main(["train-draft", "--target", tiny, "--out", out, "--method", "suffix",
                     "--tree-depth", "0"]) == 2


def test_learning_from_finished_requests():
    """With ``learn``, a finished request's text becomes draftable: the same prompt again is
    drafted from the first answer and accepted (greedy output unchanged); aborted requests are
    not learned, and the learned index keeps the newest ``learn`` tokens."""
    from pyspec.drafters.suffix import index_of
    from pyspec.engine import Engine, SamplingParams
    from pyspec.models.llama import LlamaForCausalLM
    from pyspec.runner import ModelRunner
    from helpers import default_prompt, tiny_config

    model = LlamaForCausalLM.random(tiny_config(), seed=0)
    prompt = default_prompt(length=30, seed=3)
    d = SuffixDrafter(index_of([]), learn=1000, rebuild_tokens=1, background=False)
    eng = Engine(ModelRunner(model, num_blocks=64, block_size=8), drafter=d, adaptive=False)
    sp = SamplingParams(max_tokens=40)
    first = eng.generate([prompt], sp)[0]
    assert d.learned_tokens == len(prompt) + 40
    again = eng.generate([prompt], sp)[0]
    assert again.token_ids == first.token_ids
    assert first.stats.accepted_tokens == 0 and again.stats.accepted_tokens >= 30
    plain = Engine(ModelRunner(model, num_blocks=64, block_size=8)).generate([prompt], sp)[0]
    assert again.token_ids == plain.token_ids
    # An aborted request teaches nothing.
    rid = eng.add_request(default_prompt(length=12, seed=9), SamplingParams(max_tokens=30))
    eng.step()
    eng.abort(rid)
    while eng.has_unfinished():
        eng.step()
    assert d.learned_tokens == 2 * (len(prompt) + 40)
    # The newest `learn` tokens are kept.
    small = SuffixDrafter(index_of([]), learn=50, rebuild_tokens=1, background=False)
    small.learn(0, list(range(40)))
    small.learn(1, list(range(100, 130)))
    assert small.learned_tokens == 30
    small.learn(2, [1])  # too short to teach anything
    assert small.learned_tokens == 30
    # Built in the background, the index appears once the build finishes.
    bg = SuffixDrafter(index_of([]), learn=1000, rebuild_tokens=10)
    bg.learn(0, list(range(5)))
    assert bg._builder is None  # 5 < 10 pending tokens
    bg.learn(1, list(range(5, 12)))
    bg._builder.join()
    assert bg.learned_tokens == 12


def test_learned_text_is_kept_per_partition():
    """A request drafts only from its own partition's learned text: the same prompt sent again in
    another partition (another tenant) is not drafted from the first one's answer, so acceptance
    cannot reveal what another tenant asked; within the partition it is. Outputs stay equal to
    plain decoding either way."""
    from pyspec.drafters import suffix
    from pyspec.drafters.suffix import index_of
    from pyspec.engine import Engine, SamplingParams
    from pyspec.models.llama import LlamaForCausalLM
    from pyspec.runner import ModelRunner
    from helpers import default_prompt, tiny_config

    model = LlamaForCausalLM.random(tiny_config(), seed=0)
    prompt = default_prompt(length=30, seed=3)
    d = SuffixDrafter(index_of([]), learn=1000, rebuild_tokens=1, background=False)
    eng = Engine(ModelRunner(model, num_blocks=64, block_size=8), drafter=d, adaptive=False)

    def run(part):
        return eng.generate([prompt], SamplingParams(max_tokens=40, learn_partition=part))[0]

    first = run("alice")
    assert d.learned_tokens_of("alice") == len(prompt) + 40 and d.learned_tokens == 0
    other = run("bob")  # the same prompt, another tenant: nothing learned to draft from
    shared = run(None)
    again = run("alice")
    assert other.stats.accepted_tokens == 0 and shared.stats.accepted_tokens == 0
    assert again.stats.accepted_tokens >= 30
    assert first.token_ids == other.token_ids == shared.token_ids == again.token_ids
    # At most MAX_PARTITIONS are kept, the least recently used dropped.
    small = SuffixDrafter(index_of([]), learn=100, rebuild_tokens=1, background=False)
    for k in range(suffix.MAX_PARTITIONS + 1):
        small.learn(k, [1, 2, 3], partition=f"t{k}")
    assert small.learned_tokens_of("t0") == 0 and small.learned_tokens_of("t1") == 3
    with pytest.raises(ValueError, match="learn_partition"):
        eng.add_request(prompt, SamplingParams(learn_partition=5))


def test_exit_during_a_background_build_is_clean(tmp_path):
    """The interpreter exiting while a learned index is being built waits for it and exits 0 (a
    daemon build thread aborted the process: "terminate called without an active exception")."""
    code = ("import numpy as np\n"
            "from pyspec.drafters.suffix import SuffixDrafter, index_of\n"
            "d = SuffixDrafter(index_of([]), learn=10**6, rebuild_tokens=1)\n"
            "d.learn(0, np.random.default_rng(0).integers(0, 50000, 100000).tolist())\n")
    import pyspec

    # The pyspec this test imported (not a source checkout in the working directory).
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(
        [os.path.dirname(os.path.dirname(os.path.abspath(pyspec.__file__)))]
        + [x for x in env.get("PYTHONPATH", "").split(os.pathsep) if x])
    for _ in range(3):
        p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                           timeout=120, cwd=str(tmp_path), env=env)
        assert p.returncode == 0, p.stderr[-500:]


def test_index_refuses_floats_and_negative_context():
    """Float tokens or offsets are refused, not truncated (1.9 read as 1); a negative context
    token, which would match the index's document separator, is a ValueError."""
    with pytest.raises(TypeError, match="tokens must hold integers"):
        _C.SuffixIndex([0.9, 1.9, 2.5], [0, 1, 3])
    with pytest.raises(TypeError, match="offsets must hold integers"):
        _C.SuffixIndex([0, 1, 2], [0, 1.5, 3])
    s = _C.SuffixIndex(np.array([1, 2, 3, 4], dtype=np.int32), [0, 2, 4])
    assert s.num_documents == 2 and _C.SuffixIndex([], [0]).num_tokens == 0
    assert s.longest_match([5, 3]) == (1, 1)  # "3" is continued (by 4)
    for call in (lambda: s.longest_match([2, -1, 3]), lambda: s.propose([2, -1, 3], 4, 2)):
        with pytest.raises(ValueError, match=r"context\[1\] = -1"):
            call()
