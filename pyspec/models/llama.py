"""Llama-family decoder (Llama, Mistral, Qwen2) running on pyspec's paged KV and tree attention.

The forward takes one step's flattened batch — prefill chunks, plain decode tokens and draft-tree
nodes of many requests, all as rows of one ``[T]`` token array — and one attention plan shared by
every layer. Each layer's new K/V go to a scratch area (``k_new``/``v_new``); attention reads the
committed prefix from the pages and the new part from scratch. The caller later materializes only the
rows it keeps (accepted draft paths, prefill chunks) into the pages.
"""

from __future__ import annotations

import contextlib
import math
import operator
import os
from typing import Dict, Optional, Tuple

import torch
import torch.nn.functional as F

from pyspec import _C, ops
from pyspec.attention import AttentionPlan, check_attention_backend, tree_attention
from pyspec.linear import Linear
from pyspec.models.config import ModelConfig
from pyspec.models.loader import load_weights, resolve_dtype, return_freed_memory
from pyspec.models.weights import LlamaWeights, resolve_device  # noqa: F401 (re-exported)
from pyspec.profiling import profile_range


# from_pretrained's packed_weights settings (the CLI's --packed-weights choices).
PACKED_WEIGHTS_CHOICES = ("auto", "codes", "off")

# Environment switches that once steered every model of a process, with what replaced them.
_RETIRED_ENV = {
    "PYSPEC_PACKED_NUMERICS": ("exact", "packed weights always compute exactly (the same bits as "
                               "their float32 matrices); the approximate 'fixed' numerics are "
                               "not built"),
    "PYSPEC_FUSED_LAYERS": ("1", "set model.fused_layers = False on the model instead"),
}


def _check_retired_env() -> None:
    """A retired switch set to anything but its old default would be silently ignored: refuse."""
    for name, (default, instead) in _RETIRED_ENV.items():
        value = os.environ.get(name)
        if value not in (None, "", default):
            raise ValueError(f"{name}={value!r} is no longer read: {instead}. Unset it (or set it "
                             f"to {default!r}).")


def rope_inv_freq(cfg: ModelConfig, seq_len: int) -> torch.Tensor:
    """Inverse frequencies [head_dim / 2] (float32) for the config's RoPE variant."""
    d = cfg.head_dim
    base = cfg.rope_theta
    rs = cfg.rope_scaling
    if rs.rope_type == "dynamic" and seq_len > cfg.max_position_embeddings:
        # NTK-aware scaling: grow the base with the sequence past the trained length.
        base = base * ((rs.factor * seq_len / cfg.max_position_embeddings) - (rs.factor - 1)) ** (
            d / (d - 2))
    inv = 1.0 / (base ** (torch.arange(0, d, 2, dtype=torch.int64).float() / d))
    if rs.rope_type == "linear":
        inv = inv / rs.factor
    elif rs.rope_type == "llama3":
        # Llama 3.1: keep high frequencies, divide low ones by `factor`, blend in between.
        old = rs.original_max_position_embeddings
        low_wavelen = old / rs.low_freq_factor
        high_wavelen = old / rs.high_freq_factor
        wavelen = 2 * math.pi / inv
        scaled = torch.where(wavelen > low_wavelen, inv / rs.factor, inv)
        smooth = (old / wavelen - rs.low_freq_factor) / (rs.high_freq_factor - rs.low_freq_factor)
        blended = (1 - smooth) * scaled / rs.factor + smooth * scaled
        medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
        inv = torch.where(medium, blended, scaled)
    return inv


def hidden_layers(spec, num_layers: int) -> Optional[Tuple[int, ...]]:
    """Normalize a ``return_hidden`` value: ``False``/``None`` -> None, ``True`` -> the last layer,
    a sequence of layer numbers -> that tuple (validated: 1 .. ``num_layers``, no repeats)."""
    if spec is None or spec is False:
        return None
    if spec is True:
        return (num_layers,)
    try:
        taps = tuple(int(n) for n in spec)
    except (TypeError, ValueError):
        raise ValueError(f"return_hidden must be a bool or a sequence of layer numbers; got "
                         f"{spec!r}") from None
    if not taps or any(not 1 <= n <= num_layers for n in taps) or len(set(taps)) != len(taps):
        raise ValueError(f"hidden layers must be distinct layer numbers in [1, {num_layers}] "
                         f"(the output of that layer; {num_layers} is the final hidden state); "
                         f"got {list(taps)}")
    return taps


def feature_layers(spec, num_layers: int) -> Tuple[int, ...]:
    """The target layers a drafter reads (:func:`hidden_layers`'s checks, and the last must be
    the final layer: it also gives the target's own distribution); ``None``: the final alone."""
    taps = hidden_layers(True if spec is None else spec, num_layers)
    if taps[-1] != num_layers:
        raise ValueError(f"feature layers must end with the final layer ({num_layers}); got "
                         f"{list(taps)}")
    return taps


class LlamaForCausalLM(LlamaWeights):
    """Inference-only Llama/Mistral/Qwen2 with fused QKV and gate/up projections: the forward
    over its weights (:class:`~pyspec.models.weights.LlamaWeights`: loading, packing, huge pages,
    devices), with this model's own dense-layer kernels and the step's thread policy."""

    def __init__(self, cfg: ModelConfig, weights: Dict[str, torch.Tensor], dtype: torch.dtype,
                 device: str = "cpu",
                 core_linear_dtypes=(torch.float32, torch.bfloat16, torch.float16),
                 kernels=None):
        _check_retired_env()
        self.cfg = cfg
        # The dense layers' kernels, this model's own (pyspec._C.LinearKernels: which builds run,
        # which route a call takes; an ISA name or None for this CPU's best): the core's
        # bandwidth-bound kernel for few rows (decode, draft trees) in these dtypes, torch
        # otherwise (docs/kernels.md).
        self._core_dtypes = tuple(core_linear_dtypes)
        self.dtype = dtype
        self.set_kernels(kernels)
        # The one-call decoder stack for steps it applies to (False: op by op, the same results;
        # for measurements).
        self.fused_layers = True
        # Tensor parallelism (pyspec.tensor_parallel): this model is one rank's share and the
        # row-parallel layers' outputs are summed over this process group; None: the whole model.
        self.tp_group = None
        # Tree attention's kernels (pyspec.attention.tree_attention's backend): "native",
        # "pipelined" or "triton" (CUDA tensors; see set_attention_backend).
        self.attention_backend = "native"
        super().__init__(cfg, weights, dtype, device)
        self._inv_freq = rope_inv_freq(cfg, 0).to(self.device)
        # (layers list, packed list, _C.DecoderStack, the tensors it holds) for steps that run
        # every layer in one core call (_fused_stack); rebuilt when any of them is replaced.
        self._fused = None

    def set_attention_backend(self, backend: str) -> None:
        """Run this model's tree attention on pyspec's own kernels (``"native"``, the default),
        on their CUDA tensor-core kernel with two cp.async K/V stages (``"pipelined"``: a model on
        a GPU; the same results bit for bit) or on the Triton kernel of
        :mod:`pyspec.triton_attention` (``"triton"``: a model on a GPU in bfloat16 / float16 /
        float32, with the ``triton`` package)."""
        if check_attention_backend(backend) != "native" and self.device.type != "cuda":
            raise ValueError(f"attention backend '{backend}' runs on CUDA; this model is on "
                             f"{self.device}")
        if backend == "triton":
            from pyspec import triton_attention
            if not triton_attention.available():
                raise ValueError("attention backend 'triton' needs the 'triton' package")
        self.attention_backend = backend

    def set_kernels(self, kernels=None) -> None:
        """Choose the CPU kernels (a :class:`pyspec._C.LinearKernels`, an ISA name, or None for
        this CPU's best): which builds of the dense layers and of tree attention run (attention
        at most AVX-512) and which route each dense call takes (another vector build may round
        differently; within one, every route gives a row the same bits).
        Packed matrices stay packed: where these kernels have no packed route they are read as
        their float32 matrices (rebuilt per step when only the codes are held)."""
        lin = Linear(kernels)
        self.kernels = lin.kernels
        self.linear = lin if self.dtype in self._core_dtypes else F.linear
        # Steps of up to this many rows run torch's own ops (the glue between the core calls)
        # on one thread: the dense layers then run in the core's thread pool, and torch's OpenMP
        # workers, which spin for a while after each parallel op, would compete with it for the
        # cores (bench/bench_verify_cost.py). Larger steps (prefill) keep torch's threads.
        self._serial_rows = lin.max_fast_rows(self.dtype) if self.linear is lin else 0
        self._fused = None

    def __getstate__(self):
        # The decoder stack (views into this model's tensors) is rebuilt on the next step of a
        # copy, never shared with it or pickled.
        state = dict(self.__dict__)
        state["_fused"] = None
        return state

    @classmethod
    def from_pretrained(cls, path: str, dtype="float32", device: str = "cpu",
                        packed_weights: str = "auto", kernels=None) -> "LlamaForCausalLM":
        """``packed_weights``: ``"auto"`` (default) holds every float32 CPU matrix that is exactly
        a 4-bit or 8-bit block format or 16-bit values also as its codes (:meth:`pack_weights`; the same outputs
        bit for bit, fewer bytes per decoding step), ``"codes"`` as ``"auto"`` but then holds the
        decoder layers' packed matrices as codes only (:meth:`drop_dense`: the same outputs bit for
        bit, about 5x less memory for them), ``"off"`` never; ``PYSPEC_PACKED_WEIGHTS=0`` in the
        environment turns ``"auto"`` and ``"codes"`` off. ``kernels``: the dense layers' kernels
        (a :class:`pyspec._C.LinearKernels` or an ISA name; default this CPU's best)."""
        if packed_weights not in PACKED_WEIGHTS_CHOICES:
            raise ValueError(f"packed_weights must be one of {', '.join(PACKED_WEIGHTS_CHOICES)}; "
                             f"got {packed_weights!r}")
        if not os.path.isdir(path):
            raise ValueError(f"model path {path!r} is not a directory")
        device = str(resolve_device(device))
        cfg = ModelConfig.from_file(path)
        dt = resolve_dtype(dtype)
        # A 4-bit AWQ / GPTQ checkpoint's matrices load as codes only (float32 on the CPU;
        # packed_weights="off" or another dtype or device: as the float matrices they stand for).
        off = packed_weights == "off" or os.environ.get("PYSPEC_PACKED_WEIGHTS", "1") == "0"
        # Codes only: each layer matrix becomes its codes as it is read (no float32 model in
        # memory on the way), where this model's kernels read codes at all.
        stream = (packed_weights == "codes" and not off and dt == torch.float32
                  and torch.device(device).type == "cpu"
                  and Linear(kernels).kernels.packed_available)
        m = cls(cfg, load_weights(path, cfg, dt, device, dequantize=off, pack_layers=stream),
                dt, device, kernels=kernels)
        m.source_path = path
        m.packed_weights = packed_weights
        if not stream:  # (codes only: the float32 tensors left are looked up, not streamed)
            m.place_on_huge_pages()
        if not off:
            m.pack_weights()
            if packed_weights == "codes":
                m.drop_dense()
        return_freed_memory()
        return m

    def _reads_codes(self) -> bool:
        return isinstance(self.linear, Linear) and self.kernels.packed_available

    def _weights_changed(self) -> None:
        self._fused = None  # the stack's views would keep the old weights alive

    def describe(self) -> dict:
        """How this model runs: device and dtype, its dense layers' kernels and routes (this
        model's :class:`pyspec._C.LinearKernels`), its packed matrices, and whether decoding steps
        run the one-call decoder stack."""
        name = str(self.dtype).replace("torch.", "")
        core = isinstance(self.linear, Linear) and self.device.type == "cpu"
        k = self.kernels
        out = {"device": str(self.device), "dtype": name,
               "dense_layers": ({"isa": k.isa, "kernel": k.kernel(name),
                                 "core_kernel_up_to_rows": self._serial_rows}
                                if core else {"kernel": "torch"}),
               "packed": None, "fused_layers": core and self.fused_layers}
        if self.device.type == "cpu" and self.attention_backend == "native":
            out["attention_isa"] = _C._attention_isa(k)
        ps = self._packed_weights()
        if ps:
            out["packed"] = {"matrices": len(ps), "bits": sorted({p.bits for p in ps}),
                             "codes_only": self._codes_only, "bytes": self.packed_bytes,
                             "codes_up_to_rows": k.packed_rows_limit(not self._codes_only)}
        return out

    @classmethod
    def random(cls, cfg: ModelConfig, seed: int = 0, dtype=torch.float32,
               kernels=None) -> "LlamaForCausalLM":
        """Random weights (tests, smoke runs): N(0, 1/fan_in) matrices, unit norms."""
        from pyspec.models.loader import expected_shapes

        g = torch.Generator().manual_seed(seed)
        w = {}
        for name, shape in expected_shapes(cfg).items():
            if name.endswith("norm.weight"):
                w[name] = 1.0 + 0.1 * torch.randn(shape, generator=g)
            elif name.endswith(".bias"):
                w[name] = 0.1 * torch.randn(shape, generator=g)
            elif name == "model.embed_tokens.weight":
                w[name] = torch.randn(shape, generator=g)
            else:
                w[name] = torch.randn(shape, generator=g) / math.sqrt(shape[-1])
        w = {k: v.to(dtype) for k, v in w.items()}
        return cls(cfg, w, dtype, kernels=kernels).place_on_huge_pages()

    def to(self, device) -> "LlamaForCausalLM":
        """Move the weights to ``device`` (see :func:`resolve_device`), in place; returns self.
        KV pools and runners made before the move stay where they were: make them after."""
        super().to(device)
        self._inv_freq = self._inv_freq.to(self.device)
        return self

    # ---- forward ----------------------------------------------------------------------------------

    def rope_tables(self, positions: torch.Tensor, rope_lens: Optional[torch.Tensor] = None):
        """cos/sin [T, head_dim] in rotate-half layout (first and second halves share a frequency).

        ``rope_lens`` [T] (dynamic NTK RoPE only): the sequence length each row's frequencies are
        scaled for. Transformers scales a prefill by its longest position and an incremental decode
        step by its own position + 1; per-row lengths give draft-tree rows exactly the values plain
        decoding would use at their positions (lossless) and keep requests of one batch
        independent. Default: every row uses ``max(positions) + 1``.
        """
        if self.cfg.rope_scaling.rope_type == "dynamic":
            if rope_lens is None:
                rope_lens = torch.full_like(positions, int(positions.max()) + 1)
            lens = sorted(set(rope_lens.tolist()))
            table = torch.stack([rope_inv_freq(self.cfg, n) for n in lens]).to(self.device)
            idx = torch.searchsorted(torch.tensor(lens, device=self.device), rope_lens)
            inv = table[idx]  # [T, D/2]
            ang = positions.to(torch.float32)[:, None] * inv
        else:
            ang = positions.to(torch.float32)[:, None] * self._inv_freq[None, :]
        ang = torch.cat([ang, ang], dim=-1)
        return ang.cos(), ang.sin()

    def truncated(self, num_layers: int) -> "LlamaForCausalLM":
        """A view sharing this model's weights that runs only the first ``num_layers`` layers
        followed by the final norm and lm_head (self-speculative layer skipping)."""
        import copy
        import dataclasses

        if not 1 <= num_layers <= self.cfg.num_hidden_layers:
            raise ValueError(f"num_layers must be in [1, {self.cfg.num_hidden_layers}]; got "
                             f"{num_layers}")
        view = copy.copy(self)
        view.cfg = dataclasses.replace(self.cfg, num_hidden_layers=num_layers)
        view.layers = self.layers[:num_layers]
        view._packed = None if self._packed is None else self._packed[:num_layers]
        view._fused = None
        return view

    def _rms(self, x: torch.Tensor, w: Optional[torch.Tensor]) -> torch.Tensor:
        # No weight: no norm there (published EAGLE-1/2 heads have neither an input norm in
        # their layer nor a final norm).
        return x if w is None else ops.rms_norm(x, w, self.cfg.rms_norm_eps)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, plan, k_pages: torch.Tensor,
                v_pages: torch.Tensor, k_new: torch.Tensor, v_new: torch.Tensor,
                logits_rows: Optional[torch.Tensor] = None, return_hidden: bool = False,
                rope_lens: Optional[torch.Tensor] = None,
                inputs_embeds: Optional[torch.Tensor] = None, lm_head: bool = True):
        """One step over ``T`` flattened new tokens.

        Args:
            input_ids, positions: int64 ``[T]``.
            plan: the step's attention plan (``pyspec.attention.plan_attention``).
            k_pages, v_pages: ``[L, num_blocks, block_size, Hkv, D]`` KV pool (model dtype, or
                float16 / bfloat16 under a float32 model on the CPU).
            k_new, v_new: ``[L, T, Hkv, D]`` scratch in the pool's dtype, filled with this
                step's K/V.
            logits_rows: int64 rows whose logits are wanted (``None``: all rows).
            return_hidden: also return hidden states: ``True`` the final ones ``[T, hidden]``
                (before the norm); a sequence of layer numbers (1 .. num_hidden_layers, the
                output of that layer; the last is the final hidden state) their concatenation
                ``[T, len * hidden]`` in that order (EAGLE-3-style heads read several depths).
            rope_lens: int64 ``[T]``, dynamic-RoPE scaling length per row (see ``rope_tables``).
            inputs_embeds: ``[T, hidden]`` layer-0 inputs used instead of the token embeddings
                (EAGLE-style heads feed fused token + feature vectors).
            lm_head: False: return the final hidden states ``[T, hidden]`` (before the norm;
                :meth:`project` makes logits of them) instead of logits, and the asked hidden
                states as a second value when ``return_hidden``: a CUDA-graphed step stops there.

        Returns:
            float32 logits ``[R, vocab]`` (and the hidden states when asked).
        """
        with self.step_threads(input_ids.shape[0]):
            return self._forward(input_ids, positions, plan, k_pages, v_pages, k_new, v_new,
                                 logits_rows, return_hidden, rope_lens, inputs_embeds, lm_head)

    def project(self, x: torch.Tensor) -> torch.Tensor:
        """float32 logits of final hidden states ``x`` ``[R, hidden]``: the final norm and the
        lm_head."""
        lm = self.lm_head if self._packed_lm_head is None else self._packed_lm_head
        with profile_range("pyspec.lm_head"):
            return self.linear(self._rms(x, self.norm), lm).float()

    def step_threads(self, rows: int):
        """A context for the host work of a CPU step of ``rows`` rows: torch runs on one thread
        while the step is small enough for the core's kernels (at most ``max_fast_rows`` rows:
        decoding, verification, small prefill chunks; see ``_serial_rows``), and with its own
        threads for larger steps, also inside a small step's block (a drafter catching up on many
        tokens within an engine step), and on other devices. Callers wrap the whole step in it,
        not only the forward: torch's OpenMP workers spin for a while after any parallel op (a
        max over a few rows of logits is one), and on 2 cores they then take a core from the next
        forward's own worker threads (docs/experiments/2026-12-05-torch-threads-in-step.md)."""
        if self.device.type != "cpu":
            return contextlib.nullcontext()
        if rows <= self._serial_rows:
            return ops.torch_threads(1)
        return ops.torch_threads(ops.outer_torch_threads())

    def _forward(self, input_ids, positions, plan, k_pages, v_pages, k_new, v_new, logits_rows,
                 return_hidden, rope_lens, inputs_embeds, lm_head=True):
        cfg = self.cfg
        taps = hidden_layers(return_hidden, cfg.num_hidden_layers)
        kept = {}
        t = input_ids.shape[0]
        cos, sin = self.rope_tables(positions, rope_lens)
        x = self.embed_rows(input_ids) if inputs_embeds is None else inputs_embeds
        with profile_range("pyspec.layers"):
            # (The core's stack reads a core plan; a graphed step's fixed launches run op by op.)
            stack = self._fused_stack(t, x, k_pages) if isinstance(plan, AttentionPlan) else None
            if stack is not None:
                # Every layer in one core call (in place: x is this step's own tensor),
                # stopping at each tapped layer to keep its output.
                if x is inputs_embeds or not x.is_contiguous():
                    x = x.clone(memory_format=torch.contiguous_format)
                begin = 0
                for n in sorted(taps or ()):
                    stack.run(x, cos, sin, plan, k_pages, v_pages, k_new, v_new, begin, n)
                    kept[n] = x.clone() if n < cfg.num_hidden_layers else x
                    begin = n
                stack.run(x, cos, sin, plan, k_pages, v_pages, k_new, v_new, begin, -1)
            else:
                x = self._layers_one_by_one(x, cos, sin, plan, k_pages, v_pages, k_new, v_new,
                                            taps, kept)
        hidden = x if taps is None else kept[taps[0]] if len(taps) == 1 else torch.cat(
            [kept[n] for n in taps], -1)
        if not lm_head:
            return (x, hidden) if taps is not None else x
        logits = self.project(x if logits_rows is None else x.index_select(0, logits_rows))
        return (logits, hidden) if taps is not None else logits

    def _fused_stack(self, t: int, x: torch.Tensor, k_pages: torch.Tensor):
        """The core's decoder stack for a step of ``t`` rows when it applies (CPU, the core's
        linear kernel, at most its fast rows, the model's dtype, no autograd; not with
        ``fused_layers=False``), else None. The stack computes exactly what
        :meth:`_layers_one_by_one` does, in one call instead of about a dozen per layer."""
        if (t > self._serial_rows or self.device.type != "cpu" or x.dtype != self.dtype
                or self.tp_group is not None  # (its all-reduces sit between the core's ops)
                or not ops.kv_storable(self.dtype, k_pages.dtype)
                or not k_pages.is_contiguous()
                or (torch.is_grad_enabled() and x.requires_grad) or not self.fused_layers
                or any(layer["ln1"] is None or "ln_hidden" in layer for layer in self.layers)
                or not isinstance(self.linear, Linear)
                # Codes alone need the packed kernel: op by op, the model's Linear rebuilds the
                # matrices instead.
                or (self._codes_only and not self.kernels.packed_available)):
            return None
        # The stack holds the tensors it was built from: any replaced one (a layer dict's entry,
        # a packed matrix) makes a new stack (a comparison of identities per tensor).
        sig = [v for layer in self.layers for v in layer.values()]
        if self._packed is not None:
            sig += [w for lp in self._packed for w in lp.values()]
        f = self._fused
        if (f is not None and f[0] is self.layers and f[1] is self._packed
                and len(f[3]) == len(sig) and all(map(operator.is_, f[3], sig))):
            return f[2]
        from pyspec.linear import PackedWeight

        cfg = self.cfg
        layers = []
        for li, layer in enumerate(self.layers):
            mats = layer if self._packed is None else self._packed[li]
            d = {k: layer[k] for k in ("ln1", "ln2", "bqkv", "bo")}
            for k in ("wqkv", "wo", "wgu", "wd"):
                w = mats[k]
                # perm: columns in a stored order (GPTQ act-order), the input gathered for them.
                d[k] = w if type(w) is not PackedWeight else (w.dense, w.q, w.d, w.m, w.perm)
            layers.append(d)
        stack = None
        if not any(getattr(v, "requires_grad", False) for layer in self.layers
                   for v in layer.values()):
            try:
                # The core checks every weight (dtype, shape, layout): weights it cannot take
                # (e.g. a strided view) run op by op instead.
                stack = _C.DecoderStack(layers, cfg.num_attention_heads, cfg.num_key_value_heads,
                                        cfg.head_dim, cfg.intermediate_size, cfg.rms_norm_eps,
                                        self.kernels)
            except ValueError:
                stack = None
        self._fused = (self.layers, self._packed, stack, sig)
        return stack

    def _summed(self, y: torch.Tensor) -> torch.Tensor:
        """A row-parallel layer's output summed over the tensor-parallel ranks (in place); the
        whole model's as it is."""
        if self.tp_group is not None:
            self.tp_group.allreduce([y]).wait()
        return y

    def _layers_one_by_one(self, x, cos, sin, plan, k_pages, v_pages, k_new, v_new, taps, kept):
        cfg = self.cfg
        x = x.contiguous()  # as the stack reads it (the core ops need contiguous rows)
        t = x.shape[0]
        qs = cfg.q_size
        packed = self._packed
        for li, layer in enumerate(self.layers):
            mats = layer if packed is None else packed[li]
            if "ln_hidden" in layer:
                # An EAGLE-3 head's layer: its input is [embed; feature], each half normed on
                # its own, and the feature is the residual.
                hs = cfg.hidden_size
                e, x = x[:, :hs].contiguous(), x[:, hs:].contiguous()
                h = torch.cat([self._rms(e, layer["ln1"]), self._rms(x, layer["ln_hidden"])], -1)
            else:
                h = self._rms(x, layer["ln1"])
            qkv = self.linear(h, mats["wqkv"], layer["bqkv"])
            q = ops.rotary_qkv(qkv, cos, sin, cfg.num_attention_heads, cfg.num_key_value_heads,
                               k_new[li], v_new[li])
            a = tree_attention(plan, q, k_pages[li], v_pages[li], k_new[li], v_new[li],
                               backend=self.attention_backend, kernels=self.kernels)
            x = x + self._summed(self.linear(a.view(t, qs), mats["wo"], layer["bo"]))
            h = self._rms(x, layer["ln2"])
            gu = self.linear(h, mats["wgu"])
            inter = cfg.intermediate_size
            x = x + self._summed(self.linear(ops.silu_mul(gu, inter), mats["wd"]))
            if taps is not None and li + 1 in taps:
                kept[li + 1] = x
        return x
