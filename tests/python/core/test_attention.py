"""Tree attention over paged KV against a dense float64 torch reference.

Every query row's output must equal softmax attention over (its request's prefix + the new tokens it
may see: all earlier ones for a causal chunk, its root-to-node path for a tree), computed densely in
float64 from the same (dtype-rounded) inputs.
"""

import math
import random

import pytest
import torch

from pyspec import _C
from pyspec.attention import plan_attention, tree_attention
from helpers import devices, missing_isa

F32, BF16, F16 = torch.float32, torch.bfloat16, torch.float16
# Output tolerance per storage dtype (outputs are rounded to it); LSE is fp32 in every case.
TOL = {F32: 1e-5, BF16: 2e-2, F16: 2e-2}
LSE_TOL = {F32: 2e-5, BF16: 1e-3, F16: 1e-3}
CONTEXTS = [0, 1, 15, 16, 17, 100, 1023, 1025, 2999, 3000]


def random_parents(n, rng):
    return [-1] + [rng.randrange(i) for i in range(1, n)]


def make_batch(seed, batch, block_size, hq, hkv, d, dtype, device, max_ctx=3000):
    """A ragged step mixing causal prefill chunks, decode tokens and trees, pages permuted."""
    rng = random.Random(seed)
    reqs = []
    for b in range(batch):
        prefix = rng.choice(CONTEXTS) if rng.random() < 0.4 else rng.randrange(max_ctx + 1)
        prefix = 0 if b % 6 == 1 else min(prefix, max_ctx)
        kind = rng.choice(["causal", "decode", "tree", "tree"])
        if kind == "decode":
            reqs.append((prefix, 1, None))
        elif kind == "causal":
            n = rng.choice([1, 2, 7, 33, 64, 65, 130]) if prefix else rng.choice([5, 64, 200])
            reqs.append((prefix, n, None))
        else:
            n = rng.choice([1, 2, 5, 16, 63, 64, 65, 100, 256]) if b % 7 else rng.randrange(1, 40)
            reqs.append((prefix, n, random_parents(n, rng)))
    return make_step(reqs, block_size, hq, hkv, d, dtype, device, seed)


def make_step(reqs, block_size, hq, hkv, d, dtype, device, seed=0):
    """Tensors of a step: reqs = [(prefix_len, q_len, parents or None)], block tables permuted."""
    g = torch.Generator().manual_seed(seed)
    batch = len(reqs)
    used = [-(-p // block_size) for p, _, _ in reqs]
    num_blocks = sum(used) + 5
    perm = torch.randperm(num_blocks, generator=g).tolist()
    max_blocks = max(used + [0]) + 2
    tables = torch.full((batch, max_blocks), -1, dtype=torch.int32)
    k = 0
    for b, u in enumerate(used):
        tables[b, :u] = torch.tensor(perm[k:k + u], dtype=torch.int32)
        k += u
    q_indptr = [0]
    parents, tree_indptr = [], [0]
    for _, n, par in reqs:
        q_indptr.append(q_indptr[-1] + n)
        parents += par or []
        tree_indptr.append(len(parents))
    T = q_indptr[-1]

    def rnd(*shape):
        return torch.randn(*shape, generator=g).to(dtype).to(device)

    return dict(
        reqs=reqs, block_size=block_size, num_blocks=num_blocks, tables=tables,
        q_indptr=torch.tensor(q_indptr), prefix=torch.tensor([r[0] for r in reqs]),
        parents=torch.tensor(parents, dtype=torch.int32), tree_indptr=torch.tensor(tree_indptr),
        q=rnd(T, hq, d), k_pages=rnd(num_blocks, block_size, hkv, d),
        v_pages=rnd(num_blocks, block_size, hkv, d), k_new=rnd(T, hkv, d), v_new=rnd(T, hkv, d))


def reference(c, scale):
    """Dense float64 attention per request; returns out [T, Hq, D] and lse [T, Hq]."""
    q = c["q"].cpu().double()
    T, hq, d = q.shape
    hkv = c["k_pages"].shape[2]
    bs = c["block_size"]
    kp = c["k_pages"].cpu().double().reshape(-1, hkv, d)
    vp = c["v_pages"].cpu().double().reshape(-1, hkv, d)
    kn, vn = c["k_new"].cpu().double(), c["v_new"].cpu().double()
    out = torch.zeros(T, hq, d, dtype=torch.float64)
    lse = torch.zeros(T, hq, dtype=torch.float64)
    qi = c["q_indptr"].tolist()
    for b, (prefix, n, par) in enumerate(c["reqs"]):
        if n == 0:
            continue
        pos = torch.arange(prefix)
        slots = c["tables"][b].long()[pos // bs] * bs + pos % bs
        k = torch.cat([kp[slots], kn[qi[b]:qi[b + 1]]])  # [prefix + n, hkv, d]
        v = torch.cat([vp[slots], vn[qi[b]:qi[b + 1]]])
        k = k.repeat_interleave(hq // hkv, 1).transpose(0, 1)  # [hq, L, d]
        v = v.repeat_interleave(hq // hkv, 1).transpose(0, 1)
        if par is None:
            new_vis = torch.ones(n, n, dtype=torch.bool).tril()
        else:
            new_vis = torch.zeros(n, n, dtype=torch.bool)
            for i in range(n):
                j = i
                while j >= 0:
                    new_vis[i, j] = True
                    j = par[j]
        vis = torch.cat([torch.ones(n, prefix, dtype=torch.bool), new_vis], 1)
        s = torch.einsum("nhd,hld->hnl", q[qi[b]:qi[b + 1]], k) * scale
        s = s.masked_fill(~vis, float("-inf"))
        lse[qi[b]:qi[b + 1]] = torch.logsumexp(s, -1).T
        out[qi[b]:qi[b + 1]] = torch.einsum("hnl,hld->nhd", torch.softmax(s, -1), v)
    return out, lse


def plan_for(c, hq=None, hkv=None, **kw):
    return plan_attention(c["q_indptr"], c["prefix"], c["tables"], c["block_size"], c["parents"],
                          c["tree_indptr"], c["num_blocks"], num_q_heads=hq, num_kv_heads=hkv,
                          **kw)


def check(c, out, lse, dtype, scale):
    ref, ref_lse = reference(c, scale)
    torch.testing.assert_close(out.cpu().double(), ref, atol=TOL[dtype], rtol=0)
    torch.testing.assert_close(lse.cpu().double(), ref_lse, atol=LSE_TOL[dtype], rtol=0)


# (seed, batch, block_size, hq, hkv, head_dim, dtype): GQA ratios 1/3/4, all head dims, both
# block sizes, batch 1..37.
CASES = [
    (0, 1, 16, 4, 4, 64, F32),
    (1, 37, 16, 9, 3, 64, F32),
    (2, 5, 1, 12, 4, 80, F32),
    (3, 13, 16, 8, 2, 96, F32),
    (4, 3, 1, 6, 6, 128, F32),
    (5, 8, 16, 8, 2, 256, F32),
    (6, 21, 1, 9, 3, 128, F32),
    (7, 17, 16, 9, 3, 128, BF16),
    (8, 11, 1, 4, 1, 64, BF16),
    (9, 6, 16, 3, 1, 256, F16),
    (10, 2, 16, 16, 4, 80, BF16),
    (11, 29, 1, 3, 1, 96, F32),
    (12, 4, 16, 8, 8, 256, BF16),
    (13, 9, 16, 12, 3, 96, F16),
]


@pytest.mark.parametrize("device", devices())
@pytest.mark.parametrize("seed,batch,block_size,hq,hkv,d,dtype", CASES)
def test_matches_dense_reference(device, seed, batch, block_size, hq, hkv, d, dtype):
    c = make_batch(seed, batch, block_size, hq, hkv, d, dtype, device)
    plan = plan_for(c, hq, hkv)
    assert plan.num_queries == c["q"].shape[0]
    scale = 1.0 / math.sqrt(d) * (1.3 if seed % 2 else 1.0)
    out, lse = tree_attention(plan, c["q"], c["k_pages"], c["v_pages"], c["k_new"], c["v_new"],
                              scale=scale, return_lse=True)
    assert out.dtype == dtype and lse.dtype == torch.float32
    check(c, out, lse, dtype, scale)


@pytest.mark.parametrize("device", devices())
@pytest.mark.parametrize("isa", ["generic", "avx2", "avx512", "auto"])
def test_split_kv_and_kernels(device, isa):
    """Forced split-KV (merged by LSE) on both kernels; a plan without head counts."""
    c = make_batch(100, 7, 16, 9, 3, 64, F32, device)
    try:
        kernels = _C.LinearKernels(isa)
    except ValueError as e:
        missing_isa(isa, str(e))
    assert _C._attention_isa(kernels) == (_C._attention_isa() if isa == "auto" else isa)
    plan = plan_for(c, num_threads=64, min_kv_chunk=64)
    assert plan.num_split_tiles > 0
    out = torch.full_like(c["q"], float("nan"))
    lse = torch.empty(c["q"].shape[:2], device=c["q"].device)
    tree_attention(plan, c["q"], c["k_pages"], c["v_pages"], c["k_new"], c["v_new"], out=out,
                   lse=lse, kernels=kernels)
    check(c, out, lse, F32, 1 / 8)


def test_kernels_argument():
    """``kernels`` takes a LinearKernels or an ISA name (the same build either way); anything
    else is a ValueError naming what is allowed."""
    c = make_batch(30, 5, 16, 4, 2, 32, F32, "cpu")
    plan = plan_for(c, 4, 2)
    args = (plan, c["q"], c["k_pages"], c["v_pages"], c["k_new"], c["v_new"])
    by_name, lse = tree_attention(*args, kernels="generic", return_lse=True)
    assert torch.equal(by_name, tree_attention(*args, kernels=_C.LinearKernels("generic")))
    check(c, by_name, lse, F32, 1 / math.sqrt(32))
    with pytest.raises(ValueError, match="unknown linear kernel ISA 'sse9'; use auto, generic"):
        tree_attention(*args, kernels="sse9")
    with pytest.raises(ValueError, match="kernels must be a pyspec._C.LinearKernels or an ISA "
                                         "name; got int"):
        tree_attention(*args, kernels=2)


@pytest.mark.parametrize("kv_dtype", [F16, BF16])
@pytest.mark.parametrize("isa", ["generic", "avx2", "avx512"])
def test_float32_queries_over_a_16_bit_kv_cache(kv_dtype, isa):
    """A 16-bit KV cache under float32 activations: every CPU build of the kernel (float16 rows
    through its vector conversion) equals the reference over the same 16-bit K/V, to float32
    rounding. A build this CPU lacks fails to select, visibly."""
    c = make_batch(40, 9, 16, 9, 3, 64, F32, "cpu")
    for key in ("k_pages", "v_pages", "k_new", "v_new"):
        c[key] = c[key].to(kv_dtype)
    try:
        kernels = _C.LinearKernels(isa)
    except ValueError as e:
        missing_isa(isa, str(e))
    assert _C._attention_isa(kernels) == isa
    plan = plan_for(c, 9, 3)
    out, lse = tree_attention(plan, c["q"], c["k_pages"], c["v_pages"], c["k_new"],
                              c["v_new"], return_lse=True, kernels=kernels)
    assert out.dtype == F32
    check(c, out, lse, F32, 1 / 8)


@pytest.mark.parametrize("device", devices())
def test_chain_tree_equals_causal_chunk_and_plan_reuse(device):
    n = 6
    chain = list(range(-1, n - 1))
    c = make_step([(50, n, chain), (0, n, None), (33, n, chain)], 16, 8, 2, 64, F32, device, 7)
    tree_plan = plan_for(c, 8, 2)
    causal_plan = plan_attention(c["q_indptr"], c["prefix"], c["tables"], 16, None, None,
                                 c["num_blocks"])
    assert [tree_plan.is_tree(b) for b in range(3)] == [True, False, True]
    assert not any(causal_plan.is_tree(b) for b in range(3))
    for b in (3, -1, 1 << 40):  # out of range: an error, not a read past the flags
        with pytest.raises(ValueError, match="request"):
            tree_plan.is_tree(b)
    args = (c["q"], c["k_pages"], c["v_pages"], c["k_new"], c["v_new"])
    o1 = tree_attention(tree_plan, *args)
    o2 = tree_attention(causal_plan, *args)
    torch.testing.assert_close(o1, o2, atol=1e-6, rtol=0)
    # One plan serves many layers: a second run with other K/V.
    args2 = (c["q"], c["v_pages"], c["k_pages"], c["v_new"], c["k_new"])
    c2 = dict(c, k_pages=c["v_pages"], v_pages=c["k_pages"], k_new=c["v_new"], v_new=c["k_new"])
    o3, l3 = tree_attention(tree_plan, *args2, return_lse=True)
    check(c2, o3, l3, F32, 1 / 8)


def _good_args():
    c = make_step([(9, 3, [-1, 0, 0]), (5, 2, None), (0, 1, None)], 4, 4, 2, 64, F32, "cpu", 3)
    c["tables"] = torch.tensor([[0, 1, 2, -1], [3, 4, -1, -1], [-1, -1, -1, -1]],
                               dtype=torch.int32)
    c["num_blocks"] = 6
    c["k_pages"], c["v_pages"] = c["k_pages"][:6].contiguous(), c["v_pages"][:6].contiguous()
    return c


def test_good_args_pass():
    c = _good_args()
    out, lse = tree_attention(plan_for(c, 4, 2), c["q"], c["k_pages"], c["v_pages"], c["k_new"],
                              c["v_new"], return_lse=True)
    check(c, out, lse, F32, 1 / 8)


def _set(key, fn):
    return lambda c: c.__setitem__(key, fn(c))


@pytest.mark.parametrize("mutate, match", [
    (_set("tables", lambda c: c["tables"].index_fill(1, torch.tensor([0]), 6)),
     r"block_tables\[0, 0\]"),
    (_set("tables", lambda c: c["tables"].index_fill(1, torch.tensor([1]), -1)),
     r"block_tables\[0, 1\]"),
    (_set("tables", lambda c: c["tables"][:, :2].contiguous()), "block_tables"),
    (_set("parents", lambda c: torch.tensor([-1, 0, 2], dtype=torch.int32)), "tree_parents"),
    (_set("parents", lambda c: torch.tensor([0, 0, 0], dtype=torch.int32)), "tree_parents"),
    (_set("tree_indptr", lambda c: torch.tensor([0, 2, 3, 3])), "tree_indptr"),
    (_set("tree_indptr", lambda c: torch.tensor([0, 3, 3])), "tree_indptr"),
    (_set("prefix", lambda c: torch.tensor([9, -1, 0])), r"prefix_lens\[1\]"),
    # A context past 2^31 tokens (its cost sums overflowed int64 into a plan of ~2^53 items).
    (_set("prefix", lambda c: torch.tensor([9, 1 << 62, 0])), r"prefix_lens\[1\]"),
    (_set("q_indptr", lambda c: torch.tensor([0, 3, 2, 6])), "q_indptr"),
    (_set("q_indptr", lambda c: torch.tensor([1, 3, 5, 6])), "q_indptr"),
    (_set("q_indptr", lambda c: torch.tensor([0.0, 3, 5, 6])), "q_indptr"),
    (_set("num_blocks", lambda c: None), "num_blocks"),
])
def test_plan_bad_input(mutate, match):
    c = _good_args()
    mutate(c)
    with pytest.raises(ValueError, match=match):
        plan_for(c, 4, 2)


@pytest.mark.parametrize("mutate, match", [
    (_set("q", lambda c: c["q"][:, :3].contiguous()), "'q'"),
    (_set("q", lambda c: c["q"].transpose(1, 2).contiguous().transpose(1, 2)), "'q'"),
    (_set("q", lambda c: c["q"].double()), "'q'"),
    (_set("q", lambda c: c["q"][:5]), "'q'"),
    (_set("k_pages", lambda c: c["k_pages"][:5]), "'k_pages'"),
    (_set("v_pages", lambda c: c["v_pages"].bfloat16()), "'v_pages'"),
    (_set("k_new", lambda c: c["k_new"][:, :1].contiguous()), "'k_new'"),
    (_set("v_new", lambda c: [1.0]), "'v_new'"),
    (_set("out", lambda c: torch.empty(6, 4, 64, dtype=torch.bfloat16)), "'out'"),
    (_set("lse", lambda c: torch.empty(6, 4, dtype=torch.float64)), "'lse'"),
    (_set("lse", lambda c: torch.empty(6, 3)), "'lse'"),
    (_set("q", lambda c: c["q"][:, :, :0]), "head size"),
])
def test_run_bad_input(mutate, match):
    c = _good_args()
    plan = plan_for(c, 4, 2)
    c["out"], c["lse"] = None, None
    mutate(c)
    with pytest.raises(ValueError, match=match):
        tree_attention(plan, c["q"], c["k_pages"], c["v_pages"], c["k_new"], c["v_new"],
                       out=c["out"], lse=c["lse"])


def test_plan_sizes_must_be_ints():
    args = ([0, 1], [0], torch.zeros(1, 1, dtype=torch.int32))
    for kw, name in (({"block_size": 4.9}, "block_size"), ({"block_size": 2 ** 70}, "block_size"),
                     ({"block_size": 4, "num_blocks": 1.5}, "num_blocks")):
        kw.setdefault("num_blocks", 1)
        with pytest.raises(ValueError, match=name):
            plan_attention(*args, **kw)
    assert plan_attention(*args, block_size=4, num_blocks=1).num_kv_heads >= 0


def test_plan_head_mismatch_and_repr():
    c = _good_args()
    plan = plan_for(c, 8, 2)
    assert "AttentionPlan(batch=3" in repr(plan) and plan.num_kv_heads == 2
    with pytest.raises(ValueError, match="plan was built for"):
        tree_attention(plan, c["q"], c["k_pages"], c["v_pages"], c["k_new"], c["v_new"])
    with pytest.raises(ValueError, match="num_q_heads"):
        plan_for(c, 3, 2)


@pytest.mark.cuda
@pytest.mark.parametrize("dtype,d", [(BF16, 128), (F16, 64), (BF16, 80), (F32, 128)])
def test_cuda_llama_layout_split_kv_and_plan_cache(dtype, d):
    """Llama-3-8B head layout (32/8) with a 64-node tree over a long prefix, a long decode (split
    KV), a prefill chunk and a small tree: the tensor-core path (bf16/fp16, d 64/128) and the
    generic one (d 80, fp32). The device plan is uploaded once and reused by later layers."""
    rng = random.Random(5)
    reqs = [(3000, 64, random_parents(64, rng)), (8191, 1, None), (0, 100, None),
            (517, 16, random_parents(16, rng)), (70, 256, random_parents(256, rng))]
    c = make_step(reqs, 16, 32, 8, d, dtype, "cuda", 5)
    plan = plan_for(c, 32, 8)
    args = (c["q"], c["k_pages"], c["v_pages"], c["k_new"], c["v_new"])
    out, lse = tree_attention(plan, *args, return_lse=True)
    check(c, out, lse, dtype, 1 / math.sqrt(d))
    cached = [k for k in plan.__dict__ if isinstance(k, tuple) and k[0] == "_cuda_plan"]
    assert len(cached) == 1
    dplan = plan.__dict__[cached[0]]
    assert dplan.uses_tensor_cores(str(dtype).split(".")[-1], str(dtype).split(".")[-1]) == (
        dtype != F32 and d in (64, 128))
    assert dplan.num_split_tiles > 0  # the 8191-token decode is split across the device
    out2 = tree_attention(plan, *args)
    assert len([k for k in plan.__dict__ if isinstance(k, tuple)]) == 1
    torch.testing.assert_close(out2, out, atol=0, rtol=0)


@pytest.mark.cuda
@pytest.mark.parametrize("case", ["llama-bf16-128", "llama-f16-64", "gqa3-bf16-128",
                                  "page1-bf16-64", "decode-only-bf16-128"])
def test_cuda_tensor_core_variants(case):
    """Both tensor-core kernels (one synchronously loaded K/V stage; two cp.async stages with idle
    warps skipping the math) against the dense reference, and against each other: the same MMAs
    and softmax for every real query row, so bit for bit the same output. Trees up to 256 nodes,
    long decodes split across the device, prefill chunks, GQA groups 3/4, pages of 1 and 16."""
    rng = random.Random(11)
    if case.startswith("llama"):
        dtype, d = (BF16, 128) if "bf16" in case else (F16, 64)
        reqs = [(3000, 64, random_parents(64, rng)), (8191, 1, None), (0, 100, None),
                (517, 16, random_parents(16, rng)), (70, 256, random_parents(256, rng)),
                (65, 3, random_parents(3, rng))]
        c, hq, hkv = make_step(reqs, 16, 32, 8, d, dtype, "cuda", 7), 32, 8
    elif case == "decode-only-bf16-128":  # group 4: one warp of four holds the query vectors
        dtype, d = BF16, 128
        c, hq, hkv = make_step([(n, 1, None) for n in (1, 63, 64, 65, 700, 5000)], 16, 32, 8,
                               d, dtype, "cuda", 8), 32, 8
    else:
        seed, batch, bs, hq, hkv, d, dtype = (
            (7, 17, 16, 9, 3, 128, BF16) if case == "gqa3-bf16-128" else (8, 11, 1, 4, 1, 64, BF16))
        c = make_batch(seed, batch, bs, hq, hkv, d, dtype, "cuda")
    results = {}
    for backend in ("native", "pipelined"):
        plan = plan_for(c, hq, hkv)
        out, lse = tree_attention(plan, c["q"], c["k_pages"], c["v_pages"], c["k_new"],
                                  c["v_new"], return_lse=True, backend=backend)
        dplan = next(v for k, v in plan.__dict__.items() if isinstance(k, tuple))
        assert dplan.uses_tensor_cores(str(dtype).split(".")[-1], str(dtype).split(".")[-1])
        check(c, out, lse, dtype, 1 / math.sqrt(d))
        results[backend] = (out, lse)
    torch.testing.assert_close(results["pipelined"][0], results["native"][0], atol=0, rtol=0)
    torch.testing.assert_close(results["pipelined"][1], results["native"][1], atol=0, rtol=0)
    with pytest.raises(ValueError, match="allowed: 'simple', 'pipelined'"):
        _C.run_attention_cuda(dplan, c["q"], c["k_pages"], c["v_pages"], c["k_new"], c["v_new"],
                              out, None, None, torch.cuda.current_stream().cuda_stream, "fast")
