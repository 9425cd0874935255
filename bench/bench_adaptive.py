"""Adaptive speculation policies side by side on the embedded default model.

For each drafter (--drafters), three engines over the same MT-bench first turns, interleaved per
prompt with plain decoding (greedy, batch 1, float32, --max-tokens new tokens): the adaptive
defaults (cost-model draft length; fallback only when an optimistic acceptance predicts no gain),
the same plus a hard acceptance floor (--floor, the former default 0.3), and no adaptation at all
(the drafter's full draft every step, never falling back); for a drafter with several draft
sources (`ngram`'s match lengths, the parts of `ngram|DIR` and `default`) also the adaptive
defaults with one acceptance estimate shared by all its sources (as before draft sources). Prints tokens/s relative to plain,
tokens per target step and the fallbacks each policy took; --out writes the JSON.

    python bench/bench_adaptive.py --per-category 1 --drafters "ngram;DIR@width=3,depth=1,nodes=3"
"""

from __future__ import annotations

import argparse
import json
import os
import time

HERE = os.path.dirname(os.path.abspath(__file__))


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--drafters", default="ngram,default",
                    help="drafter specs, comma-separated, or semicolon-separated when a spec's "
                    "options hold commas")
    ap.add_argument("--per-category", type=int, default=1)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--floor", type=float, default=0.3)
    ap.add_argument("--temperature", type=float, default=0.0,
                    help="sampling temperature (seed 0; outputs still match plain sampling: "
                         "acceptance draws are keyed by position)")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)

    import pyspec
    from pyspec.drafters import make_drafter
    from pyspec.engine import Engine, SamplingParams
    from pyspec.runner import ModelRunner
    from pyspec.train.evaluate import read_prompts

    prompts = read_prompts(os.path.join(HERE, "data", "mt_bench_questions.jsonl"),
                           per_category=args.per_category)
    base = pyspec.LLM(None, draft="none", dtype="float32", kv_cache_tokens=1024, progress=False)
    enc = [base.chat_prompt([{"role": "user", "content": p}]) for _, p in prompts]
    blocks = 8 + (max(len(e) for e in enc) + args.max_tokens + 64) // 16

    def engine(spec, one_estimate=False, **kw):
        runner = ModelRunner(base.model, num_blocks=blocks, block_size=16)
        drafter = make_drafter(spec, runner)
        if one_estimate:
            drafter.num_draft_sources = 1  # the engine then never names the drafting source
        return Engine(runner, drafter=drafter, max_num_seqs=1, **kw)

    engines = {"plain": engine("none")}
    for spec in args.drafters.split(";" if ";" in args.drafters else ","):
        adaptive = engines[f"{spec} | adaptive"] = engine(spec)
        if adaptive.drafters[adaptive.default_drafter].num_draft_sources > 1:
            engines[f"{spec} | adaptive, one estimate for all sources"] = engine(spec, True)
        engines[f"{spec} | adaptive + floor {args.floor}"] = engine(
            spec, min_acceptance_rate=args.floor)
        engines[f"{spec} | fixed"] = engine(spec, adaptive=False)
    for e in engines.values():  # warm-up outside the timings
        e.generate([enc[0][:16]], SamplingParams(max_tokens=4))
    params = SamplingParams(max_tokens=args.max_tokens, ignore_eos=True,
                            temperature=args.temperature, seed=0)
    tot = {n: dict(seconds=0.0, tokens=0, steps=0, identical=0, fallbacks={}, per_category={})
           for n in engines}
    for (category, _), ids in zip(prompts, enc):
        ref = None
        for name, e in engines.items():
            t0 = time.perf_counter()
            r = e.generate([ids], params)[0]
            t = tot[name]
            t["seconds"] += time.perf_counter() - t0
            t["tokens"] += len(r.token_ids)
            t["steps"] += r.stats.steps
            c = t["per_category"].setdefault(category, [0, 0])
            c[0] += len(r.token_ids)
            c[1] += r.stats.steps
            ref = r.token_ids if ref is None else ref
            t["identical"] += r.token_ids == ref
            for k, v in r.stats.fallbacks.items():
                t["fallbacks"][k] = t["fallbacks"].get(k, 0) + v
    plain = tot["plain"]["tokens"] / tot["plain"]["seconds"]
    rows = {}
    for name, t in tot.items():
        tps = t["tokens"] / t["seconds"]
        rows[name] = dict(tokens_per_second=round(tps, 2), vs_plain=round(tps / plain, 3),
                          tokens_per_target_step=round(t["tokens"] / t["steps"], 3),
                          identical_to_plain=f"{t['identical']}/{len(enc)}",
                          fallbacks=t["fallbacks"],
                          tokens_per_target_step_per_category={
                              c: round(n / k, 3) for c, (n, k) in t["per_category"].items()})
        print(f"{name:60s} {tps:6.1f} tok/s  {tps / plain:5.3f}x  "
              f"{t['tokens'] / t['steps']:.2f} tok/step  {t['identical']}/{len(enc)} identical  "
              f"fallbacks {t['fallbacks']}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(dict(config=vars(args), prompts=len(enc), results=rows), f, indent=1)


if __name__ == "__main__":
    main()
