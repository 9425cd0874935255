"""Speculative decoding on the embedded default model, every engine in one run.

MT-bench first turns (bench/data/mt_bench_questions.jsonl), chat template, greedy, batch 1,
exactly --max-tokens new tokens per prompt (EOS ignored everywhere so token counts match). Per
prompt, interleaved so machine-load drift hits every engine alike:

* pyspec plain (the engine with draft="none") and pyspec with each drafter (--drafters; adaptive
  speculation on, the defaults a user gets);
* HF transformers plain, HF assisted generation with the same independent draft model pyspec's
  draft-model path uses, HF prompt lookup (``prompt_lookup_num_tokens``);
* llama.cpp plain on the original 4-bit GGUF via llama-cpp-python, when installed.

End-to-end tokens/s (prefill included), acceptance length (1 + accepted / speculative steps) and
greedy agreement with pyspec plain, per engine and per MT-bench category; JSON + PNG.

The draft model (--draft-model, e.g. trained by ``pyspec train-draft --method draft-model``; default:
the target's first --draft-layers layers saved as a separate checkpoint with its own weights file and
KV) is the same for pyspec's draft-model path and for HF assisted generation.

    python bench/bench_spec.py --prompts 24 --out bench/results/spec.json
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
PROMPTS = os.path.join(HERE, "data", "mt_bench_questions.jsonl")


def add_engine_args(ap):
    """The arguments the one-process engine comparisons share (bench_packed.py, bench_fused.py):
    --prompts, --max-tokens and --drafters (see drafter_list)."""
    ap.add_argument("--prompts", type=int, default=8, help="MT-bench first turns (one per category "
                    "for 8)")
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--drafters", default="none,default",
                    help="drafter specs separated by commas, or by semicolons when a spec has a "
                         "comma ('none' = plain decoding; it is always run)")


def drafter_list(spec):
    """--drafters as a list, plain decoding ('none') first when it is not named."""
    drafters = [d for d in spec.split(";" if ";" in spec else ",") if d]
    if "none" not in drafters:
        drafters.insert(0, "none")
    return drafters


def timed_chat(llm, msg, sp, r):
    """``llm.chat(msg, sp)``, adding its seconds, tokens, target steps and steps that verified
    drafts to the tally ``r``."""
    t = time.perf_counter()
    out = llm.chat(msg, sp)
    r["seconds"] += time.perf_counter() - t
    r["tokens"] += len(out.token_ids)
    r["steps"] += out.stats.steps
    r["drafted_steps"] = r.get("drafted_steps", 0) + out.stats.drafts
    return out


def emit(doc, out=None):
    """Print a result document as JSON and, with ``out``, write it there too."""
    import json

    text = json.dumps(doc, indent=2)
    print(text)
    if out:
        with open(out, "w") as f:
            f.write(text + "\n")


def load_prompts(n):
    """``n`` prompts spread over the 8 categories (the file is grouped, 10 each)."""
    from pyspec.train.evaluate import read_prompts

    per = max(1, n // 8) if n < 80 else None
    return read_prompts(PROMPTS, limit=n, per_category=per)


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--prompts", type=int, default=24, help="MT-bench prompts (80 = all)")
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--drafters", default="default,ngram,layer-skip:6,draft-model",
                    help="drafter specs, each optionally NAME=SPEC, comma-separated, or "
                    "semicolon-separated when a spec's options hold commas "
                    "('default;h=ngram|DIR@width=3,depth=2,nodes=6')")
    ap.add_argument("--draft-layers", type=int, default=6)
    ap.add_argument("--draft-model", default=None,
                    help="draft-model folder (e.g. from train-draft --method draft-model); "
                         "default: the target's first --draft-layers layers")
    ap.add_argument("--no-hf", action="store_true")
    ap.add_argument("--no-llama-cpp", action="store_true")
    ap.add_argument("--out", default=os.path.join(HERE, "results", "spec.json"))
    args = ap.parse_args(argv)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import pyspec
    from pyspec.engine import Engine, SamplingParams
    from pyspec.runner import ModelRunner

    prompts = load_prompts(args.prompts)
    base = pyspec.LLM(None, draft="none", dtype=args.dtype, progress=False, kv_cache_tokens=1024)
    tmp = tempfile.mkdtemp(prefix="pyspec-bench-")
    if args.draft_model:
        draft_dir = args.draft_model
    else:
        from pyspec.models.loader import write_truncated_checkpoint

        draft_dir = write_truncated_checkpoint(base.model_path, os.path.join(tmp, "draft"),
                                               args.draft_layers)
    enc = [base.chat_prompt([{"role": "user", "content": p}]) for _, p in prompts]

    engines = {}

    def make(spec):
        runner = ModelRunner(base.model, num_blocks=64, block_size=16)
        return Engine(runner, drafter=spec, max_num_seqs=1)

    engines["pyspec plain"] = make("none")
    for d in args.drafters.split(";" if ";" in args.drafters else ","):
        name, _, spec = d.partition("=") if "=" in d else (d, "", d)
        engines[f"pyspec {name}"] = make(draft_dir if spec == "draft-model" else spec)

    def run_pyspec(eng, ids):
        t0 = time.perf_counter()
        r = eng.generate([ids], SamplingParams(max_tokens=args.max_tokens))[0]
        return r.token_ids, time.perf_counter() - t0, r.stats

    hf = hf_draft = None
    if not args.no_hf:
        import transformers

        dt = getattr(torch, args.dtype)
        hf = transformers.AutoModelForCausalLM.from_pretrained(base.model_path, dtype=dt).eval()
        hf_draft = transformers.AutoModelForCausalLM.from_pretrained(draft_dir, dtype=dt).eval()
        for m in (hf, hf_draft):
            m.generation_config.eos_token_id = None
            m.generation_config.pad_token_id = 0

    def run_hf(ids, **kw):
        x = torch.tensor([ids])
        t0 = time.perf_counter()
        with torch.no_grad():
            out = hf.generate(x, max_new_tokens=args.max_tokens, min_new_tokens=args.max_tokens,
                              do_sample=False, **kw)
        return out[0, len(ids):].tolist(), time.perf_counter() - t0, None

    lcpp = None
    if not args.no_llama_cpp:
        try:
            import llama_cpp
            from pyspec.models.default import default_gguf_path

            lcpp = llama_cpp.Llama(model_path=default_gguf_path(), n_ctx=2048,
                                   n_threads=torch.get_num_threads(), verbose=False)
        except Exception as e:  # noqa: BLE001 - optional comparison
            print(f"llama.cpp not available: {e}", file=sys.stderr)

    def run_lcpp(ids):
        lcpp.reset()
        toks = []
        t0 = time.perf_counter()
        for t in lcpp.generate(ids, top_k=1, temp=0.0, reset=True):
            toks.append(int(t))
            if len(toks) >= args.max_tokens:
                break
        return toks, time.perf_counter() - t0, None

    runners = {name: (lambda ids, e=e: run_pyspec(e, ids)) for name, e in engines.items()}
    if hf is not None:
        runners["HF plain"] = lambda ids: run_hf(ids)
        runners["HF assisted (same draft model)"] = lambda ids: run_hf(ids, assistant_model=hf_draft)
        runners["HF prompt lookup"] = lambda ids: run_hf(ids, prompt_lookup_num_tokens=10)
    if lcpp is not None:
        runners["llama.cpp plain (Q4_1 GGUF)"] = run_lcpp

    # Warm-up outside the timings.
    for name, fn in runners.items():
        fn(enc[0][:24])

    rows = {name: [] for name in runners}
    for (cat, _), ids in zip(prompts, enc):
        ref = None
        for name, fn in runners.items():
            toks, secs, st = fn(ids)
            if name == "pyspec plain":
                ref = toks
            row = dict(category=cat, tokens=len(toks), seconds=secs, tok_per_s=len(toks) / secs,
                       same_as_pyspec_plain=(toks == ref) if ref is not None else None)
            if st is not None:
                row.update(acceptance_length=st.acceptance_length, drafts=st.drafts,
                           draft_tokens=st.draft_tokens, accepted=st.accepted_tokens,
                           steps=st.steps, fallbacks=st.fallbacks, probes=st.probes)
            rows[name].append(row)
        print(cat, " ".join(f"{n}={rows[n][-1]['tok_per_s']:.1f}" for n in runners), flush=True)

    def summary(rs):
        tok = sum(r["tokens"] for r in rs)
        secs = sum(r["seconds"] for r in rs)
        out = dict(tok_per_s=tok / secs, prompts=len(rs),
                   identical_to_pyspec_plain=sum(bool(r["same_as_pyspec_plain"]) for r in rs))
        if "acceptance_length" in rs[0]:
            d = sum(r["drafts"] for r in rs)
            out["acceptance_length"] = 1 + sum(r["accepted"] for r in rs) / d if d else 1.0
            out["tokens_per_target_step"] = tok / sum(r["steps"] for r in rs)
        return out

    plain_rate = summary(rows["pyspec plain"])["tok_per_s"]
    report = dict(config=vars(args), torch_threads=torch.get_num_threads(), engines={})
    for name, rs in rows.items():
        s = summary(rs)
        s["speedup_vs_pyspec_plain"] = s["tok_per_s"] / plain_rate
        cats = {}
        for c in dict.fromkeys(r["category"] for r in rs):
            cats[c] = summary([r for r in rs if r["category"] == c])
        s["per_category"] = cats
        s["rows"] = rs
        report["engines"][name] = s
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(report, f, indent=1)
    print(f"\n{'engine':<34} {'tok/s':>7} {'vs plain':>8} {'AL':>5} {'same':>6}")
    for name, s in report["engines"].items():
        al = f"{s['acceptance_length']:.2f}" if "acceptance_length" in s else "-"
        print(f"{name:<34} {s['tok_per_s']:7.1f} {s['speedup_vs_pyspec_plain']:7.2f}x {al:>5} "
              f"{s['identical_to_pyspec_plain']:>3}/{s['prompts']}")
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        names = list(report["engines"])
        cats = list(report["engines"][names[0]]["per_category"])
        fig, ax = plt.subplots(figsize=(12, 5))
        w = 0.8 / len(names)
        for k, n in enumerate(names):
            vals = [report["engines"][n]["per_category"][c]["tok_per_s"] for c in cats]
            ax.bar([i + k * w for i in range(len(cats))], vals, w, label=n)
        ax.set_xticks([i + 0.4 - w / 2 for i in range(len(cats))])
        ax.set_xticklabels(cats)
        ax.set_ylabel("tokens/s (batch 1, greedy, CPU)")
        ax.set_title(f"MT-bench first turns, {args.max_tokens} new tokens, {args.dtype}")
        ax.legend(fontsize=7)
        fig.tight_layout()
        fig.savefig(os.path.splitext(args.out)[0] + ".png", dpi=110)
    except ImportError:
        pass


if __name__ == "__main__":
    main()
