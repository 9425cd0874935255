"""Learning from served traffic (`learn=T` on the shipped corpus drafter): tokens per target step
on 16 MT-bench first turns (two per category) for `default` (no learning), then for
`ngram|suffix@learn=T` after it has served the other 64 first turns (the 16 are new to it), then
for the same 16 served a second time (repeated traffic). Greedy, 128 new tokens, batch 1.

    python bench/bench_learn.py [--out bench/results/learn.json]
"""

import argparse
import json
import os
import time

import pyspec

HERE = os.path.dirname(os.path.abspath(__file__))


def tokens_per_step(llm, convs, max_tokens):
    toks = steps = 0
    for c in convs:  # one at a time: batch 1
        o = llm.chat(c, {"max_tokens": max_tokens})
        toks += len(o.token_ids)
        steps += o.stats.steps
    return toks / steps


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--learn", type=int, default=2_000_000)
    ap.add_argument("--out", default=os.path.join(HERE, "results", "learn.json"))
    a = ap.parse_args()
    qs = [json.loads(line) for line in open(os.path.join(HERE, "data", "mt_bench_questions.jsonl"))]
    held = set(range(0, len(qs), len(qs) // 16))
    turn = [[{"role": "user", "content": q["turns"][0]}] for q in qs]
    held_out = [turn[i] for i in sorted(held)]
    traffic = [turn[i] for i in range(len(qs)) if i not in held]
    res = {"held_out_prompts": len(held_out), "served_prompts": len(traffic),
           "max_tokens": a.max_tokens}
    base = pyspec.LLM(None, draft="default", kv_cache_tokens=4096, progress=False)
    res["default"] = tokens_per_step(base, held_out, a.max_tokens)
    llm = pyspec.LLM(None, draft=f"ngram|suffix@learn={a.learn}", kv_cache_tokens=4096,
                     progress=False)
    learner = llm.engine.drafters[llm.engine.default_drafter].parts[1]
    t0 = time.time()
    for c in traffic:
        llm.chat(c, {"max_tokens": a.max_tokens})
    if learner._builder is not None:
        learner._builder.join()
    res["served_seconds"] = round(time.time() - t0, 1)
    res["learned_tokens"] = learner.learned_tokens
    res["learned_new_prompts"] = tokens_per_step(llm, held_out, a.max_tokens)
    res["learned_repeated_prompts"] = tokens_per_step(llm, held_out, a.max_tokens)
    for k, v in res.items():
        print(f"{k}: {round(v, 3) if isinstance(v, float) else v}")
    os.makedirs(os.path.dirname(a.out), exist_ok=True)
    with open(a.out, "w") as f:
        json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
