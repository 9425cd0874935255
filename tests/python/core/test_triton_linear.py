"""Dense layers read from 4-bit and 8-bit block codes by the Triton kernel
(pyspec.triton_linear.packed_linear), the GPU route of Linear for PackedWeight codes.

Against the float matrix the codes stand for (rounded once to the input's dtype, as that
model would hold it) times the input in float64. Without a GPU the kernel runs in Triton's
interpreter in a child process (TRITON_INTERPRET=1 is a whole-process switch); on a GPU compiled,
and a 4-bit AWQ checkpoint loaded on the device equals its dequantized model.
"""

import pytest
import torch

pytest.importorskip("triton", reason="the packed GPU kernel is written in Triton")

from pyspec.linear import Linear, PackedWeight, pack_exact  # noqa: E402
from pyspec.triton_linear import packed_linear  # noqa: E402
from helpers import run_interpreted  # noqa: E402
from packed_support import q4_grid, q8_grid  # noqa: E402
from test_triton_attention import compile_sm90  # noqa: E402

# (bits, rows, N, K, dtype, bias, act-order permutation): decode and verify rows, a prefill's,
# N and K off the tiles (K a multiple of the 32-input groups), every input dtype.
CASES = [
    (4, 1, 96, 256, torch.float32, False, False),
    (4, 7, 130, 96, torch.bfloat16, True, False),
    (4, 40, 64, 160, torch.float16, False, True),
    (4, 70, 33, 288, torch.float32, True, False),
    (8, 1, 100, 128, torch.bfloat16, False, False),
    (8, 17, 64, 224, torch.float32, True, True),
]


def run_case(case, device):
    bits, rows, n, k, dtype, with_bias, act_order = case
    grid = q4_grid if bits == 4 else q8_grid
    dense = grid(n, k, seed=rows)
    w = pack_exact(dense, bits=(bits,))
    assert w is not None and w.bits == bits
    g = torch.Generator().manual_seed(k)
    x = torch.randn(3, rows, k, generator=g)[1]  # a view with a row stride
    bias = torch.randn(n, generator=g) if with_bias else None
    if act_order:  # the stored order: columns permuted, the input gathered to match
        w.perm = torch.randperm(k, generator=g)
    codes = w.drop_dense().to(device)
    # Stored codes = dense; the product reads x's columns in perm order.
    xg = x if w.perm is None else x[:, w.perm]
    want = xg.to(dtype).double() @ dense.to(dtype).double().T
    if bias is not None:
        want += bias.double()
    xs = x.to(dtype).to(device)
    xs = xs if w.perm is None else xs.index_select(-1, codes.perm)
    got = packed_linear(xs, codes, None if bias is None else bias.to(device))
    assert got.dtype == dtype and got.shape == (rows, n)
    tol = {torch.float32: 1e-4, torch.bfloat16: 3e-2, torch.float16: 3e-3}[dtype]
    torch.testing.assert_close(got.cpu().double(), want.to(got.dtype).double(), atol=tol * 8,
                               rtol=tol)
    # Linear's GPU route (the perm gather included) and the codes' own rebuild.
    if device != "cpu":
        lin = Linear()(x.to(dtype).to(device), codes,
                       None if bias is None else bias.to(device))
        torch.testing.assert_close(lin, got, atol=0, rtol=0)
        assert torch.equal(codes.unpack().cpu(), w.unpack())


def run_all(device):
    for case in CASES:
        run_case(case, device)
    # 3-d input, out= given
    dense = q4_grid(64, 64)
    w = pack_exact(dense, bits=(4,)).drop_dense().to(device)
    x = torch.randn(2, 3, 64).to(device)
    out = torch.empty(2, 3, 64, device=device)
    assert packed_linear(x, w, out=out) is out
    torch.testing.assert_close(out.cpu().double(), x.cpu().double() @ dense.double().T,
                               atol=1e-4, rtol=1e-4)


def test_interpreted_kernel():
    run_interpreted(__file__, "run_all('cpu')")


def test_codes_rebuilt_by_torch_ops_equal_the_core_unpack():
    """PackedWeight.unpack of codes on a GPU runs torch ops (``_unpack_torch``): bit for bit
    the core's CPU rebuild, for every code width."""
    for bits, grid in ((4, q4_grid), (8, q8_grid), (16, lambda n, k: torch.randn(n, k).half()
                                                     .float())):
        w = pack_exact(grid(40, 96), bits=(bits,)).drop_dense()
        assert w.bits == bits
        assert torch.equal(w._unpack_torch(), w.unpack())
    moved = w.to("meta")
    assert moved.q.device.type == "meta" and moved.dense is None and moved.bits == 16


def test_bad_input():
    w = pack_exact(q4_grid(64, 64), bits=(4,)).drop_dense()
    with pytest.raises(ValueError, match="x has 32 columns but the matrix 64"):
        packed_linear(torch.randn(2, 32), w)
    with pytest.raises(ValueError, match="float32 / bfloat16 / float16 inputs"):
        packed_linear(torch.randn(2, 64).double(), w)
    with pytest.raises(ValueError, match="bias must be \\[64\\]"):
        packed_linear(torch.randn(2, 64), w, torch.randn(3))
    sixteen = PackedWeight(None, torch.zeros(4, 32, dtype=torch.float16), None, None, 16)
    with pytest.raises(ValueError, match="4-bit or 8-bit block codes; got 16-bit"):
        packed_linear(torch.randn(2, 32), sixteen)
    import os
    if os.environ.get("TRITON_INTERPRET") != "1":
        with pytest.raises(ValueError, match="runs on CUDA tensors"):
            packed_linear(torch.randn(2, 64), w)


@pytest.mark.parametrize("bits, block_m", [(4, 16), (4, 32), (4, 64), (8, 16), (8, 32), (8, 64)])
def test_compiles_for_sm90_without_spills(bits, block_m, tmp_path):
    from pyspec import _triton_kernels

    types = {"x": "*bf16", "q": "*u8" if bits == 4 else "*i8", "d": "*fp32", "m": "*fp32",
             "bias": "*fp32", "out": "*bf16"}
    const = {"BITS": bits, "BLOCK_M": block_m, "BLOCK_N": 64, "BLOCK_K": 64,
             "HAS_BIAS": False, "PREC": "tf32", "WIDEN": False}
    compile_sm90(_triton_kernels.packed_matmul, types, const, aligned=("x", "q", "d", "m",
                                                                        "out", "s_xm", "s_om"),
                 warps=4, stages=3, no_spill=True, tmp_path=tmp_path, fp_fusion=False)


@pytest.mark.cuda
@pytest.mark.parametrize("case", CASES)
def test_cuda_kernel(case):
    run_case(case, "cuda")
