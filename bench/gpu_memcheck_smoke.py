"""A short CUDA program for compute-sanitizer (bench/gpu_check.sh): every CUDA kernel of pyspec
once on small inputs (both tensor-core attention kernels and the generic one with split-KV, the
merge, filters, greedy and sampled acceptance, KV materialization), each checked against the CPU op.
Prints "smoke: ok". ``--attention-only``: the attention kernels alone (for racecheck/synccheck).
"""

import random
import sys

import torch

from pyspec import ops, sampling
from pyspec.attention import plan_attention, tree_attention


def attention(dtype, d, backend="native"):
    random.seed(1)
    g = torch.Generator().manual_seed(1)
    bs, hq, hkv = 16, 8, 2
    reqs = [(700, 9, [-1, 0, 0, 1, 1, 2, 3, 3, 0]), (1500, 1, None), (0, 20, None)]
    used = [-(-p // bs) for p, _, _ in reqs]
    nb = sum(used) + 2
    tables = torch.full((len(reqs), max(used)), -1, dtype=torch.int32)
    perm, k = torch.randperm(nb, generator=g), 0
    for b, u in enumerate(used):
        tables[b, :u] = perm[k:k + u].int()
        k += u
    qi, par, ti = [0], [], [0]
    for _, n, p in reqs:
        qi.append(qi[-1] + n)
        par += p or []
        ti.append(len(par))
    T = qi[-1]
    kp, vp = (torch.randn(nb, bs, hkv, d, generator=g).to(dtype) for _ in range(2))
    q = torch.randn(T, hq, d, generator=g).to(dtype)
    kn, vn = (torch.randn(T, hkv, d, generator=g).to(dtype) for _ in range(2))
    plan = plan_attention(qi, [r[0] for r in reqs], tables, bs, par, ti, nb, num_q_heads=hq,
                          num_kv_heads=hkv, min_kv_chunk=64)
    cpu = tree_attention(plan, q, kp, vp, kn, vn)
    gpu = tree_attention(plan, *(t.cuda() for t in (q, kp, vp, kn, vn)), backend=backend).cpu()
    err = (cpu.float() - gpu.float()).abs().max().item()
    assert err < (1e-4 if dtype == torch.float32 else 3e-2), (dtype, d, err)


def main():

    attention(torch.bfloat16, 128)
    attention(torch.float16, 64)
    attention(torch.float32, 80)
    # The pipelined tensor-core kernel too (cp.async stages; racecheck runs this part alone).
    attention(torch.bfloat16, 128, backend="pipelined")
    attention(torch.float16, 64, backend="pipelined")
    if "--attention-only" in sys.argv:
        torch.cuda.synchronize()
        print("smoke: ok")
        return 0
    logits = torch.randn(5, 1000) * 3
    cpu = sampling.apply_sampling_filters(logits, 0.8, 20, 0.9)
    gpu = sampling.apply_sampling_filters(logits.cuda(), 0.8, 20, 0.9).cpu()
    assert torch.equal(gpu > 0, cpu > 0)
    probs = torch.softmax(torch.randn(6, 50), -1)
    tokens = torch.tensor([0, 3, 7, 0, 1, 2], dtype=torch.int32)
    parents = torch.tensor([-1, 0, 0, -1, 0, 1], dtype=torch.int32)
    indptr = torch.tensor([0, 3, 6])
    for kw in (dict(greedy=True), dict(draft_probs=probs, sampled_children=True)):
        a = sampling.accept(probs, tokens, parents, indptr, seeds=5, **kw)
        kw = {k: (v.cuda() if isinstance(v, torch.Tensor) else v) for k, v in kw.items()}
        b = sampling.accept(probs.cuda(), tokens.cuda(), parents, indptr, seeds=5, **kw)
        assert torch.equal(a.emitted_tokens, b.emitted_tokens.cpu())
    scratch = torch.randn(4, 2, 64, device="cuda")
    pages = torch.zeros(3, 4, 2, 64, device="cuda")
    ops.materialize_kv(scratch, pages, torch.tensor([0, 2], device="cuda"),
                       torch.tensor([5, 11], device="cuda"))
    assert torch.equal(pages.view(-1, 2, 64)[5], scratch[0])
    torch.cuda.synchronize()
    print("smoke: ok")
    return 0


if __name__ == "__main__":
    sys.exit(main())
