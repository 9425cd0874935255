"""End-to-end smoke run of the data plane on a tiny random-weight Llama model.

It runs greedy generation twice through the real runner — plain decoding, and prompt-lookup
speculative decoding whose draft chains are verified with tree attention over the paged KV — and
reports whether both outputs are identical, the acceptance length and the speedup. It is the main
job until the engine and the embedded default model take over; a tiny model's step is dominated by
per-step overhead, so its speed says little about real models.
"""

from __future__ import annotations

from typing import List

import torch

from pyspec.decode import decode_one, prompt_lookup_drafter
from pyspec.models.config import ModelConfig
from pyspec.models.llama import LlamaForCausalLM
from pyspec.runner import ModelRunner


def tiny_config(vocab: int = 111) -> ModelConfig:
    return ModelConfig.from_dict(dict(
        architectures=["LlamaForCausalLM"], vocab_size=vocab, hidden_size=256, intermediate_size=512,
        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, rms_norm_eps=1e-6,
        max_position_embeddings=4096, tie_word_embeddings=False), source="tiny")


def default_prompt(vocab: int = 111, length: int = 48, seed: int = 1) -> List[int]:
    """A prompt with repeated phrases, the kind of input prompt lookup is made for."""
    g = torch.Generator().manual_seed(seed)
    phrase = torch.randint(0, vocab, (8,), generator=g).tolist()
    noise = torch.randint(0, vocab, (length,), generator=g).tolist()
    return (phrase + noise[:8]) * (length // 16) + phrase


def main(max_new_tokens: int = 96, gamma: int = 6, seed: int = 0) -> dict:
    cfg = tiny_config()
    model = LlamaForCausalLM.random(cfg, seed=seed)
    runner = ModelRunner(model, num_blocks=64, block_size=16)
    prompt = default_prompt(cfg.vocab_size, seed=seed + 1)
    drafter = prompt_lookup_drafter()
    decode_one(runner, prompt, 8, drafter=drafter, gamma=gamma)  # warm-up
    plain = decode_one(runner, prompt, max_new_tokens)
    spec = decode_one(runner, prompt, max_new_tokens, drafter=drafter, gamma=gamma)
    return dict(
        prompt=prompt,
        plain_tokens=plain.tokens,
        spec_tokens=spec.tokens,
        identical=plain.tokens == spec.tokens,
        acceptance_length=spec.acceptance_length,
        draft_acceptance_rate=spec.accepted / max(spec.drafted, 1),
        plain_tok_per_s=len(plain.tokens) / plain.seconds,
        spec_tok_per_s=len(spec.tokens) / spec.seconds,
        speedup=plain.seconds / spec.seconds,
        plain_steps=plain.steps,
        spec_steps=spec.steps,
    )
