"""Shared test setup: the tests' support modules (helpers.py, reference.py, *_support.py, beside
this file) importable from every test directory, whatever the import mode or the directory pytest
runs from; the extension check; CUDA-marked tests skipped without a GPU."""

import os
import sys

import pytest

# pytest's default "prepend" import mode puts this directory on sys.path when it loads this file;
# said explicitly, so that tests/python/<package>/test_*.py find the support modules under any mode.
_HERE = os.path.dirname(os.path.abspath(__file__))
if _HERE not in sys.path:
    sys.path.insert(0, _HERE)


def pytest_configure(config):
    try:
        import pyspec._C  # noqa: F401
    except ImportError as e:
        raise pytest.UsageError(
            f"pyspec's extension is not importable ({e}). Install the package first "
            "(pip install --no-build-isolation .) and run `pytest` rather than `python -m pytest` "
            "from the repository root, so the installed package is imported, not the source tree."
        )


def _cuda_ok() -> bool:
    try:
        import pyspec

        return pyspec.cuda_available()
    except Exception:
        return False


def pytest_collection_modifyitems(config, items):
    if _cuda_ok():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU and a CUDA build of pyspec")
    for item in items:
        if "cuda" in item.keywords:
            item.add_marker(skip)



@pytest.fixture
def torch_threads_2():
    """torch with at least 2 intra-op threads for the test (restored after): what tests of
    which work runs on one thread compare against. Yields the count."""
    import torch

    prev = torch.get_num_threads()
    if prev < 2:
        torch.set_num_threads(2)
    try:
        yield torch.get_num_threads()
    finally:
        torch.set_num_threads(prev)
