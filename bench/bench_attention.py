"""Microbenchmark: pyspec CPU tree attention vs torch SDPA with an explicit dense mask.

    python bench/bench_attention.py [--quick] [--dtype float32|bfloat16] [--threads N]

Prints one JSON document: per configuration the median time per layer of

* ``pyspec``: ``tree_attention`` over the paged pool (plan built once outside the timing, as it
  is once per step);
* ``sdpa_repeat``: what a plain torch implementation does per layer: gather each request's pages
  into contiguous K/V (``index_select`` on the block table), append the new tokens' K/V, expand the
  KV heads to the query heads (``repeat_interleave``, like HF ``repeat_kv``) and call
  ``scaled_dot_product_attention`` with a dense boolean [tree, prefix + tree] mask;
* ``sdpa_gqa``: the same with ``enable_gqa=True`` instead of the expansion.

The gather IS included in both torch timings; building the dense mask is not (it is per step,
like our plan). Ratios are torch time / pyspec time (> 1: pyspec faster). Requests in a
configuration share prefix and tree sizes so torch can run them as one batched call; the block
tables are randomly permuted. Also usable under pytest-benchmark (``test_bench_*``).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch
import torch.nn.functional as F

from pyspec import _C
from pyspec.attention import plan_attention, tree_attention

BLOCK_SIZE = 16
HEADS = {"smollm2": (9, 3, 64), "llama8b": (32, 8, 128)}


def random_parents(n: int, g: torch.Generator) -> list:
    return [-1] + [int(torch.randint(0, i, (1,), generator=g)) for i in range(1, n)]


def make_case(batch, ctx, tree, hq, hkv, d, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    blocks_per = -(-ctx // BLOCK_SIZE)
    num_blocks = batch * blocks_per + 1
    perm = torch.randperm(num_blocks, generator=g)[: batch * blocks_per].view(batch, blocks_per)
    block_tables = perm.to(torch.int32)
    k_pages = torch.randn(num_blocks, BLOCK_SIZE, hkv, d, generator=g).to(dtype)
    v_pages = torch.randn(num_blocks, BLOCK_SIZE, hkv, d, generator=g).to(dtype)
    T = batch * tree
    q = torch.randn(T, hq, d, generator=g).to(dtype)
    k_new = torch.randn(T, hkv, d, generator=g).to(dtype)
    v_new = torch.randn(T, hkv, d, generator=g).to(dtype)
    parents = random_parents(tree, g)
    q_indptr = torch.arange(0, T + 1, tree, dtype=torch.int64)
    prefix = torch.full((batch,), ctx, dtype=torch.int64)
    tree_parents = torch.tensor(parents * batch, dtype=torch.int32)
    plan = plan_attention(q_indptr, prefix, block_tables, BLOCK_SIZE, tree_parents, q_indptr,
                          num_blocks, num_q_heads=hq, num_kv_heads=hkv)
    # Dense mask [tree, ctx + tree] for torch: prefix visible, tree part = ancestor-or-self.
    anc = torch.zeros(tree, tree, dtype=torch.bool)
    for i in range(tree):
        j = i
        while j >= 0:
            anc[i, j] = True
            j = parents[j]
    mask = torch.cat([torch.ones(tree, ctx, dtype=torch.bool), anc], 1)[None, None]
    return dict(plan=plan, q=q, k_pages=k_pages, v_pages=v_pages, k_new=k_new, v_new=v_new,
                block_tables=block_tables.long(), mask=mask, batch=batch, ctx=ctx, tree=tree,
                hq=hq, hkv=hkv, d=d)


def run_pyspec(c, out, kernels=None):
    tree_attention(c["plan"], c["q"], c["k_pages"], c["v_pages"], c["k_new"], c["v_new"], out=out,
                   kernels=kernels)


def run_torch(c, gqa: bool):
    B, ctx, n, hq, hkv, d = c["batch"], c["ctx"], c["tree"], c["hq"], c["hkv"], c["d"]

    def gather(pages, new):
        kv = pages.index_select(0, c["block_tables"].reshape(-1))  # [B*blocks, bs, hkv, d]
        kv = kv.view(B, -1, hkv, d)[:, :ctx]
        kv = torch.cat([kv, new.view(B, n, hkv, d)], 1)  # [B, ctx + n, hkv, d]
        kv = kv.transpose(1, 2)
        return kv if gqa else kv.repeat_interleave(hq // hkv, 1)

    k, v = gather(c["k_pages"], c["k_new"]), gather(c["v_pages"], c["v_new"])
    q = c["q"].view(B, n, hq, d).transpose(1, 2)
    if gqa:
        o = F.scaled_dot_product_attention(q, k, v, attn_mask=c["mask"], enable_gqa=True)
    else:
        o = F.scaled_dot_product_attention(q, k, v, attn_mask=c["mask"])
    return o.transpose(1, 2).reshape(B * n, hq, d)


def measure(fns, budget_s=1.0, min_rounds=3, max_rounds=50):
    """Median seconds per call of each function. The functions run interleaved, round by round,
    so load from other processes on a shared machine hits all of them alike."""
    for fn in fns.values():
        fn()  # warm-up
    times = {k: [] for k in fns}
    start = time.perf_counter()
    rounds = 0
    while rounds < min_rounds or (time.perf_counter() - start < budget_s * len(fns)
                                  and rounds < max_rounds):
        for k, fn in fns.items():
            t0 = time.perf_counter()
            fn()
            times[k].append(time.perf_counter() - t0)
        rounds += 1
    return {k: statistics.median(v) for k, v in times.items()}


def configs(quick: bool):
    out = []
    for batch in (1, 8, 32):
        for ctx in (512, 4096):
            for tree in (1, 16, 64):
                out.append(("smollm2", batch, ctx, tree))
    for batch in (1, 8):
        for tree in (16, 64):
            out.append(("llama8b", batch, 4096, tree))
    if quick:
        out = [c for c in out if c[1] in (1, 8) and c[3] in (1, 64)]
    return out


def bench(dtype=torch.float32, quick=False, budget_s=1.0, kernels=None):
    results = []
    for name, batch, ctx, tree in configs(quick):
        hq, hkv, d = HEADS[name]
        c = make_case(batch, ctx, tree, hq, hkv, d, dtype)
        out = torch.empty_like(c["q"])
        ref = run_torch(c, gqa=True)
        run_pyspec(c, out, kernels)
        err = (out.float() - ref.float()).abs().max().item()
        t = measure({"ours": lambda: run_pyspec(c, out, kernels),
                     "rep": lambda: run_torch(c, gqa=False),
                     "gqa": lambda: run_torch(c, gqa=True)}, budget_s)
        t_ours, t_rep, t_gqa = t["ours"], t["rep"], t["gqa"]
        flops = 4 * batch * tree * hq * (ctx + tree) * d
        results.append(dict(
            heads=f"{hq}q/{hkv}kv/d{d}", batch=batch, ctx=ctx, tree=tree,
            pyspec_ms=round(t_ours * 1e3, 3), sdpa_repeat_ms=round(t_rep * 1e3, 3),
            sdpa_gqa_ms=round(t_gqa * 1e3, 3),
            ratio_vs_sdpa_repeat=round(t_rep / t_ours, 2),
            ratio_vs_sdpa_gqa=round(t_gqa / t_ours, 2),
            pyspec_gflops=round(flops / t_ours / 1e9, 1), max_abs_diff=err))
    return results


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    ap.add_argument("--quick", action="store_true", help="a subset of the configurations")
    ap.add_argument("--budget", type=float, default=1.0,
                    help="seconds per variant and configuration")
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0 = torch default)")
    ap.add_argument("--isa", default="auto", choices=["auto", "generic", "avx2", "avx512"])
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    kernels = _C.LinearKernels(args.isa)
    isa = _C._attention_isa(kernels)
    res = bench(getattr(torch, args.dtype), args.quick, args.budget, kernels)
    print(json.dumps(dict(
        dtype=args.dtype, pyspec_threads=_C.num_threads(), torch_threads=torch.get_num_threads(),
        kernel_isa=isa, block_size=BLOCK_SIZE,
        notes="times per layer, median of interleaved rounds; torch times include the page "
              "gather and exclude the mask build",
        results=res), indent=1))


def _case_for_pytest(name):
    hq, hkv, d = HEADS[name]
    return make_case(8, 4096, 64, hq, hkv, d, torch.float32)


def test_bench_pyspec_tree64_ctx4096(benchmark):
    c = _case_for_pytest("smollm2")
    out = torch.empty_like(c["q"])
    benchmark(run_pyspec, c, out)


def test_bench_sdpa_tree64_ctx4096(benchmark):
    c = _case_for_pytest("smollm2")
    benchmark(run_torch, c, False)


if __name__ == "__main__":
    main()
