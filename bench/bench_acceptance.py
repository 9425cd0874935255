"""Microbenchmarks of the acceptance-sampling ops against plain-torch implementations of the same
algorithms, measured in the same process.

Setting: vocab 49152 (SmolLM2), batch 32, one 16-node draft tree per request (an EAGLE-like ragged
tree of depth 4), float32 probabilities on the CPU.

* accept/sampled: recursive rejection sampling with the draft distributions (children drawn from q
  without replacement); accept/deterministic: the target-only walk (sample the target at each
  node, follow the child holding the sample); accept/greedy: the argmax walk.
  The torch baseline walks each request in Python with torch tensor ops (residual, renormalise,
  multinomial); it does not validate the rows, pyspec does (the rows it reads).
* filters/top_p and filters/top_k_top_p: apply_sampling_filters on [512, 49152] logits against the
  usual torch formulation (full sort, softmax, cumsum, scatter).
* filters_step (script only): apply_sampling_filters on a decoding step's rows (1, 4, 16 x 49152,
  temperature 0.7, with and without top-p 0.9) in each build of the filters' row passes
  (generic, AVX2, AVX-512; each through its ``_C.LinearKernels``), checked equal bit for bit.
* engine_greedy (script only): one greedy request's acceptance at batch 1 from the logits of a
  1-, 4- or 16-node chain: the core's walk over the logits (``sampling.accept_greedy``, no
  probability rows; what an engine runs with ``greedy_from_logits``) against the temperature-0
  rows plus the acceptance op (``greedy_from_logits = False``). Both build the chain's tensors
  from its lists in the timed call.

Run as pytest-benchmark: ``pytest bench/bench_acceptance.py --benchmark-only``; or as a script,
``python bench/bench_acceptance.py [--repeats N]``, which prints a JSON object of median times (ms)
and torch / pyspec speed ratios.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from pyspec import _C, sampling

VOCAB = 49152
BATCH = 32
# Child-rank paths of a 16-node tree (root implicit): 4 / 6 / 4 / 1 nodes at depths 1..4.
PATHS = [[0], [1], [2], [3], [0, 0], [0, 1], [0, 2], [1, 0], [1, 1], [2, 0],
         [0, 0, 0], [0, 0, 1], [0, 1, 0], [1, 0, 0], [0, 0, 0, 0]]


def tree_parents():
    index = {(): 0}
    parents = [-1]
    for path in sorted(PATHS, key=lambda p: (len(p), p)):
        index[tuple(path)] = len(parents)
        parents.append(index[tuple(path[:-1])])
    return parents


def make_inputs(seed=0):
    g = torch.Generator().manual_seed(seed)
    parents = tree_parents()
    n = len(parents)
    total = BATCH * n
    logits = torch.randn(total, VOCAB, generator=g) * 4.0
    target = torch.softmax(logits, dim=-1)
    draft = torch.softmax(logits + torch.randn(total, VOCAB, generator=g) * 1.5, dim=-1)
    kids = [[c for c in range(n) if parents[c] == v] for v in range(n)]
    tokens = torch.zeros(total, dtype=torch.int32)
    det_tokens = torch.zeros(total, dtype=torch.int32)
    for b in range(BATCH):
        base = b * n
        for v in range(n):
            if kids[v]:
                k = len(kids[v])
                row = draft[base + v]
                tokens[[base + c for c in kids[v]]] = torch.multinomial(
                    row, k, replacement=False, generator=g).to(torch.int32)
                det_tokens[[base + c for c in kids[v]]] = torch.topk(row, k).indices.to(torch.int32)
    return dict(
        target=target, draft=draft, tokens=tokens, det_tokens=det_tokens,
        parents=torch.tensor(parents * BATCH, dtype=torch.int32),
        indptr=torch.arange(0, total + 1, n, dtype=torch.int64),
        seeds=torch.arange(BATCH, dtype=torch.int64) + 1234, kids=kids, n=n,
        logits=logits[: 512].contiguous())


# ---- pyspec -------------------------------------------------------------------------------------


def pyspec_accept(x, mode):
    if mode == "sampled":
        return sampling.accept(x["target"], x["tokens"], x["parents"], x["indptr"],
                               draft_probs=x["draft"], seeds=x["seeds"], offsets=7)
    if mode == "deterministic":
        return sampling.accept(x["target"], x["det_tokens"], x["parents"], x["indptr"],
                               seeds=x["seeds"], offsets=7)
    return sampling.accept(x["target"], x["tokens"], x["parents"], x["indptr"], greedy=True,
                           seeds=x["seeds"])


# ---- plain torch baseline -------------------------------------------------------------------------


def torch_accept(x, mode):
    """The same algorithms as pyspec, one request at a time with torch ops."""
    target, draft, kids, n = x["target"], x["draft"], x["kids"], x["n"]
    tokens = x["det_tokens"] if mode == "deterministic" else x["tokens"]
    tok = tokens.tolist()
    results = []
    for b in range(BATCH):
        base = b * n
        gen = torch.Generator().manual_seed(int(x["seeds"][b]))
        node, emitted = 0, []
        while True:
            p = target[base + node]
            children = kids[node]
            if mode in ("greedy", "deterministic"):  # the argmax or a sample; follow its child
                t = (int(torch.argmax(p)) if mode == "greedy"
                     else int(torch.multinomial(p, 1, generator=gen)))
                emitted.append(t)
                nxt = [c for c in children if tok[base + c] == t]
                if not nxt:
                    break
                node = nxt[0]
                continue
            q = draft[base + node]
            accepted = -1
            for c in children:
                xt = tok[base + c]
                u = float(torch.rand((), generator=gen))
                if u * float(q[xt]) < float(p[xt]):
                    accepted = c
                    break
                p = torch.clamp(p - q, min=0.0)
                p = p / p.sum()
                q = q.clone()
                q[xt] = 0.0
                q = q / q.sum()
            if accepted >= 0:
                emitted.append(tok[base + accepted])
                node = accepted
                continue
            emitted.append(int(torch.multinomial(p, 1, generator=gen)))
            break
        results.append(emitted)
    return results


def torch_filters(logits, temperature, top_k, top_p, min_p):
    """The usual torch formulation: full sort, softmax, cumsum masks, scatter back."""
    v = logits.shape[1]
    greedy = temperature == 0
    z = logits.float() / torch.where(greedy, torch.ones_like(temperature), temperature)[:, None]
    sorted_z, idx = torch.sort(z, dim=-1, descending=True, stable=True)
    ranks = torch.arange(v)[None, :]
    keep = (top_k[:, None] == 0) | (ranks < top_k[:, None])
    sorted_z = sorted_z.masked_fill(~keep, float("-inf"))
    probs = torch.softmax(sorted_z, dim=-1)
    before = probs.cumsum(-1) - probs
    keep &= before < top_p[:, None]
    keep &= probs >= min_p[:, None] * probs[:, :1]
    probs = torch.where(keep, probs, torch.zeros_like(probs))
    probs = probs / probs.sum(-1, keepdim=True)
    out = torch.zeros_like(probs).scatter_(1, idx, probs)
    if greedy.any():
        hot = torch.zeros_like(out).scatter_(1, z.argmax(-1, keepdim=True), 1.0)
        out = torch.where(greedy[:, None], hot, out)
    return out


FILTER_CONFIGS = {
    "top_p": dict(temperature=0.7, top_k=0, top_p=0.9, min_p=0.0),
    "top_k_top_p": dict(temperature=0.7, top_k=50, top_p=0.95, min_p=0.05),
}


def filter_args(logits, cfg):
    n = logits.shape[0]
    return (logits, torch.full((n,), cfg["temperature"]), torch.full((n,), cfg["top_k"], dtype=torch.int32),
            torch.full((n,), cfg["top_p"]), torch.full((n,), cfg["min_p"]))


# ---- pytest-benchmark entry points ----------------------------------------------------------------

_INPUTS = {}


def _inputs():
    if "x" not in _INPUTS:
        _INPUTS["x"] = make_inputs()
    return _INPUTS["x"]


def test_accept_sampled_pyspec(benchmark):
    benchmark(pyspec_accept, _inputs(), "sampled")


def test_accept_sampled_torch(benchmark):
    benchmark(torch_accept, _inputs(), "sampled")


def test_accept_deterministic_pyspec(benchmark):
    benchmark(pyspec_accept, _inputs(), "deterministic")


def test_accept_deterministic_torch(benchmark):
    benchmark(torch_accept, _inputs(), "deterministic")


def test_accept_greedy_pyspec(benchmark):
    benchmark(pyspec_accept, _inputs(), "greedy")


def test_accept_greedy_torch(benchmark):
    benchmark(torch_accept, _inputs(), "greedy")


def test_filters_top_p_pyspec(benchmark):
    benchmark(sampling.apply_sampling_filters, *filter_args(_inputs()["logits"], FILTER_CONFIGS["top_p"]))


def test_filters_top_p_torch(benchmark):
    benchmark(torch_filters, *filter_args(_inputs()["logits"], FILTER_CONFIGS["top_p"]))


# ---- script entry point ----------------------------------------------------------------------------


def _median_ms(fn, repeats):
    fn()  # warm-up
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=20)
    args = ap.parse_args(argv)
    x = make_inputs()
    # Sanity: the greedy walks agree exactly (no randomness involved).
    assert pyspec_accept(x, "greedy").emitted_lists() == torch_accept(x, "greedy")
    results = {"vocab": VOCAB, "batch": BATCH, "tree_nodes": x["n"], "threads": _C.num_threads(),
               "torch_threads": torch.get_num_threads(), "repeats": args.repeats, "ms": {},
               "speedup_vs_torch": {}}
    mean_acc = {}
    for mode in ("sampled", "deterministic", "greedy"):
        mean_acc[mode] = float(pyspec_accept(x, mode).num_accepted.float().mean())
        ours = _median_ms(lambda: pyspec_accept(x, mode), args.repeats)
        ref = _median_ms(lambda: torch_accept(x, mode), max(3, args.repeats // 4))
        results["ms"][f"accept/{mode}/pyspec"] = round(ours, 4)
        results["ms"][f"accept/{mode}/torch"] = round(ref, 4)
        results["speedup_vs_torch"][f"accept/{mode}"] = round(ref / ours, 2)
    results["mean_accepted"] = mean_acc
    for name, cfg in FILTER_CONFIGS.items():
        a = filter_args(x["logits"], cfg)
        torch.testing.assert_close(sampling.apply_sampling_filters(*a), torch_filters(*a),
                                   rtol=1e-3, atol=1e-6)
        ours = _median_ms(lambda: sampling.apply_sampling_filters(*a), args.repeats)
        ref = _median_ms(lambda: torch_filters(*a), args.repeats)
        results["ms"][f"filters/{name}/pyspec"] = round(ours, 4)
        results["ms"][f"filters/{name}/torch"] = round(ref, 4)
        results["speedup_vs_torch"][f"filters/{name}"] = round(ref / ours, 2)
    # A decoding step's filters: a request's tree rows (1, 4, 16) at temperature 0.7 (and with
    # top-p 0.9), in each build of the row passes this CPU has (the same bits in each).
    g = torch.Generator().manual_seed(2)
    isas = {}
    for isa in ("generic", "avx2", "avx512"):
        try:
            isas[isa] = _C.LinearKernels(isa)
        except ValueError:
            pass
    for rows in (1, 4, 16):
        logits = torch.randn(rows, VOCAB, generator=g) * 4.0
        for name, kw in (("t0.7", {}), ("t0.7_top_p0.9", {"top_p": 0.9})):
            outs = []
            for isa, kernels in isas.items():
                kw = dict(kw, kernels=kernels)
                outs.append(sampling.apply_sampling_filters(logits, 0.7, **kw))
                results["ms"][f"filters_step/{rows}_rows/{name}/{isa}"] = round(_median_ms(
                    lambda: sampling.apply_sampling_filters(logits, 0.7, **kw),
                    10 * args.repeats), 4)
            assert all(torch.equal(o, outs[0]) for o in outs)
    # The engine's greedy step at batch 1: the core's walk straight from the logits against the
    # temperature-0 rows plus the acceptance op, for one request's chain.
    from pyspec.drafters.base import Draft

    g = torch.Generator().manual_seed(1)
    for n in (1, 4, 16):
        logits = torch.randn(n, VOCAB, generator=g) * 4.0
        chain = Draft([0] + logits.argmax(-1).tolist()[:-1], list(range(-1, n - 1)))

        def op():
            probs = sampling.apply_sampling_filters(logits, 0.0)
            r = sampling.accept(probs, torch.tensor(chain.tokens, dtype=torch.int32),
                                torch.tensor(chain.parents, dtype=torch.int32),
                                torch.tensor([0, n]), greedy=True, seeds=0)
            return r.emitted_lists()

        def from_logits():
            r = sampling.accept_greedy(logits, torch.tensor(chain.tokens, dtype=torch.int32),
                                       torch.tensor(chain.parents, dtype=torch.int32),
                                       torch.tensor([0, n]))
            return r.emitted_lists()

        assert op() == from_logits()
        walk = _median_ms(from_logits, args.repeats)
        ref = _median_ms(op, args.repeats)
        results["ms"][f"engine_greedy/{n}_nodes/walk"] = round(walk, 4)
        results["ms"][f"engine_greedy/{n}_nodes/filters+accept"] = round(ref, 4)
    print(json.dumps(results, indent=2))
    return results


if __name__ == "__main__":
    main()
