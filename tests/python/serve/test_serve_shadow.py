"""pyspec serve's shadow mode (pyspec.serve.shadow): a candidate drafter on mirrored traffic
without touching the responses, shadow copies that end with their live request and apply its stop
strings, and the shadow pool's size."""

from serve_support import require_serve_deps

require_serve_deps()

import time  # noqa: E402

import httpx  # noqa: E402

import pyspec  # noqa: E402
from pyspec.serve.app import create_app  # noqa: E402
from pyspec.serve.options import ServeOptions  # noqa: E402
from serve_support import _start, alone, metric  # noqa: E402


def test_shadow_mode_mirrors_without_touching_responses(server, tmp_path):
    """A candidate drafter (the target itself as a draft model: everything accepted) runs on all
    mirrored traffic; responses stay those of the live engine; its metrics carry a label."""
    import shutil

    cand = str(tmp_path / "cand")
    shutil.copytree(server["path"], cand)
    llm = pyspec.LLM(server["path"], draft="none", kv_cache_tokens=4096)
    app = create_app(llm, shadow_draft=cand, shadow_ratio=1.0,
                     options=ServeOptions(speculation_stats=True))
    srv, th, base = _start(app)
    try:
        texts = []
        for p in ("abc abc abc", "hello world", "one two three"):
            r = httpx.post(base + "/v1/completions", json={"prompt": p, "max_tokens": 16,
                                                             "temperature": 0}, timeout=30).json()
            assert r["speculation"][0]["drafts"] == 0  # the live engine decodes plainly
            texts.append(r["choices"][0]["text"])
            assert texts[-1] == alone(llm, p, 16)
        for _ in range(200):
            try:
                if metric(base, 'pyspec_shadow_requests_total{drafter="candidate"}') >= 3:
                    break
            except AssertionError:
                pass
            time.sleep(0.05)
        assert metric(base, 'pyspec_shadow_requests_total{drafter="candidate"}') == 3
        drafted = metric(base, 'pyspec_shadow_num_draft_tokens_total{drafter="candidate"}')
        assert drafted > 0
        assert metric(base, 'pyspec_shadow_num_accepted_tokens_total{drafter="candidate"}') == drafted
        assert metric(base, 'pyspec_shadow_acceptance_length{drafter="candidate"}') > 1.5
        # The speedup gauge is the EWMA (weight 0.1) of live / shadow decode time per token over
        # the paired requests. Its value is a timing; what it is computed from is not: one more
        # pair with the live request 3x slower per token moves it exactly that way.
        sh = app.state.shadow
        for _ in range(200):  # the live and shadow halves of the three requests paired up
            with sh._lock:
                if not sh._live_tpot and not sh._shadow_tpot:
                    break
            time.sleep(0.05)
        with sh._lock:
            assert not sh._live_tpot and not sh._shadow_tpot
            s0 = sh._speedup
            assert s0 is not None and s0 > 0
            assert metric(base, 'pyspec_shadow_speedup{drafter="candidate"}') == s0
            sh._shadow_tpot["probe"] = 0.01
        sh.live_done("probe", 0.03)
        want = 0.9 * s0 + 0.1 * 3.0
        assert abs(metric(base, 'pyspec_shadow_speedup{drafter="candidate"}') - want) <= 1e-9 * want
        # Memory: at ratio 1 the shadow's pool is the live pool's size, plus the candidate draft
        # model's own pool; the candidate's weights are its own (loaded from its folder).
        live_pool = 2 * llm.runner.kv.k.numel() * llm.runner.kv.k.element_size()
        assert metric(base, 'pyspec_memory_bytes{component="shadow_kv_pool"}') > live_pool
        assert metric(base, 'pyspec_memory_bytes{component="shadow_draft_weights"}') > 0
    finally:
        srv.should_exit = True
        th.join(timeout=10)


def _shadow_server(server, tmp_path):
    import shutil

    cand = str(tmp_path / "cand")
    shutil.copytree(server["path"], cand)
    llm = pyspec.LLM(server["path"], draft="none", kv_cache_tokens=4096)
    app = create_app(llm, shadow_draft=cand, shadow_ratio=1.0,
                     options=ServeOptions(speculation_stats=True))
    srv, th, base = _start(app)
    return llm, app, srv, th, base


def test_shadow_copy_aborted_with_its_live_request(server, tmp_path, monkeypatch):
    llm, app, srv, th, base = _shadow_server(server, tmp_path)
    sh = app.state.shadow.engine
    real = sh.step

    def slow_step():  # the copies (everything accepted: ~6 tokens a step) run > 10 s
        time.sleep(0.05)
        return real()

    monkeypatch.setattr(sh, "step", slow_step)
    try:
        with httpx.stream("POST", base + "/v1/completions",
                          json={"prompt": "abc abc", "max_tokens": 900, "stream": True, "n": 2,
                                "temperature": 0, "ignore_eos": True}) as r:
            lines = r.iter_lines()  # (closing this iterator would close the connection)
            while not next(lines).startswith("data: "):
                pass
            for _ in range(100):
                if sh.scheduler.num_running == 2:
                    break
                time.sleep(0.02)
            assert sh.scheduler.num_running == 2
        t0 = time.perf_counter()
        while time.perf_counter() - t0 < 3:
            if sh.scheduler.num_running + sh.scheduler.num_waiting == 0:
                break
            time.sleep(0.05)
        assert sh.scheduler.num_running + sh.scheduler.num_waiting == 0
        assert metric(base, 'pyspec_shadow_requests_total{drafter="candidate"}') == 0
    finally:
        srv.should_exit = True
        th.join(timeout=10)


def test_shadow_copy_applies_stop_strings(server, tmp_path, monkeypatch):
    llm, app, srv, th, base = _shadow_server(server, tmp_path)
    sh = app.state.shadow.engine
    real = sh.result
    lengths = []

    def result(rid, pop=False):
        res = real(rid, pop=pop)
        if pop:
            lengths.append(len(res.token_ids))
        return res

    monkeypatch.setattr(sh, "result", result)
    try:
        body = {"prompt": "abc abc", "max_tokens": 40, "temperature": 0, "ignore_eos": True}
        text = httpx.post(base + "/v1/completions", json=body, timeout=30).json()[
            "choices"][0]["text"]
        stop = text[10:14]
        assert len(stop) == 4
        r = httpx.post(base + "/v1/completions", timeout=30,
                       json={**body, "max_tokens": 600, "stop": stop}).json()
        assert r["choices"][0]["finish_reason"] == "stop"
        assert r["choices"][0]["text"] == text[:text.index(stop)]
        for _ in range(200):
            if len(lengths) == 2:
                break
            time.sleep(0.05)
        assert len(lengths) == 2 and lengths[0] == 40
        # (at most one step's tokens past the stop string; 600 without it)
        assert lengths[1] <= r["usage"]["completion_tokens"] + sh.gamma + 1
    finally:
        srv.should_exit = True
        th.join(timeout=10)


def test_shadow_pool_is_the_mirrored_share_but_holds_one_longest_request():
    from types import SimpleNamespace

    from pyspec.serve.shadow import shadow_blocks

    def llm(blocks, bs=16, positions=8192):
        return SimpleNamespace(runner=SimpleNamespace(kv=SimpleNamespace(num_blocks=blocks),
                                                      block_size=bs),
                               model=SimpleNamespace(cfg=SimpleNamespace(
                                   max_position_embeddings=positions)))

    # A pool 8x the context limit: the share (10% -> 410 blocks) is below one longest request
    # (8192 + 1 tokens -> 513 blocks), which wins; at 50% the share wins; never above the pool.
    assert shadow_blocks(llm(4096), 0.1) == 513
    assert shadow_blocks(llm(4096), 0.5) == 2048
    assert shadow_blocks(llm(4096), 1.0) == 4096
    # A pool smaller than the context limit: a request may use all of it, so the shadow's is
    # as large.
    assert shadow_blocks(llm(64), 0.1) == 64
    assert shadow_blocks(llm(4096, positions=100), 0.0) == 7
