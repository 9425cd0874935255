"""Fixtures of the engine tests: the tiny random target and its plain greedy outputs."""

from drafters_support import model, plain  # noqa: F401 (fixtures)
