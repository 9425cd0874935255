"""Record per-request acceptance on prompt sets and fit the acceptance predictor
(pyspec.predictor), judged on prompt kinds it never saw.

    python bench/train_predictor.py [--prompts bench/data/task_kinds.jsonl,bench/data/mt_bench_questions.jsonl]
                                    [--draft default] [--max-tokens 64] [--records FILE.jsonl]
                                    [--model-out predictor.json] [--out bench/results/predictor.json]

Per prompt (chat template, greedy, batch 1): the default model decodes it plainly and with
``--draft``, one after the other, and the request's acceptance length (tokens per speculative
step), tokens per target step and speedup are recorded with the prompt's features (with the
shipped corpus drafter's index, when the build has one). ``--records`` reuses (or writes) those
rows. The predictor is judged leave-one-kind-out: fitted on every other kind, it predicts the
held-out kind's requests; the report gives Spearman's correlation between predicted and realized
acceptance length over all held-out predictions, and per kind. The model fitted on every row is
written with ``--model-out``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
DEFAULT_PROMPTS = ",".join(os.path.join(HERE, "data", f) for f in
                           ("task_kinds.jsonl", "mt_bench_questions.jsonl"))


def corpus_index():
    """The shipped corpus drafter's index, or None."""
    from pyspec.drafters.folder import read_config
    from pyspec.drafters.suffix import load_corpus
    from pyspec.models.default import default_corpus_path

    path = default_corpus_path()
    if path is None:
        return None
    cfg = read_config(path)
    return load_corpus(path, cfg, cfg["vocab_size"])


def record(args):
    import torch

    import pyspec
    from pyspec.predictor import prompt_features
    from pyspec.train.evaluate import read_prompts

    torch.set_num_threads(2)
    rows = [(c, t) for f in args.prompts.split(",") if f for c, t in read_prompts(f)]
    plain = pyspec.LLM(draft="none", progress=False)
    spec = pyspec.LLM(draft=args.draft, progress=False)
    corpus = corpus_index()
    sp = pyspec.SamplingParams(max_tokens=args.max_tokens, temperature=0.0)
    for llm in (plain, spec):
        llm.chat([{"role": "user", "content": "Hello"}], pyspec.SamplingParams(max_tokens=8))
    out = []
    for i, (kind, text) in enumerate(rows):
        msg = [{"role": "user", "content": text}]
        ids = plain.chat_prompt(msg)
        times = {}
        for name, llm in ((("plain", plain), ("spec", spec)) if i % 2 else
                          (("spec", spec), ("plain", plain))):
            t = time.perf_counter()
            o = llm.chat(msg, sp)
            times[name] = (time.perf_counter() - t, o)
        o = times["spec"][1]
        out.append({"kind": kind, "prompt_tokens": len(ids), "tokens": len(o.token_ids),
                    "acceptance_length": o.stats.acceptance_length,
                    "tokens_per_step": len(o.token_ids) / max(1, o.stats.steps),
                    "speedup": times["plain"][0] / times["spec"][0],
                    "features": prompt_features(ids, corpus)})
        print(f"{i + 1}/{len(rows)} {kind}: acceptance {o.stats.acceptance_length:.2f}",
              file=sys.stderr, flush=True)
    return out


def main(argv=None):
    from bench_spec import emit

    ap = argparse.ArgumentParser()
    ap.add_argument("--prompts", default=DEFAULT_PROMPTS, help="JSONL files, comma-separated")
    ap.add_argument("--draft", default="default")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--records", default=None, help="JSONL of recorded rows: read if it exists, "
                    "else written")
    ap.add_argument("--ridge", type=float, default=1.0)
    ap.add_argument("--model-out", default=None)
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)

    from pyspec.predictor import FEATURES, AcceptancePredictor, spearman

    if args.records and os.path.isfile(args.records):
        with open(args.records, encoding="utf-8") as f:
            rows = [json.loads(line) for line in f if line.strip()]
    else:
        rows = record(args)
        if args.records:
            with open(args.records, "w", encoding="utf-8") as f:
                for r in rows:
                    f.write(json.dumps(r) + "\n")
    kinds = sorted({r["kind"] for r in rows})
    pred, real, per_kind = [], [], {}
    for k in kinds:
        train = [r for r in rows if r["kind"] != k]
        test = [r for r in rows if r["kind"] == k]
        m = AcceptancePredictor.fit([r["features"] for r in train],
                                    [r["acceptance_length"] for r in train], ridge=args.ridge)
        p = [m.predict_features(r["features"]) for r in test]
        y = [r["acceptance_length"] for r in test]
        pred += p
        real += y
        per_kind[k] = {"requests": len(test), "spearman": round(spearman(p, y), 3),
                       "mean_predicted": round(sum(p) / len(p), 3),
                       "mean_realized": round(sum(y) / len(y), 3)}
    overall = spearman(pred, real)
    # What the features alone say (each one's rank correlation with acceptance, all rows).
    single = {f: round(spearman([r["features"][i] for r in rows],
                                [r["acceptance_length"] for r in rows]), 3)
              for i, f in enumerate(FEATURES)}
    full = AcceptancePredictor.fit([r["features"] for r in rows],
                                   [r["acceptance_length"] for r in rows], ridge=args.ridge,
                                   manifest={"draft": args.draft, "requests": len(rows),
                                             "kinds": kinds, "max_tokens": args.max_tokens,
                                             "held_out_spearman": round(overall, 3)})
    if args.model_out:
        full.save(args.model_out)
    emit({"config": {"prompts": args.prompts, "draft": args.draft, "requests": len(rows),
                     "max_tokens": args.max_tokens, "ridge": args.ridge},
          "held_out_spearman": round(overall, 3), "per_kind": per_kind,
          "feature_spearman": single,
          "coefficients": dict(zip(FEATURES, [round(c, 4) for c in full.coef]))}, args.out)


if __name__ == "__main__":
    main()
