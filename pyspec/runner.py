"""The model runner: owns the KV pool tensors and runs one step's flattened forward.

A step is a list of :class:`SeqStep` records (one per request: its new tokens, where they start, its
block table, and a draft tree or ``None`` for a causal chunk). The runner flattens them, plans tree
attention once, runs the model once, and returns the logits rows each request asked for plus the
scratch K/V. :meth:`ModelRunner.commit_kv` then materializes the rows a request keeps into its
pages. The runner knows nothing of scheduling; the scheduler knows nothing of torch.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import List, Optional, Sequence, Union

import torch

from pyspec import TokenTree, ops
from pyspec.attention import plan_attention
from pyspec.models.llama import hidden_layers


@dataclass
class SeqStep:
    """One request's share of a step.

    Attributes:
        token_ids: the new tokens (a prefill chunk, one decode token, or the tree's node tokens with
            the root first).
        start_pos: committed tokens of the request (their K/V are in its pages); the first new
            token sits at this position.
        block_table: the request's page ids (covering at least ``start_pos`` tokens).
        tree: a :class:`TokenTree` over ``token_ids`` (positions ``start_pos + depth``), or
            ``None`` for a causal chunk.
        logits: which rows need logits: ``"last"`` (prefill / decode), ``"all"`` (trees),
            ``"none"`` (a non-final prefill chunk), or an int k: the last k rows (1 <= k <= the
            number of new tokens; scoring a known continuation without a [tokens, vocab] array
            for the prompt's rows).
    """

    token_ids: Sequence[int]
    start_pos: int
    block_table: Sequence[int]
    tree: Optional[TokenTree] = None
    logits: Union[str, int] = "last"


@dataclass
class StepOutput:
    logits: torch.Tensor  # float32 [R, vocab], rows of all requests in order
    logits_indptr: List[int]  # [B + 1] offsets of each request's rows in `logits`
    row_indptr: List[int]  # [B + 1] offsets of each request's new tokens in the scratch K/V
    k_new: torch.Tensor  # [L, T, Hkv, D]
    v_new: torch.Tensor
    hidden: Optional[torch.Tensor] = None  # [T, hidden] (x the layers asked) when asked

    def logits_of(self, i: int) -> torch.Tensor:
        return self.logits[self.logits_indptr[i]:self.logits_indptr[i + 1]]


@dataclass
class KVPool:
    """K and V pages of every layer: ``[L, num_blocks, block_size, Hkv, D]``."""

    k: torch.Tensor
    v: torch.Tensor

    @property
    def num_blocks(self) -> int:
        return self.k.shape[1]

    @property
    def block_size(self) -> int:
        return self.k.shape[2]

    def copy_blocks(self, pairs) -> None:
        """Copy-on-write copies requested by the block manager: (src, dst) block ids, in order."""
        for src, dst in pairs:
            self.k[:, dst].copy_(self.k[:, src])
            self.v[:, dst].copy_(self.v[:, src])


KV_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def check_kv_dtype(model, kv_dtype) -> torch.dtype:
    """The KV cache dtype for ``model``: its own (None), float16 for a float32 model on the CPU
    and its own otherwise ("auto"), or float16 / bfloat16 (a name or a torch dtype) under a
    float32 model on the CPU; anything else is a ValueError."""
    if kv_dtype is None:
        return model.dtype
    if kv_dtype == "auto":
        lean = model.dtype == torch.float32 and model.device.type == "cpu"
        return torch.float16 if lean else model.dtype
    want = KV_DTYPES.get(kv_dtype, kv_dtype) if isinstance(kv_dtype, str) else kv_dtype
    if want == model.dtype:
        return want
    if not ops.kv_storable(torch.float32, want):
        raise ValueError(f"kv_cache_dtype must be 'auto', float32, float16 or bfloat16; got "
                         f"{kv_dtype!r}")
    if model.dtype != torch.float32 or model.device.type != "cpu":
        raise ValueError(f"a {str(want).replace('torch.', '')} KV cache needs a float32 model "
                         f"on the CPU; this model is {str(model.dtype).replace('torch.', '')} on "
                         f"{model.device.type} (kv_cache_dtype='auto' gives it its own dtype)")
    return want


class ModelRunner:
    def __init__(self, model, num_blocks: int, block_size: int = 16, kv: Optional[KVPool] = None,
                 kv_dtype: Optional[torch.dtype] = None):
        """``kv``: use this pool (e.g. views of another runner's first layers, for a drafter
        that shares the target's KV) instead of allocating one. ``kv_dtype``: the KV cache's
        dtype (default: the model's; float16 / bfloat16 under a float32 model on the CPU: half
        the cache's memory, each K/V row rounded once as it is computed, for every request
        alike)."""
        if num_blocks < 1 or block_size < 1:
            raise ValueError(f"num_blocks and block_size must be >= 1; got {num_blocks}, {block_size}")
        cfg = model.cfg
        self.model = model
        self.kv_dtype = check_kv_dtype(model, kv.k.dtype if kv is not None else kv_dtype)
        if kv is not None:
            want = (cfg.num_hidden_layers, num_blocks, block_size, cfg.num_key_value_heads,
                    cfg.head_dim)
            if tuple(kv.k.shape) != want or tuple(kv.v.shape) != want:
                raise ValueError(f"kv pool shape {list(kv.k.shape)} does not match {list(want)}")
            self.kv = kv
            return
        shape = (cfg.num_hidden_layers, num_blocks, block_size, cfg.num_key_value_heads, cfg.head_dim)
        # Uninitialized: attention only reads positions below each request's prefix length, and those
        # are always materialized first. On the CPU on transparent huge pages (pyspec.hugepages).
        from pyspec.hugepages import huge_page_empty

        self.kv = KVPool(huge_page_empty(shape, self.kv_dtype, model.device),
                         huge_page_empty(shape, self.kv_dtype, model.device))

    graphs = None  # a GraphedSteps once enable_cuda_graphs ran

    def enable_cuda_graphs(self, max_batch: int = 32, max_rows: int = 64,
                           max_tokens: int = 1024, emulate: bool = False):
        """Run the steps that fit a bucket as CUDA graphs from now on (see
        :mod:`pyspec.cuda_graphs`; ``emulate``: the same padded steps without graphs, for
        tests). Returns the :class:`pyspec.cuda_graphs.GraphedSteps`."""
        from pyspec.cuda_graphs import GraphedSteps

        self.graphs = GraphedSteps(self, max_batch, max_rows, max_tokens, emulate)
        return self.graphs

    @property
    def block_size(self) -> int:
        return self.kv.block_size

    @torch.inference_mode()
    def step(self, seqs: Sequence[SeqStep], return_hidden=False,
             inputs_embeds: Optional[torch.Tensor] = None, *,
             logits_to_host: bool = True) -> StepOutput:
        """``return_hidden``: ``True`` for the final hidden states, or a sequence of layer numbers
        for their concatenation (see ``LlamaForCausalLM.forward``). ``inputs_embeds``
        ``[T, hidden]``: layer-0 inputs for the flattened rows instead of
        the token embeddings (the token ids then only size the rows). ``logits_to_host=False``
        leaves a GPU model's logits on the device (the engine's acceptance runs there and copies
        back only its decisions, its head drafters read the hidden states there)."""
        if not seqs:
            raise ValueError("a step needs at least one sequence")
        cfg = self.model.cfg
        ids: List[int] = []
        pos: List[torch.Tensor] = []
        q_indptr, row_indptr, logit_rows, logits_indptr = [0], [0], [], [0]
        prefix, tables, tree_parents, tree_indptr = [], [], [], [0]
        rope_lens: List[torch.Tensor] = []
        window = cfg.sliding_window
        for s in seqs:
            n = len(s.token_ids)
            if n == 0:
                raise ValueError("every sequence of a step needs at least one new token")
            base = q_indptr[-1]
            ids.extend(int(t) for t in s.token_ids)
            if s.tree is None:
                p = torch.arange(s.start_pos, s.start_pos + n)
                # A causal chunk is scaled for its longest position, like a transformers prefill;
                # a single decode token for its own position + 1, like an incremental step.
                rope_lens.append(torch.full((n,), s.start_pos + n, dtype=torch.int64))
            else:
                if s.tree.num_nodes != n:
                    raise ValueError(f"tree has {s.tree.num_nodes} nodes but {n} tokens were given")
                p = s.start_pos + torch.tensor(s.tree.depths, dtype=torch.int64)
                rope_lens.append(p + 1)  # each node as if decoded alone at its position
            if window is not None and int(p.max()) >= window:
                raise ValueError(f"position {int(p.max())} is beyond the model's sliding window "
                                 f"({window}); sliding-window attention is not implemented, so "
                                 "contexts must stay within it")
            pos.append(p)
            if s.tree is not None:
                tree_parents.extend(s.tree.parents)
            tree_indptr.append(len(tree_parents))
            q_indptr.append(base + n)
            row_indptr.append(base + n)
            prefix.append(s.start_pos)
            tables.append(list(s.block_table))
            if s.logits == "last":
                logit_rows.append(base + n - 1)
            elif s.logits == "all":
                logit_rows.extend(range(base, base + n))
            elif isinstance(s.logits, int) and not isinstance(s.logits, bool):
                if not 1 <= s.logits <= n:
                    raise ValueError(f"logits={s.logits} asks for more rows than the sequence's "
                                     f"{n} new tokens (or fewer than 1)")
                logit_rows.extend(range(base + n - s.logits, base + n))
            elif s.logits != "none":
                raise ValueError(f"logits must be 'last', 'all', 'none' or a row count; got "
                                 f"{s.logits!r}")
            logits_indptr.append(len(logit_rows))
        width = max(1, max(len(t) for t in tables))
        table = torch.full((len(seqs), width), -1, dtype=torch.int32)
        for i, t in enumerate(tables):
            if t:
                table[i, :len(t)] = torch.tensor(t, dtype=torch.int32)
        plan = plan_attention(q_indptr, prefix, table, self.block_size,
                              torch.tensor(tree_parents, dtype=torch.int32), tree_indptr,
                              self.kv.num_blocks, num_q_heads=cfg.num_attention_heads,
                              num_kv_heads=cfg.num_key_value_heads)
        t = len(ids)
        if inputs_embeds is None and (min(ids) < 0 or max(ids) >= cfg.vocab_size):
            # Caught here, on the host: on a GPU an out-of-range id is a device-side assert that
            # ends the CUDA context (every later request would fail too).
            bad = next(i for i in ids if not 0 <= i < cfg.vocab_size)
            raise ValueError(f"token id {bad} is out of range [0, {cfg.vocab_size})")
        rows = torch.tensor(logit_rows, dtype=torch.int64, device=self.model.device)
        graphed = None
        if self.graphs is not None and inputs_embeds is None:
            bucket = self.graphs.bucket([len(s.token_ids) for s in seqs], prefix)
            if bucket is not None:
                graphed = self.graphs.run(bucket, ids, torch.cat(pos), plan, rows,
                                          hidden_layers(return_hidden, cfg.num_hidden_layers))
        if graphed is not None:
            logits, k_new, v_new, hidden = graphed
        else:
            shape = (cfg.num_hidden_layers, t, cfg.num_key_value_heads, cfg.head_dim)
            k_new = torch.empty(shape, dtype=self.kv_dtype, device=self.model.device)
            v_new = torch.empty_like(k_new)
            input_ids = torch.tensor(ids, dtype=torch.int64, device=self.model.device)
            positions = torch.cat(pos).to(self.model.device)
            dynamic = cfg.rope_scaling.rope_type == "dynamic"
            out = self.model.forward(input_ids, positions, plan, self.kv.k, self.kv.v, k_new,
                                     v_new, logits_rows=rows, return_hidden=return_hidden,
                                     rope_lens=torch.cat(rope_lens).to(self.model.device)
                                     if dynamic else None,
                                     inputs_embeds=None if inputs_embeds is None
                                     else inputs_embeds.to(self.model.device))
            logits, hidden = out if isinstance(out, tuple) else (out, None)
        if logits.device.type != "cpu" and logits_to_host:
            # A model on a GPU: the step's K/V scratch stays on the device for commit_kv, and the
            # logits and hidden states too where the caller works there (the engine's acceptance
            # and head drafters).
            logits = logits.cpu()
            hidden = hidden.cpu() if hidden is not None else None
        return StepOutput(logits, logits_indptr, row_indptr, k_new, v_new, hidden)

    def commit_kv(self, out: StepOutput, seq_index: int, local_rows, slots) -> None:
        """Materialize request ``seq_index``'s new-token rows ``local_rows`` into flat ``slots``."""
        base = out.row_indptr[seq_index]
        dev = self.kv.k.device
        rows = torch.as_tensor(local_rows, dtype=torch.int64).to(dev) + base
        slots = torch.as_tensor(slots, dtype=torch.int64).to(dev)
        ops.materialize_kv(out.k_new, self.kv.k, rows, slots)
        ops.materialize_kv(out.v_new, self.kv.v, rows, slots)
