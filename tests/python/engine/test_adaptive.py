"""Adaptive speculation (the scheduler's cost model, driven by the engine): fallback to plain
decoding and re-probing, the batch-aware draft budget from measured step times, draft costs that
count the whole batch, budget probes, and plain calibration steps."""

import pytest

from pyspec.drafters import Draft, Drafter
from pyspec.engine import Engine, SamplingParams
from pyspec.runner import ModelRunner

from drafters_support import Exploding, prompts
from reference import decode_one


def test_adaptive_falls_back_and_reprobes(model, plain):
    runner = ModelRunner(model, num_blocks=64, block_size=8)
    # Never right, but nearly free on this tiny model: the cost model alone would keep it (its
    # worst case is the verify cost); the hard floor makes it fall back.
    eng = Engine(runner, drafter=Exploding(set(), "none"), gamma=2, warmup_steps=2,
                 probe_interval=4, min_acceptance_rate=0.3)
    res = eng.generate(prompts()[:3], SamplingParams(max_tokens=40))
    for i, r in enumerate(res):
        assert r.token_ids == decode_one(ModelRunner(model, 64, 8), prompts()[i], 40).tokens
        st = r.stats
        fb = st.fallbacks.get("low_acceptance", 0) + st.fallbacks.get("cost_model", 0)
        assert fb >= 1 and st.probes >= 1, st
        assert st.steps > st.drafts  # plain steps happened


def test_batch_aware_budget_from_measured_step_times(model):
    """The scheduler's step-time fit (t = base + slope * tokens, from the step times the engine
    reports) sets the shared draft budget to the tokens a step can add before it turns
    compute-bound, and stops speculation once the batch alone gets there."""
    runner = ModelRunner(model, num_blocks=16, block_size=8)
    eng = Engine(runner, drafter="ngram")
    s = eng.scheduler
    assert s.memory_bound_tokens == 0
    for tokens in (4, 8, 12, 16, 20, 24, 28, 32):  # t = 10 ms + 1 ms per token
        s.observe_step_time(4, tokens, 0.010 + 0.001 * tokens)
    s.refit_cost_model()
    assert s.memory_bound_tokens == 10 and eng.stats.spec_free_tokens == 6
    # The scheduler's share: what the running batch leaves of those tokens, split among the
    # speculating requests; nothing once the batch alone reaches them.
    assert s.spec_share(4, 4) == 1 and s.spec_share(2, 2) == 4 and s.spec_share(10, 10) == 0
    assert s.spec_share(12, 3) == 0
    with pytest.raises(ValueError):
        s.set_memory_bound_tokens(-1)
    with pytest.raises(ValueError, match="observe_step_time"):
        s.observe_step_time(4, 2, 0.01)  # fewer tokens than requests


def test_draft_costs_count_every_request_of_the_batch(model):
    """A request's draft and verify tokens lengthen the step of the whole batch while its accepted
    tokens are its own, so the costs the scheduler weighs them with (relative to a plain step of
    the batch) are b times a lone request's: the same fit at batch 4 gives 4x the costs, and a
    drafter that pays alone (40% per token at 0.12 of a step per level) stops paying."""
    from pyspec._C import optimal_draft_length

    def costs(batch):
        runner = ModelRunner(model, num_blocks=16, block_size=8)
        eng = Engine(runner, drafter="ngram")
        s = eng.scheduler
        for tokens in (4, 8, 12, 16, 20, 24, 28, 32):  # t = 10 ms + 1 ms per token
            s.observe_step_time(batch, tokens, 0.010 + 0.001 * tokens)
        s.observe_draft_time(0, 0.0014 * 10, 10)  # 1.4 ms per draft level
        s.refit_cost_model()
        return eng.stats.draft_cost, eng.stats.verify_cost

    d1, v1 = costs(1)
    d4, v4 = costs(4)
    plain1, plain4 = 0.010 + 0.001 * 1, 0.010 + 0.001 * 4
    assert d1 == pytest.approx(0.0014 / plain1) and d4 == pytest.approx(4 * 0.0014 / plain4)
    assert v1 > 0 and v4 == pytest.approx(4 * v1 * plain1 / plain4)
    alpha = 0.4
    _, gain1 = optimal_draft_length(alpha, 0.0, 0.12, 8)
    _, gain4 = optimal_draft_length(alpha, 0.0, 4 * 0.12, 8)
    assert gain1 > 1 > gain4


def test_a_budget_that_stops_every_draft_is_probed_again(model):
    """A step-time fit that puts the memory-bound limit at or below the batch stops every draft,
    and so the step-size spread the fit would need to correct it: after BUDGET_PROBE_FIRST decode
    steps without a draft token (then twice as many after each probe, up to BUDGET_PROBE_MAX)
    the scheduler lifts the limit (to twice the batch) until its next refit, and the limit is then
    computed again from what the drafting steps measured."""
    from pyspec._C import BUDGET_PROBE_FIRST, BUDGET_PROBE_MAX

    runner = ModelRunner(model, num_blocks=16, block_size=8)
    eng = Engine(runner, drafter="ngram")
    s = eng.scheduler
    for tokens in (4, 8, 12, 16, 20):  # noise: t = 10 ms + 5 ms per token -> limit 2 < batch 4
        s.observe_step_time(4, tokens, 0.010 + 0.005 * tokens)
    s.refit_cost_model()
    assert s.memory_bound_tokens == 2 and s.spec_share(4, 4) == 0
    assert BUDGET_PROBE_FIRST < BUDGET_PROBE_MAX
    for _ in range(BUDGET_PROBE_FIRST - 1):  # plain steps only: the fit cannot move
        s.observe_step_time(4, 4, 0.030)
    s.refit_cost_model()
    assert s.memory_bound_tokens == 2 and eng.stats.budget_probes == 0
    s.observe_step_time(4, 4, 0.030)
    s.refit_cost_model()
    # lifted to twice the batch (at least 8 more tokens), not away: drafts again, a few per
    # request, instead of every request's full tree
    assert s.memory_bound_tokens == 12 and eng.stats.budget_probes == 1
    assert 0 < s.spec_share(4, 4) <= 2
    # The noisy fit again: the next probe waits twice as long, and the interval stops at
    # BUDGET_PROBE_MAX.
    waits = []
    for probe in range(2, 7):
        for tokens in (4, 8, 12, 16, 20):
            s.observe_step_time(4, tokens, 0.010 + 0.005 * tokens)
        s.refit_cost_model()
        assert s.memory_bound_tokens <= 4
        n = 0
        while eng.stats.budget_probes < probe:
            s.observe_step_time(4, 4, 0.030)
            s.refit_cost_model()
            n += 1
        waits.append(n)
    expected = [min(BUDGET_PROBE_FIRST * 2 ** k, BUDGET_PROBE_MAX) for k in range(1, 6)]
    assert waits == expected
    for tokens in (8, 12, 16, 20) * 8:  # what the drafting steps measure: 1 ms per token
        s.observe_step_time(4, tokens, 0.026 + 0.001 * tokens)
    s.refit_cost_model()
    assert s.memory_bound_tokens > 4 and s.spec_share(4, 4) > 0
    # A limit that leaves room for drafts is not lifted, however long no request drafted
    # (then acceptance, not the budget, kept the drafts off).
    probes = eng.stats.budget_probes
    for _ in range(2 * BUDGET_PROBE_MAX):
        s.observe_step_time(4, 4, 0.030)
    s.refit_cost_model()
    assert eng.stats.budget_probes == probes and s.memory_bound_tokens > 0


class Oracle(Drafter):
    """Drafts the next tokens of a known continuation (always right, at no cost)."""

    name = "oracle"
    max_draft_depth = 4

    def __init__(self, prompt, continuation):
        self.text = list(prompt) + list(continuation)

    def propose(self, reqs):
        out = []
        for r in reqs:
            n = len(r.context)
            c = self.text[n:n + min(r.depth_limit, r.budget)]
            out.append(Draft([r.context[-1]] + c, list(range(-1, len(c)))))
        return out


class _StepClock:
    """A clock for the engine's step timing: each forward takes 10 ms plus 0.1 ms per token, so
    the measured memory-bound limit (about 100 tokens) never throttles drafting, whatever this
    machine's load (with the wall clock a noisy fit can put it at the batch's own tokens)."""

    def __init__(self, runner):
        self.now = 0.0
        forward = runner.step

        def step(seqs, **kw):
            self.now += 0.010 + 0.0001 * sum(len(s.token_ids) for s in seqs)
            return forward(seqs, **kw)

        runner.step = step

    def perf_counter(self):
        return self.now


def test_a_drafter_that_always_drafts_gets_plain_calibration_steps(model, monkeypatch):
    """After CALIBRATION_STEPS decode-only steps in a row that drafted, the next decode-only step
    drafts nothing, so the step-time fit sees a plain step (with trees always the same size its
    intercept and slope are left to noise); the output is unchanged and the steps are counted.
    Without adaptive speculation there is no fit and no calibration step."""
    import pyspec.engine.engine as engine_module
    from pyspec._C import CALIBRATION_STEPS

    n = 3 * CALIBRATION_STEPS + 40
    p = prompts()[3]
    want = decode_one(ModelRunner(model, 64, 8), p, n).tokens
    for adaptive in (True, False):
        runner = ModelRunner(model, num_blocks=64, block_size=8)
        monkeypatch.setattr(engine_module, "time", _StepClock(runner))
        # (cost_model=False: draft lengths that do not depend on this machine's timings; the
        # calibration steps come with the scheduler's measured costs either way)
        eng = Engine(runner, drafter=Oracle(p, want), adaptive=adaptive, max_draft_tokens=1,
                     cost_model=False)
        steps = []
        eng.trace_hook = lambda t: steps.append((bool(t.prefill), t.decisions))
        rid = eng.add_request(p, SamplingParams(max_tokens=n))
        while eng.has_unfinished():
            eng.step()
        assert eng.result(rid).token_ids == want
        drafted = [d[rid][0] > 0 for pre, d in steps if not pre and rid in d]
        plain_at = [i for i, x in enumerate(drafted) if not x]
        if not adaptive:
            assert not plain_at and eng.stats.calibration_steps == 0
            continue
        assert eng.stats.calibration_steps == len(plain_at) >= 2
        # each after exactly CALIBRATION_STEPS drafted steps
        assert plain_at == [(k + 1) * (CALIBRATION_STEPS + 1) - 1 for k in range(len(plain_at))]
