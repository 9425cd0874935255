"""What verifying a draft costs on this machine: the time of one target step over a chain-shaped
tree of N nodes (N = 1 is a plain decode step) after a prompt of --context tokens, on the
embedded default model, per dtype. Speculation pays only where acceptance length / (verify step /
plain step + draft cost) > 1.

    python bench/bench_verify_cost.py --dtypes float32,bfloat16
"""

from __future__ import annotations

import argparse
import json
import time


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--dtypes", default="float32")
    ap.add_argument("--context", type=int, default=300)
    ap.add_argument("--nodes", default="1,2,4,8,12,16,24,32")
    ap.add_argument("--repeats", type=int, default=20)
    args = ap.parse_args(argv)

    import pyspec
    from pyspec import TokenTree
    from pyspec.runner import SeqStep

    out = {}
    for dtype in args.dtypes.split(","):
        # The LLM's runner, straight (its engine stays unused).
        runner = pyspec.LLM(None, draft="none", dtype=dtype, progress=False).runner
        ctx = args.context
        table = list(range((ctx + 64) // runner.block_size + 2))
        runner.step([SeqStep(list(range(100, 100 + ctx)), 0, table, None, "last")])
        ms = {}
        for n in (int(x) for x in args.nodes.split(",")):
            tree = TokenTree([-1] + list(range(n - 1))) if n > 1 else None
            step = SeqStep(list(range(200, 200 + n)), ctx, table, tree, "all" if n > 1 else "last")
            for _ in range(3):
                runner.step([step])
            t0 = time.perf_counter()
            for _ in range(args.repeats):
                runner.step([step])
            ms[n] = round((time.perf_counter() - t0) / args.repeats * 1000, 2)
        out[dtype] = {"step_ms": ms, "vs_plain": {n: round(v / ms[1], 2) for n, v in ms.items()
                                                  if 1 in ms}}
    print(json.dumps(dict(config=vars(args), results=out), indent=1))


if __name__ == "__main__":
    main()
