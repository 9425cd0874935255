"""End to end: the CPU decoder stack in one core call against the same layers op by op, one run.

    python bench/bench_fused.py [--prompts 8] [--max-tokens 128] [--drafters none,default]
                                [--packed-weights auto|off]
                                [--modes fused,op-by-op,fused-accept-op,fused-torch-threads]
                                [--out bench/results/fused.json]

Loads the default model once per drafter and decodes MT-bench first turns (chat template,
greedy, batch 1, exactly ``--max-tokens`` new tokens, EOS ignored) with each drafter twice per
prompt (the engines' order rotating from prompt to prompt): with the decoder stack in one call
(``_C.DecoderStack``, what LlamaForCausalLM runs for steps within the core kernel's rows) and op
by op (the model's ``fused_layers = False``), the engines interleaved per prompt so they share
the machine's state. The modes are per-model and per-engine attributes, set before each run:
``model.fused_layers`` (one-call stack or op by op), ``engine.greedy_from_logits`` (False in
fused-accept-op: greedy acceptance through the temperature-0 rows and the acceptance op) and
``engine.serial_host_steps`` (False in fused-torch-threads: a small step's host work keeps
torch's threads). Reports tokens/s (prefill included), tokens per target step, each engine
against op-by-op plain decoding and against plain decoding in the same mode, and whether each
output equals op-by-op plain decoding token for token (or, with ``--modes fused``, plain decoding
on the one-call path). Prints one JSON document (and writes it with ``--out``).
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
    from bench_spec import add_engine_args, drafter_list, emit, timed_chat

    ap = argparse.ArgumentParser()
    add_engine_args(ap)
    ap.add_argument("--packed-weights", default="auto", choices=["auto", "off"])
    ap.add_argument("--modes", default="fused,op-by-op",
                    help="which paths to run: fused (one core call), op-by-op, and/or "
                         "fused-accept-op (one core call, greedy acceptance through the "
                         "temperature-0 rows and the acceptance op instead of the core's greedy "
                         "walk from the logits), fused-torch-threads (one core call, torch's "
                         "threads outside the forward: the step's other torch ops run in "
                         "parallel)")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)

    import pyspec
    from bench_spec import load_prompts

    torch.set_num_threads(2)
    drafters = drafter_list(args.drafters)
    t0 = time.perf_counter()
    llms = {d: pyspec.LLM(draft=d, progress=False, packed_weights=args.packed_weights)
            for d in drafters}
    prompts = load_prompts(args.prompts)
    sp = pyspec.SamplingParams(max_tokens=args.max_tokens, temperature=0.0, ignore_eos=True)
    warm = pyspec.SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    modes = {m: m != "op-by-op" for m in args.modes.split(",") if m}
    known = ("fused", "op-by-op", "fused-accept-op", "fused-torch-threads")
    if not modes or any(m not in known for m in modes):
        raise SystemExit(f"--modes takes {', '.join(known)}; got "
                         f"{args.modes!r}")

    def use(mode, llm):
        llm.model.fused_layers = modes[mode]
        llm.engine.greedy_from_logits = mode != "fused-accept-op"
        llm.engine.serial_host_steps = mode != "fused-torch-threads"
    ref_mode = "op-by-op" if "op-by-op" in modes else "fused"
    for llm in llms.values():
        for mode in modes:
            use(mode, llm)
            llm.chat([{"role": "user", "content": "Hello"}], warm)
    keys = [(ref_mode, "none")] + [(m, d) for d in drafters for m in modes
                                   if (m, d) != (ref_mode, "none")]
    res = {k: {"seconds": 0.0, "tokens": 0, "steps": 0, "identical": 0} for k in keys}
    for i, (_, text) in enumerate(prompts):
        msg = [{"role": "user", "content": text}]
        # The engines' order rotates from prompt to prompt, so none always runs first.
        outs = {}
        for mode, d in keys[i % len(keys):] + keys[:i % len(keys)]:
            use(mode, llms[d])
            outs[mode, d] = timed_chat(llms[d], msg, sp, res[mode, d]).token_ids
        for key, ids in outs.items():
            res[key]["identical"] += ids == outs[keys[0]]
    base = res[ref_mode, "none"]["tokens"] / res[ref_mode, "none"]["seconds"]
    engines = {}
    for (mode, d), r in res.items():
        tps = r["tokens"] / r["seconds"]
        same_plain = res[mode, "none"]["tokens"] / res[mode, "none"]["seconds"]
        engines[f"{mode} {d}"] = {
            "layers": mode, "drafter": d, "tokens_per_s": round(tps, 1),
            f"vs_{ref_mode.replace('-', '_')}_plain": round(tps / base, 2),
            "vs_plain_same_mode": round(tps / same_plain, 2),
            "tokens_per_target_step": round(r["tokens"] / r["steps"], 3) if r["steps"] else None,
            "drafted_step_share": round(r.get("drafted_steps", 0) / r["steps"], 3) if r["steps"]
            else None,
            f"identical_to_{ref_mode.replace('-', '_')}_plain": f"{r['identical']}/{len(prompts)}"}
    model = llms["none"].model
    doc = {"config": {"prompts": len(prompts), "max_tokens": args.max_tokens,
                      "drafters": drafters, "threads": torch.get_num_threads(),
                      "packed_weights": args.packed_weights, "modes": list(modes),
                      "packed": model._packed is not None,
                      "linear_kernel": model.kernels.kernel("float32"),
                      "wall_seconds": round(time.perf_counter() - t0, 1)},
           "engines": engines}
    emit(doc, args.out)


if __name__ == "__main__":
    main()
