import pytest


def devices():
    """Device parameters for 'one test body per device' tests: cpu always, cuda marked."""
    return ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)]
