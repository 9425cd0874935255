import os
import subprocess
import sys

import pytest

import pyspec
from pyspec import _C


def test_version_matches_metadata():
    from importlib.metadata import version

    assert pyspec.__version__ == version("pyspec-decode")


def test_imported_from_install_not_source_tree():
    # The extension must come from the installed package (it is never built into the source tree).
    assert os.path.exists(_C.__file__)
    assert pyspec.__file__ is not None


def test_cuda_op_without_gpu_is_a_clear_error():
    if pyspec.cuda_available():
        pytest.skip("a CUDA device is present")
    with pytest.raises(RuntimeError, match="CUDA"):
        _C.cuda_require_device("materialize_kv")
    assert _C.cuda_device_count() == 0
    reason = _C.cuda_unavailable_reason()
    assert reason != ""
    if "InsufficientDriver" in reason:  # what a CUDA build says on a machine with no GPU driver
        assert "no NVIDIA driver is loaded" in reason, reason


def test_cli_info_runs():
    out = subprocess.run([sys.executable, "-m", "pyspec", "info"], capture_output=True, text=True,
                         check=True, cwd="/")
    assert f"pyspec {pyspec.__version__}" in out.stdout
    assert "built with CUDA" in out.stdout
    k = pyspec._C.LinearKernels()
    assert f"dense layer kernels (a model's default, isa {k.isa}): " + ", ".join(
        f"{d} {k.kernel(d)} up to {k.max_fast_rows(d)} rows"
        for d in ("float32", "bfloat16", "float16")) in out.stdout
    rows = k.packed_max_rows
    assert (f"packed exact weights: read as codes up to {rows} rows" if rows else
            "packed exact weights: unavailable") in out.stdout


def test_two_imports_share_nothing_mutable():
    # Trees are values: building one never changes another (no module-global state).
    a = pyspec.TokenTree.chain(3)
    b = pyspec.TokenTree.kary(2, 2)
    assert a.num_nodes == 4 and b.num_nodes == 7


# ---- helpers.require_module: skips (a whole module, at its import) or fails under CI ------------


def _without(monkeypatch, missing):
    """importlib.util.find_spec as if the top-level packages ``missing`` were not installed."""
    import importlib.util

    real = importlib.util.find_spec

    def find_spec(name, *args, **kwargs):
        if name.split(".")[0] in missing:
            if "." in name:  # what find_spec does for a submodule of a missing package
                raise ModuleNotFoundError(f"No module named {name.split('.')[0]!r}")
            return None
        return real(name, *args, **kwargs)

    monkeypatch.setattr(importlib.util, "find_spec", find_spec)


def test_require_module_skips_a_whole_module_at_import(monkeypatch, tmp_path):
    """A test module calling require_module at its import is skipped (pytest only accepts a skip
    outside a test with allow_module_level=True; without it, collection errors), as is a test."""
    import importlib.util

    from helpers import require_module

    monkeypatch.delenv("CI", raising=False)
    _without(monkeypatch, {"fastapi", "opentelemetry"})
    for name in ("fastapi", "opentelemetry.sdk"):
        with pytest.raises(pytest.skip.Exception, match=f"'{name}' is not installed") as e:
            require_module(name)
        assert e.value.allow_module_level
    # As a test module's import runs it (what pytest's collection sees).
    path = tmp_path / "test_needs_fastapi.py"
    path.write_text("from helpers import require_module\n\nrequire_module('fastapi')\n"
                    "import fastapi  # noqa: E402\n")
    spec = importlib.util.spec_from_file_location("test_needs_fastapi", path)
    with pytest.raises(pytest.skip.Exception) as e:
        spec.loader.exec_module(importlib.util.module_from_spec(spec))
    assert e.value.allow_module_level
    assert require_module("pytest") is None  # installed: nothing happens


@pytest.mark.parametrize("ci", ["true", "1", "yes"])
def test_require_module_fails_under_ci(monkeypatch, ci):
    from helpers import require_module

    monkeypatch.setenv("CI", ci)
    _without(monkeypatch, {"fastapi", "opentelemetry"})
    for name in ("fastapi", "opentelemetry.sdk"):
        with pytest.raises(pytest.fail.Exception, match=f"'{name}' is missing in CI"):
            require_module(name)
    assert require_module("pytest") is None


# ---- the package's import graph ------------------------------------------------------------------


def _pyspec_imports():
    """The installed package's modules (name -> file) and the pyspec modules each imports, at module
    level or in a function (name -> {imported name: line}). ``from X import Y`` imports X.Y when
    that is a module, else X; imports of the top-level ``pyspec`` package (it only re-exports) and
    of the module itself are left out."""
    import ast

    root = os.path.dirname(os.path.abspath(pyspec.__file__))
    files = {}
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d != "__pycache__")
        for f in sorted(filenames):
            if f.endswith(".py"):
                parts = os.path.relpath(os.path.join(dirpath, f), root)[:-3].split(os.sep)
                if parts[-1] == "__init__":
                    parts = parts[:-1]
                files[".".join(["pyspec"] + parts)] = os.path.join(dirpath, f)

    def known(name):  # the module a dotted name lies in (None outside the package)
        while name and name not in files:
            name = name.rpartition(".")[0]
        return name or None

    graph = {}
    for mod, path in files.items():
        with open(path, encoding="utf-8") as f:
            tree = ast.parse(f.read(), path)
        package = mod if path.endswith("__init__.py") else mod.rpartition(".")[0]
        edges = graph.setdefault(mod, {})
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:  # relative: from the module's package, up level - 1 packages
                    up = package.split(".")[:len(package.split(".")) - node.level + 1]
                    base = ".".join(up + ([base] if base else []))
                names = [f"{base}.{a.name}" if f"{base}.{a.name}" in files else base
                         for a in node.names]
            else:
                continue
            for name in names:
                if name != "pyspec" and not name.startswith("pyspec."):
                    continue
                target = known(name)
                if target is not None and target not in ("pyspec", mod):
                    edges.setdefault(target, node.lineno)
    return files, graph


def _strongly_connected(graph):
    """Tarjan's strongly connected components of {node: iterable of successors}, iteratively."""
    index, low, on_stack, stack, comps = {}, {}, set(), [], []
    for start in graph:
        if start in index:
            continue
        work = [(start, iter(graph[start]))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            v, it = work[-1]
            w = next(it, None)
            if w is not None:
                if w not in index:
                    index[w] = low[w] = len(index)
                    stack.append(w)
                    on_stack.add(w)
                    work.append((w, iter(graph[w])))
                elif w in on_stack:
                    low[v] = min(low[v], index[w])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[v])
            if low[v] == index[v]:
                comp = []
                while True:
                    w = stack.pop()
                    on_stack.discard(w)
                    comp.append(w)
                    if w == v:
                        break
                comps.append(sorted(comp))
    return comps


def _a_cycle(graph, comp):
    """One import cycle through the component's first module: a -> ... -> a (shortest)."""
    first, members = comp[0], set(comp)
    prev, frontier = {}, [first]
    while frontier:
        nxt = []
        for v in frontier:
            for w in sorted(graph[v]):
                if w not in members or w in prev:
                    continue
                prev[w] = v
                if w == first:
                    path = [first]
                    while path[-1] != first or len(path) == 1:
                        path.append(prev[path[-1]])
                    return path[::-1]
                nxt.append(w)
        frontier = nxt
    raise AssertionError(f"no cycle through {first} in {comp}")


def test_strongly_connected_components_find_cycles():
    g = {"a": {"b"}, "b": {"c"}, "c": {"a", "d"}, "d": set(), "e": {"e"}, "f": {"d"}}
    comps = sorted(_strongly_connected(g))
    assert comps == [["a", "b", "c"], ["d"], ["e"], ["f"]]
    assert _a_cycle(g, ["a", "b", "c"]) == ["a", "b", "c", "a"]


def test_package_has_no_import_cycles():
    """No two pyspec modules import each other, directly or through others: the package's import
    graph (every module of the installed package, parsed) has no strongly connected component of
    more than one module."""
    files, graph = _pyspec_imports()
    assert "pyspec.engine.engine" in graph and "pyspec.serve.app" in graph, sorted(files)
    assert graph["pyspec.engine.engine"], "no pyspec imports found in pyspec.engine.engine"
    cycles = [c for c in _strongly_connected(graph) if len(c) > 1]
    lines = []
    for comp in cycles:
        cycle = _a_cycle(graph, comp)
        steps = " -> ".join(
            f"{a} (line {graph[a][b]})" for a, b in zip(cycle, cycle[1:])) + f" -> {cycle[-1]}"
        lines.append(f"{len(comp)} modules import each other: {', '.join(comp)}; e.g. {steps}")
    assert not cycles, "import cycles in pyspec:\n" + "\n".join(lines)


def test_importing_the_source_checkout_says_so(tmp_path):
    """`import pyspec` from a repository root (the package's sources there, no compiled core)
    names the cause and the way out, not a circular import."""
    import shutil

    src = os.path.dirname(pyspec.__file__)
    shutil.copytree(src, tmp_path / "pyspec", ignore=shutil.ignore_patterns("_C.*", "__pycache__"))
    (tmp_path / "pyproject.toml").write_text("")
    res = subprocess.run([sys.executable, "-c", "import pyspec"], cwd=tmp_path,
                         capture_output=True, text=True, timeout=120)
    assert res.returncode != 0
    assert "importing the source checkout instead of the installed package" in res.stderr, \
        res.stderr[-2000:]
