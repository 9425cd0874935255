from typing import List

import pytest
import torch


def devices():
    """Device parameters for 'one test body per device' tests: cpu always, cuda marked."""
    return ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)]


def run_interpreted(test_file: str, call: str) -> None:
    """Runs ``call`` (e.g. ``"run_all('cpu')"``) of the test module ``test_file`` in a child
    process with Triton's interpreter on (``TRITON_INTERPRET=1``, read once when Triton is
    imported: a whole-process switch); its failure fails the calling test."""
    import os
    import subprocess
    import sys

    import pyspec

    here = os.path.dirname(os.path.abspath(test_file))
    # The child imports the pyspec this process imported (an installed wheel, or a built
    # checkout), and runs where no source tree shadows it.
    package_root = os.path.dirname(os.path.dirname(os.path.abspath(pyspec.__file__)))
    env = dict(os.environ, TRITON_INTERPRET="1",
               PYTHONPATH=os.pathsep.join([package_root, here, os.path.dirname(here),
                                           os.environ.get("PYTHONPATH", "")]))
    module = os.path.splitext(os.path.basename(test_file))[0]
    code = f"import {module} as t; t.{call}; print('all cases passed')"
    r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                       timeout=900, cwd=here)
    assert r.returncode == 0 and "all cases passed" in r.stdout, r.stdout[-3000:] + \
        r.stderr[-6000:]


def missing_isa(isa: str, why: str) -> None:
    """A kernel build (ISA) this CPU lacks: a visible skip, or a failure where the environment
    says the ISA must be there (``PYSPEC_EXPECT_ISAS=generic,avx2,avx512``, set by .ci/run for
    the machines CI runs on), so a path never drops out of the tests unnoticed."""
    import os

    expected = {x.strip() for x in os.environ.get("PYSPEC_EXPECT_ISAS", "").split(",") if x}
    if isa in expected:
        pytest.fail(f"PYSPEC_EXPECT_ISAS names {isa}, but this CPU has no {isa} build: {why}")
    pytest.skip(f"no {isa} build on this CPU: {why}")


def _missing_dependency(what: str, why: str) -> None:
    """Skip for a missing optional test dependency — except under CI (CI=true), where a missing
    dependency would silently turn real checks into skips, so it fails instead."""
    import os

    if os.environ.get("CI", "").lower() in ("1", "true", "yes"):
        pytest.fail(f"test dependency {what} is missing in CI (see .ci/run)")
    pytest.skip(why, allow_module_level=True)


def require_module(name: str) -> None:
    """Skip when an optional test dependency is not installed (under CI: fail). Callable in a
    test or at a test module's import (then the whole module skips, or fails under CI)."""
    import importlib.util

    try:
        found = importlib.util.find_spec(name) is not None
    except ModuleNotFoundError:  # a dotted name ("opentelemetry.sdk") whose parent is missing
        found = False
    if not found:
        _missing_dependency(f"'{name}'", f"'{name}' is not installed")


def require_program(name: str) -> str:
    """The path of program ``name`` on PATH; skip without it (under CI: fail), like
    :func:`require_module`."""
    import shutil

    path = shutil.which(name)
    if path is None:
        _missing_dependency(f"program '{name}'", f"program '{name}' is not on PATH")
    return path


# ---- tiny random models ---------------------------------------------------------------------------


def tiny_config(vocab: int = 111):
    """A 2-layer Llama config (hidden 256, 4 heads, 2 KV heads) for random-weight models."""
    from pyspec.models.config import ModelConfig

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


# ---- greedy equality up to measured near-ties ---------------------------------------------------


def first_divergence(a, b):
    """Index of the first position where token lists ``a`` and ``b`` differ (the shorter length
    when one is a prefix of the other), or None when they are equal."""
    if list(a) == list(b):
        return None
    return next((j for j, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def reference_top2(model, context, block_size: int = 16):
    """(top-1 minus top-2 logit, (top-1 token, top-2 token)) of ``model``'s next-token logits after
    ``context``, from one plain causal forward of the whole context on a fresh runner."""
    from pyspec.runner import ModelRunner, SeqStep

    blocks = len(context) // block_size + 1
    runner = ModelRunner(model, num_blocks=blocks, block_size=block_size)
    out = runner.step([SeqStep(list(context), 0, list(range(blocks)), None, "last")])
    vals, idx = out.logits[-1].topk(2)
    return float(vals[0] - vals[1]), (int(idx[0]), int(idx[1]))


def assert_equal_up_to_near_ties(model, prompts, outputs, references, near_tie: float,
                                 what: str = ""):
    """Greedy outputs must equal their references token for token; a divergence is accepted only
    where the target's top two logits (nearly) tie: at the first differing position, a plain
    forward of the prompt + shared prefix must give a top-1 minus top-2 gap below ``near_tie``, and
    the two differing tokens must be exactly those two. Returns the number of identical outputs and
    the accepted divergences as (index, position, gap)."""
    assert len(prompts) == len(outputs) == len(references), f"{what}output count differs"
    identical, ties = 0, []
    for i, (prompt, out, ref) in enumerate(zip(prompts, outputs, references)):
        k = first_divergence(out, ref)
        if k is None:
            identical += 1
            continue
        assert k < min(len(out), len(ref)), (
            f"{what}prompt {i}: one output stops at token {k}, the other goes on")
        gap, top2 = reference_top2(model, list(prompt) + list(ref[:k]))
        assert gap < near_tie and {out[k], ref[k]} == set(top2), (
            f"{what}prompt {i} diverges at token {k} ({out[k]} vs {ref[k]}): the reference's "
            f"top-2 logits are tokens {top2} with a gap of {gap:.3e} (not a near-tie < "
            f"{near_tie})")
        ties.append((i, k, gap))
    return identical, ties
