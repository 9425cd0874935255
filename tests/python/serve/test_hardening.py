"""A server that can be left running: a supervised engine loop (request-level failures isolated,
an engine failure reported by /health and answered at once, then a restart or an exit),
admission control (queue limit, tenant concurrency and token rate), deadlines (request, queue,
headers, body, drain) and access (API keys, tenants by key, Origin, Host, docs off)."""

import pytest

from serve_support import require_serve_deps

require_serve_deps()

import concurrent.futures as cf  # noqa: E402
import socket  # noqa: E402
import threading  # noqa: E402
import time  # noqa: E402

import httpx  # noqa: E402

import pyspec  # noqa: E402
from pyspec.serve.app import create_app  # noqa: E402
from pyspec.serve.config import ConfigError, parse_config  # noqa: E402
from pyspec.serve.guard import AccessPolicy  # noqa: E402
from pyspec.serve.options import ServeOptions  # noqa: E402
from serve_support import _start, metric_or_zero  # noqa: E402


@pytest.fixture
def serve(server):
    """Start a server of its own on the shared tiny model: ``serve(config=..., **options)``
    returns (app, base url); all are stopped at the test's end."""
    started = []

    def make(config=None, server_kwargs=None, llm_kwargs=None, **opts):
        llm = pyspec.LLM(server["path"], draft="ngram", kv_cache_tokens=2048,
                         **(llm_kwargs or {}))
        app = create_app(llm, parse_config(config), options=ServeOptions(**opts))
        srv, th, base = _start(app, **(server_kwargs or {}))
        app.state.http_server = srv
        started.append((srv, th))
        return app, base

    yield make
    for srv, th in started:
        srv.should_exit = True
        th.join(timeout=15)


def _slow(app, monkeypatch, seconds=0.05):
    eng = app.state.engine_loop.engine
    real = eng.step

    def slow():
        time.sleep(seconds)
        return real()

    monkeypatch.setattr(eng, "step", slow)


LONG = {"prompt": "abc abc", "max_tokens": 400, "temperature": 0, "ignore_eos": True}
SHORT = {"prompt": "abc", "max_tokens": 2}


def _wait(pred, timeout=5.0):
    t0 = time.perf_counter()
    while time.perf_counter() - t0 < timeout:
        if pred():
            return time.perf_counter() - t0
        time.sleep(0.01)
    raise AssertionError("condition not reached in time")


# ---- supervision ---------------------------------------------------------------------------


def test_engine_failure_answers_in_flight_reports_unhealthy_and_restarts(serve, monkeypatch):
    """An error outside any request's own handling (here: the per-step metrics update) is an
    engine failure: /health and /ready turn 503 and in-flight requests get a 503 within a
    second; after the restart delay (1 s) the loop serves again (everything aborted first)."""
    app, base = serve()
    _slow(app, monkeypatch)
    metrics = app.state.metrics
    real = metrics.after_step
    armed = threading.Event()
    failed_at = []

    def broken(eng):
        if armed.is_set():
            armed.clear()
            failed_at.append(time.perf_counter())
            raise RuntimeError("injected engine failure")
        return real(eng)

    monkeypatch.setattr(metrics, "after_step", broken)
    with cf.ThreadPoolExecutor(3) as ex:
        futs = [ex.submit(httpx.post, base + "/v1/completions", json=LONG, timeout=30)
                for _ in range(3)]
        _wait(lambda: metric_or_zero(base, "pyspec_num_requests_running") == 3)
        armed.set()
        _wait(lambda: failed_at)
        _wait(lambda: httpx.get(base + "/health").status_code == 503, 1.0)
        unhealthy_after = time.perf_counter() - failed_at[0]
        health = httpx.get(base + "/health")
        ready = httpx.get(base + "/ready")
        answers = [f.result() for f in futs]
        answered = time.perf_counter() - failed_at[0]
    assert unhealthy_after < 1.0
    assert health.status_code == 503 and "injected engine failure" in health.json()["error"]
    assert ready.status_code == 503
    assert [r.status_code for r in answers] == [503] * 3, [r.text for r in answers]
    assert answers[0].json()["error"]["code"] == "engine_unavailable"
    assert answered < 1.0
    _wait(lambda: httpx.get(base + "/health").status_code == 200, 5.0)
    ok = httpx.post(base + "/v1/completions", json=SHORT, timeout=30)
    assert ok.status_code == 200, ok.text
    assert metric_or_zero(base, "pyspec_engine_restarts_total") == 1
    assert metric_or_zero(base, "pyspec_engine_healthy") == 1
    assert metric_or_zero(base, "pyspec_kv_cache_usage_ratio") == 0
    assert app.state.engine_loop.restarts == 1


def test_engine_failure_with_exit_stays_down_and_calls_on_fatal(serve, monkeypatch):
    app, base = serve(on_engine_failure="exit")
    fatal = []
    app.state.engine_loop.on_fatal = fatal.append
    monkeypatch.setattr(app.state.metrics, "after_step",
                        lambda eng: (_ for _ in ()).throw(RuntimeError("boom")))
    _wait(lambda: fatal, 2.0)  # the idle loop updates the metrics too
    assert isinstance(fatal[0], RuntimeError)
    h = httpx.get(base + "/health")
    assert h.status_code == 503 and "boom" in h.json()["error"]
    t0 = time.perf_counter()
    r = httpx.post(base + "/v1/completions", json=SHORT, timeout=10)
    assert r.status_code == 503 and r.headers["retry-after"], r.text
    assert time.perf_counter() - t0 < 1.0


def test_repeated_step_failures_are_an_engine_failure(serve, monkeypatch):
    """A step that fails batch-wide fails its requests with a 500 and serving goes on; three in
    a row mean the engine is broken: a restart (a working step again afterwards)."""
    app, base = serve()
    eng = app.state.engine_loop.engine
    real = eng.step
    left = [3]

    def broken():
        if left[0] > 0:
            left[0] -= 1
            raise RuntimeError("step broken")
        return real()

    monkeypatch.setattr(eng, "step", broken)
    codes = [httpx.post(base + "/v1/completions", json=SHORT, timeout=10).status_code
             for _ in range(3)]
    assert codes[:2] == [500, 500] and codes[2] in (500, 503), codes
    _wait(lambda: app.state.engine_loop.restarts == 1)
    assert httpx.post(base + "/v1/completions", json=SHORT, timeout=10).status_code == 200


def test_a_request_failing_on_its_own_fails_alone(serve, monkeypatch):
    """add_request raising something other than a ValueError, and a failure while one request's
    output is handed out: that request gets a 500, the others and the engine are fine."""
    app, base = serve()
    loop_ = app.state.engine_loop
    eng = loop_.engine
    real_add = eng.add_request
    marker = [7, 7, 7, 7, 7]

    def add(ids, params):
        if list(ids) == marker:
            raise RuntimeError("add failed")
        return real_add(ids, params)

    monkeypatch.setattr(eng, "add_request", add)
    real_finished = app.state.metrics.request_finished
    bad_len = []

    def finished(stats, reason, ttft, dur, n):
        if n == 3 and not bad_len:
            bad_len.append(1)
            raise RuntimeError("output failed")
        return real_finished(stats, reason, ttft, dur, n)

    monkeypatch.setattr(app.state.metrics, "request_finished", finished)
    with cf.ThreadPoolExecutor(3) as ex:
        a = ex.submit(httpx.post, base + "/v1/completions",
                      json={"prompt": marker, "max_tokens": 2}, timeout=30)
        b = ex.submit(httpx.post, base + "/v1/completions",
                      json={"prompt": "x", "max_tokens": 3, "ignore_eos": True}, timeout=30)
        c = ex.submit(httpx.post, base + "/v1/completions",
                      json={"prompt": "y", "max_tokens": 5, "ignore_eos": True}, timeout=30)
        ra, rb, rc = a.result(), b.result(), c.result()
    assert ra.status_code == 500 and "add failed" in ra.text
    assert rb.status_code == 500 and "output failed" in rb.text
    assert rc.status_code == 200, rc.text
    assert loop_.healthy and loop_.restarts == 0
    assert httpx.get(base + "/health").status_code == 200


# ---- admission -----------------------------------------------------------------------------


def test_queue_limit_answers_503_at_once_and_admitted_requests_complete(serve, monkeypatch):
    """Two requests run at once (max_num_seqs=2) and two may wait: of 12 sent together the
    excess gets a 503 with Retry-After without waiting for the engine (every refusal comes before
    any admitted request, which needs 20 steps of at least 0.1 s, has finished), the admitted ones
    complete. (The 100 ms figure under 1,000 requests: bench/bench_admission.py.)"""
    app, base = serve(llm_kwargs={"max_num_seqs": 2}, max_waiting_requests=2)
    _slow(app, monkeypatch, 0.1)
    results = []

    def one(i):
        t0 = time.perf_counter()
        r = httpx.post(base + "/v1/completions", timeout=60,
                       json={"prompt": f"q{i}", "max_tokens": 20, "ignore_eos": True})
        results.append((r.status_code, time.perf_counter() - t0, r.headers.get("retry-after"),
                        r.json()))

    with cf.ThreadPoolExecutor(12) as ex:
        list(ex.map(one, range(12)))
    ok = [r for r in results if r[0] == 200]
    refused = [r for r in results if r[0] == 503]
    assert len(ok) + len(refused) == 12, [r[0] for r in results]
    # At least the queue's two are admitted (more if the engine took some before the rest came).
    assert len(ok) >= 2 and refused, [r[0] for r in results]
    assert all(r[2] == "1" and r[3]["error"]["code"] == "queue_full" for r in refused)
    assert max(r[1] for r in refused) < min(r[1] for r in ok)
    assert all(r[3]["usage"]["completion_tokens"] == 20 for r in ok)
    assert metric_or_zero(base, 'pyspec_requests_rejected_total{reason="queue_full"}') == \
        len(refused)


def test_tenant_concurrency_and_token_rate_limits(serve, monkeypatch):
    app, base = serve({"tenants": {"a": {"max_concurrency": 1},
                                   "b": {"tokens_per_minute": 30}}})
    _slow(app, monkeypatch, 0.05)
    with cf.ThreadPoolExecutor(2) as ex:
        first = ex.submit(httpx.post, base + "/v1/completions", json=LONG, timeout=60,
                          headers={"X-Tenant": "a"})
        _wait(lambda: metric_or_zero(base, "pyspec_num_requests_running") == 1)
        second = httpx.post(base + "/v1/completions", json=SHORT, headers={"X-Tenant": "a"})
        other = httpx.post(base + "/v1/completions", json=SHORT, headers={"X-Tenant": "c"})
        assert second.status_code == 429 and second.headers["retry-after"] == "1"
        assert second.json()["error"]["code"] == "tenant_concurrency"
        assert other.status_code == 200
        assert first.result().status_code == 200
    # Its slot is given back: the next one is admitted.
    assert httpx.post(base + "/v1/completions", json=SHORT,
                      headers={"X-Tenant": "a"}).status_code == 200
    # Tenant b: 30 tokens a minute; each request costs prompt + max_tokens = 1 + 10.
    body = {"prompt": [5], "max_tokens": 10}
    codes = [httpx.post(base + "/v1/completions", json=body,
                        headers={"X-Tenant": "b"}).status_code for _ in range(3)]
    assert codes == [200, 200, 429], codes
    too_big = httpx.post(base + "/v1/completions", json={"prompt": [5], "max_tokens": 40},
                         headers={"X-Tenant": "b"})
    assert too_big.status_code == 429 and "more than tenant 'b'" in too_big.text


def test_samples_beyond_max_num_seqs_refused(server):
    llm = server["llm"]
    most = llm.engine.max_num_seqs
    r = httpx.post(server["base"] + "/v1/completions",
                   json={"prompt": ["a"] * (most // 16 + 1), "n": 16, "max_tokens": 1})
    assert r.status_code == 400 and "max-num-seqs" in r.text


# ---- deadlines -----------------------------------------------------------------------------


def test_request_timeout_and_queue_timeout(serve, monkeypatch):
    app, base = serve(request_timeout=30.0, queue_timeout=0.3)
    _slow(app, monkeypatch, 0.05)
    t0 = time.perf_counter()
    r = httpx.post(base + "/v1/completions", json={**LONG, "timeout": 0.4}, timeout=30)
    assert r.status_code == 504 and r.json()["error"]["code"] == "timeout", r.text
    assert time.perf_counter() - t0 < 3
    assert metric_or_zero(base, "pyspec_kv_cache_usage_ratio") == 0
    bad = httpx.post(base + "/v1/completions", json={**SHORT, "timeout": -1})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "timeout"
    # A stream past its timeout ends with an error event.
    with httpx.stream("POST", base + "/v1/completions", timeout=30,
                      json={**LONG, "stream": True, "timeout": 0.4}) as s:
        text = "".join(s.iter_text())
    assert '"code": "timeout"' in text or '"code":"timeout"' in text, text[-300:]

    # Queue deadline: the first token must come within 0.3 s; a step that takes longer.
    eng = app.state.engine_loop.engine
    monkeypatch.setattr(eng, "step", lambda: time.sleep(0.5) or [])
    r = httpx.post(base + "/v1/completions", json=SHORT, timeout=30)
    assert r.status_code == 503 and r.json()["error"]["code"] == "queue_timeout", r.text


def _raw(base):
    host, port = base.rsplit("/", 1)[1].split(":")
    return socket.create_connection((host, int(port)), timeout=10)


def test_header_deadline_closes_drip_fed_and_idle_connections(serve):
    app, base = serve(server_kwargs={"header_timeout": 0.5, "drain_timeout": 2})
    idle = _raw(base)
    drip = _raw(base)
    t0 = time.perf_counter()
    closed_while_sending = False
    try:
        for ch in b"GET /health HTTP/1.1\r\nHost: x\r\nX-Pad: " + b"a" * 200:
            drip.sendall(bytes([ch]))  # each byte would restart a keep-alive timer
            time.sleep(0.01)
    except (BrokenPipeError, ConnectionResetError):
        closed_while_sending = True
    assert time.perf_counter() - t0 < 2.0
    for s in (idle, drip):
        s.settimeout(3)
        try:
            assert s.recv(100) == b""  # closed by the server, nothing answered
        except ConnectionResetError:
            pass
    assert closed_while_sending or time.perf_counter() - t0 < 3
    # A complete request on a fresh connection is answered.
    assert httpx.get(base + "/health").status_code == 200


def test_body_deadline_answers_408(serve):
    app, base = serve(body_timeout=0.5)
    s = _raw(base)
    s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
              b"Content-Length: 100\r\n\r\n{\"prompt\": ")
    s.settimeout(5)
    t0 = time.perf_counter()
    data = s.recv(4096)
    assert data.startswith(b"HTTP/1.1 408"), data[:200]
    assert time.perf_counter() - t0 < 3


def test_drain_deadline_ends_running_requests_and_stops(serve, monkeypatch):
    """SIGTERM's handler: /ready turns 503, new requests get 503, a running stream ends with a
    503 error event at the drain deadline and the server stops soon after, even with a client
    holding a half-sent body."""
    import signal

    app, base = serve(server_kwargs={"drain_timeout": 1.0})
    _slow(app, monkeypatch, 0.05)
    half = _raw(base)
    half.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 50\r\n\r\n{")
    events = []

    def stream():
        with httpx.stream("POST", base + "/v1/completions", timeout=30,
                          json={**LONG, "stream": True}) as s:
            for line in s.iter_lines():
                events.append(line)

    th = threading.Thread(target=stream)
    th.start()
    _wait(lambda: len(events) > 2)
    srv = app.state.http_server
    t0 = time.perf_counter()
    srv.handle_exit(signal.SIGTERM, None)
    assert app.state.draining
    th.join(timeout=10)
    assert not th.is_alive()
    ended = time.perf_counter() - t0
    assert any("shutting_down" in e for e in events), events[-3:]
    assert 0.8 < ended < 3.0
    _wait(lambda: not srv.started or srv.should_exit, 5)
    half.close()


def test_sigterm_drains_and_exits_cleanly(server, tmp_path):
    """The real thing: `pyspec serve` gets SIGTERM with streams running and queued (one runs at
    a time) and a client holding a half-sent body; at the drain deadline the unfinished streams
    end with a shutdown error event and the process exits (by the SIGTERM it was sent)."""
    import signal
    import subprocess
    import sys

    from serve_support import _free_port

    port = _free_port()
    proc = subprocess.Popen([sys.executable, "-m", "pyspec", "serve", "--model", server["path"],
                             "--draft", "none", "--port", str(port), "--drain-timeout", "1",
                             "--kv-cache-tokens", "1024", "--max-num-seqs", "1"],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            cwd=tmp_path)  # (the installed package, not the checkout)
    base = f"http://127.0.0.1:{port}"
    try:
        _wait(lambda: proc.poll() is not None or _up(base), 60)
        assert proc.poll() is None, proc.stdout.read()
        half = _raw(base)
        half.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 50\r\n\r\n{")
        events, streaming = {}, []

        def stream(i):
            try:
                with httpx.stream("POST", base + "/v1/completions", timeout=30,
                                  json={"prompt": "abc", "max_tokens": 900, "ignore_eos": True,
                                        "stream": True}) as s:
                    streaming.append(i)  # its response has begun: running or queued
                    events[i] = [str(s.status_code)] + list(s.iter_lines())
            except Exception as e:  # noqa: BLE001
                events[i] = [repr(e)]

        threads = [threading.Thread(target=stream, args=(i,)) for i in range(24)]
        for th in threads:
            th.start()
        _wait(lambda: len(streaming) == len(threads), 20)
        t0 = time.perf_counter()
        proc.send_signal(signal.SIGTERM)
        code = proc.wait(timeout=15)
        took = time.perf_counter() - t0
        for th in threads:
            th.join(timeout=10)
        half.close()
        # uvicorn re-raises the signal it drained for: the exit status is SIGTERM's.
        assert code in (0, -signal.SIGTERM), proc.stdout.read()
        assert 0.9 < took < 5, took
        ended = [i for i, ev in events.items() if any("shutting_down" in e for e in ev)]
        done = [i for i, ev in events.items() if i not in ended and ev[-2:] == ["data: [DONE]", ""]
                and any('"finish_reason": "length"' in e for e in ev)]
        assert ended, "no stream was still running at the drain deadline"
        assert len(ended) + len(done) == len(threads), events
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_sighup_reloads_the_config_of_a_running_server(server, tmp_path):
    """A real SIGHUP to `pyspec serve --config`: a tenant key and limit added to the file apply to
    the next requests; an invalid file is refused and the old config kept."""
    import signal
    import subprocess
    import sys

    from serve_support import _free_port

    cfg = tmp_path / "serve.yaml"
    cfg.write_text("speculative: {enabled_ratio: 1.0}\n")
    port = _free_port()
    proc = subprocess.Popen([sys.executable, "-m", "pyspec", "serve", "--model", server["path"],
                             "--draft", "ngram", "--port", str(port), "--config", str(cfg),
                             "--kv-cache-tokens", "1024"],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            cwd=tmp_path)
    base = f"http://127.0.0.1:{port}"
    url = base + "/v1/completions"
    try:
        _wait(lambda: proc.poll() is not None or _up(base), 60)
        assert proc.poll() is None, proc.stdout.read()
        assert httpx.post(url, json=SHORT).status_code == 200  # no keys yet
        cfg.write_text("tenants:\n  t:\n    api_keys: [tenant-key-1]\n"
                       "    tokens_per_minute: 20\n")
        proc.send_signal(signal.SIGHUP)
        _wait(lambda: httpx.post(url, json=SHORT).status_code == 401, 10)
        auth = {"Authorization": "Bearer tenant-key-1"}
        body = {"prompt": [5], "max_tokens": 9}  # 10 tokens each: two a minute
        codes = [httpx.post(url, json=body, headers=auth).status_code for _ in range(3)]
        assert codes == [200, 200, 429], codes
        cfg.write_text("tenants: [not, a, mapping]\n")
        proc.send_signal(signal.SIGHUP)
        time.sleep(1.0)
        assert proc.poll() is None
        assert httpx.post(url, json=SHORT).status_code == 401  # the old config still applies
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def _up(base):
    try:
        return httpx.get(base + "/health", timeout=1).status_code == 200
    except httpx.HTTPError:
        return False


# ---- access --------------------------------------------------------------------------------


def test_api_keys_tenants_by_key_and_public_endpoints(serve):
    cfg = {"tenants": {"team": {"api_keys": ["team-key-123"], "max_concurrency": 1},
                       "off": {"api_keys": ["off-key-456"],
                               "speculative": {"enabled_ratio": 0.0}}}}
    app, base = serve(cfg, access=AccessPolicy(api_keys=("server-key-1",)))
    url = base + "/v1/completions"
    assert httpx.post(url, json=SHORT).status_code == 401
    r = httpx.post(url, json=SHORT, headers={"Authorization": "Bearer wrong-key-00"})
    assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
    assert r.headers["www-authenticate"].startswith("Bearer")
    assert httpx.post(url, json=SHORT,
                      headers={"Authorization": "Basic server-key-1"}).status_code == 401
    for key in ("server-key-1", "team-key-123", "off-key-456"):
        assert httpx.post(url, json=SHORT,
                          headers={"Authorization": f"Bearer {key}"}).status_code == 200, key
    # Probes without a key; metrics and models need one.
    assert httpx.get(base + "/health").status_code == 200
    assert httpx.get(base + "/ready").status_code == 200
    assert httpx.get(base + "/metrics").status_code == 401
    assert httpx.get(base + "/v1/models").status_code == 401
    # The key names the tenant; an X-Tenant header cannot claim another one.
    admission = app.state.admission
    seen = []
    real = admission.admit
    admission.admit = lambda tenant, *a: seen.append(tenant) or real(tenant, *a)
    httpx.post(url, json=SHORT, headers={"Authorization": "Bearer team-key-123",
                                         "X-Tenant": "off"})
    httpx.post(url, json=SHORT, headers={"Authorization": "Bearer server-key-1",
                                         "X-Tenant": "team"})
    assert seen == ["team", None]
    # ... and the partition of learned text its requests draft from and teach.
    eng = app.state.engine_loop.engine
    parts = []
    real_add = eng.add_request
    eng.add_request = lambda ids, p: parts.append(p.learn_partition) or real_add(ids, p)
    for key in ("team-key-123", "server-key-1"):
        httpx.post(url, json=SHORT, headers={"Authorization": f"Bearer {key}"})
    assert parts == ["team", None]


def test_foreign_origins_refused_allowed_ones_get_cors(serve):
    app, base = serve(access=AccessPolicy(allowed_origins=("https://ok.example",)))
    url = base + "/v1/completions"
    # A web page's "simple" cross-site POST (text/plain, no preflight) is refused.
    r = httpx.post(url, content=b'{"prompt": "x", "max_tokens": 1}',
                   headers={"Content-Type": "text/plain", "Origin": "https://evil.example"})
    assert r.status_code == 403 and r.json()["error"]["code"] == "origin_not_allowed"
    r = httpx.post(url, json=SHORT, headers={"Origin": "https://ok.example"})
    assert r.status_code == 200 and r.headers["access-control-allow-origin"] == \
        "https://ok.example"
    pre = httpx.request("OPTIONS", url, headers={"Origin": "https://ok.example",
                                                 "Access-Control-Request-Method": "POST"})
    assert pre.status_code == 204 and "authorization" in pre.headers[
        "access-control-allow-headers"]
    # No Origin (SDKs, curl): served.
    assert httpx.post(url, json=SHORT).status_code == 200


def test_default_refuses_every_origin(server):
    r = httpx.post(server["base"] + "/v1/completions", json=SHORT,
                   headers={"Origin": "http://localhost:3000"})
    assert r.status_code == 403


def test_host_check_and_docs_off_by_default(serve):
    app, base = serve(access=AccessPolicy(allowed_hosts=("localhost", "127.0.0.1", "::1")))
    assert httpx.get(base + "/health").status_code == 200  # Host: 127.0.0.1:PORT
    r = httpx.get(base + "/health", headers={"Host": "attacker.example:8000"})
    assert r.status_code == 421 and r.json()["error"]["code"] == "host_not_allowed"
    for path in ("/docs", "/redoc", "/openapi.json"):
        assert httpx.get(base + path).status_code == 404
    app2, base2 = serve(docs=True)
    assert httpx.get(base2 + "/openapi.json").status_code == 200


def test_speculation_stats_off_by_default(server, serve):
    r = httpx.post(server["base"] + "/v1/completions", json=SHORT).json()
    assert "speculation" not in r
    app, base = serve(speculation_stats=True)
    r = httpx.post(base + "/v1/completions", json=SHORT).json()
    assert r["speculation"][0]["drafts"] >= 0


def test_options_and_tenant_config_are_checked():
    with pytest.raises(ValueError, match="max_waiting_requests"):
        ServeOptions(max_waiting_requests=-1)
    with pytest.raises(ValueError, match="request_timeout"):
        ServeOptions(request_timeout=0)
    with pytest.raises(ValueError, match="on_engine_failure"):
        ServeOptions(on_engine_failure="ignore")
    with pytest.raises(ValueError, match="at least 8"):
        AccessPolicy(api_keys=("short",))
    with pytest.raises(ValueError, match="origin"):
        AccessPolicy(allowed_origins=("evil.example",))
    with pytest.raises(ConfigError, match="max_concurrency"):
        parse_config({"tenants": {"a": {"max_concurrency": 0}}})
    with pytest.raises(ConfigError, match="a key names one tenant"):
        parse_config({"tenants": {"a": {"api_keys": ["k" * 8]}, "b": {"api_keys": ["k" * 8]}}})
    with pytest.raises(ConfigError, match="may only hold"):
        parse_config({"tenants": {"a": {"rate": 1}}})


# ---- OpenAI compatibility ------------------------------------------------------------------


def test_chat_content_parts_and_roles(server):
    url = server["base"] + "/v1/chat/completions"
    parts = {"messages": [{"role": "developer", "content": "Be brief."},
                          {"role": "user", "content": [{"type": "text", "text": "Hello"},
                                                       {"type": "text", "text": "there"}]}],
             "max_tokens": 4, "temperature": 0}
    plain = {"messages": [{"role": "system", "content": "Be brief."},
                          {"role": "user", "content": "Hello\nthere"}],
             "max_tokens": 4, "temperature": 0}
    a, b = httpx.post(url, json=parts), httpx.post(url, json=plain)
    assert a.status_code == 200, a.text
    assert a.json()["choices"][0]["message"] == b.json()["choices"][0]["message"]
    assert a.json()["usage"] == b.json()["usage"]
    for msgs, what in (([{"role": "wizard", "content": "x"}], "role must be one of"),
                       ([{"role": "tool", "content": "x"}], "role must be one of"),
                       ([{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}],
                        "'image_url' parts"),
                       ([{"role": "user", "content": 5}], "content must be"),
                       ([], "non-empty list")):
        r = httpx.post(url, json={"messages": msgs, "max_tokens": 1})
        assert r.status_code == 400 and what in r.json()["error"]["message"], r.text


def test_list_of_prompts_on_completions(server):
    url = server["base"] + "/v1/completions"
    prompts = ["abc abc", "hello there", [5, 6, 7]]
    r = httpx.post(url, json={"prompt": prompts, "max_tokens": 5, "temperature": 0, "n": 2})
    assert r.status_code == 200, r.text
    body = r.json()
    assert [c["index"] for c in body["choices"]] == list(range(6))
    for i, p in enumerate(prompts):
        one = httpx.post(url, json={"prompt": p, "max_tokens": 5, "temperature": 0}).json()
        for k in range(2):
            assert body["choices"][2 * i + k]["text"] == one["choices"][0]["text"], (i, k)
    singles = sum(httpx.post(url, json={"prompt": p, "max_tokens": 1}).json()["usage"]
                  ["prompt_tokens"] for p in prompts)
    assert body["usage"]["prompt_tokens"] == singles
    for bad in ([["x"], 3], [""], [[]], ["a"] * 65):
        r = httpx.post(url, json={"prompt": bad, "max_tokens": 1})
        assert r.status_code == 400 and r.json()["error"]["param"] == "prompt", (bad, r.text)


def test_model_by_id(server):
    base = server["base"]
    r = httpx.get(base + "/v1/models/pyspec")
    assert r.status_code == 200 and r.json()["id"] == "pyspec"
    r = httpx.get(base + "/v1/models/gpt-4")
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"


def test_tls(serve, tmp_path):
    """--ssl-keyfile / --ssl-certfile: the server speaks HTTPS (a self-signed certificate)."""
    import shutil
    import ssl

    if shutil.which("openssl") is None:
        pytest.skip("openssl is not installed (it makes the test certificate)")
    import subprocess

    key, cert = tmp_path / "key.pem", tmp_path / "cert.pem"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout",
                    str(key), "-out", str(cert), "-days", "1", "-subj", "/CN=127.0.0.1",
                    "-addext", "subjectAltName=IP:127.0.0.1"], check=True, capture_output=True)
    app, base = serve(server_kwargs={"ssl_keyfile": str(key), "ssl_certfile": str(cert)})
    https = base.replace("http://", "https://")
    ctx = ssl.create_default_context(cafile=str(cert))
    r = httpx.post(https + "/v1/completions", json=SHORT, verify=ctx, timeout=30)
    assert r.status_code == 200, r.text
    with pytest.raises(httpx.HTTPError):  # plain HTTP to a TLS port gets no answer
        httpx.get(base + "/health", timeout=5)


def test_access_log_has_a_line_per_request(serve):
    """`pyspec serve` logs each request (its default; --no-access-log turns it off): method,
    path and status, a refused request's 4xx too."""
    import logging

    app, base = serve(server_kwargs={"access_log": True})
    lines = []

    class Keep(logging.Handler):
        def emit(self, record):
            lines.append(record.getMessage())

    keep = Keep()
    logger = logging.getLogger("uvicorn.access")
    logger.addHandler(keep)
    try:
        assert httpx.get(base + "/health").status_code == 200
        r = httpx.post(base + "/v1/completions", json={"prompt": "x", "max_tokens": -5})
        assert r.status_code == 400
    finally:
        logger.removeHandler(keep)
    assert any('"GET /health HTTP/1.1" 200' in line for line in lines), lines
    assert any('"POST /v1/completions HTTP/1.1" 400' in line for line in lines), lines
