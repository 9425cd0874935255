"""Batch invariance of greedy output: ``pyspec.LLM.generate`` over many prompts gives each prompt
the tokens it gets when generated alone, in plain decoding and with speculative decoding.

A batch changes how the target's rows are computed: a step runs every request's rows (prefill
chunks, decode roots, draft trees) through one forward, and ``pyspec.linear`` sends more than
``max_fast_rows`` rows to torch's GEMM instead of the core kernel, so a request's logits differ
from the single-request ones by float rounding (so does attention, which sums a request's
committed prefix and a prefill chunk's rows separately: chunk boundaries move that split; a draft
tree's nodes are scored exactly as single-token decode steps, see test_tree_exactness.py). Measured on the default model (8 MT-bench first
turns x 32 tokens through the engine): at most 6e-5 in logits of magnitude ~10-30, against a
smallest top-2 gap of 1.8e-3 over 20 x 128 greedy tokens, and no divergence in 20 x 128 tokens
as a batch of 20 vs alone, plain and with the default and ngram drafters. The rule:
outputs equal token for token; a divergence is accepted only at a measured near-tie of the
reference's top two logits (see ``helpers.assert_equal_up_to_near_ties``).

The fast test runs a tiny random model through batches that mix chunked prefill, decode roots and
draft trees, with requests joining while others decode (continuous batching); the slow one the
embedded default model on MT-bench first turns.
"""

import json
import os

import pytest
import torch

import pyspec
from pyspec.linear import max_fast_rows

from helpers import assert_equal_up_to_near_ties
from models_support import write_tiny_model

NEAR_TIE = 1e-2  # logits; batch-shape rounding differences are ~1e-5 (see the module docstring)

TEXTS = [
    "the cat sat on the mat. the cat sat on the",
    "abc abc abc abc",
    "x",
    "Once upon a time there was a parser that parsed and parsed; once upon a time there was a "
    "lexer that lexed and lexed, and the parser and the lexer",
    "1 2 3 4 5 6 7 8 9 10 11 12 13 14 15 16 17 18 19 20 21 22 23 24 25 26 27 28 29 30 31",
    "def f(x):\n    return x + 1\n\ndef g(x):\n    return f(x) * 2\n\ndef h(x):\n    return",
    "Speculative decoding drafts tokens and verifies them in one forward pass of the target.",
    "a quick brown fox jumps over the lazy dog " * 4,
    "zz",
]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return write_tiny_model(tmp_path_factory.mktemp("tiny_bi"))


def _llm(path, draft, **kw):
    return pyspec.LLM(path, draft=draft, kv_cache_tokens=4096, progress=False, **kw)


def _trace_steps(llm):
    """Record (rows, decode rows, draft-tree nodes) of every engine step that ran a forward."""
    steps = []

    def hook(tr):
        dec = sum(d[0] + 1 for d in tr.decisions.values())
        nodes = sum(d[0] for d in tr.decisions.values())
        steps.append((sum(tr.prefill.values()) + dec, dec, nodes))

    llm.engine.trace_hook = hook
    return steps


@pytest.mark.parametrize("draft", ["none", "ngram", "default"])
def test_greedy_batch_equals_each_prompt_alone(model_dir, draft):
    # 9 requests, at most 5 at a time and 80 batched tokens: prompts are prefilled in chunks
    # alongside other requests' decode steps and draft trees, and requests join as others
    # finish (each has its own max_tokens).
    params = [pyspec.SamplingParams(max_tokens=24 + 3 * i, ignore_eos=True)
              for i in range(len(TEXTS))]
    batch_llm = _llm(model_dir, draft, max_num_seqs=5, max_num_batched_tokens=80)
    steps = _trace_steps(batch_llm)
    batch = batch_llm.generate(TEXTS, params)
    # Decode rows (and draft trees) ran both in steps past the core kernel's row limit, whose
    # dense layers use torch's GEMM, and in steps within it (the core kernel), as they do alone.
    limit = max_fast_rows(torch.float32)
    assert any(rows > limit and dec for rows, dec, _ in steps)
    assert any(rows <= limit and dec for rows, dec, _ in steps)
    if draft != "none":
        assert any(rows > limit and nodes for rows, _, nodes in steps)

    alone_llm = _llm(model_dir, draft)
    alone = [alone_llm.generate([t], p)[0] for t, p in zip(TEXTS, params)]

    prompts = [o.prompt_token_ids for o in alone]
    assert [o.prompt_token_ids for o in batch] == prompts
    for b, a, p in zip(batch, alone, params):
        assert len(b.token_ids) == len(a.token_ids) == p.max_tokens
    identical, ties = assert_equal_up_to_near_ties(
        batch_llm.model, prompts, [o.token_ids for o in batch], [o.token_ids for o in alone],
        NEAR_TIE, what=f"draft={draft}: ")
    assert identical >= len(TEXTS) - 1, f"only {identical} identical outputs; near-ties {ties}"
    if draft != "none":
        assert sum(o.stats.draft_tokens for o in batch) > 0
        assert sum(o.stats.accepted_tokens for o in batch) > 0


# ---- the embedded default model (slow) ----------------------------------------------------------

HERE = os.path.dirname(os.path.abspath(__file__))
PROMPTS_FILE = os.path.join(HERE, "..", "..", "..", "bench", "data", "mt_bench_questions.jsonl")
SLOW_PROMPTS = 4
SLOW_TOKENS = 32


@pytest.mark.slow
def test_default_model_greedy_batch_equals_each_prompt_alone():
    """4 MT-bench first turns (spread over the file) x 32 tokens on the default model, one at a
    time and as one batch, plain and with the ``default`` and ``ngram`` drafters; every output
    against plain decoding of the prompt alone. The prefix cache is off, so the batch computes its
    prompts itself rather than reusing the blocks of the runs alone. The drafters draft at their
    fixed lengths (not adaptive): on these short requests, and in a batch of 4 on 2 cores, the cost
    model rightly stops drafts that do not pay, and the test is about the steps that verify them."""
    rows = [json.loads(line) for line in open(PROMPTS_FILE, encoding="utf-8") if line.strip()]
    rows = rows[::len(rows) // SLOW_PROMPTS][:SLOW_PROMPTS]
    params = pyspec.SamplingParams(max_tokens=SLOW_TOKENS, ignore_eos=True)
    ref = None
    for draft in ("none", "default", "ngram"):
        llm = pyspec.LLM(None, draft=draft, kv_cache_tokens=2048, enable_prefix_cache=False,
                         spec=pyspec.SpecConfig(adaptive=False), progress=False)
        if ref is None:
            ids = [llm.chat_prompt([{"role": "user", "content": r["turns"][0]}]) for r in rows]
        alone = [llm.generate([p], params)[0] for p in ids]
        batch = llm.generate(ids, params)
        if ref is None:
            ref = llm
            plain_alone = [o.token_ids for o in alone]
        else:
            for outs in (alone, batch):
                assert all(o.stats.drafts > 0 for o in outs)
            assert sum(o.stats.accepted_tokens for o in alone + batch) > 0
        for what, outs in (("alone", alone), ("batch", batch)):
            identical, ties = assert_equal_up_to_near_ties(
                ref.model, ids, [o.token_ids for o in outs], plain_alone, NEAR_TIE,
                what=f"{draft} {what}: ")
            assert identical >= SLOW_PROMPTS - 1, f"{draft} {what}: near-ties {ties}"
