"""Sampled speculative decoding is lossless end to end: the joint distribution of the first two
generated tokens through the engine (an independent random draft model drafting sampled chains,
verified by rejection sampling) equals the target's exact distribution, by a chi-square test on
10^5 requests; the same harness with a deliberately broken acceptance rule (the recovered token
drawn from the target instead of the residual) must fail it.

The exact distribution is computed from the target alone: p(t1, t2) = p(t1 | prompt) *
p(t2 | prompt, t1), both after the same temperature / top-k / top-p filters. A slow test does the
same for the first three tokens (the third decided deep in a chain, or in a later step at whatever
position the first one reached).
"""

import dataclasses

import numpy as np
import pytest
import torch
from scipy import stats

from pyspec import _C
from pyspec.drafters import ModelDrafter, SuffixDrafter
from pyspec.engine import Engine, SamplingParams
from pyspec.models.llama import LlamaForCausalLM
from pyspec.runner import ModelRunner, SeqStep
from pyspec.sampling import apply_sampling_filters
from helpers import tiny_config

VOCAB = 6
PROMPT = [1, 4, 2, 5, 3]


@pytest.fixture(scope="module")
def models():
    cfg = dataclasses.replace(tiny_config(vocab=VOCAB), hidden_size=64, intermediate_size=128)
    target = LlamaForCausalLM.random(cfg, seed=11)
    # A different random model (one layer) and a larger logit scale: drafts are often wrong.
    draft = LlamaForCausalLM.random(dataclasses.replace(cfg, num_hidden_layers=1), seed=12)
    return target, draft


def exact_joint(target, params):
    runner = ModelRunner(target, num_blocks=4, block_size=8)
    rows = []
    seqs = [SeqStep(PROMPT + [t], 0, [0], None, "all") for t in range(VOCAB)]
    out = runner.step(seqs)
    probs = apply_sampling_filters(out.logits, params.temperature, params.top_k, params.top_p)
    n = len(PROMPT) + 1
    p1 = probs[n - 2]  # prompt's last row, identical in every sequence
    for t in range(VOCAB):
        rows.append(p1[t] * probs[t * n + n - 1])
    return torch.stack(rows).double().numpy()  # [t1, t2]


def sample_joint(target, draft, params, n, broken=False):
    runner = ModelRunner(target, num_blocks=4 * 1024, block_size=4)
    eng = Engine(runner, drafter=ModelDrafter(draft, runner, max_depth=2), adaptive=False,
                 gamma=2, initial_draft_tokens=2, max_num_seqs=1024,
                 max_num_batched_tokens=8192, spec_token_budget=0, spec_disable_batch_size=0,
                 enable_prefix_cache=True)
    eng.debug_skip_residual = broken
    counts = np.zeros((VOCAB, VOCAB))
    accepted = drafted = 0
    batch = 1000
    for start in range(0, n, batch):
        ps = [dataclasses.replace(params, seed=start + i) for i in range(batch)]
        for r in eng.generate([PROMPT] * batch, ps):
            counts[r.token_ids[0], r.token_ids[1]] += 1
            accepted += r.stats.accepted_tokens
            drafted += r.stats.draft_tokens
    return counts, accepted, drafted


def chi_square_p(counts, probs):
    n = counts.sum()
    expected = probs.flatten() / probs.sum() * n  # float32 rows: renormalize in float64
    mask = expected > 0
    assert counts.flatten()[~mask].sum() == 0, "a zero-probability pair was generated"
    exp = expected[mask]
    obs = counts.flatten()[mask]
    # Merge cells with small expectations so the chi-square approximation holds.
    small = exp < 5
    if small.any():
        exp = np.append(exp[~small], exp[small].sum())
        obs = np.append(obs[~small], obs[small].sum())
    return stats.chisquare(obs, exp).pvalue


@pytest.mark.parametrize("params", [
    SamplingParams(max_tokens=3, temperature=1.0),
    SamplingParams(max_tokens=3, temperature=0.7, top_k=4, top_p=0.9),
])
def test_sampled_speculation_is_lossless(models, params):
    target, draft = models
    probs = exact_joint(target, params)
    counts, accepted, drafted = sample_joint(target, draft, params, 100_000)
    assert drafted > 0 and 0 < accepted < drafted  # both acceptance and rejection happen
    p = chi_square_p(counts, probs)
    assert p > 1e-3, f"speculative sampling differs from the target (chi-square p = {p:.2e})"


def test_broken_acceptance_rule_is_detected(models):
    target, draft = models
    params = SamplingParams(max_tokens=3, temperature=1.0)
    probs = exact_joint(target, params)
    counts, _, _ = sample_joint(target, draft, params, 20_000, broken=True)
    p = chi_square_p(counts, probs)
    assert p < 1e-6, f"the broken rule went undetected (p = {p:.2e})"


def exact_joint3(target, params):
    """p(t1, t2, t3) of plain sampling after PROMPT, [V, V, V] float64, from the target alone."""
    runner = ModelRunner(target, num_blocks=64, block_size=8)
    n = len(PROMPT) + 2
    seqs = [SeqStep(PROMPT + [a, b], 0, [0], None, "all") for a in range(VOCAB)
            for b in range(VOCAB)]
    seqs = [dataclasses.replace(s, block_table=[i]) for i, s in enumerate(seqs)]
    out = runner.step(seqs)
    probs = apply_sampling_filters(out.logits, params.temperature, params.top_k,
                                   params.top_p).double().numpy().reshape(VOCAB, VOCAB, n, VOCAB)
    p1 = probs[0, 0, n - 3]  # after the prompt
    p2 = probs[:, 0, n - 2]  # [t1, t2]
    p3 = probs[:, :, n - 1]  # [t1, t2, t3]
    return p1[:, None, None] * p2[:, :, None] * p3


def sample_joint3(target, draft, params, n, gamma, broken=False):
    runner = ModelRunner(target, num_blocks=4 * 1024, block_size=4)
    eng = Engine(runner, drafter=ModelDrafter(draft, runner, max_depth=gamma), adaptive=False,
                 gamma=gamma, initial_draft_tokens=gamma, max_num_seqs=1024,
                 max_num_batched_tokens=8192, spec_token_budget=0, spec_disable_batch_size=0,
                 enable_prefix_cache=True)
    eng.debug_skip_residual = broken
    counts = np.zeros((VOCAB, VOCAB, VOCAB))
    accepted = set()
    batch = 1000
    for start in range(0, n, batch):
        ps = [dataclasses.replace(params, seed=10_000_019 + start + i) for i in range(batch)]
        for r in eng.generate([PROMPT] * batch, ps):
            counts[tuple(r.token_ids[:3])] += 1
            accepted.add(r.stats.accepted_tokens)
    return counts, accepted


@pytest.mark.slow
@pytest.mark.parametrize("gamma", [2, 3])
def test_sampled_speculation_is_lossless_on_the_first_three_tokens(models, gamma):
    """The first three tokens through the engine (a sampled draft chain of 2 or 3 tokens per step):
    the third token is decided at depth 2 of the first step's chain, or in a later step that starts
    at whatever position the first one reached (the Philox counter of a later step, after
    rejections); the joint of all three must be the target's (216 cells). The broken rule must
    fail the same test."""
    target, draft = models
    params = SamplingParams(max_tokens=3, temperature=1.0)
    probs = exact_joint3(target, params)
    counts, accepted = sample_joint3(target, draft, params, 30_000, gamma)
    assert {0, 1, 2} <= accepted  # third tokens both from inside a step and from a later step
    p = chi_square_p(counts, probs)
    assert p > 1e-3, f"speculative sampling differs from the target (chi-square p = {p:.2e})"
    counts, _ = sample_joint3(target, draft, params, 10_000, gamma, broken=True)
    p = chi_square_p(counts, probs)
    assert p < 1e-6, f"the broken rule went undetected (p = {p:.2e})"


@pytest.mark.parametrize("drafter", ["ngram", "lookahead", "draft-model-tree", "self-tree",
                                     "suffix"])
def test_deterministic_drafts_sample_exactly_what_plain_decoding_samples(models, drafter):
    """Deterministic drafts (prompt lookup; top-k trees of a draft model) are verified by the
    target-only walk, which samples every position with the draw plain decoding uses there (draws
    keyed by sequence position). So for a seed the sampled output equals plain sampling's token for
    token, in a batch, with temperature / top-k / top-p, and whatever the draft lengths were: fixed
    at 1 or 4, or chosen by the adaptive policy from measured timings."""
    target, draft = models
    prompts = [PROMPT, [1, 2, 3, 1, 2, 3, 1, 2], [5, 5, 5, 5], [0, 1, 2, 3, 4, 5, 0, 1]] * 3
    params = [SamplingParams(max_tokens=24, temperature=[1.0, 0.7, 1.3][i % 3],
                             top_k=[0, 4, 0][i % 3], top_p=[1.0, 1.0, 0.9][i % 3], seed=100 + i)
              for i in range(len(prompts))]

    def run(make_drafter, **kw):
        runner = ModelRunner(target, num_blocks=256, block_size=4)
        eng = Engine(runner, drafter=make_drafter(runner) if make_drafter else None, **kw)
        res = eng.generate(prompts, params)
        return [r.token_ids for r in res], eng.stats

    plain, _ = run(None)
    other = None  # a corpus drafter's text: other samples of the same prompts (often right)
    if drafter == "suffix":
        alt = [dataclasses.replace(p, seed=p.seed + 1000) for p in params]
        runner = ModelRunner(target, num_blocks=256, block_size=4)
        other = [r.token_ids for r in Engine(runner).generate(prompts, alt)]
    makers = {
        "ngram": lambda runner: "ngram",
        "lookahead": lambda runner: "lookahead@window=3",
        "draft-model-tree": lambda runner: ModelDrafter(draft, runner, width=2, max_depth=4),
        "self-tree": lambda runner: ModelDrafter(target, runner, width=2, max_depth=4),
        "suffix": lambda runner: SuffixDrafter(
            _C.SuffixIndex(np.array([t for p, o in zip(prompts, other) for t in p + o], np.int32),
                           np.cumsum([0] + [len(p) + len(o) for p, o in zip(prompts, other)])),
            max_nodes=6, max_depth=4),
    }
    accepted = 0
    for kw in (dict(gamma=1, adaptive=False), dict(gamma=4, adaptive=False), dict(gamma=4)):
        out, st = run(makers[drafter], **kw)
        for i, (a, b) in enumerate(zip(out, plain)):
            assert a == b, (drafter, kw, i)
        assert st.draft_tokens > 0, (drafter, kw)
        accepted += st.accepted_tokens
    assert accepted > 0  # drafts were taken, so positions were decided inside trees
