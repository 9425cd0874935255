"""Plain greedy decode speed on the embedded default model: pyspec vs HF transformers, same run.

MT-bench first turns (../shared/data/mt_bench_questions.jsonl or --prompts-file), chat template,
batch 1, exactly --max-tokens new tokens per prompt (EOS ignored on both sides so the token counts
match), for each dtype. Also runs pyspec with prompt-lookup speculation on the same prompts.
pyspec decodes each prompt alone through an engine (``pyspec.engine.Engine``, no prefix cache):
``drafter="none"`` for plain decoding, ``drafter="ngram"`` with ``adaptive=False`` (draft chains
of up to --gamma tokens, starting at --gamma; without the cost model the scheduler lengthens a
chain by one after a step that accepted all of it and shortens it by one after one that accepted
less than half). ``acceptance_length`` is tokens per target step.
Reports end-to-end tokens/s (prefill included) per engine and the ratios, checks that pyspec's greedy
tokens equal transformers' (fp32), and writes JSON (+ a PNG when matplotlib is installed).

    python bench/bench_decode.py --prompts 10 --out bench/results/decode.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
DEFAULT_PROMPTS = os.path.join(HERE, "..", "..", "shared", "data", "mt_bench_questions.jsonl")


def load_prompts(path, n):
    rows = [json.loads(line) for line in open(path, encoding="utf-8") if line.strip()]
    # Spread the subset over the categories (the file is grouped by category, 10 each).
    step = max(1, len(rows) // n) if n < len(rows) else 1
    rows = rows[::step][:n]
    return [(r.get("category", "?"), r["turns"][0]) for r in rows]


class Run:
    """One pyspec decode: its tokens, seconds (prefill included), tokens per target step and the
    target logits row each token was chosen from."""

    def __init__(self, tokens, seconds, acceptance_length, logits):
        self.tokens, self.seconds, self.acceptance_length = tokens, seconds, acceptance_length
        self.logits = logits

    def top2_gap(self, j):
        """The target's top-1 minus top-2 logit where token ``j`` was chosen."""
        top2 = self.logits[j].topk(2).values
        return float(top2[0] - top2[1])


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--prompts", type=int, default=10, help="number of MT-bench prompts (80 = all)")
    ap.add_argument("--prompts-file", default=DEFAULT_PROMPTS)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--dtypes", default="float32,bfloat16")
    ap.add_argument("--gamma", type=int, default=5)
    ap.add_argument("--out", default=os.path.join(HERE, "results", "decode.json"))
    ap.add_argument("--no-hf", action="store_true")
    args = ap.parse_args(argv)

    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import pyspec
    from pyspec.engine import Engine
    from pyspec.runner import ModelRunner

    prompts = load_prompts(args.prompts_file, args.prompts)
    results = dict(config=vars(args), torch_threads=torch.get_num_threads(), runs={})
    for dtype in args.dtypes.split(","):
        # The LLM's own engine stays unused (a small pool); each engine below has its own.
        llm = pyspec.LLM(None, draft="none", dtype=dtype, progress=False, kv_cache_tokens=256)
        enc = [llm.chat_prompt([{"role": "user", "content": p}]) for _, p in prompts]
        bs = 16
        num_blocks = (max(len(ids) for ids in enc) + args.max_tokens + args.gamma + bs) // bs + 2

        def engine(**kw):
            return Engine(ModelRunner(llm.model, num_blocks, bs), adaptive=False,
                          enable_prefix_cache=False, max_num_seqs=1, **kw)

        engines = {False: engine(drafter="none"),
                   True: engine(drafter="ngram", gamma=args.gamma,
                                initial_draft_tokens=args.gamma)}
        hf = None
        if not args.no_hf:
            import transformers

            hf = transformers.AutoModelForCausalLM.from_pretrained(
                llm.model_path, dtype=getattr(torch, dtype)).eval()
            # Neither side stops at EOS (pyspec gets no eos ids): both generate exactly
            # --max-tokens, and the outputs stay comparable token for token.
            hf.generation_config.eos_token_id = None
        row = dict(pyspec_plain=[], pyspec_ngram=[], hf=[], acceptance_length=[], match_hf=0)

        def ours(ids, draft):
            """One prompt alone through the plain or the n-gram engine: exactly --max-tokens
            tokens (no stop tokens), with the target logits each token was chosen from."""
            eng = engines[draft]
            t0 = time.perf_counter()
            rid = eng.add_request(ids, {"max_tokens": args.max_tokens, "stop_token_ids": []})
            eng.record_logits(rid)
            while eng.has_unfinished():
                eng.step()
            seconds = time.perf_counter() - t0
            logits = eng.recorded_logits(rid)
            res = eng.result(rid, pop=True)
            return Run(res.token_ids, seconds, len(res.token_ids) / max(res.stats.steps, 1),
                       logits)

        # Warm-up outside the timings, each engine once.
        ours(enc[0][:16], False)
        ours(enc[0][:16], True)
        if hf is not None:
            with torch.no_grad():
                hf.generate(torch.tensor([enc[0][:16]]), max_new_tokens=4, do_sample=False)
        for (cat, _), ids in zip(prompts, enc):
            # Interleave the engines per prompt so drift in machine load hits all of them.
            r = ours(ids, False)
            row["pyspec_plain"].append(len(r.tokens) / r.seconds)
            s = ours(ids, True)
            row["pyspec_ngram"].append(len(s.tokens) / s.seconds)
            row["acceptance_length"].append(s.acceptance_length)
            if s.tokens != r.tokens:
                j = next(i for i, (a, b) in enumerate(zip(s.tokens, r.tokens)) if a != b)
                # Lossless means a divergence may only happen at a near-tie of the top two logits;
                # record how near it was (plain run's gap at the first differing token).
                row.setdefault("spec_mismatch", []).append(
                    dict(category=cat, position=j, plain_top2_gap=r.top2_gap(j),
                         spec_top2_gap=s.top2_gap(j)))
            if hf is not None:
                t0 = time.perf_counter()
                with torch.no_grad():
                    out = hf.generate(torch.tensor([ids]), max_new_tokens=args.max_tokens,
                                      do_sample=False, pad_token_id=0)
                dt = time.perf_counter() - t0
                new = out[0, len(ids):].tolist()
                row["hf"].append(len(new) / dt)
                row["match_hf"] += int(new == r.tokens)
            print(f"{dtype} {cat:10s} plain {row['pyspec_plain'][-1]:6.1f} ngram "
                  f"{row['pyspec_ngram'][-1]:6.1f} hf {row['hf'][-1] if row['hf'] else 0:6.1f} tok/s "
                  f"AL {s.acceptance_length:.2f}", file=sys.stderr)
        summ = {k: statistics.mean(v) for k, v in row.items() if isinstance(v, list) and v and
                all(isinstance(x, float) for x in v)}
        summ["n_prompts"] = len(prompts)
        summ["match_hf"] = row["match_hf"]
        summ["spec_identical_to_plain"] = len(prompts) - len(row.get("spec_mismatch", []))
        summ["spec_first_divergences"] = row.get("spec_mismatch", [])
        if row["hf"]:
            summ["plain_vs_hf"] = summ["pyspec_plain"] / summ["hf"]
            summ["ngram_vs_hf"] = summ["pyspec_ngram"] / summ["hf"]
        summ["ngram_vs_plain"] = summ["pyspec_ngram"] / summ["pyspec_plain"]
        results["runs"][dtype] = dict(summary=summ, per_prompt=row)
        print(json.dumps({dtype: summ}, indent=1))
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(results, f, indent=1)
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(6, 3.5))
        names = ["hf", "pyspec_plain", "pyspec_ngram"]
        dts = list(results["runs"])
        w = 0.8 / len(names)
        for i, n in enumerate(names):
            vals = [results["runs"][d]["summary"].get(n, 0) for d in dts]
            ax.bar([j + i * w for j in range(len(dts))], vals, w, label=n)
        ax.set_xticks([j + w for j in range(len(dts))], dts)
        ax.set_ylabel("tokens/s (batch 1)")
        ax.set_title(f"SmolLM2-135M greedy, {len(prompts)} MT-bench prompts x {args.max_tokens} tok")
        ax.legend()
        fig.tight_layout()
        fig.savefig(os.path.splitext(args.out)[0] + ".png", dpi=100)
    except ImportError:
        pass


if __name__ == "__main__":
    main()
