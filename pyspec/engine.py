"""The batched engine loop: the C++ continuous-batching scheduler driving the model runner and the
drafters.

One :meth:`Engine.step` is one scheduler step (DESIGN sections 2-3):

1. ``Scheduler.step()`` picks the batch: prefill chunks, plain decode roots and speculative roots
   with a per-request draft budget (batch-aware, and per request from the Leviathan cost model).
2. DRAFT: each speculative request's drafter (:mod:`pyspec.drafters`; chosen per request by the
   :class:`Router`) proposes a token tree within the budget. A drafter that raises or returns a
   malformed draft is isolated to the requests it failed on, which decode plainly from then on.
3. VERIFY: the scheduler's pending copy-on-write block copies are applied (to the target's KV pool
   and every drafter pool), then one ``runner.step`` runs the whole batch: prefill chunks, plain
   roots and every draft tree, with tree attention.
4. ACCEPT/COMMIT: one batched :func:`~pyspec.sampling.accept` verifies every tree (greedy, the
   rejection-sampling rule for sampled draft children, the target-only walk for deterministic
   ones; draws keyed by the request's seed and the sequence position, so a request's output never
   depends on the rest of the batch, and with deterministic drafts equals plain sampling's). The
   accepted paths and prefill chunks are materialized into the pages, drafters see what was
   committed, and ``Scheduler.update`` applies the results (stop tokens, ``max_tokens``, adaptive
   draft length, fallback to plain decoding and re-probing, freeing finished requests).

Adaptive speculation: the engine measures the target's step time as a function of the tokens it
runs and each drafter's time per draft token, and hands the ratios to the scheduler's cost model
(``Scheduler.set_cost_model``), which picks each request's draft length from its acceptance EWMA
(Leviathan et al. 2023) and falls back to plain decoding when speculation cannot pay. A request
whose acceptance stays below ``switch_below`` with one drafter is moved to the next drafter of its
route that it has not tried yet. Every decision is counted in the request's :class:`RequestStats`
and in :attr:`Engine.stats`.
"""

from __future__ import annotations

import contextlib
import logging
import random
import time
from dataclasses import dataclass, field, fields, replace
from numbers import Integral, Real
from typing import (Callable, Dict, Iterable, Iterator, List, Mapping, Optional, Sequence, Tuple,
                    Union)

import torch

from pyspec import TokenTree, _C
from pyspec.drafters import Drafter, make_drafter
from pyspec.drafters.base import (Draft, DraftRequest, PrefillChunk, Verified, layers_of,
                                  select_layers, union_layers)
from pyspec.runner import ModelRunner, SeqStep
from pyspec.sampling import accept, apply_sampling_filters

_log = logging.getLogger("pyspec.engine")

_F32_MAX = 3.4028234663852886e38  # the largest finite float32
_F32_TINY = 1.1754943508222875e-38  # the smallest normal float32

__all__ = ["Engine", "SamplingParams", "RequestOutput", "GenerationResult", "RequestStats",
           "Router", "EngineStats", "StepTrace"]


# A small step's host work (drafting, acceptance, commit, the drafters' updates) runs torch on one
# thread, as its forward does (see Engine._run_step). Off only to measure what that saves:
# bench/bench_fused.py --modes fused-torch-threads.
_SERIAL_STEPS = True


def _no_threads(rows: int):
    return contextlib.nullcontext()


@dataclass
class SamplingParams:
    """Per-request generation parameters.

    ``temperature == 0`` is greedy; ``seed=None`` draws a random seed. ``stop`` (strings) and
    ``n`` are applied by :class:`pyspec.LLM` (the engine works on token ids); ``stop_token_ids``
    end a request at the engine. ``ignore_eos``: do not stop at the tokenizer's end-of-sequence
    tokens (``pyspec.LLM`` adds them to ``stop_token_ids`` otherwise). ``speculative=False``
    decodes the request plainly (one token per step) through the same engine.
    """

    max_tokens: int = 16
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: Optional[int] = None
    stop: Union[None, str, Sequence[str]] = None
    stop_token_ids: Sequence[int] = ()
    n: int = 1
    ignore_eos: bool = False
    speculative: bool = True


_PARAM_NAMES = {f.name for f in fields(SamplingParams)}
# Decode steps without any draft token, under a memory-bound limit at or below the batch, before
# the engine lifts the limit for a few steps to re-measure (see Engine._update_cost_model): 8 for
# the first probe, doubling after each, up to 64. A fit from a handful of noisy first steps can
# put the limit at the batch size; a short request would otherwise finish before the first probe.
BUDGET_PROBE_FIRST = 8
BUDGET_PROBE_STEPS = 64
# The converse: after this many decode-only steps in a row that all drafted, the next decode-only
# step drafts nothing (a plain calibration step). The step-time fit needs steps of different sizes;
# with a drafter whose trees are always the same size (an EAGLE head's three depth-1 nodes) every
# step has the same rows, the fit's intercept and slope are left to noise, and the cost model can
# put a plain step at 1.5x its measured time: it then keeps a losing drafter on. One plain step in
# CALIBRATION_STEPS + 1 costs a paying drafter about 1 / CALIBRATION_STEPS of its gain.
CALIBRATION_STEPS = 32


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

    @property
    def acceptance_length(self) -> float:
        """1 + accepted / drafts (the mean tokens per speculative step, counting the bonus or
        recovered token); 1.0 when nothing was drafted."""
        return 1.0 + self.accepted_tokens / self.drafts if self.drafts else 1.0

    @property
    def per_position_acceptance(self) -> List[float]:
        """Share of speculative steps that accepted at least i + 1 draft tokens."""
        return [c / self.drafts for c in self.accepted_per_position] if self.drafts else []


@dataclass
class GenerationResult:
    request_id: int
    token_ids: List[int]
    finish_reason: Optional[str]
    stats: RequestStats = field(default_factory=RequestStats)


@dataclass
class EngineStats:
    """Deployment-wide counters and measurements (what the server exports)."""

    steps: int = 0
    drafts: int = 0
    draft_tokens: int = 0
    accepted_tokens: int = 0
    accepted_per_position: List[int] = field(default_factory=list)
    acceptance_ewma: Optional[float] = None  # EWMA of per-step accepted / drafted depth
    fallbacks: Dict[str, int] = field(default_factory=dict)
    switches: Dict[str, int] = field(default_factory=dict)
    draft_seconds: float = 0.0
    verify_seconds: float = 0.0
    draft_cost: float = 0.0  # measured, relative to a plain decode step, times the batch
    verify_cost: float = 0.0
    # Extra tokens a step can verify before its forward turns compute-bound (measured; None
    # until the step-time fit has data).
    spec_free_tokens: Optional[int] = None
    # Times the memory-bound limit was lifted because it had stopped every draft for
    # BUDGET_PROBE_STEPS steps (so that the step-time fit sees drafting steps again).
    budget_probes: int = 0
    # Decode steps run without drafts to measure a plain step (CALIBRATION_STEPS).
    calibration_steps: int = 0


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


@dataclass
class RouteFeatures:
    prompt_len: int
    batch_size: int  # requests queued or running when this one arrived


class Router:
    """Picks a request's drafter from simple features; the first matching rule wins.

    ``rules``: ``[(predicate(RouteFeatures) -> bool, drafter_name), ...]``; ``default``: the
    drafter otherwise. ``switch_order``: drafters a request moves to (in order) when its
    acceptance stays low with the current one. Example: long prompts to prompt lookup::

        Router([(lambda f: f.prompt_len > 1024, "ngram")], default="eagle",
               switch_order=["ngram"])
    """

    def __init__(self, rules=(), default: Optional[str] = None, switch_order: Sequence[str] = ()):
        self.rules = list(rules)
        self.default = default
        self.switch_order = list(switch_order)

    def route(self, f: RouteFeatures) -> Optional[str]:
        for pred, name in self.rules:
            if pred(f):
                return name
        return self.default


@dataclass
class _Req:
    params: SamplingParams
    seed: int
    context: List[int]  # prompt + generated tokens (the drafter's input)
    num_prompt: int
    drafter: Optional[str]
    stats: RequestStats = field(default_factory=RequestStats)
    finished: bool = False
    finish_reason: Optional[str] = None
    failed: bool = False  # its drafter failed: plain decoding from now on
    ewma: float = -1.0  # engine-side acceptance EWMA with the current drafter
    spec_steps_here: int = 0  # speculative steps with the current drafter
    tried: List[str] = field(default_factory=list)

    @property
    def generated(self) -> List[int]:
        return self.context[self.num_prompt:]


def _as_params(params: Union[None, SamplingParams, Mapping]) -> SamplingParams:
    if params is None:
        return SamplingParams()
    if isinstance(params, SamplingParams):
        return params
    if isinstance(params, Mapping):
        unknown = set(params) - _PARAM_NAMES
        if unknown:
            raise ValueError(f"unknown sampling parameters: {sorted(unknown)}; allowed: "
                             f"{sorted(_PARAM_NAMES)}")
        return SamplingParams(**params)
    raise ValueError(f"params must be a SamplingParams, a dict or None; got {type(params).__name__}")


# Stop strings are checked against the text after every token; a bound on their length bounds
# that work per token (and no real stop sequence comes near it).
MAX_STOP_CHARS = 1024


def validate_params(p: SamplingParams, vocab: int) -> None:
    """ValueError naming the bad field and what is allowed."""
    if not _is_int(p.max_tokens) or p.max_tokens < 1:
        raise ValueError(f"max_tokens must be an int >= 1; got {p.max_tokens!r}")
    # The sampling filters run in float32: a value must stay in range once converted (1e300 is
    # finite here but inf there; a top_p of 1e-300 would become 0).
    if not _is_real(p.temperature) or not 0.0 <= p.temperature <= _F32_MAX:
        raise ValueError(f"temperature must be a number in [0, {_F32_MAX:.4g}] (0 = greedy); "
                         f"got {p.temperature!r}")
    if not _is_int(p.top_k) or p.top_k < 0:
        raise ValueError(f"top_k must be an int >= 0 (0 = off); got {p.top_k!r}")
    if not _is_real(p.top_p) or not _F32_TINY <= p.top_p <= 1.0:
        raise ValueError(f"top_p must be in (0, 1] (at least {_F32_TINY:.4g}, the smallest "
                         f"normal float32); got {p.top_p!r}")
    if not _is_real(p.min_p) or not 0.0 <= p.min_p <= 1.0:
        raise ValueError(f"min_p must be in [0, 1]; got {p.min_p!r}")
    for name in ("ignore_eos", "speculative"):
        if not isinstance(getattr(p, name), bool):
            raise ValueError(f"{name} must be a bool; got {getattr(p, name)!r}")
    if p.seed is not None and (not _is_int(p.seed) or not -(1 << 63) <= p.seed < (1 << 63)):
        raise ValueError(f"seed must be None or a 64-bit signed int; got {p.seed!r}")
    if not _is_int(p.n) or not 1 <= p.n <= 64:
        raise ValueError(f"n must be an int in [1, 64]; got {p.n!r}")
    if isinstance(p.stop_token_ids, (str, bytes, Iterator)) or \
            not isinstance(p.stop_token_ids, Iterable) or \
            not all(_is_int(t) for t in p.stop_token_ids):
        # An iterator is refused: checking it here would consume it, and the request would then
        # silently stop on nothing.
        raise ValueError(f"stop_token_ids must be a list of ints; got {p.stop_token_ids!r}")
    stop_ids = [int(t) for t in p.stop_token_ids]
    if any(not 0 <= t < vocab for t in stop_ids):
        raise ValueError(f"stop_token_ids must be in [0, {vocab}); got {stop_ids}")
    stop = p.stop
    if stop is not None:
        items = [stop] if isinstance(stop, str) else stop
        if not isinstance(items, (list, tuple)) or not all(isinstance(s, str) and s for s in items):
            raise ValueError(f"stop must be a non-empty string or a list of them; got {stop!r}")
        if len(items) > 16:
            raise ValueError(f"stop allows at most 16 strings; got {len(items)}")
        for s in items:
            if len(s) > MAX_STOP_CHARS:
                raise ValueError(f"stop strings may have at most {MAX_STOP_CHARS} characters; "
                                 f"got one of {len(s)}")
            try:
                s.encode("utf-8")
            except UnicodeEncodeError:
                raise ValueError(f"stop string {ascii(s)[:80]} is not valid Unicode text (a lone "
                                 "surrogate): generated text can never contain it") from None


def context_limit(cfg) -> int:
    """The most tokens (prompt + new) a request may span on a model of config ``cfg``: the
    sliding window, and the trained context unless dynamic RoPE scaling extends it."""
    return min(cfg.sliding_window or (1 << 62), cfg.max_position_embeddings
               if cfg.rope_scaling.rope_type != "dynamic" else (1 << 62))


def check_sampling_options(params: SamplingParams) -> None:
    """``validate_params`` for command-line values, before a model is loaded: the message names
    the option (the field's name with '-' for '_'). The vocabulary only bounds stop_token_ids,
    which the commands do not set."""
    try:
        validate_params(params, vocab=1)
    except ValueError as e:
        field, _, rest = str(e).partition(" ")
        raise ValueError(f"--{field.replace('_', '-')} {rest}") from None


def sample_seed(seed: int, k: int) -> int:
    """The seed of sample ``k`` of a request seeded ``seed`` (``n`` > 1): ``seed + k``, wrapped
    into the signed 64-bit range, so the largest valid seed stays valid."""
    return (int(seed) + k + (1 << 63)) % (1 << 64) - (1 << 63)


class StepError(RuntimeError):
    """An engine step failed after it was scheduled. ``request_ids``: the requests of that step,
    now finished with reason "error" (their KV freed); every other request goes on."""

    def __init__(self, request_ids: Sequence[int], cause: BaseException):
        self.request_ids = list(request_ids)
        self.cause = cause
        super().__init__(f"engine step failed ({type(cause).__name__}: {cause}); requests "
                         f"{self.request_ids} finished with 'error'")


class Engine:
    """Continuous-batching speculative decoding over a :class:`ModelRunner`.

    Args:
        runner: the target's runner; the engine's scheduler manages its whole KV pool.
        tokenizer: optional, kept for callers (``engine.tokenizer``); the engine works on ids.
        max_num_seqs, max_num_batched_tokens: scheduler batch limits.
        drafter: the default drafter: ``"ngram"``, ``"none"`` (plain decoding), ``"layer-skip:L"``,
            a drafter folder (EAGLE/Medusa heads), a draft-model folder, or a
            :class:`~pyspec.drafters.Drafter` (see :func:`pyspec.drafters.make_drafter`).
        drafters: further named drafters for the router (name -> spec or Drafter).
        router: a :class:`Router`; default: every request uses ``drafter``.
        gamma: most draft tokens (tree nodes) per request per step; default: the drafter's.
        adaptive: draft length from the Leviathan cost model with measured costs, fallback to
            plain decoding when even an optimistic acceptance estimate predicts no gain (and below
            ``min_acceptance_rate``, a hard floor, default 0 = none) with re-probing after
            ``probe_interval`` plain steps (twice as long after each probe that goes no better, up
            to 8 times), drafter switching below ``switch_below`` (or when a request starts plain
            because its drafter has been losing on this engine).
        enable_prefix_cache: share full prompt blocks between requests.
        **scheduler_kwargs: further :class:`pyspec._C.Scheduler` options (``max_prefill_chunk``,
            ``max_draft_tokens``, ``initial_draft_tokens``, ``spec_token_budget``,
            ``spec_disable_batch_size``, ``ewma_alpha``, ``min_acceptance_rate``,
            ``warmup_steps``, ``probe_interval``, ``record_transitions``); ``ewma_alpha`` also
            weighs the deployment-wide ``stats.acceptance_ewma`` (default there: 2 / 65).
    """

    def __init__(self, runner: ModelRunner, tokenizer=None, *, max_num_seqs: int = 64,
                 max_num_batched_tokens: int = 2048,
                 drafter: Union[None, str, Drafter] = "ngram",
                 drafters: Optional[Mapping[str, Union[str, Drafter]]] = None,
                 router: Optional[Router] = None, gamma: Optional[int] = None,
                 adaptive: bool = True, switch_below: float = 0.0,
                 enable_prefix_cache: bool = True, **scheduler_kwargs):
        if gamma is not None and (not _is_int(gamma) or not 0 <= gamma <= 255):
            raise ValueError(f"gamma must be an int in [0, 255]; got {gamma!r}")
        if not _is_real(switch_below) or not 0.0 <= switch_below <= 1.0:
            raise ValueError(f"switch_below must be in [0, 1]; got {switch_below!r}")
        self.runner = runner
        self.tokenizer = tokenizer
        self.vocab_size = int(runner.model.cfg.vocab_size)
        self.drafters: Dict[str, Drafter] = {}
        default = make_drafter(drafter, runner)
        if default is not None:
            self.drafters[default.name] = default
        for name, spec in (drafters or {}).items():
            d = make_drafter(spec, runner)
            if d is None:
                raise ValueError(f"drafters[{name!r}] is 'none'; leave it out instead")
            self.drafters[name] = d
        self.default_drafter = default.name if default is not None else None
        # Each drafter's requests share a scheduler evidence group: its recent acceptance on this
        # engine is a new request's prior for the cost model's fallback test.
        self._evidence_group = {name: i for i, name in enumerate(self.drafters)}
        self.router = router
        if router is not None:
            for name in [n for _, n in router.rules] + [router.default] + router.switch_order:
                if name is not None and name not in self.drafters:
                    raise ValueError(f"the router names drafter {name!r}; the engine has "
                                     f"{sorted(self.drafters)}")
        # The scheduler's draft length counts tree *levels* (the KV it reserves is for the accepted
        # path, at most depth + 1 tokens); each drafter turns a depth into its node budget.
        depths = [int(d.max_draft_depth) for d in self.drafters.values()]
        self.gamma = int(gamma) if gamma is not None else (max(depths) if depths else 0)
        self._speculate = bool(self.drafters) and self.gamma > 0
        self.switch_below = float(switch_below)
        self.adaptive = bool(adaptive)
        kw = dict(scheduler_kwargs)
        if self._speculate:
            kw.setdefault("max_draft_tokens", self.gamma)
            kw.setdefault("initial_draft_tokens", min(4, kw["max_draft_tokens"]))
            if self.adaptive:
                kw.setdefault("cost_model", True)
        try:
            self.scheduler = _C.Scheduler(runner.kv.num_blocks, runner.block_size,
                                          enable_prefix_cache=enable_prefix_cache,
                                          max_num_batched_tokens=max_num_batched_tokens,
                                          max_num_seqs=max_num_seqs, **kw)
        except TypeError as e:  # an unknown keyword
            raise ValueError(str(e)) from None
        # The deployment-wide acceptance EWMA weighs each speculative step as the scheduler's
        # per-request ones do (``ewma_alpha``; without it, that of the default 64-step window).
        self._deploy_alpha = float(kw.get("ewma_alpha", 2.0 / 65))
        self._pools = [p for d in self.drafters.values() for p in d.kv_pools()]
        # The target layers any drafter reads (False: none); each drafter gets its own.
        depth = runner.model.cfg.num_hidden_layers
        self._hidden_layers = union_layers(self.drafters.values(), depth)
        self._need_hidden = self._hidden_layers or False
        self._layers_of = {name: layers_of(d, depth) for name, d in self.drafters.items()
                           if d.needs_hidden}
        from pyspec.models.llama import hidden_layers

        for name, layers in self._layers_of.items():
            try:  # a custom drafter's layer list is checked now, not at every request's step
                hidden_layers(layers, depth)
            except ValueError as e:
                raise ValueError(f"drafter {name!r} reads target layers {list(layers)}: {e}"
                                 ) from None
        # Drafters with several draft sources (`A|B` parts, prompt lookup's match lengths): name
        # -> number of sources. The scheduler keeps MAX_DRAFT_SOURCES estimates per request;
        # sources beyond share the last.
        self._sourced = {}
        for name, d in self.drafters.items():
            n = d.num_draft_sources
            if not isinstance(n, int) or isinstance(n, bool) or n < 1:
                raise ValueError(f"drafter {name!r} has {n!r} draft sources; allowed: an int >= 1")
            if n > 1:
                self._sourced[name] = n
        self._reqs: Dict[int, _Req] = {}
        self._step_open = False  # between the scheduler's step() and update()
        self._next_id = 0
        self._chains: Dict[int, TokenTree] = {}
        self.stats = EngineStats()
        # Step-time model t = base + per_token * tokens (EWMA least squares) and draft timing.
        self._fit = [0.0] * 5  # n, sx, sy, sxx, sxy (exponentially weighted)
        self._draft_time: Dict[str, List[float]] = {}  # drafter -> [seconds, levels] EWMA sums
        self._nodes_per_level = 1.0  # tree nodes verified per draft level (EWMA)
        self._undrafted_steps = 0  # decode steps in a row that verified no draft token
        self._drafted_steps = 0  # decode-only steps in a row that verified a draft token
        self._probe_interval = BUDGET_PROBE_FIRST  # undrafted steps before the next budget probe
        self._last_batch = 1  # requests in the latest decode-only step
        self.debug_skip_residual = False  # tests only: a deliberately broken acceptance rule
        # Called with a StepTrace after every step that ran a forward (None: no tracing cost).
        self.trace_hook: Optional[Callable[[StepTrace], None]] = None
        # Requests whose served distributions are kept (quality gate): id -> list of logits rows,
        # row j = the target logits the request's emitted token j was drawn from.
        self._record: Dict[int, List[torch.Tensor]] = {}

    # ---- requests ----

    def add_request(self, prompt_ids: Sequence[int],
                    params: Union[None, SamplingParams, Mapping] = None) -> int:
        """Queue a request; returns its id. ValueError for bad input."""
        p = _as_params(params)
        try:
            prompt = [int(t) for t in prompt_ids]
        except (TypeError, ValueError):
            raise ValueError("the prompt must be a sequence of token ids") from None
        if not prompt:
            raise ValueError("the prompt must hold at least one token")
        v = self.vocab_size
        bad = [t for t in prompt if not 0 <= t < v]
        if bad:
            raise ValueError(f"prompt token ids must be in [0, {v}); got {bad[:5]}")
        validate_params(p, v)
        if p.top_k >= v:  # keeps every token: the same as off (and fits the filters' int32)
            p = replace(p, top_k=0)
        limit = context_limit(self.runner.model.cfg)
        if len(prompt) + int(p.max_tokens) > limit:
            raise ValueError(f"prompt ({len(prompt)} tokens) + max_tokens ({p.max_tokens}) exceeds "
                             f"the model's context of {limit} tokens")
        cap = self.runner.kv.num_blocks * self.runner.block_size
        if len(prompt) + int(p.max_tokens) + 1 > cap:
            raise ValueError(f"prompt ({len(prompt)} tokens) + max_tokens ({p.max_tokens}) does not "
                             f"fit in the KV pool ({cap} token slots)")
        stop = [int(t) for t in p.stop_token_ids]
        name = None
        if self._speculate and p.speculative:
            name = self.default_drafter
            if self.router is not None:
                name = self.router.route(RouteFeatures(
                    len(prompt), self.scheduler.num_running + self.scheduler.num_waiting))
        rid = self._next_id
        self.scheduler.add_request(rid, prompt, max_tokens=int(p.max_tokens), stop_token_ids=stop,
                                   speculative=name is not None,
                                   evidence_group=self._evidence_group.get(name, 0))
        self._next_id += 1
        seed = int(p.seed) if p.seed is not None else random.getrandbits(63)
        r = _Req(p, seed, prompt, len(prompt), name)
        r.stats.drafter = name
        if name is not None:
            r.tried.append(name)
            r.stats.drafters_used.append(name)
        self._reqs[rid] = r
        return rid

    def record_logits(self, request_id: int) -> None:
        """Keep the target logits each emitted token of this request was drawn from (the
        speculative verification's rows), for :meth:`recorded_logits`."""
        if request_id not in self._reqs:
            raise ValueError(f"unknown request id {request_id}")
        self._record.setdefault(request_id, [])

    def recorded_logits(self, request_id: int) -> Optional[torch.Tensor]:
        """float32 ``[generated, vocab]`` recorded for the request (and forgotten), or None."""
        rows = self._record.pop(request_id, None)
        if rows is None:
            return None
        r = self._reqs.get(request_id)
        t = torch.cat(rows) if rows else torch.empty(0, self.vocab_size)
        return t[:len(r.generated)] if r is not None else t

    def abort(self, request_id: int) -> bool:
        """Finish a request with 'abort', freeing its KV now. False if it had already finished."""
        r = self._reqs.get(request_id)
        if r is None:
            raise ValueError(f"unknown request id {request_id}")
        if r.finished:
            return False
        self.scheduler.abort(request_id)
        self._finish(request_id, r, "abort")
        return True

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished

    def result(self, request_id: int, *, pop: bool = False) -> GenerationResult:
        """The request's tokens so far, finish reason and stats (``pop``: forget it, finished
        requests only)."""
        r = self._reqs.get(request_id)
        if r is None:
            raise ValueError(f"unknown request id {request_id}")
        if pop:
            if not r.finished:
                raise ValueError(f"request {request_id} has not finished")
            del self._reqs[request_id]
            self._record.pop(request_id, None)
        st = RequestStats(**{k: (list(v) if isinstance(v, list) else
                                 dict(v) if isinstance(v, dict) else v)
                             for k, v in vars(r.stats).items()})
        return GenerationResult(request_id, list(r.generated), r.finish_reason, st)

    def _finish(self, rid: int, r: _Req, reason: Optional[str]) -> None:
        if reason in ("abort", "error"):
            self._record.pop(rid, None)
        r.finished = True
        r.finish_reason = reason
        if reason not in ("abort", "error"):
            for d in self.drafters.values():
                try:
                    d.learn(rid, r.context)
                except Exception:  # noqa: BLE001 - learning never fails a request
                    _log.warning("drafter %r failed to learn from request %d", d.name, rid)
        self._release_drafters(rid)
        if self.scheduler.has_request(rid):
            snap = self.scheduler.request(rid)
            self._sync_stats(r, snap)
            r.stats.cached_tokens = int(snap.num_cached_tokens)
            r.stats.preemptions = int(snap.num_preemptions)
            self.scheduler.release(rid)

    def _sync_stats(self, r: _Req, snap) -> None:
        st = r.stats
        for key, n in (("low_acceptance", snap.num_fallbacks),
                       ("cost_model", snap.num_cost_fallbacks)):
            if n:
                st.fallbacks[key] = int(n)
        st.probes = int(snap.num_probes)
        st.token_acceptance = snap.token_acceptance

    def _release_drafters(self, rid: int) -> None:
        for d in self.drafters.values():
            try:
                d.release(rid)
            except Exception:  # noqa: BLE001 - a drafter's bookkeeping never fails a request
                pass

    def _chain(self, n: int) -> TokenTree:
        t = self._chains.get(n)
        if t is None:
            t = self._chains[n] = TokenTree.chain(n)
        return t

    def _fail(self, rid: int, reason: str = "drafter_error", detail: str = "") -> None:
        r = self._reqs.get(rid)
        if r is None or r.failed:
            return
        r.failed = True
        _log.warning("request %d: drafter %r failed (%s); the request decodes plainly from here",
                     rid, r.drafter, detail or reason)
        r.stats.fallbacks[reason] = r.stats.fallbacks.get(reason, 0) + 1
        self.stats.fallbacks[reason] = self.stats.fallbacks.get(reason, 0) + 1
        self._release_drafters(rid)

    # ---- drafting ----

    def _draft_group(self, d: Drafter, reqs: List[DraftRequest]
                     ) -> Dict[int, Tuple[Draft, TokenTree]]:
        """Drafts of one drafter, with failures isolated to the requests they happen on."""
        try:
            drafts = d.propose(reqs)
            if len(drafts) != len(reqs):
                raise RuntimeError(f"drafter {d.name} returned {len(drafts)} drafts for "
                                   f"{len(reqs)} requests")
            pairs = list(zip(reqs, drafts))
        except Exception:  # noqa: BLE001 - retry one by one to find the failing requests
            pairs = []
            for q in reqs:
                try:
                    pairs.append((q, d.propose([q])[0]))
                except Exception as e:  # noqa: BLE001
                    self._fail(q.request_id, detail=f"propose: {type(e).__name__}: {e}")
        out = {}
        for q, dr in pairs:
            tree = self._valid(dr, q)
            if tree is not None:
                out[q.request_id] = (dr, tree)
            else:
                self._fail(q.request_id, detail="propose returned a malformed draft")
        return out

    def _valid(self, dr: Draft, q: DraftRequest) -> Optional[TokenTree]:
        """The draft's validated tree, or None when the draft is malformed."""
        try:
            n = len(dr.tokens)
            if n < 1 or n - 1 > q.budget or len(dr.parents) != n:
                return None
            if int(dr.tokens[0]) != int(q.context[-1]):
                return None
            if any(not 0 <= int(t) < self.vocab_size for t in dr.tokens):
                return None
            parents = [int(x) for x in dr.parents]
            tree = (self._chain(n - 1) if parents == list(range(-1, n - 1))
                    else TokenTree(parents))  # validates the shape (ValueError)
            if tree.max_depth > q.depth_limit:  # KV slots are reserved for depth_limit + 1
                return None
            if dr.draft_probs is not None:
                p = dr.draft_probs
                if tuple(p.shape) != (n, self.vocab_size) or not bool(torch.isfinite(p).all()):
                    return None
            return tree
        except Exception:  # noqa: BLE001
            return None

    # ---- the loop ----

    def step(self) -> List[RequestOutput]:
        """Run one scheduler step over the whole batch; returns the requests that progressed.

        Raises :class:`StepError` when the step fails after it was scheduled (a bug, or input
        that slipped past validation): the requests of that step finish with reason "error"
        (their KV freed) and the engine stays usable for every other request."""
        trace = StepTrace(time.perf_counter()) if self.trace_hook is not None else None
        if self._sourced:
            self._set_draft_sources()
        so = self.scheduler.step()
        self._step_open = True
        try:
            return self._run_step(so, trace)
        except BaseException as e:
            failed = self._fail_step(so)
            if not isinstance(e, Exception):  # KeyboardInterrupt: the engine stays usable
                raise
            _log.exception("engine step failed; requests %s finish with 'error'", failed)
            raise StepError(failed, e) from e

    def _fail_step(self, so) -> List[int]:
        """After a failed step: finish its requests with 'error' and close the scheduler's step."""
        failed = []
        for rid in list(so.ids):
            r = self._reqs.get(rid)
            if r is None or r.finished:
                continue
            try:
                self.scheduler.abort(rid)
            except Exception:  # noqa: BLE001 - already gone from the scheduler
                pass
            self._finish(rid, r, "error")
            failed.append(rid)
        if self._step_open:
            self._step_open = False
            self.scheduler.update(_C.StepResult())
        return failed

    def _update(self, result) -> List[RequestOutput]:
        self._step_open = False
        return self._apply(self.scheduler.update(result))

    def _run_step(self, so, trace) -> List[RequestOutput]:
        runner = self.runner
        for rid in so.preempted_ids:
            self._release_drafters(rid)  # its KV is gone: drafters start over at its prefill
        if len(so) == 0:
            return self._update(_C.StepResult())
        if so.pending_copies:
            runner.kv.copy_blocks(so.pending_copies)
            for pool in self._pools:
                pool.copy_blocks(so.pending_copies)
        groups, tables, rows = self._draft_requests(so)
        # The whole step (drafting, forward, acceptance, commit, the drafters' updates) under the
        # target's thread setting for a step of its rows: a small step's torch ops run on one
        # thread, so that none leaves torch's OpenMP workers spinning on the cores the next
        # forward's kernels use (see LlamaForCausalLM.step_threads: 10-20% of a speculative step).
        # Drafting under the most rows the drafts may add, the rest under the rows they did add.
        step_threads = getattr(runner.model, "step_threads", None) if _SERIAL_STEPS else None
        if step_threads is None:
            step_threads = _no_threads
        with step_threads(rows):
            drafts = self._draft_all(groups, trace)
        seqs, dec_idx, dec_drafts, dec_depths = self._step_seqs(so, tables, drafts)
        with step_threads(sum(len(s.token_ids) for s in seqs)):
            outs = self._verify_commit(so, trace, tables, seqs, dec_idx, dec_drafts, dec_depths)
        if trace is not None:
            trace.end = time.perf_counter()
            self.trace_hook(trace)
        return outs

    def _draft_requests(self, so):
        """Each drafter's requests of the step, the requests' block tables, and an upper bound
        on the step's rows (its scheduled tokens plus every draft's node budget)."""
        kinds, starts, budgets = so.kinds, so.start_pos, so.draft_budget
        blk_ptr, all_blocks = so.block_indptr, so.block_tables
        rows = len(so.tokens)
        groups: Dict[str, List[DraftRequest]] = {}
        tables = {}
        calibrate = (self.adaptive and self._drafted_steps >= CALIBRATION_STEPS
                     and "prefill" not in kinds)
        held = False  # a draft the calibration step holds back
        for i, rid in enumerate(so.ids):
            table = all_blocks[blk_ptr[i]:blk_ptr[i + 1]]
            tables[i] = table
            r = self._reqs[rid]
            if kinds[i] == "prefill" or r.drafter is None or r.failed:
                continue
            depth = min(budgets[i], self.gamma)
            if depth <= 0:
                continue
            if calibrate:
                held = True
                continue
            p = r.params
            nodes = max(1, int(self.drafters[r.drafter].node_budget(depth)))
            rows += nodes
            groups.setdefault(r.drafter, []).append(DraftRequest(
                rid, r.context, starts[i], table, nodes, float(p.temperature), int(p.top_k),
                float(p.top_p), float(p.min_p), r.seed, r.stats.steps, depth))
        if held:  # (a step in which nothing would have drafted is not one)
            self._drafted_steps = 0
            self.stats.calibration_steps += 1
        return groups, tables, rows

    def _draft_all(self, groups: Dict[str, List[DraftRequest]], trace
                   ) -> Dict[int, Tuple[Draft, TokenTree]]:
        drafts: Dict[int, Tuple[Draft, TokenTree]] = {}
        for name, reqs in groups.items():
            t0 = time.perf_counter()
            drafts.update(self._draft_group(self.drafters[name], reqs))
            t1 = time.perf_counter()
            dt = t1 - t0
            if trace is not None:
                trace.drafts.append((name, t0, t1, [q.request_id for q in reqs]))
            self.stats.draft_seconds += dt
            acc = self._draft_time.setdefault(name, [0.0, 0.0])
            acc[0] = 0.9 * acc[0] + dt
            acc[1] = 0.9 * acc[1] + sum(q.depth_limit for q in reqs)
        return drafts

    def _step_seqs(self, so, tables, drafts):
        """The step's forward inputs: prefill chunks, and each decoding request's draft tree (its
        root alone where nothing was drafted)."""
        kinds, starts = so.kinds, so.start_pos
        tok_ptr, all_tokens = so.token_indptr, so.tokens
        seqs: List[SeqStep] = []
        dec_idx: List[int] = []
        dec_drafts: List[Draft] = []
        dec_depths: List[int] = []
        for i, rid in enumerate(so.ids):
            toks = all_tokens[tok_ptr[i]:tok_ptr[i + 1]]
            if kinds[i] == "prefill":
                seqs.append(SeqStep(toks, starts[i], tables[i], None, "none"))
                continue
            dr, tree = drafts.get(rid) or (Draft([int(toks[0])], [-1]), self._chain(0))
            seqs.append(SeqStep(dr.tokens, starts[i], tables[i], tree, "all"))
            dec_idx.append(i)
            dec_drafts.append(dr)
            dec_depths.append(tree.max_depth)
        return seqs, dec_idx, dec_drafts, dec_depths

    def _verify_commit(self, so, trace, tables, seqs: List[SeqStep], dec_idx: List[int],
                       dec_drafts: List[Draft], dec_depths: List[int]) -> List[RequestOutput]:
        """VERIFY (one forward for the whole batch), ACCEPT, COMMIT."""
        runner = self.runner
        kinds, starts = so.kinds, so.start_pos
        tok_ptr, slot_ptr = so.token_indptr, so.slot_indptr
        all_tokens, all_slots = so.tokens, so.slots
        result = _C.StepResult()
        t0 = time.perf_counter()
        out = runner.step(seqs, return_hidden=self._need_hidden)
        t_fwd = time.perf_counter() - t0
        if trace is not None:
            trace.verify = (t0, t0 + t_fwd)
        self.stats.verify_seconds += t_fwd
        if len(dec_idx) == len(seqs):  # decode/verify-only steps: prefill runs at another rate
            self._observe_step_time(len(dec_idx), sum(len(s.token_ids) for s in seqs), t_fwd)

        # ACCEPT + COMMIT.
        if dec_idx:
            emitted, paths, n_acc = self._accept(so.ids, dec_idx, dec_drafts, out.logits)
        src_rows: List[int] = []
        dst_slots: List[int] = []
        row_ptr = out.row_indptr
        chunks: Dict[str, List[PrefillChunk]] = {}
        verified: Dict[str, List[Verified]] = {}
        hidden = out.hidden
        dec_pos = 0
        for i, rid in enumerate(so.ids):
            r = self._reqs[rid]
            base = row_ptr[i]
            if kinds[i] == "prefill":
                n = tok_ptr[i + 1] - tok_ptr[i]
                src_rows.extend(range(base, base + n))
                dst_slots.extend(all_slots[slot_ptr[i]:slot_ptr[i] + n])
                result.add_prefill(rid, n)
                if trace is not None:
                    trace.prefill[rid] = n
                if r.drafter is not None and not r.failed:
                    chunks.setdefault(r.drafter, []).append(PrefillChunk(
                        rid, all_tokens[tok_ptr[i]:tok_ptr[i + 1]], starts[i], tables[i],
                        r.context, self._hidden_for(r.drafter, hidden, slice(base, base + n))))
                continue
            j = dec_pos
            dec_pos += 1
            a = n_acc[j]
            dr = dec_drafts[j]
            path = paths[j][:a + 1]
            src_rows.extend(base + node for node in path)
            dst_slots.extend(all_slots[slot_ptr[i]:slot_ptr[i] + a + 1])
            nd = len(dr.tokens) - 1
            depth = dec_depths[j]
            if nd:
                self._nodes_per_level = 0.95 * self._nodes_per_level + 0.05 * (nd / depth)
            # The scheduler counts levels: its acceptance rate is accepted / drafted depth.
            result.add_decode(rid, emitted[j][:a + 1], depth, a)
            if trace is not None:
                trace.decisions[rid] = (nd, depth, a, a + 1)
            st = r.stats
            st.steps += 1
            if nd:
                self._count_spec(r, nd, depth, a)
            rec = self._record.get(rid)
            if rec is not None:
                rec.append(out.logits[[out.logits_indptr[i] + n for n in path]].clone())
            if r.drafter is not None and not r.failed:
                verified.setdefault(r.drafter, []).append(Verified(
                    rid, starts[i], [dr.tokens[n] for n in path], emitted[j][:a + 1], tables[i],
                    self._hidden_for(r.drafter, hidden, [base + n for n in path])))
        if src_rows:
            # row_indptr[0] == 0, so request 0's "local" rows are the global scratch rows: one
            # materialization for the whole batch instead of one per request.
            runner.commit_kv(out, 0, src_rows, dst_slots)
        for name, cs in chunks.items():
            self._notify(name, "prefill", cs)
        for name, vs in verified.items():
            self._notify(name, "observe", vs)
        self.stats.steps += 1
        if self.adaptive and self._speculate and self.stats.steps % 4 == 0:
            self._update_cost_model()
        outs = self._update(result)
        if self.switch_below > 0:
            self._maybe_switch(dec_idx, so.ids)
        return outs

    def _set_draft_sources(self) -> None:
        """Tell the scheduler which source of its drafter (``A|B``'s part, prompt lookup's match
        length) drafts each running request's next step, so it sizes the step from that source's
        own acceptance estimate."""
        sched = self.scheduler
        for rid in sched.running_queue:
            r = self._reqs.get(rid)
            if r is None or r.failed or r.drafter not in self._sourced:
                continue
            try:
                src = self.drafters[r.drafter].draft_source(r.context)
                if src is None:  # nothing will be drafted: no evidence to attribute
                    continue
                src = int(src)
                if not 0 <= src < self._sourced[r.drafter]:
                    raise ValueError(f"draft source {src} is not in [0, "
                                     f"{self._sourced[r.drafter]})")
            except Exception as e:  # noqa: BLE001 - a drafter's failure is its request's alone
                self._fail(rid, detail=f"draft_source: {type(e).__name__}: {e}")
                continue
            sched.set_draft_source(rid, min(src, _C.MAX_DRAFT_SOURCES - 1))

    def _hidden_for(self, name: str, hidden, rows):
        """Rows ``rows`` of the step's hidden states, the layers drafter ``name`` reads."""
        want = self._layers_of.get(name)
        if hidden is None or want is None:
            return None
        return select_layers(hidden[rows], self._hidden_layers, want)

    def _notify(self, name: str, what: str, items) -> None:
        d = self.drafters[name]
        try:
            getattr(d, what)(items)
        except Exception:  # noqa: BLE001 - isolate: retry one by one
            for it in items:
                try:
                    getattr(d, what)([it])
                except Exception as e:  # noqa: BLE001
                    self._fail(it.request_id, detail=f"{what}: {type(e).__name__}: {e}")

    def _count_spec(self, r: _Req, nd: int, depth: int, a: int) -> None:
        st, es = r.stats, self.stats
        st.drafts += 1
        st.draft_tokens += nd
        st.accepted_tokens += a
        es.drafts += 1
        es.draft_tokens += nd
        es.accepted_tokens += a
        for lst in (st.accepted_per_position, es.accepted_per_position):
            if len(lst) < a:
                lst.extend([0] * (a - len(lst)))
            for k in range(a):
                lst[k] += 1
        rate = a / depth
        es.acceptance_ewma = rate if es.acceptance_ewma is None else (
            (1 - self._deploy_alpha) * es.acceptance_ewma + self._deploy_alpha * rate)
        # What switch_below compares: a short window (about 9 steps) with the current drafter.
        r.ewma = rate if r.ewma < 0 else 0.8 * r.ewma + 0.2 * rate
        r.spec_steps_here += 1

    def _maybe_switch(self, dec_idx, ids) -> None:
        order = self.router.switch_order if self.router is not None else []
        for i in dec_idx:
            r = self._reqs.get(ids[i])
            if r is None or r.finished or r.failed or r.drafter is None:
                continue
            nxt = next((n for n in order if n not in r.tried), None)
            if nxt is None:
                continue
            reason = "low_acceptance"
            if r.spec_steps_here == 0:
                # Started plain on its drafter's losing record here (the scheduler's evidence
                # group): it would not draft, nor gather evidence to switch on, before its first
                # probe; another drafter it has not tried gets it now.
                snap = self.scheduler.request(ids[i])
                if (snap.state != "RUNNING_PLAIN" or snap.num_spec_steps > 0
                        or snap.num_cost_fallbacks == 0):
                    continue
                reason = "cost_model"
            elif r.spec_steps_here < 4 or r.ewma >= self.switch_below:
                continue
            self.drafters[r.drafter].release(ids[i])
            r.drafter = nxt
            r.tried.append(nxt)
            r.ewma, r.spec_steps_here = -1.0, 0
            # The scheduler's acceptance evidence was about the previous drafter: the new one
            # starts from the initial draft length (and speculates even if the old one had
            # fallen back to plain decoding).
            self.scheduler.reset_acceptance(ids[i], self._evidence_group[nxt])
            r.stats.drafter = nxt
            r.stats.drafters_used.append(nxt)
            r.stats.switches[reason] = r.stats.switches.get(reason, 0) + 1
            self.stats.switches[reason] = self.stats.switches.get(reason, 0) + 1

    def _observe_step_time(self, n_dec: int, n_tokens: int, seconds: float) -> None:
        if n_dec == 0:
            return
        self._undrafted_steps = self._undrafted_steps + 1 if n_tokens <= n_dec else 0
        self._drafted_steps = self._drafted_steps + 1 if n_tokens > n_dec else 0
        f = self._fit
        w = 0.97
        x, y = float(n_tokens), float(seconds)
        f[0] = w * f[0] + 1
        f[1] = w * f[1] + x
        f[2] = w * f[2] + y
        f[3] = w * f[3] + x * x
        f[4] = w * f[4] + x * y
        self._last_batch = n_dec

    def _update_cost_model(self) -> None:
        # Budget probe: a fit that put the memory-bound limit at or below the batch (noise can)
        # stops every draft, and with them the spread of step sizes the fit needs to correct
        # itself. After _probe_interval decode steps without a draft token (8, doubling up to
        # BUDGET_PROBE_STEPS), lift the limit until the next update: the steps in between draft
        # again and are measured.
        limit = self.scheduler.memory_bound_tokens
        if (0 < limit <= self._last_batch
                and self._undrafted_steps >= self._probe_interval):
            # Lift it to twice the batch (at least 8 more tokens), not away: unlimited, every
            # request would verify a full tree, steps of many times the batch's tokens that cost
            # far more than the plain steps they replace (8 requests x 16 nodes = 136 tokens), and
            # the fit would learn the cost of those instead of the next few tokens'.
            b = self._last_batch
            self.scheduler.set_memory_bound_tokens(max(2 * b, b + 8))
            self._undrafted_steps = 0
            self._probe_interval = min(2 * self._probe_interval, BUDGET_PROBE_STEPS)
            self.stats.budget_probes += 1
            return
        n, sx, sy, sxx, sxy = self._fit
        if n < 4:
            return
        var = sxx - sx * sx / n
        if var <= 1e-9 * max(n, 1):
            return  # no spread in step sizes yet
        slope = max((sxy - sx * sy / n) / var, 0.0)
        base = max(sy / n - slope * sx / n, 1e-6)
        b = self._last_batch
        plain = base + slope * b  # one plain step of the current batch
        verify = slope / plain * self._nodes_per_level  # per draft level
        sec, tok = 0.0, 0.0
        for s, t in self._draft_time.values():
            sec += s
            tok += t
        draft = (sec / tok) / plain if tok > 0 else 0.0
        # In a batch, one request's drafting and verification lengthen the step of all b
        # requests, while its accepted tokens are its own: b + a - 1 tokens for (1 + c * g) of a
        # plain step's time gain over plain only when a - 1 > b * c * g. So each request's draft
        # length is chosen with its costs times the batch (exact at b = 1; at b = 8 on the default
        # model this turns speculation off where it made the batch 7-23% slower).
        draft = min(max(draft * b, 0.0), 10.0)
        verify = min(max(verify * b, 0.0), 10.0)
        self.stats.draft_cost, self.stats.verify_cost = draft, verify
        self.scheduler.set_cost_model(draft, verify)
        # Batch-aware budget from the same fit: a step stays memory-bound while its tokens cost
        # less than its fixed part (base / slope tokens); draft tokens beyond that are compute,
        # which speculation cannot win back. The scheduler applies it every step to the batch it
        # is building: draft tokens only from what the batch leaves, none once it alone fills it.
        if slope > 0:
            limit = max(1, int(round(base / slope)))
            self.scheduler.set_memory_bound_tokens(limit)
            self.stats.spec_free_tokens = limit - b


    def _accept(self, ids, dec_idx, dec_drafts: List[Draft], logits):
        """One batched acceptance over every decode/speculative request of the step."""
        reqs = [self._reqs[ids[i]] for i in dec_idx]
        sizes = [len(d.tokens) for d in dec_drafts]
        indptr = [0]
        parents: List[int] = []
        flat: List[int] = []
        for d in dec_drafts:
            indptr.append(indptr[-1] + len(d.tokens))
            parents.extend(d.parents)
            flat.extend(d.tokens)
        greedy = [r.params.temperature == 0.0 for r in reqs]
        if all(greedy) and not self.debug_skip_residual:
            walked = _greedy_walk(logits, dec_drafts, indptr)
            if walked is not None:
                return walked
        if all(greedy):
            probs = apply_sampling_filters(logits, 0.0)
        else:
            sz = torch.tensor(sizes, dtype=torch.int64)

            def rows(vals, dtype):
                return torch.repeat_interleave(torch.tensor(vals, dtype=dtype), sz)

            # Greedy rows use temperature 0 (a one-hot at the argmax, lowest id on ties).
            probs = apply_sampling_filters(
                logits,
                rows([float(r.params.temperature) for r in reqs], torch.float32),
                rows([int(r.params.top_k) for r in reqs], torch.int32),
                rows([float(r.params.top_p) for r in reqs], torch.float32),
                rows([float(r.params.min_p) for r in reqs], torch.float32))
        sampled = [d.draft_probs is not None and not g for d, g in zip(dec_drafts, greedy)]
        draft_probs = None
        if any(sampled):
            draft_probs = torch.zeros((indptr[-1], self.vocab_size), dtype=torch.float32)
            for k, d in enumerate(dec_drafts):
                if sampled[k]:
                    draft_probs[indptr[k]:indptr[k + 1]] = d.draft_probs
        # Draws are keyed by sequence position: the root decides the token after the context.
        offsets = [len(r.context) for r in reqs]
        args = (probs, torch.tensor(flat, dtype=torch.int32), torch.tensor(parents, dtype=torch.int32),
                torch.tensor(indptr, dtype=torch.int64))
        kw = dict(greedy=torch.tensor(greedy, dtype=torch.bool),
                  seeds=torch.tensor([r.seed for r in reqs], dtype=torch.int64),
                  offsets=torch.tensor(offsets, dtype=torch.int64),
                  sampled_children=torch.tensor(sampled, dtype=torch.bool))
        if self.debug_skip_residual:
            res = _accept_broken(*args, draft_probs=draft_probs, **kw)
        else:
            res = accept(*args, draft_probs=draft_probs, **kw)
        return res.emitted_tokens.tolist(), res.accepted_nodes.tolist(), res.num_accepted.tolist()

    def _apply(self, updates) -> List[RequestOutput]:
        outs: List[RequestOutput] = []
        for rid, new, finished, reason in updates:
            r = self._reqs.get(rid)
            if r is None:
                continue
            r.context.extend(new)
            if finished:
                self._finish(rid, r, reason)
            outs.append(RequestOutput(rid, list(new), bool(finished), reason))
        return outs

    def generate(self, prompts: Sequence[Sequence[int]],
                 params: Union[None, SamplingParams, Mapping,
                               Sequence[Union[SamplingParams, Mapping]]] = None,
                 *, max_steps: Optional[int] = None,
                 on_step: Optional[Callable[[List[RequestOutput]], None]] = None
                 ) -> List[GenerationResult]:
        """Run the prompts to completion (one params for all, or one per prompt); results in
        prompt order. ``on_step`` receives each step's outputs (streaming)."""
        if isinstance(params, (list, tuple)):
            if len(params) != len(prompts):
                raise ValueError(f"got {len(params)} params for {len(prompts)} prompts")
            plist = [_as_params(p) for p in params]
        else:
            plist = [_as_params(params)] * len(prompts)
        ids = []
        try:
            for prompt, p in zip(prompts, plist):
                ids.append(self.add_request(prompt, p))
        except ValueError:
            for rid in ids:
                self.abort(rid)
                self._reqs.pop(rid, None)
            raise
        steps = 0
        while any(not self._reqs[rid].finished for rid in ids):
            if max_steps is not None and steps >= max_steps:
                raise RuntimeError(f"generation did not finish within {max_steps} steps")
            outs = self.step()
            if on_step is not None:
                on_step(outs)
            steps += 1
        return [self.result(rid, pop=True) for rid in ids]


def _greedy_walk(logits, drafts: List[Draft], indptr: List[int]):
    """Greedy acceptance for a batch of greedy requests straight from the logits: what
    :func:`~pyspec.sampling.accept` does with the one-hot rows of temperature 0, without building
    them (at 16 nodes x 49k tokens those rows cost about as much as the walk's whole step
    bookkeeping). Each node's token is its row's argmax (lowest id on ties); the walk moves to the
    first child (in index order) holding it and ends at a miss or a leaf, emitting the argmax.
    Returns (emitted, accepted nodes, accepted counts) per request, or None when a row's maximum
    is not finite (NaN or inf logits), which the general path then reports."""
    top, arg = logits.max(-1)  # the first maximal index on ties, as accept's argmax
    if not bool(torch.isfinite(top).all()):
        return None
    am = arg.tolist()
    emitted: List[List[int]] = []
    paths: List[List[int]] = []
    counts: List[int] = []
    for k, d in enumerate(drafts):
        base, toks, pars = indptr[k], d.tokens, d.parents
        node, path, out = 0, [0], []
        while True:
            t = am[base + node]
            out.append(t)
            nxt = -1
            for c in range(node + 1, len(toks)):
                if pars[c] == node and toks[c] == t:
                    nxt = c
                    break
            if nxt < 0:
                break
            path.append(nxt)
            node = nxt
        emitted.append(out)
        paths.append(path)
        counts.append(len(path) - 1)
    return emitted, paths, counts


def _accept_broken(target_probs, tokens, parents, tree_indptr, *, draft_probs, greedy, seeds,
                   offsets, sampled_children):
    """The acceptance op with its recovered-token residual skipped (a deliberately wrong rule,
    for the statistical tests' power check)."""
    from pyspec.sampling import AcceptResult

    b = tree_indptr.numel() - 1
    width = _C.tree_batch_max_depth(parents, tree_indptr) + 1
    nodes = torch.empty((b, width), dtype=torch.int32)
    emitted = torch.empty((b, width), dtype=torch.int32)
    n_acc = torch.empty((b,), dtype=torch.int32)
    _C.accept_trees(target_probs.contiguous(), draft_probs, tokens, parents, tree_indptr, greedy,
                    sampled_children, seeds, offsets, nodes, emitted, n_acc, 1e-3, True)
    return AcceptResult(nodes, emitted, n_acc)


def _is_int(x) -> bool:
    return isinstance(x, Integral) and not isinstance(x, bool)


def _is_real(x) -> bool:
    return isinstance(x, Real) and not isinstance(x, bool)
