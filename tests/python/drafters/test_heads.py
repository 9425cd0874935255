"""EAGLE and Medusa heads (pyspec.drafters.heads): their folders load, with options, and fail
clearly (another target's width or vocabulary, a bad method or layer list); an EAGLE head with a
reduced draft vocabulary is lossless; the memory the heads hold beyond the target's tensors."""

import dataclasses
import json
import os

import pytest
import torch

from pyspec.drafters import (EagleDrafter, MedusaDrafter, ModelDrafter, load_heads, make_drafter,
                             save_heads)
from pyspec.engine import Engine, SamplingParams
from pyspec.models.llama import LlamaForCausalLM
from pyspec.runner import ModelRunner

from drafters_support import MAX_TOKENS, _heads_dir, prompts
from helpers import tiny_config


def test_heads_files_and_errors(model, tmp_path):
    runner = ModelRunner(model, num_blocks=16, block_size=8)
    d = _heads_dir(str(tmp_path), model, "eagle")
    assert isinstance(load_heads(d, runner), EagleDrafter)
    assert isinstance(make_drafter(d, runner), EagleDrafter)
    m = _heads_dir(str(tmp_path), model, "medusa")
    assert isinstance(make_drafter(m, runner), MedusaDrafter)
    e = make_drafter(d + "@width=2,depth=3,nodes=7", runner)
    assert (e.width, e.max_depth, e.max_nodes, e.max_draft_depth) == (2, 3, 7, 3)
    assert e.node_budget(3) == 7 and e.node_budget(1) == 2
    # A target of another width: shape mismatch is a clear error.
    other = LlamaForCausalLM.random(dataclasses.replace(model.cfg, hidden_size=128,
                                                        num_attention_heads=2), seed=0)
    with pytest.raises(ValueError, match="hidden_size"):
        load_heads(d, ModelRunner(other, 16, 8))
    cfg_path = os.path.join(d, "drafter.json")
    conf = json.load(open(cfg_path))
    conf["method"] = "lookahead"
    json.dump(conf, open(cfg_path, "w"))
    with pytest.raises(ValueError, match="method"):
        load_heads(d, runner)
    with pytest.raises(ValueError, match="drafter.json"):
        load_heads(str(tmp_path), runner)
    # A corpus folder (no weights file) is refused for what it is, before any weights are read.
    from pyspec.drafters.suffix import save_corpus

    corpus = save_corpus(str(tmp_path / "corpus"), [[1, 2, 3]], model.cfg.vocab_size)
    with pytest.raises(ValueError, match="holds a 'suffix' drafter, not EAGLE or Medusa heads"):
        load_heads(corpus, runner)
    for bad in ("bogus", "layer-skip:9", "layer-skip:x", "ngram:0", str(tmp_path / "nothing"),
                d + "@size=3", m + "@width=2"):
        with pytest.raises(ValueError):
            make_drafter(bad, runner)
    wrong_vocab = LlamaForCausalLM.random(tiny_config(vocab=97), seed=0)
    with pytest.raises(ValueError, match="vocabulary"):
        ModelDrafter(wrong_vocab, runner)
    # Fused target layers: the layer list must fit the target and the fuse weight the list.
    f = _heads_dir(str(tmp_path), model, "eagle-fused")
    fused = load_heads(f, runner)
    assert fused.hidden_layers == (1, 2) and "reads target layers 1,2" in fused.describe()
    conf_path = os.path.join(f, "drafter.json")
    good = json.load(open(conf_path))
    for layers, match in (([1, 3], r"\[1, 2\]"), ([2, 1], "final layer"), ([0, 2], r"\[1, 2\]"),
                          ([1, 1, 2], "distinct")):
        conf = json.loads(json.dumps(good))
        conf["eagle"]["feature_layers"] = layers
        json.dump(conf, open(conf_path, "w"))
        with pytest.raises(ValueError, match=match):
            load_heads(f, runner)
    conf = json.loads(json.dumps(good))
    conf["eagle"].pop("feature_layers")  # a fuse weight the config does not account for
    json.dump(conf, open(conf_path, "w"))
    with pytest.raises(ValueError, match="feature_layers"):
        load_heads(f, runner)


def test_malformed_heads_folders_name_the_file_and_what_is_allowed(model, tmp_path):
    """drafter.json that is not a JSON object, not UTF-8, or has a 'defaults' that is not an
    object; a damaged weights file; a Medusa tree that is not a list of int paths or picks a rank
    past the vocabulary; a num_heads that is not an int: each a ValueError naming the file and
    what is allowed, at load (not a failure on every request later)."""
    runner = ModelRunner(model, num_blocks=16, block_size=8)
    m = _heads_dir(str(tmp_path), model, "medusa")
    cfg_path = os.path.join(m, "drafter.json")
    good = open(cfg_path, "rb").read()
    conf = json.loads(good)

    def load_with(text, match):
        open(cfg_path, "wb").write(text if isinstance(text, bytes) else text.encode())
        with pytest.raises(ValueError, match=match):
            load_heads(m, runner)
        open(cfg_path, "wb").write(good)

    load_with("[1, 2]", "drafter.json: must hold a JSON object; got list")
    load_with(b"\xff\xfe{}", "drafter.json: not valid UTF-8 JSON")
    load_with(json.dumps({**conf, "defaults": [1, 2]}), "'defaults' must be an object")
    vocab = model.cfg.vocab_size
    for tree, match in (([[vocab]], f"rank {vocab} is out of range.*0..{vocab - 1}"),
                        ([[-1]], "rank -1 is out of range"), ("abc", "list of paths"),
                        ([[0], ["x"]], "list of int ranks")):
        load_with(json.dumps({**conf, "medusa": {**conf["medusa"], "tree": tree}}), match)
    load_with(json.dumps({**conf, "medusa": {**conf["medusa"], "num_heads": "x"}}),
              "int 'num_heads'")
    assert isinstance(load_heads(m, runner), MedusaDrafter)
    weights = os.path.join(m, "drafter.safetensors")
    open(weights, "wb").write(b"\x10\x00\x00\x00\x00\x00\x00\x00{not json")
    with pytest.raises(ValueError, match="drafter.safetensors: not a readable safetensors file"):
        load_heads(m, runner)


def test_eagle_reduced_vocab(model, plain, tmp_path):
    cfg = model.cfg
    dv = torch.arange(0, cfg.vocab_size, 2)
    t = EagleDrafter.random_weights(cfg, seed=4, intermediate_size=64, draft_vocab=dv)
    d = save_heads(str(tmp_path / "ev"), "eagle", t, {
        "hidden_size": cfg.hidden_size, "vocab_size": cfg.vocab_size,
        "eagle": {"intermediate_size": 64}})
    runner = ModelRunner(model, num_blocks=64, block_size=8)
    eng = Engine(runner, drafter=d, adaptive=False)
    res = eng.generate(prompts()[:3], SamplingParams(max_tokens=MAX_TOKENS))
    for i, r in enumerate(res):
        assert r.token_ids == plain[i]
        assert r.stats.draft_tokens > 0


def test_draft_bytes_counts_what_drafters_hold_beyond_the_target(model, tmp_path):
    """The serve metric pyspec_memory_bytes{component="draft_weights"}: heads' own weights, each
    tensor once, never the target's tensors they read (on a CPU target a head's embedding and
    lm_head are the target's); a host copy (what a head keeps for a GPU target) counts; parts
    of combined drafters count."""
    pytest.importorskip("fastapi")
    from pyspec.engine import Engine
    from pyspec.serve.metrics import draft_bytes as _draft_bytes
    from pyspec.serve.metrics import model_tensors as _model_tensors

    def nbytes(ts):
        return sum(t.numel() * t.element_size() for t in ts)

    runner = ModelRunner(model, num_blocks=32, block_size=8)
    eagle = make_drafter(_heads_dir(str(tmp_path), model, "eagle"), runner)
    medusa = make_drafter(_heads_dir(str(tmp_path), model, "medusa"), runner)
    assert eagle.embed_w is model.embed and medusa.lm_head is model.lm_head  # CPU: no copies
    own = {id(t) for t in _model_tensors(model)}
    head_own = [t for t in _model_tensors(eagle.head) if id(t) not in own]
    want_eagle = nbytes(head_own) + nbytes([eagle.fc_w])
    assert want_eagle > 0
    assert _draft_bytes(Engine(runner, drafter=eagle)) == want_eagle
    want_medusa = nbytes(medusa.w + medusa.b)
    assert _draft_bytes(Engine(runner, drafter=medusa)) == want_medusa
    # Combined: both parts, counted once each however the engine names them.
    merged = make_drafter("ngram+" + str(tmp_path / "eagle"), runner)
    assert _draft_bytes(Engine(runner, drafter=merged)) == want_eagle
    # A host copy of the target's embedding (a GPU target's) is memory the drafter adds.
    eagle.embed_w = model.embed.clone()
    assert _draft_bytes(Engine(runner, drafter=eagle)) == want_eagle + nbytes([model.embed])
    assert _draft_bytes(Engine(runner, drafter="ngram")) == 0


@pytest.mark.parametrize("kind", ["eagle", "medusa", "eagle-fused"])
@pytest.mark.parametrize("num_blocks", [64, 14])  # 14 blocks of 8: requests get preempted
def test_seeded_sampling_with_heads_is_plain_sampling(model, tmp_path, kind, num_blocks):
    """EAGLE and Medusa heads draft deterministic (top-k) trees, which the target-only walk
    verifies with the draws plain decoding uses at each position (docs/architecture.md): a seeded
    sampled run with a head is plain seeded sampling token for token, in a batch, on a rerun, and
    when requests are preempted and recomputed (a pool too small for the batch)."""
    from drafters_support import _drafter

    ps = prompts()
    params = [SamplingParams(max_tokens=MAX_TOKENS, temperature=[1.0, 0.7, 1.3][i % 3],
                             top_k=[0, 8, 0][i % 3], top_p=[1.0, 1.0, 0.9][i % 3], seed=500 + i)
              for i in range(len(ps))]

    def run(drafter_kind, blocks):
        runner = ModelRunner(model, num_blocks=blocks, block_size=8)
        d = None if drafter_kind == "none" else _drafter(
            drafter_kind, runner, model, str(tmp_path / f"{drafter_kind}-{blocks}"))
        eng = Engine(runner, drafter=d, max_num_seqs=8, max_num_batched_tokens=80,
                     max_prefill_chunk=16, adaptive=False)
        res = eng.generate(ps, params)
        return [r.token_ids for r in res], res, eng

    plain, _, _ = run("none", 64)
    first, res, eng = run(kind, num_blocks)
    again, _, _ = run(kind, num_blocks)
    assert first == again  # a seeded run is reproducible
    for i, (a, b) in enumerate(zip(first, plain)):
        assert a == b, f"{kind}: request {i} differs from plain seeded sampling"
    assert all(len(t) == MAX_TOKENS for t in first)
    assert not any(r.stats.fallbacks.get("drafter_error") for r in res)
    assert sum(r.stats.draft_tokens for r in res) > 0
    assert sum(r.stats.accepted_tokens for r in res) > 0  # positions decided inside the trees
    if num_blocks == 14:
        assert eng.scheduler.num_preemptions > 0
        assert sum(r.stats.preemptions for r in res) == eng.scheduler.num_preemptions
