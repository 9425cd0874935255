"""The training-related scripts of bench/: the offline accuracy benchmark's unseen topics and the
oracle benchmark's arithmetic."""

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
