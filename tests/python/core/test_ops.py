import pytest
import torch

from pyspec import _C, ops
from helpers import devices


@pytest.mark.parametrize("device", devices())
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("layers", [None, 3])
def test_materialize_matches_index_copy(device, dtype, layers):
    g = torch.Generator().manual_seed(0)
    S, H, D, B, bs = 9, 3, 80, 7, 16
    lead = () if layers is None else (layers,)
    scratch = torch.randn(*lead, S, H, D, generator=g).to(dtype).to(device)
    pages = torch.randn(*lead, B, bs, H, D, generator=g).to(dtype).to(device)
    src = torch.tensor([0, 4, 8, 2], dtype=torch.int64, device=device)
    dst = torch.tensor([5, 111, 17, 40], dtype=torch.int32, device=device)
    expected = pages.clone().reshape(*lead, B * bs, H, D)
    expected.index_copy_(len(lead), dst.long(), scratch.index_select(len(lead), src))
    ops.materialize_kv(scratch, pages, src, dst)
    torch.testing.assert_close(pages.reshape(*lead, B * bs, H, D), expected, rtol=0, atol=0)


@pytest.mark.parametrize(
    "mutate, match",
    [
        (lambda a: a.update(dst=torch.tensor([32])), "dst_slots\\[0\\]"),
        (lambda a: a.update(src=torch.tensor([-1])), "src_rows\\[0\\]"),
        (lambda a: a.update(pages=a["pages"].half()), "dtype"),
        (lambda a: a.update(pages=a["pages"][:, :, :1]), "pages"),
        (lambda a: a.update(src=torch.tensor([0.5])), "src_rows"),
        (lambda a: a.update(src=torch.tensor([0, 1])), "equal length"),
        (lambda a: a.update(scratch=a["scratch"].transpose(1, 2)), "contiguous|shape"),
        (lambda a: a.update(scratch=[1, 2]), "scratch"),
        (lambda a: a.update(scratch=None), "scratch"),
    ],
)
def test_materialize_bad_input(mutate, match):
    args = dict(scratch=torch.zeros(4, 2, 8), pages=torch.zeros(2, 16, 2, 8),
                src=torch.tensor([1]), dst=torch.tensor([3]))
    mutate(args)
    with pytest.raises(ValueError, match=match):
        ops.materialize_kv(args["scratch"], args["pages"], args["src"], args["dst"])


def test_spin_window_setting():
    """The CPU ops' polling window: readable, settable, validated; results do not depend on it."""
    from pyspec import _C, linear

    before = _C.spin_us()
    assert 0 <= before <= 100000
    x, w = torch.randn(5, 96), torch.randn(300, 96)
    try:
        outs = []
        for us in (0, 7, 2000):
            _C.set_spin_us(us)
            assert _C.spin_us() == us
            outs.append(linear.linear(x, w))
        for o in outs[1:]:
            assert torch.equal(o, outs[0])
        for bad in (-1, 100001):
            with pytest.raises(ValueError, match=r"\[0, 100000\]"):
                _C.set_spin_us(bad)
        assert _C.spin_us() == 2000
    finally:
        _C.set_spin_us(before)
    assert _C.spin_us() == before


@pytest.mark.parametrize("env, expected", [("123", 123), ("0", 0), ("999999", 100000),
                                           ("abc", 500), ("-4", 500), ("", 500)])
def test_spin_window_from_environment(env, expected):
    import os
    import subprocess
    import sys

    code = "from pyspec import _C; print(_C.spin_us())"
    # cwd="/": import the installed package, not a source checkout without the built module
    out = subprocess.run([sys.executable, "-c", code], env=dict(os.environ, PYSPEC_SPIN_US=env),
                         capture_output=True, text=True, check=True, cwd="/").stdout
    assert int(out) == expected


def _rms_reference(x, w, eps):
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return w * xf.to(x.dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("rows", [1, 16, 400])
def test_rms_norm_core_matches_torch(dtype, rows):
    g = torch.Generator().manual_seed(rows)
    x = (torch.randn(rows, 576, generator=g) * 3).to(dtype)
    w = torch.randn(576, generator=g).to(dtype)
    got = ops.rms_norm(x, w, 1e-5)
    ref = _rms_reference(x, w, 1e-5)
    assert got.dtype == dtype and got.shape == x.shape
    # float32: summation order only; 16-bit: at most one rounding step of the dtype.
    tol = dict(rtol=1e-5, atol=1e-6) if dtype == torch.float32 else dict(rtol=1e-2, atol=1e-3)
    torch.testing.assert_close(got, ref, **tol)
    # A row alone gives the same bits as within the batch (draft trees rely on it).
    for r in {0, rows // 2, rows - 1}:
        assert torch.equal(ops.rms_norm(x[r:r + 1].clone(), w, 1e-5), got[r:r + 1])


def test_rotary_outputs_must_be_separate():
    qkv, cs = torch.randn(2, 4 * 8), torch.zeros(2, 8)
    q = torch.empty(2, 2, 8)
    with pytest.raises(ValueError, match="shares memory"):
        _C.rotary_qkv(qkv, cs, cs, q, q[:, :1], torch.empty(2, 1, 8))
    with pytest.raises(ValueError, match="shares memory with 'qkv'"):
        _C.rotary_qkv(qkv, cs, cs, qkv[:, :16].view(2, 2, 8), torch.empty(2, 1, 8),
                      torch.empty(2, 1, 8))


@pytest.mark.parametrize("shape", [(2, 0), (0, 4)])
def test_rms_norm_zero_size(shape):
    """Rows without features or no rows at all: an empty result, not a contiguity error."""
    x = torch.zeros(shape)
    out = ops.rms_norm(x, torch.ones(shape[1]), 1e-6)
    assert out.shape == shape
    _C.rms_norm(x, torch.ones(shape[1]), 1e-6, x)


def test_rms_norm_falls_back_for_autograd_and_layouts():
    x = torch.randn(4, 32, requires_grad=True)
    w = torch.randn(32)
    y = ops.rms_norm(x, w, 1e-6)
    y.sum().backward()  # torch ops: differentiable
    assert x.grad is not None and x.grad.shape == x.shape
    xt = torch.randn(32, 4).t()  # not contiguous: torch path, same values
    torch.testing.assert_close(ops.rms_norm(xt, w, 1e-6), _rms_reference(xt, w, 1e-6))
    x3 = torch.randn(2, 3, 32)  # leading dims are flattened
    torch.testing.assert_close(ops.rms_norm(x3, w, 1e-6), _rms_reference(x3, w, 1e-6),
                               rtol=1e-5, atol=1e-6)


def _rope_tables(t, d, offset=7):
    inv = 1.0 / (10000 ** (torch.arange(0, d, 2).float() / d))
    ang = (torch.arange(t).float() + offset)[:, None] * inv
    ang = torch.cat([ang, ang], -1)
    return ang.cos(), ang.sin()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("rows", [1, 9, 300])
def test_rotary_qkv_core_matches_torch(dtype, rows):
    H, Hkv, D = 9, 3, 64
    g = torch.Generator().manual_seed(rows)
    qkv = torch.randn(rows, (H + 2 * Hkv) * D, generator=g).to(dtype)
    cos, sin = _rope_tables(rows, D)
    k, v = torch.empty(rows, Hkv, D, dtype=dtype), torch.empty(rows, Hkv, D, dtype=dtype)
    q = ops.rotary_qkv(qkv, cos, sin, H, Hkv, k, v)
    # the torch path: a non-contiguous k_out forces it
    k_ref = torch.empty(Hkv, rows, D, dtype=dtype).transpose(0, 1)
    v_ref = torch.empty(rows, Hkv, D, dtype=dtype)
    q_ref = ops.rotary_qkv(qkv, cos, sin, H, Hkv, k_ref, v_ref)
    tol = dict(rtol=1e-5, atol=1e-6) if dtype == torch.float32 else dict(rtol=1e-2, atol=1e-2)
    torch.testing.assert_close(q, q_ref, **tol)
    torch.testing.assert_close(k, k_ref, **tol)
    assert torch.equal(v, v_ref)
    assert torch.equal(v, qkv[:, (H + Hkv) * D:].view(rows, Hkv, D))
    r = rows - 1  # row independence
    k1, v1 = torch.empty(1, Hkv, D, dtype=dtype), torch.empty(1, Hkv, D, dtype=dtype)
    q1 = ops.rotary_qkv(qkv[r:r + 1].clone(), cos[r:r + 1].clone(), sin[r:r + 1].clone(), H, Hkv,
                        k1, v1)
    assert torch.equal(q1, q[r:r + 1]) and torch.equal(k1, k[r:r + 1])


@pytest.mark.parametrize(
    "call, match",
    [
        (lambda: _C.rms_norm(torch.zeros(2, 8), torch.zeros(7), 1e-5, torch.zeros(2, 8)), "'w'"),
        (lambda: _C.rms_norm(torch.zeros(2, 8), torch.zeros(8), -1.0, torch.zeros(2, 8)), "eps"),
        (lambda: _C.rms_norm(torch.zeros(2, 8), torch.zeros(8), 1e-5, torch.zeros(2, 8).half()),
         "dtype"),
        (lambda: _C.rms_norm(torch.zeros(2, 8, dtype=torch.int32), torch.zeros(8), 1e-5,
                             torch.zeros(2, 8)), "'x'"),
        (lambda: _C.rotary_qkv(torch.zeros(2, 19), torch.zeros(2, 4), torch.zeros(2, 4),
                               torch.zeros(2, 3, 4), torch.zeros(2, 1, 4), torch.zeros(2, 1, 4)),
         "'qkv'"),
        (lambda: _C.rotary_qkv(torch.zeros(2, 20), torch.zeros(2, 4).double(), torch.zeros(2, 4),
                               torch.zeros(2, 3, 4), torch.zeros(2, 1, 4), torch.zeros(2, 1, 4)),
         "'cos'"),
        (lambda: _C.rotary_qkv(torch.zeros(2, 15), torch.zeros(2, 3), torch.zeros(2, 3),
                               torch.zeros(2, 3, 3), torch.zeros(2, 1, 3), torch.zeros(2, 1, 3)),
         "even"),
    ],
)
def test_layer_ops_bad_input(call, match):
    with pytest.raises(ValueError, match=match):
        call()
