"""Packed exact weights: float32 matrices whose values are exactly a 4-bit (w = d * q + m) or 8-bit
(w = d * q) block format, or float16 / bfloat16 values, are also held as those codes, and pyspec.linear reads the codes for the
few rows of decoding with results equal to the float32 kernel's bit for bit (pyspec.linear's
PackedWeight / pack_exact, _C.linear_packed, LlamaForCausalLM.pack_weights)."""

import pytest
import torch
import torch.nn.functional as F

import pyspec
from pyspec import _C
from pyspec.linear import Linear, PackedWeight, linear, max_fast_rows, pack_exact
from pyspec.models.llama import LlamaForCausalLM
from pyspec.runner import ModelRunner, SeqStep

from models_support import write_tiny_model
from packed_support import (assert_steps_bit_equal, bits_equal, needs_kernel, q4_grid, q8_grid,
                            snap_model_dir)


def rebuild(p: PackedWeight) -> torch.Tensor:
    """The documented code layout, decoded in Python."""
    n, k = p.shape
    if p.bits == 16:
        return p.q.float()
    if p.bits == 4:
        b = p.q.view(n, k // 32, 16).to(torch.int32)
        q = torch.cat([b & 15, b >> 4], -1).float()
        return (q * p.d[..., None] + p.m[..., None]).reshape(n, k)
    return (p.q.view(n, k // 32, 32).float() * p.d[..., None]).reshape(n, k)


def test_pack_exact_recognizes_the_formats_and_nothing_else():
    w4, w8 = q4_grid(40, 96), q8_grid(40, 96)
    p4, p8 = pack_exact(w4), pack_exact(w8)
    assert p4.bits == 4 and p4.q.dtype == torch.uint8 and p4.q.shape == (40, 48)
    assert p4.d.shape == p4.m.shape == (40, 3) and p4.nbytes == 40 * 48 + 2 * 40 * 3 * 4
    assert p8.bits == 8 and p8.q.dtype == torch.int8 and p8.q.shape == (40, 96) and p8.m is None
    assert bits_equal(rebuild(p4), w4) and bits_equal(rebuild(p8), w8)
    assert p4.dense is w4 and p4.shape == w4.shape
    # 8-bit codes only when asked for 8 bits; a 4-bit grid is also an 8-bit one only by chance.
    assert pack_exact(w4, bits=(8,)) is None or bits_equal(rebuild(pack_exact(w4, bits=(8,))), w4)
    assert pack_exact(w8, bits=(4,)) is None
    # Not a block format: off the grid by one ulp in one place, random values, other dtypes,
    # K not a multiple of 32, autograd, not a matrix.
    off = w4.clone()
    off[5, 17] = torch.nextafter(off[5, 17], torch.tensor(1.0))
    assert pack_exact(off) is None or bits_equal(rebuild(pack_exact(off)), off)
    assert pack_exact(torch.randn(64, 64)) is None
    assert pack_exact(w4.bfloat16()) is None and pack_exact(w4.double()) is None
    assert pack_exact(q4_grid(8, 64)[:, :48].contiguous()) is None
    assert pack_exact(w4.clone().requires_grad_()) is None
    assert pack_exact(w4[0]) is None and pack_exact(w4.t()) is None
    assert pack_exact(torch.empty(0, 64)) is None
    nan = w4.clone()
    nan[0, 0] = float("nan")
    assert pack_exact(nan) is None


def grid16(n, k, dtype, seed=0):
    """float32 values that are exactly ``dtype`` values: normal ones of several magnitudes, a few
    float16 subnormals, signed zeros."""
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=g) * torch.exp2(torch.randint(-6, 3, (n, 1), generator=g))
    w[:, 3] *= 1e-6  # float16 subnormals (bfloat16: tiny normals)
    w[0, :2] = torch.tensor([0.0, -0.0])
    return w.to(dtype).float()


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_pack_exact_takes_16_bit_values(dtype):
    w = grid16(70, 96, dtype)
    p = pack_exact(w)
    assert p.bits == 16 and p.q.dtype == dtype and p.d is None and p.m is None
    assert p.q.shape == (70, 96) and p.nbytes == 70 * 96 * 2 and p.shape == w.shape
    assert bits_equal(rebuild(p), w)
    out = torch.full_like(w, float("nan"))
    _C.unpack_packed(p.q, None, None, out)  # the core's widening, any CPU
    assert bits_equal(out, w)
    assert pack_exact(w, bits=(4, 8)) is None
    # One value with more bits than the format has: not exact, no codes of that format.
    off = w.clone()
    off[65, 7] = torch.nextafter(off[65, 7], torch.tensor(10.0))
    p = pack_exact(off)
    assert p is None or (p.q.dtype != dtype and bits_equal(rebuild(p), off))
    inf = w.clone()
    inf[1, 1] = float("inf")
    assert pack_exact(inf) is None
    with pytest.raises(ValueError, match="16-bit codes .* have no scales"):
        _C.unpack_packed(p.q if p is not None else w.to(dtype), torch.ones(70, 3), None, out)


def test_pack_exact_keeps_signed_zeros_and_constant_groups():
    w = q4_grid(4, 64)
    w[1, :32] = 0.25  # a constant group: d = 0
    w[2, 32:] = 0.0
    p = pack_exact(w)
    assert p is not None and p.bits == 4 and bits_equal(rebuild(p), w)
    # A -0.0 rebuilds as +0.0 in either format (d * 0 + m, d * 0): only bit patterns that
    # rebuild exactly may pack, so neither format takes it.
    w[2, 40] = -0.0
    assert pack_exact(w) is None
    w8 = q8_grid(4, 64)
    w8[0, 5] = 0.0
    assert pack_exact(w8).bits == 8
    w8[0, 5] = -0.0
    assert pack_exact(w8) is None


def test_big_matrix_of_another_format_fails_fast_and_still_packs_right():
    # More than 64 rows: the cheap check on the first rows, then the whole matrix.
    w = q8_grid(200, 64, seed=3)
    p = pack_exact(w)
    assert p.bits == 8 and bits_equal(rebuild(p), w)
    w2 = q4_grid(200, 64, seed=4)
    w2[150, 10] += 1e-3  # fine in the first rows, off the grid further down
    assert pack_exact(w2, bits=(4,)) is None


@pytest.mark.parametrize("isa, rows", [("generic", 0), ("avx2", 4), ("avx512", 32)])
def test_packed_rows_follow_the_kernel(isa, rows):
    try:
        k = _C.LinearKernels(isa)
    except ValueError as e:
        pytest.skip(f"no {isa} kernel on this CPU: {e}")
    assert k.packed_max_rows == rows and k.packed_available == (rows > 0)
    fast = k.max_fast_rows("float32")
    assert k.packed_rows_limit(True) == min(rows, fast) and k.packed_rows_limit(False) == (
        fast if rows else 0)
    if rows:
        assert k.packed_route(rows, True) == "packed" and k.packed_route(rows + 1, True) == "linear"
        assert k.packed_route(fast, False) == "packed" and k.packed_route(fast + 1, False) == "gemm"
    assert k.packed_route(0, True) == "linear"


@pytest.mark.parametrize("bits", [4, 8, "float16", "bfloat16"])
@pytest.mark.parametrize("nk", [(7, 64), (13, 96), (960, 576), (576, 1536)])
@pytest.mark.parametrize("with_bias", [False, True])
def test_packed_linear_equals_float32_kernel_bit_for_bit(packed_kernels, bits, nk, with_bias):
    linear = Linear(packed_kernels)
    n, k = nk
    w = (q4_grid(n, k, seed=n) if bits == 4 else q8_grid(n, k, seed=n) if bits == 8
         else grid16(n, k, getattr(torch, bits), seed=n))
    p = pack_exact(w)
    assert p is not None and p.bits == (bits if isinstance(bits, int) else 16)
    g = torch.Generator().manual_seed(k)
    b = torch.randn(n, generator=g) if with_bias else None
    for m in (1, 2, 3, 4, 5, 7, 8, 9, 13, 16, 32, 33, max_fast_rows(torch.float32)):
        x = torch.randn(m, k, generator=g)
        got, want = linear(x, p, b), linear(x, w, b)
        assert bits_equal(got, want), (bits, n, k, m, (got - want).abs().max().item())
        out = torch.full((m, n), float("nan"))
        _C.linear_packed(x, p.q, p.d, p.m, b, out, packed_kernels)  # the op, whatever the route
        assert bits_equal(out, want), (packed_kernels.isa, m)
    # Past the core kernel's rows both go to torch's GEMM on the float32 matrix (whose results
    # may vary with its threading from call to call: compared to rounding).
    x = torch.randn(80, k, generator=g)
    torch.testing.assert_close(linear(x, p, b), F.linear(x, w, b), rtol=1e-4, atol=1e-4)


class CountPacked:
    """Counts the calls linear makes to the packed op (its route), passing them on."""

    def __init__(self, monkeypatch):
        import pyspec.linear as mod

        self.calls = 0
        real = mod._core_packed

        def counted(*args):
            self.calls += 1
            return real(*args)

        monkeypatch.setattr(mod, "_core_packed", counted)


@needs_kernel
def test_packed_linear_shapes_out_and_autograd(monkeypatch):
    count = CountPacked(monkeypatch)
    w = q4_grid(48, 64)
    p = pack_exact(w)
    x = torch.randn(2, 3, 64)
    assert bits_equal(linear(x, p), linear(x, w)) and linear(x, p).shape == (2, 3, 48)
    out = torch.empty(2, 3, 48)
    assert linear(x, p, out=out) is out and bits_equal(out, linear(x, w))
    x1 = torch.randn(64)  # one row as a vector
    assert linear(x1, p).shape == (48,) and bits_equal(linear(x1, p), linear(x1, w))
    out1 = torch.empty(48)
    assert linear(x1, p, out=out1) is out1 and bits_equal(out1, linear(x1, w))
    assert count.calls == 6
    with pytest.raises(ValueError, match="'w'"):  # the dense route names the mismatch
        linear(torch.randn(2, 32), p)
    assert count.calls == 6
    # Autograd or other dtypes take the dense matrix.
    xg = torch.randn(2, 64, requires_grad=True)
    y = linear(xg, p)
    assert y.requires_grad and bits_equal(y.detach(), F.linear(xg, w).detach())
    xb = torch.randn(2, 64).bfloat16()
    with pytest.raises(ValueError, match="share one dtype"):  # as linear(xb, w) does
        linear(xb, p)
    with pytest.raises(ValueError, match="share one dtype"):
        linear(xb, w)


def test_packed_linear_follows_the_kernel_in_use(monkeypatch):
    # With the baseline build, the packed kernel is unavailable and a Linear on it reads the
    # dense matrix, so results still match the dense path's.
    count = CountPacked(monkeypatch)
    w = q4_grid(32, 64)
    p = pack_exact(w)
    x = torch.randn(3, 64)
    generic = _C.LinearKernels("generic")
    assert not generic.packed_available
    lin = Linear(generic)
    assert bits_equal(lin(x, p), lin(x, w))
    assert count.calls == 0
    out = torch.empty(3, 32)
    with pytest.raises(ValueError, match="AVX2 or AVX-512"):
        _C.linear_packed(x, p.q, p.d, p.m, None, out, generic)


@needs_kernel
def test_linear_packed_op_names_bad_arguments():
    p = pack_exact(q4_grid(16, 64))
    x, out = torch.randn(2, 64), torch.empty(2, 16)
    with pytest.raises(ValueError, match="multiple of 32"):
        _C.linear_packed(torch.randn(2, 48), p.q, p.d, p.m, None, out)
    with pytest.raises(ValueError, match="'d'"):
        _C.linear_packed(x, p.q, p.d.half(), p.m, None, out)
    with pytest.raises(ValueError, match="'q'"):
        _C.linear_packed(x, p.q[:, :16].contiguous(), p.d, p.m, None, out)
    with pytest.raises(ValueError, match="'m'"):
        _C.linear_packed(x, p.q, p.d, p.m[:8].contiguous(), None, out)
    with pytest.raises(ValueError, match="'out'"):
        _C.linear_packed(x, p.q, p.d, p.m, None, torch.empty(3, 16))
    with pytest.raises(ValueError, match="'x'"):
        _C.linear_packed(x.double(), p.q, p.d, p.m, None, out)
    with pytest.raises(ValueError, match="'bias'"):
        _C.linear_packed(x, p.q, p.d, p.m, torch.randn(15), out)
    # The code dtype goes with the format: uint8 nibbles with 'm', int8 codes without.
    with pytest.raises(ValueError, match="'q'"):
        _C.linear_packed(x, p.q.view(torch.int8), p.d, p.m, None, out)
    p8 = pack_exact(q8_grid(16, 64))
    with pytest.raises(ValueError, match="'q'"):
        _C.linear_packed(x, p8.q.view(torch.uint8), p8.d, None, None, out)
    with pytest.raises(ValueError, match="'x' has K = 96"):
        _C.linear_packed(torch.randn(2, 96), p8.q, p8.d, None, None, out)


@pytest.fixture(scope="module")
def grid_dir(tmp_path_factory):
    return snap_model_dir(tmp_path_factory.mktemp("tiny_grid"))


def test_from_pretrained_packs_exact_matrices_only(grid_dir, tmp_path, monkeypatch):
    m = LlamaForCausalLM.from_pretrained(grid_dir)
    if _C.LinearKernels().packed_available:
        assert sum(not isinstance(v, torch.Tensor) for lp in m._packed for v in lp.values()) == 8
        assert m._packed_lm_head is not None and m._packed_lm_head.bits == 8
        assert {lp["wqkv"].bits for lp in m._packed} == {4}
        assert 0 < m.packed_bytes < sum(t.numel() * 4 for lp in m._packed for t in
                                        (v.dense for v in lp.values()))
    else:
        assert m._packed is None and m.packed_bytes == 0
    assert LlamaForCausalLM.from_pretrained(grid_dir, packed_weights="off")._packed is None
    assert LlamaForCausalLM.from_pretrained(grid_dir, dtype="bfloat16")._packed is None
    monkeypatch.setenv("PYSPEC_PACKED_WEIGHTS", "0")
    assert LlamaForCausalLM.from_pretrained(grid_dir)._packed is None
    monkeypatch.delenv("PYSPEC_PACKED_WEIGHTS")
    with pytest.raises(ValueError, match="packed_weights must be one of auto, codes, off"):
        LlamaForCausalLM.from_pretrained(grid_dir, packed_weights="yes")
    with pytest.raises(ValueError, match="packed_weights"):
        pyspec.LLM(grid_dir, packed_weights=True, progress=False)
    # Random weights are no block format: nothing to pack.
    plain_dir = write_tiny_model(tmp_path / "random")
    assert LlamaForCausalLM.from_pretrained(plain_dir)._packed is None


@pytest.mark.parametrize("fused", [True, False], ids=["fused", "op-by-op"])
def test_packed_model_steps_equal_the_float32_model_bit_for_bit(grid_dir, packed_kernels, fused,
                                                                monkeypatch):
    count = CountPacked(monkeypatch)
    packed = LlamaForCausalLM.from_pretrained(grid_dir, kernels=packed_kernels)
    dense = LlamaForCausalLM.from_pretrained(grid_dir, packed_weights="off",
                                             kernels=packed_kernels)
    packed.fused_layers = dense.fused_layers = fused
    assert packed._packed is not None and dense._packed is None
    assert_steps_bit_equal(packed, dense, seed=0)
    # The packed model's steps within the kernel's rows read the codes: every matrix of the
    # one-row decode step (o4), and with AVX-512 those of the 30-row chunk, the 9-node tree and
    # the 6-node chain (5 to 8 rows: the kernel's one-pass path). Op by op they are counted
    # here; the fused stack reads the layers' codes in the core, so only lm_head's calls pass
    # through Python (test_fused_stack_reads_the_codes checks it).
    steps = 4 if packed_kernels.isa == "avx512" else 1
    assert count.calls == steps * ((4 * 2 if not fused else 0) + 1)
    assert (packed._fused is not None and packed._fused[2] is not None) == fused
    # The truncated view (layer skipping) keeps the packed layers it runs.
    view = packed.truncated(1)
    assert len(view._packed) == 1 and view._packed[0] is packed._packed[0]


@needs_kernel
def test_fused_stack_reads_the_codes(grid_dir, monkeypatch):
    """The fused stack reads a packed matrix's codes for steps within the packed rows and its
    float32 values beyond them: with the float32 copies scaled after packing (in place, so the
    stack's views see it), a decode step is unchanged and a 40-row step is not."""
    if _C.LinearKernels().packed_max_rows < 1:
        pytest.skip("no packed kernel")
    m = LlamaForCausalLM.from_pretrained(grid_dir)
    runner = ModelRunner(m, num_blocks=16, block_size=16)
    g = torch.Generator().manual_seed(1)
    ctx = torch.randint(3, 250, (40,), generator=g).tolist()

    def steps():
        a = runner.step([SeqStep(ctx[:1], 0, list(range(16)), None, "last")]).logits
        b = runner.step([SeqStep(ctx, 0, list(range(16)), None, "last")]).logits
        return a, b

    assert m.fused_layers
    before = steps()
    assert m._fused is not None and m._fused[2] is not None
    for lp in m._packed:
        for p in lp.values():
            if not isinstance(p, torch.Tensor):  # packed (here every layer matrix is)
                p.dense.mul_(2)
    after = steps()
    assert bits_equal(before[0], after[0])
    if _C.LinearKernels().packed_max_rows < 40:
        assert not torch.allclose(before[1], after[1])


@needs_kernel
@pytest.mark.parametrize("draft", ["none", "ngram", "layer-skip:1"])
def test_packed_generation_equals_float32_generation(grid_dir, draft):
    sp = pyspec.SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    spt = pyspec.SamplingParams(max_tokens=40, temperature=0.8, seed=7, ignore_eos=True)
    prompts = ["the cat sat on the mat. the cat sat on the", "abc abc abc abc", "x"]
    # Fixed draft lengths: the cost model's follow step timings, which differ between the two
    # (and a sampled chain's tokens depend on how long it drafts).
    fixed = pyspec.SpecConfig(adaptive=False)
    a = pyspec.LLM(grid_dir, draft=draft, spec=fixed, kv_cache_tokens=4096, progress=False)
    b = pyspec.LLM(grid_dir, draft=draft, spec=fixed, kv_cache_tokens=4096, progress=False,
                   packed_weights="off")
    assert a.model._packed is not None and b.model._packed is None
    for params in (sp, spt):
        ra, rb = a.generate(prompts, params), b.generate(prompts, params)
        assert [r.token_ids for r in ra] == [r.token_ids for r in rb]


def test_cli_packed_weights_option(grid_dir, capsys):
    from pyspec import cli

    args = ["generate", "abc abc abc abc", "--model", grid_dir, "--draft", "ngram",
            "--max-tokens", "12", "--compare", "--ignore-eos", "--no-chat"]
    assert cli.main(args) == 0
    out = capsys.readouterr().out
    assert "outputs identical: True" in out
    assert ("MB of exact block codes" in out) == _C.LinearKernels().packed_available, out
    assert cli.main(args + ["--packed-weights", "off"]) == 0
    assert "block codes" not in capsys.readouterr().out
    with pytest.raises(SystemExit) as e:
        cli.main(args + ["--packed-weights", "on"])
    assert e.value.code == 2 and "--packed-weights" in capsys.readouterr().err


@needs_kernel
def test_draft_model_follows_the_targets_setting(grid_dir):
    # The grid model as its own draft model (a draft-model folder): packed as the target is.
    a = pyspec.LLM(grid_dir, draft=grid_dir, kv_cache_tokens=1024, progress=False)
    b = pyspec.LLM(grid_dir, draft=grid_dir, kv_cache_tokens=1024, progress=False,
                   packed_weights="off")
    da, db = (next(iter(x.engine.drafters.values())) for x in (a, b))
    assert da.model._packed is not None and db.model._packed is None
    sp = pyspec.SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    assert a.generate(["abc abc"], sp)[0].token_ids == b.generate(["abc abc"], sp)[0].token_ids
