"""The per-position acceptance metric (pyspec_spec_decode_num_accepted_tokens_per_pos_total
{position}) of a server whose drafter is right for exactly the first k tokens of each draft: its
counters equal, position by position, the number of drafts that had at least that many right
tokens (and the engine's own counts). An always-right drafter could not tell a shifted or
truncated position range from the right one."""

import time

import pytest

from serve_support import require_serve_deps

require_serve_deps()

import httpx  # noqa: E402

import pyspec  # noqa: E402
from drafters_support import RightForK  # noqa: E402
from models_support import write_tiny_model  # noqa: E402
from serve_support import _start, metric_or_zero  # noqa: E402

NAME = "pyspec_spec_decode_num_accepted_tokens_per_pos_total"
KS = [1, 3, 2]  # right tokens per draft, by request id


@pytest.fixture(scope="module")
def positions_server(tmp_path_factory):
    from pyspec.serve.app import create_app

    path = write_tiny_model(tmp_path_factory.mktemp("positions-model"))
    drafter = RightForK(KS, max_depth=4)
    llm = pyspec.LLM(path, draft=drafter, spec=pyspec.SpecConfig(num_speculative_tokens=4,
                                                                adaptive=False),
                     kv_cache_tokens=2048)
    drafter.model = llm.model
    srv, th, base = _start(create_app(llm))
    yield dict(llm=llm, base=base, drafter=drafter)
    srv.should_exit = True
    th.join(timeout=10)


def per_pos(base, depth):
    return [metric_or_zero(base, f'{NAME}{{position="{j}"}}') for j in range(1, depth + 1)]


def test_per_position_metric_counts_each_position(positions_server):
    base, d, eng = positions_server["base"], positions_server["drafter"], \
        positions_server["llm"].engine
    for i, prompt in enumerate(["abc abc abc", "hello there", "x y z x y z", "qwerty",
                                "the cat sat", "zzz"]):
        r = httpx.post(base + "/v1/completions", timeout=60,
                       json={"model": "pyspec", "prompt": prompt, "max_tokens": 16,
                             "temperature": 0})
        assert r.status_code == 200, r.text
    expected = d.expected_per_position()
    assert len(expected) == max(KS)  # every k occurred; nothing past the largest k
    assert expected[0] > expected[1] > expected[2] > 0  # the positions' counts differ
    # The engine thread updates the metrics after each step; the last step may trail the reply.
    deadline = time.monotonic() + 30
    while per_pos(base, 4) != expected + [0] and time.monotonic() < deadline:
        time.sleep(0.05)
    assert per_pos(base, 4) == expected + [0]
    assert eng.stats.accepted_per_position == expected
    assert metric_or_zero(base, "pyspec_spec_decode_num_accepted_tokens_total") == sum(
        c for cs in d.log.values() for c in cs)


def test_first_position_is_exported_before_any_acceptance():
    """Position 1 exists from the start at 0 (every drafter drafts one), so the dashboard's
    per-position panel and a rate() over it have data before the first accepted token."""
    from pyspec.serve.metrics import Metrics

    m = Metrics()
    assert m.registry.get_sample_value(NAME, {"position": "1"}) == 0.0
    assert m.registry.get_sample_value(NAME, {"position": "2"}) is None
