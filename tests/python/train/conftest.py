"""Fixtures of the train tests, shared by all of them (package scope: the drafter is trained
once): ``tiny`` (a tiny random target folder) and ``trained`` (an EAGLE drafter train-draft wrote
for it, with its corpus)."""

import pytest

from models_support import write_tiny_model
from train_support import _train


@pytest.fixture(scope="package")
def tiny(tmp_path_factory):
    return write_tiny_model(tmp_path_factory.mktemp("tiny-target"))


@pytest.fixture(scope="package")
def trained(tiny, tmp_path_factory):
    return _train(tiny, str(tmp_path_factory.mktemp("drafter") / "d"))
