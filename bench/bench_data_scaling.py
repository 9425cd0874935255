"""A data-scaling curve for an EAGLE head: train on nested subsets of one corpus, then measure
each head's acceptance on MT-bench and on the task kinds it never saw, side by side.

    python bench/bench_data_scaling.py --data pyspec/data/default_corpus \
        --sizes 100000,200000,420000,840000,all --out-root ~/scaling \
        --json bench/results/data-scaling.json --chart docs/images/data-scaling.svg

Each point is one ``pyspec train-draft --train-tokens N`` run (a subprocess, so its manifest
records the exact command and its wall time) in ``OUT_ROOT/tN``; the subsets are nested (one seed
orders the corpus's sequences once), so points differ only in how much data they add. The
largest is trained first and computes the target's features for its sequences; every later point
reads the largest features file computed so far through a link in its folder and computes only
what it lacks (so a larger point added later computes only its new sequences). A finished point
is not trained again (delete its folder to redo it).

Each head is then measured with ``eval-draft``'s engine (greedy, ``--no-adaptive``: the fixed
tree the head's folder names, so the counts depend on the outputs alone) on the first turn of
``--per-category`` MT-bench questions per category and as many prompts per kind of
``bench/data/task_kinds.jsonl``: acceptance length, tokens per target step, acceptance by
position and the speedup over plain decoding in the same run (the speedup is a CPU timing and
noisier than the counts). The measurements are kept in each point's folder and not repeated.
The points of one OUT_ROOT share their settings (data, target, seed, epochs, recipe), checked
against ``OUT_ROOT/scaling.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
SETS = {"mt_bench": os.path.join(HERE, "data", "mt_bench_questions.jsonl"),
        "task_kinds": os.path.join(HERE, "data", "task_kinds.jsonl")}
# The shipped head's recipe (docs/training.md), bar the data size and the epochs.
sys.path.insert(0, HERE)
from bench_oracle_scaling import cpu_name  # noqa: E402

RECIPE = ["--batch-tokens", "256", "--unroll-steps", "3", "--draft-vocab", "8192",
          "--intermediate-size", "1024", "--gen-dtype", "bfloat16"]


def _sizes(text: str):
    out = []
    for part in text.split(","):
        part = part.strip()
        if part == "all":
            n = None
        elif part.isdigit() and int(part) >= 1:
            n = int(part)
        else:
            raise argparse.ArgumentTypeError(f"{part!r} is not a token count >= 1 (digits) or "
                                             "'all'")
        if n in out:
            raise argparse.ArgumentTypeError(f"{part!r} is given twice")
        out.append(n)
    return out


def _check_root(args) -> None:
    """The points in OUT_ROOT share one set of settings (OUT_ROOT/scaling.json), so a finished
    point and the features it computed are only reused by a run that would make the same."""
    settings = {"data": os.path.abspath(args.data), "target": args.target, "seed": args.seed,
                "epochs": args.epochs, "recipe": RECIPE}
    path = os.path.join(args.out_root, "scaling.json")
    if os.path.isfile(path):
        with open(path) as f:
            kept = json.load(f)
        if kept != settings:
            differ = sorted(k for k in settings if kept.get(k) != settings[k])
            raise SystemExit(f"--out-root {args.out_root}: its points were trained with other "
                             f"settings ({', '.join(differ)} differ); give another --out-root")
        return
    with open(path, "w") as f:
        json.dump(settings, f, indent=1)


def _features(out_root: str):
    """The largest features file a point of this curve computed (a real file, not a link)."""
    found = {}
    for d in os.listdir(out_root):
        folder = os.path.join(out_root, d)
        if not os.path.isdir(folder):
            continue
        for name in os.listdir(folder):
            path = os.path.join(folder, name)
            if name.startswith("features-") and name.endswith(".pt") \
                    and not os.path.islink(path):
                if name not in found or os.path.getsize(path) > os.path.getsize(found[name]):
                    found[name] = path
    return found


def _pyspec_command():
    """``pyspec`` in a subprocess, from the package this process imported: ``python -m pyspec``
    would look in the working directory first, where a source checkout's ``pyspec/`` (without
    its compiled module) can shadow the installed one."""
    import pyspec

    where = os.path.dirname(os.path.dirname(os.path.abspath(pyspec.__file__)))
    return [sys.executable, "-c", "import sys; sys.path.insert(0, sys.argv.pop(1)); "
            "from pyspec.cli import main; sys.exit(main(sys.argv[1:]))", where]


def train_point(args, size):
    """One train-draft run; returns (folder, whether it ran now)."""
    out = os.path.join(args.out_root, f"t{size if size else 'all'}")
    if os.path.isfile(os.path.join(out, "drafter.json")):
        return out, False
    computed = _features(args.out_root)
    os.makedirs(out, exist_ok=True)
    for name, path in computed.items():  # the target's features computed so far
        link = os.path.join(out, name)
        if os.path.islink(link):  # an earlier link (its target may be gone)
            os.remove(link)
        if not os.path.lexists(link):
            os.symlink(os.path.abspath(path), link)
    cmd = [*_pyspec_command(), "train-draft", "--data", args.data,
           *(["--target", args.target] if args.target else []),
           "--epochs", str(args.epochs), "--seed", str(args.seed), *RECIPE,
           "--version", f"scale-{size if size else 'all'}", "--out", out]
    if size:
        cmd += ["--train-tokens", str(size)]
    print(" ".join(cmd), flush=True)
    with open(out + ".log", "w") as log:
        rc = subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT).returncode
    if rc != 0:
        raise SystemExit(f"train-draft failed for {out} (exit {rc}); its output is in {out}.log")
    return out, True


def measure(target, spec: str, saved: str, per_category: int, max_tokens: int) -> dict:
    """The acceptance of drafter ``spec`` on each prompt set; kept in ``saved``, which a rerun
    with the same settings reads instead of measuring again."""
    from pyspec.train.evaluate import compact_summary, evaluate, read_prompts

    settings = {"target": target, "spec": spec, "per_category": per_category,
                "max_tokens": max_tokens}
    if os.path.isfile(saved):
        with open(saved) as f:
            kept = json.load(f)
        if kept.get("settings") == settings:
            return kept["eval"]
    out = {}
    for name, path in SETS.items():
        prompts = read_prompts(path, per_category=per_category)
        rep = evaluate(target, {"head": spec}, prompts, max_tokens=max_tokens, adaptive=False,
                       progress=False)
        s = rep["drafters"]["head"]
        out[name] = {"prompts": s["prompts"], "tokens": s["tokens"], **compact_summary(s)}
        print(f"  {name}: {json.dumps(out[name])}", flush=True)
    with open(saved, "w") as f:
        json.dump({"settings": settings, "eval": out}, f, indent=1)
    return out


def chart(result, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(5.6, 3.8))
    pts = sorted(result["points"], key=lambda p: p["tokens"])
    for name in SETS:
        ax.plot([p["tokens"] for p in pts], [p["eval"][name]["acceptance_length"] for p in pts],
                "o-", label=name.replace("_", " "))
    for k, (spec, ev) in enumerate(sorted(result.get("references", {}).items())):
        for j, name in enumerate(SETS):
            ax.axhline(ev[name]["acceptance_length"], color=f"C{j}", lw=0.8,
                       ls=("--", ":", "-.")[k % 3],
                       label=f"{os.path.basename(spec.rstrip('/')) or spec} "
                             f"({name.replace('_', ' ')})")
    ax.set_xscale("log")
    ax.set_xlabel("training tokens (one epoch)")
    ax.set_ylabel("acceptance length (greedy, fixed tree)")
    ax.grid(alpha=0.3, which="both")
    ax.legend(fontsize=8)
    ax.set_title(f"EAGLE head vs data: {result['machine']}", fontsize=8)
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.savefig(path)


def save(result, path) -> None:
    if path:
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        with open(path, "w") as f:
            json.dump(result, f, indent=1)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--target", default=None, help="target model folder (default: the embedded)")
    ap.add_argument("--data", default=os.path.join(ROOT, "pyspec", "data", "default_corpus"),
                    help="the corpus (as train-draft --data takes it)")
    ap.add_argument("--sizes", type=_sizes, default=_sizes("100000,200000,420000,840000,all"),
                    help="training tokens per point, comma-separated; 'all': the whole corpus")
    ap.add_argument("--epochs", type=int, default=1)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out-root", required=True, help="folder for the heads and their logs")
    ap.add_argument("--per-category", type=int, default=1)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--reference", action="append", default=[],
                    help="also measure this drafter spec the same way (e.g. the shipped head "
                         "with the curve's tree: 'eagle@width=4,depth=5,nodes=24'); repeatable")
    ap.add_argument("--json", default=None, help="write the result here")
    ap.add_argument("--chart", default=None, help="write an SVG/PNG chart here")
    args = ap.parse_args(argv)
    if args.epochs < 1 or args.per_category < 1 or args.max_tokens < 1:
        ap.error("--epochs, --per-category and --max-tokens must be >= 1")
    os.makedirs(args.out_root, exist_ok=True)
    _check_root(args)
    from pyspec.drafters.folder import read_config

    result = {"machine": f"{cpu_name()}, {os.cpu_count()} CPUs",
              "data": args.data, "epochs": args.epochs, "recipe": RECIPE, "points": []}
    for size in sorted(args.sizes, key=lambda n: -(n or float("inf"))):  # largest first
        folder, now = train_point(args, size)
        man = read_config(folder)["manifest"]
        print(f"{folder}: {man['recipe']['tokens']} tokens", flush=True)
        result["points"].append({"folder": folder, "tokens": man["recipe"]["tokens"],
                                 "sequences": man["recipe"]["sequences"], "trained_now": now,
                                 # the run's data step (loading; the features it computed)
                                 # and the whole run, as its manifest records them
                                 "data_seconds": man["data_seconds"],
                                 "training_seconds": man["training_seconds"],
                                 "eval": measure(args.target, folder,
                                                 os.path.join(folder, "scaling-eval.json"),
                                                 args.per_category, args.max_tokens)})
        save(result, args.json)  # as points finish
    for spec in args.reference:
        name = "".join(c if c.isalnum() else "_" for c in spec)
        result.setdefault("references", {})[spec] = measure(
            args.target, spec, os.path.join(args.out_root, f"reference-{name}.json"),
            args.per_category, args.max_tokens)
    save(result, args.json)
    if args.chart:
        chart(result, args.chart)
    return result


if __name__ == "__main__":
    main()
