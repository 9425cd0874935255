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
