"""Microbenchmark: weight-read bandwidth of pyspec.linear vs torch.nn.functional.linear.

    python bench/bench_linear.py [--quick] [--reps N] [--threads N] [--rows 1,4,16,32,64]
                                 [--dtypes float32,bfloat16] [--packed]

Runs the dense layers of one SmolLM2-135M decoding step (30 layers of qkv [960, 576], o_proj
[576, 576], gate_up [3072, 576], down [576, 1536], then lm_head [49152, 576]; ~135M weights) with
M = --rows input rows (a draft tree verifies M > 1 rows at once), per dtype, and reports the weight
bytes read per second (GB/s) and milliseconds per pass of each implementation, best and median
over the repetitions (they alternate, so all see the same machine load): ``pyspec`` is a
``pyspec.linear.Linear`` (the core kernel up to ``max_fast_rows(dtype)`` rows, torch above),
``core`` the core kernel (``_C.linear``) at every M, ``torch`` ``F.linear``. With ``--packed`` the
float32 weights are moved onto the block grids of a Q4_1 / Q8_0 GGUF (4-bit groups for the
layers, 8-bit for lm_head: the default model's formats) and ``packed`` times the ``Linear`` on
their exact codes (``pack_exact``; the same results as the float32 kernel bit for bit;
``packed_mb`` is what it reads; past the kernels' ``packed_max_rows`` rows it reads the float32
matrices, as a model does). ``--isa`` picks the kernels' build: one ``_C.LinearKernels(isa)``
that the ``Linear`` and every ``_C.linear`` call here run on (``avx2``: what a CPU without
AVX-512 runs; a model takes the same object or name as ``kernels=``). The machine's read
bandwidth is measured in the same run as a ``sum()`` over a 256 MiB fp32 tensor with the same
thread count. Prints one JSON document; ``speedup`` is pyspec GB/s / torch GB/s (medians). Also
reports the per-call Python overhead of the ``Linear`` on a tiny layer next to ``F.linear``'s.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch
import torch.nn.functional as F

from pyspec import _C
from pyspec.linear import Linear, pack_exact
from pyspec.hugepages import enabled as hugepages_enabled, huge_page_copies

HIDDEN, INTER, QKV, VOCAB, LAYERS = 576, 1536, 960, 49152, 30


def smollm2_shapes(layers: int) -> list:
    per_layer = [(QKV, HIDDEN), (HIDDEN, HIDDEN), (2 * INTER, HIDDEN), (HIDDEN, INTER)]
    return per_layer * layers + [(VOCAB, HIDDEN)]


def read_bandwidth(reps: int) -> float:
    x = torch.ones(64 * 1024 * 1024)  # 256 MiB
    x.sum()
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        x.sum()
        times.append(time.perf_counter() - t)
    return x.numel() * 4 / min(times) / 1e9


def time_pass(fn, weights, xs) -> float:
    t = time.perf_counter()
    for w in weights:
        fn(xs[w.shape[1]], w)
    return time.perf_counter() - t


def snap_to_blocks(w: torch.Tensor, bits: int) -> torch.Tensor:
    """w moved onto a block grid: per group of 32 along K, d * q + m (4-bit, q in 0..15) or d * q
    (8-bit, q in -127..127) with d and m float16 values, as a Q4_1 / Q8_0 GGUF's weights are."""
    g = w.float().view(w.shape[0], -1, 32)
    if bits == 4:
        lo, hi = g.amin(-1, keepdim=True), g.amax(-1, keepdim=True)
        d, lo = ((hi - lo) / 15).half().float(), lo.half().float()
        q = torch.round((g - lo) / d).clamp(0, 15)
        return (q * d + lo).reshape(w.shape).contiguous()
    d = (g.abs().amax(-1, keepdim=True) / 127).half().float()
    return (torch.round(g / d).clamp(-127, 127) * d + 0.0).reshape(w.shape).contiguous()  # no -0.0


def bench_case(lin: Linear, weights, m: int, dtype, reps: int, packed=None) -> dict:
    g = torch.Generator().manual_seed(0)
    xs = {k: torch.randn(m, k, generator=g).to(dtype) for k in (HIDDEN, INTER)}
    nbytes = sum(w.numel() * w.element_size() for w in weights)
    outs = {w.shape[0]: torch.empty(m, w.shape[0], dtype=dtype) for w in weights}
    k = lin.kernels
    impls = {"pyspec": lin, "core": lambda x, w: _C.linear(x, w, None, outs[w.shape[0]], k),
             "torch": F.linear}
    if packed is not None:
        # Run right after `core`: an implementation that runs after `torch` shares the cores with
        # torch's OpenMP workers for the first milliseconds (they spin after a parallel op).
        by_id = {id(w): p for w, p in zip(weights, packed)}
        impls = {"pyspec": lin, "core": impls["core"],
                 "packed": lambda x, w: lin(x, by_id[id(w)]), "torch": F.linear}
    for fn in impls.values():  # warm-up (first-touch, thread start)
        time_pass(fn, weights, xs)
    times = {name: [] for name in impls}
    for _ in range(reps):
        for name, fn in impls.items():
            times[name].append(time_pass(fn, weights, xs))
    name = str(dtype).replace("torch.", "")
    res = {"m": m, "dtype": name, "kernel": k.kernel(name),
           "pyspec_routes_to": "core" if m <= lin.max_fast_rows(dtype) else "torch",
           "weight_mb": round(nbytes / 1e6, 1)}
    if packed is not None:
        res["packed_mb"] = round(sum(p.nbytes for p in packed) / 1e6, 1)
        res["packed_equals_pyspec"] = all(  # every matrix, bit for bit
            torch.equal(lin(xs[w.shape[1]], w).view(torch.int32),
                        impls["packed"](xs[w.shape[1]], w).view(torch.int32)) for w in weights)
    for name, ts in times.items():
        res[name] = {
            "best_gbps": round(nbytes / min(ts) / 1e9, 2),
            "median_gbps": round(nbytes / statistics.median(ts) / 1e9, 2),
            "median_ms": round(statistics.median(ts) * 1e3, 2),
        }
    ratio = statistics.median(times["torch"]) / statistics.median(times["pyspec"])
    res["speedup"] = round(ratio, 2)
    res["core_speedup"] = round(statistics.median(times["torch"])
                                / statistics.median(times["core"]), 2)
    return res


def call_overhead_us(lin: Linear, n: int = 20000) -> dict:
    x, w, b = torch.randn(1, 8), torch.randn(4, 8), torch.randn(4)
    k = lin.kernels
    out = {}
    for name, fn in (("pyspec.linear", lambda: lin(x, w, b)),
                     ("_C.linear (preallocated out)", None),
                     ("F.linear", lambda: F.linear(x, w, b))):
        if fn is None:
            o = torch.empty(1, 4)
            fn = lambda o=o: _C.linear(x, w, b, o, k)  # noqa: E731
        for _ in range(1000):
            fn()
        t = time.perf_counter()
        for _ in range(n):
            fn()
        out[name] = round((time.perf_counter() - t) / n * 1e6, 2)
    return out


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="4 layers, 3 repetitions")
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--threads", type=int, default=0, help="torch threads (default: torch's)")
    ap.add_argument("--rows", default="1,4,16", help="input rows M, comma-separated")
    ap.add_argument("--dtypes", default="float32,bfloat16")
    ap.add_argument("--isa", default="auto", choices=["auto", "avx2", "avx512"])
    ap.add_argument("--packed", action="store_true",
                    help="float32 weights on Q4_1 / Q8_0 block grids, plus their packed codes")
    ap.add_argument("--huge-pages", type=int, default=1,
                    help="1: weights on transparent huge pages, as a loaded model's (default); 0: "
                         "ordinary pages")
    args = ap.parse_args(argv)
    rows = [int(r) for r in args.rows.split(",")]
    dtypes = [getattr(torch, d, None) for d in args.dtypes.split(",")]
    if any(r < 1 for r in rows) or any(d not in (torch.float32, torch.bfloat16, torch.float16)
                                       for d in dtypes):
        ap.error("--rows must be positive integers; --dtypes float32, bfloat16 or float16")
    if args.threads > 0:
        torch.set_num_threads(args.threads)
    try:
        kernels = _C.LinearKernels(args.isa)
    except ValueError as e:
        ap.error(f"--isa {args.isa}: {e}")
    lin = Linear(kernels)
    layers, reps = (4, 3) if args.quick else (LAYERS, args.reps)
    report = {
        "threads": torch.get_num_threads(),
        "linear_isa": kernels.isa,
        "packed_max_rows": kernels.packed_max_rows,
        "layers": layers,
        "reps": reps,
        "huge_pages": bool(args.huge_pages) and hugepages_enabled(),
        "read_bandwidth_gbps": round(read_bandwidth(max(reps, 5)), 2),
        "cases": [],
    }
    g = torch.Generator().manual_seed(1)
    for dtype in dtypes:
        weights = [(torch.randn(n, k, generator=g) * 0.05).to(dtype)
                   for n, k in smollm2_shapes(layers)]
        packed = None
        if args.packed and dtype == torch.float32:
            weights = [snap_to_blocks(w, 8 if n == VOCAB else 4)
                       for w, (n, _) in zip(weights, smollm2_shapes(layers))]
        if args.huge_pages:  # where a loaded model's weights live (pyspec.hugepages)
            weights = huge_page_copies(weights)
        if args.packed and dtype == torch.float32:
            packed = [pack_exact(w) for w in weights]
            if any(p is None for p in packed) or not kernels.packed_available:
                raise SystemExit("--packed: the weights did not pack, or these kernels read no "
                                 "codes (packed_available needs the AVX2 or AVX-512 float32 "
                                 "build)")
            codes = huge_page_copies([t for p in packed for t in (p.q, p.d, p.m) if t is not None])
            it = iter(codes)
            for p in packed:
                p.q, p.d = next(it), next(it)
                p.m = None if p.m is None else next(it)
        for m in rows:
            report["cases"].append(bench_case(lin, weights, m, dtype, reps, packed))
        del weights, packed
    report["read_bandwidth_gbps_after"] = round(read_bandwidth(max(reps, 5)), 2)
    report["call_overhead_us"] = call_overhead_us(lin)
    print(json.dumps(report, indent=1))
    return report


if __name__ == "__main__":
    main()
