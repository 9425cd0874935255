"""Greedy generation throughput of the default model with tensor_parallel_size 1 and N, in one
run (one rank before and after N ranks): MT-bench chat prompts, batched, the default drafter.

    python bench/bench_tensor_parallel.py --ranks 2 --out bench/results/tensor-parallel.json
"""

from __future__ import annotations

import argparse
import json
import os
import time

HERE = os.path.dirname(os.path.abspath(__file__))


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--out", default=os.path.join(HERE, "results", "tensor-parallel.json"))
    args = ap.parse_args(argv)

    import pyspec

    rows = [json.loads(x) for x in open(os.path.join(HERE, "data", "mt_bench_questions.jsonl"))]
    prompts = [r["turns"][0] for r in rows][:args.prompts]
    levels = []
    for tp in (1, args.ranks, 1):
        llm = pyspec.LLM(progress=False, tensor_parallel_size=tp)
        try:
            ids = [llm.chat_prompt([{"role": "user", "content": p}]) for p in prompts]
            llm.generate(ids[:2], {"max_tokens": 4})  # warm-up
            t0 = time.perf_counter()
            out = llm.generate(ids, {"max_tokens": args.max_tokens})
            dt = time.perf_counter() - t0
        finally:
            llm.close()
        n = sum(len(o.token_ids) for o in out)
        levels.append(dict(ranks=tp, tokens=n, seconds=dt, tokens_per_s=n / dt))
        print(json.dumps(levels[-1]), flush=True)
    one = [lv["tokens_per_s"] for lv in levels if lv["ranks"] == 1]
    ratio = levels[1]["tokens_per_s"] / (sum(one) / len(one))
    print(f"{args.ranks} ranks vs 1 (mean of before/after): {ratio:.2f}x")
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(dict(args=vars(args), cpus=os.cpu_count(), levels=levels,
                       ratio_vs_one_rank=ratio), f, indent=1)


if __name__ == "__main__":
    main()
