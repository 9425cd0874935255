"""Per-request speculation statistics (pyspec.engine.stats): per-position acceptance and the
acceptance length, added up into the engine's counters."""

from pyspec.drafters import ModelDrafter
from pyspec.engine import Engine, SamplingParams
from pyspec.models.llama import LlamaForCausalLM
from pyspec.runner import ModelRunner

from drafters_support import prompts


def test_per_position_stats(model):
    runner = ModelRunner(model, num_blocks=64, block_size=8)
    d = ModelDrafter(LlamaForCausalLM.random(model.cfg, seed=0), runner, max_depth=4)
    eng = Engine(runner, drafter=d, adaptive=False, gamma=4)
    r = eng.generate([prompts()[3]], SamplingParams(max_tokens=30))[0]
    st = r.stats
    assert st.drafts > 0 and st.accepted_tokens == st.draft_tokens
    assert st.accepted_per_position[0] == st.drafts
    assert st.per_position_acceptance[0] == 1.0
    assert st.acceptance_length == 1 + st.accepted_tokens / st.drafts
    assert st.drafter == "draft-model"
    assert eng.stats.accepted_tokens == st.accepted_tokens


def test_per_position_counts_with_a_drafter_right_for_exactly_k_positions(model, plain):
    """A drafter right for exactly the first k tokens of each draft (k = 0..3 by request) and wrong
    at k + 1: each request's accepted_per_position, and the engine's, are exactly the counts of
    drafts that had at least j right tokens; no step reaches a position beyond its k. (An always
    right drafter cannot tell a shifted or truncated position range from the right one.)"""
    from drafters_support import RightForK

    ks = [0, 1, 2, 3, 2, 1, 3]
    runner = ModelRunner(model, num_blocks=64, block_size=8)
    d = RightForK(ks, model, max_depth=4)
    eng = Engine(runner, drafter=d, adaptive=False, gamma=4)
    res = eng.generate(prompts(), SamplingParams(max_tokens=24))
    assert [r.token_ids for r in res] == plain  # lossless, whatever the drafts
    assert len(res) == len(ks)
    for r in res:
        k = ks[r.request_id % len(ks)]
        log = d.log[r.request_id]
        assert log.count(k) >= 3, (k, log)  # most drafts were long enough to hold k + 1 tokens
        st = r.stats
        assert st.drafts == len(log)
        assert st.accepted_tokens == sum(log)
        assert st.accepted_per_position == d.expected_per_position({r.request_id})
        assert len(st.accepted_per_position) == k  # nothing accepted past position k
        if k:
            assert st.accepted_per_position[0] == sum(c >= 1 for c in log)
    assert eng.stats.accepted_per_position == d.expected_per_position()
    assert eng.stats.drafts == sum(len(v) for v in d.log.values())
