"""4-bit AWQ and GPTQ checkpoints (pyspec.models.quantized): synthetic checkpoints written here in
exactly those layouts (AWQ's interleaved nibbles, GPTQ's row packing with stored zero - 1,
act-order g_idx) load as codes only, and the model equals a float32 model of the weights
dequantized here with the formats' formula; speculative decoding on them stays lossless."""

import json
import os
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from pyspec.linear import PackedWeight
from pyspec.models.llama import LlamaForCausalLM
from pyspec.runner import ModelRunner, SeqStep

from models_support import write_tiny_model

_LINEARS = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
            "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")
_AWQ_ORDER = [0, 2, 4, 6, 1, 3, 5, 7]


def _quantize(w, groups_of_k):
    """Asymmetric 4-bit quantization of w [N, K] with the group of each input column given:
    codes [N, K], zeros [G, N] (ints), scales [G, N] (float16)."""
    n, k = w.shape
    ng = int(groups_of_k.max()) + 1
    zeros = torch.zeros(ng, n, dtype=torch.int32)
    scales = torch.zeros(ng, n, dtype=torch.float16)
    codes = torch.zeros(n, k, dtype=torch.int32)
    for g in range(ng):
        cols = (groups_of_k == g).nonzero().flatten()
        blk = w[:, cols]
        lo, hi = blk.amin(1), blk.amax(1)
        s = ((hi - lo) / 15).clamp_min(1e-4).half()
        z = torch.round(-lo / s.float()).clamp(0, 15).to(torch.int32)
        q = torch.round(blk / s.float()[:, None] + z[:, None]).clamp(0, 15).to(torch.int32)
        codes[:, cols], zeros[g], scales[g] = q, z, s
    return codes, zeros, scales


def _to_int32(x64):
    return ((x64 + 2**31) % 2**32 - 2**31).to(torch.int32)


def _pack(v, order=None):
    """int [R, C] (values 0..15) -> int32 [R, C/8]: nibble i of word c = column 8c + order[i]."""
    r, c = v.shape
    v = v.view(r, c // 8, 8)
    if order is not None:
        v = v[:, :, order]
    out = torch.zeros(r, c // 8, dtype=torch.int64)
    for i in range(8):
        out |= v[:, :, i].to(torch.int64) << (4 * i)
    return _to_int32(out)


def _write_quantized(src, dst, method, group, act_order=False, v2=False, seed=0,
                     lm_head=False, shared_order=True):
    """A copy of the float checkpoint ``src`` with every layer matrix quantized in ``method``'s
    layout; returns ``{name: dequantized float32 matrix}`` by the format's formula."""
    shutil.copytree(src, dst)
    w = load_file(os.path.join(src, "model.safetensors"))
    out, ref = {}, {}
    gen = torch.Generator().manual_seed(seed)
    ranks = {}
    for name, t in w.items():
        base = name[:-len(".weight")]
        if not any(base.endswith(lin) for lin in _LINEARS) and not (lm_head and base == "lm_head"):
            out[name] = t.half()
            continue
        n, k = t.shape
        g = k if group == -1 else group
        if act_order:
            # One order per input (GPTQ's order comes from the input's statistics: q/k/v share
            # one, gate/up another).
            family = base.rsplit(".", 1)[0] + {"q_proj": "qkv", "k_proj": "qkv", "v_proj": "qkv",
                                               "gate_proj": "gu", "up_proj": "gu"}.get(
                base.rsplit(".", 1)[1], base.rsplit(".", 1)[1])
            if not shared_order:
                family = base
            if family not in ranks:
                ranks[family] = torch.randperm(k, generator=gen)
            g_idx = (ranks[family] // g).to(torch.int32)
        else:
            g_idx = (torch.arange(k) // g).to(torch.int32)
        codes, zeros, scales = _quantize(t.float(), g_idx)
        gi = g_idx.long()
        ref[name] = (codes - zeros.t()[:, gi]).float() * scales.float().t()[:, gi]
        if method == "awq":
            out[base + ".qweight"] = _pack(codes.t().contiguous(), _AWQ_ORDER)  # [K, N/8]
            out[base + ".qzeros"] = _pack(zeros, _AWQ_ORDER)
        else:
            # GPTQ: 8 consecutive input rows per word, column-wise.
            out[base + ".qweight"] = _pack(codes.contiguous()).t().contiguous()  # [K/8, N]
            # Stored as zero - 1 (AutoGPTQ's v1 format) unless gptq_v2.
            out[base + ".qzeros"] = _pack(zeros if v2 else (zeros - 1) & 0xF)
            out[base + ".g_idx"] = g_idx
        out[base + ".scales"] = scales
    os.remove(os.path.join(dst, "model.safetensors"))
    save_file(out, os.path.join(dst, "model.safetensors"))
    cfg_path = os.path.join(dst, "config.json")
    conf = json.load(open(cfg_path))
    qc = {"quant_method": method, "bits": 4, "group_size": group}
    if method == "awq":
        qc.update(version="gemm", zero_point=True)
    else:
        qc.update(desc_act=act_order, sym=False, checkpoint_format="gptq_v2" if v2 else "gptq")
    conf["quantization_config"] = qc
    json.dump(conf, open(cfg_path, "w"))
    return ref


def _reference_model(src, ref):
    w = {k: v.float() for k, v in load_file(os.path.join(src, "model.safetensors")).items()}
    w.update(ref)
    for k in w:
        if k not in ref:
            w[k] = w[k].half().float()  # as stored in the quantized checkpoint
    base = LlamaForCausalLM.from_pretrained(src, packed_weights="off")
    return LlamaForCausalLM(base.cfg, w, torch.float32)


def _logits(model, ids):
    runner = ModelRunner(model, num_blocks=8, block_size=16)
    return runner.step([SeqStep(ids, 0, list(range(8)), None, "all")]).logits


@pytest.fixture(scope="module")
def float_dir(tmp_path_factory):
    return write_tiny_model(tmp_path_factory.mktemp("q") / "float", layers=2)


@pytest.mark.parametrize("method,group,act_order,v2", [
    ("awq", 32, False, False), ("awq", 128, False, False), ("gptq", 64, False, False),
    ("gptq", 32, True, False), ("gptq", -1, False, True)])
def test_quantized_checkpoint_equals_its_dequantized_weights(float_dir, tmp_path, method, group,
                                                             act_order, v2):
    ref = _write_quantized(float_dir, str(tmp_path / "q"), method, group, act_order, v2)
    m = LlamaForCausalLM.from_pretrained(str(tmp_path / "q"))
    # Codes only: no float copy of any layer matrix.
    for layer in m.layers:
        for key in ("wqkv", "wo", "wgu", "wd"):
            assert isinstance(layer[key], PackedWeight) and layer[key].dense is None
            assert (layer[key].perm is not None) == act_order
    want_bytes = sum(v.numel() // 2 + 2 * 4 * v.numel() // 32 for v in ref.values())
    assert sum(p.nbytes for lp in m._packed for p in lp.values()) == want_bytes
    # The natural-order matrices are exactly the formula's.
    q_name = "model.layers.1.self_attn.q_proj.weight"
    k_rows = m.cfg.num_attention_heads * m.cfg.head_dim
    assert torch.equal(m.layer_weight(1, "wqkv")[:k_rows], ref[q_name])
    r = _reference_model(float_dir, ref)
    ids = [5, 77, 140, 9, 31, 200, 18, 5, 77, 140, 64, 3]
    for rows in (ids[:3], ids):  # the codes route (few rows) and the rebuilt matrices
        torch.testing.assert_close(_logits(m, rows), _logits(r, rows), rtol=1e-5, atol=1e-5)
    # Dequantized on request (packed_weights="off"): float matrices, the same logits.
    d = LlamaForCausalLM.from_pretrained(str(tmp_path / "q"), packed_weights="off")
    assert isinstance(d.layers[0]["wqkv"], torch.Tensor)
    torch.testing.assert_close(_logits(d, ids), _logits(r, ids), rtol=1e-5, atol=1e-5)


def test_act_order_layers_run_in_the_one_call_stack(float_dir, tmp_path):
    """GPTQ act-order matrices (columns in a stored order) run in the core's decoder stack, which
    gathers each matrix's input: the same bits as the layers op by op."""
    _write_quantized(float_dir, str(tmp_path / "q"), "gptq", 32, act_order=True)
    m = LlamaForCausalLM.from_pretrained(str(tmp_path / "q"))
    assert m.kernels.packed_available, "this CPU's kernels cannot read 4-bit codes"
    ids = [5, 77, 140, 9, 31]
    m.fused_layers = True
    fused = _logits(m, ids)
    assert m._fused is not None and m._fused[2] is not None  # the stack was built and ran
    m.fused_layers = False
    plain = _logits(m, ids)
    assert torch.equal(fused.view(torch.int32), plain.view(torch.int32))


def test_fused_matrices_with_different_column_orders_are_held_as_floats(float_dir, tmp_path):
    ref = _write_quantized(float_dir, str(tmp_path / "q"), "gptq", 32, act_order=True,
                           shared_order=False)
    with pytest.warns(UserWarning, match="that fused matrix is held as floats"):
        m = LlamaForCausalLM.from_pretrained(str(tmp_path / "q"))
    assert isinstance(m.layers[0]["wqkv"], torch.Tensor)
    assert isinstance(m.layers[0]["wo"], PackedWeight) and m.layers[0]["wo"].perm is not None
    ids = [5, 77, 140, 9, 31, 200, 18, 5]
    torch.testing.assert_close(_logits(m, ids), _logits(_reference_model(float_dir, ref), ids),
                               rtol=1e-5, atol=1e-5)


def test_a_quantized_lm_head_loads_as_a_float_matrix(float_dir, tmp_path):
    # A vocabulary padded to a multiple of 8 (GPTQ packs 8 output columns per word).
    padded = tmp_path / "padded"
    shutil.copytree(float_dir, padded)
    w = load_file(str(padded / "model.safetensors"))
    for k in ("model.embed_tokens.weight", "lm_head.weight"):
        w[k] = torch.cat([w[k], torch.zeros(264 - w[k].shape[0], w[k].shape[1])])
    save_file(w, str(padded / "model.safetensors"))
    conf = json.load(open(padded / "config.json"))
    json.dump(dict(conf, vocab_size=264), open(padded / "config.json", "w"))
    # (gptq_v2: the zero rows have zero points 0, which v1 stores as -1 and reads as 16.)
    ref = _write_quantized(str(padded), str(tmp_path / "q"), "gptq", 64, v2=True, lm_head=True)
    m = LlamaForCausalLM.from_pretrained(str(tmp_path / "q"))
    assert isinstance(m.lm_head, torch.Tensor) and torch.equal(m.lm_head, ref["lm_head.weight"])
    assert isinstance(m.layers[0]["wo"], PackedWeight)


def test_a_leftover_quantization_config_in_a_float_checkpoint(float_dir, tmp_path):
    shutil.copytree(float_dir, tmp_path / "f")
    conf = json.load(open(tmp_path / "f" / "config.json"))
    conf["quantization_config"] = {"quant_method": "bitsandbytes", "load_in_4bit": True}
    json.dump(conf, open(tmp_path / "f" / "config.json", "w"))
    with pytest.warns(UserWarning, match="loading the checkpoint as floats"):
        m = LlamaForCausalLM.from_pretrained(str(tmp_path / "f"))
    assert isinstance(m.layers[0]["wo"], torch.Tensor)


def test_speculative_decoding_on_a_quantized_model_is_lossless(float_dir, tmp_path):
    import pyspec

    _write_quantized(float_dir, str(tmp_path / "q"), "gptq", 32, act_order=True)
    llm = pyspec.LLM(str(tmp_path / "q"), draft="ngram", progress=False, kv_cache_tokens=1024)
    plain = pyspec.LLM(str(tmp_path / "q"), draft="none", progress=False, kv_cache_tokens=1024)
    prompt = [5, 77, 140, 9, 31, 5, 77, 140, 9, 31, 5, 77]
    p = pyspec.SamplingParams(max_tokens=24, ignore_eos=True)
    a = llm.generate([prompt], p)[0]
    b = plain.generate([prompt], p)[0]
    assert a.token_ids == b.token_ids


@pytest.mark.cuda
@pytest.mark.parametrize("method,group,act_order", [("awq", 64, False), ("gptq", 32, True)])
def test_on_a_gpu_the_layers_stay_codes(float_dir, tmp_path, method, group, act_order):
    """With Triton, a GPU model keeps the 4-bit codes (pyspec.triton_linear reads them): float32
    equal to the dequantized reference, bfloat16 to the dequantized bfloat16 model, and
    speculative decoding on it greedy-equal to plain."""
    pytest.importorskip("triton")
    import pyspec

    q = str(tmp_path / "q")
    ref = _write_quantized(float_dir, q, method, group, act_order)
    ids = [5, 77, 140, 9, 31, 200, 18, 5, 77, 140, 64, 3]
    r = _reference_model(float_dir, ref)
    for dtype, other, tol in (("float32", r, 1e-4),
                              ("bfloat16", LlamaForCausalLM.from_pretrained(
                                  q, dtype="bfloat16", device="cuda", packed_weights="off"), 5e-2)):
        m = LlamaForCausalLM.from_pretrained(q, dtype=dtype, device="cuda")
        for layer in m.layers:
            for key in ("wqkv", "wo", "wgu", "wd"):
                assert isinstance(layer[key], PackedWeight) and layer[key].q.is_cuda
        for rows in (ids[:1], ids[:5], ids):
            torch.testing.assert_close(_logits(m, rows).cpu(), _logits(other, rows).cpu(),
                                       rtol=tol, atol=tol)
    # Loaded on the CPU and moved: the codes move (and back on the CPU, float matrices).
    moved = LlamaForCausalLM.from_pretrained(q).to("cuda")
    assert isinstance(moved.layers[0]["wo"], PackedWeight) and moved.layers[0]["wo"].q.is_cuda
    torch.testing.assert_close(_logits(moved, ids).cpu(), _logits(r, ids), rtol=1e-4, atol=1e-4)
    back = moved.to("cpu")
    assert isinstance(back.layers[0]["wo"], torch.Tensor) and back._packed is None
    torch.testing.assert_close(_logits(back, ids), _logits(r, ids), rtol=1e-5, atol=1e-5)
    kw = dict(progress=False, kv_cache_tokens=1024, device="cuda", dtype="float32")
    prompt = [5, 77, 140, 9, 31, 5, 77, 140, 9, 31, 5, 77]
    p = pyspec.SamplingParams(max_tokens=24, ignore_eos=True)
    a = pyspec.LLM(q, draft="ngram", **kw).generate([prompt], p)[0]
    b = pyspec.LLM(q, draft="none", **kw).generate([prompt], p)[0]
    assert a.token_ids == b.token_ids


def test_bad_quantized_checkpoints(float_dir, tmp_path):
    def qdir(name, **qc):
        d = str(tmp_path / name)
        _write_quantized(float_dir, d, "awq", 64)
        cfg_path = os.path.join(d, "config.json")
        conf = json.load(open(cfg_path))
        conf["quantization_config"].update(qc)
        json.dump(conf, open(cfg_path, "w"))
        return d

    for name, qc, match in [("b8", {"bits": 8}, "8 bits is not supported"),
                            ("g48", {"group_size": 48}, "multiple of 32"),
                            ("gemv", {"version": "gemv"}, "gemv"),
                            ("fp8", {"quant_method": "fp8"}, "holds quantized tensors")]:
        with pytest.raises(ValueError, match=match):
            LlamaForCausalLM.from_pretrained(qdir(name, **qc))
    d = qdir("missing")
    w = load_file(os.path.join(d, "model.safetensors"))
    del w["model.layers.0.mlp.up_proj.qzeros"]
    save_file(w, os.path.join(d, "model.safetensors"))
    with pytest.raises(ValueError, match="'model.layers.0.mlp.up_proj' lacks "
                                         "model.layers.0.mlp.up_proj.qzeros"):
        LlamaForCausalLM.from_pretrained(d)
    d = qdir("shape")
    w = load_file(os.path.join(d, "model.safetensors"))
    w["model.layers.0.mlp.up_proj.scales"] = w["model.layers.0.mlp.up_proj.scales"][:1]
    save_file(w, os.path.join(d, "model.safetensors"))
    with pytest.raises(ValueError, match=r"checkpoint .*shape: model.layers.0.mlp.up_proj.scales "
                                         r"holds"):
        LlamaForCausalLM.from_pretrained(d)
    # Act-order GPTQ whose g_idx tensors are gone: refused (groups from k // G would be wrong).
    d = str(tmp_path / "no-g-idx")
    _write_quantized(float_dir, d, "gptq", 64, act_order=True)
    w = load_file(os.path.join(d, "model.safetensors"))
    save_file({k: v for k, v in w.items() if not k.endswith(".g_idx")},
              os.path.join(d, "model.safetensors"))
    with pytest.raises(ValueError, match=r"lacks model\.layers\.\d+\..*\.g_idx, which its "
                                         "quantization config's desc_act"):
        LlamaForCausalLM.from_pretrained(d)
    # A side file that is not UTF-8 JSON is named.
    d = str(tmp_path / "side")
    _write_quantized(float_dir, d, "awq", 64)
    cfg_path = os.path.join(d, "config.json")
    conf = json.load(open(cfg_path))
    conf.pop("quantization_config")
    json.dump(conf, open(cfg_path, "w"))
    open(os.path.join(d, "quant_config.json"), "wb").write(b"\xff\xfe{}")
    with pytest.raises(ValueError, match="quant_config.json: not valid UTF-8 JSON"):
        LlamaForCausalLM.from_pretrained(d)
