"""What choosing the drafter per request could gain at most: the upper bound of the acceptance
predictor's drafter-choice lever.

    python bench/drafter_choice_oracle.py [--prompts FILES] [--drafters default,ngram,lookahead]
                                          [--max-tokens 64] [--limit N] [--out FILE.json]

Per prompt (chat template, greedy, batch 1, the default model) every engine decodes it once, in a
rotating order: two plain-decoding engines (``plain`` and ``plain2``) and one per drafter.
Reported, as mean speedup over ``plain`` across requests:

* each drafter always (what one fixed choice gives);
* the oracle: per request the fastest of the drafters (and of plain decoding), which no
  predictor can beat on these measurements;
* the same oracle's noise floor: per request the faster of ``plain`` and ``plain2``, two
  identical engines. A single timing per request favours whichever run was lucky, so an oracle over
  noisy timings gains something even between identical engines: only the oracle's gain beyond
  this floor is the lever's.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
DEFAULT_PROMPTS = ",".join(os.path.join(HERE, "data", f) for f in
                           ("task_kinds.jsonl", "mt_bench_questions.jsonl"))


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--prompts", default=DEFAULT_PROMPTS, help="JSONL files, comma-separated")
    ap.add_argument("--drafters", default="default,ngram,lookahead")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--limit", type=int, default=0, help="first N prompts only (0: all)")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)

    import torch

    import pyspec
    from bench_spec import emit
    from pyspec.train.evaluate import read_prompts

    torch.set_num_threads(2)
    rows = [(c, t) for f in args.prompts.split(",") if f for c, t in read_prompts(f)]
    if args.limit:
        rows = rows[:args.limit]
    drafters = [d for d in args.drafters.split(",") if d]
    # plain2: a second plain engine (the same engine twice would find the prompt in its prefix
    # cache the second time).
    engines = {"plain": pyspec.LLM(draft="none", progress=False),
               "plain2": pyspec.LLM(draft="none", progress=False)}
    for d in drafters:
        engines[d] = pyspec.LLM(draft=d, progress=False)
    sp = pyspec.SamplingParams(max_tokens=args.max_tokens, temperature=0.0)
    for llm in engines.values():  # warm-up
        llm.chat([{"role": "user", "content": "Hello"}], pyspec.SamplingParams(max_tokens=8))
    names = list(engines)
    records = []
    for i, (kind, text) in enumerate(rows):
        msg = [{"role": "user", "content": text}]
        order = names[i % len(names):] + names[:i % len(names)]
        secs, toks = {}, {}
        for name in order:
            t = time.perf_counter()
            o = engines[name].chat(msg, sp)
            secs[name] = time.perf_counter() - t
            toks[name] = o.token_ids
        same = all(toks[n] == toks["plain"] for n in names)
        records.append({"kind": kind, "seconds": secs, "identical": same})
        print(f"{i + 1}/{len(rows)} {kind}: " + " ".join(
            f"{n} {secs['plain'] / secs[n]:.2f}x" for n in names[1:]), file=sys.stderr, flush=True)

    def mean_speedup(pick):
        return statistics.mean(r["seconds"]["plain"] / pick(r) for r in records)

    res = {"config": {"prompts": len(records), "max_tokens": args.max_tokens,
                      "drafters": drafters, "machine_threads": torch.get_num_threads()},
           "identical": sum(r["identical"] for r in records),
           "always": {d: mean_speedup(lambda r, d=d: r["seconds"][d]) for d in drafters},
           "oracle_drafters": mean_speedup(lambda r: min(r["seconds"][d] for d in drafters)),
           "oracle_drafters_or_plain": mean_speedup(
               lambda r: min([r["seconds"][d] for d in drafters] + [r["seconds"]["plain2"]])),
           "noise_floor_plain_vs_plain": mean_speedup(
               lambda r: min(r["seconds"]["plain"], r["seconds"]["plain2"])),
           "plain2_vs_plain": mean_speedup(lambda r: r["seconds"]["plain2"]),
           "records": records}
    best_fixed = max(res["always"].values())
    res["oracle_gain_over_best_fixed"] = res["oracle_drafters_or_plain"] / best_fixed
    res["noise_floor_gain"] = res["noise_floor_plain_vs_plain"] / res["plain2_vs_plain"]
    print(json.dumps({k: v for k, v in res.items() if k != "records"}, indent=1),
          file=sys.stderr)
    emit(res, args.out)
    return res


if __name__ == "__main__":
    main()
