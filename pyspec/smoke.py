"""``pyspec smoke``: the data plane end to end on a tiny random-weight Llama model, no download.

Greedy generation twice through one engine each: plain decoding, and prompt-lookup speculative
decoding (drafts of up to ``gamma`` tokens, starting at ``gamma``; without adaptive speculation's
cost model) whose chains are verified with tree attention over the paged KV.
Reports whether both outputs are identical, the acceptance length and the speedup. A tiny model's
step is dominated by per-step overhead, so its speed says little about real models.
"""

from __future__ import annotations

import time
from typing import List

import torch

from pyspec.engine import Engine
from pyspec.models.config import ModelConfig
from pyspec.models.llama import LlamaForCausalLM
from pyspec.params import SamplingParams
from pyspec.runner import ModelRunner


def _tiny_model(vocab: int, seed: int) -> LlamaForCausalLM:
    cfg = ModelConfig.from_dict(dict(
        architectures=["LlamaForCausalLM"], vocab_size=vocab, hidden_size=256, intermediate_size=512,
        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, rms_norm_eps=1e-6,
        max_position_embeddings=4096, tie_word_embeddings=False), source="smoke")
    return LlamaForCausalLM.random(cfg, seed=seed)


def _prompt(vocab: int, seed: int, length: int = 48) -> List[int]:
    """Repeated phrases: the input prompt lookup is made for."""
    g = torch.Generator().manual_seed(seed)
    phrase = torch.randint(0, vocab, (8,), generator=g).tolist()
    noise = torch.randint(0, vocab, (length,), generator=g).tolist()
    return (phrase + noise[:8]) * (length // 16) + phrase


def main(max_new_tokens: int = 96, gamma: int = 6, seed: int = 0) -> dict:
    vocab = 111
    model = _tiny_model(vocab, seed)
    prompt = _prompt(vocab, seed + 1)
    params = SamplingParams(max_tokens=max_new_tokens)

    def engine(draft):
        return Engine(ModelRunner(model, num_blocks=64, block_size=16),
                      drafter=draft if gamma > 0 else "none", gamma=gamma or None, adaptive=False,
                      **({"initial_draft_tokens": gamma} if gamma > 0 else {}))

    plain_eng, spec_eng = engine("none"), engine("ngram")
    for eng in (plain_eng, spec_eng):  # warm-up
        eng.generate([prompt], SamplingParams(max_tokens=8))

    def run(eng):
        t0 = time.perf_counter()
        res = eng.generate([prompt], params)[0]
        return res, time.perf_counter() - t0

    plain, plain_s = run(plain_eng)
    spec, spec_s = run(spec_eng)
    st = spec.stats
    return dict(
        prompt=prompt,
        plain_tokens=plain.token_ids,
        spec_tokens=spec.token_ids,
        identical=plain.token_ids == spec.token_ids,
        acceptance_length=st.acceptance_length,
        draft_acceptance_rate=st.accepted_tokens / max(st.draft_tokens, 1),
        plain_tok_per_s=len(plain.token_ids) / plain_s,
        spec_tok_per_s=len(spec.token_ids) / spec_s,
        speedup=plain_s / spec_s,
        plain_steps=plain.stats.steps,
        spec_steps=st.steps,
    )
