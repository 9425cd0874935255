"""GPU kernel benchmarks (needs a CUDA GPU and a CUDA build of pyspec).

    python bench/bench_gpu_kernels.py --out results.json [--quick] [--budget SECONDS]

Measured in one run, with CUDA events (median of repeated launches after a warm-up):

* ``copy``: device-to-device copy of a 2 GiB buffer; bandwidth = (bytes read + bytes written) /
  time. It is the ceiling the other numbers are compared with.
* ``attention``: Llama-3-8B head layout (32 query heads, 8 KV heads, head_dim 128), bfloat16,
  block size 16 with permuted pages, batch {1, 8, 64} x context {1k, 8k, 32k} x tree {1, 16, 64}
  (tree 1 = plain decode; trees are random with parents before children). Achieved bandwidth =
  K/V bytes of the contexts read / time. In the same run and on the same problems:
  ``flex_attention`` (torch, compiled) over contiguous per-request K/V with the equivalent block
  mask (prefix visible, tree part under the ancestor mask; tree 64 only, as it compiles per
  shape), and SDPA (``enable_gqa``) with the dense boolean mask (trees 16 and 64, decode at 8k).
  Both get contiguous K/V (no paging), which favours them.
* ``triton``: the Triton kernel (``tree_attention(..., backend="triton")``) on every attention
  problem, its largest difference from pyspec's CUDA kernel, and both kernels' time per call
  with the host taken out (10 calls captured in a CUDA graph, median of 5 replays: ``*_graph_s``).
* ``filters``: sampling filters (temperature 0.7, top-k 50, top-p 0.9) on bf16 logits
  [256 x 16, 128256]; bandwidth = logit bytes / time.
* ``acceptance``: batch 256, vocab 128256, chains of 16 draft tokens; greedy and sampled
  (with draft probabilities). Bandwidth counts the probability rows the walk must read (one
  target row per visited node, plus its draft row when sampled) over time.

The plan upload (once per step) is timed separately from the per-layer attention. With a time
budget, configurations that do not fit are listed under ``skipped``; nothing is extrapolated.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time

import torch

from pyspec import _C, sampling
from pyspec.attention import plan_attention, tree_attention

HQ, HKV, D, BS = 32, 8, 128, 16


def cuda_time(fn, reps=20, warmup=3):
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) / 1e3)
    return statistics.median(times)


def graph_time(fn, calls=10, replays=5):
    """Seconds per call of ``fn`` with no host overhead: ``calls`` calls captured in one CUDA graph,
    median of ``replays`` replays. Warmed up on the capture stream (plans cached per stream)."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(3):
            fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=s):
        for _ in range(calls):
            fn()
    graph.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(replays):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        graph.replay()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) / 1e3 / calls)
    return statistics.median(times)


def copy_bandwidth():
    n = 1 << 30  # 2 GiB of bf16
    src = torch.empty(n, dtype=torch.bfloat16, device="cuda").normal_()
    dst = torch.empty_like(src)
    t = cuda_time(lambda: dst.copy_(src), reps=20)
    return {"bytes": 2 * src.numel() * 2, "seconds": t, "gbps": 2 * src.numel() * 2 / t / 1e9}


def make_problem(batch, ctx, tree, g):
    used = -(-ctx // BS)
    num_blocks = batch * used + 1
    perm = torch.randperm(num_blocks, generator=g)
    tables = perm[: batch * used].view(batch, used).to(torch.int32)
    parents = []
    for _ in range(batch):
        parents += [-1] + [random.randrange(i) for i in range(1, tree)]
    q_indptr = torch.arange(0, batch * tree + 1, tree)
    tree_indptr = q_indptr.clone()
    prefix = torch.full((batch,), ctx)
    T = batch * tree
    dev = "cuda"
    kp = torch.randn(num_blocks, BS, HKV, D, dtype=torch.bfloat16, device=dev)
    vp = torch.randn(num_blocks, BS, HKV, D, dtype=torch.bfloat16, device=dev)
    q = torch.randn(T, HQ, D, dtype=torch.bfloat16, device=dev)
    kn = torch.randn(T, HKV, D, dtype=torch.bfloat16, device=dev)
    vn = torch.randn(T, HKV, D, dtype=torch.bfloat16, device=dev)
    return dict(tables=tables, parents=torch.tensor(parents, dtype=torch.int32),
                q_indptr=q_indptr, tree_indptr=tree_indptr, prefix=prefix, q=q, kp=kp, vp=vp,
                kn=kn, vn=vn, num_blocks=num_blocks)


def visibility(p, batch, ctx, tree):
    """[batch, tree, ctx + tree] bool: prefix visible, tree part = ancestor-or-self."""
    par = p["parents"].view(batch, tree)
    anc = torch.zeros(batch, tree, tree, dtype=torch.bool)
    for i in range(tree):
        anc[:, i, i] = True
        if i > 0:
            anc[:, i] |= anc[torch.arange(batch), par[:, i].long()]
    return torch.cat([torch.ones(batch, tree, ctx, dtype=torch.bool), anc], 2).cuda()


def contiguous_kv(p, batch, ctx):
    """[batch, Hkv, ctx + tree, D] K and V gathered from the pages (outside the timing)."""
    slots = (p["tables"].long().cuda()[:, :, None] * BS + torch.arange(BS, device="cuda"))
    slots = slots.reshape(batch, -1)[:, :ctx]
    tree = p["q"].shape[0] // batch
    k = torch.cat([p["kp"].view(-1, HKV, D)[slots], p["kn"].view(batch, tree, HKV, D)], 1)
    v = torch.cat([p["vp"].view(-1, HKV, D)[slots], p["vn"].view(batch, tree, HKV, D)], 1)
    return k.transpose(1, 2).contiguous(), v.transpose(1, 2).contiguous()


def bench_attention(batch, ctx, tree, flex, compare, g):
    p = make_problem(batch, ctx, tree, g)
    t0 = time.perf_counter()
    plan = plan_attention(p["q_indptr"], p["prefix"], p["tables"], BS, p["parents"],
                          p["tree_indptr"], p["num_blocks"], num_q_heads=HQ, num_kv_heads=HKV)
    out = tree_attention(plan, p["q"], p["kp"], p["vp"], p["kn"], p["vn"])  # uploads the plan
    torch.cuda.synchronize()
    plan_s = time.perf_counter() - t0
    t = cuda_time(lambda: tree_attention(plan, p["q"], p["kp"], p["vp"], p["kn"], p["vn"],
                                         out=out))
    kv_bytes = batch * ctx * HKV * D * 2 * 2
    dplan = next(v for k, v in plan.__dict__.items() if isinstance(k, tuple))
    row = {"batch": batch, "context": ctx, "tree": tree, "pyspec_s": t,
           "pyspec_gbps": kv_bytes / t / 1e9, "plan_and_upload_s": plan_s,
           "work_items": dplan.num_work_items, "split_tiles": dplan.num_split_tiles,
           "variant": "simple"}
    # The other tensor-core kernel on the same problem (backend="pipelined").
    other = "pipelined"
    out_other = torch.empty_like(out)
    tree_attention(plan, p["q"], p["kp"], p["vp"], p["kn"], p["vn"], out=out_other,
                   backend=other)
    row[f"{other}_s"] = cuda_time(lambda: tree_attention(
        plan, p["q"], p["kp"], p["vp"], p["kn"], p["vn"], out=out_other, backend=other))
    row[f"{other}_gbps"] = kv_bytes / row[f"{other}_s"] / 1e9
    row[f"{other}_max_abs_diff"] = (out_other.float() - out.float()).abs().max().item()
    # Kernel time without host overhead (CUDA graphs), and the Triton kernel on the same problem.
    args = (plan, p["q"], p["kp"], p["vp"], p["kn"], p["vn"])
    try:
        row["pyspec_graph_s"] = graph_time(lambda: tree_attention(*args, out=out))
        row["pyspec_graph_gbps"] = kv_bytes / row["pyspec_graph_s"] / 1e9
    except Exception as e:  # noqa: BLE001 - record why the graph could not be captured
        row["graph_error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"
    try:
        out_t = torch.empty_like(out)
        tree_attention(*args, out=out_t, backend="triton")  # compiles
        row["triton_s"] = cuda_time(lambda: tree_attention(*args, out=out_t, backend="triton"))
        row["triton_graph_s"] = graph_time(lambda: tree_attention(*args, out=out_t,
                                                                  backend="triton"))
        row["triton_graph_gbps"] = kv_bytes / row["triton_graph_s"] / 1e9
        row["triton_max_abs_diff"] = (out_t.float() - out.float()).abs().max().item()
        step = next(v for k, v in plan.__dict__.items() if k[0] == "_triton_step")
        row["triton_items"], row["triton_merges"] = step.num_items, step.num_merges
        if "pyspec_graph_s" in row:
            row["triton_speedup"] = row["pyspec_graph_s"] / row["triton_graph_s"]
    except Exception as e:  # noqa: BLE001 - record why the Triton kernel could not run
        row["triton_error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:300]}"
    if not compare:
        return row
    k, v = contiguous_kv(p, batch, ctx)
    q = p["q"].view(batch, tree, HQ, D).transpose(1, 2)  # [B, Hq, tree, D]
    vis = visibility(p, batch, ctx, tree)
    try:
        sdpa = lambda: torch.nn.functional.scaled_dot_product_attention(  # noqa: E731
            q, k, v, attn_mask=vis[:, None], enable_gqa=True)
        ref = sdpa()
        row["sdpa_s"] = cuda_time(sdpa, reps=10)
        err = (ref.transpose(1, 2).reshape(-1, HQ, D).float() - out.float()).abs().max().item()
        row["max_abs_diff_vs_sdpa"] = err
    except RuntimeError as e:  # out of memory for the dense mask at the largest sizes
        row["sdpa_error"] = str(e).splitlines()[0][:200]
    if flex is not None:
        flex_attention, create_block_mask = flex
        vis_b = vis

        def mask_mod(b, h, q_idx, kv_idx):
            return vis_b[b, q_idx, kv_idx]

        try:
            bm = create_block_mask(mask_mod, batch, None, tree, ctx + tree, device="cuda")
            fa = lambda: flex_attention(q, k, v, block_mask=bm, enable_gqa=True)  # noqa: E731
            fa()
            row["flex_s"] = cuda_time(fa, reps=10)
        except Exception as e:  # noqa: BLE001 - record why flex could not run this size
            row["flex_error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"
    return row


def bench_filters(rows=256 * 16, vocab=128256):
    g = torch.Generator(device="cuda").manual_seed(0)
    logits = (torch.randn(rows, vocab, device="cuda", generator=g) * 3).bfloat16()
    out = torch.empty(rows, vocab, device="cuda")
    t = torch.full((rows,), 0.7, device="cuda")
    k = torch.full((rows,), 50, dtype=torch.int32, device="cuda")
    p = torch.full((rows,), 0.9, device="cuda")
    m = torch.zeros(rows, device="cuda")
    s = cuda_time(lambda: sampling.apply_sampling_filters(logits, t, k, p, m, out=out), reps=5)
    return {"rows": rows, "vocab": vocab, "seconds": s,
            "gbps": logits.numel() * 2 / s / 1e9}


def bench_acceptance(batch=256, vocab=128256, tree=16):
    g = torch.Generator(device="cuda").manual_seed(1)
    n = batch * tree
    # Peaked rows so walks go deep: the drafted token is the target's argmax most of the time.
    target = torch.softmax(torch.randn(n, vocab, device="cuda", generator=g) * 4, -1)
    draft = torch.softmax(torch.randn(n, vocab, device="cuda", generator=g) * 4, -1)
    parents = torch.tensor(([-1] + list(range(tree - 1))) * batch, dtype=torch.int32)
    indptr = torch.arange(0, n + 1, tree)
    nxt = target.argmax(1).view(batch, tree)
    tokens = torch.zeros(batch, tree, dtype=torch.int32, device="cuda")
    tokens[:, 1:] = nxt[:, :-1].int()
    tokens = tokens.view(-1)
    out = {}
    for mode in ("greedy", "sampled"):
        kw = dict(greedy=mode == "greedy", seeds=torch.arange(batch, device="cuda"))
        if mode == "sampled":
            kw.update(draft_probs=draft, sampled_children=True)
        res = sampling.accept(target, tokens, parents, indptr, **kw)
        visited = int((res.num_accepted + 1).sum())
        rows_read = visited * (2 if mode == "sampled" else 1)
        s = cuda_time(lambda: sampling.accept(target, tokens, parents, indptr, **kw), reps=5)
        out[mode] = {"batch": batch, "vocab": vocab, "tree": tree, "seconds": s,
                     "mean_accepted": float(res.num_accepted.float().mean()),
                     "prob_bytes": rows_read * vocab * 4,
                     "gbps": rows_read * vocab * 4 / s / 1e9}
    return out


def bench_packed_linear(rows_list=(1, 16, 64)):
    """Dense layers of the Llama-3-8B layout from 4-bit / 8-bit codes (pyspec.triton_linear)
    against a bfloat16 matrix through F.linear (cuBLAS), graph-timed: seconds and weight bytes
    per second. Skipped (said so) without triton."""
    from pyspec.linear import PackedWeight
    from pyspec.triton_linear import available, packed_linear

    if not available():
        return [{"error": "no triton package"}]
    out = []
    g = torch.Generator(device="cuda").manual_seed(2)
    for n, k in ((6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336)):
        dense = torch.randn(n, k, device="cuda", dtype=torch.bfloat16, generator=g)
        codes = {
            4: PackedWeight(None, torch.randint(0, 256, (n, k // 2), device="cuda",
                                                dtype=torch.uint8, generator=g),
                            torch.rand(n, k // 32, device="cuda", generator=g) * 0.01,
                            -torch.rand(n, k // 32, device="cuda", generator=g) * 0.1, 4),
            8: PackedWeight(None, torch.randint(-127, 128, (n, k), device="cuda",
                                                dtype=torch.int8, generator=g),
                            torch.rand(n, k // 32, device="cuda", generator=g) * 0.01, None, 8)}
        for rows in rows_list:
            x = torch.randn(rows, k, device="cuda", dtype=torch.bfloat16, generator=g)
            t = graph_time(lambda x=x, w=dense: torch.nn.functional.linear(x, w))
            row = {"n": n, "k": k, "rows": rows, "bf16_s": t, "bf16_gbps": n * k * 2 / t / 1e9}
            for bits, w in codes.items():
                nbytes = w.q.numel() * w.q.element_size() + sum(
                    a.numel() * 4 for a in (w.d, w.m) if a is not None)
                t = graph_time(lambda x=x, w=w: packed_linear(x, w))
                row[f"int{bits}_s"] = t
                row[f"int{bits}_gbps"] = nbytes / t / 1e9
                row[f"int{bits}_speedup_vs_bf16"] = row["bf16_s"] / t
            out.append(row)
            print(json.dumps(row), flush=True)
        del dense, codes
        torch.cuda.empty_cache()
    return out


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--quick", action="store_true", help="batch {1, 8}, context {1k, 8k} only")
    ap.add_argument("--budget", type=float, default=240.0, help="seconds for the attention grid")
    ap.add_argument("--no-flex", action="store_true")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available() or not _C.built_with_cuda:
        print("needs a CUDA GPU and a CUDA build of pyspec", file=sys.stderr)
        return 2
    random.seed(0)
    g = torch.Generator().manual_seed(0)
    res = {"device": torch.cuda.get_device_name(), "torch": torch.__version__,
           "copy": copy_bandwidth(), "attention": [], "skipped": []}
    print(json.dumps(res["copy"]), flush=True)
    flex = None
    if not args.no_flex:
        try:
            import torch._dynamo as dynamo  # (a bare `import torch._dynamo` would rebind torch)
            from torch.nn.attention.flex_attention import create_block_mask, flex_attention

            # One compiled kernel per problem shape: allow them all.
            for name in ("cache_size_limit", "recompile_limit"):
                if hasattr(dynamo.config, name):
                    setattr(dynamo.config, name, 256)
            flex = (torch.compile(flex_attention, dynamic=False), create_block_mask)
        except Exception as e:  # noqa: BLE001
            res["flex_unavailable"] = f"{type(e).__name__}: {e}"
    batches = [1, 8] if args.quick else [1, 8, 64]
    contexts = [1024, 8192] if args.quick else [1024, 8192, 32768]
    start = time.perf_counter()
    for tree in (64, 16, 1):  # tree 64 first: the flex comparison the goals name
        for batch in batches:
            for ctx in contexts:
                if time.perf_counter() - start > args.budget:
                    res["skipped"].append({"batch": batch, "context": ctx, "tree": tree})
                    continue
                # flex_attention compiles per shape: it is compared where the goal names it
                # (tree 64); SDPA on every tree and on decode at 8k.
                compare = tree in (64, 16) or ctx == 8192
                row = bench_attention(batch, ctx, tree, flex if tree == 64 else None, compare, g)
                row["copy_fraction"] = row["pyspec_gbps"] / res["copy"]["gbps"]
                for name in ("pyspec_graph", "triton_graph"):
                    if f"{name}_gbps" in row:
                        row[f"{name}_copy_fraction"] = row[f"{name}_gbps"] / res["copy"]["gbps"]
                if "flex_s" in row:
                    row["speedup_vs_flex"] = row["flex_s"] / row["pyspec_s"]
                if "sdpa_s" in row:
                    row["speedup_vs_sdpa"] = row["sdpa_s"] / row["pyspec_s"]
                res["attention"].append(row)
                print(json.dumps(row), flush=True)
                torch.cuda.empty_cache()
    res["packed_linear"] = bench_packed_linear()
    for r in res["packed_linear"]:
        for bits in (4, 8):
            if f"int{bits}_gbps" in r:
                r[f"int{bits}_copy_fraction"] = r[f"int{bits}_gbps"] / res["copy"]["gbps"]
    res["filters"] = bench_filters()
    print(json.dumps(res["filters"]), flush=True)
    res["acceptance"] = bench_acceptance()
    for mode, r in res["acceptance"].items():
        r["copy_fraction"] = r["gbps"] / res["copy"]["gbps"]
    print(json.dumps(res["acceptance"]), flush=True)
    with open(args.out, "w") as f:
        json.dump(res, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
