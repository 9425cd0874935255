"""CUDA graphs for a GPU model's decode and verify steps.

A decode step of a small model on a GPU is mostly launch overhead: a few hundred kernels of a
few microseconds each, every one launched from Python. A CUDA graph records a step's launches
once and replays them in one call. The launches must then be the same at every replay (grids,
pointers, shapes), so a step is padded to a *bucket*:

* ``(batch bucket, rows bucket)``: at most that many requests of at most that many new tokens
  each (a decode token is 1 row, a 16-node draft tree 16). Batch buckets are 1, 2, 4, then
  multiples of 8 up to ``max_batch``; rows buckets 1, 2, 4, ... up to ``max_rows``. A step takes
  the smallest bucket that holds it; one whose padded size passes ``max_tokens`` runs eagerly.
* Every graph reads its inputs from fixed buffers: token ids, positions and the attention
  metadata of a :class:`pyspec.triton_attention.StaticAttention` (fixed-capacity work lists whose
  unused entries are no-ops), one copy to the device per step. It writes its outputs into
  buffers all graphs share (graphs replay one at a time): the step's K/V scratch, the final
  hidden states and, for steps that ask for them (EAGLE-style drafters), the hidden states of
  the layers asked.
* Layers held as 4-bit / 8-bit codes (AWQ / GPTQ checkpoints) read them with the Triton kernel
  of :mod:`pyspec.triton_linear`, whose launches replay like the others.
* The graph ends at the final hidden states. The lm_head runs after the replay, only on the rows
  whose logits the step needs (full-vocabulary logits for every padded row would take a buffer of
  gigabytes: 2,048 rows x 128,256 x 4 bytes = 1 GB).

A bucket's graph is captured the first time a step needs it (after two warm-up runs, which also
compile the Triton kernels for its tile sizes) and replayed after that. Should a capture fail, a
warning says why and every later step runs eagerly (``describe()["failed"]``). Steps a graph cannot run
go through the eager forward: prefill chunks larger than the rows buckets, and steps that give
input embeddings.

``emulate=True`` runs the same padded steps without CUDA graphs, on any device: a "capture"
records the forward and a "replay" calls it. On the CPU with the Triton interpreter
(``TRITON_INTERPRET=1``) this is how the padding, the buckets and the fixed launches are tested
where no GPU is present.
"""

from __future__ import annotations

import contextlib
import warnings
from typing import Dict, List, Optional, Sequence, Tuple

import torch

__all__ = ["GraphedSteps", "batch_buckets", "rows_buckets"]


def batch_buckets(max_batch: int) -> List[int]:
    """1, 2, 4, then multiples of 8, up to ``max_batch`` (which is always a bucket)."""
    out = [b for b in (1, 2, 4) if b < max_batch] + list(range(8, max_batch, 8))
    return out + [max_batch]


def rows_buckets(max_rows: int) -> List[int]:
    """Powers of two up to ``max_rows`` (which is always a bucket)."""
    out, n = [], 1
    while n < max_rows:
        out.append(n)
        n *= 2
    return out + [max_rows]


def _smallest(buckets: Sequence[int], n: int) -> Optional[int]:
    return next((b for b in buckets if b >= n), None)


def why_not_graphed(model) -> Optional[str]:
    """Why ``model``'s steps cannot be captured (None when they can, on a CUDA device)."""
    from pyspec.triton_attention import available

    if not available():
        return "CUDA graphs need the 'triton' package (pip install triton)"
    if model.cfg.rope_scaling.rope_type == "dynamic":
        return "dynamic RoPE scaling computes its tables on the host per step"
    if getattr(model, "tp_group", None) is not None:
        return "a tensor-parallel model's all-reduces run between its ops"
    return None


class GraphedSteps:
    """Captured steps of one :class:`pyspec.runner.ModelRunner` (see the module doc).

    Args:
        runner: the runner whose model and KV pool the graphs read.
        max_batch: most requests of a graphed step.
        max_rows: most new tokens of one request in a graphed step.
        max_tokens: most padded rows (batch bucket x rows bucket) of a graphed step.
        emulate: run the padded steps without CUDA graphs (any device; see the module doc).
    """

    def __init__(self, runner, max_batch: int = 32, max_rows: int = 64, max_tokens: int = 1024,
                 emulate: bool = False):
        for name, v, top in (("max_batch", max_batch, 1024), ("max_rows", max_rows, 256),
                             ("max_tokens", max_tokens, 1 << 16)):
            if not isinstance(v, int) or isinstance(v, bool) or not 1 <= v <= top:
                raise ValueError(f"{name} must be an int in [1, {top}]; got {v!r}")
        if not isinstance(emulate, bool):
            raise ValueError(f"emulate must be a bool; got {emulate!r}")
        model = runner.model
        if model.device.type != "cuda" and not emulate:
            raise ValueError(f"CUDA graphs need a model on a CUDA device; this one is on "
                             f"{model.device}")
        why = why_not_graphed(model)
        if why is not None:
            raise ValueError(f"this model's steps cannot run in CUDA graphs: {why}")
        if runner.kv.k.dtype != model.dtype:
            raise ValueError(f"CUDA graphs run the Triton attention kernel, which reads K/V in "
                             f"the model's dtype ({model.dtype}); this runner's KV cache is "
                             f"{runner.kv.k.dtype}")
        self.runner, self.model = runner, model
        self.emulate = emulate
        self.batch_buckets = batch_buckets(max_batch)
        self.rows_buckets = rows_buckets(max_rows)
        self.max_tokens = max_tokens
        # Rows of the largest bucket: the shared buffers' size.
        self._max_rows_padded = max(b * n for b in self.batch_buckets for n in self.rows_buckets
                                    if b * n <= max_tokens)
        cfg = model.cfg
        self._max_pages_per_request = min(runner.kv.num_blocks,
                                          -(-cfg.max_position_embeddings // runner.block_size))
        # Per (batch, rows, layers asked): the captured step (torch.cuda.CUDAGraph, or the
        # forward itself when emulated); per (batch, rows): its StaticAttention.
        self._graphs: Dict[tuple, object] = {}
        self._attn: Dict[Tuple[int, int], object] = {}
        self._pool = None if emulate else torch.cuda.graph_pool_handle()
        self._kv_new: Optional[Tuple[torch.Tensor, torch.Tensor]] = None
        # The final hidden states [T, hidden] each graph writes, and per width of a layer list's
        # concatenation the asked hidden states [T, width].
        self._final: Optional[torch.Tensor] = None
        self._tapped: Dict[int, torch.Tensor] = {}
        self.captures = 0
        self.replays = 0
        # Why capturing failed (then every later step runs eagerly), or None.
        self.failed: Optional[str] = None

    def bucket(self, rows_per_request: Sequence[int],
               prefix_lens: Sequence[int]) -> Optional[Tuple[int, int]]:
        """The ``(batch, rows)`` bucket of a step whose requests have these new-token counts and
        committed tokens, or None where no graph holds it."""
        if self.failed or not rows_per_request or len(prefix_lens) != len(rows_per_request):
            return None
        b = _smallest(self.batch_buckets, len(rows_per_request))
        n = _smallest(self.rows_buckets, max(rows_per_request))
        if b is None or n is None or b * n > self.max_tokens:
            return None
        bs = self.runner.block_size
        if sum(-(-p // bs) for p in prefix_lens) > self._max_pages(b):
            return None  # (past the model's positions: its own error comes from the eager path)
        return b, n

    def _max_pages(self, batch: int) -> int:
        """Most pages a step of ``batch`` requests may read in a graph: each request's most,
        and at most twice the pool's pages in all (requests sharing a cached prefix count its
        pages each; a step past that runs eagerly)."""
        return min(batch * self._max_pages_per_request, 2 * self.runner.kv.num_blocks)

    def _buffers(self, taps: Optional[Tuple[int, ...]]):
        """The outputs every graph writes, sized for the largest bucket (graphs replay one at a
        time, so they share them): K/V scratch, final hidden states, and the hidden states of
        ``taps`` (their concatenation). Returns the last two (the second None without taps)."""
        tokens = self._max_rows_padded
        cfg, dev, dtype = self.model.cfg, self.model.device, self.model.dtype
        if self._kv_new is None:
            shape = (cfg.num_hidden_layers, tokens, cfg.num_key_value_heads, cfg.head_dim)
            kv_dtype = self.runner.kv.k.dtype
            self._kv_new = (torch.zeros(shape, dtype=kv_dtype, device=dev),
                            torch.zeros(shape, dtype=kv_dtype, device=dev))
        if self._final is None:
            self._final = torch.zeros(tokens, cfg.hidden_size, dtype=dtype, device=dev)
        width = cfg.hidden_size * len(taps or ())
        if width and width not in self._tapped:
            self._tapped[width] = torch.zeros(tokens, width, dtype=dtype, device=dev)
        return self._final, self._tapped.get(width)

    def run(self, key: Tuple[int, int], ids: List[int], positions: torch.Tensor, plan,
            logit_rows: torch.Tensor, taps: Optional[Tuple[int, ...]] = None):
        # On the model's own GPU (cuda:N need not be the current device): its streams, its
        # allocations, its capture.
        dev = self.model.device
        with torch.cuda.device(dev) if dev.type == "cuda" else contextlib.nullcontext():
            return self._run(key, ids, positions, plan, logit_rows, taps)

    def _run(self, key: Tuple[int, int], ids: List[int], positions: torch.Tensor, plan,
             logit_rows: torch.Tensor, taps: Optional[Tuple[int, ...]]):
        """The step in bucket ``key`` (from :meth:`bucket`): its ``ids`` and ``positions``
        (host), the attention ``plan``, the device ``logit_rows`` and the layers whose hidden
        states it returns (``taps``, as ``pyspec.models.llama.hidden_layers`` normalizes them;
        None: none). Returns ``(logits, k_new, v_new, hidden)``: logits of those rows, the step's
        own K/V scratch ``[L, T, Hkv, D]`` and the hidden states ``[T, len(taps) * hidden]`` (or
        None); or None where the bucket's capture failed (a warning says why; the caller runs
        the step eagerly, and so does every later step)."""
        batch, rows = key
        t = len(ids)
        final, tapped = self._buffers(taps)
        attn = self._attn.get(key)
        if attn is None:
            from pyspec.triton_attention import StaticAttention

            cfg = self.model.cfg
            attn = StaticAttention(self.model.device, batch, rows, cfg.num_attention_heads,
                                   cfg.num_key_value_heads, cfg.head_dim,
                                   self.runner.block_size, self._max_pages(batch),
                                   inputs=2 * batch * rows)
            self._attn[key] = attn
        io = torch.zeros(2, batch * rows, dtype=torch.int64)  # padding rows: token 0 at 0
        io[0, :t] = torch.tensor(ids, dtype=torch.int64)
        io[1, :t] = positions
        attn.write(plan, io)  # checks that the step fits the bucket; one upload
        gkey = (batch, rows) if taps is None else (batch, rows, taps)
        g = self._graphs.get(gkey)
        if g is None:
            try:
                g = self._capture(key, attn, taps, final, tapped)
            except Exception as e:  # noqa: BLE001 (any capture failure: eager from now on)
                self.failed = f"capturing bucket {gkey} failed: {type(e).__name__}: {e}"
                warnings.warn(f"CUDA graphs are off for this model's steps: {self.failed}",
                              stacklevel=3)
                return None
            self._graphs[gkey] = g
        if self.emulate:
            g()
        else:
            g.replay()
        self.replays += 1
        logits = self.model.project(final[:t].index_select(0, logit_rows))
        hidden = None if tapped is None else tapped[:t].clone()
        k_new, v_new = self._kv_new
        return logits, k_new[:, :t].clone(), v_new[:, :t].clone(), hidden

    def _capture(self, key: Tuple[int, int], attn, taps: Optional[Tuple[int, ...]], final,
                 tapped):
        batch, rows = key
        t = batch * rows
        io, (k_new, v_new) = attn.inputs.view(2, t), self._kv_new
        k_new, v_new = k_new[:, :t], v_new[:, :t]
        kv = self.runner.kv
        model = self.model
        final = final[:t]
        tapped = None if tapped is None else tapped[:t]

        def forward():
            out = model.forward(io[0], io[1], attn, kv.k, kv.v, k_new, v_new, lm_head=False,
                                return_hidden=taps or False)
            x, hidden = out if taps else (out, None)
            final.copy_(x)
            if hidden is not None:
                tapped.copy_(hidden)

        self.captures += 1
        if self.emulate:
            return forward
        dev = model.device
        # Two runs off the capture (they compile the Triton kernels for this bucket's tiles and
        # let the libraries pick their workspaces), then the capture itself.
        side = torch.cuda.Stream(dev)
        side.wait_stream(torch.cuda.current_stream(dev))
        with torch.cuda.stream(side):
            for _ in range(2):
                forward()
        torch.cuda.current_stream(dev).wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        # thread_local: another thread's CUDA work (a server's) does not invalidate the capture.
        # The capture stream is the model's device's (torch's default one is made on whichever
        # device is current when it is first used).
        with torch.cuda.graph(graph, pool=self._pool, stream=side,
                              capture_error_mode="thread_local"):
            forward()
        return graph

    def describe(self) -> dict:
        """Buckets captured so far, captures and replays."""
        return {"buckets": sorted(self._graphs), "captures": self.captures,
                "replays": self.replays, "failed": self.failed, "max_tokens": self.max_tokens,
                "batch_buckets": self.batch_buckets, "rows_buckets": self.rows_buckets}
