"""Tensors on transparent huge pages (pyspec.hugepages): same values, same results, ties kept."""

import pytest
import torch

from pyspec import hugepages
from pyspec.models.llama import LlamaForCausalLM
from pyspec.runner import ModelRunner, SeqStep
from helpers import default_prompt, tiny_config

needs_huge = pytest.mark.skipif(not hugepages.enabled(), reason="no MADV_HUGEPAGE here")


def _thp_mode():
    try:
        with open("/sys/kernel/mm/transparent_hugepage/enabled") as f:
            return f.read().split("[")[1].split("]")[0]
    except (OSError, IndexError):
        return "never"


def _anon_huge_kb():
    with open("/proc/self/smaps_rollup") as f:
        return int(f.read().split("AnonHugePages:")[1].split()[0])


@pytest.fixture
def any_size(monkeypatch):
    """Map requests of any size (the default leaves those under 8 MiB on ordinary pages)."""
    monkeypatch.setattr(hugepages, "MIN_BYTES", 0)


@needs_huge
def test_copies_keep_values_dtypes_ties_and_alignment(any_size):
    g = torch.Generator().manual_seed(0)
    a = torch.randn(3, 5, generator=g)
    b = torch.randn(7, generator=g).to(torch.bfloat16)
    c = torch.randint(0, 100, (4, 4), generator=g, dtype=torch.int64)
    out = hugepages.huge_page_copies([a, None, b, a, c, torch.empty(0, 3)])
    assert out[1] is None and out[0] is out[3]  # a tensor given twice: one copy (ties)
    for got, want in ((out[0], a), (out[2], b), (out[4], c)):
        assert got is not want and got.dtype == want.dtype and got.shape == want.shape
        assert torch.equal(got, want) and got.data_ptr() % 64 == 0
    assert out[5].shape == (0, 3)
    # One mapping for all of them, starting on a 2 MiB boundary.
    ptrs = sorted(t.data_ptr() for t in (out[0], out[2], out[4]))
    assert ptrs[0] % (2 << 20) == 0 and ptrs[-1] - ptrs[0] < (2 << 20)
    # Writing a copy does not touch the original.
    out[0].zero_()
    assert a.abs().sum() > 0


def test_what_cannot_move_stays(monkeypatch, any_size):
    small = torch.randn(4, 4)
    monkeypatch.setattr(hugepages, "MIN_BYTES", 8 << 20)
    assert hugepages.huge_page_copies([small])[0] is small  # under MIN_BYTES
    monkeypatch.setattr(hugepages, "MIN_BYTES", 0)
    x = torch.randn(4, 4)
    t = x.t()  # not contiguous
    assert hugepages.huge_page_copies([x, t])[1] is t
    w = torch.randn(3, requires_grad=True)
    assert hugepages.huge_page_copies([w])[0] is w
    monkeypatch.setenv("PYSPEC_HUGEPAGES", "0")
    assert not hugepages.enabled()
    assert hugepages.huge_page_copies([x])[0] is x
    e = hugepages.huge_page_empty((2, 3), torch.float16)
    assert e.shape == (2, 3) and e.dtype == torch.float16


def _logits(model):
    runner = ModelRunner(model, num_blocks=16, block_size=8)
    ids = default_prompt(length=30, seed=3)
    out = runner.step([SeqStep(ids, 0, list(range(4)), None, "all")])
    return out.logits


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_model_on_huge_pages_computes_the_same_bits(dtype, monkeypatch, any_size):
    on = LlamaForCausalLM.random(tiny_config(), seed=0, dtype=dtype)
    monkeypatch.setenv("PYSPEC_HUGEPAGES", "0")
    off = LlamaForCausalLM.random(tiny_config(), seed=0, dtype=dtype)
    assert torch.equal(_logits(on), _logits(off))
    if hugepages.enabled():
        # Every weight moved into the mapping (one storage); a tied lm_head stays tied.
        base = on.embed.untyped_storage().data_ptr()
        for layer in on.layers:
            for t in layer.values():
                if t is not None:
                    assert t.untyped_storage().data_ptr() == base
        assert (on.lm_head is on.embed) == (off.lm_head is off.embed)


@needs_huge
@pytest.mark.skipif(_thp_mode() == "never", reason="transparent huge pages are off here")
def test_the_kernel_backs_them_with_huge_pages():
    before = _anon_huge_kb()
    t = hugepages.huge_page_copies([torch.ones(3 << 20)])[0]  # 12 MiB, touched by the copy
    assert t.sum().item() == 3 << 20
    # At least some of the mapping is on 2 MiB pages (the kernel may fall back to 4 KiB pages
    # where it cannot find free huge pages, but not for all of a fresh 12 MiB on an idle host).
    assert _anon_huge_kb() - before >= 2048
