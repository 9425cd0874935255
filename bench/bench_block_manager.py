"""Microbenchmarks of the block manager's hot calls (pytest-benchmark).

Run: ``pytest bench/bench_block_manager.py --benchmark-only``. The numbers include the Python call
overhead of the binding (``pyspec._C.BlockManager``), which a caller driving the block manager from
Python pays per request per step.
"""

import pytest

pytest.importorskip("pytest_benchmark")

from pyspec._C import BlockManager  # noqa: E402

BLOCK = 16
PROMPT = list(range(1000))  # 62 full blocks + a partial one


def test_add_free_prefix_hit(benchmark):
    bm = BlockManager(4096, BLOCK)
    assert bm.add_request(0, PROMPT) == 0
    bm.mark_computed(0, len(PROMPT) - 1)
    rid = iter(range(1, 10**9))

    def run():
        r = next(rid)
        assert bm.add_request(r, PROMPT) == 992
        bm.free(r)

    benchmark(run)


def test_speculative_step(benchmark):
    bm = BlockManager(1 << 16, BLOCK)
    bm.add_request(0, PROMPT)
    bm.mark_computed(0, len(PROMPT) - 1)

    def run():
        assert bm.reserve(0, 6)
        bm.slots_for(0, bm.num_computed(0), 4)
        bm.commit(0, [1, 2, 3, 4], num_computed=4)

    benchmark.pedantic(run, rounds=2000, iterations=1)
