"""Microbenchmark: weight-read bandwidth of pyspec.linear vs torch.nn.functional.linear.

    python bench/bench_linear.py [--quick] [--reps N] [--threads N] [--rows 1,4,16,32,64]
                                 [--dtypes float32,bfloat16]

Runs the dense layers of one SmolLM2-135M decoding step (30 layers of qkv [960, 576], o_proj
[576, 576], gate_up [3072, 576], down [576, 1536], then lm_head [49152, 576]; ~135M weights) with
M = --rows input rows (a draft tree verifies M > 1 rows at once), per dtype, and reports the weight
bytes read per second (GB/s) and milliseconds per pass of each implementation, best and median
over the repetitions (they alternate, so all see the same machine load): ``pyspec`` is
``pyspec.linear`` (the core kernel up to ``max_fast_rows(dtype)`` rows, torch above), ``core`` the
core kernel at every M, ``torch`` ``F.linear``. The machine's read bandwidth is measured in the same run as a
``sum()`` over a 256 MiB fp32 tensor with the same thread count. Prints one JSON document;
``speedup`` is pyspec GB/s / torch GB/s (medians). Also reports the per-call Python overhead of
``pyspec.linear`` on a tiny layer next to ``F.linear``'s.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch
import torch.nn.functional as F

from pyspec import _C
from pyspec.linear import linear, max_fast_rows
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


def bench_case(weights, m: int, dtype, reps: int) -> dict:
    g = torch.Generator().manual_seed(0)
    xs = {k: torch.randn(m, k, generator=g).to(dtype) for k in (HIDDEN, INTER)}
    nbytes = sum(w.numel() * w.element_size() for w in weights)
    outs = {w.shape[0]: torch.empty(m, w.shape[0], dtype=dtype) for w in weights}
    impls = {"pyspec": linear, "core": lambda x, w: _C.linear(x, w, None, outs[w.shape[0]]),
             "torch": F.linear}
    for fn in impls.values():  # warm-up (first-touch, thread start)
        time_pass(fn, weights, xs)
    times = {name: [] for name in impls}
    for _ in range(reps):
        for name, fn in impls.items():
            times[name].append(time_pass(fn, weights, xs))
    name = str(dtype).replace("torch.", "")
    res = {"m": m, "dtype": name, "kernel": _C._linear_kernel(name),
           "pyspec_routes_to": "core" if m <= max_fast_rows(dtype) else "torch",
           "weight_mb": round(nbytes / 1e6, 1)}
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


def call_overhead_us(n: int = 20000) -> dict:
    x, w, b = torch.randn(1, 8), torch.randn(4, 8), torch.randn(4)
    out = {}
    for name, fn in (("pyspec.linear", lambda: linear(x, w, b)),
                     ("_C.linear (preallocated out)", None),
                     ("F.linear", lambda: F.linear(x, w, b))):
        if fn is None:
            o = torch.empty(1, 4)
            fn = lambda o=o: _C.linear(x, w, b, o)  # noqa: E731
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
    layers, reps = (4, 3) if args.quick else (LAYERS, args.reps)
    report = {
        "threads": torch.get_num_threads(),
        "linear_isa": _C._linear_isa(),
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
        if args.huge_pages:  # where a loaded model's weights live (pyspec.hugepages)
            weights = huge_page_copies(weights)
        for m in rows:
            report["cases"].append(bench_case(weights, m, dtype, reps))
        del weights
    report["read_bandwidth_gbps_after"] = round(read_bandwidth(max(reps, 5)), 2)
    report["call_overhead_us"] = call_overhead_us()
    print(json.dumps(report, indent=1))
    return report


if __name__ == "__main__":
    main()
