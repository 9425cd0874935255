"""``pyspec serve``: load the model (+ drafter) and serve it over HTTP (uvicorn)."""

from __future__ import annotations

import logging
import math
import signal

from pyspec.cli_flags import add_model_flags

log = logging.getLogger("pyspec.serve")


def build(args):
    import pyspec
    from pyspec.serve.app import create_app
    from pyspec.serve.config import load_config

    cfg = load_config(args.config)
    spec = cfg.speculative
    model = args.model or (None if spec.target_model == "default" else spec.target_model)
    draft = args.draft or spec.draft_model
    if spec.tree_width > 1:
        draft = with_tree_width(draft, spec.tree_width)
    sc = pyspec.SpecConfig(num_speculative_tokens=spec.gamma, adaptive=spec.adaptive,
                           fallback_on_alpha_below=spec.fallback_on_alpha_below)
    llm = pyspec.LLM(model, draft, sc, dtype=args.dtype, kv_cache_tokens=args.kv_cache_tokens,
                     device=getattr(args, "device", "cpu"),
                     packed_weights=getattr(args, "packed_weights", "auto"))
    from pyspec.serve.tracing import tracer_from_env

    app = create_app(llm, cfg, model_name=args.served_model_name,
                     prompt_log=args.prompt_log, prompt_log_ratio=args.prompt_log_ratio,
                     tracer=tracer_from_env(args.otlp_endpoint), shadow_draft=args.shadow_draft,
                     shadow_ratio=args.shadow_ratio,
                     max_body_bytes=int(args.max_body_mb * (1 << 20)))
    return llm, app


def with_tree_width(draft: str, width: int) -> str:
    """``speculative.tree_width`` > 1: top-``width`` dynamic trees for a draft-model folder
    (``DIR@tree=W``). Other drafters size their trees with their own options, so the key is
    refused for them rather than ignored."""
    from pyspec.drafters import is_draft_model_folder

    if "@" not in draft and is_draft_model_folder(draft):
        return f"{draft}@tree={width}"
    raise ValueError(f"speculative.tree_width={width} applies to a draft-model folder (a model "
                     f"with the target's vocabulary) given without @options; the drafter is "
                     f"{draft!r}: set tree_width to 1 and size its trees with its own @options "
                     "(e.g. eagle@width=3,depth=2,nodes=8)")


# Keys read once, when the engine is built: a reload keeps their old values.
RESTART_KEYS = ("target_model", "draft_model", "gamma", "tree_width", "adaptive",
                "fallback_on_alpha_below")


def reload_config(app, path) -> bool:
    """SIGHUP: validate the file again and apply it to new requests (running requests keep their
    settings): ``enabled_ratio`` (also per tenant) and ``quality_gate``. The keys of
    ``RESTART_KEYS`` need a restart to change; a reload keeps their old values and says so."""
    from pyspec.serve.config import ConfigError, load_config

    try:
        new = load_config(path)
    except ConfigError as e:
        log.error("config reload failed, keeping the old config: %s", e)
        return False
    old = app.state.config["config"]
    kept = [k for k in RESTART_KEYS
            if getattr(new.speculative, k) != getattr(old.speculative, k)]
    if kept:
        log.error("config reload: changes to speculative.%s need a restart (the engine reads "
                  "them once); the rest is applied", ", speculative.".join(kept))
        for k in kept:
            setattr(new.speculative, k, getattr(old.speculative, k))
    app.state.config["config"] = new
    gate = getattr(app.state, "quality_gate", None)
    if gate is not None:
        gate.rolled_back = False  # a new config decides again
    log.info("config reloaded from %s", path)
    return True


def check_prompt_log(args) -> None:
    """--prompt-log-ratio only with --prompt-log, in (0, 1]; 0.01 when --prompt-log comes alone
    (a ratio of 0 would open the file and never write it)."""
    r = args.prompt_log_ratio
    if args.prompt_log is None:
        if r is not None:
            raise ValueError("--prompt-log-ratio needs --prompt-log FILE.jsonl (where the sampled "
                             "prompts go)")
        args.prompt_log_ratio = 0.0
        return
    if r is None:
        args.prompt_log_ratio = 0.01
    elif not (math.isfinite(r) and 0 < r <= 1):
        raise ValueError(f"--prompt-log-ratio must be in (0, 1] (the share of prompts logged); "
                         f"got {r}")


def cmd_serve(args) -> int:
    import uvicorn

    check_prompt_log(args)
    if not (math.isfinite(args.max_body_mb) and args.max_body_mb * (1 << 20) >= 1):
        raise ValueError(f"--max-body-mb must be a number > 0; got {args.max_body_mb}")
    if not 0 <= args.port <= 65535:
        raise ValueError(f"--port must be in [0, 65535]; got {args.port}")
    logging.basicConfig(level=logging.INFO)
    llm, app = build(args)
    if args.config:
        signal.signal(signal.SIGHUP, lambda *_: reload_config(app, args.config))
    print(f"serving {llm.model_path} as '{args.served_model_name}' with drafter "
          f"{llm.drafter_name} on http://{args.host}:{args.port}", flush=True)
    uvicorn.run(app, host=args.host, port=args.port, log_level="warning")
    return 0


def add_parser(sub):
    p = sub.add_parser("serve", help="OpenAI-compatible HTTP server (continuous batching)")
    p.add_argument("--config", default=None, help="YAML config (see README); SIGHUP reloads it")
    p.add_argument("--model", default=None, help="model folder (default: config / embedded)")
    p.add_argument("--draft", default=None, help="drafter spec (default: config / 'default')")
    p.add_argument("--served-model-name", default="pyspec")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    add_model_flags(p)
    p.add_argument("--kv-cache-tokens", type=int, default=16384)
    p.add_argument("--prompt-log", default=None,
                   help="append a sampled share of prompts to this JSONL (eval-draft replays it)")
    p.add_argument("--prompt-log-ratio", type=float, default=None,
                   help="share of prompts logged, in (0, 1] (default with --prompt-log: 0.01)")
    p.add_argument("--max-body-mb", type=float, default=16.0,
                   help="largest request body accepted, in MiB (larger: 413)")
    p.add_argument("--shadow-draft", default=None,
                   help="shadow mode: a candidate drafter run on mirrored traffic (responses "
                        "untouched); metrics labelled drafter=\"candidate\"")
    p.add_argument("--shadow-ratio", type=float, default=0.1, help="share of traffic mirrored")
    p.add_argument("--otlp-endpoint", default=None,
                   help="export OpenTelemetry traces here (default: OTEL_EXPORTER_OTLP_ENDPOINT; "
                        "unset = no tracing)")
    p.set_defaults(func=cmd_serve)
    return p
