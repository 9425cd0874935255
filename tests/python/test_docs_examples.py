"""The examples in README.md and docs/*.md run as written: every ```python block (a file's blocks
in order, in one fresh process, so a later block may use an earlier one's names) and the README's
`pyspec generate` quick-start lines. Blocks that talk to a server (an OpenAI client) get the
documented `pyspec serve` command started first, on a free port instead of 8000."""

import glob
import os
import re
import shlex
import subprocess
import sys
import time
import urllib.request

import pytest

from serve_support import _free_port, require_serve_deps

pytestmark = pytest.mark.slow

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
DOCS = [os.path.join(ROOT, "README.md")] + sorted(glob.glob(os.path.join(ROOT, "docs", "*.md")))
DOCUMENTED_PORT = "8000"


def blocks(path: str, lang: str):
    with open(path, encoding="utf-8") as f:
        return re.findall(rf"^```{lang}\n(.*?)^```", f.read(), flags=re.S | re.M)


def _with_python():
    return [os.path.relpath(p, ROOT) for p in DOCS if blocks(p, "python")]


def _env() -> dict:
    """The environment of an example's process (run outside the checkout): the pyspec this test
    imported (an installed wheel or the source tree) first on its path."""
    import pyspec

    env = dict(os.environ)
    pkg_parent = os.path.dirname(os.path.dirname(pyspec.__file__))
    env["PYTHONPATH"] = os.pathsep.join([pkg_parent] + [p for p in [env.get("PYTHONPATH")] if p])
    return env


def _run(args, timeout: float, **kw) -> subprocess.CompletedProcess:
    return subprocess.run(args, capture_output=True, text=True, timeout=timeout, env=_env(), **kw)


def _serve(command: str, port: int, tmp_path):
    """Starts the documented serve command (pip part dropped, port swapped) and waits until the
    server answers /health; returns the process."""
    line = command.split("&&")[-1].split("#")[0].strip()
    assert line.startswith("pyspec serve") and f"--port {DOCUMENTED_PORT}" in line, line
    args = shlex.split(line.replace(f"--port {DOCUMENTED_PORT}", f"--port {port}"))
    args = [sys.executable, "-m", "pyspec"] + args[1:]
    log = open(tmp_path / "serve.log", "w")
    proc = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT, env=_env(), cwd=tmp_path)
    deadline = time.time() + 120
    while time.time() < deadline:
        if proc.poll() is not None:
            break
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2) as r:
                if r.status == 200:
                    return proc
        except OSError:
            time.sleep(0.5)
    proc.kill()
    proc.wait()
    raise AssertionError(f"`{line}` did not come up: {(tmp_path / 'serve.log').read_text()[-3000:]}")


def test_the_docs_hold_python_examples():
    """The parametrization below found the files it should (a wrong pattern would run nothing)."""
    found = _with_python()
    assert "README.md" in found and os.path.join("docs", "api.md") in found, found


@pytest.mark.parametrize("doc", _with_python())
def test_python_examples_run(doc, tmp_path):
    path = os.path.join(ROOT, doc)
    code = "import pyspec\n" + "\n".join(blocks(path, "python"))
    proc = None
    if f"127.0.0.1:{DOCUMENTED_PORT}" in code:
        require_serve_deps()
        serve = [line for b in blocks(path, "bash") for line in b.splitlines()
                 if "pyspec serve" in line and f"--port {DOCUMENTED_PORT}" in line]
        assert serve, f"{doc}: a client example without the `pyspec serve` command it talks to"
        port = _free_port()
        proc = _serve(serve[0], port, tmp_path)
        code = code.replace(f"127.0.0.1:{DOCUMENTED_PORT}", f"127.0.0.1:{port}")
    try:
        res = _run([sys.executable, "-c", code], timeout=600, cwd=tmp_path)
    finally:
        if proc is not None:
            proc.terminate()
            proc.wait(timeout=60)
    assert res.returncode == 0, f"{doc}'s examples failed:\n{res.stdout[-2000:]}\n{res.stderr[-4000:]}"
    if "print(" in code:
        assert res.stdout.strip(), f"{doc}'s examples printed nothing"


def test_readme_generate_lines_run(tmp_path):
    lines = [line.split("#")[0].strip() for b in blocks(os.path.join(ROOT, "README.md"), "bash")
             for line in b.splitlines() if line.startswith("pyspec generate")]
    assert len(lines) >= 2, lines
    for line in lines:
        res = _run([sys.executable, "-m", "pyspec"] + shlex.split(line)[1:], timeout=600,
                   cwd=tmp_path)
        assert res.returncode == 0, f"`{line}`:\n{res.stdout[-2000:]}\n{res.stderr[-3000:]}"
        assert res.stdout.strip(), f"`{line}` printed nothing"
        if "--compare" in line:
            assert "outputs identical: True" in res.stdout, res.stdout[-2000:]
