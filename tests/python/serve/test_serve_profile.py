"""pyspec serve's kernel-level profiles (--profile-dir, POST/GET /admin/profile): a window of
engine steps recorded on request, its trace linked from the requests' spans; off without the
folder, refused for tenants' keys and bad input."""

from serve_support import require_serve_deps

require_serve_deps()

import os  # noqa: E402

import httpx  # noqa: E402

import pyspec  # noqa: E402
from helpers import require_module  # noqa: E402
from pyspec.serve.app import create_app  # noqa: E402
from pyspec.serve.config import parse_config  # noqa: E402
from pyspec.serve.guard import AccessPolicy  # noqa: E402
from pyspec.serve.options import ServeOptions  # noqa: E402
from serve_support import served  # noqa: E402


def test_profiling_is_off_without_a_folder(server):
    r = httpx.post(server["base"] + "/admin/profile", json={"steps": 2}, timeout=10)
    assert r.status_code == 404 and "--profile-dir" in r.json()["error"]["message"]
    assert httpx.get(server["base"] + "/admin/profile", timeout=10).status_code == 404


def test_a_profile_of_served_steps_linked_from_the_spans(server, tmp_path):
    require_module("opentelemetry.sdk")
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    llm = pyspec.LLM(server["path"], draft="ngram", kv_cache_tokens=4096)
    folder = str(tmp_path / "profiles")
    app = create_app(llm, tracer=provider.get_tracer("test"),
                     options=ServeOptions(profile_dir=folder))
    with served(app) as base:
        assert httpx.get(base + "/admin/profile", timeout=10).json() == {
            "object": "profile", "profile": None}
        for body, why in (({"steps": 0}, "'steps' must be an int >= 1"),
                          ({"steps": "3"}, "'steps' must be an int >= 1"),
                          ({"steps": 5000}, "steps must be an int in [1, 1000]")):
            r = httpx.post(base + "/admin/profile", json=body, timeout=10)
            assert r.status_code == 400 and why in r.json()["error"]["message"], r.text
        r = httpx.post(base + "/admin/profile", json={"steps": 3}, timeout=10)
        assert r.status_code == 200, r.text
        path = r.json()["path"]
        assert os.path.dirname(path) == folder and r.json()["recorded"] == 0
        r = httpx.post(base + "/admin/profile", timeout=10)  # no body: 20 steps, but one records
        assert r.status_code == 409 and r.json()["error"]["code"] == "profile_in_progress"
        out = httpx.post(base + "/v1/completions", json={
            "prompt": "abc abc abc abc", "max_tokens": 12, "temperature": 0,
            "ignore_eos": True}, timeout=30).json()
        assert out["usage"]["completion_tokens"] == 12
        st = httpx.get(base + "/admin/profile", timeout=10).json()["profile"]
        assert st["done"] and st["recorded"] == 3 and st["error"] is None
        assert os.path.exists(path) and os.path.exists(st["summary"])
        # A new window once the last one ended; an empty body asks for the default 20 steps.
        r = httpx.post(base + "/admin/profile", timeout=10)
        assert r.status_code == 200 and r.json()["steps"] == 20
    steps = [s for s in exporter.get_finished_spans() if s.name in ("pyspec.verify",
                                                                    "pyspec.accept")]
    linked = sorted({s.attributes.get("pyspec.profile.step") for s in steps
                     if s.attributes.get("pyspec.profile.file") == path})
    assert linked[:2] == [1, 2], linked  # step 0 was the prefill (its own span kind)
    prefill = [s for s in exporter.get_finished_spans() if s.name == "pyspec.prefill"]
    assert prefill[0].attributes["pyspec.profile.step"] == 0
    assert any("pyspec.profile.file" not in s.attributes for s in steps)  # after the window


def test_profiles_take_a_server_wide_key(server, tmp_path):
    llm = pyspec.LLM(server["path"], draft="ngram", kv_cache_tokens=1024)
    cfg = parse_config({"tenants": {"team": {"api_keys": ["team-key-1234"]}}})
    app = create_app(llm, cfg, options=ServeOptions(
        access=AccessPolicy(api_keys=("server-key-1234",)), profile_dir=str(tmp_path)))
    with served(app) as base:
        def post(key):
            return httpx.post(base + "/admin/profile", json={"steps": 1}, timeout=10,
                              headers={"Authorization": f"Bearer {key}"} if key else {})

        assert post(None).status_code == 401
        r = post("team-key-1234")
        assert r.status_code == 403 and "server-wide key" in r.json()["error"]["message"]
        assert post("server-key-1234").status_code == 200
        llm.engine.stop_profile()  # (nothing recorded: ends the window)
