"""Helpers of the train-draft / eval-draft tests: a short training run, an EAGLE head with
perturbed weights, bench/ scripts imported as modules, and the lossless check of a drafter."""

import os

import torch

from pyspec import cli


def _train(target, out, seed=0, epochs=1):
    rc = cli.main(["train-draft", "--target", target, "--out", out, "--prompts", "12",
                   "--max-tokens", "12", "--batch", "6", "--epochs", str(epochs), "--draft-vocab",
                   "80", "--intermediate-size", "32", "--tree-nodes", "8", "--seed", str(seed)])
    assert rc == 0
    return out


def _random_head(target, kv_cache_tokens=512):
    """The tiny target and an EAGLE head on it with perturbed (not freshly initialised) weights."""
    import pyspec
    from pyspec.train.eagle import EagleHead

    llm = pyspec.LLM(target, draft="none", kv_cache_tokens=kv_cache_tokens)
    torch.manual_seed(0)
    head = EagleHead(llm.model, torch.arange(40), 32)
    with torch.no_grad():
        for p in head.parameters():
            p.add_(torch.randn_like(p) * 0.3)
    return llm, head


def _bench_module(name):
    """A script of bench/ imported as a module."""
    import importlib.util

    path = os.path.join(os.path.dirname(__file__), "..", "..", "bench", name + ".py")
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _lossless(target, draft, prompts=("the cat sat on the mat", "abc abc"), max_tokens=12):
    """Greedy output with ``draft`` equals plain greedy output; returns (drafting LLM, plain)."""
    import pyspec

    llm = pyspec.LLM(target, draft=draft, kv_cache_tokens=2048)
    ref = pyspec.LLM(target, draft="none", kv_cache_tokens=2048)
    p = list(prompts)
    assert [o.token_ids for o in llm.generate(p, {"max_tokens": max_tokens})] == \
        [o.token_ids for o in ref.generate(p, {"max_tokens": max_tokens})]
    return llm, ref
