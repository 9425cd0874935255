"""Drafter checkpoints as their authors publish them, read without conversion:

* **Medusa** (Cai et al. 2024; the ``medusa_lm_head`` layout): ``config.json`` with
  ``medusa_num_heads`` / ``medusa_num_layers``, weights ``medusa_lm_head.safetensors`` (or the
  pickled ``medusa_lm_head.pt``) holding per head ``i``: residual blocks
  ``{i}.{j}.linear.weight [H, H]`` / ``{i}.{j}.linear.bias [H]`` (``x + SiLU(W x + b)``, j <
  num_layers) and the head's own projection ``{i}.{num_layers}.weight [V, H]``. Head ``i`` reads
  the target's final-normed hidden state at position t and proposes token t + i + 2.
* **EAGLE-1/2** (Li et al. 2024; the ``cnets1`` layout): ``config.json`` of a one-layer Llama,
  weights ``pytorch_model.bin`` or ``model.safetensors`` with ``fc.weight [H, 2H]`` (and
  ``fc.bias`` unless the config says ``"bias": false``) over ``[embed(t+1); f_t]``, one decoder
  layer ``layers.0.*`` *without* an input norm, no final norm and no lm_head: ``f`` is the
  target's last hidden state *after* its final norm, and the head's output goes straight to the
  target's lm_head.
* **EAGLE-3** (Li et al. 2025): ``config.json`` (``draft_vocab_size``; optionally
  ``eagle_config.eagle_aux_hidden_state_layer_ids``), weights with ``fc.weight [H, 3H]`` (no bias)
  fusing the target's hidden states at three depths (by default the outputs of layers 2, L//2 and
  L-3, un-normed, low to high), a ``midlayer`` whose attention reads
  ``[input_layernorm(embed); hidden_norm(feature)]`` (2H wide) with the feature as its residual,
  ``norm.weight``, ``lm_head.weight [Vd, H]`` over a reduced vocabulary with ``d2t`` (target id =
  draft id + d2t[draft id]); ``t2d`` and a copy of the target's ``embed_tokens`` may be present.
  Deeper draft levels feed the midlayer's output (before ``norm``) back as the feature.

Pickled ``.bin`` / ``.pt`` files are read with ``torch.load(weights_only=True)`` (nothing in the
file runs); safetensors is preferred where both are present. Every mismatch names the file, the
tensor and what was expected.
"""

from __future__ import annotations

import os
import re
from typing import Dict, Optional, Tuple

import torch

__all__ = ["published_kind", "load_published", "eagle3_layers"]

_MEDUSA_FILES = ("medusa_lm_head.safetensors", "medusa_lm_head.pt", "medusa_lm_head.bin")
_EAGLE_FILES = ("model.safetensors", "pytorch_model.bin")


def _config(path: str) -> Optional[dict]:
    from pyspec.models.config import _read_object

    f = os.path.join(path, "config.json")
    return _read_object(f) if os.path.isfile(f) else None


def _first(path: str, names) -> Optional[str]:
    for n in names:
        if os.path.isfile(os.path.join(path, n)):
            return os.path.join(path, n)
    return None


def _tensor_names(file: str) -> Tuple[str, ...]:
    """The tensor names of a safetensors file (its header only); () for a pickle (read later)."""
    if not file.endswith(".safetensors"):
        return ()
    from safetensors import safe_open

    from pyspec.models.loader import check_safetensors_header

    check_safetensors_header(file)
    try:
        with safe_open(file, "pt") as f:
            return tuple(f.keys())
    except Exception as e:  # noqa: BLE001 - safetensors' own error types
        raise _unreadable(file, e) from None


def _unreadable(file: str, e: Exception) -> ValueError:
    return ValueError(f"{file} is not a readable safetensors file (truncated or corrupt?): "
                      f"{type(e).__name__}: {e}")


def published_kind(path: str) -> Optional[str]:
    """"medusa", "eagle" (EAGLE-1/2) or "eagle3" for a folder in a published drafter layout,
    else None (a pyspec drafter folder, a model, or anything else)."""
    if not os.path.isdir(path) or os.path.isfile(os.path.join(path, "drafter.json")):
        return None
    if _first(path, _MEDUSA_FILES) is not None:
        return "medusa"
    cfg = _config(path)
    if cfg is None:
        return None
    if "medusa_num_heads" in cfg:
        return "medusa"
    archs = cfg.get("architectures") or ()
    arch = " ".join(map(str, archs if isinstance(archs, (list, tuple)) else [archs]))
    if "eagle3" in arch.lower() or "draft_vocab_size" in cfg:
        return "eagle3"
    file = _first(path, _EAGLE_FILES)
    if file is None:
        return None
    names = _tensor_names(file)
    if not names and file.endswith(".bin") and cfg.get("num_hidden_layers") in (None, 1):
        # A pickle has no header: read it only for what may be a one-layer EAGLE head, not for
        # a whole model's weights.
        names = tuple(_load(file).keys())
    if any(n.startswith("midlayer.") for n in names) or "d2t" in names:
        return "eagle3"
    if "fc.weight" in names and any(n.startswith("layers.0.") for n in names):
        return "eagle"
    return None


def _load(file: str) -> Dict[str, torch.Tensor]:
    if file.endswith(".safetensors"):
        from safetensors.torch import load_file

        _tensor_names(file)  # header checks
        try:
            return load_file(file)
        except Exception as e:  # noqa: BLE001
            raise _unreadable(file, e) from None
    from pyspec.models.loader import load_weights_only

    obj = load_weights_only(
        file, lambda name: f"{file}: the file holds pickled Python objects (it names {name}), "
                           "which pyspec does not load (unpickling can run any code); convert it "
                           "to safetensors",
        lambda why: f"{file}: not a readable PyTorch weights file ({why})")
    if not isinstance(obj, dict) or not all(isinstance(k, str) and isinstance(v, torch.Tensor)
                                            for k, v in obj.items()):
        raise ValueError(f"{file}: must hold a dict of tensor name -> tensor")
    return obj


def _get(t: Dict[str, torch.Tensor], file: str, name: str, shape) -> torch.Tensor:
    if name not in t:
        raise ValueError(f"{file}: tensor {name!r} is missing (expected shape {list(shape)})")
    v = t.pop(name)
    if tuple(v.shape) != tuple(shape):
        raise ValueError(f"{file}: tensor {name!r} has shape {list(v.shape)}; expected "
                         f"{list(shape)} for this target")
    if not v.is_floating_point():
        raise ValueError(f"{file}: tensor {name!r} has dtype {v.dtype}; expected floating point")
    return v.float()


def _medusa(path: str, target_cfg) -> Tuple[dict, Dict[str, torch.Tensor]]:
    file = _first(path, _MEDUSA_FILES)
    if file is None:
        raise ValueError(f"{path!r}: Medusa heads need one of {', '.join(_MEDUSA_FILES)}")
    cfg = _config(path) or {}
    t = _load(file)
    h, v = target_cfg.hidden_size, target_cfg.vocab_size
    heads = sorted({int(m.group(1)) for k in t for m in [re.match(r"(\d+)\.", k)] if m})
    if not heads or heads != list(range(len(heads))):
        raise ValueError(f"{file}: expected Medusa heads named 0.*, 1.*, ... (the medusa_lm_head "
                         f"layout); found {sorted(t)[:6]}")
    # The published configs sometimes under-report their heads: the tensors decide; a config
    # that names more heads than the file holds is an error.
    n_cfg = cfg.get("medusa_num_heads")
    if isinstance(n_cfg, int) and n_cfg > len(heads):
        raise ValueError(f"{path}/config.json: medusa_num_heads is {n_cfg} but {file} holds "
                         f"{len(heads)} heads")
    blocks = sorted({int(m.group(1)) for k in t for m in [re.match(r"0\.(\d+)\.linear\.", k)] if m})
    layers = len(blocks)
    if blocks != list(range(layers)) or layers == 0:
        raise ValueError(f"{file}: head 0 needs residual blocks 0.0.linear.* .. (found "
                         f"{[k for k in t if k.startswith('0.')][:6]})")
    n_l = cfg.get("medusa_num_layers")
    if isinstance(n_l, int) and n_l != layers:
        raise ValueError(f"{path}/config.json: medusa_num_layers is {n_l} but {file} holds "
                         f"{layers} blocks per head")
    out = {}
    for i in heads:
        for j in range(layers):
            out[f"heads.{i}.{j}.weight"] = _get(t, file, f"{i}.{j}.linear.weight", (h, h))
            out[f"heads.{i}.{j}.bias"] = _get(t, file, f"{i}.{j}.linear.bias", (h,))
        out[f"heads.{i}.lm_head.weight"] = _get(t, file, f"{i}.{layers}.weight", (v, h))
    if t:
        raise ValueError(f"{file}: unexpected tensors {sorted(t)[:5]} (the medusa_lm_head layout "
                         f"has {{i}}.{{j}}.linear.weight/bias and {{i}}.{layers}.weight)")
    return {"num_heads": len(heads), "num_layers": layers, "head_lm_heads": True}, out


def _positive(cfg: dict, cfg_path: str, key: str, default) -> int:
    v = cfg.get(key, default)
    if isinstance(v, bool) or not isinstance(v, int) or v < 1:
        raise ValueError(f"{cfg_path}: {key} must be an int >= 1; got {v!r}")
    return v


def _head_shape(cfg: dict, cfg_path: str, target_cfg, what: str):
    """(heads, KV heads, head dim, intermediate size) of a one-layer EAGLE head's config.json,
    checked against the target it drafts for (hidden size, vocabulary, norm eps, RoPE base)."""
    h = target_cfg.hidden_size
    if cfg.get("hidden_size") not in (None, h):
        raise ValueError(f"{cfg_path}: hidden_size {cfg.get('hidden_size')} does not match the "
                         f"target's {h}")
    if cfg.get("vocab_size") not in (None, target_cfg.vocab_size):
        raise ValueError(f"{cfg_path}: vocab_size {cfg.get('vocab_size')} does not match the "
                         f"target's {target_cfg.vocab_size}")
    if cfg.get("num_hidden_layers", 1) != 1:
        raise ValueError(f"{cfg_path}: an {what} head has one decoder layer; num_hidden_layers "
                         f"is {cfg.get('num_hidden_layers')}")
    for key, want in (("rms_norm_eps", target_cfg.rms_norm_eps),
                      ("rope_theta", target_cfg.rope_theta)):
        if key in cfg and cfg[key] != want:
            raise ValueError(f"{cfg_path}: {key} {cfg[key]} differs from the target's {want} "
                             "(the head shares the target's)")
    nh = _positive(cfg, cfg_path, "num_attention_heads", target_cfg.num_attention_heads)
    kv = _positive(cfg, cfg_path, "num_key_value_heads", nh)
    hd = _positive(cfg, cfg_path, "head_dim", h // nh)
    if nh % kv:  # the checks a target's config gets (ModelConfig), at load, not at a step
        raise ValueError(f"{cfg_path}: num_attention_heads {nh} is not a multiple of "
                         f"num_key_value_heads {kv}")
    if hd % 2:
        raise ValueError(f"{cfg_path}: head_dim {hd} must be even (rotary embeddings)")
    return nh, kv, hd, _positive(cfg, cfg_path, "intermediate_size", target_cfg.intermediate_size)


def _eagle_files(path: str, what: str):
    """(weights file, config, config path) of a published EAGLE head folder."""
    file = _first(path, _EAGLE_FILES)
    cfg = _config(path)
    if file is None or cfg is None:
        raise ValueError(f"{path!r}: an {what} head needs config.json and one of "
                         f"{', '.join(_EAGLE_FILES)}")
    return file, cfg, os.path.join(path, "config.json")


def _eagle(path: str, target_cfg) -> Tuple[dict, Dict[str, torch.Tensor]]:
    file, cfg, cfg_path = _eagle_files(path, "EAGLE")
    t = _load(file)
    h = target_cfg.hidden_size
    nh, nkv, hd, inter = _head_shape(cfg, cfg_path, target_cfg, "EAGLE")
    out = {"fc.weight": _get(t, file, "fc.weight", (h, 2 * h))}
    if cfg.get("bias", True) or "fc.bias" in t:
        out["fc.bias"] = _get(t, file, "fc.bias", (h,))
    shapes = {"post_attention_layernorm.weight": (h,),
              "self_attn.q_proj.weight": (nh * hd, h), "self_attn.k_proj.weight": (nkv * hd, h),
              "self_attn.v_proj.weight": (nkv * hd, h), "self_attn.o_proj.weight": (h, nh * hd),
              "mlp.gate_proj.weight": (inter, h), "mlp.up_proj.weight": (inter, h),
              "mlp.down_proj.weight": (h, inter)}
    for k, s in shapes.items():
        out["layer." + k] = _get(t, file, "layers.0." + k, s)
    if "layers.0.input_layernorm.weight" in t:
        raise ValueError(f"{file}: layers.0.input_layernorm.weight is present, but an EAGLE-1/2 "
                         "head has no input norm in its layer (is this another layout?)")
    emb = t.pop("embed_tokens.weight", None)  # the target's embedding, when the file has a copy
    if emb is not None and tuple(emb.shape) != (target_cfg.vocab_size, h):
        raise ValueError(f"{file}: embed_tokens.weight has shape {list(emb.shape)}; expected "
                         f"{[target_cfg.vocab_size, h]} (the target's embedding)")
    if t:
        raise ValueError(f"{file}: unexpected tensors {sorted(t)[:5]} for an EAGLE-1/2 head")
    head_cfg = {"intermediate_size": inter, "num_attention_heads": nh,
                "num_key_value_heads": nkv, "head_dim": hd, "input_layernorm": False,
                "final_norm": False, "feature": "normed_hidden"}
    return head_cfg, out


def eagle3_layers(num_layers: int, aux_ids=None) -> Tuple[int, ...]:
    """The target layers (numbered 1..L: the output of that layer) an EAGLE-3 head fuses: the
    inputs of layers 2, L//2 and L-3 counted from 0 (the reference code's capture), which are the
    outputs of layers 2, L//2 and L-3 counted from 1; or ``aux_ids`` (a config's
    ``eagle_aux_hidden_state_layer_ids``: layer i's output, counted from 0)."""
    if aux_ids is not None:
        if not isinstance(aux_ids, list) or not all(isinstance(i, int) and not isinstance(i, bool)
                                                    for i in aux_ids):
            raise ValueError(f"eagle_aux_hidden_state_layer_ids must be a list of ints; got "
                             f"{aux_ids!r}")
        layers = tuple(i + 1 for i in aux_ids)
    else:
        layers = (2, num_layers // 2, num_layers - 3)
    if len(set(layers)) != len(layers) or list(layers) != sorted(layers) or \
            not all(1 <= n <= num_layers for n in layers):
        raise ValueError(f"an EAGLE-3 head fuses target layers {list(layers)}, which a target "
                         f"of {num_layers} layers does not have as distinct ascending layers")
    return layers


def _eagle3(path: str, target_cfg) -> Tuple[dict, Dict[str, torch.Tensor]]:
    file, cfg, cfg_path = _eagle_files(path, "EAGLE-3")
    h, v = target_cfg.hidden_size, target_cfg.vocab_size
    if cfg.get("target_hidden_size") not in (None, h):
        raise ValueError(f"{cfg_path}: target_hidden_size {cfg.get('target_hidden_size')} does "
                         f"not match the target's hidden size {h}")
    nh, nkv, hd, inter = _head_shape(cfg, cfg_path, target_cfg, "EAGLE-3")
    ec = cfg.get("eagle_config") or {}
    if not isinstance(ec, dict):
        raise ValueError(f"{cfg_path}: eagle_config must be an object; got {type(ec).__name__}")
    if "eagle_aux_hidden_state_layer_ids" in cfg:
        raise ValueError(f"{cfg_path}: a top-level eagle_aux_hidden_state_layer_ids is read "
                         "differently by different engines; give the layers as "
                         "eagle_config.eagle_aux_hidden_state_layer_ids (layer i's output, "
                         "counted from 0)")
    if cfg.get("rope_scaling") not in (None, {}) and target_cfg.rope_scaling.rope_type in (
            None, "default"):
        raise ValueError(f"{cfg_path}: rope_scaling {cfg['rope_scaling']} differs from the "
                         "target's (none; the head shares the target's)")
    for key in ("norm_before_residual", "norm_before_fc", "fc_norm", "norm_output",
                "attention_bias"):
        if cfg.get(key) or (isinstance(ec, dict) and ec.get(key)):
            raise ValueError(f"{cfg_path}: {key} is a variant of the EAGLE-3 layer pyspec does "
                             "not implement (only the reference layout loads)")

    vd = _positive(cfg, cfg_path, "draft_vocab_size", v)
    if vd > v:
        raise ValueError(f"{cfg_path}: draft_vocab_size {vd} is larger than the target's "
                         f"vocabulary ({v})")
    layers = eagle3_layers(target_cfg.num_hidden_layers,
                           ec.get("eagle_aux_hidden_state_layer_ids")
                           if isinstance(ec, dict) else None)
    t = _load(file)
    out = {"fuse.weight": _get(t, file, "fc.weight", (h, len(layers) * h)),
           "norm.weight": _get(t, file, "norm.weight", (h,)),
           "lm_head.weight": _get(t, file, "lm_head.weight", (vd, h))}
    if "fc.bias" in t:
        raise ValueError(f"{file}: fc.bias is present, but an EAGLE-3 head's fc has no bias")
    shapes = {"hidden_norm.weight": (h,), "input_layernorm.weight": (h,),
              "post_attention_layernorm.weight": (h,),
              "self_attn.q_proj.weight": (nh * hd, 2 * h),
              "self_attn.k_proj.weight": (nkv * hd, 2 * h),
              "self_attn.v_proj.weight": (nkv * hd, 2 * h),
              "self_attn.o_proj.weight": (h, nh * hd),
              "mlp.gate_proj.weight": (inter, h), "mlp.up_proj.weight": (inter, h),
              "mlp.down_proj.weight": (h, inter)}
    for k, s in shapes.items():
        out["layer." + k] = _get(t, file, "midlayer." + k, s)
    d2t = t.pop("d2t", None)
    if d2t is None:
        if vd != v:
            raise ValueError(f"{file}: tensor 'd2t' is missing (a draft vocabulary of {vd} of "
                             f"the target's {v} tokens needs its map)")
        draft_vocab = torch.arange(v)
    else:
        if d2t.dtype not in (torch.int64, torch.int32) or tuple(d2t.shape) != (vd,):
            raise ValueError(f"{file}: tensor 'd2t' must be int64 [{vd}]; got {d2t.dtype} "
                             f"{list(d2t.shape)}")
        draft_vocab = torch.arange(vd) + d2t.to(torch.int64)
        if bool((draft_vocab < 0).any()) or bool((draft_vocab >= v).any()) or \
                draft_vocab.unique().numel() != vd:
            raise ValueError(f"{file}: 'd2t' maps draft ids to target ids outside [0, {v}) or "
                             "to the same id twice")
    out["draft_vocab"] = draft_vocab
    t2d = t.pop("t2d", None)  # the inverse map, implied by d2t
    if t2d is not None and tuple(t2d.shape) != (v,):
        raise ValueError(f"{file}: tensor 't2d' has shape {list(t2d.shape)}; expected [{v}]")
    emb = t.pop("embed_tokens.weight", None)  # a copy of the target's, when present
    if emb is not None and tuple(emb.shape) != (v, h):
        raise ValueError(f"{file}: embed_tokens.weight has shape {list(emb.shape)}; expected "
                         f"{[v, h]} (the target's embedding)")
    if t:
        raise ValueError(f"{file}: unexpected tensors {sorted(t)[:5]} for an EAGLE-3 head")
    head_cfg = {"intermediate_size": inter, "num_attention_heads": nh,
                "num_key_value_heads": nkv, "head_dim": hd, "layout": "eagle3",
                "fused_layers": list(layers)}
    return head_cfg, out


def load_published(path: str, target_runner, **overrides):
    """A drafter from a published layout (:func:`published_kind`) for ``target_runner``."""
    from pyspec.drafters.heads import EagleDrafter, MedusaDrafter

    kind = published_kind(path)
    tc = target_runner.model.cfg
    if kind == "medusa":
        if any(k in overrides for k in ("width", "max_depth", "max_nodes")):
            raise ValueError("width/depth/nodes options apply to EAGLE drafters; a Medusa tree "
                             "comes from its choice list")
        cfg, tensors = _medusa(path, tc)
        d = MedusaDrafter(target_runner, tensors, cfg["num_heads"], overrides.pop("tree", None),
                          num_layers=cfg["num_layers"])
    elif kind == "eagle":
        head_cfg, tensors = _eagle(path, tc)
        d = EagleDrafter(target_runner, tensors, head_cfg,
                         **{k: v for k, v in overrides.items() if v is not None})
    elif kind == "eagle3":
        head_cfg, tensors = _eagle3(path, tc)
        d = EagleDrafter(target_runner, tensors, head_cfg,
                         **{k: v for k, v in overrides.items() if v is not None})
    else:
        raise ValueError(f"{path!r} is not a published drafter layout (Medusa medusa_lm_head, "
                         "EAGLE-1/2 or EAGLE-3 head)")
    d.manifest = {"source": f"published {kind} layout"}
    d.path = path
    return d
