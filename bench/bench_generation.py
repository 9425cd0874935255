"""How fast the CPU makes training data: the target's answers to requests through pyspec's batched
engine (``pyspec.train.data.generate_corpus``, what ``train-draft`` runs), generated tokens per
hour with the hidden states recorded (what a head trained straight from the generation needs)
and tokens only (``train-draft --method suffix``; features are computed later in one
teacher-forced pass), measured side by side on the same requests.

    python bench/bench_generation.py --prompts pyspec/train/seed_requests.jsonl --limit 128 \
        --json bench/results/generation-rate.json
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from bench_oracle_scaling import cpu_name  # noqa: E402


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--target", default=None, help="target model folder (default: the embedded)")
    ap.add_argument("--prompts", required=True, help="JSONL requests ('prompt' or 'turns')")
    ap.add_argument("--limit", type=int, default=128, help="first N requests")
    ap.add_argument("--max-tokens", type=int, default=192)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16"])
    ap.add_argument("--json", default=None, help="write the result here")
    args = ap.parse_args(argv)
    if min(args.limit, args.max_tokens, args.batch) < 1:
        ap.error("--limit, --max-tokens and --batch must be >= 1")
    import torch

    import pyspec
    from pyspec.train.data import generate_corpus
    from pyspec.train.evaluate import read_prompts

    prompts = [text for _, text in read_prompts(args.prompts, limit=args.limit)]
    llm = pyspec.LLM(args.target, draft="none", dtype=args.dtype, kv_cache_tokens=1024)
    result = {"machine": f"{cpu_name()}, {os.cpu_count()} CPUs, {torch.get_num_threads()} threads",
              "prompts": len(prompts), "max_tokens": args.max_tokens, "batch": args.batch,
              "dtype": args.dtype, "runs": {}}
    generate_corpus(llm, prompts[:2], max_tokens=4, batch=2, progress=False)  # warm-up
    for name, hidden in (("hidden_recorded", True), ("tokens_only", False)):
        t0 = time.perf_counter()
        seqs = generate_corpus(llm, prompts, max_tokens=args.max_tokens, batch=args.batch,
                               progress=False, hidden=hidden)
        secs = time.perf_counter() - t0
        gen = sum(len(s.tokens) - s.num_prompt for s in seqs)
        result["runs"][name] = {"seconds": round(secs, 1), "generated_tokens": gen,
                                "tokens_per_hour": round(3600 * gen / secs)}
        print(f"{name}: {gen} tokens in {secs:.1f} s, {3600 * gen / secs:,.0f} per hour",
              flush=True)
        if name == "hidden_recorded":
            tokens = [s.tokens for s in seqs]
        else:  # the same requests, seeds and temperatures: the same answers
            result["same_tokens"] = tokens == [s.tokens for s in seqs]
    if args.json:
        os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
    return result


if __name__ == "__main__":
    main()
