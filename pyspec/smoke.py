"""End-to-end smoke run of the core's data plane on a tiny random-weight Llama-style model.

It exercises, per step, exactly what the engine will do: the block manager reserves KV capacity,
a drafter proposes a token tree (here: prompt lookup, a chain), one forward of the target runs the
tree's nodes through tree attention over the paged KV (prefix from pages, tree part from scratch),
greedy acceptance picks the path, the accepted K/V are materialized into the pages and committed.
Plain decoding is the same loop with a root-only tree. Both runs must produce identical tokens.

This is a stand-in main job until the model layer and engine exist; it says nothing about the
speed of real models (a tiny model's step is dominated by per-step overhead).
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from typing import List, Optional

import torch

from pyspec import TokenTree, ops
from pyspec.attention import plan_attention, tree_attention
from pyspec.kv_cache import BlockManager
from pyspec.sampling import accept


@dataclass
class TinyConfig:
    vocab: int = 111
    hidden: int = 256
    layers: int = 2
    heads: int = 4
    kv_heads: int = 2
    head_dim: int = 64
    intermediate: int = 512
    rope_theta: float = 10000.0


class TinyLlama:
    """A random-weight Llama-style decoder (RMSNorm, RoPE, GQA, SwiGLU) on pyspec's paged KV."""

    def __init__(self, cfg: TinyConfig, seed: int = 0):
        self.cfg = cfg
        g = torch.Generator().manual_seed(seed)

        def w(*shape, std=None):
            std = std if std is not None else 1.0 / math.sqrt(shape[-1])
            return torch.randn(*shape, generator=g) * std

        c = cfg
        self.embed = w(c.vocab, c.hidden, std=1.0)
        self.layers = []
        for _ in range(c.layers):
            self.layers.append(dict(
                wq=w(c.heads * c.head_dim, c.hidden), wk=w(c.kv_heads * c.head_dim, c.hidden),
                wv=w(c.kv_heads * c.head_dim, c.hidden), wo=w(c.hidden, c.heads * c.head_dim),
                w1=w(c.intermediate, c.hidden), w3=w(c.intermediate, c.hidden),
                w2=w(c.hidden, c.intermediate)))
        self.lm_head = w(c.vocab, c.hidden, std=3.0 / math.sqrt(c.hidden))
        inv = 1.0 / (c.rope_theta ** (torch.arange(0, c.head_dim, 2).float() / c.head_dim))
        self.inv_freq = inv

    @staticmethod
    def _rms(x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)

    def _rope(self, x, positions):  # x [T, H, D]
        ang = positions.float()[:, None] * self.inv_freq[None, :]
        cos, sin = ang.cos()[:, None, :], ang.sin()[:, None, :]
        x1, x2 = x[..., 0::2], x[..., 1::2]
        out = torch.empty_like(x)
        out[..., 0::2] = x1 * cos - x2 * sin
        out[..., 1::2] = x1 * sin + x2 * cos
        return out

    def forward(self, tokens, positions, plan, k_pages, v_pages, k_new, v_new):
        """tokens/positions [T]; k_pages/v_pages [L, NB, bs, Hkv, D]; k_new/v_new [L, T, Hkv, D]
        are filled with this step's K/V. Returns logits [T, vocab]."""
        c = self.cfg
        t = tokens.shape[0]
        x = self.embed[tokens]
        for li, p in enumerate(self.layers):
            h = self._rms(x)
            q = self._rope((h @ p["wq"].T).view(t, c.heads, c.head_dim), positions)
            k_new[li] = self._rope((h @ p["wk"].T).view(t, c.kv_heads, c.head_dim), positions)
            v_new[li] = (h @ p["wv"].T).view(t, c.kv_heads, c.head_dim)
            a = tree_attention(plan, q.contiguous(), k_pages[li], v_pages[li], k_new[li], v_new[li])
            x = x + a.reshape(t, -1) @ p["wo"].T
            h = self._rms(x)
            x = x + (torch.nn.functional.silu(h @ p["w1"].T) * (h @ p["w3"].T)) @ p["w2"].T
        return self._rms(x) @ self.lm_head.T


def prompt_lookup_draft(context: List[int], gamma: int, max_ngram: int = 3) -> List[int]:
    """Prompt-lookup drafting: find the latest earlier occurrence of the context's last n tokens
    (n = max_ngram..1) and propose the tokens that followed it."""
    n_ctx = len(context)
    for n in range(min(max_ngram, n_ctx - 1), 0, -1):
        tail = context[n_ctx - n:]
        for start in range(n_ctx - n - 1, -1, -1):
            if context[start:start + n] == tail:
                follow = context[start + n:start + n + gamma]
                if follow:
                    return follow
    return []


@dataclass
class SmokeRun:
    tokens: List[int]
    seconds: float
    steps: int
    drafted: int
    accepted: int

    @property
    def acceptance_length(self) -> float:
        return len(self.tokens) / max(self.steps, 1)


def generate(model: TinyLlama, prompt: List[int], max_new_tokens: int, gamma: int,
             block_size: int = 16, num_blocks: Optional[int] = None) -> SmokeRun:
    """Greedy generation; gamma = 0 is plain decoding (root-only trees)."""
    c = model.cfg
    total = len(prompt) + max_new_tokens + gamma + 1
    num_blocks = num_blocks or (total + block_size - 1) // block_size + 1
    bm = BlockManager(num_blocks, block_size)
    shape = (c.layers, num_blocks, block_size, c.kv_heads, c.head_dim)
    k_pages, v_pages = torch.zeros(shape), torch.zeros(shape)
    rid = 0

    def run(new_tokens, start, parents):
        """One forward over new tokens at positions start.. (a causal chunk or a tree)."""
        n = len(new_tokens)
        table = torch.tensor([bm.block_table(rid)], dtype=torch.int32)
        if parents is None:
            tp, ti = None, None
            positions = torch.arange(start, start + n)
        else:
            tree = TokenTree(parents)
            tp = torch.tensor(parents, dtype=torch.int32)
            ti = torch.tensor([0, n], dtype=torch.int64)
            positions = start + torch.tensor(tree.depths)
        plan = plan_attention([0, n], [start], table, block_size, tp, ti, num_blocks,
                              num_q_heads=c.heads, num_kv_heads=c.kv_heads)
        k_new = torch.empty(c.layers, n, c.kv_heads, c.head_dim)
        v_new = torch.empty_like(k_new)
        logits = model.forward(torch.tensor(new_tokens), positions, plan, k_pages, v_pages,
                               k_new, v_new)
        return logits, k_new, v_new

    t0 = time.perf_counter()
    if bm.add_request(rid, prompt) < 0:
        raise ValueError("the KV pool is too small for the prompt")
    # Prefill everything but the last prompt token; that one is the first step's tree root.
    n_pre = len(prompt) - 1
    if n_pre > 0:
        bm.reserve(rid, 0)
        _, k_new, v_new = run(prompt[:n_pre], 0, None)
        rows = torch.arange(n_pre)
        ops.materialize_kv(k_new, k_pages, rows, torch.tensor(bm.slots_for(rid, 0, n_pre)))
        ops.materialize_kv(v_new, v_pages, rows, torch.tensor(bm.slots_for(rid, 0, n_pre)))
        bm.mark_computed(rid, n_pre)
    out: List[int] = []
    steps = drafted = accepted = 0
    while len(out) < max_new_tokens:
        context = bm.tokens(rid)
        draft = prompt_lookup_draft(context, gamma) if gamma > 0 else []
        draft = draft[: max_new_tokens - len(out) - 1] if len(out) + 1 < max_new_tokens else []
        parents = list(range(-1, len(draft)))
        node_tokens = [context[-1]] + draft
        start = bm.num_computed(rid)
        if not bm.reserve(rid, len(node_tokens)):
            raise RuntimeError("KV pool exhausted")
        logits, k_new, v_new = run(node_tokens, start, parents)
        res = accept(torch.softmax(logits.float(), -1), torch.tensor(node_tokens, dtype=torch.int32),
                     torch.tensor(parents, dtype=torch.int32), torch.tensor([0, len(node_tokens)]),
                     greedy=True, seeds=0)
        n_acc = int(res.num_accepted[0])
        path = res.accepted_nodes[0, : n_acc + 1].to(torch.int64)
        emitted = res.emitted_lists()[0]
        slots = torch.tensor(bm.slots_for(rid, start, n_acc + 1))
        ops.materialize_kv(k_new, k_pages, path, slots)
        ops.materialize_kv(v_new, v_pages, path, slots)
        if not bm.commit(rid, emitted, num_computed=n_acc + 1):
            raise RuntimeError("KV pool exhausted")
        out.extend(emitted)
        steps += 1
        drafted += len(draft)
        accepted += n_acc
    seconds = time.perf_counter() - t0
    bm.check_invariants()
    bm.free(rid)
    return SmokeRun(out[:max_new_tokens], seconds, steps, drafted, accepted)


def default_prompt(cfg: TinyConfig, length: int = 48, seed: int = 1) -> List[int]:
    """A prompt with repeated phrases, the kind of input prompt lookup is made for."""
    g = torch.Generator().manual_seed(seed)
    phrase = torch.randint(0, cfg.vocab, (8,), generator=g).tolist()
    noise = torch.randint(0, cfg.vocab, (length,), generator=g).tolist()
    return (phrase + noise[:8]) * (length // 16) + phrase


def main(max_new_tokens: int = 96, gamma: int = 6, seed: int = 0) -> dict:
    cfg = TinyConfig()
    model = TinyLlama(cfg, seed=seed)
    prompt = default_prompt(cfg, seed=seed + 1)
    generate(model, prompt, 8, gamma)  # warm-up (thread pool, allocator)
    plain = generate(model, prompt, max_new_tokens, 0)
    spec = generate(model, prompt, max_new_tokens, gamma)
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
