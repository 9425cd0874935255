"""The reference decoding loop the batched engine is checked against: one request, plain or
speculative (a draft chain verified as a tree), straight on the runner and a block manager, with
none of the engine's scheduling, batching or adaptive speculation.

Per step: reserve KV capacity for the tree's depth + 1 tokens, run the root + draft nodes through
one forward (tree attention over the paged prefix), run acceptance (greedy at temperature 0; else
the lossless target-only walk, since these drafts are deterministic), materialize the accepted
path's K/V into the pages and commit the emitted tokens. Plain decoding is the same step with a
root-only tree, so both paths share every line.
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass, field
from typing import Callable, Iterable, List, Optional, Sequence

import torch

from pyspec import TokenTree, _C
from pyspec.drafters.ngram import prompt_lookup_match
from pyspec.runner import ModelRunner, SeqStep
from pyspec.sampling import accept, apply_sampling_filters

# A drafter for this loop: (context tokens, max draft length) -> draft chain tokens.
ChainDrafter = Callable[[List[int], int], List[int]]


@dataclass
class DecodeResult:
    tokens: List[int]
    seconds: float
    prefill_seconds: float
    steps: int
    drafted: int
    accepted: int
    finish_reason: str = "length"
    accepted_per_step: List[int] = field(default_factory=list)
    # With record_gaps: for each emitted token, the target's top-1 minus top-2 logit at the step
    # that produced it (how close to a tie the greedy choice was).
    logit_gaps: List[float] = field(default_factory=list)

    @property
    def acceptance_length(self) -> float:
        """Mean tokens emitted per target step (1 + accepted / steps; 1.0 for plain decoding)."""
        return len(self.tokens) / max(self.steps, 1)

    @property
    def decode_tokens_per_second(self) -> float:
        t = self.seconds - self.prefill_seconds
        return len(self.tokens) / t if t > 0 else float("inf")


def prompt_lookup_drafter(max_ngram: int = 3) -> ChainDrafter:
    """Prompt lookup as a chain drafter for :func:`decode_one`: the tokens that followed the latest
    earlier occurrence of the context's last n tokens (n = max_ngram..1)."""

    def draft(context: List[int], gamma: int) -> List[int]:
        n, where = prompt_lookup_match(context, max_ngram)
        return context[where:where + gamma] if n else []

    return draft


def decode_one(runner: ModelRunner, prompt: Sequence[int], max_new_tokens: int, *,
                  drafter: Optional[ChainDrafter] = None, gamma: int = 0,
                  eos_token_ids: Iterable[int] = (), prefill_chunk: int = 512,
                  temperature: float = 0.0, top_k: int = 0, top_p: float = 1.0, min_p: float = 0.0,
                  seed: int = 0, on_tokens: Optional[Callable[[List[int]], None]] = None,
                  record_gaps: bool = False) -> DecodeResult:
    """Decode one request. ``temperature == 0`` is greedy; otherwise the target is sampled after
    top-k / top-p / min-p, and speculative output has exactly the distribution of plain sampling.
    ``on_tokens`` receives each step's emitted tokens (streaming)."""
    if not (temperature >= 0.0) or temperature != temperature:
        raise ValueError(f"temperature must be >= 0; got {temperature}")
    if top_k < 0:
        raise ValueError(f"top_k must be >= 0 (0 = off); got {top_k}")
    if not 0.0 < top_p <= 1.0:
        raise ValueError(f"top_p must be in (0, 1]; got {top_p}")
    if not 0.0 <= min_p <= 1.0:
        raise ValueError(f"min_p must be in [0, 1]; got {min_p}")
    if not 0 <= gamma <= 64:
        raise ValueError(f"gamma must be in [0, 64] (a draft chain's depth limit); got {gamma}")
    prompt = [int(t) for t in prompt]
    if not prompt:
        raise ValueError("the prompt must hold at least one token")
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be >= 1; got {max_new_tokens}")
    vocab = runner.model.cfg.vocab_size
    bad = [t for t in prompt if not 0 <= t < vocab]
    if bad:
        raise ValueError(f"prompt token ids must be in [0, {vocab}); got {bad[:5]}")
    eos = set(int(e) for e in eos_token_ids)
    bs = runner.block_size
    needed = (len(prompt) + max_new_tokens + gamma + bs) // bs + 1
    if needed > runner.kv.num_blocks:
        raise ValueError(f"prompt + max_new_tokens need {needed} KV blocks; the pool has "
                         f"{runner.kv.num_blocks}")
    bm = _C.BlockManager(runner.kv.num_blocks, bs, enable_prefix_cache=False)
    rid = 0
    t0 = time.perf_counter()
    if bm.add_request(rid, prompt) < 0:
        raise ValueError("the KV pool is too small for the prompt")
    # Prefill all but the last prompt token (in chunks); the last one is the first step's root.
    done = 0
    while done < len(prompt) - 1:
        n = min(prefill_chunk, len(prompt) - 1 - done)
        bm.reserve(rid, 0)
        out = runner.step([SeqStep(prompt[done:done + n], done, bm.block_table(rid), None, "none")])
        runner.commit_kv(out, 0, range(n), bm.slots_for(rid, done, n))
        bm.mark_computed(rid, n)
        done += n
    t_prefill = time.perf_counter() - t0
    tokens: List[int] = []
    steps = drafted = accepted = 0
    per_step: List[int] = []
    gaps: List[float] = []
    finish = "length"
    # Small steps run torch's ops on one thread (see LlamaForCausalLM.step_threads).
    threads = getattr(runner.model, "step_threads", None)
    with threads(gamma + 1) if threads is not None else contextlib.nullcontext():
        while len(tokens) < max_new_tokens:
            context = bm.tokens(rid)
            room = max_new_tokens - len(tokens) - 1
            draft = drafter(context, min(gamma, room)) if drafter and gamma > 0 and room > 0 else []
            node_tokens = [context[-1]] + [int(t) for t in draft]
            tree = TokenTree.chain(len(draft))
            start = bm.num_computed(rid)
            if not bm.reserve(rid, len(node_tokens)):
                raise RuntimeError("KV pool exhausted")
            out = runner.step([SeqStep(node_tokens, start, bm.block_table(rid), tree, "all")])
            greedy = temperature == 0.0
            probs = apply_sampling_filters(out.logits, 1.0 if greedy else temperature, top_k, top_p,
                                           min_p)
            res = accept(probs, torch.tensor(node_tokens, dtype=torch.int32),
                         torch.tensor(tree.parents, dtype=torch.int32),
                         torch.tensor([0, len(node_tokens)]), greedy=greedy, seeds=seed,
                         offsets=len(context), sampled_children=False)
            n_acc = int(res.num_accepted[0])
            emitted = res.emitted_lists()[0]
            if record_gaps:
                # Emitted token j was chosen from the logits of accepted node j.
                path = res.accepted_nodes[0, :n_acc + 1].to(torch.int64)
                top2 = out.logits.index_select(0, path).topk(2, dim=-1).values
                gaps.extend((top2[:, 0] - top2[:, 1]).tolist())
            runner.commit_kv(out, 0, res.accepted_nodes[0, :n_acc + 1].tolist(),
                             bm.slots_for(rid, start, n_acc + 1))
            if not bm.commit(rid, emitted, num_computed=n_acc + 1):
                raise RuntimeError("KV pool exhausted")
            steps += 1
            drafted += len(draft)
            accepted += n_acc
            per_step.append(n_acc)
            kept = []
            for tok in emitted:
                kept.append(tok)
                if tok in eos:
                    finish = "stop"
                    break
            tokens.extend(kept)
            if on_tokens is not None:
                on_tokens(kept)
            if finish == "stop":
                break
    seconds = time.perf_counter() - t0
    bm.check_invariants()
    bm.free(rid)
    return DecodeResult(tokens[:max_new_tokens], seconds, t_prefill, steps, drafted, accepted,
                        finish, per_step, gaps[:len(tokens)])
