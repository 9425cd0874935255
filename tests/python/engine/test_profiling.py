"""Kernel-level profiles of engine steps (pyspec.profiling, Engine.profile): a window of steps
written as a Chrome trace with each step's phases and the model's parts, linked from the steps'
trace records; bad arguments and states refused; outputs unchanged."""

import json
import os

import pytest

from pyspec.engine import Engine, SamplingParams
from pyspec.profiling import StepProfiler, profile_range
from pyspec.runner import ModelRunner

from drafters_support import prompts


def _engine(model):
    return Engine(ModelRunner(model, num_blocks=64, block_size=8), drafter="ngram")


def _names(path):
    with open(path, encoding="utf-8") as f:
        trace = json.load(f)
    return [e.get("name", "") for e in trace["traceEvents"]], trace


def test_a_window_records_its_steps_and_links_them(model, tmp_path):
    eng = _engine(model)
    seen = []
    eng.trace_hook = seen.append
    path = eng.profile(str(tmp_path / "prof"), steps=3)
    assert path.startswith(str(tmp_path / "prof")) and path.endswith(".json")
    st = eng.profile_status()
    assert st["recorded"] == 0 and not st["done"] and not os.path.exists(path)
    ps = prompts()[2:4]
    p = SamplingParams(max_tokens=12, ignore_eos=True)
    got = [r.token_ids for r in eng.generate(ps, p)]
    st = eng.profile_status()
    assert st == {"path": path, "steps": 3, "recorded": 3, "done": True, "error": None,
                  "summary": path[:-5] + ".summary.json"}
    names, trace = _names(path)
    steps = [n for n in names if n.startswith("pyspec.step ")]
    assert [n.split(" (")[0] for n in steps] == [f"pyspec.step {k}" for k in range(3)]
    assert steps[0] == "pyspec.step 0 (requests 0, 1)"  # the prefill step of both requests
    for phase in ("pyspec.draft", "pyspec.verify", "pyspec.accept", "pyspec.layers",
                  "pyspec.lm_head"):
        assert phase in names, phase
    assert any(n.startswith("aten::") for n in names)  # the torch ops inside
    with open(st["summary"], encoding="utf-8") as f:
        summary = json.load(f)
    assert summary["steps"] == 3 and summary["top"] and summary["trace"] == os.path.basename(path)
    # The first three traced steps point at the trace, the later ones at nothing.
    assert [t.profile for t in seen[:3]] == [(path, 0), (path, 1), (path, 2)]
    assert all(t.profile is None for t in seen[3:]) and len(seen) > 3
    # Profiling changes no output; a new window may start once the last one is done.
    again = _engine(model)
    assert [r.token_ids for r in again.generate(ps, p)] == got
    second = eng.profile(str(tmp_path / "prof"), steps=1)
    assert second != path
    eng.generate([ps[0]], SamplingParams(max_tokens=2))
    assert eng.profile_status()["done"] and os.path.exists(second)


def test_bad_arguments_and_states(model, tmp_path):
    eng = _engine(model)
    for steps in (0, -1, 1001, "3", 2.0, True, None):
        with pytest.raises(ValueError, match="steps must be an int in"):
            eng.profile(str(tmp_path), steps=steps)
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    with pytest.raises(ValueError, match="cannot create the profile folder"):
        eng.profile(str(blocker / "sub"), steps=2)
    assert eng.profile_status() is None  # nothing armed by a refused call
    path = eng.profile(str(tmp_path), steps=5)
    with pytest.raises(RuntimeError, match="already recording a profile"):
        eng.profile(str(tmp_path), steps=2)
    # Ended early: what was recorded is written.
    eng.generate([prompts()[3]], SamplingParams(max_tokens=2))
    st = eng.stop_profile()
    assert st["done"] and st["error"] is None and 1 <= st["recorded"] < 5
    assert os.path.exists(path)
    # Ended before any step: no file, and said so.
    path = eng.profile(str(tmp_path), steps=2)
    st = eng.stop_profile()
    assert st["done"] and st["recorded"] == 0 and "before any step" in st["error"]
    assert not os.path.exists(path) and st["summary"] is None


def test_one_window_at_a_time_in_a_process(model, tmp_path):
    """torch.profiler is one per process: a second engine's window waits until the first ends,
    then records its own steps."""
    a, b = _engine(model), _engine(model)
    pa = a.profile(str(tmp_path), steps=2)
    pb = b.profile(str(tmp_path), steps=1)
    a.add_request(prompts()[3], SamplingParams(max_tokens=8, ignore_eos=True))
    b.add_request(prompts()[3], SamplingParams(max_tokens=8, ignore_eos=True))
    a.step()
    b.step()  # a's window records: b's waits
    assert b.profile_status()["recorded"] == 0 and a.profile_status()["recorded"] == 1
    a.step()
    assert a.profile_status()["done"] and os.path.exists(pa)
    b.step()
    assert b.profile_status()["done"] and b.profile_status()["recorded"] == 1
    assert os.path.exists(pb)


def test_ranges_cost_nothing_outside_a_window():
    assert profile_range("x") is profile_range("y")  # the same no-op context
    with pytest.raises(ValueError, match="steps must be"):
        StepProfiler(".", 0)
