import pytest


def devices():
    """Device parameters for 'one test body per device' tests: cpu always, cuda marked."""
    return ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)]


def require_module(name: str) -> None:
    """Skip when an optional test dependency is not installed — except under CI (CI=true), where
    a missing dependency would silently turn real checks into skips, so it fails instead."""
    import importlib.util
    import os

    if importlib.util.find_spec(name) is None:
        if os.environ.get("CI", "").lower() in ("1", "true", "yes"):
            pytest.fail(f"test dependency '{name}' is missing in CI (see .ci/run)")
        pytest.skip(f"'{name}' is not installed")
