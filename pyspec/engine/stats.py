"""What the engine reports: per-step outputs, per-request statistics and results, deployment-wide
counters, and step traces."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Dict, List, Optional, Sequence

__all__ = ["RequestOutput", "RequestStats", "GenerationResult", "EngineStats", "StepTrace",
           "StepError"]


@dataclass
class RequestOutput:
    """What one :meth:`Engine.step` produced for a request (the tokens kept this step)."""

    request_id: int
    new_tokens: List[int]
    finished: bool
    finish_reason: Optional[str]  # "stop" | "length" | "abort" | "error" once finished


@dataclass
class RequestStats:
    drafts: int = 0  # decode steps that verified at least one draft token
    draft_tokens: int = 0  # draft tokens (tree nodes) verified
    accepted_tokens: int = 0  # draft tokens accepted
    steps: int = 0  # decode steps (target forwards that emitted tokens)
    cached_tokens: int = 0  # prompt tokens served by the prefix cache (known once finished)
    preemptions: int = 0  # times the request's KV was released and recomputed (once finished)
    # accepted_per_position[i]: speculative steps whose accepted path reached draft depth i + 1.
    accepted_per_position: List[int] = field(default_factory=list)
    drafter: Optional[str] = None  # the drafter in use at the end
    drafters_used: List[str] = field(default_factory=list)
    # Decisions: {"drafter_error": n, "low_acceptance": n, "cost_model": n}; probes: re-tries of
    # speculation after a fallback; switches: {"low_acceptance": n, "cost_model": n} (the latter:
    # it started plain on its drafter's record).
    fallbacks: Dict[str, int] = field(default_factory=dict)
    probes: int = 0
    switches: Dict[str, int] = field(default_factory=dict)
    token_acceptance: Optional[float] = None  # the cost model's per-token acceptance estimate
    # "long": the prompt was longer than the engine's long-prompt threshold (its drafter is the
    # long-prompt channel's); "short" otherwise.
    channel: str = "short"
    # The acceptance predictor's estimate for this request (None: no predictor consulted), and
    # whether it made the request decode plainly.
    predicted_acceptance: Optional[float] = None
    predictor_plain: bool = False

    @property
    def acceptance_length(self) -> float:
        """1 + accepted / drafts (the mean tokens per speculative step, counting the bonus or
        recovered token); 1.0 when nothing was drafted."""
        return 1.0 + self.accepted_tokens / self.drafts if self.drafts else 1.0

    @property
    def per_position_acceptance(self) -> List[float]:
        """Share of speculative steps that accepted at least i + 1 draft tokens."""
        return [c / self.drafts for c in self.accepted_per_position] if self.drafts else []

    def copy(self) -> "RequestStats":
        return RequestStats(**{k: (list(v) if isinstance(v, list) else
                                   dict(v) if isinstance(v, dict) else v)
                               for k, v in vars(self).items()})


@dataclass
class GenerationResult:
    request_id: int
    token_ids: List[int]
    finish_reason: Optional[str]
    stats: RequestStats = field(default_factory=RequestStats)


@dataclass
class EngineStats:
    """Deployment-wide counters and measurements (what the server exports). The adaptive
    speculation fields are the scheduler's (``Scheduler.cost_model_stats``)."""

    steps: int = 0
    drafts: int = 0
    draft_tokens: int = 0
    accepted_tokens: int = 0
    accepted_per_position: List[int] = field(default_factory=list)
    acceptance_ewma: Optional[float] = None  # average of per-step accepted / drafted depth
    fallbacks: Dict[str, int] = field(default_factory=dict)
    switches: Dict[str, int] = field(default_factory=dict)
    draft_seconds: float = 0.0
    verify_seconds: float = 0.0
    draft_cost: float = 0.0  # measured, relative to a plain decode step, times the batch
    verify_cost: float = 0.0
    # Extra tokens a step can verify before its forward turns compute-bound (measured; None
    # until the step-time fit has data).
    spec_free_tokens: Optional[int] = None
    # Times the memory-bound limit was lifted because it had stopped every draft (so that the
    # step-time fit sees drafting steps again).
    budget_probes: int = 0
    # Decode steps run without drafts to measure a plain step (calibration steps).
    calibration_steps: int = 0


def count_speculative_step(stats, nodes: int, accepted: int) -> None:
    """Adds one speculative step (``nodes`` draft tokens verified, ``accepted`` kept) to a
    :class:`RequestStats` or :class:`EngineStats`."""
    stats.drafts += 1
    stats.draft_tokens += nodes
    stats.accepted_tokens += accepted
    per = stats.accepted_per_position
    if len(per) < accepted:
        per.extend([0] * (accepted - len(per)))
    for k in range(accepted):
        per[k] += 1


@dataclass
class StepTrace:
    """What one step did, for tracing (built only when ``Engine.trace_hook`` is set). Times are
    ``time.perf_counter()`` seconds."""

    start: float
    end: float = 0.0
    drafts: List[tuple] = field(default_factory=list)  # (drafter, t0, t1, [request ids])
    verify: tuple = (0.0, 0.0)  # the target forward
    prefill: Dict[int, int] = field(default_factory=dict)  # request -> chunk tokens
    # request -> (draft nodes, tree depth, accepted draft tokens, emitted tokens)
    decisions: Dict[int, tuple] = field(default_factory=dict)
    # (Chrome trace file, step number in it) while a profile window records (Engine.profile)
    profile: Optional[tuple] = None


class StepError(RuntimeError):
    """An engine step failed after it was scheduled. ``request_ids``: the requests of that step,
    now finished with reason "error" (their KV freed); every other request goes on."""

    def __init__(self, request_ids: Sequence[int], cause: BaseException):
        self.request_ids = list(request_ids)
        self.cause = cause
        super().__init__(f"engine step failed ({type(cause).__name__}: {cause}); requests "
                         f"{self.request_ids} finished with 'error'")
