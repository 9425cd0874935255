"""Packed exact weights in the model tests: float32 matrices on a 4-bit / 8-bit block grid,
bit-for-bit comparison, a model folder snapped onto the grids, and the steps two models must
agree on bit for bit (test_packed.py, test_packed_codes.py)."""

import os

import pytest
import torch

from pyspec import TokenTree, _C
from pyspec.runner import ModelRunner, SeqStep

from models_support import write_tiny_model


needs_kernel = pytest.mark.skipif(not _C.LinearKernels().packed_available,
                                  reason="the packed kernel needs the AVX2 or AVX-512 float32 "
                                         "build")


def q4_grid(n, k, seed=0):
    """A float32 [n, k] matrix on a 4-bit grid: per group of 32, d * q + m with d, m float16 values
    and q in 0..15, q = 0 and q = 15 both present (as a Q4_1 quantizer leaves them)."""
    g = torch.Generator().manual_seed(seed)
    d = (torch.rand(n, k // 32, 1, generator=g) * 0.02 + 1e-3).half().float()
    m = (-torch.rand(n, k // 32, 1, generator=g) * 0.2).half().float()
    q = torch.randint(0, 16, (n, k // 32, 32), generator=g)
    q[..., 3], q[..., 20] = 0, 15
    return (q * d + m).reshape(n, k).contiguous()


def q8_grid(n, k, seed=0):
    """8-bit: per group of 32, d * q with d a float16 value and q in -127..127, |q| = 127 present."""
    g = torch.Generator().manual_seed(seed)
    d = (torch.rand(n, k // 32, 1, generator=g) * 0.01 + 1e-4).half().float()
    q = torch.randint(-127, 128, (n, k // 32, 32), generator=g)
    q[..., 7] = 127
    return (q * d + 0.0).reshape(n, k).contiguous()


def bits_equal(a, b):
    return a.shape == b.shape and torch.equal(a.contiguous().view(torch.int32),
                                              b.contiguous().view(torch.int32))


def snap_model_dir(path, layers=2):
    """write_tiny_model with its dense matrices moved onto the 4-bit grid and lm_head onto the
    8-bit one, as a model converted from a Q4_1 / Q8_0 GGUF has them."""
    from safetensors.torch import load_file, save_file

    write_tiny_model(path, layers=layers)
    f = os.path.join(str(path), "model.safetensors")
    w = load_file(f)
    for i, (name, t) in enumerate(sorted(w.items())):
        if name.endswith("proj.weight"):
            g = t.view(t.shape[0], -1, 32)
            lo, hi = g.amin(-1, keepdim=True), g.amax(-1, keepdim=True)
            d = ((hi - lo) / 15).half().float()
            lo = lo.half().float()
            q = torch.round((g - lo) / d).clamp(0, 15)
            w[name] = (q * d + lo).reshape(t.shape).contiguous()
        elif name == "lm_head.weight":
            g = t.view(t.shape[0], -1, 32)
            d = (g.abs().amax(-1, keepdim=True) / 127).half().float()
            # + 0.0: a code of 0 is +0.0, as a GGUF's dequantized d * q is (never -0.0).
            w[name] = (torch.round(g / d).clamp(-127, 127) * d + 0.0).reshape(t.shape).contiguous()
    save_file(w, f)
    return str(path)


def sixteen_bit_model_dir(path, layers=2):
    """write_tiny_model stored as most published checkpoints are: the layer matrices in bfloat16,
    lm_head in float16 (loaded as float32, their values are exactly those 16-bit ones)."""
    from safetensors.torch import load_file, save_file

    write_tiny_model(path, layers=layers)
    f = os.path.join(str(path), "model.safetensors")
    w = load_file(f)
    for name, t in w.items():
        if name.endswith("proj.weight"):
            w[name] = t.bfloat16()
        elif name == "lm_head.weight":
            w[name] = t.half()
    save_file(w, f)
    return str(path)


def tied_model_dir(path, dtype=torch.bfloat16, layers=2):
    """write_tiny_model with its embedding table tied to lm_head (no lm_head tensor) and every
    matrix stored in ``dtype``, as small published checkpoints are."""
    import json

    from safetensors.torch import load_file, save_file

    write_tiny_model(path, layers=layers)
    f = os.path.join(str(path), "model.safetensors")
    w = load_file(f)
    del w["lm_head.weight"]
    save_file({k: v.to(dtype) for k, v in w.items()}, f)
    cfg = os.path.join(str(path), "config.json")
    with open(cfg) as fh:
        conf = json.load(fh)
    conf["tie_word_embeddings"] = True
    with open(cfg, "w") as fh:
        json.dump(conf, fh)
    return str(path)


STEP_NAMES = ("prefill", "chunk", "hidden", "tree", "decode", "chain")


def model_steps(model, ctx, nodes, tree):
    """Logits (and hidden states) of a model's steps over 90 context tokens then 9 tree nodes: a
    60-row prefill chunk (past the packed kernel's usual 32 rows, where an "auto" model reads its
    float32 matrices; not past the core kernel's 64, where torch's GEMM may vary from call to
    call), a 30-row chunk, the tree, a decode step and a 6-node chain."""
    runner = ModelRunner(model, num_blocks=16, block_size=16)
    table = list(range(16))
    o1 = runner.step([SeqStep(ctx[:60], 0, table, None, "all")])
    runner.commit_kv(o1, 0, range(60), range(60))
    o2 = runner.step([SeqStep(ctx[60:90], 60, table, None, "all")], return_hidden=True)
    runner.commit_kv(o2, 0, range(30), range(60, 90))
    o3 = runner.step([SeqStep(nodes, 90, table, tree, "all")])
    o4 = runner.step([SeqStep(nodes[:1], 90, table, None, "last")])
    o5 = runner.step([SeqStep(nodes[:6], 90, table, TokenTree.chain(5), "all")])
    return o1.logits, o2.logits, o2.hidden, o3.logits, o4.logits, o5.logits


def assert_steps_bit_equal(a, b, seed, n_ctx=90):
    """model_steps of models ``a`` and ``b`` on the same random tokens, equal bit for bit;
    returns the context tokens."""
    g = torch.Generator().manual_seed(seed)
    ctx = torch.randint(3, 250, (n_ctx,), generator=g).tolist()
    nodes = torch.randint(3, 250, (9,), generator=g).tolist()
    tree = TokenTree([-1, 0, 0, 1, 1, 2, 3, 3, 4])
    for name, x, y in zip(STEP_NAMES, model_steps(a, ctx, nodes, tree),
                          model_steps(b, ctx, nodes, tree)):
        assert bits_equal(x, y), (name, (x - y).abs().max().item())
    return ctx
