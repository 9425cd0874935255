"""`pyspec serve`'s command line (pyspec.serve.cli): bad options refused before any model loads,
the prompt log's default ratio, and --tree-width for draft-model folders only."""

import pytest

from serve_support import require_serve_deps

require_serve_deps()

from models_support import write_tiny_model  # noqa: E402


@pytest.mark.parametrize("argv, message", [
    (["--prompt-log-ratio", "0.5"], "--prompt-log-ratio needs --prompt-log"),
    (["--prompt-log", "P", "--prompt-log-ratio", "0"], r"must be in \(0, 1\]"),
    (["--prompt-log", "P", "--prompt-log-ratio", "1.5"], r"must be in \(0, 1\]"),
    (["--prompt-log", "P", "--prompt-log-ratio", "nan"], r"must be in \(0, 1\]"),
    (["--port", "70000"], r"--port must be in \[0, 65535\]"),
    (["--max-body-mb", "0"], "--max-body-mb must be a number > 0"),
    (["--max-waiting-requests", "0"], "max_waiting_requests must be an int >= 1"),
    (["--request-timeout", "-1"], "request_timeout must be a number of seconds > 0"),
    (["--queue-timeout", "inf"], "queue_timeout must be a number of seconds > 0"),
    (["--body-timeout", "0"], "body_timeout must be a number of seconds > 0"),
    (["--header-timeout", "nan"], "--header-timeout must be a number of seconds > 0"),
    (["--drain-timeout", "0"], "--drain-timeout must be a number of seconds > 0"),
    (["--max-num-seqs", "0"], "--max-num-seqs must be >= 1"),
    (["--max-prefill-chunk", "-1"], "--max-prefill-chunk must be >= 0"),
    (["--api-key", "short"], "at least 8 characters"),
    (["--allowed-origins", "evil.example"], "scheme://host"),
    (["--ssl-keyfile", "P"], "both --ssl-keyfile and --ssl-certfile"),
    (["--ssl-keyfile", "P", "--ssl-certfile", "P"], "no such file"),
    (["--watch-config", "5"], "--watch-config needs --config"),
    (["--config", "P", "--watch-config", "0"], "--watch-config must be a number of seconds > 0"),
    (["--replicas", "2"], "--replicas applies with --ray only"),
    (["--ray", "--replicas", "0"], "--replicas must be >= 1"),
    (["--ray", "--replica-cpus", "0"], "--replica-cpus must be a number > 0"),
    (["--ray", "--replica-cpus", "nan"], "--replica-cpus must be a number > 0"),
    (["--ray", "--ray-autoscaling", "{"], "--ray-autoscaling must be a JSON object"),
    (["--ray", "--replicas", "2", "--ray-autoscaling", '{"max_replicas": 2}'],
     "--replicas or --ray-autoscaling, not both"),
    (["--ray", "--shadow-draft", "ngram"], "--shadow-draft is not available with --ray"),
    (["--ray", "--prompt-log", "P"], "--prompt-log is not available with --ray"),
    (["--ray", "--header-timeout", "3"], "--header-timeout is not available with --ray"),
    (["--ray", "--ray-autoscaling", '{"target_ongoing_requests": 0}'],
     "target_ongoing_requests must be a number > 0"),
    (["--ray", "--ray-autoscaling", '{"max_replicas": 2.5}'],
     "max_replicas must be a whole number"),
    (["--shadow-ratio", "0.5"], "--shadow-ratio needs --shadow-draft"),
    (["--shadow-draft", "ngram", "--shadow-ratio", "2"], r"--shadow-ratio must be in \(0, 1\]"),
    (["--region", "eu"], "--region needs --config"),
    (["--served-model-name="], "--served-model-name must not be empty"),
    (["--prompt-log", "NODIR"], "must be a file this process can append to"),
])
def test_serve_cli_refuses_bad_options_before_loading(argv, message, tmp_path, capsys,
                                                      monkeypatch):
    """One `pyspec: error:` line and exit status 2, before any model is loaded."""
    import re

    from pyspec import cli
    from pyspec.serve import cli as serve_cli

    def no_load(args):
        raise AssertionError("the model was loaded before the options were checked")

    monkeypatch.setattr(serve_cli, "build", no_load)
    argv = [str(tmp_path / "p.jsonl") if a == "P" else
            str(tmp_path / "nodir" / "p.jsonl") if a == "NODIR" else a for a in argv]
    assert cli.main(["serve", *argv]) == 2
    err = capsys.readouterr().err
    assert err.startswith("pyspec: error:") and re.search(message, err), err
    assert not (tmp_path / "p.jsonl").exists()


def test_config_watcher_reloads_on_content_change_only(tmp_path):
    """The watcher reloads when the content changes (also through a Kubernetes-style symlink
    swap), not when the file is rewritten unchanged, and waits while the file is missing."""
    import os
    import time

    from pyspec.serve.cli import ConfigWatcher

    data = tmp_path / "..data_1"
    data.mkdir()
    (data / "serve.yaml").write_text("speculative: {enabled_ratio: 1.0}\n")
    os.symlink(data, tmp_path / "..data")
    path = tmp_path / "serve.yaml"
    os.symlink("..data/serve.yaml", path)
    calls = []
    w = ConfigWatcher(str(path), 0.05, lambda: calls.append(path.read_text()))
    assert not w.check()
    (data / "serve.yaml").write_text("speculative: {enabled_ratio: 1.0}\n")  # same content
    assert not w.check() and calls == []
    new = tmp_path / "..data_2"  # the kubelet's update: a new folder, the link swapped
    new.mkdir()
    (new / "serve.yaml").write_text("speculative: {enabled_ratio: 0.5}\n")
    os.symlink(new, tmp_path / "..data_tmp")
    os.replace(tmp_path / "..data_tmp", tmp_path / "..data")
    assert w.check() and calls == ["speculative: {enabled_ratio: 0.5}\n"]
    assert not w.check()
    os.remove(new / "serve.yaml")
    assert not w.check()  # missing: waited for, not reloaded
    (new / "serve.yaml").write_text("speculative: {enabled_ratio: 0.25}\n")
    w.start()  # the thread finds the change by itself
    try:
        deadline = time.monotonic() + 5
        while len(calls) < 2 and time.monotonic() < deadline:
            time.sleep(0.02)
    finally:
        w.stop()
    assert calls[-1] == "speculative: {enabled_ratio: 0.25}\n"


def test_serve_options_from_flags(monkeypatch):
    """The Host check follows --host (loopback names on a loopback address, none otherwise,
    --allowed-hosts when given); the key comes from --api-key or PYSPEC_API_KEY."""
    import argparse

    from pyspec.serve import cli as serve_cli

    ap = argparse.ArgumentParser()
    serve_cli.add_serve_flags(ap.add_subparsers().add_parser("serve"))
    monkeypatch.delenv("PYSPEC_API_KEY", raising=False)
    o = serve_cli.serve_options(ap.parse_args(["serve"]))
    assert o.access.allowed_hosts == ("localhost", "127.0.0.1", "::1")
    assert o.access.api_keys == () and o.access.allowed_origins == ()
    assert o.access.public_paths == ("/health", "/ready") and not o.speculation_stats
    o = serve_cli.serve_options(ap.parse_args(["serve", "--host", "0.0.0.0"]))
    assert o.access.allowed_hosts is None
    o = serve_cli.serve_options(ap.parse_args(["serve", "--host", "0.0.0.0", "--allowed-hosts",
                                               "Llm.Example:443,other", "--public-endpoints",
                                               "health,/metrics"]))
    assert o.access.allowed_hosts == ("llm.example", "other")
    assert o.access.public_paths == ("/health", "/metrics")
    monkeypatch.setenv("PYSPEC_API_KEY", "env-key-123")
    assert serve_cli.serve_options(ap.parse_args(["serve"])).access.api_keys == ("env-key-123",)
    o = serve_cli.serve_options(ap.parse_args(["serve", "--api-key", "flag-key-123"]))
    assert o.access.api_keys == ("flag-key-123",)


def test_serve_cli_prompt_log_ratio_defaults(tmp_path):
    """--prompt-log alone logs 1% of prompts (a ratio of 0 would open the file and never write);
    without it nothing is logged."""
    from types import SimpleNamespace

    from pyspec.serve.cli import check_prompt_log

    a = SimpleNamespace(prompt_log=str(tmp_path / "p.jsonl"), prompt_log_ratio=None)
    check_prompt_log(a)
    assert a.prompt_log_ratio == 0.01
    a = SimpleNamespace(prompt_log=str(tmp_path / "p.jsonl"), prompt_log_ratio=1.0)
    check_prompt_log(a)
    assert a.prompt_log_ratio == 1.0
    a = SimpleNamespace(prompt_log=None, prompt_log_ratio=None)
    check_prompt_log(a)
    assert a.prompt_log_ratio == 0.0
    # A log it could not write is refused at the start, not found out by the sampled requests.
    for bad in (tmp_path / "nodir" / "p.jsonl", tmp_path):
        with pytest.raises(ValueError, match="must be a file this process can append to"):
            check_prompt_log(SimpleNamespace(prompt_log=str(bad), prompt_log_ratio=1.0))


def test_a_prompt_log_that_fails_does_not_fail_the_request(tmp_path, caplog):
    """The prompt log is a side channel: a write that fails (its folder gone while serving) is a
    warning; the request is answered."""
    import shutil

    import httpx

    import pyspec
    from pyspec.serve.app import create_app
    from serve_support import served

    folder = tmp_path / "logs"
    folder.mkdir()
    llm = pyspec.LLM(write_tiny_model(str(tmp_path / "m")), draft="ngram", kv_cache_tokens=1024)
    app = create_app(llm, prompt_log=str(folder / "p.jsonl"), prompt_log_ratio=1.0)
    with served(app) as base:
        body = {"model": "pyspec", "prompt": "abc", "max_tokens": 2}
        assert httpx.post(base + "/v1/completions", json=body).status_code == 200
        assert (folder / "p.jsonl").read_text().count("\n") == 1
        shutil.rmtree(folder)
        with caplog.at_level("WARNING", logger="pyspec.serve"):
            r = httpx.post(base + "/v1/completions", json=body)
        assert r.status_code == 200, r.text
    assert any("the prompt was not logged" in m for m in caplog.messages), caplog.messages


def test_tree_width_applies_to_draft_model_folders_only(tmp_path, monkeypatch):
    from pyspec.serve.cli import with_tree_width

    model = tmp_path / "draft_model"
    write_tiny_model(str(model))
    assert with_tree_width(str(model), 3) == f"{model}@tree=3"
    monkeypatch.setenv("HOME", str(tmp_path))  # a folder under ~, as the drafter loader reads it
    assert with_tree_width("~/draft_model", 3) == "~/draft_model@tree=3"
    heads = tmp_path / "heads"
    heads.mkdir()
    (heads / "drafter.json").write_text("{}")
    empty = tmp_path / "empty"
    empty.mkdir()
    for spec in ("ngram", "default", "eagle", "ngram|suffix", str(heads), str(empty),
                 f"{model}@tree=2"):
        with pytest.raises(ValueError, match="tree_width=3 applies to a draft-model folder"):
            with_tree_width(spec, 3)


def test_serve_refuses_an_address_it_cannot_listen_on_before_loading(capsys, monkeypatch):
    """A port another server holds, or a host name that does not resolve: one line, status 2,
    before the model loads (not uvicorn's error after the start line)."""
    import socket

    from pyspec import cli
    from pyspec.serve import cli as serve_cli

    def no_load(args):
        raise AssertionError("the model was loaded before the address was checked")

    monkeypatch.setattr(serve_cli, "build", no_load)
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        port = held.getsockname()[1]
        assert cli.main(["serve", "--port", str(port)]) == 2
        err = capsys.readouterr().err
        assert f"--port {port}: cannot listen there" in err, err
    assert cli.main(["serve", "--host", "no.such.host.invalid", "--port", "0"]) == 2
    assert "--host no.such.host.invalid: not an address" in capsys.readouterr().err
    with pytest.raises(AssertionError, match="loaded before"):  # "": every interface, fine
        cli.main(["serve", "--host", "", "--port", "0"])
