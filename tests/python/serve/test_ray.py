"""`pyspec serve --ray` (pyspec.serve.ray_app): two engine replicas of a tiny model on a local
Ray cluster, driven with the `openai` client through Ray's HTTP proxy: outputs as from one
engine, prefix affinity, metrics per replica, and a replica killed mid-stream (its streams end
with an error event, the others finish, new requests are served)."""

import json
import os
import threading
import time

import pytest

from helpers import require_module
from serve_support import require_serve_deps

require_serve_deps()

from models_support import write_tiny_model  # noqa: E402


# ---- without Ray ---------------------------------------------------------------------------------


def test_prompt_text_for_the_router():
    from pyspec.serve.ray_app import PROMPT_CHARS, prompt_text

    def body(x):
        return json.dumps(x).encode()

    assert prompt_text("POST", "/v1/completions", body({"prompt": "abc"})) == "abc"
    assert prompt_text("POST", "/v1/completions", body({"prompt": ["abc", "x"]})) == "abc"
    assert prompt_text("POST", "/v1/completions", body({"prompt": [5, 6, 7]})) == "5 6 7"
    assert prompt_text("POST", "/v1/completions", body({"prompt": [[5, 6], [7]]})) == "5 6"
    assert prompt_text("POST", "/v1/chat/completions", body({"messages": [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": [{"type": "text", "text": "hi"}]}]})) == "be brief\nhi"
    assert len(prompt_text("POST", "/v1/completions", body({"prompt": "a" * 9999}))) \
        == PROMPT_CHARS
    # Anything else is "" (routed by load; the engine answers a malformed body itself).
    assert prompt_text("GET", "/health", b"") == ""
    assert prompt_text("POST", "/v1/completions", b"{not json") == ""
    assert prompt_text("POST", "/v1/completions", body({"prompt": ""})) == ""
    assert prompt_text("POST", "/v1/chat/completions", body({"messages": 5})) == ""
    assert prompt_text("POST", "/v1/chat/completions", body([1])) == ""
    assert prompt_text("POST", "/v1/chat/completions", body({"messages": [
        {"role": "user", "content": [{"text": None}, {"text": "ok"}]}]})) == "ok"


def test_merged_metrics_label_every_sample_with_its_replica():
    from prometheus_client import CollectorRegistry, Counter, Gauge, generate_latest
    from prometheus_client.parser import text_string_to_metric_families

    from pyspec.serve.ray_app import merge_metrics

    texts = {}
    for name, n in (("r1", 3), ("r2", 5)):
        reg = CollectorRegistry()
        Counter("pyspec_requests", "done", ["finish_reason"], registry=reg).labels("stop").inc(n)
        Gauge("pyspec_num_requests_waiting", "queued", registry=reg).set(n)
        texts[name] = generate_latest(reg)
    fams = {f.name: f for f in text_string_to_metric_families(merge_metrics(texts).decode())}
    got = {(s.labels["replica"], s.labels["finish_reason"]): s.value
           for s in fams["pyspec_requests"].samples if s.name == "pyspec_requests_total"}
    assert got == {("r1", "stop"): 3.0, ("r2", "stop"): 5.0}
    assert fams["pyspec_requests"].type == "counter"
    assert {s.labels["replica"]: s.value for s in fams["pyspec_num_requests_waiting"].samples} \
        == {"r1": 3.0, "r2": 5.0}
    assert fams["pyspec_replicas"].samples[0].value == 2.0


def test_autoscaling_config_is_checked():
    from pyspec.serve.ray_app import autoscaling_config

    ok = autoscaling_config('{"min_replicas": 1, "max_replicas": 3, '
                            '"target_ongoing_requests": 8}')
    assert ok["max_replicas"] == 3
    for bad, msg in (("[1]", "non-empty JSON object"), ("{", "must be a JSON object"),
                     ('{"replicas": 2}', "unknown keys"),
                     ('{"max_replicas": -1}', "must be a whole number >= 0"),
                     ('{"min_replicas": 3, "max_replicas": 2}', "max_replicas must be")):
        with pytest.raises(ValueError, match=msg):
            autoscaling_config(bad)


def test_app_builder_for_serve_run(tmp_path):
    """`serve run pyspec.serve.ray_app:app_builder args="..." replicas=2` builds the application
    (two deployments, the engine's replica count and router set) without a cluster; bad flags
    are the command's own errors."""
    require_module("ray")
    from pyspec.serve.ray_app import app_builder

    path = write_tiny_model(tmp_path / "model")
    app = app_builder({"args": f"--model {path} --draft ngram", "replicas": "2"})
    ingress = app._bound_deployment
    engine = ingress.init_args[0]._bound_deployment  # the ingress's argument: the engines
    assert (ingress.name, engine.name) == ("PyspecIngress", "PyspecEngine")
    assert engine.num_replicas == 2
    router = engine._deployment_config.request_router_config.request_router_class
    assert router.endswith("PrefixAffinityRouter"), router
    with pytest.raises(ValueError, match="--replicas must be >= 1"):
        app_builder({"args": f"--model {path}", "replicas": "0"})


# ---- a local Ray cluster -------------------------------------------------------------------------


@pytest.mark.slow
def test_pyspec_serve_ray_command(tmp_path):
    """`pyspec serve --ray --replicas 1` starts a local cluster, serves, and on SIGTERM shuts
    Ray Serve down and exits 0. (First in the file: before this module's own cluster starts.)"""
    import signal
    import subprocess
    import sys

    import httpx

    from serve_support import _free_port

    require_module("ray")
    path = write_tiny_model(tmp_path / "model")
    port = _free_port()
    proc = subprocess.Popen([sys.executable, "-m", "pyspec", "serve", "--ray", "--replicas", "1",
                             "--model", path, "--draft", "ngram", "--port", str(port),
                             "--kv-cache-tokens", "2048"],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            cwd=tmp_path)
    try:
        deadline = time.monotonic() + 120
        for line in proc.stdout:
            if "serving on Ray" in line:
                break
            assert time.monotonic() < deadline
        r = httpx.post(f"http://127.0.0.1:{port}/v1/completions",
                       json={"prompt": "abc", "max_tokens": 4}, timeout=60)
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 4
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=90) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    require_module("ray")
    import openai
    import ray
    from ray import serve

    from pyspec.serve.ray_app import build_app, parse_args
    from serve_support import _free_port

    path = write_tiny_model(tmp_path_factory.mktemp("ray-model"))
    port = _free_port()
    # Ray's workers start in the driver's working directory and import from it: run from the
    # repository root (as CI does), they would import the source tree's pyspec, which has no
    # built core, instead of the installed one.
    cwd = os.getcwd()
    os.chdir(tmp_path_factory.mktemp("ray-cwd"))
    ray.init(num_cpus=4, include_dashboard=False, log_to_driver=False)
    try:
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        args = parse_args(["--model", path, "--draft", "ngram", "--replicas", "2",
                           "--kv-cache-tokens", "4096", "--max-num-seqs", "16"])
        serve.run(build_app(args), name="pyspec", route_prefix="/")
        base = f"http://127.0.0.1:{port}"
        yield dict(base=base, path=path, client=openai.OpenAI(base_url=base + "/v1",
                                                                api_key="x", max_retries=0))
    finally:
        serve.shutdown()
        ray.shutdown()
        os.chdir(cwd)


def _replica_of(r):
    return r.headers.get("x-pyspec-replica")


@pytest.mark.slow
def test_openai_client_through_ray_replicas(cluster):
    """Greedy outputs through two replicas equal one plain engine's; streaming works; bad input
    is the engine's own 400."""
    import httpx

    import pyspec

    ref = pyspec.LLM(cluster["path"], draft="none", kv_cache_tokens=2048)
    c = cluster["client"]
    for prompt in ("abc abc abc", "hello world", "x y z x y z"):
        got = c.completions.create(model="pyspec", prompt=prompt, max_tokens=24, temperature=0)
        assert got.choices[0].text == ref.generate(prompt, {"max_tokens": 24})[0].text
    chunks = list(c.chat.completions.create(
        model="pyspec", messages=[{"role": "user", "content": "hi"}], max_tokens=12,
        temperature=0, stream=True))
    text = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
    assert text == ref.chat([{"role": "user", "content": "hi"}], {"max_tokens": 12}).text
    r = httpx.post(cluster["base"] + "/v1/completions", json={"prompt": "a", "max_tokens": -1})
    assert r.status_code == 400 and "max_tokens" in r.json()["error"]["message"]
    assert _replica_of(r)
    assert httpx.get(cluster["base"] + "/health").json() == {"status": "ok"}


@pytest.mark.slow
def test_prefix_affinity_and_metrics_per_replica(cluster):
    """Requests sharing a long prefix land on one replica; /metrics carries both replicas'
    series, labelled."""
    import httpx

    base = cluster["base"]
    seen = set()
    for i in range(6):
        r = httpx.post(base + "/v1/completions", timeout=60, json={
            "prompt": "a long shared system prompt " * 12 + f"question {i}", "max_tokens": 4})
        assert r.status_code == 200, r.text
        seen.add(_replica_of(r))
    assert len(seen) == 1, seen
    deadline = time.monotonic() + 30
    while True:
        text = httpx.get(base + "/metrics", timeout=30).text
        replicas = {line.split('replica="')[1].split('"')[0] for line in text.splitlines()
                    if line.startswith("pyspec_num_requests_running{")}
        if len(replicas) == 2 and "pyspec_replicas 2.0" in text:
            break
        assert time.monotonic() < deadline, text[-2000:]
        time.sleep(0.5)
    assert seen <= replicas
    assert 'pyspec_requests_total{finish_reason="length",replica=' in text


@pytest.mark.slow
def test_a_replica_killed_mid_stream(cluster):
    """Streams on a killed replica end with a `replica_failed` error event; the other
    replica's streams finish; new requests are served."""
    import httpx
    import ray

    base = cluster["base"]
    # Two prompt families pinned (by prefix affinity) to different replicas: tried until their
    # first requests landed apart.
    families = {}
    for k in range(40):
        prefix = f"family {k} " + "filler words to make a prefix " * 6
        r = httpx.post(base + "/v1/completions", json={"prompt": prefix, "max_tokens": 1},
                       timeout=60)
        families.setdefault(_replica_of(r), prefix)
        if len(families) == 2:
            break
    assert len(families) == 2, families
    prefixes = list(families.values())
    events, replica_of = {}, {}
    started = threading.Barrier(9)

    def stream(i):
        body = {"prompt": prefixes[i % 2] + f"stream {i}", "max_tokens": 600,
                "ignore_eos": True, "stream": True}
        try:
            with httpx.stream("POST", base + "/v1/completions", json=body, timeout=120) as s:
                replica_of[i] = _replica_of(s)
                lines = s.iter_lines()
                first = next(lines)
                started.wait(timeout=60)
                events[i] = [first] + list(lines)
        except Exception as e:  # noqa: BLE001
            events[i] = [repr(e)]
            started.abort()

    threads = [threading.Thread(target=stream, args=(i,)) for i in range(8)]
    for th in threads:
        th.start()
    started.wait(timeout=60)  # every stream has its first event
    by_replica = {}
    for i, r in replica_of.items():
        by_replica.setdefault(r, []).append(i)
    assert len(by_replica) == 2, by_replica
    victim = sorted(by_replica, key=lambda r: -len(by_replica[r]))[0]
    (actor,) = [a for a in ray.util.list_named_actors(all_namespaces=True)
                if a["name"].endswith(f"#{victim}")]
    ray.kill(ray.get_actor(actor["name"], namespace=actor["namespace"]), no_restart=True)
    for th in threads:
        th.join(timeout=120)
    for i, ev in events.items():
        if replica_of[i] == victim:
            assert any('"code": "replica_failed"' in e for e in ev), ev[-3:]
            assert "data: [DONE]" not in ev
        else:
            assert ev[-2:] == ["data: [DONE]", ""] or ev[-1] == "data: [DONE]", ev[-3:]
            assert any('"finish_reason": "length"' in e for e in ev)
    # New requests go to the survivor (and to the replica Ray starts in the victim's place).
    for _ in range(4):
        r = httpx.post(base + "/v1/completions", json={"prompt": "after", "max_tokens": 4},
                       timeout=60)
        assert r.status_code == 200, r.text
        assert _replica_of(r) != victim


@pytest.mark.slow
def test_redeploy_with_fewer_replicas_keeps_routing(cluster):
    """A redeploy to one replica: requests with the old replicas' prefixes are served. And
    when Ray's prefix tree (an actor that outlives deployment versions) names a replica that is
    gone, as after a redeploy racing traffic, a request matching it is routed by load instead of
    waiting forever in Ray's routing loop (which a KeyError stops)."""
    import httpx
    import ray
    from ray import serve

    from pyspec.serve.ray_app import build_app, parse_args

    base = cluster["base"]
    prompts = ["a long shared system prompt " * 12 + "again", "family 0 filler", "after"]
    for p in prompts:  # routed (and remembered) while there are two replicas
        assert httpx.post(base + "/v1/completions", json={"prompt": p, "max_tokens": 2},
                          timeout=60).status_code == 200
    args = parse_args(["--model", cluster["path"], "--draft", "ngram", "--replicas", "1",
                       "--kv-cache-tokens", "4096", "--max-num-seqs", "8"])
    serve.run(build_app(args), name="pyspec", route_prefix="/")
    seen = set()
    for p in prompts * 3:
        r = httpx.post(base + "/v1/completions", json={"prompt": p, "max_tokens": 2}, timeout=30)
        assert r.status_code == 200, r.text
        seen.add(_replica_of(r))
    assert len(seen) == 1, seen
    tree = ray.get_actor("LlmPrefixTreeActor", namespace="serve::pyspec::PyspecEngine")
    gone = "SERVE_REPLICA::pyspec#PyspecEngine#gone0000"
    ray.get(tree.add_tenants.remote([gone], time.time()))
    ray.get(tree.insert.remote("a prompt only the gone replica served", gone, time.time()))
    for p in ("a prompt only the gone replica served", "an unseen prompt"):
        r = httpx.post(base + "/v1/completions", json={"prompt": p, "max_tokens": 2}, timeout=30)
        assert r.status_code == 200, r.text
        assert _replica_of(r) in seen


@pytest.mark.slow
def test_a_client_gone_mid_stream_frees_its_request(cluster):
    """A client that closes its stream: the replica aborts the request (nothing left running)."""
    import httpx

    base = cluster["base"]
    with httpx.stream("POST", base + "/v1/completions", timeout=60, json={
            "prompt": "go on", "max_tokens": 900, "ignore_eos": True, "stream": True}) as s:
        replica = _replica_of(s)
        next(s.iter_lines())
    deadline = time.monotonic() + 20
    while True:
        text = httpx.get(base + "/metrics", timeout=30).text
        running = [line for line in text.splitlines()
                   if line.startswith("pyspec_num_requests_running{")
                   and f'replica="{replica}"' in line]
        aborted = [line for line in text.splitlines()
                   if line.startswith('pyspec_requests_total{finish_reason="abort"')
                   and f'replica="{replica}"' in line]
        if running and running[0].endswith(" 0.0") and aborted and \
                float(aborted[0].split()[-1]) >= 1:
            break
        assert time.monotonic() < deadline, (running, aborted)
        time.sleep(0.5)


@pytest.mark.slow
def test_keys_back_pressure_and_abandoned_requests(cluster):
    """With an API key, the merged /metrics needs it like every other path; past
    --max-waiting-requests queued for busy replicas a request gets 503 queue_full with
    Retry-After; a client that gives up on a non-streaming request frees it on the replica."""
    import httpx
    from ray import serve

    from pyspec.serve.ray_app import build_app, parse_args

    base = cluster["base"]
    # (Plain decoding: a 900-token request then takes seconds, so the client below gives up
    # while it runs.)
    args = parse_args(["--model", cluster["path"], "--draft", "none", "--replicas", "1",
                       "--kv-cache-tokens", "4096", "--max-num-seqs", "1",
                       "--max-waiting-requests", "1", "--api-key", "test-key-123"])
    serve.run(build_app(args), name="pyspec", route_prefix="/")
    auth = {"Authorization": "Bearer test-key-123"}
    assert httpx.get(base + "/metrics", timeout=30).status_code == 401
    assert httpx.post(base + "/v1/completions", json={"prompt": "a", "max_tokens": 1}
                      ).status_code == 401
    codes, lock = [], threading.Lock()

    def one():
        r = httpx.post(base + "/v1/completions", headers=auth, timeout=120, json={
            "prompt": "busy", "max_tokens": 300, "ignore_eos": True})
        with lock:
            codes.append((r.status_code, r.headers.get("retry-after"),
                          r.json().get("error", {}).get("code") if r.status_code != 200 else ""))

    threads = [threading.Thread(target=one) for _ in range(8)]
    for th in threads:
        th.start()
    for th in threads:
        th.join(timeout=120)
    assert any(c == (503, "1", "queue_full") for c in codes), codes
    assert any(c[0] == 200 for c in codes), codes
    # A non-streaming request abandoned mid-way: aborted on the replica, nothing left running.
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(base + "/v1/completions", headers=auth, timeout=0.5, json={
            "prompt": "long", "max_tokens": 900, "ignore_eos": True})
    deadline = time.monotonic() + 30
    while True:
        text = httpx.get(base + "/metrics", headers=auth, timeout=30).text
        running = [float(line.split()[-1]) for line in text.splitlines()
                   if line.startswith("pyspec_num_requests_running{")]
        aborted = [float(line.split()[-1]) for line in text.splitlines()
                   if line.startswith('pyspec_requests_total{finish_reason="abort"')]
        if running and max(running) == 0 and aborted and max(aborted) >= 1:
            break
        assert time.monotonic() < deadline, (running, aborted)
        time.sleep(0.5)
