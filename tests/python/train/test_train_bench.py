"""The training-related scripts of bench/: the offline accuracy benchmark's unseen topics, the
oracle benchmark's arithmetic, the oracle drafter of controlled acceptance with its scaling
benchmark, the data-scaling curve and the generation rate."""

import os

import pytest

from train_support import _bench_module


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

    path = os.path.join(os.path.dirname(__file__), "..", "..", "..", "bench", "bench_oracle.py")
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


def test_oracle_drafter_controls_acceptance_and_stays_lossless():
    """bench/oracle_support.py: the oracle drafter drafts the true continuation with each token
    wrong with probability 1 - alpha; alpha 1 accepts every draft of a chain, alpha 0 none, a
    tree adds random siblings to the same spine; output equals plain decoding either way."""
    import torch

    from pyspec.engine import Engine, SamplingParams
    from pyspec.runner import ModelRunner

    sup = _bench_module("oracle_support")
    fixed = _bench_module("bench_oracle_scaling").fixed_shape
    assert sup.shape_nodes("chain4") == (4, 4) and sup.shape_nodes("tree16") == (16, 4)
    for bad in ("tree6", "chain0", "star8"):
        with pytest.raises(ValueError, match="chainD"):
            sup.shape_nodes(bad)
    with pytest.raises(ValueError, match="weights must be one of"):
        sup.random_model("tiny", "int3")
    for weights in ("q8", "bf16"):
        if weights == "q8":
            from pyspec import _C

            if not _C.LinearKernels().packed_available:
                with pytest.raises(RuntimeError, match="packed codes"):
                    sup.random_model("tiny", weights)
                continue
        model = sup.random_model("tiny", weights)
        if weights == "q8":
            assert model.describe()["packed"]["codes_only"]
        prompts = [torch.randint(0, 111, (12,), generator=torch.Generator().manual_seed(s)).tolist()
                   for s in range(2)]
        sp = SamplingParams(max_tokens=20, ignore_eos=True)

        def run(drafter=None, depth=0):
            runner = ModelRunner(model, num_blocks=32, block_size=16)
            eng = (Engine(runner, drafter="none", max_num_seqs=2) if drafter is None else
                   Engine(runner, drafter=drafter, max_num_seqs=2, **fixed(depth)))
            return eng.generate(prompts, sp)

        plain = run()
        truths = [p + list(r.token_ids) for p, r in zip(prompts, plain)]
        for shape, alpha in (("chain4", 1.0), ("tree16", 1.0), ("chain4", 0.0)):
            d = sup.make_oracle(truths, alpha, shape)
            d.vocab = 111
            res = run(d, 4)
            assert [r.token_ids for r in res] == [r.token_ids for r in plain]
            s = [r.stats for r in res]
            if alpha == 1.0:  # every step but a last short one accepts all 4
                assert all(x.accepted_tokens >= 4 * (x.drafts - 1) for x in s)
                nodes = 16 if shape == "tree16" else 4
                assert all(x.draft_tokens <= nodes * x.drafts for x in s)
                assert sum(x.draft_tokens for x in s) > 4 * sum(x.drafts for x in s) \
                    if shape == "tree16" else True  # the siblings were verified too
            else:  # nothing accepted, and still 4 drafts a step (the shape is held; the last
                # 3 steps have room for 3, 2, 1 only)
                assert sum(x.drafts for x in s) > 0 and sum(x.accepted_tokens for x in s) == 0
                assert all(x.draft_tokens == 4 * (x.drafts - 3) + 6 for x in s)
        tree = sup.make_oracle(truths, 1.0, "tree16")
        tree.vocab = 111
        from pyspec.drafters.base import DraftRequest

        (dr,) = tree.propose([DraftRequest(0, truths[0][:13], 12, [0], 16, max_depth=4)])
        assert len(dr.tokens) == 17 and dr.parents[:5] == [-1, 0, 0, 0, 0]
        spine = [dr.tokens[i] for i in (1, 5, 9, 13)]
        assert spine == truths[0][13:17]  # the first child of each level is the truth
        assert tree.propose([DraftRequest(0, [7, 7, 7], 2, [0], 16)])[0].tokens == [7]


def test_oracle_scaling_bench_runs(tmp_path):
    """bench/bench_oracle_scaling.py end to end on the tiny layout: a speedup per (batch, shape,
    alpha), outputs identical to plain, and its chart."""
    import json

    bench = _bench_module("bench_oracle_scaling")
    out, chart = tmp_path / "o.json", tmp_path / "o.svg"
    bench.main(["--layouts", "tiny", "--weights", "bf16", "--alphas", "0.5,1", "--shapes",
                "chain2,tree8", "--batch", "1,2", "--max-tokens", "8", "--out", str(out),
                "--chart", str(chart)])
    r = json.loads(out.read_text())
    (row,) = r["rows"]
    assert [e["batch"] for e in row["batches"]] == [1, 2]
    for e in row["batches"]:
        assert len(e["runs"]) == 4 and e["plain_tok_s"] > 0
        assert all(x["speedup"] > 0 and x["identical_to_plain"].split("/")[0] ==
                   x["identical_to_plain"].split("/")[1] for x in e["runs"])
    assert chart.stat().st_size > 1000
    with pytest.raises(SystemExit):
        bench.main(["--shapes", "tree6"])


def test_data_scaling_bench_runs(tiny, trained, tmp_path):
    """bench/bench_data_scaling.py end to end on the tiny target: nested subsets trained in
    subprocesses, the features computed by the largest and linked into the smaller, each head
    measured on both prompt sets with outputs identical to plain (and a reference drafter the
    same way), and its chart."""
    import json
    import shutil

    from pyspec import cli
    from pyspec.train.data import load_sequences

    bench = _bench_module("bench_data_scaling")
    # A corpus drafter folder (tokens only), as the default corpus is: features are computed.
    data = str(tmp_path / "corpus")
    assert cli.main(["train-draft", "--target", tiny, "--out", data, "--method", "suffix",
                     "--data", os.path.join(trained, "data.pt")]) == 0
    total = sum(len(s.tokens) for s in load_sequences(os.path.join(trained, "data.pt")))
    out, chart = tmp_path / "s.json", tmp_path / "s.svg"
    bench.main(["--target", tiny, "--data", data, "--sizes", f"{total // 2},all",
                "--out-root", str(tmp_path / "runs"), "--max-tokens", "8", "--json", str(out),
                "--chart", str(chart), "--reference", "ngram"])
    r = json.loads(out.read_text())
    full, small = r["points"]  # the largest first: its features serve the smaller
    assert small["tokens"] >= total // 2 and full["tokens"] == total
    assert small["sequences"] < full["sequences"]
    for p in r["points"]:
        assert p["trained_now"] and p["training_seconds"] > 0
        assert p["training_seconds"] >= p["data_seconds"] >= 0  # tenths: 0.0 on a fast run
        for name in ("mt_bench", "task_kinds"):
            e = p["eval"][name]
            kinds = {"mt_bench": 8, "task_kinds": 7}[name]  # first prompt of each category
            assert e["prompts"] == kinds and e["identical_to_plain"] == kinds
            assert e["acceptance_length"] >= 1.0
    ref = r["references"]["ngram"]  # measured the same way
    assert ref["mt_bench"]["identical_to_plain"] == ref["mt_bench"]["prompts"] == 8
    half = f"t{total // 2}"
    assert (tmp_path / "runs" / half / "features-2.pt").is_symlink()
    assert "loaded the layer [2] features" in (tmp_path / "runs" / f"{half}.log").read_text()
    assert chart.stat().st_size > 1000
    # A finished point is not trained again.
    again = bench.main(["--target", tiny, "--data", data, "--sizes", "all", "--out-root",
                        str(tmp_path / "runs"), "--max-tokens", "8"])
    assert not again["points"][0]["trained_now"]
    assert again["points"][0]["eval"] == full["eval"]  # read back, not measured again
    assert again["points"][0]["training_seconds"] == full["training_seconds"]
    # Other settings in the same folder are refused (its points and features are not theirs);
    # a deleted point is trained again though other folders link to its features.
    with pytest.raises(SystemExit, match="seed differ"):
        bench.main(["--target", tiny, "--data", data, "--sizes", "all", "--out-root",
                    str(tmp_path / "runs"), "--seed", "1"])
    with pytest.raises(SystemExit):
        bench.main(["--sizes", "12,12", "--out-root", str(tmp_path / "x")])
    shutil.rmtree(tmp_path / "runs" / "tall")
    (tmp_path / "runs" / half / "drafter.json").unlink()
    again = bench.main(["--target", tiny, "--data", data, "--sizes", str(total // 2),
                        "--out-root", str(tmp_path / "runs"), "--max-tokens", "8"])
    assert again["points"][0]["trained_now"]


def test_generation_rate_bench_runs(tiny, tmp_path):
    """bench/bench_generation.py on the tiny target: both modes generate, at a rate, the same
    answers."""
    import json

    bench = _bench_module("bench_generation")
    seed = os.path.join(os.path.dirname(__file__), "..", "..", "..", "pyspec", "train",
                        "seed_requests.jsonl")
    out = tmp_path / "g.json"
    bench.main(["--target", tiny, "--prompts", seed, "--limit", "5", "--max-tokens", "6",
                "--batch", "2", "--dtype", "float32", "--json", str(out)])
    r = json.loads(out.read_text())
    assert r["prompts"] == 5 and r["same_tokens"] is True
    for run in r["runs"].values():
        assert run["generated_tokens"] > 0 and run["tokens_per_hour"] > 0
