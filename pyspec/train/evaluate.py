"""``pyspec eval-draft``: a drafter's acceptance report, and the promotion gate between versions.

For every prompt (batch 1, greedy unless --temperature), in one process: the target decodes plainly
and with each drafter (the drafter under test and, with --baseline, the other version), both
through the same engine settings a user gets. The report holds, overall and per category:
acceptance length (1 + accepted / speculative steps), tokens per target step, per-position
acceptance, the draft / verify time split and the speedup over plain decoding measured in the same
run. Written as JSON, markdown and a PNG.

Gate (--baseline): exits 1 when a tracked metric of the candidate is worse than the baseline's by
more than --threshold (relative; default 5%). Tracked: tokens per target step, overall and per
category (it counts every step, drafted or not; acceptance length, conditional on drafting, is
not comparable between drafters that draft on different shares of steps). It varies little
between runs (greedy outputs are fixed; only the draft lengths follow measured step times), so
the gate is not fooled by timing noise; speedup is tracked too with --gate-speedup.
"""

from __future__ import annotations

import json
import os
import time
from typing import Dict, List, Optional

# Gated: tokens per target step counts every step, drafted or not. Acceptance length (1 +
# accepted per *drafted* step) is reported but not gated: it is not comparable between drafters
# that draft on different shares of steps (prompt lookup drafts only where the context repeats).
TRACKED = ("tokens_per_target_step",)


def read_prompts(path: str, limit: Optional[int] = None, per_category: Optional[int] = None,
                 flag: str = "--prompts"):
    """JSONL rows: MT-bench style ``{"category", "turns": [...]}`` or ``{"prompt", "category"?}``
    (also what ``pyspec serve``'s prompt sampling writes), as ``(category, text)`` pairs.
    ``flag``: the option that named the file, for the error of a missing one."""
    return [(c, t) for _, c, t in read_prompt_lines(path, limit, per_category, flag)]


def read_prompt_lines(path: str, limit: Optional[int] = None,
                      per_category: Optional[int] = None, flag: str = "--prompts"):
    """:func:`read_prompts` with each prompt's line number: ``(line, category, text)``."""
    if not os.path.isfile(path):
        raise ValueError(f"{flag}: {path!r} is not a file")
    out = []
    # Read as bytes and decoded per line: an encoding error then names the file and its line (a
    # text-mode read decodes in chunks and fails with neither).
    with open(path, "rb") as f:
        for k, raw in enumerate(f, 1):
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as e:
                raise ValueError(f"{path}:{k}: not UTF-8 text (byte {raw[e.start]:#04x} at "
                                 f"column {e.start + 1}); prompts files must be UTF-8 JSONL"
                                 ) from None
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{path}:{k}: not valid JSON ({e})") from None
            turns = row.get("turns") if isinstance(row, dict) else None
            if isinstance(row, dict) and "turns" in row:
                text = turns[0] if isinstance(turns, list) and turns else None
            else:
                text = row.get("prompt", row.get("text")) if isinstance(row, dict) else None
            if not isinstance(text, str) or not text:
                raise ValueError(f"{path}:{k}: each line must be a JSON object with 'turns' (a "
                                 "non-empty list of strings) or 'prompt' (a non-empty string)")
            out.append((k, str(row.get("category", "all")), text))
    if not out:
        raise ValueError(f"{path}: no prompts")
    if per_category:
        seen: Dict[str, int] = {}
        kept = []
        for k, c, t in out:
            if seen.get(c, 0) < per_category:
                seen[c] = seen.get(c, 0) + 1
                kept.append((k, c, t))
        out = kept
    return out[:limit] if limit else out


def _summary(rows: List[dict]) -> dict:
    tok = sum(r["tokens"] for r in rows)
    steps = sum(r["steps"] for r in rows)
    drafts = sum(r["drafts"] for r in rows)
    acc = sum(r["accepted"] for r in rows)
    secs = sum(r["seconds"] for r in rows)
    plain = sum(r["plain_seconds"] for r in rows)
    pos: List[int] = []
    for r in rows:
        for i, c in enumerate(r["accepted_per_position"]):
            if i >= len(pos):
                pos.append(0)
            pos[i] += c
    return dict(prompts=len(rows), tokens=tok,
                acceptance_length=1 + acc / drafts if drafts else 1.0,
                tokens_per_target_step=tok / steps if steps else 0.0,
                per_position_acceptance=[c / drafts for c in pos] if drafts else [],
                tokens_per_second=tok / secs if secs else 0.0,
                plain_tokens_per_second=sum(r["tokens"] for r in rows) / plain if plain else 0.0,
                speedup=plain / secs if secs else 0.0,
                draft_seconds=sum(r["draft_seconds"] for r in rows),
                verify_seconds=sum(r["verify_seconds"] for r in rows),
                identical_to_plain=sum(r["identical"] for r in rows))


def sampling_params(max_tokens: int, temperature: float):
    """The evaluation's sampling parameters, checked (ValueError naming the bad one): done before
    the target loads, so a bad value costs no load."""
    from pyspec.params import SamplingParams, validate_params

    params = SamplingParams(max_tokens=max_tokens, temperature=temperature, seed=0)
    # The vocabulary only bounds stop_token_ids, and there are none here.
    validate_params(params, vocab=1)
    return params


def evaluate(target: Optional[str], drafts: Dict[str, str], prompts, *, max_tokens: int = 128,
             temperature: float = 0.0, dtype: str = "float32", adaptive: bool = True,
             progress: bool = True, where: Optional[List[str]] = None,
             packed_weights: str = "codes", kv_cache_dtype: str = "auto",
             predictor=None) -> dict:
    """``where``: where each prompt came from (e.g. ``FILE:LINE``), for error messages.
    ``packed_weights``: as ``pyspec.LLM``'s; the report's ``weights`` says which the target read
    ("packed" or "float32"), since speedups differ between them (outputs do not).
    ``kv_cache_dtype``: as ``pyspec.LLM``'s, for every engine of the evaluation. ``predictor``
    (a :class:`pyspec.predictor.AcceptancePredictor`): each drafter's report gains how well it
    predicted the requests' acceptance lengths (``predictor``: Spearman's correlation and the
    mean absolute error)."""
    import pyspec
    from tqdm import tqdm

    from pyspec.engine import Engine, SamplingParams
    from pyspec.runner import ModelRunner

    from pyspec.predictor import corpus_of, spearman

    params = sampling_params(max_tokens, temperature)
    base = pyspec.LLM(target, draft="none", dtype=dtype, kv_cache_tokens=1024, progress=progress,
                      packed_weights=packed_weights, kv_cache_dtype=kv_cache_dtype)
    enc = [base.chat_prompt([{"role": "user", "content": p}]) for _, p in prompts]
    # Every prompt is checked against the context before any is evaluated: one too long would
    # otherwise fail the run when evaluation reaches it.
    limit = base.model.cfg.context_limit
    for i, ids in enumerate(enc):
        if len(ids) + max_tokens > limit:
            name = where[i] if where else f"prompt {i + 1}"
            raise ValueError(f"{name}: the prompt ({len(ids)} tokens in the chat template) + "
                             f"--max-tokens {max_tokens} exceeds the target's context of {limit} "
                             "tokens; shorten the prompt or lower --max-tokens")
    blocks = 8 + (max(len(ids) for ids in enc) + max_tokens + 64) // 16

    def engine(spec):
        return Engine(ModelRunner(base.model, num_blocks=blocks, block_size=16,
                                  kv_dtype=base.runner.kv_dtype), drafter=spec,
                      max_num_seqs=1, adaptive=adaptive)

    plain = engine("none")
    engines = {name: engine(spec) for name, spec in drafts.items()}
    for e in [plain, *engines.values()]:  # warm-up outside the timings
        e.generate([enc[0][:16]], SamplingParams(max_tokens=4))
    rows: Dict[str, List[dict]] = {n: [] for n in engines}
    predicted: Dict[str, List[float]] = {n: [] for n in engines}
    corpora = {n: corpus_of(e.drafters.get(e.default_drafter or "")) for n, e in engines.items()}
    for (cat, _), ids in tqdm(list(zip(prompts, enc)), desc="evaluating", disable=not progress):
        t0 = time.perf_counter()
        ref = plain.generate([ids], params)[0]
        t_plain = time.perf_counter() - t0
        for name, e in engines.items():
            d0, v0 = e.stats.draft_seconds, e.stats.verify_seconds
            t0 = time.perf_counter()
            r = e.generate([ids], params)[0]
            secs = time.perf_counter() - t0
            st = r.stats
            if predictor is not None:
                predicted[name].append(predictor.predict(ids, corpora[name]))
            rows[name].append(dict(
                category=cat, tokens=len(r.token_ids), steps=st.steps, drafts=st.drafts,
                draft_tokens=st.draft_tokens, accepted=st.accepted_tokens,
                accepted_per_position=st.accepted_per_position, seconds=secs,
                plain_seconds=t_plain * len(r.token_ids) / max(len(ref.token_ids), 1),
                draft_seconds=e.stats.draft_seconds - d0, verify_seconds=e.stats.verify_seconds - v0,
                identical=r.token_ids == ref.token_ids, fallbacks=st.fallbacks))
    report = dict(target=base.model_path, max_tokens=max_tokens, temperature=temperature,
                  dtype=dtype, adaptive=adaptive,
                  weights="packed" if base.model.packed_bytes else dtype,
                  kv_cache_dtype=str(base.runner.kv_dtype).replace("torch.", ""), drafters={})
    for name, rs in rows.items():
        s = _summary(rs)
        s["spec"] = drafts[name]
        d = engines[name].drafters.get(engines[name].default_drafter or "")
        s["manifest"] = getattr(d, "manifest", None)
        s["per_category"] = {c: _summary([r for r in rs if r["category"] == c])
                             for c in dict.fromkeys(r["category"] for r in rs)}
        if predictor is not None:
            real = [1.0 + r["accepted"] / r["drafts"] if r["drafts"] else 1.0 for r in rs]
            rho = spearman(predicted[name], real)
            s["predictor"] = {
                "spearman": None if rho != rho else round(rho, 3),
                "mean_abs_error": round(sum(abs(p - y) for p, y in zip(predicted[name], real))
                                        / max(1, len(real)), 3)}
        report["drafters"][name] = s
    return report


def compact_summary(s: dict) -> dict:
    """A drafter's headline numbers from :func:`evaluate`'s report, rounded for a record."""
    return {"acceptance_length": round(s["acceptance_length"], 3),
            "tokens_per_target_step": round(s["tokens_per_target_step"], 3),
            "per_position_acceptance": [round(x, 3) for x in s["per_position_acceptance"][:8]],
            "speedup": round(s["speedup"], 3), "identical_to_plain": s["identical_to_plain"]}


def gate(report: dict, candidate: str, baseline: str, threshold: float,
         speedup: bool = False) -> List[str]:
    """Tracked metrics where the candidate is worse than the baseline by more than threshold."""
    c, b = report["drafters"][candidate], report["drafters"][baseline]
    keys = TRACKED + (("speedup",) if speedup else ())
    bad = []
    scopes = [("overall", c, b)] + [(f"category {k}", c["per_category"][k], b["per_category"][k])
                                    for k in c["per_category"] if k in b["per_category"]]
    for scope, cs, bs in scopes:
        for k in keys:
            if bs[k] > 0 and cs[k] < bs[k] * (1 - threshold):
                bad.append(f"{scope}: {k} {cs[k]:.3f} < baseline {bs[k]:.3f} "
                           f"(-{100 * (1 - cs[k] / bs[k]):.1f}% > {100 * threshold:.0f}%)")
    return bad


def write_report(report: dict, out_dir: str) -> List[str]:
    os.makedirs(out_dir, exist_ok=True)
    paths = [os.path.join(out_dir, "report.json"), os.path.join(out_dir, "report.md")]
    with open(paths[0], "w") as f:
        json.dump(report, f, indent=1)
    lines = ["# Drafter acceptance report", "",
             f"target `{report['target']}`, {report['max_tokens']} new tokens, temperature "
             f"{report['temperature']}, {report['dtype']} ("
             f"{'weights read as packed block codes' if report.get('weights') == 'packed' else 'dense weights'}"
             "), batch 1, same run as plain decoding", ""]
    for name, s in report["drafters"].items():
        lines += [f"## {name} (`{s['spec']}`)", "",
                  f"- acceptance length **{s['acceptance_length']:.2f}**, tokens per target step "
                  f"{s['tokens_per_target_step']:.2f}",
                  f"- speedup over plain **{s['speedup']:.2f}x** ({s['tokens_per_second']:.1f} vs "
                  f"{s['plain_tokens_per_second']:.1f} tok/s)",
                  f"- draft / verify time: {s['draft_seconds']:.1f}s / {s['verify_seconds']:.1f}s",
                  "- per-position acceptance: " + ", ".join(
                      f"{p:.2f}" for p in s["per_position_acceptance"][:8]),
                  f"- identical to plain: {s['identical_to_plain']}/{s['prompts']}", "",
                  "| category | prompts | acceptance length | tokens/step | speedup |",
                  "|---|---|---|---|---|"]
        for c, cs in s["per_category"].items():
            lines.append(f"| {c} | {cs['prompts']} | {cs['acceptance_length']:.2f} | "
                         f"{cs['tokens_per_target_step']:.2f} | {cs['speedup']:.2f}x |")
        lines.append("")
    with open(paths[1], "w") as f:
        f.write("\n".join(lines))
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, axes = plt.subplots(1, 2, figsize=(12, 4))
        names = list(report["drafters"])
        cats = list(report["drafters"][names[0]]["per_category"])
        w = 0.8 / len(names)
        for k, n in enumerate(names):
            s = report["drafters"][n]
            axes[0].bar([i + k * w for i in range(len(cats))],
                        [s["per_category"][c]["acceptance_length"] for c in cats], w, label=n)
            axes[1].plot(range(1, len(s["per_position_acceptance"]) + 1),
                         s["per_position_acceptance"], marker="o", label=n)
        axes[0].set_xticks([i + 0.4 - w / 2 for i in range(len(cats))])
        axes[0].set_xticklabels(cats, rotation=30, fontsize=8)
        axes[0].set_ylabel("acceptance length")
        axes[1].set_xlabel("draft position")
        axes[1].set_ylabel("share of speculative steps accepting it")
        axes[0].legend(fontsize=7)
        fig.tight_layout()
        p = os.path.join(out_dir, "report.png")
        fig.savefig(p, dpi=100)
        paths.append(p)
    except ImportError:
        pass
    return paths


SHIPPED = ("default", "suffix", "eagle")  # drafter specs naming the drafters shipped in pyspec


def _spec_parts(spec: str) -> List[str]:
    """The single drafters of a combined spec (``A|B``, ``A+B``), as make_drafter splits it."""
    from pyspec.drafters import split_spec

    split = split_spec(spec)
    return [spec] if split is None else [q for part in split[1] for q in _spec_parts(part)]


def _heads_folder(spec: str) -> Optional[str]:
    """The drafter folder (EAGLE/Medusa heads, a corpus) a drafter spec uses, or None; the shipped
    corpus for ``default`` and ``suffix``, the shipped head for ``eagle``."""
    from pyspec.models.default import shipped_drafter_path

    for part in _spec_parts(spec):
        if part in SHIPPED:
            return shipped_drafter_path(part)
        path = os.path.expanduser(part.partition("@")[0])
        if os.path.isfile(os.path.join(path, "drafter.json")):
            return path
    return None


def _check_manifest_target(draft_dir: str, target: Optional[str]) -> None:
    """--record-in-manifest writes a measurement into the drafter's manifest: refused, before
    anything runs, when the manifest names other target weights than the ones evaluated."""
    from pyspec.models.loader import weights_sha256

    with open(os.path.join(draft_dir, "drafter.json"), encoding="utf-8") as f:
        want = ((json.load(f).get("manifest") or {}).get("target") or {}).get("sha256")
    if want is None:
        return
    if target is None or target == "default":
        from pyspec.models.default import default_model_path

        target = default_model_path()
    have = weights_sha256(os.path.expanduser(target))
    if have != want:
        raise ValueError(f"--record-in-manifest: {draft_dir} was made for target weights "
                         f"{want[:12]}..., --target {target} has {have[:12]}...: a measurement on "
                         f"this target does not belong in that drafter's manifest")


def record_in_manifest(draft_dir: str, report: dict, args) -> None:
    """Write the candidate's summary into ``draft_dir``'s drafter.json ("evaluation"), with the
    spec and settings that reproduce it (folders by their base name)."""
    cfg_path = os.path.join(draft_dir, "drafter.json")
    with open(cfg_path) as f:
        cfg = json.load(f)
    c = report["drafters"]["candidate"]
    spec = args.draft
    for part in _spec_parts(args.draft):  # the folder by its base name (the manifest travels)
        path = part.partition("@")[0]
        if path not in SHIPPED and \
                os.path.abspath(os.path.expanduser(path)) == os.path.abspath(draft_dir):
            spec = spec.replace(path, os.path.basename(os.path.abspath(draft_dir)))
    cfg.setdefault("manifest", {})["evaluation"] = {
        "draft": spec,
        "command": f"pyspec eval-draft --draft '{spec}' "
                   f"--prompts {os.path.basename(args.prompts)} --max-tokens {args.max_tokens}"
                   + (f" --limit {args.limit}" if args.limit else "")
                   + (f" --per-category {args.per_category}" if args.per_category else "")
                   + f" --temperature {args.temperature} --dtype {args.dtype}"
                   + ("" if report["adaptive"] else " --no-adaptive")
                   + f" --packed-weights {args.packed_weights}"
                   + f" --kv-cache-dtype {getattr(args, 'kv_cache_dtype', 'auto')}",
        "prompts": c["prompts"], "prompts_file": os.path.basename(args.prompts),
        "limit": args.limit, "per_category": args.per_category, "max_tokens": report["max_tokens"],
        "temperature": report["temperature"], "dtype": report["dtype"],
        "adaptive": report["adaptive"], "weights": report["weights"],
        **compact_summary(c),
        "per_category_acceptance_length": {k: round(v["acceptance_length"], 3)
                                           for k, v in c["per_category"].items()},
    }
    with open(cfg_path, "w") as f:
        json.dump(cfg, f, indent=1)


def add_parser(sub):
    from pyspec.cli_flags import add_model_flags

    p = sub.add_parser("eval-draft", help="acceptance report for a drafter (and a promotion gate)")
    p.add_argument("--target", default=None, help="target model folder (default: the embedded)")
    p.add_argument("--draft", default="default", help="drafter spec (see pyspec generate --draft)")
    p.add_argument("--prompts", required=True, help="JSONL prompts (MT-bench format or 'prompt')")
    p.add_argument("--limit", type=int, default=None, help="first N prompts only")
    p.add_argument("--per-category", type=int, default=None,
                   help="at most N prompts of each category (in file order)")
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--temperature", type=float, default=0.0)
    add_model_flags(p, dtypes=("float32", "bfloat16"), device=False)
    p.add_argument("--no-adaptive", dest="adaptive", action="store_false",
                   help="fixed draft lengths (the drafter's), no fallback to plain decoding: "
                        "the drafter's acceptance without the cost model's decisions")
    p.add_argument("--baseline", default=None, help="another drafter to compare (promotion gate)")
    p.add_argument("--threshold", type=float, default=0.05)
    p.add_argument("--gate-speedup", action="store_true", help="also gate on measured speedup")
    p.add_argument("--out", default="eval-draft", help="report folder")
    p.add_argument("--predictor", default=None,
                   help="an acceptance predictor file: report how well it predicts each "
                        "request's acceptance length")
    p.add_argument("--record-in-manifest", action="store_true",
                   help="write the candidate's summary into its drafter.json manifest "
                        "('evaluation'), for a drafter folder")
    p.set_defaults(func=_cmd)
    return p


def _cmd(args) -> int:
    if args.max_tokens < 1:
        raise ValueError("--max-tokens must be >= 1")
    from pyspec.params import SamplingParams, check_sampling_options

    # Before anything is loaded or written.
    check_sampling_options(SamplingParams(max_tokens=args.max_tokens,
                                          temperature=args.temperature, seed=0))
    for name, v in (("--limit", args.limit), ("--per-category", args.per_category)):
        if v is not None and v < 1:
            raise ValueError(f"{name} must be >= 1 (leave it out for all prompts); got {v}")
    if os.path.exists(args.out) and not os.path.isdir(args.out):
        raise ValueError(f"--out {args.out!r} exists and is not a folder")
    try:  # before the evaluation runs: a report that cannot be written wastes the run
        os.makedirs(args.out, exist_ok=True)
    except OSError as e:
        raise ValueError(f"--out {args.out!r}: cannot create the report folder ({e})") from None
    if not 0 < args.threshold < 1:
        raise ValueError("--threshold must be in (0, 1)")
    heads = _heads_folder(args.draft) if args.record_in_manifest else None
    if args.record_in_manifest and args.target and set(SHIPPED) & set(_spec_parts(args.draft)):
        raise ValueError("--record-in-manifest with 'default', 'suffix' or 'eagle' records into a "
                         "drafter shipped for the embedded model; leave out --target (or name a "
                         "drafter folder)")
    if args.record_in_manifest and heads is None:
        raise ValueError(f"--record-in-manifest needs a drafter that uses a drafter folder "
                         f"(drafter.json: EAGLE/Medusa heads or a corpus, alone or in A+B / A|B, "
                         f"or 'default'); {args.draft!r} has none")
    if args.record_in_manifest:
        _check_manifest_target(heads, args.target)
    rows = read_prompt_lines(args.prompts, args.limit, args.per_category)
    prompts = [(c, t) for _, c, t in rows]
    drafts = {"candidate": args.draft}
    if args.baseline:
        drafts["baseline"] = args.baseline
    from pyspec.predictor import load_predictor

    report = evaluate(args.target, drafts, prompts, max_tokens=args.max_tokens,
                      temperature=args.temperature, dtype=args.dtype, adaptive=args.adaptive,
                      where=[f"{args.prompts}:{k}" for k, _, _ in rows],
                      packed_weights=args.packed_weights, kv_cache_dtype=args.kv_cache_dtype,
                      predictor=load_predictor(args.predictor))
    paths = write_report(report, args.out)
    if args.record_in_manifest:
        record_in_manifest(heads, report, args)
    for name, s in report["drafters"].items():
        print(f"{name}: acceptance length {s['acceptance_length']:.2f}, tokens/step "
              f"{s['tokens_per_target_step']:.2f}, speedup {s['speedup']:.2f}x "
              f"({s['identical_to_plain']}/{s['prompts']} identical to plain)"
              + (f"; predictor Spearman {s['predictor']['spearman']}, mean abs error "
                 f"{s['predictor']['mean_abs_error']}" if "predictor" in s else ""))
    print("wrote " + ", ".join(paths))
    if args.baseline:
        bad = gate(report, "candidate", "baseline", args.threshold, args.gate_speedup)
        if bad:
            print("promotion gate: FAILED")
            for b in bad:
                print("  " + b)
            return 1
        print("promotion gate: passed")
    return 0
