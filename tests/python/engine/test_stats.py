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
