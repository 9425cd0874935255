"""The batched engine: the C++ continuous-batching scheduler driving the model runner and the
drafters (:class:`Engine`; one :meth:`Engine.step` per scheduler step).

Modules: :mod:`~pyspec.engine.engine` (the step), :mod:`~pyspec.engine.drafting` (drafters,
draft validation and failure isolation), :mod:`~pyspec.engine.accept` (batched acceptance),
:mod:`~pyspec.engine.routing` (which drafter serves a request, switching), and
:mod:`~pyspec.engine.stats` (outputs, statistics, traces). Adaptive speculation (step-cost fit,
draft lengths, calibration, fallback, switching evidence) is the C++ scheduler's.
"""

from pyspec.engine.engine import Engine
from pyspec.engine.routing import RouteFeatures, Router
from pyspec.engine.stats import (EngineStats, GenerationResult, RequestOutput, RequestStats,
                                 StepError, StepTrace)
from pyspec.params import SamplingParams

__all__ = ["Engine", "SamplingParams", "RequestOutput", "GenerationResult", "RequestStats",
           "Router", "RouteFeatures", "EngineStats", "StepTrace", "StepError"]
