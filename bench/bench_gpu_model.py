"""The whole model on a device (random weights; no download): what a target step costs over a
draft tree of N nodes against a one-token decode step (speculation pays only where acceptance
length > verify step / plain step + draft cost), and the engine's plain and speculative decoding
speed on the same prompts in one run.

    python bench/bench_gpu_model.py --device cuda --out results.json      # ~1B-parameter Llama
    python bench/bench_gpu_model.py --device cpu --config tiny             # a smoke run

Random weights make acceptance meaningless (the prompts are repetitive so that prompt lookup has
something to find); the step times, their ratios and the engine's tokens/s are what this
measures.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from oracle_support import LAYOUTS as CONFIGS, layout_config  # noqa: E402


def repetitive_prompt(vocab: int, length: int = 48, seed: int = 1):
    """A prompt with repeated phrases, the kind of input prompt lookup is made for: an 8-token
    phrase and 8 random tokens, repeated, then the phrase."""
    import torch

    g = torch.Generator().manual_seed(seed)
    phrase = torch.randint(0, vocab, (8,), generator=g).tolist()
    noise = torch.randint(0, vocab, (length,), generator=g).tolist()
    return (phrase + noise[:8]) * (length // 16) + phrase


def _sync(device):
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed(device, fn, repeats: int = 1):
    """``(fn()'s last result, seconds per call)`` over ``repeats`` calls, the device synchronized
    before and after."""
    _sync(device)
    t0 = time.perf_counter()
    for _ in range(repeats):
        out = fn()
    _sync(device)
    return out, (time.perf_counter() - t0) / repeats


def _step_ranges(events):
    """The host's ``pyspec.step`` ranges of a profile's trace (not their copies on the GPU
    timeline, category ``gpu_user_annotation``)."""
    return [e for e in events if str(e.get("name", "")).startswith("pyspec.step ")
            and e.get("ph") == "X" and e.get("cat") == "user_annotation"]


def device_share(events):
    """What overlapping host and device work (asynchronous speculation) could buy at most, from a
    profile's trace events: the steps' mean wall time (their ``pyspec.step`` ranges), the share
    of it the device was busy (kernels, copies and sets on any stream, clipped to the steps and
    merged where they overlap), and the bound ``1 / max(busy, 1 - busy)`` on the speedup of a
    step whose host and device halves ran fully overlapped."""
    spans = [(float(e["ts"]), float(e["ts"]) + float(e["dur"])) for e in _step_ranges(events)]
    wall = sum(b - a for a, b in spans)
    if not wall:
        return None
    work = sorted((float(e["ts"]), float(e["ts"]) + float(e["dur"])) for e in events
                  if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset") and "dur" in e)
    busy = 0.0
    for a, b in spans:
        end = a  # merged: time already counted within this step
        for s, f in work:
            s, f = max(s, end), min(f, b)
            if f > s:
                busy += f - s
                end = f
    share = busy / wall
    return {"step_ms": round(wall / 1e3 / len(spans), 3), "device_busy": round(share, 3),
            "overlap_bound_speedup": round(1 / max(share, 1 - share), 3)}


def profile_check(eng, prompts, folder):
    """A 4-step profile window of ``eng`` (untimed): the trace's file, its step ranges, how many
    device kernels it holds (a CUDA trace has events of category "kernel") and the device's share
    of the steps' time (:func:`device_share`)."""
    from pyspec.engine import SamplingParams

    path = eng.profile(folder, steps=4)
    eng.generate(prompts, SamplingParams(max_tokens=8, ignore_eos=True))
    st = eng.stop_profile()
    out = {"path": path, "recorded": st["recorded"], "error": st["error"]}
    if st["error"] is None:
        with open(path) as f:
            events = json.load(f)["traceEvents"]
        out["step_ranges"] = len(_step_ranges(events))
        out["kernels"] = sum(e.get("cat") == "kernel" for e in events)
        out["device_share"] = device_share(events)
        with open(st["summary"]) as f:
            out["top"] = json.load(f)["top"][:5]
    return out


def verify_cost(model, args, backend, bs=16):
    """One request, a chain-shaped tree of N nodes after C tokens: a target step's time and its
    ratio to a one-token step, with the model's attention backend ``backend``."""
    import torch

    from pyspec import TokenTree
    from pyspec.runner import ModelRunner, SeqStep

    device, cfg, verify = model.device, model.cfg, []
    for ctx in (int(x) for x in args.contexts.split(",")):
        runner = ModelRunner(model, num_blocks=(ctx + 128) // bs + 2, block_size=bs)
        table = list(range(runner.kv.num_blocks))
        g = torch.Generator().manual_seed(ctx)
        prompt = torch.randint(0, cfg.vocab_size, (ctx,), generator=g).tolist()
        out = runner.step([SeqStep(prompt, 0, table, None, "none" if ctx > 1 else "last")])
        runner.commit_kv(out, 0, range(ctx), list(range(ctx)))
        base = None
        for n in (int(x) for x in args.nodes.split(",") if x):
            tree = TokenTree([-1] + list(range(n - 1))) if n > 1 else None
            step = SeqStep(prompt[:n], ctx, table, tree, "all" if n > 1 else "last")
            for _ in range(3):
                runner.step([step])
            ms = timed(device, lambda r=runner, s=step: r.step([s]), args.repeats)[1] * 1000
            base = ms if n == 1 else base
            row = {"attention": backend, "context": ctx, "nodes": n, "step_ms": round(ms, 3),
                   "vs_plain": round(ms / base, 3) if base else None}
            verify.append(row)
            print(json.dumps(row), flush=True)
        del runner
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return verify


def kernel_seconds(fn, steps: int = 5) -> float:
    """Seconds of device kernels per call of ``fn`` (torch.profiler's CUDA activity: the sum of
    every kernel's duration, gaps between them not counted)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            fn()
    us = sum(e.device_time_total for e in prof.key_averages()
             if e.device_type.name == "CUDA" and e.device_time_total > 0
             and not e.key.startswith("Memcpy") and not e.key.startswith("Memset"))
    return us / 1e6 / steps


def graph_cost(model, args, bs=16):
    """Steps of ``batch`` requests (a decode token or a 16-node tree each) after 512 tokens:
    eager with the Triton kernel against CUDA-graphed, and the graphed step against the sum of
    its kernels' times (the host's share of a step is what graphs remove)."""
    import torch

    from pyspec import TokenTree
    from pyspec.runner import ModelRunner, SeqStep

    model.set_attention_backend("triton")
    cfg, ctx, rows = model.cfg, 512, []
    for batch in (int(x) for x in args.graph_batch.split(",") if x):
        for n in (1, 16):
            per = (ctx + n) // bs + 2
            runner = ModelRunner(model, num_blocks=batch * per, block_size=bs)
            g = torch.Generator().manual_seed(batch)
            tables = [list(range(i * per, (i + 1) * per)) for i in range(batch)]
            tree = TokenTree([-1] + list(range(n - 1))) if n > 1 else None
            steps = [SeqStep(torch.randint(0, cfg.vocab_size, (n,), generator=g).tolist(), ctx,
                             t, tree, "all" if n > 1 else "last") for t in tables]
            row = {"batch": batch, "nodes": n, "context": ctx}
            for mode in ("eager", "graphs"):
                if mode == "graphs":
                    runner.enable_cuda_graphs(max_batch=max(batch, 1), max_rows=16)
                for _ in range(3):
                    runner.step(steps)
                sec = timed(model.device, lambda r=runner: r.step(steps), args.repeats)[1]
                row[f"{mode}_ms"] = round(sec * 1e3, 3)
                row[f"{mode}_kernels_ms"] = round(
                    kernel_seconds(lambda r=runner: r.step(steps)) * 1e3, 3)
            row["graphs_speedup"] = round(row["eager_ms"] / row["graphs_ms"], 3)
            row["graphs_vs_kernels"] = round(row["graphs_ms"] / row["graphs_kernels_ms"], 3)
            rows.append(row)
            print(json.dumps(row), flush=True)
    model.set_attention_backend("native")
    return rows


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--config", default="1b", choices=sorted(CONFIGS))
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--contexts", default="512,2048")
    ap.add_argument("--nodes", default="1,4,8,16,32,64")
    ap.add_argument("--repeats", type=int, default=10)
    ap.add_argument("--batch", default="1,8", help="engine batch sizes")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--profile-dir", default=None,
                    help="also record a kernel-level profile (Engine.profile) of 4 speculative "
                         "steps at the first batch size, after its timed run, into this folder")
    ap.add_argument("--attention-backends", default="native,triton",
                    help="tree attention kernels the verify cost is measured with (triton: where "
                         "the package is present)")
    ap.add_argument("--graph-batch", default="1,8",
                    help="batch sizes of the eager-vs-CUDA-graph step timings ('' to skip; "
                         "needs triton)")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)

    import torch

    from pyspec.engine import Engine, SamplingParams
    from pyspec.models.llama import LlamaForCausalLM, resolve_device
    from pyspec.models.loader import resolve_dtype
    from pyspec.runner import ModelRunner

    device = resolve_device(args.device)
    cfg = layout_config(args.config)
    t0 = time.perf_counter()
    model = LlamaForCausalLM.random(cfg, seed=0, dtype=resolve_dtype(args.dtype)).to(device)
    params = sum(p.numel() for p in [model.embed, model.lm_head, model.norm]) + sum(
        v.numel() for layer in model.layers for v in layer.values() if v is not None)
    info = {"device": str(device), "config": args.config, "dtype": args.dtype,
            "parameters": params, "init_s": round(time.perf_counter() - t0, 1)}
    if device.type == "cuda":
        info["gpu"] = torch.cuda.get_device_name(device)
    info["torch"] = torch.__version__
    print(json.dumps(info), flush=True)

    # ---- verify cost: one request, a chain-shaped tree of N nodes after C tokens ----------------
    verify = []
    bs = 16
    backends = [b for b in args.attention_backends.split(",") if b]
    for backend in backends:
        try:
            model.set_attention_backend(backend)
        except ValueError as e:
            verify.append({"attention": backend, "error": str(e)})
            print(json.dumps(verify[-1]), flush=True)
            continue
        verify += verify_cost(model, args, backend, bs)
    model.set_attention_backend("native")

    # ---- CUDA graphs: eager vs graphed steps, and graphed steps vs their kernels' time --------
    graphs = []
    if args.graph_batch and device.type == "cuda":
        try:
            graphs = graph_cost(model, args, bs)
        except ValueError as e:  # no triton
            graphs = [{"error": str(e)}]
            print(json.dumps(graphs[-1]), flush=True)

    # ---- engine: plain vs prompt-lookup speculation, same prompts, one run -----------------------
    engine = []
    for b in (int(x) for x in args.batch.split(",") if x):
        prompts = [repetitive_prompt(cfg.vocab_size, length=96, seed=s) for s in range(b)]
        sp = SamplingParams(max_tokens=args.max_tokens, ignore_eos=True)
        row = {"batch": b, "max_tokens": args.max_tokens}
        outs = {}
        for name, drafter in (("plain", None), ("ngram", "ngram")):
            runner = ModelRunner(model, num_blocks=b * (96 + args.max_tokens + 64) // bs + 8,
                                 block_size=bs)
            eng = Engine(runner, drafter=drafter, max_num_seqs=max(b, 1),
                         max_num_batched_tokens=4096)
            eng.generate(prompts[:1], SamplingParams(max_tokens=4, ignore_eos=True))  # warm-up
            res, s = timed(device, lambda e=eng: e.generate(prompts, sp))
            toks = sum(len(r.token_ids) for r in res)
            outs[name] = [r.token_ids for r in res]
            row[f"{name}_tok_s"] = round(toks / s, 1)
            if drafter:
                row[f"{name}_acceptance_length"] = round(
                    sum(r.stats.acceptance_length for r in res) / len(res), 3)
            if drafter and args.profile_dir and not engine:
                row["profile"] = profile_check(eng, prompts, args.profile_dir)
            del eng, runner
        row["speedup"] = round(row["ngram_tok_s"] / row["plain_tok_s"], 3)
        row["identical"] = sum(a == p for a, p in zip(outs["ngram"], outs["plain"]))
        engine.append(row)
        print(json.dumps(row), flush=True)

    result = {"info": info, "verify": verify, "graphs": graphs, "engine": engine}
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)
    return result


if __name__ == "__main__":
    main()
