"""``pyspec serve --ray``: replicas of the pyspec server on Ray Serve.

Two deployments. ``PyspecEngine`` replicas each hold one engine (its own KV pool) and run the
very app ``pyspec serve`` runs, in process; ``PyspecIngress`` takes HTTP from Ray's proxy and
forwards each request, whole, to an engine replica through a deployment handle, streaming the
answer back. The handle call carries the request's prompt text, so Ray's
``PrefixCacheAffinityRouter`` (where this Ray has it) sends requests sharing a prefix to the
replica that holds it in its prefix cache. Replicas push their Prometheus registry to a small
actor every ``PUSH_SECONDS``; the ingress's ``/metrics`` serves them all, each sample labelled
``replica``. A replica that dies ends its streams with an error event (``replica_failed``) and
its not-yet-started requests with a 503; the others go on, and Ray starts a new replica.

Importable for ``serve run``::

    serve run pyspec.serve.ray_app:app_builder args="--model DIR --draft ngram" replicas=2
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import math
import shlex
import time
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Tuple

from pyspec.serve.protocol import RequestError, error_response, sse

log = logging.getLogger("pyspec.serve")

HUB = "pyspec-metrics-hub"  # the named actor replicas push their metrics to
PUSH_SECONDS = 2.0
STALE_SECONDS = 15.0  # a replica silent this long (gone) leaves /metrics
PROMPT_CHARS = 4096  # of a prompt, what the prefix router sees
ROUTER_TREE_CHARS = 4 << 20
ROUTER_IMBALANCE = 4  # queue lengths further apart than this: routed by load, not by prefix
MAX_BODY_BYTES = 64 << 20  # the ingress buffers a body (the engine's own limit is applied after)
AUTOSCALING_KEYS = ("min_replicas", "max_replicas", "initial_replicas", "target_ongoing_requests",
                    "upscale_delay_s", "downscale_delay_s", "metrics_interval_s",
                    "look_back_period_s")
GENERATE_PATHS = ("/v1/completions", "/v1/chat/completions")


@dataclass
class HTTPCall:
    """One HTTP request, forwarded from the ingress to an engine replica. ``prompt``: its prompt
    text (chat: the messages' contents), read by the prefix-affinity router."""

    method: str
    path: str
    query_string: bytes
    headers: List[Tuple[bytes, bytes]]
    body: bytes
    client: Optional[Tuple[str, int]] = None
    prompt: str = field(default="")


def prompt_text(method: str, path: str, body: bytes) -> str:
    """What the prefix router matches a request by: the prompt of a completion or chat request
    as text (token ids as their decimal spelling), at most ``PROMPT_CHARS``; "" for anything
    else (other endpoints, a body that is not a well-formed request: the engine answers those
    with its own error), which the router routes by load."""
    if path not in GENERATE_PATHS:
        return ""
    try:
        req = json.loads(body)
        if path.endswith("/chat/completions"):
            parts = []
            for m in req.get("messages") or []:
                c = m.get("content") if isinstance(m, dict) else None
                if isinstance(c, str):
                    parts.append(c)
                elif isinstance(c, list):
                    parts.extend(p["text"] for p in c
                                 if isinstance(p, dict) and isinstance(p.get("text"), str))
            text = "\n".join(parts)
        else:
            p = req.get("prompt")
            if isinstance(p, list) and p and isinstance(p[0], (list, str)):
                p = p[0]  # a batch of prompts: routed by its first
            if isinstance(p, list):
                text = " ".join(str(t) for t in p)
            else:
                text = p if isinstance(p, str) else ""
    except (ValueError, TypeError, AttributeError):
        return ""
    return text[:PROMPT_CHARS]


def check_ray_flags(args) -> None:
    """The flags of ``--ray`` (and the ones it cannot honour), before anything starts."""
    if not args.ray:
        for flag in ("replicas", "ray_address", "ray_autoscaling"):
            if getattr(args, flag) is not None:
                raise ValueError(f"--{flag.replace('_', '-')} applies with --ray only")
        return
    if args.ssl_keyfile or args.ssl_certfile:
        raise ValueError("--ray serves through Ray's HTTP proxy, which this server does not "
                         "configure for TLS: terminate TLS in front of it, or drop --ray")
    if args.shadow_draft:
        raise ValueError("--shadow-draft is not available with --ray (each replica would run "
                         "its own shadow); run shadow mode on a single server")
    if getattr(args, "tensor_parallel_size", 1) != 1:
        raise ValueError("--tensor-parallel-size is not available with --ray: a replica is one "
                         "process; split the model on a single server, or add replicas")
    if args.prompt_log:
        raise ValueError("--prompt-log is not available with --ray (every replica would append "
                         "to the file); log prompts on a single server")
    from pyspec.serve.cli import add_serve_flags

    defaults = argparse.ArgumentParser()
    add_serve_flags(defaults)
    for flag in ("header_timeout", "keep_alive_timeout", "body_timeout"):
        if getattr(args, flag) != defaults.get_default(flag):
            raise ValueError(f"--{flag.replace('_', '-')} is not available with --ray: Ray's "
                             "HTTP proxy holds the connections (its own timeouts apply)")
    if args.replicas is not None and args.replicas < 1:
        raise ValueError(f"--replicas must be >= 1; got {args.replicas}")
    if not (math.isfinite(args.replica_cpus) and args.replica_cpus > 0):
        raise ValueError(f"--replica-cpus must be a number > 0; got {args.replica_cpus}")
    if args.ray_autoscaling is not None:
        if args.replicas is not None:
            raise ValueError("give --replicas or --ray-autoscaling, not both")
        autoscaling_config(args.ray_autoscaling)


def autoscaling_config(text: str) -> dict:
    """``--ray-autoscaling``: a JSON object of Ray Serve autoscaling keys (checked)."""
    try:
        cfg = json.loads(text)
    except ValueError as e:
        raise ValueError(f"--ray-autoscaling must be a JSON object: {e}") from None
    if not isinstance(cfg, dict) or not cfg:
        raise ValueError("--ray-autoscaling must be a non-empty JSON object, e.g. "
                         '\'{"min_replicas": 1, "max_replicas": 4, "target_ongoing_requests": 8}\'')
    unknown = sorted(set(cfg) - set(AUTOSCALING_KEYS))
    if unknown:
        raise ValueError(f"--ray-autoscaling: unknown keys {unknown}; allowed: "
                         f"{list(AUTOSCALING_KEYS)}")
    for k, v in cfg.items():
        whole = k.endswith("_replicas")
        if isinstance(v, bool) or not isinstance(v, int if whole else (int, float)) or v < 0 \
                or (k == "target_ongoing_requests" and v <= 0):
            want = ("a whole number >= 0" if whole else "a number > 0"
                    if k == "target_ongoing_requests" else "a number of seconds >= 0")
            raise ValueError(f"--ray-autoscaling: {k} must be {want}; got {v!r}")
    lo, hi = cfg.get("min_replicas", 0), cfg.get("max_replicas", 1)
    if hi < max(1, lo):
        raise ValueError(f"--ray-autoscaling: max_replicas must be >= max(1, min_replicas); "
                         f"got max_replicas={hi}, min_replicas={lo}")
    return cfg


# ---- the engine replica ----------------------------------------------------------------------


class EngineReplica:
    """One engine and the app ``pyspec serve`` runs, driven in process over ASGI."""

    def __init__(self, args):
        from pyspec.serve import cli as serve_cli

        self.args = args
        self._watcher = None
        if args.config and args.watch_config:  # (its first look before the build reads the file)
            self._watcher = serve_cli.ConfigWatcher(
                args.config, args.watch_config,
                lambda: serve_cli.reload_config(self.app, args.config))
        self.llm, self.app = serve_cli.build(args)
        self._started = None  # the lifespan (engine thread) once started, on the replica's loop
        self._lock = asyncio.Lock()
        self._pusher = None
        if self._watcher is not None:
            self._watcher.start()

    @staticmethod
    def replica_id() -> str:
        from ray import serve

        try:
            return serve.get_replica_context().replica_id.unique_id
        except Exception:  # noqa: BLE001 - outside a replica (tests): one name
            return "local"

    async def _ensure_started(self) -> None:
        async with self._lock:
            if self._started is None:
                ctx = self.app.router.lifespan_context(self.app)
                await ctx.__aenter__()
                self._started = ctx
                self._pusher = asyncio.ensure_future(self._push_metrics())

    async def _push_metrics(self) -> None:
        from prometheus_client import generate_latest

        rid = self.replica_id()
        name = hub_name(app_name())
        hub = None
        while True:
            try:
                if hub is None:
                    hub = metrics_hub(name)
                await hub.put.remote(rid, generate_latest(self.app.state.metrics.registry))
            except Exception:  # noqa: BLE001 - the hub went with its owner: a new one next time
                hub = None
            await asyncio.sleep(PUSH_SECONDS)

    async def check_health(self) -> None:
        """Ray's health check, as ``/health``: a replica whose engine is down is replaced."""
        await self._ensure_started()
        loop_ = self.app.state.engine_loop
        if not loop_.healthy:
            raise RuntimeError(f"the engine is not serving: {loop_.failure}")

    async def forward(self, call: HTTPCall):
        """Run ``call`` through the app; yields ("start", status, headers), then ("body",
        bytes) chunks. Cancelled (the client went away): the app sees a disconnect."""
        await self._ensure_started()
        out: asyncio.Queue = asyncio.Queue()
        gone = asyncio.Event()
        sent = False

        async def receive():
            nonlocal sent
            if not sent:
                sent = True
                return {"type": "http.request", "body": call.body, "more_body": False}
            await gone.wait()
            return {"type": "http.disconnect"}

        async def send(message):
            await out.put(message)

        scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1",
                 "method": call.method, "scheme": "http", "path": call.path, "raw_path":
                 call.path.encode(), "root_path": "", "query_string": call.query_string,
                 "headers": call.headers, "client": call.client, "server": ("ray", 0)}
        task = asyncio.ensure_future(self.app(scope, receive, send))
        rid = self.replica_id().encode()
        try:
            while True:
                get = asyncio.ensure_future(out.get())
                await asyncio.wait({get, task}, return_when=asyncio.FIRST_COMPLETED)
                if not get.done():
                    get.cancel()
                    if out.empty():
                        task.result()  # the app's own error, if it raised
                        return
                    continue
                msg = get.result()
                if msg["type"] == "http.response.start":
                    headers = list(msg.get("headers", [])) + [(b"x-pyspec-replica", rid)]
                    yield ("start", msg["status"], headers)
                elif msg["type"] == "http.response.body":
                    if msg.get("body"):
                        yield ("body", bytes(msg["body"]))
                    if not msg.get("more_body", False):
                        return
        finally:
            gone.set()
            if not task.done():
                try:
                    await asyncio.wait_for(task, timeout=5)
                except Exception:  # noqa: BLE001 - the app's end after a disconnect
                    task.cancel()

    def __del__(self):
        """Ray's graceful shutdown (after its drain of running requests): stop the engine."""
        if getattr(self, "_watcher", None) is not None:
            self._watcher.stop()
        if getattr(self, "_started", None) is not None:
            self.app.state.engine_loop.stop()


# ---- the ingress -----------------------------------------------------------------------------


class MetricsHub:
    """Where replicas leave their latest Prometheus text (a Ray actor)."""

    def __init__(self):
        self._texts: Dict[str, Tuple[float, bytes]] = {}

    def put(self, replica: str, text: bytes) -> None:
        self._texts[replica] = (time.monotonic(), text)

    def snapshot(self) -> Dict[str, bytes]:
        now = time.monotonic()
        self._texts = {r: v for r, v in self._texts.items() if now - v[0] < STALE_SECONDS}
        return {r: v[1] for r, v in self._texts.items()}


def merge_metrics(texts: Dict[str, bytes]) -> bytes:
    """The replicas' exposition texts as one, every sample labelled ``replica``."""
    from prometheus_client import CollectorRegistry, generate_latest
    from prometheus_client.metrics_core import Metric
    from prometheus_client.parser import text_string_to_metric_families
    from prometheus_client.samples import Sample

    families: Dict[str, Metric] = {}
    for replica in sorted(texts):
        for fam in text_string_to_metric_families(texts[replica].decode()):
            m = families.get(fam.name)
            if m is None:
                m = families[fam.name] = Metric(fam.name, fam.documentation, fam.type, fam.unit)
            for s in fam.samples:
                m.samples.append(Sample(s.name, {**s.labels, "replica": replica}, s.value,
                                        s.timestamp, s.exemplar))
    live = Metric("pyspec_replicas", "Engine replicas reporting metrics", "gauge")
    live.samples.append(Sample("pyspec_replicas", {}, float(len(texts)), None, None))
    families["pyspec_replicas"] = live

    class _Collector:
        def collect(self):
            return list(families.values())

    registry = CollectorRegistry(auto_describe=False)
    registry.register(_Collector())
    return generate_latest(registry)


def _failed(status: int, message: str, code: str, retry: bool = False):
    """A server-side error in the server's own shape (:class:`RequestError`)."""
    e = RequestError(status, message, code=code, kind="server_error")
    if retry:
        e.headers = {"retry-after": "1"}
    return e


class Ingress:
    """The ASGI app of the ingress deployment: reads a request, forwards it to an engine replica
    (:class:`EngineReplica.forward`), streams the answer; ``/metrics`` merges the replicas'
    (behind the server's access rules: keys, hosts, origins, public paths)."""

    def __init__(self, engine, args, app_name: str):
        from pyspec.serve.cli import serve_options
        from pyspec.serve.config import load_config
        from pyspec.serve.guard import Guard

        self.engine = engine.options(stream=True)
        self.hub_name = hub_name(app_name)
        self.hub = None
        self.max_body = int(args.max_body_mb * (1 << 20))
        self._metrics_app = Guard(self._metrics, serve_options(args).access,
                                  {"config": load_config(args.config, args.region)})

    async def _metrics(self, scope, receive, send) -> None:
        try:
            if self.hub is None:
                self.hub = metrics_hub(self.hub_name)
            texts = await self.hub.snapshot.remote()
        except Exception as e:  # noqa: BLE001 - the hub died (its owner did): a new one next time
            self.hub = None
            return await error_response(_failed(
                503, f"the replicas' metrics are not available ({type(e).__name__}); retry",
                "metrics_unavailable", retry=True))(scope, receive, send)
        body = merge_metrics(texts)
        await send({"type": "http.response.start", "status": 200, "headers": [
            (b"content-type", b"text/plain; version=0.0.4; charset=utf-8")]})
        await send({"type": "http.response.body", "body": body})

    async def __call__(self, scope, receive, send):
        if scope["type"] == "lifespan":
            while True:
                msg = await receive()
                if msg["type"] == "lifespan.startup":
                    await send({"type": "lifespan.startup.complete"})
                elif msg["type"] == "lifespan.shutdown":
                    await send({"type": "lifespan.shutdown.complete"})
                    return
        if scope["type"] != "http":
            return
        path = scope["path"]
        if path == "/metrics" and scope["method"] == "GET":
            return await self._metrics_app(scope, receive, send)
        chunks, size = [], 0
        while True:
            msg = await receive()
            if msg["type"] == "http.disconnect":
                return
            chunks.append(msg.get("body", b""))
            size += len(chunks[-1])
            if size > self.max_body:
                return await error_response(RequestError(
                    413, f"the request body is over {self.max_body} bytes (--max-body-mb)",
                    code="body_too_large"))(scope, receive, send)
            if not msg.get("more_body", False):
                break
        body = b"".join(chunks)
        call = HTTPCall(scope["method"], path, scope.get("query_string", b""),
                        list(scope.get("headers", [])), body, scope.get("client"),
                        prompt_text(scope["method"], path, body))
        gen = self.engine.forward.remote(call)
        try:
            await self._relay(gen, scope, receive, send)
        except BaseException:
            gen.cancel()  # the client went away (or we failed): the replica aborts the request
            raise

    async def _relay(self, gen, scope, receive, send) -> None:
        from ray.serve.exceptions import BackPressureError

        try:
            first = await gen.__anext__()
        except (asyncio.CancelledError, KeyboardInterrupt):
            raise
        except BaseException as e:  # noqa: BLE001 - the replica died or could not be reached
            if isinstance(e, StopAsyncIteration):
                err = _failed(500, "the replica ended the request without an answer",
                              "replica_failed")
            elif isinstance(e, BackPressureError):
                err = _failed(503, "every replica's queue is full (--max-waiting-requests); "
                                   "retry later", "queue_full", retry=True)
            else:
                log.warning("replica failed before answering: %s", e)
                err = _failed(503, f"the replica serving this request failed "
                                   f"({type(e).__name__}); retry", "replica_failed", retry=True)
            return await error_response(err)(scope, receive, send)
        _, status, headers = first
        streaming = any(k.lower() == b"content-type" and v.startswith(b"text/event-stream")
                        for k, v in headers)
        await send({"type": "http.response.start", "status": status, "headers": headers})
        try:
            async for item in gen:
                await send({"type": "http.response.body", "body": item[1], "more_body": True})
        except (asyncio.CancelledError, KeyboardInterrupt, OSError):
            raise
        except Exception as e:  # noqa: BLE001 - the replica died mid-answer
            log.warning("replica failed mid-answer: %s", e)
            if streaming:  # an error event, as the server ends a stream it cannot finish
                err = _failed(503, "the replica serving this request failed "
                                   f"({type(e).__name__}); the output is incomplete",
                              "replica_failed")
                await send({"type": "http.response.body", "body": sse(err.body()).encode(),
                            "more_body": True})
        await send({"type": "http.response.body", "body": b"", "more_body": False})


def hub_name(app: str) -> str:
    return f"{HUB}:{app}"


def app_name() -> str:
    """The Ray Serve application this replica belongs to ("" outside one)."""
    from ray import serve

    try:
        return serve.get_replica_context().app_name
    except Exception:  # noqa: BLE001 - outside a replica (tests)
        return ""


def metrics_hub(name: str):
    """The app's metrics hub actor, made by the first caller. Detached (it must not go with the
    replica that happened to make it) and restarted by Ray if it fails; `pyspec serve --ray`
    removes it at shutdown."""
    import ray

    return ray.remote(num_cpus=0, max_restarts=-1)(MetricsHub).options(
        name=name, namespace="serve", get_if_exists=True, lifetime="detached").remote()


# ---- the application -------------------------------------------------------------------------


def build_app(args):
    """The Ray Serve application for parsed ``pyspec serve`` arguments (``args.replicas``
    engines, or ``args.ray_autoscaling``)."""
    from ray import serve

    engine_opts = dict(
        name="PyspecEngine",
        ray_actor_options={"num_cpus": args.replica_cpus, "runtime_env": {"env_vars": {
            "PYSPEC_NUM_THREADS": str(max(1, int(args.replica_cpus))),
            "OMP_NUM_THREADS": str(max(1, int(args.replica_cpus)))}}},
        # Requests in flight per replica: the engine's own batch and queue decide beyond this.
        max_ongoing_requests=args.max_num_seqs + (args.max_waiting_requests or args.max_num_seqs),
        # Past --max-waiting-requests queued for replicas: 503 queue_full (Ray's back pressure).
        max_queued_requests=args.max_waiting_requests or -1,
        graceful_shutdown_timeout_s=args.drain_timeout,
        health_check_period_s=5.0)
    if args.ray_autoscaling is not None:
        engine_opts["autoscaling_config"] = autoscaling_config(args.ray_autoscaling)
    else:
        engine_opts["num_replicas"] = args.replicas or 1
    router = prefix_router()
    if router is not None:
        from ray.serve.config import RequestRouterConfig

        # Its prefix tree keeps at most ROUTER_TREE_CHARS of prompt text (oldest out first).
        engine_opts["request_router_config"] = RequestRouterConfig(
            request_router_class=router, request_router_kwargs={
                "imbalanced_threshold": ROUTER_IMBALANCE, "do_eviction": True,
                "eviction_threshold_chars": ROUTER_TREE_CHARS,
                "eviction_target_chars": ROUTER_TREE_CHARS * 9 // 10})

    engine = serve.deployment(**engine_opts)(EngineReplica)

    class PyspecIngress:
        def __init__(self, engine_handle):
            self._ingress = Ingress(engine_handle, args, app_name())

        def __serve_build_asgi_app__(self):
            return self._ingress

    ingress = serve.deployment(name="PyspecIngress", ray_actor_options={"num_cpus": 0},
                               max_ongoing_requests=4096)(serve.ingress()(PyspecIngress))
    return ingress.bind(engine.bind(args))


def prefix_router():
    """The prefix-affinity router (:mod:`pyspec.serve.ray_router`), where this Ray has one
    (else None: Ray's default power-of-two-choices routing)."""
    try:
        from pyspec.serve.ray_router import PrefixAffinityRouter
    except ImportError:
        log.warning("this Ray has no PrefixCacheAffinityRouter: requests are routed without "
                    "prefix affinity")
        return None
    return PrefixAffinityRouter


def app_builder(cli_args: Dict[str, str]):
    """For ``serve run pyspec.serve.ray_app:app_builder args="..." replicas=N``: ``args`` holds
    ``pyspec serve`` flags."""
    args = parse_args(shlex.split(cli_args.get("args", "")) + (
        ["--replicas", str(cli_args["replicas"])] if "replicas" in cli_args else []))
    return build_app(args)


def parse_args(flags: List[str]):
    """``pyspec serve`` flags parsed and checked, with --ray on."""
    from pyspec.serve.cli import parse_serve_flags

    args = parse_serve_flags(["--ray", *flags])
    check_ray_flags(args)
    return args


def run(args) -> int:
    """``pyspec serve --ray``: start (or join, ``--ray-address``) a Ray cluster, run the
    application on ``--host:--port`` and serve until SIGINT / SIGTERM."""
    import signal

    import ray
    from ray import serve

    ray.init(address=args.ray_address, ignore_reinit_error=True, log_to_driver=False)
    serve.start(http_options={"host": args.host, "port": args.port})
    serve.run(build_app(args), name="pyspec", route_prefix="/")
    stop = {"now": False}

    def on_signal(*_):
        stop["now"] = True

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    n = args.replicas or "autoscaled"
    print(f"serving on Ray: {n} engine replica(s) on http://{args.host}:{args.port}", flush=True)
    while not stop["now"]:
        time.sleep(0.2)
    serve.shutdown()
    try:
        ray.kill(ray.get_actor(hub_name("pyspec"), namespace="serve"))
    except ValueError:  # no replica ever reported
        pass
    ray.shutdown()
    return 0
