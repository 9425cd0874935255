"""4-bit AWQ and GPTQ checkpoints, read as the block codes pyspec's packed kernel decodes from:
the layers' matrices are never held as floats (memory close to the 4-bit size).

Layouts (safetensors, ``quantization_config`` in config.json, or GPTQ's ``quantize_config.json``),
for a linear layer with K inputs, N outputs and groups of G inputs (``group_size``; -1: one
group of K):

* **AWQ** (``quant_method: awq``, ``version: gemm``, ``zero_point: true``): ``qweight`` int32
  ``[K, N/8]`` (nibble i of word c holds output column ``8c + [0, 2, 4, 6, 1, 3, 5, 7][i]``),
  ``qzeros`` int32 ``[K/G, N/8]`` (the same packing), ``scales`` ``[K/G, N]``;
  ``w[n, k] = (q[k, n] - z[k // G, n]) * s[k // G, n]``.
* **GPTQ** (``quant_method: gptq``; AutoGPTQ / optimum layout): ``qweight`` int32 ``[K/8, N]``
  (nibble j of word r holds input row ``8r + j``), ``qzeros`` int32 ``[K/G, N/8]`` (nibble j of
  word c: column ``8c + j``; stored as zero - 1 unless ``checkpoint_format: gptq_v2``, read
  back as stored + 1 without wrapping, as AutoGPTQ's kernels read it),
  ``scales`` ``[K/G, N]``, ``g_idx`` int32 ``[K]`` (each input's group; not ``k // G`` with
  act-order, ``desc_act``); ``w[n, k] = (q[k, n] - z[g_idx[k], n]) * s[g_idx[k], n]``.

Both become :class:`~pyspec.linear.PackedWeight` codes (4-bit, 32-column blocks: ``w = d * q + m``
with ``d = s`` and ``m = -z * s``, exact in float32 for 16-bit scales). With act-order the
columns are stored sorted by group (``PackedWeight.perm``) and the input is gathered to match.
"""

from __future__ import annotations

import json
import os
import warnings
from typing import Dict, Iterable, Optional, Tuple

import torch

__all__ = ["quantization_config", "quantized_tensors"]

_AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)
_PARTS = ("qweight", "qzeros", "scales", "g_idx")


def quantization_config(path: str) -> Optional[dict]:
    """The checkpoint's 4-bit quantization, normalized: ``{"method": "awq" | "gptq",
    "group_size": G (-1: one group), "zero_plus_one": bool (GPTQ's stored zero - 1)}``, or None
    for a float checkpoint. Anything pyspec cannot read is a ValueError naming the key."""
    cfg_file = os.path.join(path, "config.json")
    qc, where = None, cfg_file
    if os.path.isfile(cfg_file):
        with open(cfg_file, "rb") as f:
            try:
                qc = json.loads(f.read().decode("utf-8")).get("quantization_config")
            except (UnicodeDecodeError, json.JSONDecodeError, AttributeError):
                qc = None  # the config's own loader reports a bad config.json
    # Older side files: AutoGPTQ's quantize_config.json, AutoAWQ's quant_config.json.
    for side, default in (("quantize_config.json", "gptq"), ("quant_config.json", "awq")):
        file = os.path.join(path, side)
        if qc is None and os.path.isfile(file):
            with open(file, "rb") as f:
                try:
                    qc = json.loads(f.read().decode("utf-8"))
                except (UnicodeDecodeError, json.JSONDecodeError) as e:
                    raise ValueError(f"{file}: not valid UTF-8 JSON ({e})") from None
            if not isinstance(qc, dict):
                raise ValueError(f"{file}: must hold a JSON object")
            where = file
            qc = dict(qc, quant_method=qc.get("quant_method", default))
    if qc is None:
        return None
    if not isinstance(qc, dict):
        raise ValueError(f"{where}: quantization_config must be an object")
    method = str(qc.get("quant_method", "")).lower()
    if method not in ("awq", "gptq"):
        # Often a leftover in a merged float checkpoint: load the floats; a checkpoint that does
        # hold another method's tensors fails on them, by name.
        warnings.warn(f"{where}: quant_method {qc.get('quant_method')!r} is not one pyspec reads "
                      "(4-bit awq and gptq); loading the checkpoint as floats", stacklevel=3)
        return None
    bits = qc.get("bits", qc.get("w_bit"))
    if bits != 4:
        raise ValueError(f"{where}: {method} with {bits} bits is not supported (4 only)")
    g = qc.get("group_size", qc.get("q_group_size"))
    if isinstance(g, bool) or not isinstance(g, int) or not (g == -1 or (g > 0 and g % 32 == 0)):
        raise ValueError(f"{where}: group_size must be -1 or a positive multiple of 32 (the "
                         f"packed kernel's block); got {g!r}")
    out = {"method": method, "group_size": g, "zero_plus_one": False}
    if method == "awq":
        version = str(qc.get("version", "gemm")).lower()
        if version != "gemm":
            raise ValueError(f"{where}: AWQ version {version!r} is not supported (gemm only)")
        if qc.get("zero_point", True) is not True:
            raise ValueError(f"{where}: AWQ without zero points is not supported")
    else:
        fmt = str(qc.get("checkpoint_format", "gptq")).lower()
        if fmt not in ("gptq", "gptq_v2"):
            raise ValueError(f"{where}: GPTQ checkpoint_format {fmt!r} is not supported (gptq, "
                             "gptq_v2)")
        out["zero_plus_one"] = fmt == "gptq"
        # Act-order: each input's group is in g_idx, not k // G; a file without it is refused.
        out["act_order"] = qc.get("desc_act") is True
    return out


def _nibbles(words: torch.Tensor) -> torch.Tensor:
    """int32 ``[..., W]`` -> uint8 ``[..., W, 8]``: nibble j (bits 4j..4j+3) of each word."""
    shifts = torch.arange(0, 32, 4, dtype=torch.int32)
    return ((words.unsqueeze(-1) >> shifts) & 0xF).to(torch.uint8)


def _codes(name: str, parts: Dict[str, torch.Tensor], qc: dict):
    """(codes uint8 [N, K], zeros [groups, N], scales float32 [groups, N], g_idx [K]) of one
    quantized linear layer ``name``."""
    for k in ("qweight", "qzeros", "scales"):
        if k not in parts:
            raise ValueError(f"quantized layer {name!r} lacks {name}.{k}")
    qw, qz, sc = parts["qweight"], parts["qzeros"], parts["scales"]
    for k, t in (("qweight", qw), ("qzeros", qz)):
        if t.dtype != torch.int32 or t.dim() != 2:
            raise ValueError(f"{name}.{k} must be a 2-D int32 tensor; got {t.dtype} "
                             f"{list(t.shape)}")
    if not sc.is_floating_point() or sc.dim() != 2:
        raise ValueError(f"{name}.scales must be a 2-D float tensor; got {sc.dtype} "
                         f"{list(sc.shape)}")
    if qc["method"] == "awq":
        k, n = qw.shape[0], qw.shape[1] * 8
        codes = torch.empty(k, n // 8, 8, dtype=torch.uint8)
        codes[:, :, list(_AWQ_ORDER)] = _nibbles(qw)
        codes = codes.view(k, n)
        zeros = torch.empty(qz.shape[0], n // 8, 8, dtype=torch.uint8)
        if qz.shape[1] * 8 != n:
            raise ValueError(f"{name}.qzeros has shape {list(qz.shape)}; expected "
                             f"[groups, {n // 8}] for qweight {list(qw.shape)}")
        zeros[:, :, list(_AWQ_ORDER)] = _nibbles(qz)
        zeros = zeros.view(qz.shape[0], n)
        g_idx = None
    else:
        k, n = qw.shape[0] * 8, qw.shape[1]
        codes = _nibbles(qw.t().contiguous()).view(n, k).t()  # [K, N]
        if qz.shape[1] * 8 != n:
            raise ValueError(f"{name}.qzeros has shape {list(qz.shape)}; expected "
                             f"[groups, {n // 8}] for qweight {list(qw.shape)}")
        zeros = _nibbles(qz).view(qz.shape[0], n)
        g_idx = parts.get("g_idx")
        if g_idx is None and qc.get("act_order"):
            raise ValueError(f"quantized layer {name!r} lacks {name}.g_idx, which its "
                             f"quantization config's desc_act (act-order) requires: each input's "
                             f"group is read from it")
    if k == 0 or n == 0:
        raise ValueError(f"{name}.qweight has shape {list(qw.shape)}: no inputs or outputs")
    g = qc["group_size"] if qc["group_size"] != -1 else k
    groups = k // g
    if k % g or k % 32:
        raise ValueError(f"quantized layer {name!r}: {k} inputs are not a multiple of the group "
                         f"size {g} and of 32")
    for t, what in ((zeros, "qzeros"), (sc, "scales")):
        if t.shape != (groups, n):
            raise ValueError(f"{name}.{what} holds {list(t.shape)} values; expected "
                             f"[{groups}, {n}] for {k} inputs in groups of {g}")
    zeros = zeros.to(torch.int32) + (1 if qc["zero_plus_one"] else 0)
    if g_idx is not None:
        if g_idx.shape != (k,) or g_idx.dtype not in (torch.int32, torch.int64) or \
                bool((g_idx < 0).any()) or bool((g_idx >= groups).any()):
            raise ValueError(f"{name}.g_idx must be {k} group numbers in [0, {groups})")
        g_idx = g_idx.to(torch.int64)
    return codes.t().contiguous(), zeros, sc.float(), g_idx, g


def _packed(name: str, parts: Dict[str, torch.Tensor], qc: dict):
    from pyspec.linear import PackedWeight

    codes, zeros, scales, g_idx, g = _codes(name, parts, qc)  # codes [N, K]
    n, k = codes.shape
    perm = None
    block_group = torch.arange(0, k, 32) // g  # each 32-column block's group, natural order
    if g_idx is not None and not torch.equal(g_idx, torch.arange(k) // g):
        # Act-order: store the columns sorted by group; each block must fall in one group.
        perm = torch.argsort(g_idx, stable=True)
        sorted_groups = g_idx[perm].view(k // 32, 32)
        if not bool((sorted_groups == sorted_groups[:, :1]).all()):
            raise ValueError(f"{name}.g_idx: a group's inputs are not a multiple of 32, which "
                             "the packed kernel's blocks need")
        block_group = sorted_groups[:, 0]
        codes = codes[:, perm]
    d = scales.t()[:, block_group].contiguous()  # [N, K/32]
    m = (-(zeros.t().float() * scales.t()))[:, block_group].contiguous()
    q = codes.view(n, k // 32, 2, 16)
    q = (q[:, :, 0] | (q[:, :, 1] << 4)).reshape(n, k // 2).contiguous()
    return PackedWeight(None, q, d, m, 4, perm)


def quantized_tensors(tensors: Iterable[Tuple[str, torch.Tensor]],
                      qc: dict) -> Iterable[Tuple[str, object]]:
    """The checkpoint's tensors with each quantized linear layer's ``qweight`` / ``qzeros`` /
    ``scales`` / ``g_idx`` replaced by one ``NAME.weight`` :class:`~pyspec.linear.PackedWeight`
    (after the tensors of a layer are all read); other tensors pass through."""
    pending: Dict[str, Dict[str, torch.Tensor]] = {}
    for name, t in tensors:
        base, _, part = name.rpartition(".")
        if part in _PARTS:
            pending.setdefault(base, {})[part] = t
            continue
        yield name, t
    for base, parts in pending.items():
        yield base + ".weight", _packed(base, parts, qc)
