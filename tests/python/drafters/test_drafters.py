"""Every drafter through the engine on tiny random models: greedy output equals plain greedy
decoding token for token (batched, with prefix-cache hits and preemption). Each drafter's own
files, options and errors are tested beside it (test_heads.py, test_model_drafter.py,
test_merged.py, test_ngram.py, test_drafter_spec.py, test_suffix.py); how the engine drafts,
routes and adapts, in tests/python/engine."""

import pytest
import torch

from pyspec.engine import Engine, SamplingParams
from pyspec.runner import ModelRunner

from drafters_support import MAX_TOKENS, _drafter, prompts


KINDS = ["ngram", "lookahead", "lookahead-pure", "ngram|lookahead", "suffix", "ngram|suffix",
         "layer-skip", "draft-model-self", "draft-model", "draft-model-tree", "medusa",
         "eagle", "eagle-fused", "ngram+eagle", "ngram|eagle", "medusa+eagle-fused"]


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("num_blocks", [64, 14])  # 14 blocks of 8: requests get preempted
def test_greedy_lossless_every_drafter(model, plain, tmp_path, kind, num_blocks):
    runner = ModelRunner(model, num_blocks=num_blocks, block_size=8)
    eng = Engine(runner, drafter=_drafter(kind, runner, model, str(tmp_path), plain),
                 max_num_seqs=8,
                 max_num_batched_tokens=80, max_prefill_chunk=16, adaptive=False)
    ps = prompts()
    # Two waves: the second hits the prefix cache of the first.
    res = eng.generate(ps[:4], SamplingParams(max_tokens=MAX_TOKENS)) + \
        eng.generate(ps[4:], SamplingParams(max_tokens=MAX_TOKENS))
    for i, (r, ref) in enumerate(zip(res, plain)):
        assert r.token_ids == ref, f"{kind}: request {i} differs from plain greedy decoding"
        assert not r.stats.fallbacks.get("drafter_error"), f"{kind} failed on request {i}"
    drafted = sum(r.stats.draft_tokens for r in res)
    accepted = sum(r.stats.accepted_tokens for r in res)
    assert drafted > 0
    if kind == "draft-model-self":
        assert accepted == drafted  # an identical draft model is always right
    if kind in ("draft-model-tree", "suffix", "ngram|suffix", "lookahead", "lookahead-pure"):
        assert accepted > 0
    if kind in ("ngram+eagle", "ngram|eagle", "suffix", "ngram|suffix"):
        assert eng.drafters[eng.default_drafter].name == kind
    s = eng.scheduler
    assert s.num_free_blocks == s.num_total_blocks
    if num_blocks == 14:
        assert s.num_preemptions > 0


@pytest.mark.parametrize("kind", ["ngram", "lookahead", "layer-skip", "draft-model-tree",
                                  "eagle", "ngram|suffix"])
@pytest.mark.parametrize("kv_dtype", ["float16", "bfloat16"])
def test_greedy_lossless_over_a_16_bit_kv_cache(model, plain, tmp_path, kind, kv_dtype):
    """A 16-bit KV cache rounds every K/V row once as it is computed, for plain and speculative
    decoding alike: speculative output equals plain decoding's under the same cache dtype (the
    drafter that shares the target's cache, layer-skip, reads it in 16 bits too)."""
    from reference import decode_one

    ref_runner = ModelRunner(model, num_blocks=64, block_size=8, kv_dtype=kv_dtype)
    ps = prompts()
    ref = [decode_one(ref_runner, p, MAX_TOKENS).tokens for p in ps]
    assert ref_runner.kv.k.dtype == getattr(torch, kv_dtype)
    runner = ModelRunner(model, num_blocks=64, block_size=8, kv_dtype=kv_dtype)
    eng = Engine(runner, drafter=_drafter(kind, runner, model, str(tmp_path), plain),
                 max_num_seqs=8, max_num_batched_tokens=80, max_prefill_chunk=16,
                 adaptive=False)
    res = eng.generate(ps, SamplingParams(max_tokens=MAX_TOKENS))
    assert [r.token_ids for r in res] == ref, kind
    assert sum(r.stats.draft_tokens for r in res) > 0
