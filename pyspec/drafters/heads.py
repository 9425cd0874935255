"""Draft heads on the target's hidden states: Medusa (Cai et al. 2024) and EAGLE (Li et al. 2024).

On-disk format (a folder; :func:`save_heads` writes it, :func:`load_heads` reads it)::

    drafter.json          {"format": "pyspec-drafter", "format_version": 1,
                           "method": "eagle" | "medusa", "hidden_size": H, "vocab_size": V,
                           "eagle":  {"intermediate_size", "num_attention_heads",
                                      "num_key_value_heads", "head_dim",
                                      "draft_vocab_size": null | Vd,
                                      "feature_layers": null | [l_1, .., L],
                                      "layout": "eagle" | "eagle3",
                                      "fused_layers": [l_1, l_2, l_3] (eagle3),
                                      "input_layernorm": true, "final_norm": true,
                                      "feature": "hidden" | "normed_hidden"},
                           "medusa": {"num_heads": K, "tree": [[0], [1], [0, 0], ...]},
                           "defaults": {"width": .., "max_depth": .., "max_nodes": ..},
                           "manifest": {...free-form: version, target hash, recipe, report}}
    drafter.safetensors   EAGLE:  fc.weight [H, 2H] (fc.bias [H] optional), norm.weight [H],
                                  fuse.weight [H, K*H] with eagle.feature_layers (K layers),
                                  layer.{input_layernorm, post_attention_layernorm}.weight [H],
                                  layer.self_attn.{q,k,v,o}_proj.weight,
                                  layer.mlp.{gate,up,down}_proj.weight,
                                  optional lm_head.weight [Vd, H] + draft_vocab int64 [Vd]
                                  (a reduced draft vocabulary mapped back to target ids);
                                  otherwise the target's lm_head is used.
                          Medusa: heads.{k}.weight [H, H], heads.{k}.bias [H], k < K.

Published layouts (pyspec.drafters.published) load into the same drafter: EAGLE-1/2 heads with
no input norm, no final norm and features after the target's final norm (``input_layernorm``,
``final_norm``, ``feature``), EAGLE-3 heads (``layout: eagle3``: no fc over [embed; feature]; the
layer's attention reads ``[input_norm(embed); hidden_norm(feature)]`` with the feature as the
residual, ``layer.hidden_norm.weight``; the fuse reads ``fused_layers``, and the final layer is
tapped too for the engine).

EAGLE: one decoder layer over ``fc([embed(t_{p+1}); f_p])`` (f = the target's last hidden state
before the final norm, or with ``feature_layers`` EAGLE-3's ``fuse([h^{l_1}_p; ..; h^L_p])`` over
the outputs of those target layers) predicts ``f_{p+1}``; ``lm_head(norm(f))`` gives the
next-token draft distribution. Its KV (one layer) lives in a pool with the target's block
geometry, filled with the *true* target features of committed positions; tree nodes use
predicted features in scratch. Trees are EAGLE-2 dynamic trees (:mod:`pyspec.drafters.tree_builder`).

Medusa: head ``k`` maps the target's normed hidden state ``h`` at the last committed position to
``h + SiLU(W_k h + b_k)`` and the target's lm_head, proposing the token ``k + 2`` positions ahead
(the root is ``k = -1``, the target's own prediction). The tree is static: a choice list of
per-head rank paths (the Medusa paper's format), truncated to the step's node budget.
"""

from __future__ import annotations

import dataclasses
import math
import os
from typing import Dict, List, Optional, Sequence

import torch
import torch.nn.functional as F

from pyspec import TokenTree
from pyspec.drafters.base import Draft, Drafter, DraftRequest, PrefillChunk, Verified, slots_of
from pyspec.drafters.folder import (WEIGHTS_NAME, check_target, read_config, warn_target_hash,
                                    write_config)
from pyspec.drafters.tree_builder import TreeBuilder
from pyspec.ops import rms_norm
from pyspec.params import is_int
from pyspec.runner import ModelRunner, SeqStep

DEFAULT_MEDUSA_TREE = [[0], [1], [2], [0, 0], [0, 1], [1, 0], [0, 0, 0], [2, 0], [0, 2],
                       [1, 1], [0, 0, 1], [0, 1, 0], [0, 0, 0, 0]]
_LAYER_KEYS = ["input_layernorm.weight", "post_attention_layernorm.weight",
               "self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight",
               "self_attn.o_proj.weight", "mlp.gate_proj.weight", "mlp.up_proj.weight",
               "mlp.down_proj.weight"]


# ---------------------------------------------------------------------------------------------
# Files


def save_heads(path: str, method: str, tensors: Dict[str, torch.Tensor], config: dict) -> str:
    """Write a heads folder: ``drafter.safetensors`` and ``drafter.json`` (pyspec.drafters.folder)."""
    from safetensors.torch import save_file

    os.makedirs(path, exist_ok=True)
    save_file({k: v.contiguous() for k, v in tensors.items()}, os.path.join(path, WEIGHTS_NAME))
    write_config(path, method, config)
    return path


def read_heads(path: str, cfg: Optional[dict] = None):
    """A heads folder's drafter.json and weights (``cfg``: its drafter.json when the caller has
    read it already, e.g. to check the method before loading the weights)."""
    from safetensors.torch import load_file

    if cfg is None:
        cfg = read_config(path)
    w_path = os.path.join(path, WEIGHTS_NAME)
    if not os.path.isfile(w_path):
        raise ValueError(f"{path!r}: {WEIGHTS_NAME} is missing")
    try:
        return cfg, load_file(w_path)
    except Exception as e:  # noqa: BLE001 - safetensors' own error types
        raise ValueError(f"{w_path}: not a readable safetensors file ({type(e).__name__}: "
                         f"{e})") from None


def _shape(t: Dict[str, torch.Tensor], name: str, shape: Sequence[int]) -> torch.Tensor:
    if name not in t:
        raise ValueError(f"drafter weights lack {name!r}")
    if tuple(t[name].shape) != tuple(shape):
        raise ValueError(f"drafter weight {name!r} has shape {list(t[name].shape)}; expected "
                         f"{list(shape)}")
    return t[name]


# ---------------------------------------------------------------------------------------------
# Medusa


class MedusaDrafter(Drafter):
    name = "medusa"
    needs_hidden = True

    def __init__(self, target_runner: ModelRunner, weights: Dict[str, torch.Tensor], num_heads: int,
                 tree: Optional[List[List[int]]] = None, num_layers: int = 1):
        m = target_runner.model
        h = m.cfg.hidden_size
        if not isinstance(num_heads, int) or not 1 <= num_heads <= 16:
            raise ValueError(f"num_heads must be an int in [1, 16]; got {num_heads!r}")
        if not isinstance(num_layers, int) or not 1 <= num_layers <= 8:
            raise ValueError(f"num_layers must be an int in [1, 8]; got {num_layers!r}")
        self.target = m
        # The heads run where the target does (a GPU target's hidden states stay there), on the
        # target's own final norm and lm_head.
        self.device = m.device
        self.norm_w = m.norm
        self.lm_head = m.lm_head
        # Residual blocks per head: [layer][head] weights (pyspec's own single-block heads are
        # named heads.{k}.weight/bias; published ones heads.{k}.{j}.weight/bias).
        def block(k, j, part, shape):
            name = (f"heads.{k}.{part}" if num_layers == 1 and f"heads.{k}.{part}" in weights
                    else f"heads.{k}.{j}.{part}")
            return _shape(weights, name, shape)

        place = dict(device=m.device, dtype=m.dtype)
        self.w = [torch.stack([block(k, j, "weight", (h, h)) for k in range(num_heads)]).to(**place)
                  for j in range(num_layers)]
        self.b = [torch.stack([block(k, j, "bias", (h,)) for k in range(num_heads)]).to(**place)
                  for j in range(num_layers)]
        # Each head's own projection to the vocabulary (the published Medusa layout), or the
        # target's lm_head for all (pyspec's own heads).
        self.head_lm = None
        if any(f"heads.{k}.lm_head.weight" in weights for k in range(num_heads)):
            self.head_lm = [_shape(weights, f"heads.{k}.lm_head.weight",
                                   (m.cfg.vocab_size, h)).to(**place) for k in range(num_heads)]
        # The default tree cut to the heads there are (its paths' prefixes stay in it).
        vocab = m.cfg.vocab_size
        if tree is not None and (not isinstance(tree, (list, tuple)) or not all(
                isinstance(p, (list, tuple)) and all(is_int(r) for r in p) for p in tree)):
            raise ValueError(f"a Medusa tree is a list of paths, each a list of int ranks (one "
                             f"per head, 0 = the head's top token); got {str(tree)[:200]}")
        tree = [list(p) for p in (tree or [q for q in DEFAULT_MEDUSA_TREE
                                           if len(q) <= num_heads])]
        if any(len(p) > num_heads or len(p) == 0 for p in tree):
            raise ValueError(f"every Medusa tree path needs 1..{num_heads} ranks (one per head)")
        bad = [r for p in tree for r in p if not 0 <= r < vocab]
        if bad:
            raise ValueError(f"Medusa tree rank {bad[0]} is out of range: a rank picks one of a "
                             f"head's top tokens, 0..{vocab - 1} for this {vocab}-token target")
        self.paths = sorted(tree, key=lambda p: (len(p), p))
        TokenTree.from_paths(self.paths)  # validates closure
        self.num_heads = num_heads
        self.max_rank = max(max(p) for p in self.paths) + 1
        self._last: Dict[int, torch.Tensor] = {}  # request -> hidden of its last committed token

    @property
    def max_draft_depth(self) -> int:
        return max(len(p) for p in self.paths)

    def node_budget(self, depth: int) -> int:
        return sum(1 for p in self.paths if len(p) <= depth)

    def prefill(self, chunks: List[PrefillChunk]) -> None:
        for c in chunks:
            self._last[c.request_id] = c.hidden[-1]

    def observe(self, results: List[Verified]) -> None:
        for v in results:
            self._last[v.request_id] = v.hidden[-1]

    def release(self, request_id: int) -> None:
        self._last.pop(request_id, None)

    @torch.inference_mode()
    def propose(self, reqs: List[DraftRequest]) -> List[Draft]:
        have = [r for r in reqs if r.request_id in self._last]
        ranked = {}
        if have:
            m = self.target
            h = rms_norm(torch.stack([self._last[r.request_id] for r in have]).to(self.device),
                         self.norm_w, m.cfg.rms_norm_eps)  # [B, H]
            hk = h[:, None, :].expand(-1, self.num_heads, -1)  # [B, K, H]
            for w, b in zip(self.w, self.b):
                hk = hk + F.silu(torch.einsum("bkh,koh->bko", hk, w) + b)
            if self.head_lm is None:
                logits = m.linear(hk.reshape(-1, h.shape[-1]), self.lm_head).float()
            else:
                logits = torch.stack([m.linear(hk[:, k].contiguous(), lm).float()
                                      for k, lm in enumerate(self.head_lm)], 1).flatten(0, 1)
            top = logits.topk(self.max_rank, dim=-1).indices.view(len(have), self.num_heads, -1)
            for r, t in zip(have, top.tolist()):
                ranked[r.request_id] = t
        out = []
        for r in reqs:
            t = ranked.get(r.request_id)
            if t is None:
                out.append(Draft([int(r.context[-1])], [-1]))
                continue
            paths = [q for q in self.paths if len(q) <= r.depth_limit][:r.budget]
            where = {(): 0}
            tokens, parents = [int(r.context[-1])], [-1]
            for p in paths:
                where[tuple(p)] = len(tokens)
                parents.append(where[tuple(p[:-1])])
                tokens.append(int(t[len(p) - 1][p[-1]]))
            out.append(Draft(tokens, parents))
        return out

    @staticmethod
    def random_weights(hidden_size: int, num_heads: int, seed: int = 0, scale: float = 0.02):
        g = torch.Generator().manual_seed(seed)
        t = {}
        for k in range(num_heads):
            t[f"heads.{k}.weight"] = scale * torch.randn(hidden_size, hidden_size, generator=g)
            t[f"heads.{k}.bias"] = torch.zeros(hidden_size)
        return t

    def describe(self) -> str:
        blocks = f", {len(self.w)} blocks each" if len(self.w) > 1 else ""
        own = ", own projections" if self.head_lm is not None else ""
        return (f"medusa ({self.num_heads} heads{blocks}{own}, static tree of "
                f"{len(self.paths)} nodes)")


# ---------------------------------------------------------------------------------------------
# EAGLE


class EagleDrafter(Drafter):
    name = "eagle"
    needs_hidden = True

    def __init__(self, target_runner: ModelRunner, weights: Dict[str, torch.Tensor],
                 head_cfg: dict, *, width: int = 4, max_depth: int = 5, max_nodes: int = 24):
        from pyspec.models.llama import LlamaForCausalLM

        tm = target_runner.model
        tc = tm.cfg
        h = tc.hidden_size
        self.device = tm.device
        place = dict(device=tm.device, dtype=tm.dtype)
        for name, v, lo, hi in (("width", width, 1, 16), ("max_depth", max_depth, 1, 32),
                                ("max_nodes", max_nodes, 1, 255)):
            if not isinstance(v, int) or not lo <= v <= hi:
                raise ValueError(f"{name} must be an int in [{lo}, {hi}]; got {v!r}")
        self.width, self.max_depth, self.max_nodes = width, max_depth, max_nodes
        inter = int(head_cfg.get("intermediate_size", tc.intermediate_size))
        nh = int(head_cfg.get("num_attention_heads", tc.num_attention_heads))
        nkv = int(head_cfg.get("num_key_value_heads", tc.num_key_value_heads))
        hd = int(head_cfg.get("head_dim", tc.head_dim))
        cfg = dataclasses.replace(tc, num_hidden_layers=1, intermediate_size=inter,
                                  num_attention_heads=nh, num_key_value_heads=nkv, head_dim=hd,
                                  tie_word_embeddings=False, attention_bias=False)
        layout = head_cfg.get("layout", "eagle")
        if layout not in ("eagle", "eagle3"):
            raise ValueError(f"eagle layout must be 'eagle' or 'eagle3'; got {layout!r}")
        # EAGLE-3 (Li et al. 2025) as published: fuse([h^{l_1}; h^{l_2}; h^{l_3}]) is the feature,
        # the layer reads [input_norm(embed); hidden_norm(feature)] (2H wide) with the feature as
        # its residual, and no fc over [embed; feature].
        self.eagle3 = layout == "eagle3"
        layers = head_cfg.get("feature_layers")
        self.fuse_w = None
        self.fuse_cols = 0  # leading feature columns the fuse reads (EAGLE-3: not the final layer)
        if self.eagle3:
            from pyspec.models.llama import feature_layers, hidden_layers

            fused = hidden_layers(head_cfg.get("fused_layers") or (), tc.num_hidden_layers) \
                if head_cfg.get("fused_layers") else None
            if not fused or len(fused) < 2 or list(fused) != sorted(fused):
                raise ValueError("an EAGLE-3 head needs fused_layers: >= 2 ascending target "
                                 f"layer numbers; got {head_cfg.get('fused_layers')!r}")
            # The engine taps the final layer too (the target's own distribution comes from it).
            self.hidden_layers = feature_layers(
                fused + (() if fused[-1] == tc.num_hidden_layers else (tc.num_hidden_layers,)),
                tc.num_hidden_layers)
            self.fuse_cols = len(fused) * h
            self.fuse_w = _shape(weights, "fuse.weight", (h, self.fuse_cols)).to(**place)
        elif layers:
            from pyspec.models.llama import feature_layers

            layers = feature_layers(layers, tc.num_hidden_layers)
            if len(layers) > 1:
                self.hidden_layers = layers
                self.fuse_w = _shape(weights, "fuse.weight", (h, len(layers) * h)).to(**place)
        if self.fuse_w is None and "fuse.weight" in weights:
            raise ValueError("the drafter has fuse.weight but its config names no eagle "
                             "feature_layers (the target layers it was trained on)")
        self.fc_w = self.fc_b = None
        if self.eagle3:
            if "fc.weight" in weights:
                raise ValueError("an EAGLE-3 head has no fc over [embed; feature] (its fc is the "
                                 "fuse of the target's layers: fuse.weight)")
        else:
            self.fc_w = _shape(weights, "fc.weight", (h, 2 * h)).to(**place)
            self.fc_b = weights.get("fc.bias")
            if self.fc_b is not None:
                self.fc_b = _shape(weights, "fc.bias", (h,)).to(**place)
        self.vocab_map = None
        # The head runs where the target does (a GPU target's hidden states stay there), on the
        # target's embedding and lm_head (a CPU target holding its tied table only as codes: the
        # head holds the rebuilt table).
        self.embed_w = tm.embed
        lm_head = self.embed_w if tm.tied else tm.lm_head
        if "lm_head.weight" in weights:
            if "draft_vocab" not in weights:
                raise ValueError("a drafter with its own lm_head.weight needs draft_vocab (its "
                                 "rows' target token ids)")
            dv = weights["draft_vocab"].to(torch.int64)
            if dv.dim() != 1 or bool((dv < 0).any()) or bool((dv >= tc.vocab_size).any()):
                raise ValueError(f"draft_vocab must be 1-D target ids in [0, {tc.vocab_size})")
            lm_head = _shape(weights, "lm_head.weight", (dv.numel(), h)).to(**place)
            self.vocab_map = dv
        # EAGLE-1/2 as published: no input norm in the layer, no final norm (the head predicts
        # the target's *normed* last hidden state, which goes straight to its lm_head), and
        # features read after the target's final norm.
        for key in ("input_layernorm", "final_norm"):
            if not isinstance(head_cfg.get(key, True), bool):
                raise ValueError(f"eagle {key} must be true or false; got {head_cfg[key]!r}")
        feature = head_cfg.get("feature", "hidden")
        if feature not in ("hidden", "normed_hidden"):
            raise ValueError(f"eagle feature must be 'hidden' or 'normed_hidden'; got {feature!r}")
        if feature == "normed_hidden" and (layers or self.eagle3):
            raise ValueError("eagle feature 'normed_hidden' reads the last layer only; it cannot "
                             "go with feature_layers")
        self.feature_norm = tm.norm if feature == "normed_hidden" else None
        w = {"model.embed_tokens.weight": self.embed_w, "lm_head.weight": lm_head,
             "model.norm.weight": (_shape(weights, "norm.weight", (h,)).to(**place)
                                   if head_cfg.get("final_norm", True) else None)}
        win = 2 * h if self.eagle3 else h  # the attention's input width
        shapes = {"input_layernorm.weight": (h,), "post_attention_layernorm.weight": (h,),
                  "self_attn.q_proj.weight": (nh * hd, win),
                  "self_attn.k_proj.weight": (nkv * hd, win),
                  "self_attn.v_proj.weight": (nkv * hd, win), "self_attn.o_proj.weight": (h, nh * hd),
                  "mlp.gate_proj.weight": (inter, h), "mlp.up_proj.weight": (inter, h),
                  "mlp.down_proj.weight": (h, inter)}
        if not head_cfg.get("input_layernorm", True):
            del shapes["input_layernorm.weight"]
            w["model.layers.0.input_layernorm.weight"] = None
        for k, s in shapes.items():
            w["model.layers.0." + k] = _shape(weights, "layer." + k, s).to(**place)
        # The target's dense kernels (its LinearKernels), for the head's layers and its own
        # matrices (fc, fuse) alike.
        self.head = LlamaForCausalLM(cfg, w, tm.dtype, tm.device,
                                     kernels=getattr(tm, "kernels", None))
        if self.eagle3:
            self.head.layers[0]["ln_hidden"] = _shape(weights, "layer.hidden_norm.weight",
                                                      (h,)).to(**place)
        self.target = tm
        self.vocab_size = tc.vocab_size
        self.block_size = target_runner.block_size
        self.runner = ModelRunner(self.head, target_runner.kv.num_blocks, self.block_size)
        # Per request: entries (f_p, t_{p+1}) for positions dc .. not yet in the head's pages.
        self._dc: Dict[int, int] = {}
        self._feat: Dict[int, List[torch.Tensor]] = {}
        self._next: Dict[int, List[int]] = {}

    def kv_pools(self) -> list:
        return [self.runner.kv]

    @property
    def max_draft_depth(self) -> int:
        return self.max_depth

    def node_budget(self, depth: int) -> int:
        # The node budget shrinks with the allowed depth in proportion (EAGLE-2 trees are about
        # as wide at every level).
        return min(self.max_nodes, max(depth, round(self.max_nodes * depth / self.max_depth)))

    def _push(self, rid: int, start: int, feats: torch.Tensor, next_tokens: Sequence[int]) -> None:
        feats = feats.to(self.device)
        if self.feature_norm is not None:
            feats = rms_norm(feats.contiguous(), self.feature_norm, self.target.cfg.rms_norm_eps)
        if self.fuse_w is not None:  # the target's layers fused into one feature (EAGLE-3)
            if self.fuse_cols:
                feats = feats[:, :self.fuse_cols]
            feats = self.head.linear(feats.to(self.fuse_w.dtype).contiguous(), self.fuse_w)
        dc = self._dc.get(rid)
        have = len(self._feat.get(rid, ()))
        if dc is None or dc + have != start:  # first chunk, or a gap (e.g. after a cache hit)
            self._dc[rid] = start
            self._feat[rid], self._next[rid] = [], []
        self._feat[rid].extend(feats.unbind(0))
        self._next[rid].extend(int(t) for t in next_tokens)

    @torch.inference_mode()
    def prefill(self, chunks: List[PrefillChunk]) -> None:
        for c in chunks:
            n = len(c.tokens)
            nxt = list(c.context[c.start + 1:c.start + n + 1])
            if len(nxt) < n:  # nothing follows the last prompt token yet
                n = len(nxt)
            self._push(c.request_id, c.start, c.hidden[:n], nxt)
        # The prompt's head KV is written now, not at the first draft: its full blocks may be
        # shared through the prefix cache (another request then reads these pages), and a request
        # whose first steps another drafter serves (``ngram|HEAD``) may never draft with the head.
        self._flush([(c.request_id, c.block_table) for c in chunks])

    def _flush(self, items) -> None:
        """Write the head KV of every pending entry but the last (which the next draft runs as its
        root entry) of each (request id, block table), in one causal step."""
        seqs, embeds, dst, done = [], [], [], []
        for rid, table in dict(items).items():
            dc, feats, nxt = self._dc.get(rid), self._feat.get(rid, []), self._next.get(rid, [])
            m = len(feats) - 1
            if dc is None or m < 1:
                continue
            embeds.append(self._embed(nxt[:m], torch.stack(feats[:m])))
            seqs.append(SeqStep(nxt[:m], dc, table, None, "none"))
            dst.extend(slots_of(table, self.block_size, dc, m))
            done.append((rid, m))
        if not seqs:
            return
        res = self.runner.step(seqs, inputs_embeds=torch.cat(embeds))
        self.runner.commit_kv(res, 0, range(len(dst)), dst)
        for rid, m in done:  # the state moves only once the KV is written
            self._dc[rid] += m
            self._feat[rid] = self._feat[rid][m:]
            self._next[rid] = self._next[rid][m:]

    def observe(self, results: List[Verified]) -> None:
        for v in results:
            self._push(v.request_id, v.start, v.hidden, v.emitted)

    def release(self, request_id: int) -> None:
        for d in (self._dc, self._feat, self._next):
            d.pop(request_id, None)

    def _embed(self, tokens: List[int], feats: torch.Tensor) -> torch.Tensor:
        e = F.embedding(torch.tensor(tokens, dtype=torch.int64).to(self.device), self.embed_w)
        if self.eagle3:  # the layer norms both halves itself
            return torch.cat([e, feats.to(e.dtype)], dim=-1)
        # The core's dense kernel, like every layer of the head: torch's GEMM here would wake
        # its own thread team while the core's workers still poll for their next job.
        return self.head.linear(torch.cat([e, feats.to(e.dtype)], dim=-1), self.fc_w, self.fc_b)

    @torch.inference_mode()
    def propose(self, reqs: List[DraftRequest]) -> List[Draft]:
        out: List[Optional[Draft]] = [None] * len(reqs)
        work = []  # (index, builder, pending entries excluding the root entry)
        for i, r in enumerate(reqs):
            rid = r.request_id
            dc, feats, nxt = self._dc.get(rid), self._feat.get(rid, []), self._next.get(rid, [])
            # The root entry is (f_{start-1}, root): entries must reach start - 1.
            if dc is None or r.start < 1 or dc + len(feats) != r.start or \
                    not feats or nxt[-1] != int(r.context[-1]):
                out[i] = Draft([int(r.context[-1])], [-1])
                continue
            depth = min(r.depth_limit, self.max_depth)
            b = TreeBuilder(int(r.context[-1]), width=self.width, depth=depth,
                            budget=min(r.budget, self.max_nodes), sample=False,
                            vocab_map=self.vocab_map)
            work.append((i, b, len(feats) - 1))
        # Long catch-ups (after a run of steps another drafter or plain decoding served) run
        # first as one causal chunk: a tree's depth is bounded, and those entries need only KV.
        long_ = [k for k, (_, _, m) in enumerate(work) if m > 16]
        if long_:
            self._flush([(reqs[work[k][0]].request_id, reqs[work[k][0]].block_table)
                         for k in long_])
            for k in long_:
                i, b, _ = work[k]
                work[k] = (i, b, len(self._feat[reqs[i].request_id]) - 1)
        first = True
        fhat: Dict[int, Dict[int, torch.Tensor]] = {i: {} for i, _, _ in work}
        while True:
            active = [(i, b, m) for i, b, m in work if not b.done]
            if not active:
                break
            seqs, embeds = [], []
            for i, b, m in active:
                r = reqs[i]
                rid = r.request_id
                mm = m if first else 0
                feats = self._feat[rid]
                run = b.run
                # Pending entries (committed, true features), then the root entry, then nodes
                # whose inputs are their parents' predicted features.
                ent_tok = self._next[rid][len(feats) - 1 - mm:]
                ent_feat = torch.stack(feats[len(feats) - 1 - mm:])
                node_feat = [fhat[i][b.parents[n]] for n in run[1:]]
                toks = ent_tok + [b.tokens[n] for n in run[1:]]
                x = ent_feat if not node_feat else torch.cat([ent_feat, torch.stack(node_feat)
                                                              .to(self.device)])
                embeds.append(self._embed(toks, x))
                parents = list(range(-1, mm)) + [p + mm for p in b.run_parents()[1:]]
                seqs.append(SeqStep(toks, r.start - 1 - mm, r.block_table, TokenTree(parents),
                                    "all"))
            res = self.runner.step(seqs, return_hidden=True, inputs_embeds=torch.cat(embeds))
            if first:
                src, dst = [], []
                for j, (i, b, m) in enumerate(active):
                    r = reqs[i]
                    base = res.row_indptr[j]
                    src.extend(range(base, base + m + 1))
                    dst.extend(slots_of(r.block_table, self.block_size, r.start - 1 - m, m + 1))
                    rid = r.request_id
                    self._dc[rid] = r.start
                    self._feat[rid] = self._feat[rid][-1:]  # the root entry stays for next levels
                    self._next[rid] = self._next[rid][-1:]
                self.runner.commit_kv(res, 0, src, dst)
            for j, (i, b, m) in enumerate(active):
                mm = m if first else 0
                base = res.row_indptr[j]
                for k, n in enumerate(b.run):
                    fhat[i][n] = res.hidden[base + mm + k]
                rows = torch.tensor([mm + k for k in b.frontier_rows()], dtype=torch.int64)
                # (The head's logits come to the host: the tree is built there.)
                b.expand(torch.softmax(res.logits_of(j).index_select(0, rows), dim=-1))
            first = False
        for i, b, _ in work:
            out[i] = b.draft(self.vocab_size)
        for i, _, _ in work:
            # The root entry was written to the pages: keep only what follows it.
            rid = reqs[i].request_id
            self._feat[rid], self._next[rid] = [], []
        return out

    @staticmethod
    def random_weights(target_cfg, seed: int = 0, intermediate_size: Optional[int] = None,
                       draft_vocab: Optional[torch.Tensor] = None,
                       num_feature_layers: int = 1) -> Dict[str, torch.Tensor]:
        g = torch.Generator().manual_seed(seed)
        h = target_cfg.hidden_size
        inter = intermediate_size or target_cfg.intermediate_size
        qs = target_cfg.num_attention_heads * target_cfg.head_dim
        kv = target_cfg.num_key_value_heads * target_cfg.head_dim

        def mat(o, i):
            return torch.randn(o, i, generator=g) / math.sqrt(i)

        t = {"fc.weight": mat(h, 2 * h), "norm.weight": torch.ones(h),
             "layer.input_layernorm.weight": torch.ones(h),
             "layer.post_attention_layernorm.weight": torch.ones(h),
             "layer.self_attn.q_proj.weight": mat(qs, h), "layer.self_attn.k_proj.weight": mat(kv, h),
             "layer.self_attn.v_proj.weight": mat(kv, h), "layer.self_attn.o_proj.weight": mat(h, qs),
             "layer.mlp.gate_proj.weight": mat(inter, h), "layer.mlp.up_proj.weight": mat(inter, h),
             "layer.mlp.down_proj.weight": mat(h, inter)}
        if draft_vocab is not None:
            t["draft_vocab"] = draft_vocab.to(torch.int64)
            t["lm_head.weight"] = mat(draft_vocab.numel(), h)
        if num_feature_layers > 1:
            t["fuse.weight"] = mat(h, num_feature_layers * h)
        return t

    def describe(self) -> str:
        fused = (f"reads target layers {','.join(map(str, self.hidden_layers))}, "
                 if self.hidden_layers else "")
        return (f"eagle (1-layer head, {fused}dynamic tree: width {self.width}, "
                f"depth {self.max_depth}, "
                f"<= {self.max_nodes} nodes)")


def load_heads(path: str, target_runner: ModelRunner, **overrides) -> Drafter:
    """Load a Medusa/EAGLE drafter folder against a target (shape mismatches are errors)."""
    cfg = read_config(path)
    if cfg["method"] not in ("eagle", "medusa"):
        raise ValueError(f"{path!r} holds a {cfg['method']!r} drafter, not EAGLE or Medusa heads")
    cfg, tensors = read_heads(path, cfg)
    check_target(cfg, target_runner.model.cfg)
    defaults = dict(cfg.get("defaults") or {})
    if cfg["method"] == "medusa":
        if any(k in overrides for k in ("width", "max_depth", "max_nodes")):
            raise ValueError("width/depth/nodes options apply to EAGLE drafters; a Medusa tree "
                             "comes from its choice list")
        mc = cfg.get("medusa") or {}
        if not isinstance(mc, dict) or not is_int(mc.get("num_heads")):
            raise ValueError(f"{os.path.join(path, 'drafter.json')}: 'medusa' must be an object "
                             f"with an int 'num_heads' (1..16); got {str(mc)[:200]}")
        d = MedusaDrafter(target_runner, tensors, int(mc["num_heads"]),
                          overrides.pop("tree", None) or mc.get("tree"))
    else:
        defaults.update({k: v for k, v in overrides.items() if v is not None})
        allowed = {"width", "max_depth", "max_nodes"}
        d = EagleDrafter(target_runner, tensors, cfg.get("eagle") or {},
                         **{k: v for k, v in defaults.items() if k in allowed})
    d.manifest = cfg.get("manifest") or {}
    d.path = path
    warn_target_hash(d, path, target_runner)
    return d
