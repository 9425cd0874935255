"""The batched engine loop: the C++ continuous-batching scheduler driving the model runner.

One :meth:`Engine.step` is one scheduler step (DESIGN sections 2-3):

1. ``Scheduler.step()`` picks the batch: prefill chunks, plain decode roots and speculative roots
   with a per-request draft budget.
2. Each decode/speculative request drafts a prompt-lookup chain of at most its budget (and
   ``gamma``) tokens; every request becomes one :class:`~pyspec.runner.SeqStep`.
3. The scheduler's pending copy-on-write block copies are applied to the KV pool, then one
   ``runner.step`` runs the whole batch.
4. One batched :func:`~pyspec.sampling.accept` call verifies every tree of the step (per-row
   sampling parameters through :func:`~pyspec.sampling.apply_sampling_filters`, per-request greedy
   flag, seed and offset = the request's decode step, so a request's randomness never depends on the
   rest of the batch).
5. The accepted path rows (root + accepted drafts) and the prefill chunk rows are materialized into
   the slots the scheduler handed out, and ``Scheduler.update`` applies the results (stop tokens,
   ``max_tokens``, adaptive draft length, freeing finished requests).

:meth:`Engine.generate` loops :meth:`Engine.step` until every request it added has finished.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field, fields
from numbers import Integral, Real
from typing import Dict, List, Mapping, Optional, Sequence, Union

import torch

from pyspec import TokenTree, _C
from pyspec.decode import prompt_lookup_drafter
from pyspec.runner import ModelRunner, SeqStep
from pyspec.sampling import accept, apply_sampling_filters

__all__ = ["Engine", "SamplingParams", "RequestOutput", "GenerationResult", "RequestStats"]


@dataclass
class SamplingParams:
    """Per-request generation parameters. ``temperature == 0`` is greedy; ``seed=None`` draws a
    random seed. ``speculative=False`` decodes the request plainly (one token per step)."""

    max_tokens: int = 16
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: Optional[int] = None
    stop_token_ids: Sequence[int] = ()
    speculative: bool = True


_PARAM_NAMES = {f.name for f in fields(SamplingParams)}


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
    draft_tokens: int = 0  # draft tokens verified
    accepted_tokens: int = 0  # draft tokens accepted
    steps: int = 0  # decode steps (target forwards that emitted tokens)
    cached_tokens: int = 0  # prompt tokens served by the prefix cache (known once finished)
    preemptions: int = 0  # times the request's KV was released and recomputed (once finished)

    @property
    def acceptance_length(self) -> float:
        """1 + accepted / drafts (the mean tokens per speculative step, counting the bonus or
        recovered token); 1.0 when nothing was drafted."""
        return 1.0 + self.accepted_tokens / self.drafts if self.drafts else 1.0


@dataclass
class GenerationResult:
    request_id: int
    token_ids: List[int]
    finish_reason: Optional[str]
    stats: RequestStats = field(default_factory=RequestStats)


@dataclass
class _Req:
    params: SamplingParams
    seed: int
    context: List[int]  # prompt + generated tokens (the drafter's input)
    num_prompt: int
    stats: RequestStats = field(default_factory=RequestStats)
    finished: bool = False
    finish_reason: Optional[str] = None

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
            raise ValueError(f"unknown sampling parameters: {sorted(unknown)}")
        return SamplingParams(**params)
    raise ValueError(f"params must be a SamplingParams, a dict or None; got {type(params).__name__}")


class Engine:
    """Continuous-batching speculative decoding over a :class:`ModelRunner`.

    Args:
        runner: the model runner; the engine's scheduler manages its whole KV pool.
        tokenizer: optional, kept for callers (``engine.tokenizer``); the engine works on ids.
        max_num_seqs, max_num_batched_tokens: scheduler batch limits.
        drafter: ``"ngram"`` (prompt lookup) or ``"none"`` (plain decoding for every request).
        gamma: longest draft chain per step (the scheduler's ``max_draft_tokens`` unless given).
        enable_prefix_cache: share full prompt blocks between requests.
        **scheduler_kwargs: further :class:`pyspec._C.Scheduler` options (``max_prefill_chunk``,
            ``max_draft_tokens``, ``initial_draft_tokens``, ``spec_token_budget``,
            ``spec_disable_batch_size``, ``ewma_alpha``, ``min_acceptance_rate``,
            ``warmup_steps``, ``probe_interval``, ``record_transitions``).
    """

    def __init__(self, runner: ModelRunner, tokenizer=None, *, max_num_seqs: int = 64,
                 max_num_batched_tokens: int = 2048, drafter: str = "ngram", gamma: int = 5,
                 enable_prefix_cache: bool = True, **scheduler_kwargs):
        if drafter not in ("ngram", "none"):
            raise ValueError(f"drafter must be 'ngram' or 'none'; got {drafter!r}")
        if not _is_int(gamma) or not 0 <= gamma <= 255:
            raise ValueError(f"gamma must be an int in [0, 255]; got {gamma!r}")
        self.runner = runner
        self.tokenizer = tokenizer
        self.vocab_size = int(runner.model.cfg.vocab_size)
        self.gamma = int(gamma)
        self._speculate = drafter == "ngram" and self.gamma > 0
        self._draft = prompt_lookup_drafter() if self._speculate else None
        kw = dict(scheduler_kwargs)
        if self._speculate:
            kw.setdefault("max_draft_tokens", self.gamma)
            kw.setdefault("initial_draft_tokens", min(4, kw["max_draft_tokens"]))
        try:
            self.scheduler = _C.Scheduler(runner.kv.num_blocks, runner.block_size,
                                          enable_prefix_cache=enable_prefix_cache,
                                          max_num_batched_tokens=max_num_batched_tokens,
                                          max_num_seqs=max_num_seqs, **kw)
        except TypeError as e:  # an unknown keyword
            raise ValueError(str(e)) from None
        self._reqs: Dict[int, _Req] = {}
        self._next_id = 0
        self._chains: Dict[int, TokenTree] = {}

    # ---- requests ----

    def add_request(self, prompt_ids: Sequence[int],
                    params: Union[None, SamplingParams, Mapping] = None) -> int:
        """Queue a request; returns its id. ValueError for bad input."""
        p = _as_params(params)
        prompt = [int(t) for t in prompt_ids]
        if not prompt:
            raise ValueError("the prompt must hold at least one token")
        v = self.vocab_size
        bad = [t for t in prompt if not 0 <= t < v]
        if bad:
            raise ValueError(f"prompt token ids must be in [0, {v}); got {bad[:5]}")
        if not _is_int(p.max_tokens) or p.max_tokens < 1:
            raise ValueError(f"max_tokens must be an int >= 1; got {p.max_tokens!r}")
        if not _is_real(p.temperature) or not p.temperature >= 0.0:
            raise ValueError(f"temperature must be >= 0; got {p.temperature!r}")
        if not _is_int(p.top_k) or p.top_k < 0:
            raise ValueError(f"top_k must be an int >= 0 (0 = off); got {p.top_k!r}")
        if not _is_real(p.top_p) or not 0.0 < p.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1]; got {p.top_p!r}")
        if not _is_real(p.min_p) or not 0.0 <= p.min_p <= 1.0:
            raise ValueError(f"min_p must be in [0, 1]; got {p.min_p!r}")
        if p.seed is not None and (not _is_int(p.seed) or not -(1 << 63) <= p.seed < (1 << 63)):
            raise ValueError(f"seed must be None or a 64-bit signed int; got {p.seed!r}")
        stop = [int(t) for t in p.stop_token_ids]
        if any(not 0 <= t < v for t in stop):
            raise ValueError(f"stop_token_ids must be in [0, {v}); got {stop}")
        rid = self._next_id
        self.scheduler.add_request(rid, prompt, max_tokens=int(p.max_tokens), stop_token_ids=stop,
                                   speculative=bool(p.speculative) and self._speculate)
        self._next_id += 1
        seed = int(p.seed) if p.seed is not None else random.getrandbits(63)
        self._reqs[rid] = _Req(p, seed, prompt, len(prompt))
        return rid

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
        return GenerationResult(request_id, list(r.generated), r.finish_reason,
                                RequestStats(**vars(r.stats)))

    def _finish(self, rid: int, r: _Req, reason: Optional[str]) -> None:
        r.finished = True
        r.finish_reason = reason
        if self.scheduler.has_request(rid):
            snap = self.scheduler.request(rid)
            r.stats.cached_tokens = int(snap.num_cached_tokens)
            r.stats.preemptions = int(snap.num_preemptions)
            self.scheduler.release(rid)

    def _chain(self, n: int) -> TokenTree:
        t = self._chains.get(n)
        if t is None:
            t = self._chains[n] = TokenTree.chain(n)
        return t

    # ---- the loop ----

    def step(self) -> List[RequestOutput]:
        """Run one scheduler step over the whole batch; returns the requests that progressed."""
        sched, runner = self.scheduler, self.runner
        so = sched.step()
        result = _C.StepResult()
        if len(so) == 0:
            return self._apply(sched.update(result))
        kinds, starts, budgets = so.kinds, so.start_pos, so.draft_budget
        tok_ptr, blk_ptr, slot_ptr = so.token_indptr, so.block_indptr, so.slot_indptr
        all_tokens, all_blocks, all_slots = so.tokens, so.block_tables, so.slots
        seqs: List[SeqStep] = []
        # Decode/speculative entries: (entry index, request, node tokens) in batch order.
        dec_idx: List[int] = []
        dec_nodes: List[List[int]] = []
        for i, rid in enumerate(so.ids):
            toks = all_tokens[tok_ptr[i]:tok_ptr[i + 1]]
            table = all_blocks[blk_ptr[i]:blk_ptr[i + 1]]
            if kinds[i] == "prefill":
                seqs.append(SeqStep(toks, starts[i], table, None, "none"))
                continue
            budget = min(budgets[i], self.gamma)
            draft = self._draft(self._reqs[rid].context, budget) if budget > 0 else []
            nodes = toks + draft
            seqs.append(SeqStep(nodes, starts[i], table, self._chain(len(draft)), "all"))
            dec_idx.append(i)
            dec_nodes.append(nodes)
        if so.pending_copies:
            runner.kv.copy_blocks(so.pending_copies)
        out = runner.step(seqs)

        # Rows to materialize: global scratch rows -> flat slots, all requests at once.
        src_rows: List[int] = []
        dst_slots: List[int] = []
        row_ptr = out.row_indptr
        if dec_idx:
            emitted, paths, n_acc = self._accept(so.ids, dec_idx, dec_nodes, out.logits)
        dec_pos = 0
        for i, rid in enumerate(so.ids):
            if kinds[i] == "prefill":
                n = tok_ptr[i + 1] - tok_ptr[i]
                src_rows.extend(range(row_ptr[i], row_ptr[i] + n))
                dst_slots.extend(all_slots[slot_ptr[i]:slot_ptr[i] + n])
                result.add_prefill(rid, n)
                continue
            j = dec_pos
            dec_pos += 1
            a = n_acc[j]
            base = row_ptr[i]
            src_rows.extend(base + node for node in paths[j][:a + 1])
            dst_slots.extend(all_slots[slot_ptr[i]:slot_ptr[i] + a + 1])
            nd = len(dec_nodes[j]) - 1
            result.add_decode(rid, emitted[j][:a + 1], nd, a)
            st = self._reqs[rid].stats
            st.steps += 1
            if nd:
                st.drafts += 1
                st.draft_tokens += nd
                st.accepted_tokens += a
        if src_rows:
            # row_indptr[0] == 0, so request 0's "local" rows are the global scratch rows: one
            # materialization for the whole batch instead of one per request.
            runner.commit_kv(out, 0, src_rows, dst_slots)
        return self._apply(sched.update(result))

    def _accept(self, ids, dec_idx, dec_nodes, logits):
        """One batched acceptance over every decode/speculative request of the step."""
        reqs = [self._reqs[ids[i]] for i in dec_idx]
        sizes = [len(n) for n in dec_nodes]
        indptr = [0]
        parents: List[int] = []
        flat: List[int] = []
        for nodes in dec_nodes:
            indptr.append(indptr[-1] + len(nodes))
            parents.extend(self._chain(len(nodes) - 1).parents)
            flat.extend(nodes)
        greedy = [r.params.temperature == 0.0 for r in reqs]
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
        # The request's decode step (= the scheduler's num_decode_steps, counted here without
        # copying the request's state out of the scheduler).
        offsets = [r.stats.steps for r in reqs]
        res = accept(probs, torch.tensor(flat, dtype=torch.int32),
                     torch.tensor(parents, dtype=torch.int32),
                     torch.tensor(indptr, dtype=torch.int64),
                     greedy=torch.tensor(greedy, dtype=torch.bool),
                     seeds=torch.tensor([r.seed for r in reqs], dtype=torch.int64),
                     offsets=torch.tensor(offsets, dtype=torch.int64), sampled_children=False)
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
                 *, max_steps: Optional[int] = None) -> List[GenerationResult]:
        """Run the prompts to completion (one params for all, or one per prompt); results in
        prompt order."""
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
            self.step()
            steps += 1
        return [self.result(rid, pop=True) for rid in ids]


def _is_int(x) -> bool:
    return isinstance(x, Integral) and not isinstance(x, bool)


def _is_real(x) -> bool:
    return isinstance(x, Real) and not isinstance(x, bool)
