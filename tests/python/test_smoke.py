"""The smoke pipeline (runner + block manager + tree attention + acceptance + materialize on a tiny
random Llama) against a dense full-recompute torch reference."""

import subprocess
import sys

import torch
import torch.nn.functional as F

from helpers import default_prompt, tiny_config
from reference import decode_one, prompt_lookup_drafter
from pyspec.models.llama import LlamaForCausalLM
from pyspec.runner import ModelRunner


def _rms(model, x, w):
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + model.cfg.rms_norm_eps)
    return w * xf.to(x.dtype)


def _rotate(x, cos, sin):
    half = x.shape[-1] // 2
    return x * cos + torch.cat([-x[..., half:], x[..., :half]], dim=-1) * sin


def dense_logits(model, toks):
    """Reference forward: the whole sequence with causal SDPA (no paging, no trees), in plain
    torch ops (none of the core's)."""
    c = model.cfg
    t = len(toks)
    pos = torch.arange(t)
    cos, sin = model.rope_tables(pos)
    cos, sin = cos[:, None], sin[:, None]
    x = model.embed[torch.tensor(toks)]
    for L in model.layers:
        h = _rms(model, x, L["ln1"])
        qkv = F.linear(h, L["wqkv"], L["bqkv"])
        q = _rotate(qkv[:, :c.q_size].view(t, -1, c.head_dim), cos, sin)
        k = _rotate(qkv[:, c.q_size:c.q_size + c.kv_size].view(t, -1, c.head_dim), cos, sin)
        v = qkv[:, c.q_size + c.kv_size:].view(t, -1, c.head_dim)
        rep = c.num_attention_heads // c.num_key_value_heads
        k, v = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
        a = F.scaled_dot_product_attention(q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1),
                                           is_causal=True)
        x = x + F.linear(a.transpose(0, 1).reshape(t, -1), L["wo"], L["bo"])
        h = _rms(model, x, L["ln2"])
        gu = F.linear(h, L["wgu"])
        x = x + F.linear(F.silu(gu[:, :c.intermediate_size]) * gu[:, c.intermediate_size:], L["wd"])
    return F.linear(_rms(model, x, model.norm), model.lm_head)


def _dense_greedy(model, prompt, n):
    toks = list(prompt)
    for _ in range(n):
        toks.append(int(dense_logits(model, toks)[-1].argmax()))
    return toks[len(prompt):]


def test_plain_and_speculative_match_dense_reference():
    cfg = tiny_config()
    model = LlamaForCausalLM.random(cfg, seed=3)
    prompt = default_prompt(cfg.vocab_size, seed=4)
    n = 40
    ref = _dense_greedy(model, prompt, n)
    plain = decode_one(ModelRunner(model, 16, 16), prompt, n, prefill_chunk=20)
    spec = decode_one(ModelRunner(model, 200, 1), prompt, n, drafter=prompt_lookup_drafter(),
                         gamma=5)
    assert plain.tokens == ref
    assert spec.tokens == ref
    assert plain.steps == n
    assert spec.steps < n  # prompt lookup accepted at least some drafts
    assert spec.accepted > 0 and spec.drafted >= spec.accepted


def test_prompt_lookup_draft():
    d = prompt_lookup_drafter()
    assert d([1, 2, 3, 9, 1, 2], 3) == [3, 9, 1]
    assert d([5, 6, 7], 4) == []
    assert d([4, 4], 2) == [4]


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
