"""When speculation pays on this machine for bigger models: speedup against draft acceptance and
draft shape, on random-weight models of real layouts (about 1B and 3B parameters), with the
weights held as 8-bit codes (float32 values on the Q8_0 grid, as a converted GGUF has them) or as
bfloat16.

The drafter is the oracle of ``oracle_support.py``: each prompt's true greedy continuation (from
the plain pass, which is also the baseline), every token replaced by a wrong one with probability
``1 - alpha``. Speculation runs at a fixed shape (adaptive speculation off and the draft length
pinned, so what is measured is the shape, not the controller): chains of 2, 4 and 8, and a 16-node tree (a 4-deep chain with 3
random siblings per level). Plain and speculative decoding of the same prompts run side by side in
one process, greedy, at each batch size; the output is checked against plain (identical unless a
random model's near-tie falls differently, which the run counts). On a GPU (``--device cuda``,
bf16) the same script measures the GPU issue's oracle goals on the 1b and 8b layouts.

    python bench/bench_oracle_scaling.py [--layouts 1b,3b] [--weights q8,bf16]
        [--alphas 0.5,0.7,0.8,0.9] [--shapes chain2,chain4,chain8,tree16] [--batch 1]
        [--prompts 2] [--max-tokens 32] [--device cpu]
        [--out bench/results/oracle-scaling.json] [--chart docs/images/oracle-scaling-cpu.svg]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

from oracle_support import LAYOUTS, WEIGHTS, chain_tokens, make_oracle, random_model, shape_nodes  # noqa: E402


def _list(s: str, kind=str):
    return [kind(x) for x in s.split(",") if x.strip()]


def cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def fixed_shape(depth: int) -> dict:
    """Engine settings that hold every request at ``depth`` draft levels: no adaptive speculation
    and no draft-length adaptation (a rejection would otherwise shorten the next draft)."""
    return dict(gamma=depth, adaptive=False, initial_draft_tokens=depth, adapt_draft_length=False)


def run_layout(layout: str, weights: str, alphas, shapes, prompts: int, max_tokens: int,
               batches=(1,), device: str = "cpu"):
    """One model: for each batch size, plain decoding, every (shape, alpha), plain again."""
    import torch

    from pyspec.engine import Engine, SamplingParams
    from pyspec.runner import ModelRunner

    t0 = time.perf_counter()
    model = random_model(layout, weights, device=device)
    vocab = model.cfg.vocab_size
    row = {"layout": layout, "weights": weights, "device": str(model.device),
           "build_s": round(time.perf_counter() - t0, 1), "batches": []}
    if model.device.type == "cuda":
        row["gpu"] = torch.cuda.get_device_name(model.device)
    print(json.dumps(row), flush=True)
    sp = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    for b in batches:
        g = torch.Generator().manual_seed(7)
        ps = [torch.randint(0, vocab, (64,), generator=g).tolist() for _ in range(max(prompts, b))]
        blocks = 8 + len(ps) * (64 + max_tokens + 80) // 16

        def engine(drafter=None, depth=0):
            runner = ModelRunner(model, num_blocks=blocks, block_size=16)
            if drafter is None:
                return Engine(runner, drafter="none", max_num_seqs=b)
            return Engine(runner, drafter=drafter, max_num_seqs=b, **fixed_shape(depth))

        def timed(eng):
            eng.generate(ps[:1], SamplingParams(max_tokens=4, ignore_eos=True))  # warm-up
            if model.device.type == "cuda":
                torch.cuda.synchronize(model.device)
            t = time.perf_counter()
            res = eng.generate(ps, sp)
            return res, time.perf_counter() - t

        plain, plain_s = timed(engine())
        truths = [p + list(r.token_ids) for p, r in zip(ps, plain)]
        tokens = sum(len(r.token_ids) for r in plain)
        runs = []
        for shape in shapes:
            nodes, depth = shape_nodes(shape)
            for a in alphas:
                d = make_oracle(truths, a, shape)
                d.vocab = vocab
                res, s = timed(engine(d, depth))
                steps = sum(r.stats.steps for r in res)
                same = sum(list(r.token_ids) == list(p.token_ids) for r, p in zip(res, plain))
                run = {"batch": b, "shape": shape, "nodes": nodes, "alpha": a,
                       "tokens_per_step": round(tokens / max(steps, 1), 3),
                       "expected_tokens_per_step": round(chain_tokens(a, depth), 3),
                       "seconds": s, "identical_to_plain": f"{same}/{len(res)}"}
                runs.append(run)
                print(json.dumps(run), flush=True)
        # Plain again after the speculative runs: the baseline is the mean of both, and their
        # ratio (the machine's drift over the run) is reported beside it.
        _, again = timed(engine())
        base = (plain_s + again) / 2
        for run in runs:
            run["speedup"] = round(base / run.pop("seconds"), 3)
        entry = {"batch": b, "plain_tok_s": round(tokens / base, 2),
                 "plain_drift": round(again / plain_s, 3), "runs": runs}
        row["batches"].append(entry)
        print(json.dumps({k: v for k, v in entry.items() if k != "runs"}), flush=True)
    return row  # (the model is freed with this frame, before the next layout is built)


def chart(result, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = [(row, e) for row in result["rows"] for e in row["batches"]]
    fig, axes = plt.subplots(1, len(panels), figsize=(4.2 * len(panels), 3.6), sharey=True,
                             squeeze=False)
    for ax, (row, e) in zip(axes[0], panels):
        shapes = sorted({r["shape"] for r in e["runs"]}, key=lambda s: shape_nodes(s))
        for shape in shapes:
            rs = sorted((r for r in e["runs"] if r["shape"] == shape), key=lambda r: r["alpha"])
            ax.plot([r["alpha"] for r in rs], [r["speedup"] for r in rs], "o-", label=shape)
        ax.axhline(1.0, color="grey", lw=0.8, ls="--")
        ax.set_title(f"{row['layout']} {row['weights']}, batch {e['batch']} "
                     f"(plain {e['plain_tok_s']} tok/s)", fontsize=9)
        ax.set_xlabel("per-token acceptance alpha")
        ax.grid(alpha=0.3)
    axes[0][0].set_ylabel("speedup over plain decoding")
    axes[0][0].legend(fontsize=8)
    fig.suptitle(f"Oracle drafter, greedy: {result['machine']}", fontsize=9)
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.savefig(path)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layouts", default="1b,3b")
    ap.add_argument("--weights", default="q8,bf16")
    ap.add_argument("--alphas", default="0.5,0.7,0.8,0.9")
    ap.add_argument("--shapes", default="chain2,chain4,chain8,tree16")
    ap.add_argument("--prompts", type=int, default=2)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--batch", default="1", help="batch sizes (each runs max(--prompts, B) "
                    "prompts at once)")
    ap.add_argument("--device", default="cpu", help="cpu, or cuda (bf16 weights there)")
    ap.add_argument("--out", default=os.path.join(HERE, "results", "oracle-scaling.json"))
    ap.add_argument("--chart", default=None, help="an SVG/PNG chart of speedup against alpha")
    a = ap.parse_args(argv)
    layouts, weights = _list(a.layouts), _list(a.weights)
    alphas, shapes = _list(a.alphas, float), _list(a.shapes)
    for x in layouts:
        if x not in LAYOUTS:
            ap.error(f"--layouts: {x!r} is not one of {', '.join(LAYOUTS)}")
    for x in weights:
        if x not in WEIGHTS:
            ap.error(f"--weights: {x!r} is not one of {', '.join(WEIGHTS)}")
    if not alphas or any(not 0.0 <= x <= 1.0 for x in alphas):
        ap.error("--alphas: numbers in [0, 1]")
    for x in shapes:
        try:
            shape_nodes(x)
        except ValueError as e:
            ap.error(f"--shapes: {e}")
    if a.prompts < 1 or a.max_tokens < 2:
        ap.error("--prompts must be >= 1 and --max-tokens >= 2")
    batches = _list(a.batch, int)
    if not batches or min(batches) < 1:
        ap.error("--batch: integers >= 1")

    import torch

    machine = f"{cpu_name()}, {torch.get_num_threads()} threads"
    if a.device != "cpu" and torch.cuda.is_available():
        machine = torch.cuda.get_device_name()
    result = {"machine": machine, "prompts": a.prompts, "max_tokens": a.max_tokens, "rows": []}
    for layout in layouts:
        for w in weights:
            result["rows"].append(run_layout(layout, w, alphas, shapes, a.prompts, a.max_tokens,
                                             batches, a.device))
            with open(a.out, "w") as f:  # what ran so far, should a later layout not fit
                json.dump(result, f, indent=1)
    if a.chart:
        chart(result, a.chart)
    return result


if __name__ == "__main__":
    main()
