"""pyspec serve's routes (pyspec.serve.app) with a tiny random model, driven by the real `openai`
client: models, health, completions and chat equal to running them alone, streaming (with usage)
and stop sequences, unknown routes and methods in OpenAI's error shape."""

from serve_support import require_serve_deps

require_serve_deps()

import httpx  # noqa: E402

from serve_support import alone  # noqa: E402


def test_models_health_and_completion(server):
    c = server["client"]
    assert [m.id for m in c.models.list().data] == ["pyspec"]
    assert httpx.get(server["base"] + "/health").json() == {"status": "ok"}
    r = c.completions.create(model="pyspec", prompt="abc abc abc", max_tokens=12, temperature=0)
    assert r.choices[0].text == alone(server["llm"], "abc abc abc", 12)
    assert r.usage.completion_tokens <= 12 and r.usage.prompt_tokens > 0


def test_chat_stream_and_stop(server):
    c = server["client"]
    full = c.chat.completions.create(model="pyspec", temperature=0, max_tokens=16,
                                     messages=[{"role": "user", "content": "hello"}])
    text = full.choices[0].message.content
    assert text == alone(server["llm"], "hello", 16, chat=True)
    chunks = list(c.chat.completions.create(model="pyspec", temperature=0, max_tokens=16,
                                            stream=True,
                                            messages=[{"role": "user", "content": "hello"}]))
    assert "".join(ch.choices[0].delta.content or "" for ch in chunks) == text
    with_usage = list(c.chat.completions.create(
        model="pyspec", temperature=0, max_tokens=16, stream=True,
        stream_options={"include_usage": True}, messages=[{"role": "user", "content": "hello"}]))
    assert with_usage[-1].usage.completion_tokens == full.usage.completion_tokens
    assert chunks[-1].choices[0].finish_reason in ("length", "stop")
    if len(text) > 4:
        stop = text[2:4]
        cut = c.chat.completions.create(model="pyspec", temperature=0, max_tokens=16, stop=[stop],
                                        messages=[{"role": "user", "content": "hello"}])
        assert cut.choices[0].message.content == text[:text.find(stop)]
        assert cut.choices[0].finish_reason == "stop"


def test_unknown_routes_and_methods_get_openai_errors(server):
    base = server["base"]
    for method, path, status in (("GET", "/nope", 404), ("POST", "/v1/nope", 404),
                                 ("GET", "/v1/completions", 405), ("POST", "/health", 405)):
        r = httpx.request(method, base + path)
        assert r.status_code == status, (method, path, r.text)
        err = r.json()["error"]
        assert err["message"] and err["type"] == "invalid_request_error" and "param" in err
    assert "POST" in httpx.get(base + "/v1/completions").headers["allow"]
    r = httpx.head(base + "/health")
    assert r.status_code == 200 and r.content == b""
