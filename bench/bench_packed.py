"""End to end: the default model on packed exact weights against its float32 weights, one run.

    python bench/bench_packed.py [--prompts 8] [--max-tokens 128] [--drafters none,default]
                                 [--isa auto|avx2|avx512] [--weights packed,float32]
                                 [--prefill-tokens 0] [--out bench/results/packed.json]

Loads the default model twice in one process, with ``packed_weights="auto"`` (its Q4_1 layers
and Q8_0 lm_head also held as codes, see ``pyspec.linear.pack_exact``) and ``"off"`` (float32
matrices only), and decodes MT-bench first turns (chat template, greedy, batch 1, exactly
``--max-tokens`` new tokens, EOS ignored) with each drafter on both, the four engines
interleaved per prompt so they share the machine's state. Reports tokens/s (prefill included),
tokens per target step, each engine against plain decoding on float32 weights and against plain
decoding on the same weights, and whether each output equals plain decoding on float32 weights
token for token. ``--isa`` picks every loaded model's dense-layer kernels (``LLM(...,
kernels=isa)``, a property of each model; ``avx2``: what a CPU without AVX-512 runs).
``--weights packed,codes,float32`` adds the model loaded with ``packed_weights="codes"`` (the
layers' float32 copies freed); each engine reports the weight bytes its model holds.
``--prefill-tokens N`` also times, per weights, a prefill of an N-token prompt (from the prompts
joined, another start each repetition so nothing comes from the prefix cache; ``max_tokens=1``,
median of 5, the weights alternating). Prints one JSON document (and
writes it with ``--out``).
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)


def held_bytes(model) -> int:
    """Bytes of the weights a model holds: its tensors (as the server's memory gauge counts them)
    and its packed codes."""
    from pyspec.serve.metrics import model_tensors as _model_tensors

    return sum(t.numel() * t.element_size() for t in _model_tensors(model)) + model.packed_bytes


def main(argv=None):
    from bench_spec import add_engine_args, drafter_list, emit, timed_chat

    ap = argparse.ArgumentParser()
    add_engine_args(ap)
    ap.add_argument("--isa", default="auto", choices=["auto", "avx2", "avx512"])
    ap.add_argument("--weights", default="packed,float32",
                    help="comma-separated: packed (packed_weights='auto'), codes, float32 ('off')")
    ap.add_argument("--prefill-tokens", type=int, default=0)
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)

    import pyspec
    from bench_spec import load_prompts

    torch.set_num_threads(2)
    drafters = drafter_list(args.drafters)
    setting = {"packed": "auto", "codes": "codes", "float32": "off"}
    kinds = [w for w in args.weights.split(",") if w]
    if "float32" not in kinds or "packed" not in kinds or any(w not in setting for w in kinds):
        raise SystemExit(f"--weights takes packed, codes and float32 (packed and float32 "
                         f"required); got {args.weights!r}")
    llms = {}
    t0 = time.perf_counter()
    for weights in kinds:
        for d in drafters:
            t = time.perf_counter()
            # The kernels are given at load: whether the model packs depends on them.
            llms[weights, d] = pyspec.LLM(draft=d, progress=False,
                                         packed_weights=setting[weights], kernels=args.isa)
            llms[weights, d].load_seconds_measured = time.perf_counter() - t
    packed_model = llms["packed", "none"].model
    if packed_model._packed is None:
        raise SystemExit("the default model did not pack here (packed_weights needs the AVX2 or "
                         "AVX-512 float32 kernel); nothing to compare")
    prompts = load_prompts(args.prompts)
    sp = pyspec.SamplingParams(max_tokens=args.max_tokens, temperature=0.0, ignore_eos=True)
    warm = pyspec.SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    for llm in llms.values():
        llm.chat([{"role": "user", "content": "Hello"}], warm)
    prefill_ms = {}
    if args.prefill_tokens > 0:
        tok = llms["float32", "none"].tokenizer
        ids = tok.encode(" ".join(text for _, text in load_prompts(80)))
        while len(ids) < args.prefill_tokens + 5:
            ids = ids + ids
        one = pyspec.SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
        times = {w: [] for w in kinds}
        for rep in range(5):
            # Another first token each time: nothing comes from the prefix cache.
            prompt = ids[rep:rep + args.prefill_tokens]
            for w in kinds:
                t = time.perf_counter()
                llms[w, "none"].generate([prompt], one)
                times[w].append(time.perf_counter() - t)
        prefill_ms = {w: round(1e3 * sorted(v)[len(v) // 2], 1) for w, v in times.items()}
    res = {k: {"seconds": 0.0, "tokens": 0, "steps": 0, "identical": 0} for k in llms}
    for _, text in prompts:
        msg = [{"role": "user", "content": text}]
        ref = None
        for key in [("float32", "none")] + [k for k in llms if k != ("float32", "none")]:
            out = timed_chat(llms[key], msg, sp, res[key])
            r = res[key]
            if ref is None:
                ref = out.token_ids
            r["identical"] += out.token_ids == ref
    base = res["float32", "none"]["tokens"] / res["float32", "none"]["seconds"]
    engines = {}
    for (weights, d), r in res.items():
        tps = r["tokens"] / r["seconds"]
        same_plain = res[weights, "none"]["tokens"] / res[weights, "none"]["seconds"]
        engines[f"{weights} {d}"] = {
            "weights": weights, "drafter": d, "tokens_per_s": round(tps, 1),
            "vs_float32_plain": round(tps / base, 2),
            "vs_plain_same_weights": round(tps / same_plain, 2),
            "tokens_per_target_step": round(r["tokens"] / r["steps"], 3) if r["steps"] else None,
            "identical_to_float32_plain": f"{r['identical']}/{len(prompts)}",
            "load_seconds": round(llms[weights, d].load_seconds_measured, 2),
            "target_weight_mb": round(held_bytes(llms[weights, d].model) / 1e6, 1)}
        if weights in prefill_ms and d == "none":
            engines[f"{weights} {d}"][f"prefill_{args.prefill_tokens}_ms"] = prefill_ms[weights]
    doc = {"config": {"prompts": len(prompts), "max_tokens": args.max_tokens,
                      "drafters": drafters, "threads": torch.get_num_threads(),
                      "linear_kernel": packed_model.kernels.kernel("float32"),
                      "packed_max_rows": packed_model.kernels.packed_max_rows,
                      "packed_weight_bytes": packed_model.packed_bytes,
                      "float32_weight_bytes": sum(
                          p.dense.numel() * 4 for lp in packed_model._packed
                          for p in lp.values()) + packed_model.lm_head.numel() * 4,
                      "wall_seconds": round(time.perf_counter() - t0, 1)},
           "engines": engines}
    emit(doc, args.out)


if __name__ == "__main__":
    main()
