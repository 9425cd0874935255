"""The CPU decoder stack in one core call (``_C.DecoderStack``, used by LlamaForCausalLM for steps
within the core kernel's rows) against the same layers run op by op: the same bits for logits,
hidden states and new K/V, in every dtype, with biases, trees, batches and tapped layers."""

import dataclasses

import pytest
import torch
import torch.nn.functional as F

from pyspec import TokenTree, _C, ops
from pyspec.linear import max_fast_rows
from pyspec.models.llama import LlamaForCausalLM
from pyspec.runner import ModelRunner, SeqStep
from helpers import tiny_config


def _model(dtype, bias=False, layers=2):
    cfg = dataclasses.replace(tiny_config(), attention_bias=bias, num_hidden_layers=layers)
    m = LlamaForCausalLM.random(cfg, seed=3, dtype=dtype)
    if bias:  # an o_proj bias too (Llama checkpoints may carry one)
        g = torch.Generator().manual_seed(9)
        for layer in m.layers:
            layer["bo"] = (0.1 * torch.randn(cfg.hidden_size, generator=g)).to(dtype)
        m._fused = None
    return m


def _steps(model, fused, monkeypatch, return_hidden=False, kv_dtype=None):
    model.fused_layers = fused
    runner = ModelRunner(model, num_blocks=32, block_size=16, kv_dtype=kv_dtype)
    g = torch.Generator().manual_seed(0)
    v = model.cfg.vocab_size
    ctx = torch.randint(0, v, (40,), generator=g).tolist()
    other = torch.randint(0, v, (20,), generator=g).tolist()
    nodes = torch.randint(0, v, (7,), generator=g).tolist()
    outs = []
    o = runner.step([SeqStep(ctx, 0, list(range(3)), None, "all"),
                     SeqStep(other, 0, list(range(3, 5)), None, "all")],
                    return_hidden=return_hidden)
    outs.append(o)
    runner.commit_kv(o, 0, range(40), range(40))
    runner.commit_kv(o, 0, range(40, 60), range(48, 68))
    # A tree for one request and a decode row for the other, in one step.
    o = runner.step([SeqStep(nodes, 40, list(range(3)), TokenTree([-1, 0, 0, 1, 1, 2, 5]), "all"),
                     SeqStep(other[:1], 20, list(range(3, 5)), None, "last")],
                    return_hidden=return_hidden)
    outs.append(o)
    return outs


def _same(a, b):
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(
        a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("bias", [False, True])
def test_fused_steps_equal_op_by_op(dtype, bias, monkeypatch):
    m = _model(dtype, bias)
    fused = _steps(m, True, monkeypatch)
    assert m._fused is not None and m._fused[2] is not None and len(m._fused[2]) == 2
    plain = _steps(m, False, monkeypatch)
    for a, b in zip(fused, plain):
        assert _same(a.logits, b.logits)
        assert _same(a.k_new, b.k_new) and _same(a.v_new, b.v_new)


@pytest.mark.parametrize("kv_dtype", [torch.float16, torch.bfloat16])
def test_fused_steps_equal_op_by_op_over_a_16_bit_kv_cache(kv_dtype, monkeypatch):
    """float32 activations, K/V stored in 16 bits: the stack rounds each new K/V row once, as
    the op-by-op path does, and both read the same rounded cache."""
    m = _model(torch.float32)
    fused = _steps(m, True, monkeypatch, kv_dtype=kv_dtype)
    assert m._fused is not None and m._fused[2] is not None
    plain = _steps(m, False, monkeypatch, kv_dtype=kv_dtype)
    for a, b in zip(fused, plain):
        assert a.k_new.dtype == kv_dtype
        assert _same(a.logits, b.logits)
        assert _same(a.k_new, b.k_new) and _same(a.v_new, b.v_new)
    # Close to the float32 cache's logits (the rounding is the only difference).
    full = _steps(m, True, monkeypatch)
    for a, b in zip(fused, full):
        torch.testing.assert_close(a.logits, b.logits, atol=0.05, rtol=0.02)
        assert not _same(a.logits, b.logits)


def test_kv_cache_dtype_errors():
    m = _model(torch.float32)
    with pytest.raises(ValueError, match="kv_cache_dtype must be 'auto'.*got 'int8'"):
        ModelRunner(m, 4, 16, kv_dtype="int8")
    with pytest.raises(ValueError, match="needs a float32 model on the CPU; this model is "
                                         "bfloat16"):
        ModelRunner(_model(torch.bfloat16), 4, 16, kv_dtype="float16")
    assert ModelRunner(_model(torch.bfloat16), 4, 16, kv_dtype="bfloat16").kv.k.dtype == \
        torch.bfloat16
    runner = ModelRunner(m, 4, 16, kv_dtype=torch.float16)
    assert runner.kv.k.dtype == runner.kv.v.dtype == torch.float16
    # The core checks the cache against the activations too.
    _, stack, plan, x, cos, sin, kn = _stack_step(m)
    with pytest.raises(ValueError, match="'k_new' has dtype float32 but 'k_pages' has float16"):
        stack.run(x, cos, sin, plan, runner.kv.k, runner.kv.v, kn, torch.empty_like(kn))
    kn16 = kn.half()
    stack.run(x, cos, sin, plan, runner.kv.k, runner.kv.v, kn16, torch.empty_like(kn16))
    with pytest.raises(ValueError, match="'k_new' has dtype float16 but 'k_pages' has float32"):
        stack.run(x, cos, sin, plan, ModelRunner(m, 4, 16).kv.k, ModelRunner(m, 4, 16).kv.v,
                  kn16, torch.empty_like(kn16))


def test_fused_tapped_layers_equal_op_by_op(monkeypatch):
    m = _model(torch.float32, layers=4)
    for taps in (True, [2, 4], [4, 1, 3]):
        a = _steps(m, True, monkeypatch, return_hidden=taps)
        b = _steps(m, False, monkeypatch, return_hidden=taps)
        for x, y in zip(a, b):
            assert _same(x.logits, y.logits) and _same(x.hidden, y.hidden), taps


def test_fused_keeps_inputs_embeds_and_follows_weight_changes(monkeypatch):
    m = _model(torch.float32)
    runner = ModelRunner(m, num_blocks=8, block_size=16)
    emb = torch.randn(5, m.cfg.hidden_size)
    keep = emb.clone()
    m.fused_layers = True
    a = runner.step([SeqStep([1, 2, 3, 4, 5], 0, [0], None, "all")], inputs_embeds=emb).logits
    assert torch.equal(emb, keep)  # the stack runs in place, but on a copy
    m.fused_layers = False
    b = runner.step([SeqStep([1, 2, 3, 4, 5], 0, [0], None, "all")], inputs_embeds=emb).logits
    assert _same(a, b)
    # A replaced weight tensor (or packed matrix) gives a stack over the new tensors.
    m.fused_layers = True
    first = m._fused[2]
    m.layers[1]["wd"] = m.layers[1]["wd"] * 1.5
    c = runner.step([SeqStep([1, 2, 3, 4, 5], 0, [0], None, "all")], inputs_embeds=emb).logits
    assert m._fused[2] is not first and not torch.equal(a, c)
    m.fused_layers = False
    d = runner.step([SeqStep([1, 2, 3, 4, 5], 0, [0], None, "all")], inputs_embeds=emb).logits
    assert _same(c, d)
    m.place_on_huge_pages()  # copies every weight: the old stack goes with the old tensors
    assert m._fused is None or m._fused[2] is not first
    m.fused_layers = True
    view = m.truncated(1)
    ModelRunner(view, num_blocks=8, block_size=16).step([SeqStep([1, 2], 0, [0], None, "last")])
    assert len(view._fused[2]) == 1
    assert m._fused is None or m._fused[2] is not view._fused[2]


def test_fused_path_only_where_it_applies(monkeypatch):
    """Larger steps than the core kernel's rows, inputs that need a gradient and inputs of
    another dtype run op by op."""
    m = _model(torch.float32)
    m.fused_layers = True
    calls = []
    real = _C.DecoderStack

    class Counting:
        def __init__(self, *a, **k):
            self.s = real(*a, **k)

        def run(self, *a):
            calls.append(a[0].shape[0])
            return self.s.run(*a)

        def __len__(self):
            return len(self.s)

    monkeypatch.setattr(_C, "DecoderStack", Counting)
    runner = ModelRunner(m, num_blocks=16, block_size=16)
    big = max_fast_rows(torch.float32) + 1
    runner.step([SeqStep([i % 100 for i in range(big)], 0, list(range(16)), None, "last")])
    assert calls == []
    runner.step([SeqStep([1, 2, 3], 0, [0], None, "last")])
    assert calls == [3]
    emb = torch.randn(3, m.cfg.hidden_size, requires_grad=True)
    with torch.enable_grad():
        assert m._fused_stack(3, emb, runner.kv.k) is None
    with torch.no_grad():
        assert m._fused_stack(3, emb, runner.kv.k) is not None
    assert m._fused_stack(3, emb.detach().double(), runner.kv.k) is None
    # A weight the core cannot take (a strided view) runs op by op: what fused_layers=False
    # gives (torch's matmul for that layer), no error.
    monkeypatch.setattr(_C, "DecoderStack", real)
    m.layers[0]["wo"] = m.layers[0]["wo"].t().contiguous().t()
    assert m._fused_stack(3, emb.detach(), runner.kv.k) is None
    step = SeqStep([1, 2, 3], 0, [0], None, "last")
    a = runner.step([step]).logits
    m.fused_layers = False
    assert _same(a, runner.step([step]).logits)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_silu_mul_matches_torch(dtype):
    g = torch.Generator().manual_seed(2)
    gu = (3 * torch.randn(9, 2 * 70, generator=g)).to(dtype)
    got = ops.silu_mul(gu, 70)
    want = F.silu(gu[:, :70]) * gu[:, 70:]
    assert got.dtype == dtype and got.shape == (9, 70)
    # The core's exp may differ from torch's in the last bit of the float32 silu: close to torch.
    tol = {torch.float32: 1e-6, torch.bfloat16: 1e-2, torch.float16: 2e-3}[dtype]
    assert torch.allclose(got.float(), want.float(), rtol=2 * tol, atol=1e-6)
    # And exactly torch's roundings around the core's own float32 silu (silu(a) * 1 in float32):
    # silu rounded to the dtype, then the product rounded.
    ones = torch.cat([gu[:, :70].float(), torch.ones(9, 70)], 1)
    silu32 = ops.silu_mul(ones, 70)
    ref = (silu32.to(dtype).float() * gu[:, 70:].float()).to(dtype)
    assert _same(got, ref)
    # Non-contiguous or autograd inputs take torch's ops.
    t = (3 * torch.randn(9, 140, generator=g)).t().contiguous().t()
    assert torch.equal(ops.silu_mul(t, 70), F.silu(t[:, :70]) * t[:, 70:])
    with pytest.raises(ValueError, match="'out'"):
        _C.silu_mul(gu, torch.empty(9, 71, dtype=dtype))
    with pytest.raises(ValueError, match="'gu'"):
        _C.silu_mul(torch.empty(9, 7, dtype=dtype), torch.empty(9, 3, dtype=dtype))


def _stack_step(m):
    """A decoder stack over ``m``'s layers and the arguments of a 2-row step on 4 blocks:
    (layers, stack, plan, x, cos, sin, k_new) (v_new: like k_new)."""
    from pyspec.attention import plan_attention

    layers = [{k: layer[k] for k in ("ln1", "ln2", "bqkv", "bo", "wqkv", "wo", "wgu", "wd")}
              for layer in m.layers]
    cfg = m.cfg
    stack = _C.DecoderStack(layers, cfg.num_attention_heads, cfg.num_key_value_heads,
                            cfg.head_dim, cfg.intermediate_size, cfg.rms_norm_eps)
    plan = plan_attention([0, 2], [0], [[0]], 16, num_blocks=4,
                          num_q_heads=cfg.num_attention_heads,
                          num_kv_heads=cfg.num_key_value_heads)
    x = torch.randn(2, cfg.hidden_size)
    cos, sin = m.rope_tables(torch.tensor([0, 1]))
    kn = torch.empty(2, 2, cfg.num_key_value_heads, cfg.head_dim)
    return layers, stack, plan, x, cos, sin, kn


def test_decoder_stack_argument_errors():
    m = _model(torch.float32)
    layers, stack, plan, x, cos, sin, kn = _stack_step(m)
    cfg = m.cfg
    assert len(stack) == 2
    runner = ModelRunner(m, num_blocks=4, block_size=16)
    vn = torch.empty_like(kn)
    stack.run(x, cos, sin, plan, runner.kv.k, runner.kv.v, kn, vn)
    with pytest.raises(ValueError, match="'k_new'"):
        stack.run(x, cos, sin, plan, runner.kv.k, runner.kv.v, kn[:, :1].contiguous(), vn)
    with pytest.raises(ValueError, match=r"layers \[0, 3\)"):
        stack.run(x, cos, sin, plan, runner.kv.k, runner.kv.v, kn, vn, 0, 3)
    with pytest.raises(ValueError, match="'x'"):
        stack.run(x.double(), cos, sin, plan, runner.kv.k, runner.kv.v, kn, vn)
    with pytest.raises(ValueError,
                       match=r"layers\[1\] must be a dict of the layer's tensors; got list"):
        _C.DecoderStack([layers[0], [1]], cfg.num_attention_heads, cfg.num_key_value_heads,
                        cfg.head_dim, cfg.intermediate_size, cfg.rms_norm_eps)
    with pytest.raises(ValueError, match=r"layers\[0\] has no 'wd'"):
        _C.DecoderStack([{k: v for k, v in layers[0].items() if k != "wd"}],
                        cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim,
                        cfg.intermediate_size, cfg.rms_norm_eps)
    with pytest.raises(ValueError, match="'layer 0 wo' must be"):
        _C.DecoderStack([dict(layers[0], wo=layers[0]["wo"][:, :8].contiguous())],
                        cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim,
                        cfg.intermediate_size, cfg.rms_norm_eps)
    with pytest.raises(ValueError, match="overlap|share"):
        stack.run(x, cos, sin, plan, runner.kv.k, runner.kv.v, kn, kn)
    with pytest.raises(ValueError, match="query rows"):
        stack.run(x[:1], cos[:1], sin[:1], plan, runner.kv.k, runner.kv.v,
                  kn[:, :1].contiguous(), vn[:, :1].contiguous())
    bad = [dict(layers[0], wqkv=(layers[0]["wqkv"],))]
    with pytest.raises(ValueError, match="'wqkv' must be a tensor or a"):
        _C.DecoderStack(bad, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim,
                        cfg.intermediate_size, cfg.rms_norm_eps)


@pytest.mark.parametrize("name,value", [("PYSPEC_FUSED_LAYERS", "0"),
                                        ("PYSPEC_PACKED_NUMERICS", "fixed")])
def test_retired_environment_switches_are_refused_not_ignored(name, value, monkeypatch):
    """The process-wide switches that became per-model settings (or left main) must not be
    silently ignored when set: loading a model names the switch and what replaced it."""
    monkeypatch.setenv(name, value)
    with pytest.raises(ValueError, match=f"{name}='{value}' is no longer read"):
        LlamaForCausalLM.random(tiny_config())
    monkeypatch.setenv(name, {"PYSPEC_FUSED_LAYERS": "1", "PYSPEC_PACKED_NUMERICS": "exact"}[name])
    assert LlamaForCausalLM.random(tiny_config()).fused_layers


def test_two_models_run_attention_with_their_own_kernels(monkeypatch):
    """Tree attention's CPU build is the model's (its LinearKernels), not the process's: a
    model on the generic build beside one on this CPU's best, the fused stack and the op-by-op
    path of each giving the same bits (both read the model's kernels), and the generic model's
    results unchanged by the other's steps."""
    generic, best = _model(torch.float32), _model(torch.float32)
    generic.set_kernels("generic")
    assert generic.describe()["attention_isa"] == "generic"
    assert best.describe()["attention_isa"] == _C._attention_isa()
    first = _steps(generic, True, monkeypatch)
    for m in (best, generic):
        fused, plain = _steps(m, True, monkeypatch), _steps(m, False, monkeypatch)
        for a, b in zip(fused, plain):
            assert _same(a.logits, b.logits)
    for a, b in zip(_steps(generic, True, monkeypatch), first):
        assert _same(a.logits, b.logits)


def test_model_pickles_and_copies_with_its_kernels(monkeypatch):
    """A model (its LinearKernels included, the decoder stack never) survives pickle and deepcopy:
    the copy keeps its kernels and computes the same bits."""
    import copy
    import pickle

    m = _model(torch.float32)
    m.set_kernels("generic")
    want = _steps(m, True, monkeypatch)
    for c in (pickle.loads(pickle.dumps(m)), copy.deepcopy(m)):
        assert c.kernels.isa == "generic" and c.kernels is not m.kernels
        for a, b in zip(_steps(c, True, monkeypatch), want):
            assert _same(a.logits, b.logits)
    assert pickle.loads(pickle.dumps(_C.LinearKernels())).isa == _C.LinearKernels().isa
