import pytest
import torch

from pyspec import ops
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
    out = subprocess.run([sys.executable, "-c", code], env=dict(os.environ, PYSPEC_SPIN_US=env),
                         capture_output=True, text=True, check=True).stdout
    assert int(out) == expected
