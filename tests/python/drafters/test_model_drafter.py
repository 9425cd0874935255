"""Draft models (pyspec.drafters.model): a request switched to a draft model mid-way catches up
the draft KV of its whole context."""

from pyspec.drafters import ModelDrafter
from pyspec.engine import Engine, SamplingParams
from pyspec.models.llama import LlamaForCausalLM
from pyspec.runner import ModelRunner

from drafters_support import Exploding, prompts
from reference import decode_one


def test_switch_to_a_draft_model_catches_up_its_kv(model, plain):
    """A request routed to a draft model mid-way (no draft KV yet) recomputes the draft KV of
    its whole context, so the identical draft model is right every time after the switch."""
    from pyspec.engine import Router

    runner = ModelRunner(model, num_blocks=64, block_size=8)
    same = ModelDrafter(LlamaForCausalLM.random(model.cfg, seed=0), runner, max_depth=3)
    proposed = []
    real = same.propose

    def counting(reqs):
        drafts = real(reqs)
        proposed.extend(d.num_draft_tokens for d in drafts)
        return drafts

    same.propose = counting
    bad = Exploding(set(), "none")
    eng = Engine(runner, drafter=bad, drafters={"same": same},
                 router=Router(default="exploding", switch_order=["same"]), adaptive=False,
                 switch_below=0.5, gamma=3)
    res = eng.generate([prompts()[3]], SamplingParams(max_tokens=40))[0]
    assert res.token_ids == decode_one(ModelRunner(model, 64, 8), prompts()[3], 40).tokens
    assert res.stats.drafters_used == ["exploding", "same"]
    assert sum(proposed) > 0
    # Before the switch the bad drafter's tokens (3, 4) were rejected; after it, every token the
    # identical draft model proposed must have been accepted (its catch-up KV is right).
    assert res.stats.accepted_tokens >= sum(proposed)
