"""What a `pyspec serve` process is made of: its flags and their checks, the server built from
them, config reloads (SIGHUP, `--watch-config`). The command itself: :mod:`pyspec.serve.command`."""

from __future__ import annotations

import hashlib
import logging
import math
import os
import threading
from typing import Optional, Tuple

from pyspec.cli_flags import add_model_flags

log = logging.getLogger("pyspec.serve")


def build(args):
    import pyspec
    from pyspec.serve.app import create_app
    from pyspec.serve.config import load_config
    from pyspec.serve.rollback import PREVIOUS_DRAFTER

    cfg = load_config(args.config, getattr(args, "region", None))
    spec = cfg.speculative
    model = args.model or (None if spec.target_model == "default" else spec.target_model)
    from pyspec.drafters.foreign import settings_from_args

    foreign = settings_from_args(args)  # vLLM / SGLang spellings: the YAML's drafter replaced
    draft = foreign.draft if foreign else (args.draft or spec.draft_model)
    if spec.tree_width > 1 and not foreign:
        draft = with_tree_width(draft, spec.tree_width)
    sc = pyspec.SpecConfig(**{"num_speculative_tokens": spec.gamma, "adaptive": spec.adaptive,
                              "fallback_on_alpha_below": spec.fallback_on_alpha_below,
                              "long_prompt_tokens": spec.long_prompt_tokens,
                              "long_prompt_draft": spec.long_prompt_draft,
                              "predictor": spec.predictor,
                              "predictor_min_acceptance": spec.predictor_min_acceptance,
                              **(foreign.spec_config_fields() if foreign else {})})
    if spec.previous_draft_model:  # kept loaded for the drafter rollback
        sc.drafters = {**sc.drafters, PREVIOUS_DRAFTER: spec.previous_draft_model}
    options = serve_options(args)  # (checked before the model loads)
    llm = pyspec.LLM(model, draft, sc, dtype=args.dtype, kv_cache_tokens=args.kv_cache_tokens,
                     device=getattr(args, "device", "cpu"),
                     packed_weights=getattr(args, "packed_weights", "codes"),
                     tensor_parallel_size=getattr(args, "tensor_parallel_size", 1),
                     attention_backend=getattr(args, "attention_backend", "native"),
                     cuda_graphs=getattr(args, "cuda_graphs", False),
                     kv_cache_dtype=getattr(args, "kv_cache_dtype", "auto"),
                     max_num_seqs=args.max_num_seqs,
                     max_num_batched_tokens=args.max_num_batched_tokens,
                     max_prefill_chunk=args.max_prefill_chunk)
    from pyspec.serve.tracing import tracer_from_env

    app = create_app(llm, cfg, model_name=args.served_model_name,
                     prompt_log=args.prompt_log, prompt_log_ratio=args.prompt_log_ratio,
                     tracer=tracer_from_env(args.otlp_endpoint), shadow_draft=args.shadow_draft,
                     shadow_ratio=args.shadow_ratio,
                     max_body_bytes=int(args.max_body_mb * (1 << 20)), options=options)
    return llm, app


def _list(v: Optional[str]) -> Tuple[str, ...]:
    return tuple(x.strip() for x in (v or "").split(",") if x.strip())


def serve_options(args):
    """The :class:`ServeOptions` of ``pyspec serve``'s flags. The API key comes from
    ``--api-key`` or ``PYSPEC_API_KEY``; the Host check defaults to the loopback names when the
    server listens on a loopback address (a web page cannot then reach it through a rebinding DNS
    name), to none otherwise."""
    from pyspec.serve.guard import LOOPBACK_HOSTS, AccessPolicy, host_name
    from pyspec.serve.options import ServeOptions

    key = args.api_key if args.api_key is not None else os.environ.get("PYSPEC_API_KEY") or None
    hosts = _list(args.allowed_hosts)
    if not hosts:
        hosts = LOOPBACK_HOSTS if host_name(args.host) in LOOPBACK_HOSTS else None
    else:
        hosts = tuple(host_name(h) if h != "*" else h for h in hosts)
    public = tuple("/" + p.lstrip("/") for p in _list(args.public_endpoints))
    access = AccessPolicy(api_keys=(key,) if key else (), public_paths=public,
                          allowed_origins=_list(args.allowed_origins), allowed_hosts=hosts)
    return ServeOptions(access=access, max_waiting_requests=args.max_waiting_requests,
                        request_timeout=args.request_timeout, queue_timeout=args.queue_timeout,
                        body_timeout=args.body_timeout, speculation_stats=args.speculation_stats,
                        docs=args.enable_docs, on_engine_failure=args.on_engine_failure,
                        max_engine_restarts=args.max_engine_restarts,
                        profile_dir=args.profile_dir)


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
                "fallback_on_alpha_below", "long_prompt_tokens", "long_prompt_draft", "predictor",
                "predictor_min_acceptance", "previous_draft_model")


def reload_config(app, path) -> bool:
    """SIGHUP: validate the file again and apply it to new requests (running requests keep their
    settings): ``enabled_ratio`` (also per tenant and prompt class), ``quality_gate`` and
    ``rollback`` (:meth:`Rollbacks.apply_config`; a speculation rollback ends). The keys of
    ``RESTART_KEYS`` need a restart to change; a reload keeps their old values and says so."""
    from pyspec.serve.config import ConfigError, load_config

    try:
        new = load_config(path, app.state.config["config"].region)
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
    rollbacks = getattr(app.state, "rollbacks", None)
    if rollbacks is not None:
        rollbacks.apply_config(old, new)  # (a speculation rollback ends with the old config)
    log.info("config reloaded from %s", path)
    return True


class ConfigWatcher:
    """Calls ``reload`` when the file at ``path`` changes content, looked at every ``interval``
    seconds: a Kubernetes ConfigMap volume is updated in place (an atomic symlink swap) and
    sends the process no SIGHUP. A file missing for a moment (mid-swap) is waited for."""

    def __init__(self, path: str, interval: float, reload):
        self.path, self.interval, self.reload = path, interval, reload
        self._seen = self._digest()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="pyspec-config-watch",
                                        daemon=True)

    def _digest(self) -> Optional[bytes]:
        try:
            with open(self.path, "rb") as f:
                return hashlib.sha256(f.read()).digest()
        except OSError:
            return None

    def check(self) -> bool:
        """Reload when the content differs from the last seen; True when it did."""
        d = self._digest()
        if d is None or d == self._seen:
            return False
        self._seen = d
        self.reload()
        return True

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            try:
                self.check()
            except Exception:  # noqa: BLE001 - a failed look is logged; the next one retries
                log.exception("config watch: checking %s failed", self.path)

    def start(self) -> "ConfigWatcher":
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()


def _share_option(args, name: str, needs: str, default: float, needs_what: str,
                  share_what: str) -> None:
    """A share option (--NAME, in (0, 1]) that goes with the option --NEEDS: refused without it,
    ``default`` when --NEEDS comes alone, 0.0 when neither is given."""
    attr = name.replace("-", "_")
    r = getattr(args, attr, None)
    if getattr(args, needs.replace("-", "_"), None) is None:
        if r is not None:
            raise ValueError(f"--{name} needs --{needs} {needs_what}")
        setattr(args, attr, 0.0)
        return
    r = default if r is None else r
    if not (math.isfinite(r) and 0 < r <= 1):
        raise ValueError(f"--{name} must be in (0, 1] ({share_what}); got {r}")
    setattr(args, attr, r)


def check_prompt_log(args) -> None:
    """--prompt-log-ratio only with --prompt-log, in (0, 1]; 0.01 when --prompt-log comes alone
    (a ratio of 0 would open the file and never write it)."""
    _share_option(args, "prompt-log-ratio", "prompt-log", 0.01,
                  "FILE.jsonl (where the sampled prompts go)", "the share of prompts logged")
    if args.prompt_log is None:
        return
    path = args.prompt_log
    folder = os.path.dirname(os.path.abspath(path))
    exists = os.path.exists(path)  # appending to it needs the file writable, not the folder
    if os.path.isdir(path) or not os.path.isdir(folder) or (
            not os.access(path, os.W_OK) if exists else not os.access(folder, os.W_OK)):
        raise ValueError(f"--prompt-log {path}: must be a file this process can append to, in a "
                         f"folder that exists ({folder})")


def check_server_flags(args) -> None:
    """The operational flags, checked before anything loads (one error line each)."""
    from pyspec.drafters.foreign import settings_from_args
    from pyspec.serve.http import check_server_settings

    serve_options(args)
    settings_from_args(args)
    check_server_settings(header_timeout=args.header_timeout,
                          keep_alive_timeout=args.keep_alive_timeout,
                          drain_timeout=args.drain_timeout, ssl_keyfile=args.ssl_keyfile,
                          ssl_certfile=args.ssl_certfile)
    for flag, lo in (("max_num_seqs", 1), ("max_num_batched_tokens", 1),
                     ("max_prefill_chunk", 0), ("max_engine_restarts", 0)):
        if getattr(args, flag) < lo:
            raise ValueError(f"--{flag.replace('_', '-')} must be >= {lo}; got "
                             f"{getattr(args, flag)}")
    if not (math.isfinite(args.max_body_mb) and args.max_body_mb * (1 << 20) >= 1):
        raise ValueError(f"--max-body-mb must be a number > 0; got {args.max_body_mb}")
    if not 0 <= args.port <= 65535:
        raise ValueError(f"--port must be in [0, 65535]; got {args.port}")
    _share_option(args, "shadow-ratio", "shadow-draft", 0.1,
                  "SPEC (the drafter it mirrors traffic to)", "the share of traffic mirrored")
    if getattr(args, "region", None) is not None and not args.config:
        raise ValueError("--region needs --config FILE (its regions.<REGION> overrides)")
    if not getattr(args, "served_model_name", "pyspec"):
        raise ValueError("--served-model-name must not be empty (clients send it as 'model')")
    profile_dir = getattr(args, "profile_dir", None)
    if profile_dir is not None and os.path.exists(profile_dir) and not os.path.isdir(profile_dir):
        raise ValueError(f"--profile-dir {profile_dir}: exists and is not a folder")
    w = getattr(args, "watch_config", None)
    if w is not None:
        if not args.config:
            raise ValueError("--watch-config needs --config FILE (the file it watches)")
        if not (math.isfinite(w) and w > 0):
            raise ValueError(f"--watch-config must be a number of seconds > 0; got {w}")


def parse_serve_flags(flags):
    """``pyspec serve``'s flags (without the command name) parsed and checked as the server
    checks them before loading anything."""
    import argparse

    p = argparse.ArgumentParser(prog="pyspec serve")
    add_serve_flags(p)
    args = p.parse_args(list(flags))
    check_prompt_log(args)
    check_server_flags(args)
    return args


def add_serve_flags(p) -> None:
    """The flags of ``pyspec serve`` (the command itself: :mod:`pyspec.serve.command`)."""
    p.add_argument("--config", default=None, help="YAML config (see README); SIGHUP reloads it")
    p.add_argument("--watch-config", type=float, default=None, metavar="SECONDS",
                   help="also reload --config when its content changes, looked at every SECONDS "
                        "(a Kubernetes ConfigMap volume changes without a signal)")
    p.add_argument("--region", default=None,
                   help="this server's region: the config's regions.<REGION> overrides apply")
    p.add_argument("--model", default=None, help="model folder (default: config / embedded)")
    p.add_argument("--draft", default=None, help="drafter spec (default: config / 'default')")
    p.add_argument("--served-model-name", default="pyspec")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    add_model_flags(p, tensor_parallel=True)
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
    p.add_argument("--shadow-ratio", type=float, default=None,
                   help="share of traffic mirrored (with --shadow-draft; default 0.1)")
    p.add_argument("--otlp-endpoint", default=None,
                   help="export OpenTelemetry traces here (default: OTEL_EXPORTER_OTLP_ENDPOINT; "
                        "unset = no tracing)")
    g = p.add_argument_group("replicas on Ray Serve (docs/scaling.md)")
    g.add_argument("--ray", action="store_true",
                   help="serve engine replicas on Ray Serve behind one HTTP endpoint")
    g.add_argument("--replicas", type=int, default=None,
                   help="engine replicas (with --ray; default 1)")
    g.add_argument("--replica-cpus", type=float, default=1.0,
                   help="CPUs Ray reserves per replica (also its engine's threads)")
    g.add_argument("--ray-address", default=None,
                   help="a running Ray cluster to join (default: start one here)")
    g.add_argument("--ray-autoscaling", default=None, metavar="JSON",
                   help="Ray Serve autoscaling instead of --replicas, e.g. "
                        "'{\"min_replicas\": 1, \"max_replicas\": 4, "
                        "\"target_ongoing_requests\": 8}'")
    g = p.add_argument_group("engine limits")
    g.add_argument("--max-num-seqs", type=int, default=64,
                   help="requests holding KV (running) at once")
    g.add_argument("--max-num-batched-tokens", type=int, default=2048,
                   help="tokens run per engine step")
    g.add_argument("--max-prefill-chunk", type=int, default=512,
                   help="most prompt tokens of one request per step, so short requests and "
                        "decoding go on between a long prompt's chunks (0: no limit)")
    g = p.add_argument_group("admission and deadlines")
    g.add_argument("--max-waiting-requests", type=int, default=None,
                   help="queued requests past which new ones get 503 + Retry-After (default: "
                        "no limit)")
    g.add_argument("--request-timeout", type=float, default=None,
                   help="seconds a request may take (and the most its 'timeout' field may "
                        "ask); past it: 504")
    g.add_argument("--queue-timeout", type=float, default=None,
                   help="seconds a request may wait for its first token; past it: 503")
    g.add_argument("--no-access-log", action="store_true",
                   help="no log line per request (default: method, path and status of each, at "
                        "INFO on the uvicorn.access logger; with --ray, Ray Serve logs requests)")
    g.add_argument("--header-timeout", type=float, default=10.0,
                   help="seconds a connection has to send a request's headers")
    g.add_argument("--body-timeout", type=float, default=30.0,
                   help="seconds a client has to send a request's body (past it: 408)")
    g.add_argument("--keep-alive-timeout", type=float, default=5.0,
                   help="seconds an idle keep-alive connection stays open")
    g.add_argument("--drain-timeout", type=float, default=30.0,
                   help="on SIGTERM: seconds running requests may finish in; then they get 503")
    g.add_argument("--on-engine-failure", choices=["restart", "exit"], default="restart",
                   help="after an engine failure: abort everything and serve on (at most "
                        "--max-engine-restarts times), or exit with status 3")
    g.add_argument("--max-engine-restarts", type=int, default=3)
    g.add_argument("--profile-dir", default=None,
                   help="a folder for kernel-level profiles of engine steps (Chrome traces), "
                        "recorded on request: POST /admin/profile {\"steps\": N} (a server-wide "
                        "key when keys are on); default: off")
    g = p.add_argument_group("access")
    g.add_argument("--api-key", default=None,
                   help="require 'Authorization: Bearer KEY' (default: $PYSPEC_API_KEY; tenant "
                        "keys go in the config)")
    g.add_argument("--public-endpoints", default="/health,/ready",
                   help="comma-separated paths served without a key (e.g. add /metrics)")
    g.add_argument("--allowed-origins", default="",
                   help="comma-separated browser origins allowed (CORS), or *; default none: "
                        "requests from web pages are refused")
    g.add_argument("--allowed-hosts", default="",
                   help="comma-separated Host names answered, or *; default: localhost names "
                        "when --host is a loopback address, any otherwise")
    g.add_argument("--ssl-keyfile", default=None, help="TLS private key (PEM)")
    g.add_argument("--ssl-certfile", default=None, help="TLS certificate chain (PEM)")
    g.add_argument("--enable-docs", action="store_true",
                   help="serve /docs, /redoc and /openapi.json")
    g.add_argument("--speculation-stats", action="store_true",
                   help="add each response's 'speculation' field (acceptance statistics; off by "
                        "default: they can reveal what other clients sent)")
    from pyspec.drafters.foreign import add_flags as add_foreign_flags

    add_foreign_flags(p)
