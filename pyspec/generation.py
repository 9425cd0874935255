"""Loading a model + tokenizer and generating text for one prompt (what ``pyspec generate`` runs).

Speculation here is prompt lookup (n-gram drafts, no weights) verified as a tree by the target; the
batched engine with every drafter, adaptive speculation and ``pyspec.LLM`` builds on the same
runner. Output is lossless: greedy output equals plain greedy output, sampled output has the
distribution of plain sampling.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from typing import Callable, Optional

from pyspec.decode import DecodeResult, decode_one, prompt_lookup_drafter
from pyspec.models.llama import LlamaForCausalLM
from pyspec.runner import ModelRunner
from pyspec.tokenizer import Tokenizer

DRAFTERS = ("ngram", "none")


@dataclass
class Loaded:
    model: LlamaForCausalLM
    tokenizer: Tokenizer
    runner: ModelRunner
    path: str
    load_seconds: float


def load(model: Optional[str] = None, dtype: str = "float32", num_blocks: int = 1024,
         block_size: int = 16, progress: bool = True, device: str = "cpu") -> Loaded:
    """Load a model folder (default: the embedded SmolLM2-135M-Instruct, converted on first use)
    onto ``device`` ("cpu", "cuda", "cuda:N"; see ``pyspec.models.llama.resolve_device``)."""
    t0 = time.perf_counter()
    if model is None or model == "default":
        from pyspec.models.default import default_model_path

        path = default_model_path(progress=progress)
    else:
        path = os.path.expanduser(model)
        if not os.path.isdir(path):
            raise ValueError(f"--model must be a model folder (config.json, *.safetensors, "
                             f"tokenizer.json) or 'default'; {path!r} is not a directory")
    m = LlamaForCausalLM.from_pretrained(path, dtype=dtype, device=device)
    tok = Tokenizer.from_pretrained(path)
    return Loaded(m, tok, ModelRunner(m, num_blocks, block_size), path, time.perf_counter() - t0)


def encode_prompt(tok: Tokenizer, prompt: str, chat: bool = True):
    if not isinstance(prompt, str) or not prompt:
        raise ValueError("the prompt must be a non-empty string")
    if chat and tok.chat_template:
        return tok.encode_chat([{"role": "user", "content": prompt}], add_generation_prompt=True)
    return tok.encode(prompt)


def run(loaded: Loaded, prompt_ids, *, draft: str = "ngram", gamma: int = 5,
        max_tokens: int = 128, temperature: float = 0.0, top_p: float = 1.0, top_k: int = 0,
        min_p: float = 0.0, seed: int = 0,
        on_text: Optional[Callable[[str], None]] = None) -> DecodeResult:
    if draft not in DRAFTERS:
        raise ValueError(f"draft must be one of {DRAFTERS}; got {draft!r}")
    drafter = prompt_lookup_drafter() if draft == "ngram" else None
    inc = loaded.tokenizer.incremental_decoder()

    def stream(tokens):
        if on_text is not None:
            text = "".join(inc.push(t) for t in tokens)
            if text:
                on_text(text)

    res = decode_one(loaded.runner, prompt_ids, max_tokens, drafter=drafter,
                     gamma=gamma if drafter else 0, eos_token_ids=loaded.tokenizer.eos_token_ids,
                     temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p, seed=seed,
                     on_tokens=stream)
    if on_text is not None:
        tail = inc.flush()
        if tail:
            on_text(tail)
    return res
