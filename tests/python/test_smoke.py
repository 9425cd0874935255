"""The smoke pipeline (block manager + tree attention + acceptance + materialize on a tiny random
model) against a dense full-recompute torch reference."""

import subprocess
import sys

import torch

from pyspec import smoke


def _dense_greedy(model, prompt, n):
    """Reference: recompute the whole sequence every step with plain causal SDPA."""
    c = model.cfg
    toks = list(prompt)
    for _ in range(n):
        t = len(toks)
        x = model.embed[torch.tensor(toks)]
        pos = torch.arange(t)
        for p in model.layers:
            h = model._rms(x)
            q = model._rope((h @ p["wq"].T).view(t, c.heads, c.head_dim), pos)
            k = model._rope((h @ p["wk"].T).view(t, c.kv_heads, c.head_dim), pos)
            v = (h @ p["wv"].T).view(t, c.kv_heads, c.head_dim)
            rep = c.heads // c.kv_heads
            k, v = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
            a = torch.nn.functional.scaled_dot_product_attention(
                q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), is_causal=True)
            x = x + a.transpose(0, 1).reshape(t, -1) @ p["wo"].T
            h = model._rms(x)
            x = x + (torch.nn.functional.silu(h @ p["w1"].T) * (h @ p["w3"].T)) @ p["w2"].T
        logits = model._rms(x[-1]) @ model.lm_head.T
        toks.append(int(logits.argmax()))
    return toks[len(prompt):]


def test_plain_and_speculative_match_dense_reference():
    cfg = smoke.TinyConfig()
    model = smoke.TinyLlama(cfg, seed=3)
    prompt = smoke.default_prompt(cfg, seed=4)
    n = 40
    ref = _dense_greedy(model, prompt, n)
    plain = smoke.generate(model, prompt, n, gamma=0, block_size=16)
    spec = smoke.generate(model, prompt, n, gamma=5, block_size=1)
    assert plain.tokens == ref
    assert spec.tokens == ref
    assert plain.steps == n
    assert spec.steps < n  # prompt lookup accepted at least some drafts
    assert spec.accepted > 0 and spec.drafted >= spec.accepted


def test_prompt_lookup_draft():
    assert smoke.prompt_lookup_draft([1, 2, 3, 9, 1, 2], 3) == [3, 9, 1]
    assert smoke.prompt_lookup_draft([5, 6, 7], 4) == []
    assert smoke.prompt_lookup_draft([4, 4], 2) == [4]


def test_cli_smoke_runs():
    out = subprocess.run([sys.executable, "-m", "pyspec", "smoke", "--max-tokens", "24"],
                         capture_output=True, text=True, cwd="/")
    assert out.returncode == 0, out.stderr
    assert "identical to plain: True" in out.stdout
    assert "acceptance length" in out.stdout and "speedup" in out.stdout


def test_cli_bad_argument_is_clear():
    out = subprocess.run([sys.executable, "-m", "pyspec", "smoke", "--gamma", "-1"],
                         capture_output=True, text=True, cwd="/")
    assert out.returncode == 2
    assert "--gamma" in out.stderr
