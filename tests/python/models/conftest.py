"""Fixtures shared by the model tests: ``packed_kernels``, each build with a packed kernel
(test_packed.py, test_packed_codes.py)."""

import pytest

from pyspec import _C


@pytest.fixture(params=["avx2", "avx512"])
def packed_kernels(request):
    """The builds with a packed kernel, each through its own LinearKernels; one this CPU lacks is
    a visible skip."""
    try:
        return _C.LinearKernels(request.param)
    except ValueError as e:
        pytest.skip(f"no {request.param} kernel on this CPU: {e}")
