"""Loading Hugging Face safetensors checkpoints (single file or sharded) with clear errors.

Tensors are read one at a time from memory-mapped files and converted to the requested dtype, so
the process never holds two copies of the weights: a source tensor is dropped as soon as its
converted (or fused) form exists.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import struct
from typing import Callable, Dict, Iterator, List, Optional, Tuple

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
        except (json.JSONDecodeError, UnicodeDecodeError, KeyError, TypeError) as e:
            raise ValueError(f"{index} is malformed (needs a 'weight_map' object): {e}") from None
        if not isinstance(weight_map, dict) or not all(
                isinstance(v, str) and v == os.path.basename(v) and v not in ("", ".", "..")
                for v in weight_map.values()):
            raise ValueError(f"{index} is malformed: its 'weight_map' must map tensor names to "
                             "the file names of shards in the same folder")
        files = sorted(set(weight_map.values()))
        missing = [f for f in files if not os.path.isfile(os.path.join(path, f))]
        if missing:
            raise ValueError(f"{index} names shard(s) that do not exist: {missing}")
        return [os.path.join(path, f) for f in files]
    if os.path.isfile(single):
        return [single]
    if os.path.lexists(single):  # e.g. a cache snapshot's link whose blob was never downloaded
        what = "a link to nothing" if os.path.islink(single) and not os.path.exists(single) \
            else "not a regular file"
        raise ValueError(f"{single} is {what}: the weights are missing")
    found = sorted(f for f in os.listdir(path)
                   if f.endswith(".safetensors") and os.path.isfile(os.path.join(path, f)))
    if found:
        return [os.path.join(path, f) for f in found]
    raise ValueError(f"no safetensors weights in {path} (expected model.safetensors or "
                     "model.safetensors.index.json)")


# safetensors' own limit on the JSON header.
_MAX_HEADER_BYTES = 100 * 2**20


def check_safetensors_header(file: str) -> dict:
    """The checks safetensors leaves out, made before it opens ``file``: a JSON header that fits
    the file and names each tensor once (JSON allows repeated keys; a reader would keep one of
    them). ValueError saying what is wrong; :func:`iter_tensors` checks each entry it reads
    (dtype, shape, offsets within the file), safetensors' own reader the rest. Returns the header
    (plus ``"__data_start__"``: where the tensor data begins)."""
    size = os.path.getsize(file)
    with open(file, "rb") as f:
        head = f.read(8)
        if len(head) < 8:
            raise ValueError(f"{file} is not a safetensors file (truncated or corrupt?): "
                             f"{size} bytes is shorter than its header length")
        (n,) = struct.unpack("<Q", head)
        if n > size - 8:
            raise ValueError(f"{file} is not a readable safetensors file (truncated or corrupt?): "
                             f"its header length {n} runs past the end of the file ({size} "
                             "bytes)")
        if n > _MAX_HEADER_BYTES:
            raise ValueError(f"{file} is not a readable safetensors file: its header is {n} "
                             f"bytes, more than safetensors reads ({_MAX_HEADER_BYTES})")
        raw = f.read(n)

    def no_duplicates(pairs):
        seen = set()
        for k, _ in pairs:
            if k in seen:
                raise ValueError(f"{file} is not a readable safetensors file: its header names "
                                 f"{k!r} more than once")
            seen.add(k)
        return dict(pairs)

    try:
        header = json.loads(raw.decode("utf-8"), object_pairs_hook=no_duplicates)
    except (UnicodeDecodeError, json.JSONDecodeError, RecursionError) as e:
        raise ValueError(f"{file} is not a readable safetensors file (truncated or corrupt?): "
                         f"its header is not UTF-8 JSON ({type(e).__name__})") from None
    if not isinstance(header, dict):
        raise ValueError(f"{file} is not a readable safetensors file (truncated or corrupt?): "
                         "its header is not a JSON object")
    header["__data_start__"] = 8 + n
    return header


def return_freed_memory() -> None:
    """Hand the heap's freed pages back to the system (glibc ``malloc_trim``; nothing elsewhere):
    a load frees hundreds of MB of tensors read and converted on the way, which the allocator
    would otherwise keep as resident memory of the process."""
    import ctypes
    import ctypes.util

    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        trim = libc.malloc_trim
    except (OSError, AttributeError):
        return
    trim.argtypes = [ctypes.c_size_t]
    trim(0)


_ST_DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16,
              "BF16": torch.bfloat16, "I64": torch.int64, "I32": torch.int32,
              "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8, "BOOL": torch.bool}


def _offsets_ok(offs) -> bool:
    """A safetensors entry's ``data_offsets``: two ints, 0 <= begin <= end."""
    return (isinstance(offs, list) and len(offs) == 2 and all(
        isinstance(o, int) and not isinstance(o, bool) for o in offs) and 0 <= offs[0] <= offs[1])


def iter_tensors(path: str) -> Iterator[Tuple[str, torch.Tensor]]:
    """Yields (name, tensor) for every tensor of every shard, one at a time, each read into its
    own memory with ordinary file reads (no memory map: a tensor the caller drops, e.g. a matrix
    kept as codes, is gone at once, and the file never counts toward the process's memory).
    Header entries are checked against the file: known dtype, integer shape, offsets inside
    the data and matching the shape's size, no two tensors' bytes overlapping."""
    for file in _checkpoint_files(path):
        header = check_safetensors_header(file)
        start = header.pop("__data_start__")
        header.pop("__metadata__", None)
        size = os.path.getsize(file)

        def bad(name, why):
            return ValueError(f"{file} is not a readable safetensors file (truncated or "
                              f"corrupt?): tensor {name!r} {why}")

        spans = sorted((info["data_offsets"][0], info["data_offsets"][1], name)
                       for name, info in header.items()
                       if isinstance(info, dict) and _offsets_ok(info.get("data_offsets")))
        for (b0, e0, n0), (b1, e1, n1) in zip(spans, spans[1:]):
            if b1 < e0:  # two tensors would share bytes: one of them is not what it claims
                raise bad(n1, f"has data_offsets {[b1, e1]}, overlapping tensor {n0!r}'s "
                          f"{[b0, e0]}")
        try:
            with open(file, "rb", buffering=0) as f:
                for name, info in header.items():
                    if not isinstance(info, dict):
                        raise bad(name, "has no dtype/shape/data_offsets entry")
                    dtype = _ST_DTYPES.get(info.get("dtype"))
                    shape, offs = info.get("shape"), info.get("data_offsets")
                    if dtype is None:
                        raise bad(name, f"has dtype {info.get('dtype')!r}; readable: "
                                  + ", ".join(_ST_DTYPES))
                    if not isinstance(shape, list) or not all(
                            isinstance(d, int) and not isinstance(d, bool) and d >= 0
                            for d in shape):
                        raise bad(name, f"has shape {shape!r}")
                    if not _offsets_ok(offs):
                        raise bad(name, f"has data_offsets {offs!r}")
                    numel = 1
                    for d in shape:
                        numel *= d
                    nbytes = offs[1] - offs[0]
                    if nbytes != numel * dtype.itemsize:
                        raise bad(name, f"holds {nbytes} bytes; shape {shape} of "
                                  f"{info['dtype']} needs {numel * dtype.itemsize}")
                    if start + offs[1] > size:
                        raise bad(name, f"runs past the end of the file ({size} bytes)")
                    t = torch.empty(nbytes, dtype=torch.uint8)
                    f.seek(start + offs[0])
                    got = f.readinto(memoryview(t.numpy())) if nbytes else 0
                    if got != nbytes:
                        raise bad(name, f"could be read for {got} of its {nbytes} bytes")
                    yield name, t.view(dtype).reshape(shape)
        except OSError as e:
            raise ValueError(f"{file} could not be read (truncated or corrupt?): {e}") from None


class _Shapes:
    """The shape a checkpoint tensor of ``cfg`` must have, by name, without listing every layer's
    names up front: a config's layer count is only a claim until the tensors are read (one that
    says 2**31 layers must cost a lookup per tensor the file holds, not a table of 2**31 rows)."""

    _LAYER = "model.layers."

    def __init__(self, cfg: ModelConfig):
        one = dataclasses.replace(cfg, num_hidden_layers=1)
        self.layers = cfg.num_hidden_layers
        self.required, self.optional = {}, {}
        for table, shapes in ((self.required, expected_shapes(one)),
                              (self.optional, optional_shapes(one))):
            for name, shape in shapes.items():
                key = name[len(self._LAYER + "0."):] if name.startswith(self._LAYER) else name
                table[(name.startswith(self._LAYER), key)] = shape
        self.count = (sum(not layer for layer, _ in self.required)
                      + self.layers * sum(layer for layer, _ in self.required))

    def _key(self, name: str):
        if not name.startswith(self._LAYER):
            return False, name
        index, _, rest = name[len(self._LAYER):].partition(".")
        if not (index.isdigit() and index == str(int(index)) and int(index) < self.layers):
            return None
        return True, rest

    def get(self, name: str):
        """(shape, required) of tensor ``name``, or None for a name the config does not use."""
        key = self._key(name)
        if key in self.required:
            return self.required[key], True
        if key in self.optional:
            return self.optional[key], False
        return None

    def missing(self, found, limit: int = 5) -> List[str]:
        """Up to ``limit`` required names not in ``found``, in order (stops there: the layers
        walked are at most those ``found`` holds, plus one)."""
        out = []
        for i in range(-1, self.layers):
            for (layer, key) in self.required:
                if layer != (i >= 0):
                    continue
                name = f"{self._LAYER}{i}.{key}" if layer else key
                if name not in found:
                    out.append(name)
                    if len(out) == limit:
                        return out
        return out


def load_weights(path: str, cfg: ModelConfig, dtype: torch.dtype,
                 device: str = "cpu", dequantize: bool = False,
                 pack_layers: bool = False) -> Dict[str, torch.Tensor]:
    """Reads, validates and converts all tensors. Errors name missing, unexpected or misshapen
    tensors. A 4-bit AWQ / GPTQ checkpoint's layer matrices come as codes-only
    :class:`~pyspec.linear.PackedWeight` (:mod:`pyspec.models.quantized`) for a float32 CPU model
    and, with Triton, a model of any dtype on a CUDA device (:mod:`pyspec.triton_linear`), else
    (another dtype on the CPU, or ``dequantize``) as the float matrices they stand for.

    ``pack_layers`` (a float32 CPU model loaded with ``packed_weights="codes"``): each decoder
    layer matrix whose values are exactly a 4-bit or 8-bit block format or 16-bit values
    (:func:`pyspec.linear.pack_exact`) is kept as its codes alone as soon as it is read, so the
    float32 layers are never all in memory at once (the load's peak stays near what the model
    holds afterwards)."""
    from pyspec.linear import PackedWeight, pack_exact
    from pyspec.models.quantized import quantization_config, quantized_tensors

    shapes = _Shapes(cfg)
    out: Dict[str, torch.Tensor] = {}
    unexpected: List[str] = []
    required = 0
    tensors = iter_tensors(path)
    qc = quantization_config(path)
    if qc is not None:
        tensors = _in_checkpoint(quantized_tensors(tensors, qc), path)
        # Codes stay codes for a float32 CPU model (the core's packed kernel) and on a CUDA
        # device with Triton (pyspec.triton_linear: any dtype); elsewhere the float matrices.
        from pyspec.triton_attention import available as triton_available

        dev = torch.device(device)
        kept = (dev.type == "cpu" and dtype == torch.float32) or (
            dev.type == "cuda" and triton_available())
        dequantize = dequantize or not kept
    for name, t in tensors:
        packed = isinstance(t, PackedWeight)  # a quantized layer's codes (already checked)
        if not packed and name.endswith(_IGNORED_SUFFIXES):
            continue
        if name in out:
            raise ValueError(f"checkpoint {path} holds tensor '{name}' more than once (in two "
                             "shards, or as floats and quantized)")
        want = shapes.get(name)
        if want is None:
            unexpected.append(name)
            continue
        if tuple(t.shape) != want[0]:
            what = "quantized matrix" if packed else "tensor"
            raise ValueError(f"checkpoint {path}: {what} '{name}' has shape {tuple(t.shape)}; "
                             f"its config.json implies {want[0]}")
        if packed:
            # Codes only for the decoder layers' matrices (a quantized lm_head is read, like the
            # embedding, as a float matrix: drafters and other devices take it as one).
            keep = not dequantize and name.startswith("model.layers.")
            out[name] = (t if dev.type == "cpu" else t.to(dev)) if keep else \
                t.natural().to(device=device, dtype=dtype)
        elif not t.is_floating_point():
            raise ValueError(f"checkpoint {path}: tensor '{name}' has dtype {t.dtype}; expected "
                             "a floating type "
                             "(of quantized checkpoints, 4-bit AWQ and GPTQ load: see "
                             "docs/coming-from.md)")
        else:
            t = t.to(device=device, dtype=dtype)
            p = None
            if pack_layers and name.startswith("model.layers.") and name.endswith("_proj.weight"):
                p = pack_exact(t)
            out[name] = t if p is None else p.drop_dense()
        required += want[1]
        del t
    quant = [n for n in unexpected if n.rpartition(".")[2] in ("qweight", "qzeros", "g_idx")]
    if quant:
        raise ValueError(f"checkpoint {path} holds quantized tensors ({quant[0]}, ...) but no "
                         "AWQ / GPTQ quantization_config pyspec reads (config.json "
                         "quantization_config with quant_method awq or gptq, quantize_config.json "
                         "or quant_config.json)")
    if unexpected:
        more = f" (+{len(unexpected) - 5} more)" if len(unexpected) > 5 else ""
        raise ValueError(f"checkpoint {path} has tensors this {cfg.model_type} config does not use: "
                         f"{unexpected[:5]}{more}")
    if required < shapes.count:
        missing = shapes.missing(out)
        n = shapes.count - required
        more = f" (+{n - len(missing)} more)" if n > len(missing) else ""
        raise ValueError(f"checkpoint {path} is missing tensors: {missing}{more}")
    return out


def _in_checkpoint(tensors, path: str):
    """``tensors`` with each ValueError naming the checkpoint ``path`` (the quantized layers'
    checks name the tensor only)."""
    try:
        yield from tensors
    except ValueError as e:
        if path in str(e):
            raise
        raise ValueError(f"checkpoint {path}: {e}") from None


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
                                                      "special_tokens_map.json",
                                                      "quantize_config.json",
                                                      "quant_config.json"):
            shutil.copy(os.path.join(src, name), os.path.join(dst, name))
    save_file(w, os.path.join(dst, "model.safetensors"))
    return dst


# torch.load(weights_only=True) failures, said in one line (training corpora, checkpoints,
# published drafter pickles).


def pickled_global(e: Exception) -> Optional[str]:
    """The Python object a pickle refused by ``torch.load(weights_only=True)`` names (to build or
    call it), or None when the load failed for another reason (bytes that are no pickle)."""
    # "Unsupported global: GLOBAL x.y", or for a module torch blocks outright (os, sys, ...)
    # "Trying to load unsupported GLOBAL posix.system whose module posix is blocked".
    m = re.search(r"unsupported(?: global:)? GLOBAL ([\w.]+)", str(e), flags=re.IGNORECASE)
    return m.group(1) if m else None


def load_weights_only(path: str, pickled: Callable[[str], str],
                      unreadable: Callable[[str], str]):
    """``torch.load(path, weights_only=True)`` on the CPU: nothing in the file runs. A file that
    pickles a Python object is a ValueError with ``pickled(name)`` (``name``: the object it
    names), any other failure (truncated or foreign bytes raise almost anything) one with
    ``unreadable(why)`` (``why``: the error in one line)."""
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:  # noqa: BLE001
        name = pickled_global(e)
        raise ValueError(pickled(name) if name is not None else unreadable(load_failure(e))) \
            from None


def load_failure(e: Exception) -> str:
    """A torch.load error in one line: its type and the line of its message that says what."""
    lines = [x.strip() for x in str(e).splitlines() if x.strip()]
    why = next((x for x in lines if "unsupported" in x.lower()), lines[0] if lines else "")
    why = why.split(" was not an allowed global")[0]
    return f"{type(e).__name__}: {why}" if why else type(e).__name__
