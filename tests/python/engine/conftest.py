"""Fixtures of the engine tests: the tiny random target and its plain greedy outputs."""

import pytest

from drafters_support import plain_outputs, tiny_model


@pytest.fixture(scope="module")
def model():
    return tiny_model()


@pytest.fixture(scope="module")
def plain(model):
    return plain_outputs(model)
