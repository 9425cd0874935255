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
    assert _C.cuda_unavailable_reason() != ""


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
