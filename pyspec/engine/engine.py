"""The engine: one :meth:`Engine.step` is one scheduler step (DESIGN sections 2-3).

1. ``Scheduler.step()`` picks the batch: prefill chunks, plain decode roots and speculative roots
   with a per-request draft budget (batch-aware, per request from the Leviathan cost model, none
   in a calibration step).
2. DRAFT (:mod:`pyspec.engine.drafting`): each speculative request's drafter (chosen per request
   by the :class:`~pyspec.engine.routing.Router`) proposes a token tree within the budget.
3. VERIFY: the scheduler's pending copy-on-write block copies are applied (to the target's KV pool
   and every drafter pool), then one ``runner.step`` runs the whole batch: prefill chunks, plain
   roots and every draft tree, with tree attention.
4. ACCEPT/COMMIT (:mod:`pyspec.engine.accept`): one batched acceptance verifies every tree; the
   accepted paths and prefill chunks are materialized into the pages, drafters see what was
   committed, and ``Scheduler.update`` applies the results (stop tokens, ``max_tokens``, adaptive
   draft length, fallback to plain decoding and re-probing, freeing finished requests).

Adaptive speculation lives in the C++ scheduler (``cpp/include/pyspec/adaptive.h``): the engine
reports what it measured (each decode-only step's forward time, each drafter's time per draft
level) and the scheduler fits the step cost, picks draft lengths, runs calibration steps, falls
back and re-probes, and says when a request should switch drafter (:mod:`pyspec.engine.routing`).
"""

from __future__ import annotations

import contextlib
import copy
import logging
import random
import time
from dataclasses import dataclass, field, replace
from typing import Callable, Dict, List, Mapping, Optional, Sequence, Tuple, Union

import torch

from pyspec import _C
from pyspec.drafters.base import Draft, Drafter, PrefillChunk, Verified
from pyspec.engine.accept import accept_step
from pyspec.engine.drafting import DraftStage
from pyspec.engine.routing import RouteFeatures, Router, switch_drafters
from pyspec.engine.stats import (EngineStats, GenerationResult, RequestOutput, RequestStats,
                                 StepError, StepTrace, count_speculative_step)
from pyspec.models.loader import return_freed_memory
from pyspec.params import SamplingParams, as_params, is_int, is_real, validate_params
from pyspec.predictor import corpus_of, prompt_features
from pyspec.profiling import StepProfiler, profile_range
from pyspec.runner import ModelRunner, SeqStep

__all__ = ["Engine"]

# Steps of at least this many tokens (prefill chunks) are followed by return_freed_memory().
TRIM_STEP_TOKENS = 256
# Of the requests the acceptance predictor would decode plainly, every EXPLORE_EVERY-th
# speculates anyway; a finished request teaches the predictor after this many speculative steps.
EXPLORE_EVERY = 8
PREDICTOR_MIN_DRAFTS = 4

_log = logging.getLogger("pyspec.engine")


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
    tried: List[str] = field(default_factory=list)
    features: Optional[List[float]] = None  # its prompt's predictor features (when consulted)

    @property
    def generated(self) -> List[int]:
        return self.context[self.num_prompt:]


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
            ``warmup_steps``, ``probe_interval``, ``record_transitions``, ``adapt_draft_length``:
            False holds every request at ``initial_draft_tokens`` levels, for measurements of one
            draft shape); ``ewma_alpha`` also
            weighs the deployment-wide ``stats.acceptance_ewma`` (default there: 2 / 65).

    Attributes for measurements (per engine): ``serial_host_steps`` (default True: a small
    step's host work runs torch on one thread, see ``LlamaForCausalLM.step_threads``),
    ``greedy_from_logits`` (default True: greedy batches walk the logits, see
    :mod:`pyspec.engine.accept`).
    """

    def __init__(self, runner: ModelRunner, tokenizer=None, *, max_num_seqs: int = 64,
                 max_num_batched_tokens: int = 2048,
                 drafter: Union[None, str, Drafter] = "ngram",
                 drafters: Optional[Mapping[str, Union[str, Drafter]]] = None,
                 router: Optional[Router] = None, gamma: Optional[int] = None,
                 adaptive: bool = True, switch_below: float = 0.0,
                 enable_prefix_cache: bool = True,
                 long_prompt: Optional[Tuple[int, Optional[str]]] = None,
                 predictor=None, predictor_min_acceptance: float = 1.2,
                 **scheduler_kwargs):
        if gamma is not None and (not is_int(gamma) or not 0 <= gamma <= 255):
            raise ValueError(f"gamma must be an int in [0, 255]; got {gamma!r}")
        if not is_real(switch_below) or not 0.0 <= switch_below <= 1.0:
            raise ValueError(f"switch_below must be in [0, 1]; got {switch_below!r}")
        self.runner = runner
        self.tokenizer = tokenizer
        self.vocab_size = int(runner.model.cfg.vocab_size)
        self.drafting = DraftStage(runner, drafter, drafters, self._fail)
        self.drafters = self.drafting.drafters
        self.default_drafter = self.drafting.default
        self.router = router
        # The long-prompt channel: (threshold, drafter name): prompts of more than ``threshold``
        # tokens are drafted by that drafter (None: plainly), before the router sees them.
        self.long_prompt = None
        if long_prompt is not None:
            n, lname = long_prompt
            if not is_int(n) or n < 1:
                raise ValueError(f"the long-prompt threshold must be an int >= 1 (tokens); "
                                 f"got {n!r}")
            if lname is not None and lname not in self.drafters:
                raise ValueError(f"the long-prompt channel names drafter {lname!r}; the engine "
                                 f"has {sorted(self.drafters)}")
            self.long_prompt = (int(n), lname)
        # The acceptance predictor (pyspec.predictor.AcceptancePredictor): a short-channel
        # request of the default drafter predicted below ``predictor_min_acceptance`` tokens
        # per speculative step decodes plainly (every EXPLORE_EVERY-th such request speculates
        # anyway, so the predictor keeps learning where it says no); finished speculative
        # requests update it.
        if predictor is not None and not hasattr(predictor, "predict_features"):
            raise ValueError(f"predictor must be a pyspec.predictor.AcceptancePredictor; got "
                             f"{type(predictor).__name__}")
        if not is_real(predictor_min_acceptance) or not 1.0 <= predictor_min_acceptance <= 64:
            raise ValueError(f"predictor_min_acceptance must be a number in [1, 64] (tokens per "
                             f"speculative step); got {predictor_min_acceptance!r}")
        self.predictor = predictor
        # As loaded, for reset_policy (online updates since then are dropped there).
        self._predictor_start = copy.deepcopy(predictor)
        self.predictor_min_acceptance = float(predictor_min_acceptance)
        # The predictor judges the requests of the drafter it was fitted for (the default one
        # at start), with that drafter's corpus in its features.
        self._predicted_drafter = self.default_drafter
        self._corpus = corpus_of(self.drafters.get(self.default_drafter or ""))
        self._predicted_plain = 0
        if router is not None:
            for name in router.names():
                if name is not None and name not in self.drafters:
                    raise ValueError(f"the router names drafter {name!r}; the engine has "
                                     f"{sorted(self.drafters)}")
        # The scheduler's draft length counts tree *levels* (the KV it reserves is for the accepted
        # path, at most depth + 1 tokens); each drafter turns a depth into its node budget.
        self.gamma = int(gamma) if gamma is not None else self.drafting.max_depth()
        self._speculate = bool(self.drafters) and self.gamma > 0
        self.switch_below = float(switch_below)
        self.adaptive = bool(adaptive)
        kw = dict(scheduler_kwargs)
        if self._speculate:
            kw.setdefault("max_draft_tokens", self.gamma)
            kw.setdefault("initial_draft_tokens", min(4, kw["max_draft_tokens"]))
            if self.adaptive:
                kw.setdefault("cost_model", True)
            # Measured costs, calibration steps (scheduler's adaptive.h; measure_costs=False keeps
            # the costs set_cost_model gives).
            kw.setdefault("measure_costs", self.adaptive)
        if "ewma_alpha" in kw:
            kw.setdefault("deployment_ewma_alpha", kw["ewma_alpha"])
        try:
            self.scheduler = _C.Scheduler(runner.kv.num_blocks, runner.block_size,
                                          enable_prefix_cache=enable_prefix_cache,
                                          max_num_batched_tokens=max_num_batched_tokens,
                                          max_num_seqs=max_num_seqs,
                                          **kw)
        except TypeError as e:  # an unknown keyword
            raise ValueError(str(e)) from None
        self.max_num_seqs = int(max_num_seqs)
        self._reqs: Dict[int, _Req] = {}
        self._step_open = False  # between the scheduler's step() and update()
        self._next_id = 0
        self._stats = EngineStats()
        self.serial_host_steps = True
        self.greedy_from_logits = True
        self.debug_skip_residual = False  # tests only: a deliberately broken acceptance rule
        # Called with a StepTrace after every step that ran a forward (None: no tracing cost).
        self.trace_hook: Optional[Callable[[StepTrace], None]] = None
        self._profiler: Optional[StepProfiler] = None  # an armed profile window (profile())
        # Requests whose served distributions are kept (quality gate): id -> list of logits rows,
        # row j = the target logits the request's emitted token j was drawn from.
        self._record: Dict[int, List[torch.Tensor]] = {}

    def channel_of(self, prompt_tokens: int) -> str:
        """The prompt channel of a prompt this many tokens long: ``"long"`` past the long-prompt
        threshold, ``"short"`` otherwise (what a request's ``stats.channel`` will say)."""
        return "long" if self.long_prompt is not None and prompt_tokens > self.long_prompt[0] \
            else "short"

    def set_default_drafter(self, name: Optional[str]) -> None:
        """Requests added from now on are drafted by ``name`` (one of :attr:`drafters`; None:
        decoded plainly) where they would have been by the default drafter (a rollback to a
        drafter's previous version kept loaded beside it, and back); requests in flight keep
        theirs. The acceptance predictor keeps judging only the requests of the drafter it was
        fitted for (the default one at start). Call between steps."""
        if name is not None and name not in self.drafters:
            raise ValueError(f"no drafter named {name!r}; the engine has {sorted(self.drafters)}")
        self.default_drafter = name

    def reset_policy(self) -> None:
        """The speculation policy back to where it started (a rollback): the scheduler's
        learned costs, batch-aware limits and deployment-wide acceptance evidence
        (``Scheduler.reset_policy``), and the acceptance predictor as it was loaded (its online
        updates dropped). Requests in flight keep their own estimates. Call between steps."""
        self.scheduler.reset_policy()
        self.predictor = copy.deepcopy(self._predictor_start)
        self._predicted_plain = 0

    def profile(self, out_dir: str, steps: int = 20) -> str:
        """Record a kernel-level profile of this engine's next ``steps`` steps that run a forward
        (:mod:`pyspec.profiling`): a Chrome trace written to ``out_dir`` when the last of them
        ends; returns its path. Steps traced meanwhile (``trace_hook``) carry the file and their
        step number in ``StepTrace.profile``. ValueError for bad arguments; RuntimeError while a
        window of this engine is still recording. :meth:`profile_status` says how it went."""
        cur = self._profiler
        if cur is not None and not cur.done:
            raise RuntimeError(f"this engine is already recording a profile ({cur.path}: "
                               f"{cur.recorded} of {cur.steps} steps)")
        self._profiler = StepProfiler(out_dir, steps,
                                      cuda=self.runner.model.device.type == "cuda")
        return self._profiler.path

    def stop_profile(self) -> Optional[dict]:
        """End the profile window now, writing what it recorded (call it between steps, from the
        thread that runs them); returns :meth:`profile_status`."""
        if self._profiler is not None:
            self._profiler.stop()
        return self.profile_status()

    def profile_status(self) -> Optional[dict]:
        """The last profile window's state (``path``, ``steps``, ``recorded``, ``done``,
        ``error``, ``summary``: the top kernels' file once written); None before any."""
        return None if self._profiler is None else self._profiler.status()

    @property
    def stats(self) -> EngineStats:
        """Deployment-wide counters, with the scheduler's adaptive speculation measurements."""
        es = self._stats
        c = self.scheduler.cost_model_stats
        es.draft_cost, es.verify_cost = c["draft_cost"], c["verify_cost"]
        es.spec_free_tokens = c["spec_free_tokens"]
        es.budget_probes, es.calibration_steps = c["budget_probes"], c["calibration_steps"]
        es.acceptance_ewma = self.scheduler.deployment_acceptance_ewma
        return es

    # ---- requests ----

    def add_request(self, prompt_ids: Sequence[int],
                    params: Union[None, SamplingParams, Mapping] = None) -> int:
        """Queue a request; returns its id. ValueError for bad input."""
        p = as_params(params)
        if p.n != 1:
            raise ValueError(f"an engine request is one sample: n must be 1; got n={p.n} "
                             f"(LLM.generate and the server add n requests for n samples)")
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
        limit = self.runner.model.cfg.context_limit
        if len(prompt) + int(p.max_tokens) > limit:
            raise ValueError(f"prompt ({len(prompt)} tokens) + max_tokens ({p.max_tokens}) exceeds "
                             f"the model's context of {limit} tokens")
        cap = self.runner.kv.num_blocks * self.runner.block_size
        if len(prompt) + int(p.max_tokens) + 1 > cap:
            raise ValueError(f"prompt ({len(prompt)} tokens) + max_tokens ({p.max_tokens}) does not "
                             f"fit in the KV pool ({cap} token slots)")
        stop = [int(t) for t in p.stop_token_ids]
        name = None
        channel = self.channel_of(len(prompt))
        long = channel == "long"
        if self._speculate and p.speculative:
            name = self.default_drafter
            if long:
                name = self.long_prompt[1]
            elif self.router is not None:
                name = self.router.route(RouteFeatures(
                    len(prompt), self.scheduler.num_running + self.scheduler.num_waiting))
        feats, predicted, plain = None, None, False
        if self.predictor is not None and name is not None and name == self._predicted_drafter \
                and not long:
            feats = prompt_features(prompt, self._corpus)
            predicted = self.predictor.predict_features(feats)
            if predicted < self.predictor_min_acceptance:
                self._predicted_plain += 1
                if self._predicted_plain % EXPLORE_EVERY:
                    name, plain = None, True
        rid = self._next_id
        self.scheduler.add_request(rid, prompt, max_tokens=int(p.max_tokens), stop_token_ids=stop,
                                   speculative=name is not None,
                                   evidence_group=self.drafting.evidence_group.get(name, 0))
        self._next_id += 1
        seed = int(p.seed) if p.seed is not None else random.getrandbits(63)
        r = _Req(p, seed, prompt, len(prompt), name)
        r.stats.drafter = name
        r.stats.channel = channel
        r.stats.predicted_acceptance, r.stats.predictor_plain = predicted, plain
        r.features = feats
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
        return GenerationResult(request_id, list(r.generated), r.finish_reason, r.stats.copy())

    def generate(self, prompts: Sequence[Sequence[int]],
                 params: Union[None, SamplingParams, Mapping,
                               Sequence[Union[SamplingParams, Mapping]]] = None,
                 *, max_steps: Optional[int] = None,
                 on_step: Optional[Callable[[List[RequestOutput]], None]] = None
                 ) -> List[GenerationResult]:
        """Run the prompts to completion (one params for all, or one per prompt); results in
        prompt order. ``on_step`` receives each step's outputs (streaming). When anything fails
        (``max_steps`` reached, ``on_step`` or a step raising), the call's requests are aborted
        and forgotten before the exception goes on."""
        if max_steps is not None and (not is_int(max_steps) or max_steps < 1):
            raise ValueError(f"max_steps must be None or an int >= 1; got {max_steps!r}")
        if on_step is not None and not callable(on_step):
            raise ValueError(f"on_step must be None or a callable taking each step's outputs; "
                             f"got {type(on_step).__name__}")
        if isinstance(params, (list, tuple)):
            if len(params) != len(prompts):
                raise ValueError(f"got {len(params)} params for {len(prompts)} prompts")
            plist = [as_params(p) for p in params]
        else:
            plist = [as_params(params)] * len(prompts)
        ids = []
        try:
            for prompt, p in zip(prompts, plist):
                ids.append(self.add_request(prompt, p))
            steps = 0
            while any(not self._reqs[rid].finished for rid in ids):
                if max_steps is not None and steps >= max_steps:
                    raise RuntimeError(f"generation did not finish within {max_steps} steps")
                outs = self.step()
                if on_step is not None:
                    on_step(outs)
                steps += 1
        except BaseException:
            for rid in ids:
                try:
                    self.abort(rid)
                except Exception:  # noqa: BLE001 - cleanup; the original error goes on
                    pass
                self._reqs.pop(rid, None)
            raise
        return [self.result(rid, pop=True) for rid in ids]

    def _finish(self, rid: int, r: _Req, reason: Optional[str]) -> None:
        if reason in ("abort", "error"):
            self._record.pop(rid, None)
        r.finished = True
        r.finish_reason = reason
        if reason not in ("abort", "error"):
            self.drafting.learn(rid, r.context, r.params.learn_partition)
            if r.features is not None and r.stats.drafts >= PREDICTOR_MIN_DRAFTS:
                self.predictor.update(r.features, r.stats.acceptance_length)
        self.drafting.release(rid)
        if self.scheduler.has_request(rid):
            snap = self.scheduler.request(rid)
            st = r.stats
            for key, n in (("low_acceptance", snap.num_fallbacks),
                           ("cost_model", snap.num_cost_fallbacks)):
                if n:
                    st.fallbacks[key] = int(n)
            st.probes = int(snap.num_probes)
            st.token_acceptance = snap.token_acceptance
            st.cached_tokens = int(snap.num_cached_tokens)
            st.preemptions = int(snap.num_preemptions)
            self.scheduler.release(rid)

    def _fail(self, rid: int, detail: str = "", reason: str = "drafter_error") -> None:
        """Request ``rid``'s drafter failed: it decodes plainly from here."""
        r = self._reqs.get(rid)
        if r is None or r.failed:
            return
        r.failed = True
        _log.warning("request %d: drafter %r failed (%s); the request decodes plainly from here",
                     rid, r.drafter, detail or reason)
        r.stats.fallbacks[reason] = r.stats.fallbacks.get(reason, 0) + 1
        self._stats.fallbacks[reason] = self._stats.fallbacks.get(reason, 0) + 1
        if self.scheduler.has_request(rid):
            self.scheduler.mark_drafter_failed(rid)
        self.drafting.release(rid)

    # ---- the loop ----

    def step(self) -> List[RequestOutput]:
        """Run one scheduler step over the whole batch; returns the requests that progressed.

        Raises :class:`StepError` when the step fails after it was scheduled (a bug, or input
        that slipped past validation): the requests of that step finish with reason "error"
        (their KV freed) and the engine stays usable for every other request."""
        trace = StepTrace(time.perf_counter()) if self.trace_hook is not None else None
        if self.drafting.sourced:
            self.drafting.set_draft_sources(self.scheduler, self._reqs)
        so = self.scheduler.step()
        self._step_open = True
        prof = self._profiler
        recording = prof is not None and not prof.done and len(so)
        try:
            with prof.step(so.ids) if recording else contextlib.nullcontext() as k:
                if trace is not None and k is not None:
                    trace.profile = (prof.path, k)
                outs = self._run_step(so, trace)
        except BaseException as e:
            failed = self._fail_step(so)
            if not isinstance(e, Exception):  # KeyboardInterrupt: the engine stays usable
                raise
            _log.exception("engine step failed; requests %s finish with 'error'", failed)
            raise StepError(failed, e) from e
        if so.token_indptr[-1] >= TRIM_STEP_TOKENS:
            # A long prefill chunk's temporaries (activations, matrices rebuilt from their codes)
            # went back to the heap, which keeps them resident: hand the pages back (a
            # millisecond against the chunk's hundreds).
            return_freed_memory()
        return outs

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
        outs: List[RequestOutput] = []
        for rid, new, finished, reason in self.scheduler.update(result):
            r = self._reqs.get(rid)
            if r is None:
                continue
            r.context.extend(new)
            if finished:
                self._finish(rid, r, reason)
            outs.append(RequestOutput(rid, list(new), bool(finished), reason))
        return outs

    def _run_step(self, so, trace) -> List[RequestOutput]:
        runner = self.runner
        for rid in so.preempted_ids:
            self.drafting.release(rid)  # its KV is gone: drafters start over at its prefill
        if len(so) == 0:
            return self._update(_C.StepResult())
        if so.pending_copies:
            runner.kv.copy_blocks(so.pending_copies)
            for pool in self.drafting.pools:
                pool.copy_blocks(so.pending_copies)
        groups, tables, rows = self.drafting.requests(so, self._reqs, self.gamma)
        # The whole step (drafting, forward, acceptance, commit, the drafters' updates) under the
        # target's thread setting for a step of its rows: a small step's torch ops run on one
        # thread, so that none leaves torch's OpenMP workers spinning on the cores the next
        # forward's kernels use (see LlamaForCausalLM.step_threads). Drafting under the most rows
        # the drafts may add, the rest under the rows they did add.
        step_threads = getattr(runner.model, "step_threads", None) if self.serial_host_steps \
            else None
        if step_threads is None:
            def step_threads(rows):
                return contextlib.nullcontext()
        with step_threads(rows), profile_range("pyspec.draft"):
            drafts = self.drafting.draft(groups, trace, self.scheduler, self._stats)
        seqs, dec_idx, dec_drafts, dec_depths = self._step_seqs(so, tables, drafts)
        with step_threads(sum(len(s.token_ids) for s in seqs)):
            outs = self._verify_commit(so, trace, tables, seqs, dec_idx, dec_drafts, dec_depths)
        if trace is not None:
            trace.end = time.perf_counter()
            self.trace_hook(trace)
        return outs

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
            dr, tree = drafts.get(rid) or (Draft([int(toks[0])], [-1]), self.drafting.chain(0))
            seqs.append(SeqStep(dr.tokens, starts[i], tables[i], tree, "all"))
            dec_idx.append(i)
            dec_drafts.append(dr)
            dec_depths.append(tree.max_depth)
        return seqs, dec_idx, dec_drafts, dec_depths

    def _verify_commit(self, so, trace, tables, seqs: List[SeqStep], dec_idx: List[int],
                       dec_drafts: List[Draft], dec_depths: List[int]) -> List[RequestOutput]:
        """VERIFY (one forward for the whole batch), then ACCEPT and COMMIT."""
        result = _C.StepResult()
        t0 = time.perf_counter()
        with profile_range("pyspec.verify"):
            out = self.runner.step(seqs, return_hidden=self.drafting.need_hidden,
                                   logits_to_host=False)
        t_fwd = time.perf_counter() - t0
        if trace is not None:
            trace.verify = (t0, t0 + t_fwd)
        self._stats.verify_seconds += t_fwd
        if len(dec_idx) == len(seqs):  # decode/verify-only steps: prefill runs at another rate
            self.scheduler.observe_step_time(len(dec_idx), sum(len(s.token_ids) for s in seqs),
                                             t_fwd)
        with profile_range("pyspec.accept"):
            return self._accept_commit(so, trace, tables, dec_idx, dec_drafts, dec_depths, out,
                                       result)

    def _accept_commit(self, so, trace, tables, dec_idx, dec_drafts, dec_depths, out,
                       result) -> List[RequestOutput]:
        """ACCEPT (one batched acceptance of every tree) and COMMIT (the accepted rows' K/V into
        the pages, the drafters told, the scheduler updated)."""
        runner, drafting = self.runner, self.drafting
        kinds, starts = so.kinds, so.start_pos
        tok_ptr, slot_ptr = so.token_indptr, so.slot_indptr
        all_tokens, all_slots = so.tokens, so.slots
        if dec_idx:
            emitted, paths, n_acc = accept_step(
                [self._reqs[so.ids[i]] for i in dec_idx], dec_drafts, out.logits,
                self.vocab_size, greedy_from_logits=self.greedy_from_logits,
                debug_skip_residual=self.debug_skip_residual,
                kernels=getattr(runner.model, "kernels", None))
        src_rows: List[int] = []
        dst_slots: List[int] = []
        row_ptr = out.row_indptr
        chunks: Dict[str, List[PrefillChunk]] = {}
        verified: Dict[str, List[Verified]] = {}
        hidden = out.hidden
        top = None  # every logits row's argmax, for drafters that learn from predictions
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
                        r.context, drafting.hidden_for(r.drafter, hidden, slice(base, base + n))))
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
            # The scheduler counts levels: its acceptance rate is accepted / drafted depth; the
            # tree's nodes feed the cost model's nodes per level.
            result.add_decode(rid, emitted[j][:a + 1], depth, a, nd)
            if trace is not None:
                trace.decisions[rid] = (nd, depth, a, a + 1)
            r.stats.steps += 1
            if nd:
                count_speculative_step(r.stats, nd, a)
                count_speculative_step(self._stats, nd, a)
            rec = self._record.get(rid)
            if rec is not None:
                rec.append(out.logits[[out.logits_indptr[i] + n for n in path]].to(
                    "cpu", copy=True))
            if r.drafter is not None and not r.failed:
                v = Verified(
                    rid, starts[i], [dr.tokens[n] for n in path], emitted[j][:a + 1], tables[i],
                    drafting.hidden_for(r.drafter, hidden, [base + n for n in path]))
                if nd and r.drafter in drafting.wants_predictions:
                    lo = out.logits_indptr[i]
                    v.tree = dr
                    if top is None:  # (one pass and one copy per step, also from a GPU)
                        top = out.logits.argmax(-1).tolist()
                    v.predicted = top[lo:lo + nd + 1]
                verified.setdefault(r.drafter, []).append(v)
        if src_rows:
            # row_indptr[0] == 0, so request 0's "local" rows are the global scratch rows: one
            # materialization for the whole batch instead of one per request.
            runner.commit_kv(out, 0, src_rows, dst_slots)
        for name, cs in chunks.items():
            drafting.notify(name, "prefill", cs)
        for name, vs in verified.items():
            drafting.notify(name, "observe", vs)
        self._stats.steps += 1
        outs = self._update(result)
        if self.switch_below > 0:
            switch_drafters(self, [so.ids[i] for i in dec_idx])
        return outs
