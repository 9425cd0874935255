import pytest
import torch
import torch.nn.functional as F

from pyspec import _C
from pyspec.linear import MAX_FAST_ROWS, Linear, linear, max_fast_rows

TOL = {torch.float32: (1e-5, 1e-5), torch.bfloat16: (1e-2, 1e-2), torch.float16: (1e-2, 1e-2)}


_ISAS = ("generic", "avx2", "avx512", "amx")


@pytest.fixture(params=_ISAS)
def kernels(request):
    """Each build of the kernel through its own LinearKernels; one this CPU lacks is a visible
    skip, not a silently shorter list."""
    from helpers import missing_isa

    try:
        return _C.LinearKernels(request.param)
    except ValueError as e:
        missing_isa(request.param, str(e))


def _ref(x, w, b):
    # fp64 reference, rounded once to the dtype like the kernel.
    y = F.linear(x.double(), w.double(), None if b is None else b.double())
    return y.to(x.dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("m", [1, 2, 3, 5, 6, 7, 8, 13, 16, 31])
# (48, 96) and (320, 576): shapes the AMX kernel takes in bfloat16 (N % 16 == 0, K % 32 == 0).
@pytest.mark.parametrize("nk", [(7, 5), (111, 99), (1001, 577), (48, 96), (320, 576)])
@pytest.mark.parametrize("with_bias", [False, True])
def test_matches_torch(kernels, dtype, m, nk, with_bias):
    n, k = nk
    g = torch.Generator().manual_seed(m * 1000 + n + k)
    x = torch.randn(m, k, generator=g).to(dtype)
    w = (torch.randn(n, k, generator=g) / k**0.5).to(dtype)
    b = torch.randn(n, generator=g).to(dtype) if with_bias else None
    out = torch.full((m, n), float("nan"), dtype=dtype)
    _C.linear(x, w, b, out, kernels)  # the core op itself, whatever the wrapper would route
    rtol, atol = TOL[dtype]
    torch.testing.assert_close(out, _ref(x, w, b), rtol=rtol, atol=atol)
    torch.testing.assert_close(Linear(kernels)(x, w, b), F.linear(x, w, b), rtol=rtol, atol=atol)


def test_large_m_core_is_correct_and_wrapper_falls_back():
    g = torch.Generator().manual_seed(0)
    x, w, b = torch.randn(80, 33, generator=g), torch.randn(17, 33, generator=g), torch.randn(17)
    out = torch.empty(80, 17)
    _C.linear(x, w, b, out)
    torch.testing.assert_close(out, F.linear(x, w, b), rtol=1e-5, atol=1e-5)
    assert MAX_FAST_ROWS < 80
    torch.testing.assert_close(linear(x, w, b), F.linear(x, w, b))


def test_row_limits_name_the_kernel_in_use(kernels):
    lin = Linear(kernels)
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        name = str(dtype).removeprefix("torch.")
        kernel = kernels.kernel(name)
        assert kernel in ("generic", "avx2", "avx512", "avx512-bf16", "amx-bf16")
        assert 8 <= lin.max_fast_rows(dtype) == kernels.max_fast_rows(name) <= 64
        assert kernels.dense_route(name, lin.max_fast_rows(dtype)) == "linear"
        assert kernels.dense_route(name, lin.max_fast_rows(dtype) + 1) == "gemm"
    assert lin.max_fast_rows(torch.float64) == 0
    assert max_fast_rows(torch.float32) <= MAX_FAST_ROWS
    with pytest.raises(ValueError, match="dtype must be"):
        kernels.kernel("float64")


def test_two_models_kernels_side_by_side():
    """Kernels are per object, not per process: a generic and this CPU's best Linear run in one
    process, each its own build, both right (the old process-wide switch is gone)."""
    g = torch.Generator().manual_seed(4)
    x, w = torch.randn(5, 100, generator=g), torch.randn(61, 100, generator=g)
    slow, best = Linear("generic"), Linear()
    assert slow.kernels.isa == "generic" and slow.kernels.kernel("float32") == "generic"
    for lin in (slow, best, slow):
        torch.testing.assert_close(lin(x, w), F.linear(x, w), rtol=1e-5, atol=1e-5)
    assert slow.max_fast_rows(torch.float32) == 16
    assert not hasattr(_C, "_set_linear_isa")
    with pytest.raises(ValueError, match="kernels must be"):
        Linear(42)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("n", [301, 320])  # 320: the AMX kernel's shape where it runs bfloat16
def test_tree_rows_score_like_single_rows(dtype, n):
    # Verification scores a draft tree's rows in one call; plain decoding one row at a time. Up to
    # the wrapper's row limit both take the core kernel, whose rows never depend on each other.
    g = torch.Generator().manual_seed(3)
    w = (torch.randn(n, 576, generator=g) / 24).to(dtype)
    m = max_fast_rows(dtype)
    x = torch.randn(m, 576, generator=g).to(dtype)
    together = linear(x, w)
    for i in (0, 1, m // 2, m - 1):
        assert torch.equal(linear(x[i:i + 1], w)[0], together[i])


def test_wrapper_shapes_out_and_fallbacks():
    g = torch.Generator().manual_seed(1)
    w, b = torch.randn(9, 12, generator=g), torch.randn(9, generator=g)
    x3 = torch.randn(1, 3, 12, generator=g)
    y = linear(x3, w, b)
    assert y.shape == (1, 3, 9)
    torch.testing.assert_close(y, F.linear(x3, w, b))
    out = torch.empty(3, 9)
    assert linear(x3[0], w, b, out=out) is out
    torch.testing.assert_close(out, F.linear(x3[0], w, b))
    # Non-contiguous input, float64, autograd: torch handles them.
    xt = torch.randn(12, 2, generator=g).t()
    torch.testing.assert_close(linear(xt, w, b), F.linear(xt, w, b))
    torch.testing.assert_close(linear(xt.double(), w.double()), F.linear(xt.double(), w.double()))
    wp = torch.nn.Parameter(w.clone())
    y = linear(x3, wp, b)
    assert y.requires_grad
    y.sum().backward()
    assert wp.grad is not None
    # Parameters that require grad are read directly under no_grad.
    with torch.no_grad():
        torch.testing.assert_close(linear(x3, wp, b), F.linear(x3, w, b))
    # Empty inputs.
    assert linear(torch.empty(0, 12), w, b).shape == (0, 9)


@pytest.mark.parametrize("m,n,k", [(2, 3, 0), (0, 3, 4), (2, 0, 4), (0, 0, 0)])
def test_core_zero_size_is_math_not_layout(m, n, k):
    """A zero-size dimension is not a layout error (torch gives an empty [M, 0] tensor strides
    (1, 1), which the core once called non-contiguous): the core computes what torch does, bias
    alone (or zeros) for K = 0, empty results otherwise."""
    x, w, b = torch.randn(m, k), torch.randn(n, k), torch.randn(n)
    for bias in (None, b):
        out = torch.full((m, n), 7.0)
        _C.linear(x, w, bias, out)
        torch.testing.assert_close(out, F.linear(x, w, bias))
        torch.testing.assert_close(linear(x, w, bias), F.linear(x, w, bias))


def test_out_may_be_x_but_not_the_weights_or_bias():
    x, w = torch.randn(4, 4), torch.randn(4, 4)
    want = F.linear(x, w)
    _C.linear(x, w, None, x)  # the kernel reads x before writing
    torch.testing.assert_close(x, want)
    with pytest.raises(ValueError, match="'out' shares memory with 'w'"):
        _C.linear(torch.randn(4, 4), w, None, w)
    out = torch.zeros(2, 8)
    with pytest.raises(ValueError, match="'out' shares memory with 'bias'"):
        _C.linear(torch.randn(2, 8), torch.randn(8, 8), out[0], out)


def test_bad_inputs_raise_value_error():
    x, w, out = torch.randn(2, 8), torch.randn(3, 8), torch.empty(2, 3)
    with pytest.raises(ValueError, match="'w'"):
        _C.linear(x, w.bfloat16(), None, out)
    with pytest.raises(ValueError, match="'w'"):
        _C.linear(x, torch.randn(3, 7), None, out)
    with pytest.raises(ValueError, match="'bias'"):
        _C.linear(x, w, torch.randn(4), out)
    with pytest.raises(ValueError, match="'bias'"):
        _C.linear(x, w, torch.randn(3).half(), out)
    with pytest.raises(ValueError, match="'out'"):
        _C.linear(x, w, None, torch.empty(2, 4))
    with pytest.raises(ValueError, match="'out'"):
        _C.linear(x, w, None, torch.empty(3, 2).t())
    with pytest.raises(ValueError, match="'x'"):
        _C.linear(torch.randn(8, 2).t(), torch.randn(3, 2), None, torch.empty(2, 3))
    with pytest.raises(ValueError, match="'x'"):
        _C.linear(torch.randn(2, 8).double(), w.double(), None, out.double())
    with pytest.raises(ValueError, match="'x'"):
        _C.linear(torch.randn(1, 2, 8), w, None, out)
    with pytest.raises(ValueError, match="'x'"):
        _C.linear([1.0], w, None, out)
    with pytest.raises(ValueError):
        linear(x, torch.randn(3, 7))  # via the wrapper: the core names the argument
    with pytest.raises(ValueError, match="unknown linear kernel ISA 'avx9'"):
        _C.LinearKernels("avx9")


@pytest.mark.cuda
def test_cuda_not_implemented():
    x = torch.randn(2, 8, device="cuda")
    w = torch.randn(3, 8, device="cuda")
    with pytest.raises(RuntimeError, match="not implemented on CUDA"):
        _C.linear(x, w, None, torch.empty(2, 3, device="cuda"))
    torch.testing.assert_close(linear(x, w), F.linear(x, w))  # the wrapper routes to torch


def test_amx_kernel_where_the_cpu_has_it():
    """bfloat16 on AMX tiles (Intel CPUs with AMX-BF16): where it can be selected, it is what
    "auto" picks for bfloat16, it agrees with the AVX-512 kernel to one rounding, and asking for
    it on a CPU without it is a clear error."""
    try:
        amx_k = _C.LinearKernels("amx")
    except ValueError as e:
        assert "no AMX-BF16" in str(e)
        assert _C.LinearKernels().kernel("bfloat16") != "amx-bf16"
        from helpers import missing_isa

        missing_isa("amx", str(e))
    assert amx_k.isa == "amx" and amx_k.kernel("bfloat16") == "amx-bf16"
    assert amx_k.kernel("float32") == "avx512"  # AMX is for bfloat16 only
    g = torch.Generator().manual_seed(7)
    x = torch.randn(37, 576, generator=g).bfloat16()
    w = (torch.randn(960, 576, generator=g) / 24).bfloat16()
    b = torch.randn(960, generator=g).bfloat16()
    amx = torch.empty(37, 960, dtype=torch.bfloat16)
    _C.linear(x, w, b, amx, amx_k)
    vec_k = _C.LinearKernels("avx512")
    assert vec_k.kernel("bfloat16") == "avx512-bf16"
    vec = torch.empty_like(amx)
    _C.linear(x, w, b, vec, vec_k)
    ulp = (vec.float().abs() * 2.0 ** -7).clamp_min(1e-30)
    assert ((amx.float() - vec.float()).abs() <= ulp).all()
    torch.testing.assert_close(amx, _ref(x, w, b), rtol=1e-2, atol=1e-2)
    auto = _C.LinearKernels()
    assert auto.isa == "amx" and auto.kernel("bfloat16") == "amx-bf16"
