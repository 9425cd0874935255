"""Does any draft-length policy make a drafter pay at batch 1? One run, the same prompts.

    python bench/bench_cost_policy.py [--prompts 8] [--max-tokens 128] [--drafter default]
                                      [--scales 1,1.6,2.5,50] [--out bench/results/cost-policy.json]

Loads the default model once for plain decoding and once per scale for ``--drafter``, and decodes
MT-bench first turns (chat template, greedy, batch 1, exactly ``--max-tokens`` new tokens, EOS
ignored), the engines' order rotating from prompt to prompt. For each scale the engine's cost model
runs as usual but hands the scheduler its measured verify cost times the scale: 1 is the engine as
shipped; larger scales make every draft token look dearer, so the scheduler drafts shorter trees,
falls back to plain decoding sooner and, at a large scale, drafts only on its probes. Reports
tokens/s (prefill included), against plain decoding, tokens per target step and whether each
output equals plain decoding's token for token. Prints one JSON document (and writes it with
``--out``).
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)


def main(argv=None):
    from bench_spec import emit, load_prompts, timed_chat

    ap = argparse.ArgumentParser()
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--drafter", default="default")
    ap.add_argument("--scales", default="1,1.6,2.5,50")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    scales = [float(x) for x in args.scales.split(",") if x]
    if not scales or any(not s > 0 for s in scales):
        raise SystemExit(f"--scales takes positive numbers; got {args.scales!r}")

    import pyspec
    import pyspec.engine as engine_mod

    torch.set_num_threads(2)
    shipped = engine_mod.Engine._update_cost_model

    def scaled(scale):
        def update(self):
            shipped(self)
            st = self.stats
            if st.verify_cost > 0:
                self.scheduler.set_cost_model(st.draft_cost, min(10.0, st.verify_cost * scale))
        return update

    t0 = time.perf_counter()
    llms = {"plain": pyspec.LLM(draft="none", progress=False)}
    for s in scales:
        llms[s] = pyspec.LLM(draft=args.drafter, progress=False)
    prompts = load_prompts(args.prompts)
    sp = pyspec.SamplingParams(max_tokens=args.max_tokens, temperature=0.0, ignore_eos=True)
    warm = pyspec.SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    keys = list(llms)
    res = {k: {"seconds": 0.0, "tokens": 0, "steps": 0, "identical": 0} for k in keys}
    try:
        for k in keys:
            engine_mod.Engine._update_cost_model = shipped if k == "plain" else scaled(k)
            llms[k].chat([{"role": "user", "content": "Hello"}], warm)
        for i, (_, text) in enumerate(prompts):
            msg = [{"role": "user", "content": text}]
            outs = {}
            for k in keys[i % len(keys):] + keys[:i % len(keys)]:
                engine_mod.Engine._update_cost_model = shipped if k == "plain" else scaled(k)
                outs[k] = timed_chat(llms[k], msg, sp, res[k]).token_ids
            for k, ids in outs.items():
                res[k]["identical"] += ids == outs["plain"]
    finally:
        engine_mod.Engine._update_cost_model = shipped
    base = res["plain"]["tokens"] / res["plain"]["seconds"]
    engines = {}
    for k, r in res.items():
        tps = r["tokens"] / r["seconds"]
        engines["plain" if k == "plain" else f"{args.drafter} verify cost x{k:g}"] = {
            "tokens_per_s": round(tps, 1), "vs_plain": round(tps / base, 3),
            "tokens_per_target_step": round(r["tokens"] / r["steps"], 3),
            "identical_to_plain": f"{r['identical']}/{len(prompts)}"}
    doc = {"config": {"prompts": len(prompts), "max_tokens": args.max_tokens,
                      "drafter": args.drafter, "scales": scales,
                      "threads": torch.get_num_threads(),
                      "packed": llms["plain"].model._packed is not None,
                      "wall_seconds": round(time.perf_counter() - t0, 1)},
           "engines": engines}
    emit(doc, args.out)


if __name__ == "__main__":
    main()
