"""Codes-only packed weights (packed_weights="codes", LlamaForCausalLM.drop_dense,
PackedWeight.unpack, _C.unpack_packed): the decoder layers' float32 copies are freed and every
output stays the one the float32 matrices give, bit for bit."""

import pytest
import torch

import pyspec
from pyspec import _C
from pyspec.linear import Linear, PackedWeight, pack_exact
from pyspec.models.llama import LlamaForCausalLM
from pyspec.runner import ModelRunner, SeqStep

from packed_support import (assert_steps_bit_equal, bits_equal, needs_kernel, q4_grid, q8_grid,
                            sixteen_bit_model_dir, snap_model_dir, tied_model_dir)


@pytest.fixture(scope="module", params=["block-codes", "16-bit"])
def grid_dir(tmp_path_factory, request):
    """A model whose matrices load as codes: on the 4-bit / 8-bit block grids (as from a GGUF), or
    stored in bfloat16 / float16 (as most published checkpoints)."""
    if request.param == "16-bit":
        return sixteen_bit_model_dir(tmp_path_factory.mktemp("tiny_16_bit_codes"))
    return snap_model_dir(tmp_path_factory.mktemp("tiny_grid_codes"))


@pytest.mark.parametrize("grid", [q4_grid, q8_grid], ids=["4-bit", "8-bit"])
@pytest.mark.parametrize("nk", [(1, 32), (7, 64), (300, 576)])
def test_unpack_rebuilds_the_packed_matrix_bit_for_bit(grid, nk):
    w = grid(*nk)
    p = pack_exact(w)
    assert p is not None and p.bits == (4 if grid is q4_grid else 8)
    out = torch.full(nk, float("nan"))
    assert p.unpack(out) is out and bits_equal(out, w)
    assert p.unpack() is p.dense  # the float32 matrix itself while it is held
    assert p.drop_dense() is p and p.dense is None and p.shape == w.shape
    assert bits_equal(p.unpack(), w)


def test_unpack_packed_names_bad_arguments():
    p = pack_exact(q4_grid(16, 64))
    with pytest.raises(ValueError, match="'out'"):
        _C.unpack_packed(p.q, p.d, p.m, torch.empty(15, 64))
    with pytest.raises(ValueError, match="'out'"):
        _C.unpack_packed(p.q, p.d, p.m, torch.empty(16, 64, dtype=torch.float64))
    with pytest.raises(ValueError, match="multiple of 32"):
        _C.unpack_packed(p.q, p.d, p.m, torch.empty(16, 48))
    with pytest.raises(ValueError, match="'q'"):  # 4-bit nibbles without 'm'
        _C.unpack_packed(p.q, p.d, None, torch.empty(16, 64))
    with pytest.raises(ValueError, match="'m'"):
        _C.unpack_packed(p.q, p.d, p.m[:8].contiguous(), torch.empty(16, 64))
    buf = torch.zeros(16 * 64)  # out overlapping the scales' memory
    d = buf[:32].view(16, 2)
    d.copy_(p.d)
    with pytest.raises(ValueError, match="'out'"):
        _C.unpack_packed(p.q, d, p.m, buf.view(16, 64))


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("rows", [1, 5, 33, 64, 65, 100])
def test_codes_only_linear_equals_the_float32_matrix(packed_kernels, bits, rows):
    linear = Linear(packed_kernels)
    w = (q4_grid if bits == 4 else q8_grid)(96, 128, seed=rows)
    bias = torch.randn(96)
    p = pack_exact(w)
    codes = PackedWeight(None, p.q, p.d, p.m, p.bits)
    x = torch.randn(rows, 128)
    for b in (None, bias):
        want = linear(x, w, b)
        got = linear(x, codes, b)
        out = torch.empty(rows, 96)
        assert linear(x, codes, b, out=out) is out
        for res in (got, out):
            if rows <= 64:  # the core kernel's rows: the codes at every M, its float32 bits
                assert bits_equal(res, want), rows
            else:  # torch's GEMM on the rebuilt matrix (it may vary between calls past 64 rows)
                torch.testing.assert_close(res, want, rtol=1e-5, atol=1e-5)
    # Autograd reads a matrix of its own (not the reused scratch buffer).
    xg = x.clone().requires_grad_(True)
    linear(xg, codes, bias).sum().backward()
    assert torch.allclose(xg.grad, w.sum(0).expand(rows, -1), rtol=1e-5, atol=1e-5)


@needs_kernel
@pytest.mark.parametrize("fused", [True, False], ids=["fused", "op-by-op"])
def test_codes_model_steps_equal_the_float32_model_bit_for_bit(grid_dir, fused, monkeypatch):
    codes = LlamaForCausalLM.from_pretrained(grid_dir, packed_weights="codes")
    dense = LlamaForCausalLM.from_pretrained(grid_dir, packed_weights="off")
    codes.fused_layers = dense.fused_layers = fused
    # Every layer matrix is held as codes alone; lm_head keeps its float32 matrix.
    for i, layer in enumerate(codes.layers):
        for k in ("wqkv", "wo", "wgu", "wd"):
            assert type(layer[k]) is PackedWeight and layer[k].dense is None
            assert bits_equal(codes.layer_weight(i, k), dense.layers[i][k])
    assert isinstance(codes.lm_head, torch.Tensor) and codes._packed_lm_head.dense is codes.lm_head
    # The 60-row chunk: the codes model reads its codes where the dense one runs the float32
    # kernel on its matrices.
    ctx = assert_steps_bit_equal(codes, dense, seed=2, n_ctx=100)
    # Past 64 rows: the matrices rebuilt for the step, then torch's GEMM on the same values.
    long = [ModelRunner(m, num_blocks=16, block_size=16).step(
        [SeqStep(ctx, 0, list(range(16)), None, "all")]).logits for m in (codes, dense)]
    torch.testing.assert_close(long[0], long[1], rtol=1e-5, atol=1e-5)
    assert (codes._fused is not None and codes._fused[2] is not None) == fused
    view = codes.truncated(1)
    assert len(view._packed) == 1 and view._packed[0] is codes._packed[0]


@needs_kernel
def test_a_tied_table_is_held_as_codes_alone(tmp_path):
    """A tied embedding table whose lm_head codes are exact is held as those codes alone under
    "codes": lookups and logits are the float32 model's bit for bit, the table's float32 copy
    is gone, and a caller asking for the table gets it rebuilt."""
    from pyspec.serve.metrics import model_tensors

    path = tied_model_dir(tmp_path / "tied")
    codes = LlamaForCausalLM.from_pretrained(path, packed_weights="codes")
    auto = LlamaForCausalLM.from_pretrained(path)
    dense = LlamaForCausalLM.from_pretrained(path, packed_weights="off")
    assert codes._embed is None and codes._packed_lm_head.dense is None
    assert codes._packed_lm_head.bits == 16 and auto._embed is not None
    table = dense.embed
    assert bits_equal(codes.embed, table) and bits_equal(codes.lm_head, table)
    assert codes.embed is not codes.embed  # rebuilt per call, not kept
    ids = torch.tensor([5, 0, 77, 255, 5])
    assert bits_equal(codes.embed_rows(ids), table[ids])
    assert_steps_bit_equal(codes, dense, seed=4)
    # Only the codes stay: the model holds the table's float32 bytes less than "auto" does, on
    # top of the layers' matrices.

    def held(m):
        return sum(t.numel() * t.element_size() for t in model_tensors(m)) + m.packed_bytes

    layers_f32 = sum(auto.layer_weight(i, k).numel() * 4 for i in range(len(auto.layers))
                     for k in ("wqkv", "wo", "wgu", "wd"))
    assert held(codes) == held(auto) - layers_f32 - table.numel() * 4
    assert codes.drop_dense() == 0 and codes.pack_weights() == 0 and codes._embed is None
    # The engine on it: the plain float32 model's tokens.
    llm = pyspec.LLM(path, draft="ngram", progress=False, kv_cache_tokens=1024)
    ref = pyspec.LLM(path, draft="none", progress=False, kv_cache_tokens=1024,
                     packed_weights="off")
    assert llm.model._embed is None
    prompt = [5, 77, 140, 9, 31, 5, 77, 140, 9, 31, 5, 77]
    p = pyspec.SamplingParams(max_tokens=24, ignore_eos=True)
    assert llm.generate([prompt], p)[0].token_ids == ref.generate([prompt], p)[0].token_ids
    # On another device the table comes back as a tensor (checked on the CPU: the same path).
    moved = codes.to("cpu")
    assert moved._embed is None


def test_large_codes_only_matrices_take_many_rows_in_chunks(packed_kernels, monkeypatch):
    """A codes-only matrix too large to rebuild per call (REBUILD_MAX_BYTES) takes a call of many
    rows through the codes' route in chunks: each row the core kernel's bits, no rebuilt copy."""
    import pyspec.linear as lin_mod

    linear = Linear(packed_kernels)
    w = q8_grid(96, 128, seed=3)
    p = pack_exact(w)
    codes = PackedWeight(None, p.q, p.d, p.m, p.bits)
    limit = packed_kernels.packed_rows_limit(False)
    rows = 2 * limit + 5
    x = torch.randn(rows, 128)
    monkeypatch.setattr(lin_mod, "REBUILD_MAX_BYTES", 0)
    calls = []
    real = lin_mod._core_packed
    monkeypatch.setattr(lin_mod, "_core_packed", lambda *a: (calls.append(a[0].shape[0]),
                                                              real(*a))[1])
    got = linear(x, codes)
    assert calls == [limit, limit, 5]
    want = torch.cat([linear(x[i:i + limit], w) for i in range(0, rows, limit)])
    assert bits_equal(got, want)
    # No rows (a prefill chunk that asks for no logits): nothing rebuilt, nothing read.

    def no_rebuild(n):
        raise AssertionError("a call of no rows rebuilt the matrix")

    monkeypatch.setattr(lin_mod, "_scratch", no_rebuild)
    calls.clear()
    assert linear(torch.empty(0, 128), codes).shape == (0, 96) and calls == []


@needs_kernel
def test_codes_model_frees_the_float32_matrices(grid_dir):
    from pyspec.serve.metrics import model_tensors as _model_tensors

    auto = LlamaForCausalLM.from_pretrained(grid_dir)
    codes = LlamaForCausalLM.from_pretrained(grid_dir, packed_weights="codes")

    def held(m):  # bytes of the tensors the model holds, packed codes included
        return sum(t.numel() * t.element_size() for t in _model_tensors(m)) + m.packed_bytes

    layer_f32 = sum(auto.layer_weight(i, k).numel() * 4 for i in range(len(auto.layers))
                    for k in ("wqkv", "wo", "wgu", "wd"))
    assert held(codes) == held(auto) - layer_f32
    # No float32 copy is left behind: not in a layer, not under a PackedWeight, not in the stack.
    assert all(p.dense is None for lp in codes._packed for p in lp.values())
    assert codes.drop_dense() == 0  # idempotent
    assert codes.to("cpu") is codes and type(codes.layers[0]["wqkv"]) is PackedWeight
    # Without packed codes there is nothing to drop.
    assert LlamaForCausalLM.from_pretrained(grid_dir, packed_weights="off").drop_dense() == 0


@needs_kernel
@pytest.mark.parametrize("draft", ["none", "ngram", "layer-skip:1"])
def test_codes_generation_equals_float32_generation(grid_dir, draft):
    # A prompt past 64 tokens runs the rebuilt-matrix path in its prefill.
    prompts = ["the cat sat on the mat. the cat sat on the", "abc abc abc abc",
               " ".join(["word"] * 80)]
    fixed = pyspec.SpecConfig(adaptive=False)
    a = pyspec.LLM(grid_dir, draft=draft, spec=fixed, kv_cache_tokens=4096, progress=False,
                   packed_weights="codes")
    b = pyspec.LLM(grid_dir, draft=draft, spec=fixed, kv_cache_tokens=4096, progress=False,
                   packed_weights="off")
    assert a.model._packed is not None and a.model.layers[0]["wo"].dense is None
    for params in (pyspec.SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True),
                   pyspec.SamplingParams(max_tokens=30, temperature=0.8, seed=3, ignore_eos=True)):
        ra, rb = a.generate(prompts, params), b.generate(prompts, params)
        assert [r.token_ids for r in ra] == [r.token_ids for r in rb]


@needs_kernel
def test_draft_model_from_a_codes_target(grid_dir):
    from pyspec.train.draft_model import DraftLM

    codes = LlamaForCausalLM.from_pretrained(grid_dir, packed_weights="codes")
    dense = LlamaForCausalLM.from_pretrained(grid_dir, packed_weights="off")
    a, b = DraftLM(codes, 1), DraftLM(dense, 1)
    for (na, pa), (nb, pb) in zip(a.named_parameters(), b.named_parameters()):
        assert na == nb and bits_equal(pa.detach(), pb.detach()), na


def test_cli_codes_option(grid_dir, capsys):
    from pyspec import cli

    args = ["generate", "abc abc abc abc", "--model", grid_dir, "--draft", "ngram",
            "--max-tokens", "12", "--compare", "--ignore-eos", "--no-chat",
            "--packed-weights", "codes"]
    assert cli.main(args) == 0
    assert "outputs identical: True" in capsys.readouterr().out
    with pytest.raises(ValueError, match="packed_weights must be one of auto, codes, off"):
        LlamaForCausalLM.from_pretrained(grid_dir, packed_weights="yes")


@pytest.fixture(scope="module")
def mixed_dir(tmp_path_factory):
    """The grid model with layer 1's down_proj off the grid: that matrix does not pack."""
    import os

    from safetensors.torch import load_file, save_file

    path = snap_model_dir(tmp_path_factory.mktemp("tiny_mixed"))
    f = os.path.join(path, "model.safetensors")
    w = load_file(f)
    name = "model.layers.1.mlp.down_proj.weight"
    w[name] = w[name] + 1e-4 * torch.randn(w[name].shape, generator=torch.Generator().manual_seed(0))
    save_file(w, f)
    return path


@needs_kernel
def test_drop_dense_lets_every_old_tensor_go(mixed_dir):
    """No holder keeps a tensor from before drop_dense: not a layer dict, not a PackedWeight, not
    the packed layers' entry of a matrix that did not pack (the forward reads that), so the
    memory (one huge-page mapping, where the model is large enough for one) is freed."""
    import gc
    import weakref

    m = LlamaForCausalLM.from_pretrained(mixed_dir)  # "auto": codes next to the float32 matrices
    dense = LlamaForCausalLM.from_pretrained(mixed_dir, packed_weights="off")
    assert isinstance(m._packed[1]["wd"], torch.Tensor)  # did not pack
    assert type(m._packed[0]["wd"]) is PackedWeight
    old = [weakref.ref(t) for t in [m.embed, m.norm, m.lm_head] + [
        t for layer in m.layers for t in layer.values() if isinstance(t, torch.Tensor)]]
    assert m.drop_dense() == 7
    gc.collect()
    assert all(r() is None for r in old)
    assert m._packed[1]["wd"] is m.layers[1]["wd"]
    assert m._packed_lm_head.dense is m.lm_head
    assert_steps_bit_equal(m, dense, seed=4)


@needs_kernel
def test_codes_model_runs_when_its_kernels_change(grid_dir):
    """The fused stack needs the packed kernel for codes alone: with the model's kernels set to
    the generic build after loading, steps run op by op and rebuild the matrices, with the bits
    of the float32 model on the same kernels."""
    codes = LlamaForCausalLM.from_pretrained(grid_dir, packed_weights="codes")
    dense = LlamaForCausalLM.from_pretrained(grid_dir, packed_weights="off", kernels="generic")
    codes.set_kernels("generic")
    assert codes.kernels.isa == "generic" and not codes.kernels.packed_available
    assert codes.describe()["packed"]["codes_up_to_rows"] == 0
    assert_steps_bit_equal(codes, dense, seed=5)
    assert codes._fused is None  # never built: op by op


@needs_kernel
def test_server_on_a_codes_model(grid_dir):
    """`pyspec serve --packed-weights codes`: completions as the float32 model gives them, and the
    weight gauge counting the codes instead of the freed float32 matrices."""
    pytest.importorskip("uvicorn")
    httpx = pytest.importorskip("httpx")
    from pyspec.serve.app import create_app
    from serve_support import _start

    llm = pyspec.LLM(grid_dir, draft="ngram", kv_cache_tokens=2048, progress=False,
                     packed_weights="codes")
    ref = pyspec.LLM(grid_dir, draft="none", kv_cache_tokens=2048, progress=False,
                     packed_weights="off")
    srv, th, base = _start(create_app(llm))
    try:
        r = httpx.post(base + "/v1/completions", json={"prompt": "abc abc abc", "max_tokens": 12,
                                                        "temperature": 0})
        assert r.status_code == 200, r.text
        want = ref.generate(["abc abc abc"], pyspec.SamplingParams(max_tokens=12, temperature=0))
        assert r.json()["choices"][0]["text"] == want[0].text
        gauge = [line for line in httpx.get(base + "/metrics").text.splitlines()
                 if line.startswith('pyspec_memory_bytes{component="target_weights"}')]
        from pyspec.serve.metrics import model_tensors as _model_tensors

        held = sum(t.numel() * t.element_size() for t in _model_tensors(llm.model))
        assert float(gauge[0].split()[-1]) == held + llm.model.packed_bytes
        f32 = sum(t.numel() * t.element_size() for t in _model_tensors(ref.model))
        assert held + llm.model.packed_bytes < f32
    finally:
        srv.should_exit = True
        th.join(timeout=10)
