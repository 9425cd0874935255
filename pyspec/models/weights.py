"""A Llama-family model's weights as the forward reads them: loaded from a Hugging Face weight
dict (fused QKV and gate/up matrices), packed as exact 4-bit / 8-bit block codes or 16-bit values
where their values allow, held on transparent huge pages, moved between devices. The forward is
:class:`pyspec.models.llama.LlamaForCausalLM`, which extends this storage.
"""

from __future__ import annotations

import warnings
from typing import Dict, Optional

import torch
import torch.nn.functional as F

from pyspec import _C
from pyspec.models.config import ModelConfig

__all__ = ["LlamaWeights", "resolve_device"]


def resolve_device(device) -> torch.device:
    """The torch device a model may run on: ``"cpu"``, or ``"cuda"`` / ``"cuda:N"`` where pyspec
    was built with CUDA and that GPU is usable. Anything else is a ValueError saying why.

    On a CUDA device the model's forward (dense layers, norms and rotary through torch, tree
    attention and KV materialization through pyspec's kernels) and its KV pool live on the GPU;
    so do the engine's sampling filters and acceptance (only its decisions come back) and head
    drafters (EAGLE, Medusa) and draft models; n-gram and corpus drafters run on the host.
    """
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError):
        raise ValueError(f"device must be 'cpu', 'cuda' or 'cuda:N'; got {device!r}") from None
    if dev.type == "cpu":
        return dev
    if dev.type != "cuda":
        raise ValueError(f"device must be 'cpu', 'cuda' or 'cuda:N'; got {device!r} (no "
                         f"{dev.type} kernels)")
    if not getattr(_C, "built_with_cuda", False):
        raise ValueError(f"device {device!r}: this pyspec build has no CUDA kernels (rebuild with "
                         "PYSPEC_ENABLE_CUDA=ON on a machine with nvcc)")
    reason = _C.cuda_unavailable_reason()
    if reason:
        raise ValueError(f"device {device!r}: no usable CUDA device ({reason})")
    count = _C.cuda_device_count()
    index = 0 if dev.index is None else dev.index
    if not 0 <= index < count:
        raise ValueError(f"device {device!r}: there are {count} CUDA device(s)")
    if not torch.cuda.is_available():
        raise ValueError(f"device {device!r}: this torch build ({torch.__version__}) has no CUDA "
                         "support")
    return torch.device("cuda", index)


class LlamaWeights:
    """The weights of a Llama/Mistral/Qwen2 decoder: ``embed``, ``lm_head`` (tied to ``embed``
    where the config says so), ``norm`` and per layer a dict of ``ln1``, ``ln2``, ``wqkv`` (q, k,
    v fused), ``bqkv``, ``wo``, ``bo``, ``wgu`` (gate then up), ``wd``; packed codes beside them
    (``_packed``, ``_packed_lm_head``).

    Subclasses (the forward) say whether their dense-layer kernels read codes
    (:meth:`_reads_codes`) and drop whatever they built over the weights when
    :meth:`_weights_changed` is called (a weight was replaced, packed or moved).
    """

    def __init__(self, cfg: ModelConfig, weights: Dict[str, torch.Tensor], dtype: torch.dtype,
                 device: str = "cpu"):
        self.cfg = cfg
        self.dtype = dtype
        self.device = resolve_device(device)  # "cuda" -> "cuda:0": the device the KV pool gets
        # The embedding table, and lm_head's own matrix (None: tied to the table); the table is
        # None when only its codes are held (drop_dense: see the embed property).
        self._embed = weights.pop("model.embed_tokens.weight")
        lm = weights.pop("lm_head.weight", None)
        self._lm_head = None if cfg.tie_word_embeddings else lm
        self.norm = weights.pop("model.norm.weight")
        self.layers = []
        from pyspec.linear import PackedWeight, pack_exact

        def cat(parts):  # codes-only matrices (AWQ / GPTQ checkpoints) stack as codes
            if any(isinstance(t, PackedWeight) for t in parts):
                if all(isinstance(t, PackedWeight) and t.q.dtype == parts[0].q.dtype
                       for t in parts) and all(
                        (p.perm is None and parts[0].perm is None) or (
                            p.perm is not None and parts[0].perm is not None
                            and torch.equal(p.perm, parts[0].perm)) for p in parts):
                    return PackedWeight.cat_rows(parts)
                # Quantized and float matrices, codes of different formats (float16 and
                # bfloat16 values), or act-order column orders that differ, in one fused matrix:
                # codes when the fused values are exactly one format, else floats.
                fused = torch.cat([p.natural() if isinstance(p, PackedWeight) else p
                                   for p in parts], 0)
                packed = pack_exact(fused)
                if packed is not None:
                    return packed.drop_dense()
                warnings.warn("matrices fused into one (q/k/v, gate/up) differ in quantization "
                              "or act-order column order: that fused matrix is held as floats",
                              stacklevel=4)
                return fused.to(dtype)
            return torch.cat(parts, 0)

        for i in range(cfg.num_hidden_layers):
            p = f"model.layers.{i}."
            g = lambda n: weights.pop(p + n)  # noqa: E731
            wqkv = cat([g("self_attn.q_proj.weight"), g("self_attn.k_proj.weight"),
                        g("self_attn.v_proj.weight")])
            bqkv = None
            if cfg.attention_bias:
                bqkv = torch.cat([g("self_attn.q_proj.bias"), g("self_attn.k_proj.bias"),
                                  g("self_attn.v_proj.bias")], 0)
            self.layers.append(dict(
                ln1=g("input_layernorm.weight"), ln2=g("post_attention_layernorm.weight"),
                wqkv=wqkv, bqkv=bqkv, wo=g("self_attn.o_proj.weight"),
                bo=weights.pop(p + "self_attn.o_proj.bias", None),
                wgu=cat([g("mlp.gate_proj.weight"), g("mlp.up_proj.weight")]),
                wd=g("mlp.down_proj.weight")))
        if weights:
            raise ValueError(f"unused weights: {sorted(weights)[:5]}")
        self.source_path: Optional[str] = None  # the checkpoint folder, when loaded from one
        # Per layer, the dense matrices as pyspec.linear.PackedWeight where they are exactly a
        # 4-bit or 8-bit block format or 16-bit values (pack_weights), and the same for lm_head;
        # None: not packed.
        self._packed: Optional[list] = None
        self._packed_lm_head = None
        self.packed_weights = "auto"  # from_pretrained's setting (draft models loaded for it follow)
        self._codes_only = False  # some layer matrix is held as codes only (drop_dense)
        if any(isinstance(v, PackedWeight) for layer in self.layers for v in layer.values()):
            # A quantized checkpoint's matrices arrive as codes only (pyspec.models.quantized).
            self._packed = [{k: layer[k] for k in ("wqkv", "wo", "wgu", "wd")}
                            for layer in self.layers]
            self._codes_only = True
            if self.device.type == "cpu":
                self._codes_on_huge_pages()

    @property
    def embed(self) -> torch.Tensor:
        """The embedding table [vocab, hidden]. Where the model holds it only as codes (a tied
        table whose lm_head codes are exact, after :meth:`drop_dense`) this is a copy rebuilt
        for the caller, not kept: lookups go through :meth:`embed_rows`."""
        if self._embed is None:
            return self._packed_lm_head.unpack()
        return self._embed

    @embed.setter
    def embed(self, t: torch.Tensor) -> None:
        self._embed = t

    @property
    def tied(self) -> bool:
        """lm_head is the embedding table itself."""
        return self._lm_head is None

    @property
    def lm_head(self) -> torch.Tensor:
        """The output projection [vocab, hidden]: the embedding table itself where tied."""
        return self.embed if self._lm_head is None else self._lm_head

    @lm_head.setter
    def lm_head(self, t: torch.Tensor) -> None:
        if self._lm_head is None and t is self._embed:
            return  # (still tied)
        self._lm_head = t

    def embed_rows(self, ids: torch.Tensor) -> torch.Tensor:
        """The embeddings of token ids ``[T]`` as ``[T, hidden]``: rows of the table, or rebuilt
        from the codes alone where the table is held only as those (the same values bit for
        bit)."""
        if self._embed is not None:
            return F.embedding(ids, self._embed)
        p = self._packed_lm_head
        ids = ids.reshape(-1)
        pick = (lambda t: None if t is None else t.index_select(0, ids))  # noqa: E731
        out = torch.empty(ids.shape[0], p.shape[1], dtype=torch.float32)
        _C.unpack_packed(pick(p.q), pick(p.d), pick(p.m), out)
        return out

    def _reads_codes(self) -> bool:
        """Whether the forward's dense layers can read packed codes (subclasses decide)."""
        return False

    def _weights_changed(self) -> None:
        """A weight tensor was replaced, packed or moved (subclasses drop their views of them)."""

    def drop_dense(self) -> int:
        """Hold each packed decoder-layer matrix as its codes only (:meth:`pack_weights` first):
        the layer's entry becomes the :class:`~pyspec.linear.PackedWeight` and the float32 matrix
        is freed. Outputs stay the same bit for bit: the core kernel reads the codes at every row
        count it runs, and steps beyond it (long prefills) rebuild each matrix from its codes
        for the call (:meth:`PackedWeight.unpack`). An embedding table tied to lm_head whose
        codes are exact (the default model's 8-bit ones, a 16-bit checkpoint's values) is held as
        those codes alone too: lookups rebuild their rows (:meth:`embed_rows`), and :attr:`embed`
        rebuilds the table for a caller that asks. An untied lm_head keeps its float32 matrix.
        Returns how many matrices were dropped.
        Readers of ``layers[i][k]`` get a PackedWeight there: :meth:`layer_weight` gives the
        float32 matrix in either case."""
        from pyspec.linear import PackedWeight

        if self._packed is None:
            return 0
        count = 0
        for layer, lp in zip(self.layers, self._packed):
            for k, p in lp.items():
                if type(p) is PackedWeight and p.dense is not None:
                    p.drop_dense()
                    layer[k] = p
                    count += 1
        lm = self._packed_lm_head
        if (lm is not None and self.tied and self._embed is not None
                and lm.dense is self._embed and self.device.type == "cpu"):
            lm.drop_dense()
            self._embed = None
            count += 1
        if count:
            self._codes_only = True
            # The float32 matrices may share one huge-page mapping with the rest: copying the rest
            # into a new one (or, where none can be made, onto ordinary pages) lets it go.
            arena = self._huge_page_arena()
            self._rehome(arena.copy if arena is not None else torch.clone)
        return count

    def layer_weight(self, index: int, name: str) -> torch.Tensor:
        """Layer ``index``'s matrix ``name`` ("wqkv", "wo", "wgu", "wd") as a float32 tensor,
        rebuilt from its codes when the model holds only those (:meth:`drop_dense`)."""
        w = self.layers[index][name]
        return w if isinstance(w, torch.Tensor) else w.natural()

    def pack_weights(self) -> int:
        """Also hold each dense matrix (and lm_head) whose float32 values are exactly a 4-bit or
        8-bit block format or 16-bit floats (:func:`pyspec.linear.pack_exact`) as those codes,
        which the forward then reads for the few rows of decoding and verification: fewer bytes
        per step (4-bit 5.3x, 8-bit 3.6x, 16-bit 2x), the
        same results bit for bit (the codes rebuild each weight exactly and the kernel accumulates
        as the float32 one does). The float32 matrices stay (prefill, other devices, drafters
        that read them) unless :meth:`drop_dense` frees the layers' ones. Only float32 models on
        the CPU whose dense-layer kernels read codes (``_reads_codes``: the AVX2 or AVX-512
        float32 build); returns how many matrices were packed (0 otherwise)."""
        from pyspec.linear import pack_exact
        from pyspec.models.loader import return_freed_memory

        if (self.dtype != torch.float32 or self.device.type != "cpu"
                or not self._reads_codes()):
            return 0
        packed, new = [], []
        for layer in self.layers:
            lp = {}
            for k in ("wqkv", "wo", "wgu", "wd"):
                p = pack_exact(layer[k])
                lp[k] = layer[k] if p is None else p
                if p is not None:
                    new.append(p)
            packed.append(lp)
        # (A table held only as its codes keeps them: packing its rebuilt copy would hold both.)
        lm = self._packed_lm_head if self._embed is None else pack_exact(self.lm_head)
        if lm is not None and lm is not self._packed_lm_head:
            new.append(lm)
        if not new:
            return 0
        self._packed = packed
        self._packed_lm_head = lm
        self._weights_changed()
        # The packing's temporaries go back to the system before the codes are copied again.
        return_freed_memory()
        self._codes_on_huge_pages(new)
        return len(new)

    def _codes_on_huge_pages(self, ps: Optional[list] = None) -> None:
        """Copy the packed matrices' codes (``ps``; default every one) into one huge-page
        mapping (they stream every step, like the weights), where one can be made."""
        from pyspec.hugepages import Arena

        ps = self._packed_weights() if ps is None else ps
        arena = Arena.for_tensors([t for p in ps for t in (p.q, p.d, p.m) if t is not None])
        if arena is not None:
            for p in ps:
                p.q = arena.copy(p.q)
                p.d = None if p.d is None else arena.copy(p.d)  # (16-bit codes: no scales)
                p.m = None if p.m is None else arena.copy(p.m)

    def _packed_weights(self) -> list:
        """The PackedWeight objects the forward reads (layers, then lm_head)."""
        ps = [p for lp in (self._packed or []) for p in lp.values()
              if not isinstance(p, torch.Tensor)]
        return ps + ([self._packed_lm_head] if self._packed_lm_head is not None else [])

    @property
    def packed_bytes(self) -> int:
        """Bytes a decoding step reads for the packed matrices' codes (0 when none are packed)."""
        return sum(p.nbytes for p in self._packed_weights())

    def place_on_huge_pages(self) -> "LlamaWeights":
        """Move a CPU model's weights into one mapping on transparent huge pages (see
        :mod:`pyspec.hugepages`; the same values, fewer TLB misses while a step streams them), in
        place; returns self. Does nothing on a GPU, where huge pages are unavailable, or with
        ``PYSPEC_HUGEPAGES=0``. The weights then share one storage: clone one before saving it
        (``torch.save`` would write the whole mapping; safetensors refuses shared storage)."""
        if self.device.type != "cpu":
            return self
        arena = self._huge_page_arena()
        if arena is not None:
            self._rehome(arena.copy)
        return self

    def _huge_page_arena(self):
        """A huge-page mapping sized for every weight tensor the model holds (codes-only matrices
        have their own), or None where none can be made (see Arena.for_tensors)."""
        from pyspec.hugepages import Arena

        layer_ts = [t for layer in self.layers for t in layer.values()
                    if isinstance(t, torch.Tensor)]
        return Arena.for_tensors([t for t in (self._embed, self.norm, self._lm_head)
                                  if t is not None] + layer_ts)

    def _rehome(self, copy) -> None:
        """Replace every CPU weight tensor by ``copy(tensor)``, one at a time, so each source can
        go as soon as its copy exists: no decoder stack, packed matrix (its ``dense``) or
        unpacked entry of the packed layers may keep holding the old one."""
        self._weights_changed()
        # id(tensor) -> its other holders: PackedWeights (dense) and packed-layer dicts holding a
        # matrix that did not pack (the forward reads those dicts).
        owners: Dict[int, list] = {}
        for p in self._packed_weights():
            if p.dense is not None:
                owners.setdefault(id(p.dense), []).append((p, None))
        for lp in self._packed or []:
            for k, v in lp.items():
                if isinstance(v, torch.Tensor):
                    owners.setdefault(id(v), []).append((lp, k))

        def move(t):
            new = copy(t)
            for holder, k in owners.pop(id(t), ()):
                if k is None:
                    holder.dense = new
                else:
                    holder[k] = new
            return new

        if self._embed is not None:
            self._embed = move(self._embed)
        if self._lm_head is not None:
            self._lm_head = move(self._lm_head)
        self.norm = move(self.norm)
        for layer in self.layers:
            for k, t in layer.items():
                if isinstance(t, torch.Tensor):
                    layer[k] = move(t)

    def to(self, device) -> "LlamaWeights":
        """Move the weights to ``device`` (see :func:`resolve_device`), in place; returns self.
        KV pools and runners made before the move stay where they were: make them after."""
        dev = resolve_device(device)
        self._weights_changed()  # views of the old weights would keep them alive
        mv = lambda t: None if t is None else t.to(dev)  # noqa: E731

        from pyspec.triton_attention import available as triton_available

        # Codes-only matrices stay codes where a kernel reads them: the CPU's (codes on the
        # CPU), a GPU's with Triton (4-bit / 8-bit codes); else the matrices in the model's dtype.
        gpu_codes = dev.type == "cuda" and triton_available()

        def mv_layer(t):
            if t is None or isinstance(t, torch.Tensor):
                return mv(t)
            if dev.type == "cpu" and t.q.device.type == "cpu":
                return t
            if gpu_codes and t.bits in (4, 8):
                return t.to(dev)
            return t.natural().to(device=dev, dtype=self.dtype)

        if self._embed is None and dev.type != "cpu":
            self._embed = self.embed  # rebuilt from its codes: the device reads the table
        self._embed = mv(self._embed)
        self._lm_head = mv(self._lm_head)
        self.norm = mv(self.norm)
        self.layers = [{k: mv_layer(v) for k, v in layer.items()} for layer in self.layers]
        self.device = dev
        from pyspec.linear import PackedWeight

        coded = any(type(v) is PackedWeight for layer in self.layers for v in layer.values())
        off_device = any(p.q.device != dev for lp in (self._packed or []) for p in lp.values()
                         if type(p) is PackedWeight)
        if dev.type != "cpu" or off_device:  # the CPU kernel's packed copies of floats go
            self._packed_lm_head = None
            # Codes the layers still hold (a quantized checkpoint's, on a GPU with Triton).
            self._packed = [{k: layer[k] for k in ("wqkv", "wo", "wgu", "wd")}
                            for layer in self.layers] if coded else None
            self._codes_only = coded
        return self
