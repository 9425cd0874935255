"""Speculation inside one batch: wall time of ``LLM.generate`` over N MT-bench first turns submitted
together (greedy, ``ignore_eos``, the same length each), per drafter, in one process, with the
engine's cost-model state after the run (memory-bound draft limit, budget probes).

    python bench/bench_batch_spec.py --prompts 8 --max-tokens 128 --drafters none,default \
        [--dtype float32|bfloat16|float16]
"""

from __future__ import annotations

import argparse
import json
import os
import time

HERE = os.path.dirname(os.path.abspath(__file__))


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--drafters", default="none,default")
    ap.add_argument("--model", default=None)
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    args = ap.parse_args(argv)
    if args.prompts < 1 or args.max_tokens < 1:
        ap.error("--prompts and --max-tokens must be >= 1")
    import pyspec

    with open(os.path.join(HERE, "data", "mt_bench_questions.jsonl"), encoding="utf-8") as f:
        qs = [json.loads(line) for line in f if line.strip()]
    step = max(1, len(qs) // args.prompts)
    prompts = [q["turns"][0] for q in qs[::step][:args.prompts]]
    params = pyspec.SamplingParams(max_tokens=args.max_tokens, temperature=0, ignore_eos=True)
    plain = None
    for d in args.drafters.split(","):
        llm = pyspec.LLM(args.model, draft=d, dtype=args.dtype)
        ids = [llm.chat_prompt([{"role": "user", "content": p}]) for p in prompts]
        llm.generate(ids[:1], pyspec.SamplingParams(max_tokens=4, temperature=0))  # warm-up
        t = time.perf_counter()
        outs = llm.generate(ids, params)
        dt = time.perf_counter() - t
        plain = dt if plain is None else plain
        eng = llm.engine
        print(json.dumps({
            "drafter": d, "seconds": round(dt, 3), "time_vs_first": round(dt / plain, 3),
            "acceptance_length": [round(o.stats.acceptance_length, 2) for o in outs],
            "drafts": [o.stats.drafts for o in outs],
            "memory_bound_tokens": eng.scheduler.memory_bound_tokens,
            "budget_probes": eng.stats.budget_probes}), flush=True)


if __name__ == "__main__":
    main()
