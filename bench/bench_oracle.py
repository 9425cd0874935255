"""The engine's ceiling: speculative decoding with drafts that are always right.

The drafter here is a corpus (``--method suffix`` format) holding exactly the target's own greedy
answers to the measured prompts, produced in this run by plain decoding at batch 1, so the
longest-suffix match drafts the very continuation plain decoding will emit. It is not a drafter
anyone can ship; it measures what the engine makes of right drafts: the tokens per target step
and speedup at chain depths 1, 2, 4 and 8 (``@nodes=D,depth=D``: one chain of D nodes), all with
the defaults a user gets (adaptive speculation on), plain decoding in the same run (``pyspec
eval-draft``'s harness: MT-bench first turns, one or more per category, greedy, batch 1).

From the measured cost of a step at each depth, ``cost(D) = tokens_per_step / speedup`` in plain
steps, it derives the per-token acceptance a real drafter would need for a target speedup: a
chain of D drafts that each hold with probability ``a`` (independently) yields
``(1 - a^(D+1)) / (1 - a)`` tokens per step, so the speedup is that over ``cost(D)``; the script
reports the smallest ``a`` reaching ``--goal`` at the best depth.

    python bench/bench_oracle.py [--per-category 1] [--max-tokens 128] [--goal 2.0]
        [--out bench/results/oracle.json]
"""

import argparse
import json
import os
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from oracle_support import chain_tokens  # noqa: E402

DEPTHS = (1, 2, 4, 8)


def needed_acceptance(cost: float, depth: int, goal: float) -> float:
    """Smallest per-token acceptance at which a ``depth`` chain reaches ``goal`` given the
    measured step ``cost`` (in plain steps); inf where even right drafts fall short."""
    if chain_tokens(1.0, depth) / cost < goal:
        return float("inf")
    lo, hi = 0.0, 1.0
    for _ in range(50):
        mid = (lo + hi) / 2
        if chain_tokens(mid, depth) / cost >= goal:
            hi = mid
        else:
            lo = mid
    return hi


def _num(x: float):
    return None if x == float("inf") else round(x, 3)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--per-category", type=int, default=1)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--goal", type=float, default=2.0)
    ap.add_argument("--out", default=os.path.join(HERE, "results", "oracle.json"))
    a = ap.parse_args()
    if a.per_category < 1 or a.max_tokens < 1 or a.goal <= 1.0:
        sys.exit("--per-category and --max-tokens must be >= 1 and --goal > 1")

    import pyspec
    from pyspec.drafters.suffix import save_corpus
    from pyspec.engine import Engine, SamplingParams
    from pyspec.runner import ModelRunner
    from pyspec.train.evaluate import evaluate, read_prompts

    prompts = read_prompts(os.path.join(HERE, "data", "mt_bench_questions.jsonl"),
                           per_category=a.per_category)
    base = pyspec.LLM(None, draft="none", dtype="float32", progress=False)
    enc = [base.chat_prompt([{"role": "user", "content": p}]) for _, p in prompts]
    blocks = 8 + (max(len(e) for e in enc) + a.max_tokens + 64) // 16
    plain = Engine(ModelRunner(base.model, num_blocks=blocks, block_size=16), drafter="none",
                   max_num_seqs=1)
    # Exactly the requests evaluate() sends (same params, batch 1): the answers it will compare.
    params = SamplingParams(max_tokens=a.max_tokens, temperature=0.0, seed=0)
    docs = [list(ids) + list(plain.generate([ids], params)[0].token_ids) for ids in enc]
    with tempfile.TemporaryDirectory() as tmp:
        save_corpus(tmp, docs, base.model.cfg.vocab_size,
                    manifest={"note": "oracle: the target's own answers to the measured prompts"})
        report = evaluate(None, {f"depth {d}": f"{tmp}@nodes={d},depth={d}" for d in DEPTHS},
                          prompts, max_tokens=a.max_tokens, progress=True)
    res = {"prompts": len(prompts), "max_tokens": a.max_tokens, "goal": a.goal, "depths": {}}
    best = None
    for d in DEPTHS:
        r = report["drafters"][f"depth {d}"]
        cost = r["tokens_per_target_step"] / r["speedup"]
        need = needed_acceptance(cost, d, a.goal)
        res["depths"][d] = {"tokens_per_target_step": round(r["tokens_per_target_step"], 3),
                            "speedup": round(r["speedup"], 3),
                            "step_cost_in_plain_steps": round(cost, 3),
                            "identical_to_plain": f"{r['identical_to_plain']}/{r['prompts']}",
                            # None: even right drafts at this depth fall short of the goal
                            "acceptance_needed_for_goal": _num(need)}
        if best is None or need < best[1]:
            best = (d, need)
        print(f"depth {d}: {r['tokens_per_target_step']:.2f} tokens per target step, "
              f"{r['speedup']:.2f}x plain, a step costs {cost:.2f} plain steps; "
              f"{a.goal}x needs per-token acceptance >= {need:.3f}")
    res["best_depth_for_goal"], res["acceptance_needed_for_goal"] = best[0], _num(best[1])
    print(f"{a.goal}x needs per-token acceptance >= {best[1]:.3f} (chains of {best[0]})")
    os.makedirs(os.path.dirname(os.path.abspath(a.out)), exist_ok=True)
    with open(a.out, "w") as f:
        json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
