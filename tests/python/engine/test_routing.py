"""Routing and drafter switching (pyspec.engine.routing): the router picks a request's drafter;
a request whose drafter does poorly switches to the next untried one, which starts afresh."""

import pytest

from pyspec.drafters import ModelDrafter
from pyspec.engine import Engine, SamplingParams
from pyspec.models.llama import LlamaForCausalLM
from pyspec.runner import ModelRunner

from drafters_support import MAX_TOKENS, Exploding, prompts
from reference import decode_one


def pyspec_router(**kw):
    from pyspec.engine import Router

    return Router(**kw)


def test_router_and_switching(model, plain):
    from pyspec.engine import Router

    runner = ModelRunner(model, num_blocks=64, block_size=8)
    bad = Exploding(set(), "none")  # always drafts tokens 3, 4: rarely right

    eng = Engine(runner, drafter=bad, drafters={"ngram": "ngram",
                                                "self": ModelDrafter(
                                                    LlamaForCausalLM.random(model.cfg, seed=0),
                                                    runner, max_depth=3)},
                 router=Router([(lambda f: f.prompt_len >= 30, "ngram")], default="exploding",
                               switch_order=["self"]),
                 adaptive=False, switch_below=0.5)
    res = eng.generate(prompts(), SamplingParams(max_tokens=MAX_TOKENS))
    for i, r in enumerate(res):
        assert r.token_ids == plain[i]
    long_ = [i for i, p in enumerate(prompts()) if len(p) >= 30]
    assert all(res[i].stats.drafters_used[0] == "ngram" for i in long_)
    switched = [r for r in res if r.stats.switches.get("low_acceptance")]
    assert switched, "a request with a poor drafter should have switched"
    for r in switched:
        assert r.stats.drafters_used[-1] == "self"
    with pytest.raises(ValueError, match="router names drafter"):
        Engine(runner, router=Router(default="nope"))
    # A malformed router is refused where it is made, naming the part.
    for kw, match in (({"rules": [5]}, "rule 0 must be a .predicate, drafter name. pair"),
                      ({"rules": [(5, "a")]}, "rule 0"), ({"rules": "ngram"}, "list of"),
                      ({"default": ["a"]}, "default must be a drafter name"),
                      ({"switch_order": "ngram"}, "switch_order must be a list"),
                      ({"switch_order": [1]}, "switch_order must hold drafter names")):
        with pytest.raises(ValueError, match=match):
            Router(**kw)
    assert Router([(lambda f: f.prompt_len > 99, None)], default="ngram").rules  # None: plain


def test_a_request_that_starts_plain_switches_to_an_untried_drafter(model, plain):
    """With drafter switching on, a request that starts plain because its drafter has been
    losing on this engine (the scheduler's evidence for that drafter) moves at once to the next
    drafter it has not tried, instead of decoding plainly until its first probe: counted as a
    "cost_model" switch. (The costs are fixed here, not measured.)"""
    runner = ModelRunner(model, num_blocks=64, block_size=8)
    bad = Exploding(set(), "none")  # never right
    good = ModelDrafter(LlamaForCausalLM.random(model.cfg, seed=0), runner, max_depth=3)
    eng = Engine(runner, drafter=bad, drafters={"self": good},
                 router=pyspec_router(default="exploding", switch_order=["self"]),
                 max_draft_tokens=3, measure_costs=False)
    eng.scheduler.set_cost_model(0.5, 0.2)
    first = eng.generate([prompts()[3]], SamplingParams(max_tokens=MAX_TOKENS))[0]
    assert first.stats.fallbacks.get("cost_model", 0) >= 1 and first.stats.drafts > 0
    eng.switch_below = 0.5
    second = eng.generate([prompts()[3]], SamplingParams(max_tokens=MAX_TOKENS))[0]
    assert second.token_ids == plain[3]
    assert second.stats.switches == {"cost_model": 1}
    assert second.stats.drafters_used == ["exploding", "self"]
    assert second.stats.fallbacks.get("cost_model") == 1  # the plain start
    assert second.stats.accepted_tokens > 0  # the target itself drafts: always right
    assert eng.stats.switches.get("cost_model") == 1


def test_a_switch_gives_the_new_drafter_a_fresh_start(model, plain):
    """The scheduler's acceptance evidence about the drafter a request leaves is dropped: right
    after the switch the request speculates from the initial draft length, even where the old
    drafter's misses had shrunk it to 1, and the new drafter (the target itself: always right)
    then has every token accepted."""
    runner = ModelRunner(model, num_blocks=64, block_size=8)
    bad = Exploding(set(), "none")
    good = ModelDrafter(LlamaForCausalLM.random(model.cfg, seed=0), runner, max_depth=3)
    eng = Engine(runner, drafter=bad, drafters={"self": good},
                 router=pyspec_router(default="exploding", switch_order=["self"]),
                 adaptive=False, switch_below=0.5, max_draft_tokens=3)
    rid = eng.add_request(prompts()[3], SamplingParams(max_tokens=40))
    before = None
    while eng.has_unfinished():
        snap = eng.scheduler.request(rid)
        eng.step()
        r = eng._reqs[rid]
        if r.stats.switches.get("low_acceptance"):
            before = snap
            break
    assert before is not None and before.draft_len == 1  # the old drafter's misses
    after = eng.scheduler.request(rid)
    assert after.state == "RUNNING_SPECULATIVE" and after.token_acceptance is None
    assert after.draft_len == 3  # initial_draft_tokens = min(4, max_draft_tokens)
    accepted = eng._reqs[rid].stats.accepted_tokens
    eng.step()
    assert eng._reqs[rid].stats.accepted_tokens - accepted == 3
    while eng.has_unfinished():
        eng.step()
    assert eng.result(rid).token_ids == decode_one(ModelRunner(model, 64, 8), prompts()[3],
                                                   40).tokens
