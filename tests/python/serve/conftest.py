"""The server fixtures of the serve tests, each started once and shared by every serve test module
(as when they were one module): ``server`` (pyspec serve on 127.0.0.1 with a tiny random model,
speculation on half of the requests) and ``small`` (a 255-token context and a 4 KiB body limit).
Test modules skip without the serve extra's packages (serve_support.require_serve_deps), so the
fixtures import them lazily."""

import pytest

import pyspec
from models_support import write_tiny_model
from serve_support import _start


@pytest.fixture(scope="package")
def server(tmp_path_factory):
    import openai

    from pyspec.serve.app import create_app
    from pyspec.serve.config import parse_config

    path = write_tiny_model(tmp_path_factory.mktemp("serve-model"))
    llm = pyspec.LLM(path, draft="ngram", kv_cache_tokens=8192)
    app = create_app(llm, parse_config({"speculative": {"enabled_ratio": 0.5}}))
    srv, th, base = _start(app)
    yield dict(llm=llm, app=app, base=base, path=path,
               client=openai.OpenAI(base_url=base + "/v1", api_key="x", max_retries=0))
    srv.should_exit = True
    th.join(timeout=10)


@pytest.fixture(scope="package")
def small(tmp_path_factory):
    """A server with a 255-token context and a 4 KiB body limit."""
    from pyspec.serve.app import create_app

    path = write_tiny_model(tmp_path_factory.mktemp("serve-small"))
    llm = pyspec.LLM(path, draft="ngram", kv_cache_tokens=256)
    app = create_app(llm, max_body_bytes=4096)
    srv, th, base = _start(app)
    yield dict(llm=llm, app=app, base=base, ctx=255)
    srv.should_exit = True
    th.join(timeout=10)
