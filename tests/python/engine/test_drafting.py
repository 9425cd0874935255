"""The engine's drafting stage (pyspec.engine.drafting): a drafter that raises, or returns a
malformed draft, fails only the requests it failed on (they decode plainly, output unchanged); a
failing draft source does the same; the parts of ``A|B`` keep their own draft lengths."""

import pytest

from pyspec import _C
from pyspec.drafters import FirstDrafter, ModelDrafter, NgramDrafter
from pyspec.engine import Engine, SamplingParams
from pyspec.models.llama import LlamaForCausalLM
from pyspec.runner import ModelRunner

from drafters_support import MAX_TOKENS, Exploding, SomeSteps, prompts
from reference import decode_one


@pytest.mark.parametrize("mode", ["raise", "nan", "token", "tree"])
def test_drafter_failure_falls_back_without_changing_output(model, plain, mode, caplog):
    runner = ModelRunner(model, num_blocks=64, block_size=8)
    d = Exploding({1, 3}, mode)
    eng = Engine(runner, drafter=d, adaptive=False)
    with caplog.at_level("WARNING", logger="pyspec.engine"):
        res = eng.generate(prompts()[:5], [SamplingParams(max_tokens=MAX_TOKENS)] * 5)
    # Each failure is logged once, naming the request, the drafter and what went wrong.
    logged = [r.getMessage() for r in caplog.records if r.name == "pyspec.engine"]
    assert len(logged) == 2, logged
    for rid, msg in zip((1, 3), logged):
        assert msg.startswith(f"request {rid}: drafter 'exploding' failed")
        assert ("drafter crashed" in msg) == (mode == "raise"), msg
    for i, r in enumerate(res):
        assert r.token_ids == plain[i]
        failed = r.stats.fallbacks.get("drafter_error", 0)
        assert failed == (1 if i in (1, 3) else 0)
        if i not in (1, 3):
            assert r.stats.draft_tokens > 0
    assert eng.stats.fallbacks["drafter_error"] == 2


@pytest.mark.parametrize("mode", Exploding.BAD_PROBS + ("budget",))
def test_bad_sampling_rows_or_node_budget_fail_only_their_request(model, mode):
    """Sampled requests: rows the batched acceptance would refuse (for the whole call), or a
    node_budget that raises, fail only the request they came with; every output is still seeded
    plain sampling's."""
    params = [SamplingParams(max_tokens=MAX_TOKENS, temperature=1.0, seed=10 + i)
              for i in range(5)]
    ref = Engine(ModelRunner(model, num_blocks=64, block_size=8)).generate(prompts()[:5], params)
    eng = Engine(ModelRunner(model, num_blocks=64, block_size=8), drafter=Exploding({1, 3}, mode),
                 adaptive=False)
    res = eng.generate(prompts()[:5], params)
    assert [r.token_ids for r in res] == [r.token_ids for r in ref]
    failed = [i for i, r in enumerate(res) if r.stats.fallbacks.get("drafter_error")]
    if mode == "budget":
        assert len(failed) == 1, failed
    else:
        assert failed == [1, 3]
    for i, r in enumerate(res):
        assert r.finish_reason == "length"
        if i not in failed:
            assert r.stats.draft_tokens > 0


@pytest.mark.parametrize("sourced", [True, False])
def test_first_drafter_parts_keep_their_own_draft_length(model, sourced):
    """``A|B``: A (the target itself, so always right) drafts on some steps, B (never right) on the
    others. The scheduler sizes each step from the acceptance of the part that drafts it, so B's
    misses do not shorten A's drafts: once A has reached the longest draft, every A step drafts
    and has accepted all of it. Without the per-part estimates (``sourced=False``, the engine not
    naming the part) A's drafts shrink after B's misses, which the test checks too, so it can
    fail."""
    runner = ModelRunner(model, num_blocks=64, block_size=8)
    good = SomeSteps(ModelDrafter(LlamaForCausalLM.random(model.cfg, seed=0), runner,
                                       max_depth=3))
    first = FirstDrafter([good, Exploding(set(), "none")])
    assert first.num_draft_sources == 2
    eng = Engine(runner, drafter=first, adaptive=False, max_draft_tokens=3)
    if not sourced:
        eng.drafting.sourced = {}
    steps = []
    eng.trace_hook = lambda t: steps.append(t.decisions)
    rid = eng.add_request(prompts()[3], SamplingParams(max_tokens=60))
    sources = []
    while eng.has_unfinished():
        r = eng._reqs[rid]
        # (the part that drafts, whether max_tokens leaves room for the longest draft)
        sources.append((first.draft_source(r.context), 60 - len(r.generated) > 4))
        eng.step()
    a_steps = [d[rid] for (s, _), d in zip(sources, steps) if s == 0 and rid in d]
    b_steps = [d[rid] for (s, _), d in zip(sources, steps) if s == 1 and rid in d]
    roomy = [d[rid] for (s, room), d in zip(sources, steps) if s == 0 and room and rid in d]
    assert len(a_steps) >= 4 and len(b_steps) >= 4
    assert all(a == 0 for _, _, a, _ in b_steps)  # B is never right
    assert all(a == depth for _, depth, a, _ in a_steps)  # A always is
    later = [depth for _, depth, _, _ in roomy[2:]]
    assert len(later) >= 3
    if sourced:
        assert later == [3] * len(later), a_steps
    else:
        assert min(later) < 3, a_steps
    assert eng.result(rid).token_ids == decode_one(ModelRunner(model, 64, 8), prompts()[3],
                                                   60).tokens


def test_a_failing_draft_source_fails_over_to_plain_decoding(model, caplog):
    class Broken(Exploding):
        def draft_source(self, context):
            raise RuntimeError("cannot tell")

    runner = ModelRunner(model, num_blocks=64, block_size=8)
    first = FirstDrafter([Broken(set(), "none"), Exploding(set(), "none")])
    eng = Engine(runner, drafter=first)
    res = eng.generate(prompts()[:2], SamplingParams(max_tokens=20))
    for i, r in enumerate(res):
        assert r.token_ids == decode_one(ModelRunner(model, 64, 8), prompts()[i], 20).tokens
        assert r.stats.fallbacks.get("drafter_error") == 1
    assert "draft_source: RuntimeError: cannot tell" in caplog.text
    # More sources than the scheduler keeps estimates for: the last ones share one.
    many = FirstDrafter([NgramDrafter(16), NgramDrafter(2)])
    assert many.num_draft_sources == _C.MAX_DRAFT_SOURCES + 2
    eng = Engine(ModelRunner(model, num_blocks=64, block_size=8), drafter=many)
    res = eng.generate(prompts()[:2], SamplingParams(max_tokens=20))
    for i, r in enumerate(res):
        assert r.token_ids == decode_one(ModelRunner(model, 64, 8), prompts()[i], 20).tokens
    broken = Exploding(set(), "none")
    broken.num_draft_sources = 0
    with pytest.raises(ValueError, match="draft sources"):
        Engine(ModelRunner(model, num_blocks=16, block_size=8), drafter=broken)


@pytest.mark.parametrize("depth", [10**6, -1, 2.5, True])
def test_a_drafter_depth_outside_what_the_scheduler_takes_is_refused(model, depth):
    class Deep(Exploding):
        max_draft_depth = depth

    with pytest.raises(ValueError, match="'exploding' has max_draft_depth .*allowed: an int in"):
        Engine(ModelRunner(model, num_blocks=16, block_size=8), drafter=Deep(set(), "raise"))
