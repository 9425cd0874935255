"""``pyspec train-draft``: self-distill a drafter for a target on the CPU, resumably."""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import shutil
import time

import torch

from pyspec.train.data import PROMPT_SETS

METHODS = ("eagle", "medusa", "draft-model", "suffix")
# Options not given on the command line, per method: --tree-depth / --tree-nodes (an EAGLE head's
# dynamic tree; a corpus drafter's best-first tree, deeper: a retrieved continuation is often right
# for several tokens) and --batch-tokens (an EAGLE head learns most per token from many small
# steps: at 6,144 tokens per step 0.5M tokens made 258 steps in 3 epochs and left it far
# undertrained, see README "Training and evaluating drafters").
_METHOD_DEFAULTS = {"eagle": {"tree_depth": 5, "tree_nodes": 24, "batch_tokens": 256,
                              "draft_vocab": 8192, "intermediate_size": 1024},
                    "medusa": {"batch_tokens": 2048, "draft_vocab": 8192},
                    "draft-model": {"batch_tokens": 2048},
                    "suffix": {"tree_depth": 8, "tree_nodes": 8}}


def _prompt_sets(text: str) -> str:
    names = text.split(",")
    bad = [n for n in names if n not in PROMPT_SETS]
    if bad or len(set(names)) != len(names):
        raise argparse.ArgumentTypeError(
            f"{text!r}: give one or more of {', '.join(PROMPT_SETS)}, comma-separated, each once")
    return text


def _feature_layers(text):
    if text is None:
        return None
    try:
        layers = [int(x) for x in str(text).split(",") if x.strip()]
    except ValueError:
        layers = []
    if not layers:
        raise ValueError(f"--feature-layers must be comma-separated layer numbers (e.g. "
                         f"3,15,27,30); got {text!r}")
    return layers


def _self_prompts(gen, args):
    """The target's own requests; a rerun reuses DIR/self-prompts.jsonl when it holds enough."""
    from pyspec.train import data as D
    from pyspec.train.evaluate import read_prompts

    path = os.path.join(args.out, "self-prompts.jsonl")
    if os.path.isfile(path):
        kept = [text for _, text in read_prompts(path)]
        if len(kept) >= args.prompts:
            print(f"loaded {args.prompts} of the {len(kept)} requests in {path}")
            return kept[:args.prompts]
    prompts = D.self_prompts(gen, args.prompts, seed=args.seed, batch=args.batch)
    if not prompts:
        raise ValueError("--prompt-set self: the target wrote no complete request (none ended "
                         "its turn); choose another prompt set")
    with open(path, "w") as f:
        for p in prompts:
            f.write(json.dumps({"prompt": p}) + "\n")
    return prompts


# Options that apply to one method only, and those that only shape corpus generation: the recorded
# command lists what the run used, so a manifest never shows --draft-layers for an EAGLE head or
# --prompt-set for a run that trained on --data.
_METHOD_OPTIONS = {"draft_layers": ("draft-model",), "medusa_heads": ("medusa",),
                   "draft_vocab": ("eagle", "medusa"), "intermediate_size": ("eagle",),
                   "unroll_steps": ("eagle",), "feature_layers": ("eagle",),
                   "tree_width": ("eagle",), "tree_depth": ("eagle", "suffix"),
                   "tree_nodes": ("eagle", "suffix"),
                   "epochs": ("eagle", "medusa", "draft-model"),
                   "lr": ("eagle", "medusa", "draft-model"),
                   "batch_tokens": ("eagle", "medusa", "draft-model")}
_GENERATION_OPTIONS = ("prompts", "prompt_set", "prompt_file", "max_tokens", "batch",
                       "shard_prompts")


def _recorded_command(args, generated: bool, used_gen_dtype: bool) -> str:
    """The train-draft command line of this run, with the options it used (sorted)."""
    def used(k):
        if k in ("func", "command", "out") or getattr(args, k) is None:
            return False
        if k in _METHOD_OPTIONS:
            return args.method in _METHOD_OPTIONS[k]
        if k in _GENERATION_OPTIONS:
            return generated and not (k in ("prompts", "prompt_set") and args.prompt_file)
        if k == "gen_dtype":
            return used_gen_dtype
        return True
    return "pyspec train-draft " + " ".join(
        f"--{k.replace('_', '-')} {getattr(args, k)}" for k in sorted(vars(args)) if used(k))


def _prompt_lists(gen, args):
    """The prompts to generate the corpus from: the --prompt-file requests (people's, or a served
    prompt log), else one list per --prompt-set."""
    from pyspec.train import data as D

    if args.prompt_file is not None:
        from pyspec.train.evaluate import read_prompt_lines

        rows = read_prompt_lines(args.prompt_file, flag="--prompt-file")
        # Every request is checked against the context before any is generated: one too long
        # would otherwise end the run after the others' generation.
        limit = gen.model.cfg.context_limit
        for line, _, text in rows:
            n = len(gen.chat_prompt([{"role": "user", "content": text}]))
            if n + args.max_tokens > limit:
                raise ValueError(f"--prompt-file {args.prompt_file}:{line}: the request ({n} "
                                 f"tokens in the chat template) + --max-tokens {args.max_tokens} "
                                 f"exceeds the target's context of {limit} tokens")
        print(f"{len(rows)} requests from {args.prompt_file}")
        return [[text for _, _, text in rows]]
    return [_self_prompts(gen, args) if name == "self" else
            D.seed_prompts(args.prompts, seed=args.seed, prompt_set=name)
            for name in args.prompt_set.split(",")]


def _data_recipe(args, data_paths) -> dict:
    """Where a run's corpus came from, for its manifest. Reused data is traced to the commands
    that generated it (the recipes of the drafter folders it is, or sits in)."""
    if data_paths:
        made_by = {}
        for p in data_paths:
            conf = os.path.join(p if os.path.isdir(p) else os.path.dirname(p) or ".",
                                "drafter.json")
            try:
                with open(conf) as f:
                    made_by[p] = json.load(f)["manifest"]["recipe"]["command"]
            except (OSError, ValueError, KeyError, TypeError):
                continue  # no record of how it was made
        return {"data": data_paths, **({"data_commands": made_by} if made_by else {})}
    source = ({"prompt_file": args.prompt_file} if args.prompt_file is not None else
              {"seed_prompts": args.prompts, "prompt_set": args.prompt_set})
    return {**source, "max_tokens": args.max_tokens}


def _initial_head(args, layers):
    """--init-from DIR: the trained EAGLE head to start from. Its draft vocabulary, intermediate
    size and feature layers are the new head's (given explicitly, they must agree)."""
    from pyspec.drafters.folder import read_config
    from pyspec.drafters.heads import read_heads

    if args.method != "eagle":
        raise ValueError("--init-from applies to --method eagle only")
    path = os.path.expanduser(args.init_from)
    if path == "eagle":  # the head shipped for the embedded model
        from pyspec.models.default import shipped_drafter_path

        path = shipped_drafter_path("eagle")
        if path is None:
            raise ValueError("--init-from eagle: this build ships no EAGLE head")
    if not os.path.isfile(os.path.join(path, "drafter.json")):
        raise ValueError(f"--init-from {args.init_from!r}: not a drafter folder (drafter.json)")
    cfg = read_config(path)
    if cfg.get("method") != "eagle":
        raise ValueError(f"--init-from {args.init_from!r} is a {cfg.get('method')} drafter; an "
                         "EAGLE head is needed")
    cfg, tensors = read_heads(path, cfg)
    e = cfg["eagle"]
    own = e.get("feature_layers")
    if layers is not None and list(layers) != list(own or layers):
        raise ValueError(f"--feature-layers {layers} differ from the initial head's {own}")
    for name, value in (("intermediate_size", int(e["intermediate_size"])),
                        ("draft_vocab", int(tensors["draft_vocab"].numel()))):
        given = getattr(args, name)
        if given is not None and given != value:
            raise ValueError(f"--{name.replace('_', '-')} {given} differs from the initial "
                             f"head's {value} (leave it out to keep the head's)")
        setattr(args, name, value)
    version = (cfg.get("manifest") or {}).get("drafter_version")
    return {"tensors": tensors, "version": version}, (own or layers)


# What the written drafter accepts when it loads (EagleDrafter, SuffixDrafter, MedusaDrafter):
# a value outside these ranges would train for hours and then write a drafter that fails to load.
_TREE_RANGES = {"eagle": {"tree_width": (1, 16), "tree_depth": (1, 32), "tree_nodes": (1, 255)},
                "suffix": {"tree_depth": (1, 16), "tree_nodes": (1, 255)}}
_RANGES = {"medusa_heads": (1, 16)}


def _check_options(args) -> None:
    """The checks that need neither the target nor the data, made before anything is loaded or
    written: a bad value found after the corpus is generated wastes that run (tens of minutes)."""
    ranges = {**_RANGES, **_TREE_RANGES.get(args.method, {})}
    for name in ("prompts", "max_tokens", "batch", "epochs", "draft_vocab", "intermediate_size",
                 "draft_layers", "medusa_heads", "unroll_steps", "tree_width", "tree_depth",
                 "tree_nodes", "batch_tokens", "shard_prompts", "train_tokens"):
        v = getattr(args, name)
        lo, hi = ranges.get(name, (1, None))
        if v is None or (lo <= v and (hi is None or v <= hi)):
            continue
        option = "--" + name.replace("_", "-")
        if hi is None:
            raise ValueError(f"{option} must be >= 1; got {v}")
        limit = f" (what a {args.method} drafter loads with)" if name.startswith("tree_") else ""
        raise ValueError(f"{option} must be in [{lo}, {hi}]{limit}; got {v}")
    if not (math.isfinite(args.lr) and args.lr > 0):
        raise ValueError(f"--lr must be a finite number > 0; got {args.lr}")


def _check_target_layers(args, num_layers: int, layers) -> None:
    """The options that depend on the target's layer count, checked once its config is read and
    before the corpus is generated."""
    if args.method == "draft-model" and args.draft_layers > num_layers:
        raise ValueError(f"--draft-layers must be in [1, {num_layers}] (the target's layers); "
                         f"got {args.draft_layers}")
    if layers:
        from pyspec.models.llama import feature_layers

        try:
            feature_layers(layers, num_layers)
        except ValueError as e:
            raise ValueError(f"--feature-layers {args.feature_layers}: {e}") from None


RUN_NAME = "run.json"  # what an --out folder was made from (target, method, generation options)


def _generation_options(args) -> dict:
    """The options the corpus in ``--out/data.pt`` was generated with (a prompt file by its
    content's hash)."""
    import hashlib

    opts = {"prompts": args.prompts, "prompt_set": args.prompt_set, "max_tokens": args.max_tokens,
            "batch": args.batch, "seed": args.seed, "gen_dtype": args.gen_dtype,
            "hidden": args.method != "suffix", "prompt_file": args.prompt_file}
    if args.prompt_file is not None:
        with open(args.prompt_file, "rb") as f:
            opts["prompt_file_sha256"] = hashlib.sha256(f.read()).hexdigest()
    return opts


# Generation options a rerun that reuses --out/data.pt takes from it (so that its recipe says how
# that corpus was made); the seed also orders training, so a different one is refused instead.
_ADOPTED = ("prompts", "prompt_set", "max_tokens", "batch", "gen_dtype", "prompt_file")


def _folder_record(folder: str) -> dict:
    """What a train-draft --out folder says it was made from: its run.json (``target_sha256``,
    ``method``, ``generation``), else what its drafter's manifest tells (``target_sha256``,
    ``method``); {} when it holds neither."""
    run = os.path.join(folder, RUN_NAME)
    if os.path.isfile(run):
        try:
            with open(run, encoding="utf-8") as f:
                return json.load(f)
        except (ValueError, OSError) as e:
            raise ValueError(f"{run}: not readable ({e}); delete it") from None
    cfg = os.path.join(folder, "drafter.json")
    if os.path.isfile(cfg):
        with open(cfg, encoding="utf-8") as f:
            d = json.load(f)
        return {"target_sha256": ((d.get("manifest") or {}).get("target") or {}).get("sha256"),
                "method": d.get("method")}
    return {}


def _claim_out(args, target_sha: str, data_paths, reused_data: bool) -> None:
    """``--out`` belongs to one target and method, and its data.pt to one set of generation
    options: a run that differs is refused (resuming would write the old run's data, head or
    drafter under this run's manifest), and a new folder records this run's in run.json."""
    run_path = os.path.join(args.out, RUN_NAME)
    gen_opts = _generation_options(args)
    prev = _folder_record(args.out)
    restart = "give another --out, or delete the folder to start over"
    recorded = prev.get("target_sha256")
    if recorded is not None and recorded != target_sha:
        raise ValueError(f"--out {args.out} was made for other target weights ({recorded[:12]}..."
                         f"; this target's are {target_sha[:12]}...): {restart}")
    method = prev.get("method")
    if method is not None and method != args.method:
        raise ValueError(f"--out {args.out} holds a {method} drafter; this run trains "
                         f"--method {args.method}: {restart}")
    recorded_gen = prev.get("generation") if reused_data else None
    if recorded_gen is not None and recorded_gen != gen_opts:
        diff = sorted(k for k in set(gen_opts) | set(recorded_gen)
                      if gen_opts.get(k) != recorded_gen.get(k))
        fixed = [k for k in diff if k not in _ADOPTED and not (
            k == "prompt_file_sha256" and args.prompt_file is None)]  # (the file is adopted)
        if fixed:
            raise ValueError(f"--out {args.out}/data.pt was generated with other options ("
                             f"{', '.join(fixed)} differ): {restart}, or delete data.pt to "
                             f"generate the corpus again")
        adopted = [k for k in diff if k in _ADOPTED]
        for k in adopted:  # the corpus is reused: the recipe records how it was made
            setattr(args, k, recorded_gen.get(k))
        print(f"reusing {args.out}/data.pt, generated with "
              + ", ".join(f"--{k.replace('_', '-')} {recorded_gen.get(k)}" for k in adopted)
              + " (the recipe records those); delete data.pt to generate with these options")
    for p in data_paths:  # another run's corpus: its hidden states are its target's
        folder = p if os.path.isdir(p) else os.path.dirname(os.path.abspath(p))
        other = _folder_record(folder).get("target_sha256")
        if args.method != "suffix" and not os.path.isdir(p) and other not in (None, target_sha):
            raise ValueError(f"--data {p} was generated by other target weights ({other[:12]}...; "
                             f"this target's are {target_sha[:12]}...): its hidden states are "
                             f"that target's")
    record = {"target_sha256": target_sha, "method": args.method,
              "generation": prev.get("generation") if reused_data else
              (None if data_paths else gen_opts)}
    tmp = run_path + ".tmp"
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump(record, f, indent=1)
    os.replace(tmp, run_path)


def train_draft(args) -> str:
    import pyspec
    from pyspec.train import data as D
    from pyspec.train import eagle as E

    if args.method not in METHODS:
        raise ValueError(f"--method {args.method!r} is not available; choose one of "
                         f"{', '.join(METHODS)}")
    _check_options(args)
    layers = _feature_layers(args.feature_layers)
    if layers and args.method != "eagle":
        raise ValueError("--feature-layers applies to --method eagle only")
    init = None
    if args.init_from is not None:
        init, layers = _initial_head(args, layers)
    for k, v in _METHOD_DEFAULTS.get(args.method, {}).items():
        if getattr(args, k) is None:
            setattr(args, k, v)
    if args.gen_dtype == "auto":  # the recipe records what was used
        from pyspec.train.loop import native_bf16

        args.gen_dtype = "bfloat16" if native_bf16() else "float32"
    # The input files are checked before anything is loaded or written.
    if args.prompt_file is not None and not os.path.isfile(args.prompt_file):
        raise ValueError(f"--prompt-file {args.prompt_file!r}: no such file")
    data_paths = [os.path.expanduser(p) for p in (args.data or "").split(",") if p.strip()]
    if args.data is not None and not data_paths:
        raise ValueError(f"--data names no file or folder; got {args.data!r}")
    if data_paths and args.prompt_file is not None:
        raise ValueError("--data and --prompt-file both say where the corpus comes from; give "
                         "one (--prompt-file generates a new corpus, --data reuses one)")
    for p in data_paths:
        if not (os.path.isfile(p) or os.path.isdir(p)):
            raise ValueError(f"--data: {p!r} is neither a file nor a folder (give data.pt files "
                             "or corpus drafter folders, comma-separated)")
    t0 = time.time()
    # Saved corpora are read before the target loads: a file that is not one is refused before
    # anything is loaded or written (a corpus drafter folder needs the target's vocabulary).
    data_path = os.path.join(args.out, "data.pt")
    reuse = data_paths or ([data_path] if os.path.isfile(data_path) else [])
    saved = {p: (D.load_sequences(p, "--data") if data_paths else
                 D.load_sequences(p, "--out (resuming)", f"delete {p} to generate the corpus "
                                  "again"))
             for p in reuse if not os.path.isdir(p)}
    os.makedirs(args.out, exist_ok=True)
    torch.manual_seed(args.seed)
    gen = pyspec.LLM(args.target, draft="none", dtype=args.gen_dtype, kv_cache_tokens=1024,
                     progress=True)
    _check_target_layers(args, gen.model.cfg.num_hidden_layers, layers)
    _claim_out(args, E.target_hash(gen.model_path), data_paths,
               reused_data=bool(reuse) and not data_paths)
    if reuse:
        seqs = []
        for p in reuse:
            if os.path.isdir(p):  # a corpus drafter: tokens only, features computed below
                part = D.corpus_sequences(p, gen.model.cfg.vocab_size)
                print(f"loaded {len(part)} documents from the corpus drafter {p}")
            else:
                part = saved[p]
                print(f"loaded {len(part)} generated sequences from {p}")
            seqs.extend(part)
    else:
        seqs = []
        for k, prompts in enumerate(_prompt_lists(gen, args)):  # one corpus per list
            # A corpus keeps tokens only (nothing trains on its hidden states).
            kw = dict(max_tokens=args.max_tokens, batch=args.batch, seed=args.seed,
                      hidden=args.method != "suffix")
            if args.shard_prompts:  # saved shard by shard: an interrupted run resumes
                seqs.extend(D.generate_sharded(gen, prompts, args.out, f"set{k}",
                                               shard=args.shard_prompts, **kw))
            else:
                seqs.extend(D.generate_corpus(gen, prompts, **kw))
        D.save_sequences(seqs, data_path)
        shutil.rmtree(os.path.join(args.out, "shards"), ignore_errors=True)
    if args.train_tokens is not None:
        total, count = sum(len(s.tokens) for s in seqs), len(seqs)
        seqs = D.token_subset(seqs, args.train_tokens, seed=args.seed)
        print(f"--train-tokens {args.train_tokens}: {len(seqs)} of {count} sequences, "
              f"{sum(len(s.tokens) for s in seqs)} of {total} tokens")
    # Features from one teacher-forced pass over the tokens: for other layers than the recorded
    # final one, and for a corpus drafter's documents, which have none (not needed by a corpus).
    recompute = layers or (args.method != "suffix" and any(s.hidden is None for s in seqs))
    if recompute:
        from pyspec.models.llama import feature_layers

        layers = list(feature_layers(layers, gen.model.cfg.num_hidden_layers))
        feat_path = os.path.join(args.out, "features-" + "-".join(map(str, layers)) + ".pt")
        cached = (D.load_sequences(feat_path, "--out (the feature cache)",
                                   f"delete {feat_path} to compute the features again")
                  if os.path.isfile(feat_path) else None)
        # The cache may hold other sequences than this run trains on (another --train-tokens
        # subset's, linked in by a data-scaling run): the ones it has are taken from it, and
        # only the others are computed.
        # The file written keeps what it held: a smaller run never shrinks a larger one's cache.
        by_tokens = {tuple(c.tokens): c for c in cached} if cached is not None else {}
        missing = list({tuple(s.tokens): s for s in seqs
                        if tuple(s.tokens) not in by_tokens}.values())
        found = sum(tuple(s.tokens) in by_tokens for s in seqs)
        if found:
            print(f"loaded the layer {layers} features of {found} sequences from {feat_path}")
        if missing:
            by_tokens.update((tuple(s.tokens), s)
                             for s in D.with_feature_layers(gen, missing, layers))
            D.save_sequences(list(by_tokens.values()), feat_path)
        seqs = [D.Sequence_(s.tokens, by_tokens[tuple(s.tokens)].hidden, s.num_prompt)
                for s in seqs]
        if layers == [gen.model.cfg.num_hidden_layers]:
            layers = None  # the final hidden state alone: a plain head
    n_tok = sum(len(s.tokens) for s in seqs)
    n_gen = (None if any(s.num_prompt is None for s in seqs)
             else sum(len(s.tokens) - s.num_prompt for s in seqs))
    t_data = time.time() - t0
    print(f"data: {len(seqs)} sequences, {n_tok} tokens"
          + (f" ({n_gen} generated)" if n_gen is not None else "") + f" in {t_data:.0f}s")
    if args.method == "suffix":
        return _write_corpus(args, gen, seqs, data_paths, n_tok, n_gen, t0, t_data)
    # Train against the target in float32 (its features were recorded from the generation run).
    target = pyspec.LLM(args.target, draft="none", dtype="float32", kv_cache_tokens=1024,
                        progress=False)
    # The target's generation dtype mattered if it generated the corpus or recomputed features.
    used_gen_dtype = not data_paths or bool(recompute)
    recipe = {"command": _recorded_command(args, generated=not data_paths,
                                           used_gen_dtype=used_gen_dtype),
        **_data_recipe(args, data_paths),
        **({"init_from": {"path": args.init_from, "version": init["version"]}} if init else {}),
        "sequences": len(seqs), "tokens": n_tok,
        **({"generated_tokens": n_gen} if n_gen is not None else {}),
        "epochs": args.epochs, "lr": args.lr,
        "batch_tokens": args.batch_tokens,
        **({"gen_dtype": args.gen_dtype} if used_gen_dtype else {})}
    manifest = {"drafter_version": args.version, "method": args.method,
                "target": {"path_name": os.path.basename(target.model_path.rstrip("/")),
                           "sha256": E.target_hash(target.model_path)},
                "recipe": recipe,
                "machine": f"{platform.machine()}, {os.cpu_count()} CPUs, torch {torch.__version__}"}
    if args.method == "draft-model":
        from pyspec.train import draft_model as DM

        model = DM.train(target, seqs, args.out, num_layers=args.draft_layers, epochs=args.epochs,
                         lr=args.lr, max_entries=args.batch_tokens, seed=args.seed)
        out = model.save_pretrained(target.model_path, args.out)
        recipe["draft_layers"] = args.draft_layers
        manifest.update(training_seconds=round(time.time() - t0, 1), data_seconds=round(t_data, 1))
        with open(os.path.join(out, "pyspec_manifest.json"), "w") as f:
            json.dump(manifest, f, indent=1)
        print(f"wrote {out} ({(time.time() - t0) / 60:.1f} min)")
        return out
    eos = [int(e) for e in gen.tokenizer.eos_token_ids]
    vocab = (init["tensors"]["draft_vocab"].to(torch.int64) if init else
             D.draft_vocabulary(seqs, gen.model.cfg.vocab_size, args.draft_vocab, always=eos))
    covered = float(D.token_counts(seqs, gen.model.cfg.vocab_size)[vocab].sum()) / max(n_tok, 1)
    if args.method == "medusa":
        from pyspec.train import medusa as M

        heads = M.train(target, seqs, args.out, num_heads=args.medusa_heads, draft_vocab=vocab,
                        epochs=args.epochs, lr=args.lr, max_entries=args.batch_tokens,
                        seed=args.seed)
        recipe.update(medusa_heads=args.medusa_heads, loss_vocab=int(vocab.numel()),
                      loss_vocab_token_coverage=round(covered, 4))
        manifest.update(training_seconds=round(time.time() - t0, 1), data_seconds=round(t_data, 1))
        out = M.write_drafter(heads, args.out, manifest=manifest)
        print(f"wrote {out} ({(time.time() - t0) / 60:.1f} min)")
        return out
    head = E.train(target, seqs, args.out, draft_vocab=vocab,
                   intermediate_size=args.intermediate_size, epochs=args.epochs, lr=args.lr,
                   max_entries=args.batch_tokens, steps=args.unroll_steps, seed=args.seed,
                   feature_layers=layers, init=init["tensors"] if init else None)
    recipe.update(draft_vocab=int(vocab.numel()), draft_vocab_token_coverage=round(covered, 4),
                  intermediate_size=args.intermediate_size, unroll_steps=args.unroll_steps,
                  **({"feature_layers": layers} if layers else {}))
    t_total = time.time() - t0
    manifest.update(training_seconds=round(t_total, 1), data_seconds=round(t_data, 1))
    out = E.write_drafter(head, args.out, manifest=manifest, width=args.tree_width,
                          max_depth=args.tree_depth, max_nodes=args.tree_nodes)
    print(f"wrote {out} ({t_total / 60:.1f} min)")
    return out


def _write_corpus(args, gen, seqs, data_paths, n_tok, n_gen, t0, t_data) -> str:
    """--method suffix: the generated sequences become a corpus drafter's datastore."""
    from pyspec.drafters.suffix import save_corpus
    from pyspec.train import eagle as E

    recipe = {"command": _recorded_command(args, generated=not data_paths,
                                           used_gen_dtype=not data_paths),
              **_data_recipe(args, data_paths),
              **({} if data_paths else {"gen_dtype": args.gen_dtype}),
              "sequences": len(seqs), "tokens": n_tok,
              **({"generated_tokens": n_gen} if n_gen is not None else {})}
    manifest = {"drafter_version": args.version, "method": "suffix",
                "target": {"path_name": os.path.basename(gen.model_path.rstrip("/")),
                           "sha256": E.target_hash(gen.model_path)},
                "recipe": recipe,
                "machine": f"{platform.machine()}, {os.cpu_count()} CPUs, torch {torch.__version__}",
                "training_seconds": round(time.time() - t0, 1), "data_seconds": round(t_data, 1)}
    out = save_corpus(args.out, [s.tokens for s in seqs], gen.model.cfg.vocab_size,
                      manifest=manifest,
                      defaults={"max_depth": args.tree_depth, "max_nodes": args.tree_nodes})
    print(f"wrote {out}: a corpus of {n_tok} tokens ({(time.time() - t0) / 60:.1f} min)")
    return out


def add_parser(sub):
    p = sub.add_parser("train-draft", help="train a drafter for a target by self-distillation")
    p.add_argument("--target", default=None, help="target model folder (default: the embedded)")
    p.add_argument("--method", default="eagle",
                   help="eagle | medusa | draft-model | suffix (a corpus of the target's answers, "
                   "drafted from by longest-suffix retrieval; no training)")
    p.add_argument("--draft-layers", type=int, default=4, help="draft-model: layers")
    p.add_argument("--medusa-heads", type=int, default=4, help="medusa: heads (1..16)")
    p.add_argument("--out", required=True, help="output drafter folder (resumes if present)")
    p.add_argument("--prompts", type=int, default=2400, help="seed prompts to generate from")
    p.add_argument("--data", default=None,
                   help="reuse the generated corpora of earlier runs for this target instead of "
                   "generating one: data.pt files, or corpus drafter folders (--method suffix; "
                   "the target's features are computed by one teacher-forced pass), "
                   "comma-separated, concatenated in that order")
    p.add_argument("--prompt-set", default="diverse", type=_prompt_sets,
                   help="seed prompt templates: the 32 basic ones; diverse: those plus personas, "
                   "reasoning, science, humanities, editing and passage extraction; wide: the "
                   "diverse templates over topics, places, people and objects from larger pools; "
                   "self: requests the target writes itself after its chat template's user-turn "
                   "header (kept in DIR/self-prompts.jsonl); several comma-separated: --prompts "
                   "prompts of each, one corpus after another")
    p.add_argument("--prompt-file", default=None,
                   help="generate from these requests instead of a --prompt-set: JSONL lines with "
                   "'prompt' or MT-bench style 'turns' (what pyspec serve --prompt-log writes)")
    p.add_argument("--init-from", default=None,
                   help="eagle: start from this trained head (a drafter folder, or 'eagle' for "
                   "the shipped one) instead of from scratch; its draft vocabulary, intermediate "
                   "size and feature layers are kept")
    p.add_argument("--max-tokens", type=int, default=192)
    p.add_argument("--batch", type=int, default=64, help="generation batch size")
    p.add_argument("--shard-prompts", type=int, default=None,
                   help="generate the corpus in shards of this many prompts, each saved when "
                   "done (DIR/shards/), so an interrupted run resumes mid-generation")
    p.add_argument("--gen-dtype", default="auto", choices=["auto", "float32", "bfloat16"],
                   help="the target's dtype while it generates the corpus; auto: bfloat16 where "
                   "the CPU multiplies it natively (AMX or AVX-512 BF16), else float32 (on an "
                   "AVX2-only CPU bfloat16 generation ran at half float32's speed)")
    p.add_argument("--train-tokens", type=int, default=None,
                   help="train on whole sequences drawn at random (by --seed) until they hold "
                        "this many tokens; with one seed a smaller subset is part of a larger "
                        "one (data-scaling curves)")
    p.add_argument("--epochs", type=int, default=4)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--batch-tokens", type=int, default=None,
                   help="training tokens per optimizer step (padded; a longer sequence makes a "
                   "step of its own); default: eagle 256, medusa and draft-model 2048")
    p.add_argument("--draft-vocab", type=int, default=None,
                   help="reduced draft vocabulary size (medusa: the loss's vocabulary; default "
                   "8192, or the --init-from head's)")
    p.add_argument("--intermediate-size", type=int, default=None,
                   help="eagle: the head's MLP width (default 1024, or the --init-from head's)")
    p.add_argument("--unroll-steps", type=int, default=3,
                   help="eagle: train the head over this many of its own steps (training-time "
                   "test; 1 = teacher-forced features only)")
    p.add_argument("--feature-layers", default=None,
                   help="eagle: the target layers the head reads, comma-separated, ending with the "
                   "final one (e.g. 3,15,27,30 on a 30-layer target: EAGLE-3's fused low, middle "
                   "and high features); default: the final hidden state only")
    p.add_argument("--tree-width", type=int, default=4)
    p.add_argument("--tree-depth", type=int, default=None,
                   help="draft tree depth (eagle: 5, suffix: 8)")
    p.add_argument("--tree-nodes", type=int, default=None,
                   help="draft tree nodes (eagle: 24, suffix: 8)")
    p.add_argument("--version", default="1")
    p.add_argument("--seed", type=int, default=0)
    p.set_defaults(func=lambda a: (train_draft(a), 0)[1])
    return p


def synth_prompts(args) -> dict:
    """``pyspec synth-prompts``: the target's own requests to a JSONL file (resumable), and a
    report of their diversity and overlap with ``--reference``."""
    import pyspec
    from pyspec.train.evaluate import read_prompts
    from pyspec.train.prompts import check_synthesis, diversity_report, synthesize_prompts

    check_synthesis(args.n, batch=args.batch, max_tokens=args.max_tokens,
                    temperature=args.temperature, min_words=args.min_words, max_words=args.max_words,
                    min_latin=args.min_latin, near_duplicate=args.near_duplicate, flags=True)
    reference = ([text for _, text in read_prompts(args.reference, flag="--reference")]
                 if args.reference else [])
    folder = os.path.dirname(os.path.abspath(args.out))
    if os.path.isdir(args.out) or not os.path.isdir(folder):  # before the model loads
        raise ValueError(f"--out {args.out}: must be a file in a folder that exists ({folder})")
    llm = pyspec.LLM(args.target, draft="none", dtype=args.dtype, progress=True)
    run = synthesize_prompts(llm, args.n, out=args.out, seed=args.seed, batch=args.batch,
                             max_tokens=args.max_tokens, temperature=args.temperature,
                             near_duplicate=args.near_duplicate, min_latin=args.min_latin,
                             min_words=args.min_words, max_words=args.max_words)
    prompts = run.pop("prompts")
    report = {"command": " ".join(["pyspec synth-prompts"] + [
        f"--{k.replace('_', '-')} {v}" for k, v in sorted(vars(args).items())
        if k not in ("func", "command") and v is not None]),
              "run": run,
              "diversity": diversity_report(prompts, reference) if prompts else None}
    path = args.report or os.path.splitext(args.out)[0] + ".report.json"
    with open(path, "w") as f:
        json.dump(report, f, indent=1)
    print(f"{run['kept']} requests in {args.out} ({run['new']} new in {run['seconds']} s: "
          f"{run['prompts_per_hour']} prompts/hour, {run['tokens_per_hour']} generated "
          f"tokens/hour); dropped {run['dropped']}; report {path}")
    return report


def add_synth_parser(sub):
    p = sub.add_parser("synth-prompts", help="the target writes its own requests (Magpie-style), "
                       "filtered and deduplicated, to JSONL")
    p.add_argument("--target", default=None, help="target model folder (default: the embedded)")
    p.add_argument("--n", type=int, required=True, help="requests wanted in --out")
    p.add_argument("--out", required=True, help="JSONL file (appended; a rerun resumes)")
    p.add_argument("--report", default=None, help="report JSON (default: OUT.report.json)")
    p.add_argument("--reference", default=None,
                   help="prompts the set must not resemble (JSONL; e.g. MT-bench questions)")
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--near-duplicate", type=float, default=0.7,
                   help="word 3-gram Jaccard similarity at which a request counts as a copy")
    p.add_argument("--min-words", type=int, default=4, help="shortest request kept (words)")
    p.add_argument("--max-words", type=int, default=200, help="longest request kept (words)")
    p.add_argument("--min-latin", type=float, default=0.9,
                   help="least share of a request's letters in the Latin script (a language "
                   "filter; 0: none)")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    p.add_argument("--seed", type=int, default=0)
    p.set_defaults(func=lambda a: (synth_prompts(a), 0)[1])
    return p
