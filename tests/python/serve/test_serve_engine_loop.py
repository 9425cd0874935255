"""pyspec serve's engine loop (pyspec.serve.engine_loop): 16 concurrent mixed requests each equal
(greedy) to running it alone, a client that disconnects mid-stream or gives up on a non-streaming
request aborts its request and frees its KV, and a failed engine step fails only its requests."""

import pytest

from serve_support import require_serve_deps

require_serve_deps()

import concurrent.futures as cf  # noqa: E402
import logging  # noqa: E402
import time  # noqa: E402

import httpx  # noqa: E402

from serve_support import alone, metric, metric_or_zero  # noqa: E402


def test_sixteen_concurrent_mixed_requests_equal_alone(server):
    c = server["client"]
    prompts = [f"item {i} item {i} item" for i in range(16)]

    def one(i):
        if i % 4 == 3:  # sampled requests mixed in
            r = c.completions.create(model="pyspec", prompt=prompts[i], max_tokens=10,
                                     temperature=0.9, top_p=0.8, seed=i)
            return None, r
        return prompts[i], c.completions.create(model="pyspec", prompt=prompts[i],
                                                max_tokens=8 + i % 5, temperature=0)

    with cf.ThreadPoolExecutor(16) as ex:
        res = list(ex.map(one, range(16)))
    for i, (p, r) in enumerate(res):
        if p is not None:
            assert r.choices[0].text == alone(server["llm"], p, 8 + i % 5), i


def test_disconnect_mid_stream_frees_kv(server, monkeypatch):
    base = server["base"]
    idle = metric(base, "pyspec_kv_cache_usage_ratio")
    eng = server["llm"].engine
    real_step = eng.step

    def slow_step():  # keep the request running long enough to disconnect in the middle
        time.sleep(0.05)  # 500 tokens, at most 6 a step: > 4 s, however busy the machine
        return real_step()

    monkeypatch.setattr(eng, "step", slow_step)
    aborted = metric_or_zero(base, 'pyspec_requests_total{finish_reason="abort"}')
    with httpx.stream("POST", base + "/v1/completions",
                      json={"model": "pyspec", "prompt": "abc abc", "max_tokens": 500,
                            "stream": True, "temperature": 0, "ignore_eos": True}) as r:
        lines = r.iter_lines()  # (closing this iterator would already close the connection)
        line = next(lines)
        while not line.startswith("data: "):
            line = next(lines)
        assert '"text"' in line, line
        assert metric(base, "pyspec_num_requests_running") >= 1  # still generating
    # The connection is closed here, mid-stream: the server aborts the request.
    for _ in range(100):
        if metric(base, "pyspec_num_requests_running") == 0:
            break
        time.sleep(0.05)
    assert metric(base, "pyspec_num_requests_running") == 0
    assert metric(base, "pyspec_kv_cache_usage_ratio") == idle
    assert metric(base, 'pyspec_requests_total{finish_reason="abort"}') == aborted + 1


def test_failed_engine_step_fails_only_its_requests(server, monkeypatch):
    """An engine step that raises: the requests in it get a 500, the engine closes the step, and
    the next request is served (it used to answer 500 to everything until a restart)."""
    eng = server["llm"].engine
    real = eng.runner.step
    calls = []

    def broken_once(*args, **kwargs):
        if not calls:
            calls.append(1)
            raise RuntimeError("injected failure")
        return real(*args, **kwargs)

    monkeypatch.setattr(eng.runner, "step", broken_once)
    r = httpx.post(server["base"] + "/v1/completions", json={"prompt": "x", "max_tokens": 3})
    assert calls and r.status_code == 500 and "injected failure" in r.text
    ok = server["client"].completions.create(model="pyspec", prompt="x", max_tokens=2)
    assert ok.choices[0].finish_reason in ("length", "stop")


def test_non_streaming_disconnect_aborts_request(server, monkeypatch, caplog):
    """A non-streaming client that gives up: the request is aborted (not run to max_tokens),
    quietly (no error logged)."""
    base = server["base"]
    eng = server["llm"].engine
    real_step = eng.step

    def slow_step():  # 900 tokens, at most 6 a step: > 7 s
        time.sleep(0.05)
        return real_step()

    monkeypatch.setattr(eng, "step", slow_step)
    aborted = metric_or_zero(base, 'pyspec_requests_total{finish_reason="abort"}')
    uv = logging.getLogger("uvicorn.error")  # (does not propagate to the root logger)
    uv.addHandler(caplog.handler)
    try:
        with pytest.raises(httpx.TimeoutException):
            httpx.post(base + "/v1/completions", timeout=1.0,
                       json={"prompt": "abc abc", "max_tokens": 900, "temperature": 0,
                             "ignore_eos": True, "n": 2})
        t0 = time.perf_counter()
        while time.perf_counter() - t0 < 4:
            if metric(base, "pyspec_num_requests_running") == 0:
                break
            time.sleep(0.05)
        time.sleep(0.2)  # (the handler's return after the abort)
    finally:
        uv.removeHandler(caplog.handler)
    assert metric(base, "pyspec_num_requests_running") == 0
    assert metric(base, 'pyspec_requests_total{finish_reason="abort"}') == aborted + 2
    assert not [r for r in caplog.records if r.levelno >= 40], caplog.records
