"""A bounded soak: mixed traffic for PYSPEC_SOAK_SECONDS (default 40) against one server (plain
and streamed requests, n > 1, sampled and greedy, clients that disconnect mid-stream, give up on a
non-streaming request, send bad requests, or are killed), then checks that every request got an
outcome (none lost or hanging), none was answered twice, the engine holds nothing afterwards (KV
back to idle, no live request, no tenant slot held) and the process's memory stayed flat."""

import pytest

from serve_support import require_serve_deps

require_serve_deps()

import collections  # noqa: E402
import os  # noqa: E402
import random  # noqa: E402
import signal  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import threading  # noqa: E402
import time  # noqa: E402

import httpx  # noqa: E402

import pyspec  # noqa: E402
from pyspec.serve.app import create_app  # noqa: E402
from pyspec.serve.config import parse_config  # noqa: E402
from serve_support import _start, metric, metric_or_zero  # noqa: E402


def _rss_mb() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


_KILLED_CLIENT = r"""
import sys, httpx
with httpx.stream("POST", sys.argv[1] + "/v1/completions", timeout=60,
                  json={"prompt": "killed client", "max_tokens": 300, "stream": True,
                        "ignore_eos": True}) as r:
    for line in r.iter_lines():
        if line.startswith("data: {"):
            print("started", flush=True)
            break
    import time; time.sleep(60)
"""


@pytest.mark.slow
def test_soak_mixed_traffic(server):
    seconds = float(os.environ.get("PYSPEC_SOAK_SECONDS", "40"))
    llm = pyspec.LLM(server["path"], draft="ngram", kv_cache_tokens=4096, max_num_seqs=8)
    app = create_app(llm, parse_config({"speculative": {"enabled_ratio": 0.5},
                                        "tenants": {"t1": {"max_concurrency": 4}}}))
    srv, th, base = _start(app)
    url = base + "/v1/completions"
    outcomes = collections.Counter()
    ids = []
    problems = []
    lock = threading.Lock()

    def note(kind, rid=None):
        with lock:
            outcomes[kind] += 1
            if rid is not None:
                ids.append(rid)

    def plain(rng):
        n = rng.choice((1, 1, 2))
        body = {"prompt": f"soak {rng.random()}", "max_tokens": rng.randint(1, 24), "n": n,
                "ignore_eos": True, "temperature": rng.choice((0, 0.8))}
        r = httpx.post(url, json=body, timeout=60, headers={"X-Tenant": rng.choice(("", "t1"))})
        if r.status_code == 429:
            return note("429")
        if r.status_code != 200:
            return problems.append(("plain", r.status_code, r.text[:200]))
        j = r.json()
        if len(j["choices"]) != n or j["usage"]["completion_tokens"] != n * body["max_tokens"]:
            problems.append(("plain-shape", j))
        note("plain", j["id"])

    def streamed(rng, disconnect):
        body = {"prompt": f"stream {rng.random()}", "max_tokens": rng.randint(4, 60),
                "stream": True, "ignore_eos": True, "n": rng.choice((1, 2))}
        finishes, rid, lines = collections.Counter(), None, 0
        with httpx.stream("POST", url, json=body, timeout=60) as r:
            if r.status_code != 200:
                return problems.append(("stream", r.status_code))
            for line in r.iter_lines():
                if not line.startswith("data: "):
                    continue
                lines += 1
                if disconnect and lines >= 3:
                    return note("disconnected")
                if line == "data: [DONE]":
                    finishes["done"] += 1
                    continue
                import json

                c = json.loads(line[6:])
                rid = c["id"]
                for ch in c["choices"]:
                    if ch["finish_reason"] is not None:
                        finishes[ch["index"]] += 1
        if finishes["done"] != 1 or any(finishes[i] != 1 for i in range(body["n"])):
            problems.append(("stream-finish", dict(finishes)))
        note("stream", rid)

    def gives_up(rng):
        try:
            httpx.post(url, json={"prompt": "give up", "max_tokens": 400, "ignore_eos": True},
                       timeout=0.2)
            note("gave-up-too-late")
        except httpx.TimeoutException:
            note("gave-up")

    def bad(rng):
        r = httpx.post(url, json={"prompt": "x", "max_tokens": -1})
        if r.status_code != 400:
            problems.append(("bad", r.status_code))
        note("bad")

    def killed(rng):
        p = subprocess.Popen([sys.executable, "-c", _KILLED_CLIENT, base],
                             stdout=subprocess.PIPE, text=True)
        p.stdout.readline()
        p.send_signal(signal.SIGKILL)
        p.wait()
        note("killed")

    actions = [plain] * 4 + [lambda r: streamed(r, False)] * 3 + \
        [lambda r: streamed(r, True)] * 2 + [gives_up, bad, killed]

    def worker(seed, deadline):
        rng = random.Random(seed)
        while time.perf_counter() < deadline:
            try:
                rng.choice(actions)(rng)
            except Exception as e:  # noqa: BLE001 - a lost or hanging request
                problems.append(("exception", repr(e)))

    try:
        warm = time.perf_counter() + min(5.0, seconds / 4)
        ws = [threading.Thread(target=worker, args=(s, warm)) for s in range(6)]
        for w in ws:
            w.start()
        for w in ws:
            w.join()
        rss0 = _rss_mb()
        deadline = time.perf_counter() + seconds
        ws = [threading.Thread(target=worker, args=(100 + s, deadline)) for s in range(6)]
        for w in ws:
            w.start()
        for w in ws:
            w.join(timeout=seconds + 120)
        assert not any(w.is_alive() for w in ws), "a client is still waiting for its answer"
        for _ in range(200):
            if metric(base, "pyspec_num_requests_running") == 0 and \
                    metric(base, "pyspec_num_requests_waiting") == 0:
                break
            time.sleep(0.05)
        rss1 = _rss_mb()
        assert not problems, problems[:10]
        assert len(ids) == len(set(ids)), "a response id was answered twice"
        assert outcomes["plain"] > 10 and outcomes["stream"] > 5 and outcomes["killed"] >= 1, \
            outcomes
        assert metric(base, "pyspec_kv_cache_usage_ratio") == 0
        loop_ = app.state.engine_loop
        assert not loop_._live and not llm.engine.has_unfinished()
        assert not app.state.admission.in_flight
        assert loop_.waiting() == 0 and loop_.healthy and loop_.restarts == 0
        assert metric_or_zero(base, 'pyspec_requests_total{finish_reason="error"}') == 0
        # Every client that went away aborted its request (it was not run to its end).
        gone = outcomes["disconnected"] + outcomes["gave-up"] + outcomes["killed"]
        assert metric_or_zero(base, 'pyspec_requests_total{finish_reason="abort"}') >= gone
        assert rss1 - rss0 < 150, (rss0, rss1)  # flat: no per-request growth
    finally:
        srv.should_exit = True
        th.join(timeout=15)
