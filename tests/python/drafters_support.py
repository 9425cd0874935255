"""Drafters on the tiny random target for the drafter and engine tests: the prompts and the plain
greedy outputs drafting must reproduce, drafter folders (EAGLE / Medusa heads, a corpus), every
drafter kind by name, and scripted drafters that fail, or draft on some steps only."""

import dataclasses
import os

import pytest
import torch

from pyspec.drafters import (Draft, Drafter, EagleDrafter, LayerSkipDrafter, MedusaDrafter,
                             ModelDrafter, load_heads, save_heads)
from pyspec.models.llama import LlamaForCausalLM
from pyspec.runner import ModelRunner

from helpers import default_prompt, tiny_config
from reference import decode_one


MAX_TOKENS = 24


@pytest.fixture(scope="module")
def model():
    """The tiny random target (a fixture of drafters/ and engine/, through their conftest)."""
    return LlamaForCausalLM.random(tiny_config(), seed=0)


def prompts():
    a = default_prompt(length=40, seed=1)
    b = default_prompt(length=40, seed=5)
    return [a[:n] for n in (2, 11, 25, 40)] + [b[:n] for n in (7, 30)] + [a[:16] + b[:9]]


@pytest.fixture(scope="module")
def plain(model):
    """Plain greedy decoding of every prompt by ``model``."""
    runner = ModelRunner(model, num_blocks=64, block_size=8)
    return [decode_one(runner, p, MAX_TOKENS).tokens for p in prompts()]


def _heads_dir(tmp, model, method):
    cfg = model.cfg
    if method == "medusa":
        t = MedusaDrafter.random_weights(cfg.hidden_size, 3, seed=1, scale=0.5)
        conf = {"hidden_size": cfg.hidden_size, "vocab_size": cfg.vocab_size,
                "medusa": {"num_heads": 3, "tree": [[0], [1], [0, 0], [1, 0], [0, 0, 0], [0, 1]]}}
    else:  # "eagle", or "eagle-fused": reading target layers 1 and 2 (EAGLE-3 style)
        fused = method == "eagle-fused"
        t = EagleDrafter.random_weights(cfg, seed=2, intermediate_size=128,
                                        num_feature_layers=2 if fused else 1)
        conf = {"hidden_size": cfg.hidden_size, "vocab_size": cfg.vocab_size,
                "eagle": {"intermediate_size": 128, **({"feature_layers": [1, 2]} if fused
                                                       else {})},
                "defaults": {"width": 3, "max_depth": 4, "max_nodes": 10}}
    return save_heads(os.path.join(tmp, method), method.split("-")[0], t, conf)


def _suffix_dir(tmp, model, plain):
    """A corpus drafter over the plain outputs (so drafts are often right) and random text (so
    trees branch)."""
    from pyspec.drafters.suffix import save_corpus

    g = torch.Generator().manual_seed(4)
    noise = [torch.randint(0, model.cfg.vocab_size, (30,), generator=g).tolist() for _ in range(6)]
    docs = [p + o for p, o in zip(prompts(), plain)] + noise
    return save_corpus(os.path.join(tmp, "suffix"), docs, model.cfg.vocab_size,
                       defaults={"max_nodes": 6, "max_depth": 4})


def _drafter(kind, runner, model, tmp, plain=None):
    if kind == "ngram":
        return "ngram"
    if kind == "lookahead":
        return "lookahead"
    if kind == "lookahead-pure":  # the iteration's own n-grams alone, a wide window
        return "lookahead@window=6,ngram=4,pool=8,nodes=12,context=0"
    if kind == "ngram|lookahead":
        return "ngram|lookahead@window=3"
    if kind == "suffix":
        return _suffix_dir(tmp, model, plain)
    if kind == "ngram|suffix":  # through the spec syntax, with options
        return "ngram|" + _suffix_dir(tmp, model, plain) + "@nodes=4,depth=3,match=6"
    if kind == "layer-skip":
        return LayerSkipDrafter(runner, 1, max_depth=4)
    if kind == "draft-model-self":  # the target itself: everything is accepted
        return ModelDrafter(LlamaForCausalLM.random(model.cfg, seed=0), runner, max_depth=4)
    if kind == "draft-model":
        small = dataclasses.replace(model.cfg, num_hidden_layers=1)
        return ModelDrafter(LlamaForCausalLM.random(small, seed=3), runner, max_depth=4)
    if kind == "draft-model-tree":
        return ModelDrafter(LlamaForCausalLM.random(model.cfg, seed=0), runner, width=3,
                            max_depth=3)
    if kind in ("medusa", "eagle", "eagle-fused"):
        return load_heads(_heads_dir(tmp, model, kind), runner)
    if kind == "medusa+eagle-fused":  # parts reading different target layers
        return _heads_dir(tmp, model, "medusa") + "+" + _heads_dir(tmp, model, "eagle-fused")
    if kind == "ngram+eagle":  # merged trees, through the spec syntax
        return "ngram+" + _heads_dir(tmp, model, "eagle")
    if kind == "ngram|eagle":  # prompt lookup, else the head
        return "ngram|" + _heads_dir(tmp, model, "eagle")
    raise AssertionError(kind)


class Exploding(Drafter):
    """Fails on the requests ``bad_ids`` as ``mode`` says: raises, or returns a malformed draft
    (a NaN, out-of-vocabulary or ill-formed tree, or sampled-children probabilities the acceptance
    refuses: rows summing to 2, an integer tensor, a child of probability 0, two siblings with
    one token), or its ``node_budget`` raises. Other requests get a two-token chain."""

    name = "exploding"
    BAD_PROBS = ("sum", "int", "zero", "repeat")

    def __init__(self, bad_ids, mode):
        self.bad, self.mode = set(bad_ids), mode
        self.seen = 0
        self.budget_calls = 0

    def node_budget(self, depth):
        self.budget_calls += 1
        if self.mode == "budget" and self.budget_calls == 2:
            raise ZeroDivisionError("budget crashed")
        return depth

    def propose(self, reqs):
        out = []
        for r in reqs:
            self.seen += 1
            if r.request_id in self.bad:
                if self.mode == "raise":
                    raise RuntimeError("drafter crashed")
                if self.mode == "nan":
                    probs = torch.full((2, 111), float("nan"))
                    out.append(Draft([r.context[-1], 1], [-1, 0], probs))
                    continue
                if self.mode in self.BAD_PROBS:
                    probs = torch.full((3, 111), 1.0 / 111)
                    kids = [1, 2]
                    if self.mode == "sum":
                        probs *= 2
                    elif self.mode == "int":
                        probs = torch.ones((3, 111), dtype=torch.int64)
                    elif self.mode == "zero":
                        probs[0, 2] = 0.0
                        probs[0, 1] += 1.0 / 111
                    else:
                        kids = [1, 1]
                    out.append(Draft([r.context[-1]] + kids, [-1, 0, 0], probs))
                    continue
                if self.mode == "token":
                    out.append(Draft([r.context[-1], 5000], [-1, 0]))
                    continue
                if self.mode == "tree":
                    out.append(Draft([r.context[-1], 1, 2], [-1, 2, 0]))
                    continue
            n = min(2, r.budget)
            out.append(Draft([r.context[-1], 3, 4][:n + 1], [-1, 0, 1][:n + 1]))
        return out


class SomeSteps(Drafter):
    """Drafts with ``inner`` only when the context's length is 0, 1 or 2 modulo 5, and says so
    beforehand (a fully accepted depth-3 draft adds 4 tokens, a miss 1: the parts alternate)."""

    name = "some-steps"

    def __init__(self, inner):
        self.inner = inner
        self.max_draft_depth = inner.max_draft_depth

    def draft_source(self, context):
        return 0 if len(context) % 5 < 3 else None

    def kv_pools(self):
        return self.inner.kv_pools()

    def prefill(self, chunks):
        self.inner.prefill(chunks)

    def observe(self, results):
        self.inner.observe(results)

    def release(self, request_id):
        self.inner.release(request_id)

    def propose(self, reqs):
        out = self.inner.propose(reqs)
        return [d if self.draft_source(r.context) is not None else Draft([r.context[-1]], [-1])
                for r, d in zip(reqs, out)]


class RightForK(Drafter):
    """Drafts the target's own greedy continuation for the first ``k`` tokens of every draft, then
    one wrong token (so a greedy target accepts exactly ``min(k, draft length)`` of each draft).
    ``k`` is ``ks[request_id % len(ks)]``; ``model`` (the target) may be set after construction.
    ``log[request_id]`` lists, per draft proposed, how many of its tokens were right."""

    name = "right-for-k"

    def __init__(self, ks, model=None, max_depth: int = 4):
        self.ks = list(ks)
        self.model = model
        self.max_draft_depth = max_depth
        self.log = {}

    def expected_per_position(self, request_ids=None):
        """Per-position acceptance counts the log implies: [drafts with >= j right tokens]."""
        rights = [c for rid, cs in self.log.items()
                  if request_ids is None or rid in request_ids for c in cs]
        depth = max(rights, default=0)
        return [sum(c >= j for c in rights) for j in range(1, depth + 1)]

    def propose(self, reqs):
        from pyspec.runner import ModelRunner

        out = []
        for r in reqs:
            k = self.ks[r.request_id % len(self.ks)]
            n = min(r.budget, r.depth_limit, k + 1)
            if n < 1:
                out.append(Draft([r.context[-1]], [-1]))
                continue
            ctx = list(r.context)
            runner = ModelRunner(self.model, num_blocks=len(ctx) // 8 + 4, block_size=8)
            greedy = decode_one(runner, ctx, k + 1).tokens
            chain = greedy[:k] + [(greedy[k] + 1) % self.model.cfg.vocab_size]
            self.log.setdefault(r.request_id, []).append(min(k, n))
            out.append(Draft([r.context[-1]] + chain[:n], list(range(-1, n))))
        return out
