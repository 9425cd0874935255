"""Speculation per task kind: every drafter against plain decoding, kind by kind, in one run.

    python bench/bench_kinds.py [--prompts bench/data/task_kinds.jsonl] [--per-kind 4]
                                [--drafters "none;default;ngram;lookahead"] [--max-tokens 128]
                                [--temperature 0] [--long 0] [--ignore-eos]
                                [--predictor FILE [--predictor-draft default]
                                 [--predictor-min-acceptance 1.2]]
                                [--out bench/results/kinds.json]

The prompt set (``bench/data/task_kinds.jsonl``: summaries, questions about a passage,
translation, arithmetic word problems, code edits, chit-chat, extraction; see
``bench/data/SOURCES.md``) is read as ``(kind, prompt)`` rows, ``--per-kind`` of each kind.
``--long N`` adds N long-document requests of kind ``long_document``: a question about, or a
summary of, this repository's own docs concatenated to at least 4,096 prompt tokens.

The default model, chat template, batch 1, up to ``--max-tokens`` new tokens (stopping at EOS
unless ``--ignore-eos``), greedy or sampled (``--temperature``, one seed per prompt, the same for
every engine). One ``LLM`` per drafter, each warmed up; per prompt the engines run in turn, the
order rotating from prompt to prompt, so machine-load drift hits every engine alike. Reports per
kind and overall (the mixed workload: total tokens over total seconds): tokens/s, speedup
against plain decoding in the same run, tokens per target step, and (greedy) how many outputs
equal plain decoding's token for token. ``--predictor FILE`` adds one more engine, named
``DRAFT+predictor``: ``--predictor-draft`` (default ``default``) with that acceptance predictor
(``SpecConfig(predictor=FILE, predictor_min_acceptance=...)``), so the same run measures the engine with and without the
predictor's decisions; the report also counts the requests it decoded plainly. Prints one JSON
document (and writes it with ``--out``).
"""

from __future__ import annotations

import argparse
import collections
import os
import sys
import time

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
KINDS = os.path.join(HERE, "data", "task_kinds.jsonl")
DOCS = os.path.join(os.path.dirname(HERE), "docs")
LONG_TOKENS = 4096
LONG_ASKS = ["Summarize the document above in one paragraph.",
             "According to the document above, how does the engine keep speculative output "
             "equal to plain decoding?",
             "List the command-line commands the document above mentions, with one line each on "
             "what they do.",
             "What does the document above say about memory and the KV cache?"]


def long_prompts(tokenizer, n: int):
    """``n`` long-document prompts: the repository's docs, concatenated until the text is at least
    LONG_TOKENS tokens, each followed by a different request."""
    names = sorted(f for f in os.listdir(DOCS) if f.endswith(".md"))
    out = []
    for k in range(n):
        text, i = "", k
        while len(tokenizer.encode(text)) < LONG_TOKENS:
            with open(os.path.join(DOCS, names[i % len(names)]), encoding="utf-8") as f:
                text += f.read() + "\n\n"
            i += 1
        out.append(("long_document", text + LONG_ASKS[k % len(LONG_ASKS)]))
    return out


def main(argv=None):
    from bench_spec import drafter_list, emit, timed_chat

    ap = argparse.ArgumentParser()
    ap.add_argument("--prompts", default=KINDS, help="JSONL of {'category', 'prompt'} rows")
    ap.add_argument("--per-kind", type=int, default=4, help="prompts of each kind (0 = all)")
    ap.add_argument("--drafters", default="none;default;ngram;lookahead",
                    help="drafter specs separated by semicolons ('none' is always run)")
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--temperature", type=float, default=0.0)
    ap.add_argument("--long", type=int, default=0, help="long-document requests to add")
    ap.add_argument("--ignore-eos", action="store_true")
    ap.add_argument("--predictor", default=None, help="an acceptance predictor file: adds the "
                    "engine DRAFT+predictor")
    ap.add_argument("--predictor-draft", default="default", help="the drafter of that engine")
    ap.add_argument("--predictor-min-acceptance", type=float, default=1.2,
                    help="below this predicted acceptance length a request decodes plainly")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    if args.per_kind < 0 or args.long < 0 or args.max_tokens < 1:
        raise SystemExit("--per-kind and --long must be >= 0, --max-tokens >= 1")

    import pyspec
    from pyspec.train.evaluate import read_prompts

    torch.set_num_threads(2)
    drafters = drafter_list(args.drafters)
    t0 = time.perf_counter()
    llms = {d: pyspec.LLM(draft=d, progress=False) for d in drafters}
    if args.predictor:
        name = f"{args.predictor_draft}+predictor"
        llms[name] = pyspec.LLM(draft=args.predictor_draft, progress=False,
                                spec=pyspec.SpecConfig(
                                    predictor=args.predictor,
                                    predictor_min_acceptance=args.predictor_min_acceptance))
        drafters.append(name)
    rows = read_prompts(args.prompts, per_category=args.per_kind or None)
    rows += long_prompts(llms["none"].tokenizer, args.long)
    warm = pyspec.SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    for llm in llms.values():
        llm.chat([{"role": "user", "content": "Hello"}], warm)
    greedy = args.temperature == 0.0
    tally = {d: collections.defaultdict(lambda: {"seconds": 0.0, "tokens": 0, "steps": 0,
                                                 "identical": 0, "prompts": 0, "plain": 0})
             for d in drafters}
    for i, (kind, text) in enumerate(rows):
        msg = [{"role": "user", "content": text}]
        sp = pyspec.SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature,
                                   seed=1000 + i, ignore_eos=args.ignore_eos)
        outs = {}
        for d in drafters[i % len(drafters):] + drafters[:i % len(drafters)]:
            outs[d] = timed_chat(llms[d], msg, sp, tally[d][kind])
        for d in drafters:
            tally[d][kind]["identical"] += outs[d].token_ids == outs["none"].token_ids
            tally[d][kind]["prompts"] += 1
            tally[d][kind]["plain"] += bool(outs[d].stats.predictor_plain)

    def summary(d, r, plain):
        tps = r["tokens"] / r["seconds"]
        out = {"tokens_per_s": round(tps, 1),
               "speedup": round(tps / (plain["tokens"] / plain["seconds"]), 3),
               "tokens_per_target_step": round(r["tokens"] / r["steps"], 3),
               "tokens": r["tokens"]}
        if greedy:
            out["identical_to_plain"] = f"{r['identical']}/{r['prompts']}"
        if d.endswith("+predictor"):
            out["predicted_plain"] = f"{r['plain']}/{r['prompts']}"
        return out

    kinds = list(dict.fromkeys(k for k, _ in rows))
    per_kind = {k: {d: summary(d, tally[d][k], tally["none"][k]) for d in drafters}
                for k in kinds}
    overall = {}
    for d in drafters:
        tot = {"seconds": 0.0, "tokens": 0, "steps": 0, "identical": 0, "prompts": 0, "plain": 0}
        for k in kinds:
            for key in tot:
                tot[key] += tally[d][k][key]
        overall[d] = tot
    doc = {"config": {"prompts": args.prompts, "per_kind": args.per_kind, "long": args.long,
                      "requests": len(rows), "max_tokens": args.max_tokens,
                      "temperature": args.temperature, "ignore_eos": args.ignore_eos,
                      "drafters": drafters, "predictor": args.predictor,
                      "predictor_min_acceptance": args.predictor_min_acceptance, "threads": torch.get_num_threads(),
                      "wall_seconds": round(time.perf_counter() - t0, 1)},
           "overall": {d: summary(d, overall[d], overall["none"]) for d in drafters},
           "per_kind": per_kind}
    emit(doc, args.out)


if __name__ == "__main__":
    main()
