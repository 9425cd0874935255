"""Drafter checkpoints in their published layouts (pyspec.drafters.published): Medusa's
``medusa_lm_head`` and EAGLE-1/2 heads, built here with random weights in exactly those layouts.
Each drafter's proposals equal a reference forward written below from the papers' equations (in
plain torch, not pyspec's ops), the engine stays lossless with each, and broken files fail with
the file, the tensor and what was expected."""

import json
import math
import os

import pytest
import torch
import torch.nn.functional as F

from pyspec.drafters import EagleDrafter, MedusaDrafter, make_drafter
from pyspec.drafters.published import published_kind
from pyspec.engine import Engine, SamplingParams
from pyspec.runner import ModelRunner, SeqStep

from drafters_support import MAX_TOKENS, prompts

EAGLE_INTER = 96


def _rms(x, w, eps):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


def _target_hidden(model, context):
    """The target's last hidden states (before its final norm) over ``context``."""
    blocks = len(context) // 8 + 1
    runner = ModelRunner(model, num_blocks=blocks, block_size=8)
    res = runner.step([SeqStep(list(context), 0, list(range(blocks)), None, "all")],
                      return_hidden=True)
    return res.hidden.float()


def _medusa_dir(tmp, model, heads=3, layers=2, pickle=False, seed=3):
    cfg = model.cfg
    h, v = cfg.hidden_size, cfg.vocab_size
    g = torch.Generator().manual_seed(seed)
    t = {}
    for i in range(heads):
        for j in range(layers):
            t[f"{i}.{j}.linear.weight"] = torch.randn(h, h, generator=g) / math.sqrt(h)
            t[f"{i}.{j}.linear.bias"] = 0.1 * torch.randn(h, generator=g)
        t[f"{i}.{layers}.weight"] = torch.randn(v, h, generator=g) / math.sqrt(h)
    os.makedirs(tmp, exist_ok=True)
    if pickle:
        torch.save(t, os.path.join(tmp, "medusa_lm_head.pt"))
    else:
        from safetensors.torch import save_file

        save_file(t, os.path.join(tmp, "medusa_lm_head.safetensors"))
    with open(os.path.join(tmp, "config.json"), "w") as f:
        json.dump({"medusa_num_heads": heads, "medusa_num_layers": layers,
                   "base_model_name_or_path": "tiny"}, f)
    return tmp, t


def _eagle_dir(tmp, model, bias=True, bin_file=False, seed=5):
    cfg = model.cfg
    h = cfg.hidden_size
    qs, kv = cfg.num_attention_heads * cfg.head_dim, cfg.num_key_value_heads * cfg.head_dim
    g = torch.Generator().manual_seed(seed)

    def mat(o, i):
        return torch.randn(o, i, generator=g) / math.sqrt(i)

    t = {"fc.weight": mat(h, 2 * h),
         "layers.0.self_attn.q_proj.weight": mat(qs, h),
         "layers.0.self_attn.k_proj.weight": mat(kv, h),
         "layers.0.self_attn.v_proj.weight": mat(kv, h),
         "layers.0.self_attn.o_proj.weight": mat(h, qs),
         "layers.0.mlp.gate_proj.weight": mat(EAGLE_INTER, h),
         "layers.0.mlp.up_proj.weight": mat(EAGLE_INTER, h),
         "layers.0.mlp.down_proj.weight": mat(h, EAGLE_INTER),
         "layers.0.post_attention_layernorm.weight": 1 + 0.1 * torch.randn(h, generator=g)}
    if bias:
        t["fc.bias"] = 0.1 * torch.randn(h, generator=g)
    os.makedirs(tmp, exist_ok=True)
    if bin_file:
        torch.save(t, os.path.join(tmp, "pytorch_model.bin"))
    else:
        from safetensors.torch import save_file

        save_file(t, os.path.join(tmp, "model.safetensors"))
    conf = {"architectures": ["LlamaForCausalLM"], "hidden_size": h, "num_hidden_layers": 1,
            "num_attention_heads": cfg.num_attention_heads,
            "num_key_value_heads": cfg.num_key_value_heads, "intermediate_size": EAGLE_INTER,
            "vocab_size": cfg.vocab_size, "rms_norm_eps": cfg.rms_norm_eps,
            "rope_theta": cfg.rope_theta}
    if not bias:
        conf["bias"] = False
    with open(os.path.join(tmp, "config.json"), "w") as f:
        json.dump(conf, f)
    return tmp, t


def _record(drafter):
    """Wrap ``drafter.propose`` to keep every (request, draft) it returns."""
    seen = []
    orig = drafter.propose

    def propose(reqs):
        out = orig(reqs)
        seen.extend((list(r.context), d) for r, d in zip(reqs, out))
        return out

    drafter.propose = propose
    return seen


def _run(model, drafter, n=3, max_tokens=MAX_TOKENS):
    runner = ModelRunner(model, num_blocks=64, block_size=8)
    eng = Engine(runner, drafter=drafter, adaptive=False)
    return eng.generate(prompts()[:n], SamplingParams(max_tokens=max_tokens))


def test_published_medusa_matches_the_reference_and_is_lossless(model, plain, tmp_path):
    cfg = model.cfg
    runner = ModelRunner(model, num_blocks=64, block_size=8)
    path, t = _medusa_dir(str(tmp_path / "medusa"), model)
    assert published_kind(path) == "medusa"
    d = make_drafter(path, runner)
    assert isinstance(d, MedusaDrafter) and "2 blocks each, own projections" in d.describe()
    seen = _record(d)
    res = _run(model, d)
    for i, r in enumerate(res):
        assert r.token_ids == plain[i]
    assert sum(r.stats.draft_tokens for r in res) > 0
    checked = 0
    for context, draft in seen:
        if len(draft.tokens) == 1:
            continue
        # Medusa: head k on the final-normed hidden state of the position before the root.
        hid = _target_hidden(model, context[:-1])[-1]
        x0 = _rms(hid, model.norm.float(), cfg.rms_norm_eps)
        tops = []
        for k in range(3):
            x = x0
            for j in range(2):
                x = x + F.silu(x @ t[f"{k}.{j}.linear.weight"].T + t[f"{k}.{j}.linear.bias"])
            tops.append((x @ t[f"{k}.2.weight"].T).topk(4).indices.tolist())
        where = {(): 0}
        for node, path_ in enumerate(sorted(d.paths, key=lambda p: (len(p), p))[
                :len(draft.tokens) - 1], start=1):
            where[tuple(path_)] = node
            assert draft.parents[node] == where[tuple(path_[:-1])]
            assert draft.tokens[node] == tops[len(path_) - 1][path_[-1]]
        checked += 1
    assert checked >= 3


def _eagle_reference_chain(model, t, context, depth, bias=True):
    """EAGLE-1's draft chain (top-1 at each level) from its equations: entries
    x_p = fc([embed(t_{p+1}); f_p]) with f the target's last hidden state after its final norm;
    one Llama layer without an input norm (causal, RoPE at positions 0..); the output o goes to
    the target's lm_head unnormed and is the feature of the next level."""
    cfg = model.cfg
    nh, nkv, hd = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
    feats = _rms(_target_hidden(model, context[:-1]), model.norm.float(), cfg.rms_norm_eps)
    emb = model.embed.float()
    fc_b = t["fc.bias"] if bias else 0

    def fc(tok, f):
        return torch.cat([emb[tok], f]) @ t["fc.weight"].T + fc_b

    xs = [fc(context[p + 1], feats[p]) for p in range(len(context) - 1)]
    inv = 1.0 / (cfg.rope_theta ** (torch.arange(0, hd, 2, dtype=torch.float64) / hd))

    def rope(x, pos):  # x [T, heads, hd]
        ang = pos[:, None].double() * inv[None]
        cos, sin = torch.cat([ang.cos()] * 2, -1).float(), torch.cat([ang.sin()] * 2, -1).float()
        x1, x2 = x[..., :hd // 2], x[..., hd // 2:]
        rot = torch.cat([-x2, x1], -1)
        return x * cos[:, None] + rot * sin[:, None]

    def layer(x):  # [T, H] -> [T, H]
        n = x.shape[0]
        pos = torch.arange(n)
        q = rope((x @ t["layers.0.self_attn.q_proj.weight"].T).view(n, nh, hd), pos)
        k = rope((x @ t["layers.0.self_attn.k_proj.weight"].T).view(n, nkv, hd), pos)
        v = (x @ t["layers.0.self_attn.v_proj.weight"].T).view(n, nkv, hd)
        k, v = k.repeat_interleave(nh // nkv, 1), v.repeat_interleave(nh // nkv, 1)
        s = torch.einsum("qhd,khd->hqk", q, k) / math.sqrt(hd)
        s = s.masked_fill(torch.triu(torch.ones(n, n, dtype=torch.bool), 1), float("-inf"))
        a = torch.einsum("hqk,khd->qhd", s.softmax(-1), v).reshape(n, nh * hd)
        h = x + a @ t["layers.0.self_attn.o_proj.weight"].T
        m = _rms(h, t["layers.0.post_attention_layernorm.weight"], cfg.rms_norm_eps)
        g = F.silu(m @ t["layers.0.mlp.gate_proj.weight"].T) * (m @ t["layers.0.mlp.up_proj.weight"].T)
        return h + g @ t["layers.0.mlp.down_proj.weight"].T

    chain = []
    for _ in range(depth):
        o = layer(torch.stack(xs))[-1]
        tok = int((o @ model.lm_head.float().T).argmax())
        chain.append(tok)
        xs.append(fc(tok, o))
    return chain


@pytest.mark.parametrize("bias,bin_file", [(True, False), (False, True)])
def test_published_eagle_matches_the_reference_and_is_lossless(model, plain, tmp_path, bias,
                                                               bin_file):
    runner = ModelRunner(model, num_blocks=64, block_size=8)
    path, t = _eagle_dir(str(tmp_path / "eagle"), model, bias=bias, bin_file=bin_file)
    assert published_kind(path) == "eagle"
    d = make_drafter(path + "@width=1,depth=3,nodes=3", runner)
    assert isinstance(d, EagleDrafter) and d.feature_norm is not None
    seen = _record(d)
    res = _run(model, d, n=len(prompts()))
    for i, r in enumerate(res):
        assert r.token_ids == plain[i]
    checked = 0
    for context, draft in seen:
        if len(draft.tokens) < 4 or len(context) < 3:
            continue
        assert draft.parents == [-1, 0, 1, 2]  # a chain
        want = _eagle_reference_chain(model, t, context, 3, bias=bias)
        assert draft.tokens[1:] == want, (context, draft.tokens, want)
        checked += 1
    assert checked >= 3
    # Wider trees from the same head stay lossless.
    res = _run(model, make_drafter(path + "@width=3,depth=4,nodes=10", runner))
    for i, r in enumerate(res):
        assert r.token_ids == plain[i]


def test_published_layouts_fail_clearly(model, tmp_path):
    runner = ModelRunner(model, num_blocks=16, block_size=8)
    # A pickled Medusa file loads (weights_only) ...
    path, _ = _medusa_dir(str(tmp_path / "pt"), model, pickle=True)
    assert isinstance(make_drafter(path, runner), MedusaDrafter)
    # ... but one holding code is refused, and the code never runs.
    marker = tmp_path / "ran"

    class Evil:
        def __reduce__(self):
            return (open, (str(marker), "w"))

    evil = tmp_path / "evil"
    evil.mkdir()
    torch.save({"0.0.linear.weight": Evil()}, str(evil / "medusa_lm_head.pt"))
    with pytest.raises(ValueError, match="pickled Python objects"):
        make_drafter(str(evil), runner)
    assert not marker.exists()
    # A missing tensor, a wrong shape (another target's width): the file and tensor are named.
    path, t = _medusa_dir(str(tmp_path / "m2"), model)
    from safetensors.torch import save_file

    t2 = dict(t)
    del t2["1.1.linear.bias"]
    save_file(t2, os.path.join(path, "medusa_lm_head.safetensors"))
    with pytest.raises(ValueError, match=r"medusa_lm_head.safetensors: tensor '1.1.linear.bias' is "
                                         r"missing"):
        make_drafter(path, runner)
    t2 = dict(t)
    t2["0.2.weight"] = torch.zeros(7, model.cfg.hidden_size)
    save_file(t2, os.path.join(path, "medusa_lm_head.safetensors"))
    with pytest.raises(ValueError, match=r"'0.2.weight' has shape \[7, 256\]; expected \[111, 256\]"):
        make_drafter(path, runner)
    with pytest.raises(ValueError, match="Medusa tree comes from its choice list"):
        make_drafter(str(tmp_path / "pt") + "@width=2", runner)
    # EAGLE: another hidden size, an input norm it should not have, an unknown tensor.
    path, t = _eagle_dir(str(tmp_path / "e"), model)
    conf = json.load(open(os.path.join(path, "config.json")))
    json.dump(dict(conf, hidden_size=128), open(os.path.join(path, "config.json"), "w"))
    with pytest.raises(ValueError, match="hidden_size 128 does not match the target's 256"):
        make_drafter(path, runner)
    json.dump(conf, open(os.path.join(path, "config.json"), "w"))
    save_file(dict(t, **{"layers.0.input_layernorm.weight": torch.ones(256)}),
              os.path.join(path, "model.safetensors"))
    with pytest.raises(ValueError, match="input_layernorm.weight is present"):
        make_drafter(path, runner)
    save_file(dict(t, extra=torch.ones(3)), os.path.join(path, "model.safetensors"))
    with pytest.raises(ValueError, match=r"unexpected tensors \['extra'\]"):
        make_drafter(path, runner)
    save_file(dict(t, **{"fc.weight": torch.ones(256, 256)}),
              os.path.join(path, "model.safetensors"))
    with pytest.raises(ValueError, match=r"model.safetensors: tensor 'fc.weight' has shape "
                                         r"\[256, 256\]; expected \[256, 512\]"):
        make_drafter(path, runner)
    # EAGLE-3 heads are recognised and refused with the reason.
    e3 = tmp_path / "e3"
    e3.mkdir()
    save_file({"midlayer.hidden_norm.weight": torch.ones(256), "d2t": torch.zeros(4,
               dtype=torch.int64)}, str(e3 / "model.safetensors"))
    json.dump({"architectures": ["LlamaForCausalLMEagle3"], "draft_vocab_size": 4},
              open(e3 / "config.json", "w"))
    assert published_kind(str(e3)) == "eagle3"
    with pytest.raises(ValueError, match="EAGLE-3 head"):
        make_drafter(str(e3), runner)
