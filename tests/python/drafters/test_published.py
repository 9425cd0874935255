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
    feats = _rms(_target_hidden(model, context[:-1]), model.norm.float(), cfg.rms_norm_eps)
    emb = model.embed.float()
    fc_b = t["fc.bias"] if bias else 0

    def fc(tok, f):
        return torch.cat([emb[tok], f]) @ t["fc.weight"].T + fc_b

    xs = [fc(context[p + 1], feats[p]) for p in range(len(context) - 1)]
    chain = []
    for _ in range(depth):
        x = torch.stack(xs)
        o = _ref_layer(model.cfg, t, "layers.0.", x, x)[-1]
        tok = int((o @ model.lm_head.float().T).argmax())
        chain.append(tok)
        xs.append(fc(tok, o))
    return chain


def _ref_layer(cfg, t, pfx, inp, res):
    """One Llama decoder layer's attention over ``inp`` (causal, RoPE at positions 0..) added to
    the residual ``res``, then its MLP block: [T, *] -> [T, H]."""
    nh, nkv, hd = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
    inv = 1.0 / (cfg.rope_theta ** (torch.arange(0, hd, 2, dtype=torch.float64) / hd))

    def rope(x, pos):  # x [T, heads, hd]
        ang = pos[:, None].double() * inv[None]
        cos, sin = torch.cat([ang.cos()] * 2, -1).float(), torch.cat([ang.sin()] * 2, -1).float()
        x1, x2 = x[..., :hd // 2], x[..., hd // 2:]
        return x * cos[:, None] + torch.cat([-x2, x1], -1) * sin[:, None]

    n = inp.shape[0]
    pos = torch.arange(n)
    q = rope((inp @ t[pfx + "self_attn.q_proj.weight"].T).view(n, nh, hd), pos)
    k = rope((inp @ t[pfx + "self_attn.k_proj.weight"].T).view(n, nkv, hd), pos)
    v = (inp @ t[pfx + "self_attn.v_proj.weight"].T).view(n, nkv, hd)
    k, v = k.repeat_interleave(nh // nkv, 1), v.repeat_interleave(nh // nkv, 1)
    sc = torch.einsum("qhd,khd->hqk", q, k) / math.sqrt(hd)
    sc = sc.masked_fill(torch.triu(torch.ones(n, n, dtype=torch.bool), 1), float("-inf"))
    a = torch.einsum("hqk,khd->qhd", sc.softmax(-1), v).reshape(n, nh * hd)
    h = res + a @ t[pfx + "self_attn.o_proj.weight"].T
    m = _rms(h, t[pfx + "post_attention_layernorm.weight"], cfg.rms_norm_eps)
    g = F.silu(m @ t[pfx + "mlp.gate_proj.weight"].T) * (m @ t[pfx + "mlp.up_proj.weight"].T)
    return h + g @ t[pfx + "mlp.down_proj.weight"].T


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
    # A damaged weights file (an interrupted download), architectures that are not a list.
    weights = os.path.join(path, "model.safetensors")
    save_file(t, weights)
    data = open(weights, "rb").read()
    open(weights, "wb").write(data[:len(data) // 2])
    with pytest.raises(ValueError, match=r"model.safetensors is not a readable safetensors file"):
        make_drafter(path, runner)
    save_file(t, weights)
    json.dump(dict(conf, architectures=5), open(os.path.join(path, "config.json"), "w"))
    assert published_kind(path) == "eagle"
    json.dump(conf, open(os.path.join(path, "config.json"), "w"))
    for bad, match in (({"num_key_value_heads": 3, "num_attention_heads": 4},
                        "num_attention_heads 4 is not a multiple of num_key_value_heads 3"),
                       ({"head_dim": 33}, "head_dim 33 must be even")):
        json.dump(dict(conf, **bad), open(os.path.join(path, "config.json"), "w"))
        with pytest.raises(ValueError, match=r"config.json: " + match):
            make_drafter(path, runner)
    json.dump(conf, open(os.path.join(path, "config.json"), "w"))
    # EAGLE-3: a target too shallow for the default fused layers (2, L//2, L-3) is named.
    e3 = tmp_path / "e3"
    e3.mkdir()
    save_file({"midlayer.hidden_norm.weight": torch.ones(256)}, str(e3 / "model.safetensors"))
    json.dump({"architectures": ["LlamaForCausalLMEagle3"], "draft_vocab_size": 4},
              open(e3 / "config.json", "w"))
    assert published_kind(str(e3)) == "eagle3"
    with pytest.raises(ValueError, match=r"fuses target layers \[2, 1, -1\], which a target of 2 "
                                         "layers does not have"):
        make_drafter(str(e3), runner)


@pytest.fixture(scope="module")
def model4():
    """A 4-layer tiny target: room for an EAGLE-3 head's three fused layers and the final one."""
    import dataclasses

    from helpers import tiny_config
    from pyspec.models.llama import LlamaForCausalLM

    return LlamaForCausalLM.random(dataclasses.replace(tiny_config(), num_hidden_layers=4), seed=2)


def _eagle3_dir(tmp, model, vd=64, seed=7):
    cfg = model.cfg
    h, v = cfg.hidden_size, cfg.vocab_size
    qs, kv = cfg.num_attention_heads * cfg.head_dim, cfg.num_key_value_heads * cfg.head_dim
    g = torch.Generator().manual_seed(seed)

    def mat(o, i):
        return torch.randn(o, i, generator=g) / math.sqrt(i)

    used = torch.randperm(v, generator=g)[:vd].sort().values
    t = {"fc.weight": mat(h, 3 * h), "norm.weight": 1 + 0.1 * torch.randn(h, generator=g),
         "lm_head.weight": mat(vd, h), "d2t": used - torch.arange(vd),
         "t2d": torch.zeros(v, dtype=torch.bool).index_fill(0, used, True),
         "midlayer.hidden_norm.weight": 1 + 0.1 * torch.randn(h, generator=g),
         "midlayer.input_layernorm.weight": 1 + 0.1 * torch.randn(h, generator=g),
         "midlayer.post_attention_layernorm.weight": 1 + 0.1 * torch.randn(h, generator=g),
         "midlayer.self_attn.q_proj.weight": mat(qs, 2 * h),
         "midlayer.self_attn.k_proj.weight": mat(kv, 2 * h),
         "midlayer.self_attn.v_proj.weight": mat(kv, 2 * h),
         "midlayer.self_attn.o_proj.weight": mat(h, qs),
         "midlayer.mlp.gate_proj.weight": mat(EAGLE_INTER, h),
         "midlayer.mlp.up_proj.weight": mat(EAGLE_INTER, h),
         "midlayer.mlp.down_proj.weight": mat(h, EAGLE_INTER)}
    os.makedirs(tmp, exist_ok=True)
    torch.save(t, os.path.join(tmp, "pytorch_model.bin"))
    conf = {"architectures": ["LlamaForCausalLMEagle3"], "hidden_size": h,
            "num_hidden_layers": 1, "num_attention_heads": cfg.num_attention_heads,
            "num_key_value_heads": cfg.num_key_value_heads, "intermediate_size": EAGLE_INTER,
            "vocab_size": v, "draft_vocab_size": vd, "rms_norm_eps": cfg.rms_norm_eps,
            "eagle_config": {"eagle_aux_hidden_state_layer_ids": [0, 1, 2]}}
    with open(os.path.join(tmp, "config.json"), "w") as f:
        json.dump(conf, f)
    return tmp, t, used


def _eagle3_reference_chain(model, t, used, context, depth):
    """EAGLE-3's draft chain from its equations: the feature g_p = fc([h^1_p; h^2_p; h^3_p]) over
    the target's layer outputs (un-normed; layers 1-3 from aux ids 0-2); the midlayer's attention
    reads [input_norm(embed(t_{p+1})); hidden_norm(g_p)] with g_p as the residual; logits
    lm_head(norm(o)) over the draft vocabulary, mapped to target ids by d2t; deeper levels feed
    o (before norm) back as the feature."""
    cfg = model.cfg
    eps = cfg.rms_norm_eps
    blocks = len(context) // 8 + 1
    runner = ModelRunner(model, num_blocks=blocks, block_size=8)
    res = runner.step([SeqStep(list(context[:-1]), 0, list(range(blocks)), None, "all")],
                      return_hidden=[1, 2, 3])
    gs = res.hidden.float() @ t["fc.weight"].T
    emb = model.embed.float()

    def inp(tok, f):
        return torch.cat([_rms(emb[tok], t["midlayer.input_layernorm.weight"], eps),
                          _rms(f, t["midlayer.hidden_norm.weight"], eps)])

    xs = [inp(context[p + 1], gs[p]) for p in range(len(context) - 1)]
    rs = list(gs)
    chain = []
    for _ in range(depth):
        o = _ref_layer(cfg, t, "midlayer.", torch.stack(xs), torch.stack(rs))[-1]
        did = int((_rms(o, t["norm.weight"], eps) @ t["lm_head.weight"].T).argmax())
        tok = did + int(t["d2t"][did])
        assert tok == int(used[did])
        chain.append(tok)
        xs.append(inp(tok, o))
        rs.append(o)
    return chain


def test_published_eagle3_matches_the_reference_and_is_lossless(model4, tmp_path):
    from drafters_support import decode_one

    runner = ModelRunner(model4, num_blocks=64, block_size=8)
    path, t, used = _eagle3_dir(str(tmp_path / "e3"), model4)
    assert published_kind(path) == "eagle3"
    d = make_drafter(path + "@width=1,depth=3,nodes=3", runner)
    assert isinstance(d, EagleDrafter) and d.eagle3 and d.hidden_layers == (1, 2, 3, 4)
    seen = _record(d)
    plain = [decode_one(ModelRunner(model4, num_blocks=64, block_size=8), p, MAX_TOKENS).tokens
             for p in prompts()]
    res = _run(model4, d, n=len(prompts()))
    for i, r in enumerate(res):
        assert r.token_ids == plain[i]
    checked = 0
    for context, draft in seen:
        if len(draft.tokens) < 4 or len(context) < 3:
            continue
        assert draft.parents == [-1, 0, 1, 2]
        assert draft.tokens[1:] == _eagle3_reference_chain(model4, t, used, context, 3)
        assert all(tok in set(used.tolist()) for tok in draft.tokens[1:])
        checked += 1
    assert checked >= 3
    res = _run(model4, make_drafter(path + "@width=3,depth=4,nodes=10", runner),
               n=len(prompts()))
    for i, r in enumerate(res):
        assert r.token_ids == plain[i]
    # Broken files: a d2t mapping two draft ids to one target id, a missing midlayer tensor.
    bad = dict(t, d2t=-torch.arange(64))  # every draft id to target id 0
    torch.save(bad, os.path.join(path, "pytorch_model.bin"))
    with pytest.raises(ValueError, match="to the same id twice"):
        make_drafter(path, runner)
    bad = {k: v for k, v in t.items() if k != "midlayer.self_attn.k_proj.weight"}
    torch.save(bad, os.path.join(path, "pytorch_model.bin"))
    with pytest.raises(ValueError, match=r"pytorch_model.bin: tensor "
                                         r"'midlayer.self_attn.k_proj.weight' is missing"):
        make_drafter(path, runner)


def test_eagle3_default_layers():
    from pyspec.drafters.published import eagle3_layers

    # The reference code captures the inputs of layers 2, L//2, L-3 (from 0): for Llama-3.1-8B
    # the outputs of layers 2, 16, 29 (from 1), as HF's hidden_states[2, 16, 29].
    assert eagle3_layers(32) == (2, 16, 29)
    assert eagle3_layers(4, [0, 1, 2]) == (1, 2, 3)
    with pytest.raises(ValueError, match="does not have"):
        eagle3_layers(4, [3, 4])
