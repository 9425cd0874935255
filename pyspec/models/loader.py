"""Loading Hugging Face safetensors checkpoints (single file or sharded) with clear errors.

Tensors are read one at a time from memory-mapped files and converted to the requested dtype, so
the process never holds two copies of the weights: a source tensor is dropped as soon as its
converted (or fused) form exists.
"""

from __future__ import annotations

import json
import os
from typing import Dict, Iterator, List, Optional, Tuple

import torch

from pyspec.models.config import ModelConfig

_DTYPES = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16,
           "bf16": torch.bfloat16, "float16": torch.float16, "fp16": torch.float16}
# Buffers some checkpoints carry that the model recomputes.
_IGNORED_SUFFIXES = (".rotary_emb.inv_freq",)


def resolve_dtype(dtype) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        if dtype in (torch.float32, torch.bfloat16, torch.float16):
            return dtype
    elif isinstance(dtype, str) and dtype.lower() in _DTYPES:
        return _DTYPES[dtype.lower()]
    raise ValueError(f"unsupported dtype {dtype!r}; allowed: float32, bfloat16, float16")


def expected_shapes(cfg: ModelConfig) -> Dict[str, Tuple[int, ...]]:
    """Every tensor a checkpoint of this config must hold, with its shape."""
    h, q, kv, inter, v = cfg.hidden_size, cfg.q_size, cfg.kv_size, cfg.intermediate_size, cfg.vocab_size
    shapes = {"model.embed_tokens.weight": (v, h), "model.norm.weight": (h,)}
    if not cfg.tie_word_embeddings:
        shapes["lm_head.weight"] = (v, h)
    for i in range(cfg.num_hidden_layers):
        p = f"model.layers.{i}."
        shapes.update({
            p + "input_layernorm.weight": (h,),
            p + "post_attention_layernorm.weight": (h,),
            p + "self_attn.q_proj.weight": (q, h),
            p + "self_attn.k_proj.weight": (kv, h),
            p + "self_attn.v_proj.weight": (kv, h),
            p + "self_attn.o_proj.weight": (h, q),
            p + "mlp.gate_proj.weight": (inter, h),
            p + "mlp.up_proj.weight": (inter, h),
            p + "mlp.down_proj.weight": (h, inter),
        })
        if cfg.attention_bias:
            shapes.update({p + "self_attn.q_proj.bias": (q,), p + "self_attn.k_proj.bias": (kv,),
                           p + "self_attn.v_proj.bias": (kv,)})
    return shapes


def optional_shapes(cfg: ModelConfig) -> Dict[str, Tuple[int, ...]]:
    """Tensors a checkpoint may hold: a tied model's duplicate lm_head, Llama's o_proj bias."""
    shapes = {}
    if cfg.tie_word_embeddings:
        shapes["lm_head.weight"] = (cfg.vocab_size, cfg.hidden_size)
    if cfg.attention_bias and cfg.model_type != "qwen2":
        for i in range(cfg.num_hidden_layers):
            shapes[f"model.layers.{i}.self_attn.o_proj.bias"] = (cfg.hidden_size,)
    return shapes


def _checkpoint_files(path: str) -> List[str]:
    index = os.path.join(path, "model.safetensors.index.json")
    single = os.path.join(path, "model.safetensors")
    if os.path.isfile(index):
        try:
            with open(index, encoding="utf-8") as f:
                weight_map = json.load(f)["weight_map"]
        except (json.JSONDecodeError, KeyError, TypeError) as e:
            raise ValueError(f"{index} is malformed (needs a 'weight_map' object): {e}") from None
        files = sorted(set(weight_map.values()))
        missing = [f for f in files if not os.path.isfile(os.path.join(path, f))]
        if missing:
            raise ValueError(f"{index} names shard(s) that do not exist: {missing}")
        return [os.path.join(path, f) for f in files]
    if os.path.isfile(single):
        return [single]
    found = sorted(f for f in os.listdir(path) if f.endswith(".safetensors"))
    if found:
        return [os.path.join(path, f) for f in found]
    raise ValueError(f"no safetensors weights in {path} (expected model.safetensors or "
                     "model.safetensors.index.json)")


def iter_tensors(path: str) -> Iterator[Tuple[str, torch.Tensor]]:
    """Yields (name, tensor) for every tensor of every shard, one at a time (memory-mapped)."""
    from safetensors import SafetensorError, safe_open

    for file in _checkpoint_files(path):
        try:
            with safe_open(file, framework="pt", device="cpu") as f:
                for name in f.keys():
                    yield name, f.get_tensor(name)
        except SafetensorError as e:
            raise ValueError(f"{file} is not a readable safetensors file (truncated or corrupt?): "
                             f"{e}") from None
        except (OSError, RuntimeError) as e:
            raise ValueError(f"{file} could not be read (truncated or corrupt?): {e}") from None


def load_weights(path: str, cfg: ModelConfig, dtype: torch.dtype,
                 device: str = "cpu") -> Dict[str, torch.Tensor]:
    """Reads, validates and converts all tensors. Errors name missing, unexpected or misshapen
    tensors."""
    required = expected_shapes(cfg)
    optional = optional_shapes(cfg)
    out: Dict[str, torch.Tensor] = {}
    unexpected: List[str] = []
    for name, t in iter_tensors(path):
        if name.endswith(_IGNORED_SUFFIXES):
            continue
        want = required.get(name) or optional.get(name)
        if want is None:
            unexpected.append(name)
            continue
        if tuple(t.shape) != want:
            raise ValueError(f"tensor '{name}' has shape {tuple(t.shape)}; the config implies {want}")
        if not t.is_floating_point():
            raise ValueError(f"tensor '{name}' has dtype {t.dtype}; expected a floating type "
                             "(quantized checkpoints are not supported)")
        out[name] = t.to(device=device, dtype=dtype)
        del t
    if unexpected:
        more = f" (+{len(unexpected) - 5} more)" if len(unexpected) > 5 else ""
        raise ValueError(f"checkpoint {path} has tensors this {cfg.model_type} config does not use: "
                         f"{unexpected[:5]}{more}")
    missing = [n for n in required if n not in out]
    if missing:
        more = f" (+{len(missing) - 5} more)" if len(missing) > 5 else ""
        raise ValueError(f"checkpoint {path} is missing tensors: {missing[:5]}{more}")
    return out


def default_dtype(cfg: ModelConfig, dtype: Optional[object]) -> torch.dtype:
    if dtype is not None and dtype != "auto":
        return resolve_dtype(dtype)
    return torch.float32


def weights_sha256(path: str) -> str:
    """sha256 over a checkpoint folder's safetensors files (names + contents): the target identity
    drafters record. Cached in ``.pyspec-sha256.json`` next to the weights, keyed by file sizes and
    modification times, so it costs one pass over the weights once."""
    import hashlib
    import json

    files = sorted(f for f in os.listdir(path) if f.endswith(".safetensors"))
    key = [[f, os.path.getsize(os.path.join(path, f)),
            int(os.path.getmtime(os.path.join(path, f)))] for f in files]
    cache = os.path.join(path, ".pyspec-sha256.json")
    try:
        with open(cache) as fh:
            c = json.load(fh)
        if c.get("key") == key:
            return c["sha256"]
    except (OSError, ValueError, KeyError):
        pass
    h = hashlib.sha256()
    for f in files:
        h.update(f.encode())
        with open(os.path.join(path, f), "rb") as fh:
            for block in iter(lambda: fh.read(1 << 22), b""):
                h.update(block)
    digest = h.hexdigest()
    try:
        with open(cache, "w") as fh:
            json.dump({"key": key, "sha256": digest}, fh)
    except OSError:
        pass  # read-only folder: recompute next time
    return digest


def write_truncated_checkpoint(src: str, dst: str, num_layers: int) -> str:
    """A checkpoint folder holding ``src``'s first ``num_layers`` layers, embeddings, final norm,
    lm_head and tokenizer files: an independent draft model made from a target (its own weights
    file and, in pyspec, its own KV), loadable by pyspec and transformers alike."""
    import json
    import shutil

    from safetensors.torch import load_file, save_file

    os.makedirs(dst, exist_ok=True)
    with open(os.path.join(src, "config.json")) as f:
        conf = json.load(f)
    if not 1 <= num_layers <= int(conf.get("num_hidden_layers", 0)):
        raise ValueError(f"num_layers must be in [1, {conf.get('num_hidden_layers')}]; got "
                         f"{num_layers}")
    conf["num_hidden_layers"] = num_layers
    with open(os.path.join(dst, "config.json"), "w") as f:
        json.dump(conf, f, indent=1)
    w = {}
    for name in sorted(os.listdir(src)):
        if name.endswith(".safetensors"):
            for k, v in load_file(os.path.join(src, name)).items():
                if not k.startswith("model.layers.") or int(k.split(".")[2]) < num_layers:
                    w[k] = v
        elif name.startswith("tokenizer") or name in ("generation_config.json",
                                                      "chat_template.jinja",
                                                      "special_tokens_map.json"):
            shutil.copy(os.path.join(src, name), os.path.join(dst, name))
    save_file(w, os.path.join(dst, "model.safetensors"))
    return dst
