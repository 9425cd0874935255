"""The "fixed" packed numerics: packed codes on AMX int8 tiles with fixed-point input rows
(``_C.linear_fixed``, ``pyspec.linear.set_packed_numerics``). What makes them usable for
speculative decoding is that a row's outputs never depend on the other rows of a call; they are
about as accurate as float32, not its bits."""

import pytest
import torch

import pyspec
import pyspec.linear as L
from pyspec import _C
from pyspec.linear import linear, pack_exact

from test_packed import grid_dir, q4_grid, q8_grid  # noqa: F401 - grid_dir is a fixture

needs_amx_int8 = pytest.mark.skipif(not _C._fixed_available(),
                                    reason="needs a CPU with AMX-INT8 tiles")


@pytest.fixture
def fixed():
    L.set_packed_numerics("fixed")
    try:
        yield
    finally:
        L.set_packed_numerics("exact")


def test_set_packed_numerics_names_the_modes():
    with pytest.raises(ValueError, match="'exact' or 'fixed'"):
        L.set_packed_numerics("int8")
    assert L.packed_numerics() == "exact"
    if not _C._fixed_available():
        with pytest.raises(ValueError, match="AMX-INT8"):
            L.set_packed_numerics("fixed")
        assert L.packed_numerics() == "exact"


@needs_amx_int8
@pytest.mark.parametrize("grid, nk", [(q4_grid, (1536, 576)), (q4_grid, (576, 1536)),
                                      (q8_grid, (2048, 576)), (q4_grid, (960, 64)),
                                      (q4_grid, (1040, 576))])
def test_rows_do_not_depend_on_their_call_and_match_float32_accuracy(fixed, grid, nk):
    n, k = nk
    w = grid(n, k, seed=3)
    p = pack_exact(w)
    assert p is not None
    g = torch.Generator().manual_seed(1)
    x = torch.randn(40, k, generator=g)
    x[:, 7] = 60.0  # a large dimension, as hidden states have
    x[5] = 0.0
    bias = torch.randn(n, generator=g)
    ref = x.double() @ w.double().T + bias.double()
    full = linear(x, p, bias)
    # Every row count (one and several blocks of 12 rows, partial tiles), any order.
    for m in (1, 2, 3, 4, 5, 11, 12, 13, 24, 25, 39):
        assert torch.equal(linear(x[:m], p, bias), full[:m]), m
    perm = torch.randperm(40, generator=g)
    assert torch.equal(linear(x[perm], p, bias), full[perm])
    assert torch.equal(linear(x[5:6], p, bias)[0], bias)  # a zero row: the bias exactly
    # Rows below 2^-96 scale by 2^126 (exactly) and keep fewer bits, not garbage.
    tiny = x[:2] * 1e-33
    t = linear(tiny, p)
    tref = tiny.double() @ w.double().T
    assert ((t.double() - tref).abs().max() / tref.abs().max()).item() < 1e-5
    err = ((full.double() - ref).abs().max() / ref.abs().max()).item()
    L.set_packed_numerics("exact")
    exact = linear(x, p, bias)
    L.set_packed_numerics("fixed")
    err32 = ((exact.double() - ref).abs().max() / ref.abs().max()).item()
    assert err < 2e-6 and err < 4 * err32, (err, err32)
    assert not torch.equal(full, exact)  # other arithmetic: not the float32 kernel's bits


@needs_amx_int8
def test_a_row_with_a_nan_gives_nan_and_leaves_the_others(fixed):
    w = q4_grid(64, 96)
    p = pack_exact(w)
    x = torch.randn(3, 96)
    alone = linear(x, p)
    x[1, 4] = float("nan")
    x[2, 0] = float("inf")
    y = linear(x, p)
    assert torch.equal(y[0], alone[0]) and torch.isnan(y[1:]).all()


@needs_amx_int8
def test_op_checks_its_arguments():
    p = pack_exact(q4_grid(48, 64))
    tq, td, tm = p.fixed_codes()
    out = torch.empty(2, 48)
    x = torch.randn(2, 64)
    _C.linear_fixed(x, tq, td, tm, None, out)
    with pytest.raises(ValueError, match="multiple of 16"):
        q = pack_exact(q4_grid(40, 64))
        _C.linear_fixed(x, q.q, q.d, q.m, None, torch.empty(2, 40))
    with pytest.raises(ValueError):
        _C.linear_fixed(torch.randn(2, 32), tq, td, tm, None, out)  # K does not match
    with pytest.raises(ValueError):
        _C.linear_fixed(x, tq, td, tm, None, torch.empty(3, 48))  # out's shape


@needs_amx_int8
@pytest.mark.parametrize("draft", ["ngram", "layer-skip:1"])
def test_speculative_output_equals_plain_in_fixed_numerics(fixed, grid_dir, draft):  # noqa: F811
    """Lossless in the fixed numerics: greedy (and, with prompt lookup, seeded sampled)
    speculation equals plain decoding in the same numerics token for token, batched (tree rows
    and other requests' rows share a call) and alone."""
    sp = pyspec.SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    spt = pyspec.SamplingParams(max_tokens=40, temperature=0.8, seed=7, ignore_eos=True)
    prompts = ["the cat sat on the mat. the cat sat on the", "abc abc abc abc", "x"]
    spec = pyspec.SpecConfig(adaptive=False)
    a = pyspec.LLM(grid_dir, draft=draft, spec=spec, kv_cache_tokens=4096, progress=False)
    b = pyspec.LLM(grid_dir, draft="none", kv_cache_tokens=4096, progress=False)
    assert a.model._packed is not None
    # (A seeded sampled output equals plain sampling's token for token with deterministic drafts:
    # prompt lookup's; a draft model's sampled drafts change which draws are used.)
    for params in (sp, spt) if draft == "ngram" else (sp,):
        ra = a.generate(prompts, params)
        rb = b.generate(prompts, params)
        assert [r.token_ids for r in ra] == [r.token_ids for r in rb]
    alone = [b.generate([q], sp)[0].token_ids for q in prompts]
    assert alone == [r.token_ids for r in a.generate(prompts, sp)]
    assert sum(r.stats.draft_tokens for r in a.generate(prompts, sp)) > 0  # trees were verified
    # the layers ran on the tiles (their codes were laid out for them on first use)
    assert all(w._fixed is not None for lp in a.model._packed for w in lp.values()
               if w.shape[0] % 16 == 0)
