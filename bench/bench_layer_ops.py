"""The decode step's glue on this machine: the core's one-call layer ops against the torch op
chains they replace, and a target step with the thread pool's polling on and off.

- ``rms_norm`` (``pyspec.ops.rms_norm`` / ``_C.rms_norm``) against upcast-square-mean-rsqrt-scale-
  downcast-weight in torch, and ``rotary_qkv`` against slicing q/k/v out of the fused projection and
  rotating q and k with torch ops, at 1 / 16 / 300 rows of the default model's sizes (hidden 576,
  9 query and 3 key/value heads of 64), microseconds per call;
- one target step of the embedded default model (float32) after a --context-token prompt, plain
  (1 row) and over a chain of 16 draft nodes, with ``_C.set_spin_us(0)`` (workers sleep at once)
  and with the default polling window, interleaved in rounds, median milliseconds.

    python bench/bench_layer_ops.py --out bench/results/layer_ops.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import torch

HERE = os.path.dirname(os.path.abspath(__file__))


def _per_call_us(fn, repeats):
    for _ in range(20):
        fn()
    t0 = time.perf_counter()
    for _ in range(repeats):
        fn()
    return (time.perf_counter() - t0) / repeats * 1e6


def torch_rms(x, w, eps):
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return w * xf.to(x.dtype)


def torch_rotary(qkv, cos, sin, hq, hkv, k_out, v_out):
    t, d = qkv.shape[0], cos.shape[-1]
    c, s = cos[:, None], sin[:, None]

    def rotate(x):
        rot = torch.cat([-x[..., d // 2:], x[..., :d // 2]], dim=-1)
        return x * c + rot * s

    q = rotate(qkv[:, :hq * d].view(t, hq, d).float()).to(qkv.dtype)
    k_out.copy_(rotate(qkv[:, hq * d:(hq + hkv) * d].view(t, hkv, d).float()))
    v_out.copy_(qkv[:, (hq + hkv) * d:].view(t, hkv, d))
    return q


def ops_table(rows_list, repeats):
    from pyspec import ops

    hidden, hq, hkv, d = 576, 9, 3, 64
    out = []
    for rows in rows_list:
        x, w = torch.randn(rows, hidden), torch.randn(hidden)
        qkv = torch.randn(rows, (hq + 2 * hkv) * d)
        ang = torch.rand(rows, d)
        cos, sin = ang.cos(), ang.sin()
        k, v = torch.empty(rows, hkv, d), torch.empty(rows, hkv, d)
        r = repeats if rows < 100 else max(1, repeats // 10)
        for name, core, ref in (
                ("rms_norm", lambda: ops.rms_norm(x, w, 1e-5), lambda: torch_rms(x, w, 1e-5)),
                ("rotary_qkv", lambda: ops.rotary_qkv(qkv, cos, sin, hq, hkv, k, v),
                 lambda: torch_rotary(qkv, cos, sin, hq, hkv, k, v))):
            a, b = _per_call_us(core, r), _per_call_us(ref, r)
            out.append(dict(op=name, rows=rows, pyspec_us=round(a, 2), torch_us=round(b, 2),
                            ratio=round(b / a, 2)))
    return out


def step_table(context, rounds, repeats):
    import pyspec
    from pyspec import TokenTree, _C
    from pyspec.runner import SeqStep

    # The LLM's runner, straight (its engine stays unused).
    runner = pyspec.LLM(None, draft="none", dtype="float32", progress=False).runner
    table = list(range((context + 64) // runner.block_size + 2))
    runner.step([SeqStep(list(range(100, 100 + context)), 0, table, None, "last")])
    steps = {n: SeqStep(list(range(200, 200 + n)), context, table,
                        TokenTree([-1] + list(range(n - 1))) if n > 1 else None,
                        "all" if n > 1 else "last") for n in (1, 16)}
    default = _C.spin_us()
    times = {(s, n): [] for s in (0, default) for n in steps}
    try:
        for _ in range(rounds):
            for spin in (0, default):
                _C.set_spin_us(spin)
                for n, st in steps.items():
                    runner.step([st])
                    t0 = time.perf_counter()
                    for _ in range(repeats):
                        runner.step([st])
                    times[spin, n].append((time.perf_counter() - t0) / repeats * 1e3)
    finally:
        _C.set_spin_us(default)
    return [dict(spin_us=s, nodes=n, step_ms=round(statistics.median(v), 2))
            for (s, n), v in times.items()]


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", default="1,16,300")
    ap.add_argument("--repeats", type=int, default=2000)
    ap.add_argument("--context", type=int, default=300)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--step-repeats", type=int, default=8)
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    res = dict(config=vars(args), threads=torch.get_num_threads(),
               ops=ops_table([int(r) for r in args.rows.split(",")], args.repeats),
               steps=step_table(args.context, args.rounds, args.step_repeats))
    text = json.dumps(res, indent=1)
    print(text)
    if args.out:
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        with open(args.out, "w") as f:
            f.write(text + "\n")


if __name__ == "__main__":
    main()
