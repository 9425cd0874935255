"""Convert a llama.cpp GGUF checkpoint into a Hugging Face style safetensors folder.

The output folder holds ``config.json`` (``LlamaForCausalLM``), ``model.safetensors`` (float32,
Hugging Face tensor names and layout), ``tokenizer.json``, ``tokenizer_config.json`` (special
tokens and the chat template) and ``generation_config.json``. It loads like any HF checkpoint.

Two things differ between llama.cpp's layout and Hugging Face's and are undone here:

* llama.cpp's converter permutes the rows of the Q and K projections so that each head's rotary
  pairs are adjacent (``x[2i], x[2i+1]``, GPT-J style); Hugging Face pairs ``x[i]`` with
  ``x[i + d/2]`` (rotate-half). :func:`unpermute_qk` restores Hugging Face's row order.
* A GGUF stores the tokenizer as metadata (tokens, merges, token types, special ids and a
  pre-tokenizer *name*); :func:`build_tokenizer` rebuilds an equivalent ``tokenizers`` pipeline,
  with the split rules llama.cpp uses for that pre-tokenizer name.

Only the ``llama`` architecture and byte-level BPE (``gpt2``) vocabularies are supported; anything
else raises :class:`ValueError`. Needs the ``gguf`` package (``pip install gguf``).
"""

from __future__ import annotations

import json
import os
import shutil
import struct
import tempfile
from typing import Any, Dict, List, Optional, Tuple

import numpy as np

# Bumped whenever the produced folder changes in a way that matters to readers of it.
CONVERTER_VERSION = 1
MARKER_FILE = "pyspec_convert.json"

SUPPORTED_ARCHITECTURES = ("llama",)

# Split rules (applied before byte-level encoding) for llama.cpp's tokenizer.ggml.pre names.
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
# name -> (isolate every digit first, split regex or None for the GPT-2 byte-level regex)
_PRE_TOKENIZERS: Dict[str, Tuple[bool, Optional[str]]] = {
    "default": (False, None),
    "gpt-2": (False, None),
    "gpt2": (False, None),
    "mpt": (False, None),
    "olmo": (False, None),
    "smollm": (True, None),
    "starcoder": (True, None),
    "refact": (True, None),
    "codeshell": (True, None),
    "llama3": (False, _LLAMA3_SPLIT),
    "llama-v3": (False, _LLAMA3_SPLIT),
    "llama-bpe": (False, _LLAMA3_SPLIT),
    "smaug-bpe": (False, _LLAMA3_SPLIT),
    "qwen2": (False, _QWEN2_SPLIT),
}

# llama.cpp token types
_TOKEN_CONTROL = 3
_TOKEN_USER_DEFINED = 4


# --------------------------------------------------------------------------------------------
# reading


def _gguf():
    try:
        import gguf  # noqa: F401
    except ImportError as e:  # pragma: no cover - depends on the environment
        raise ImportError(
            "reading GGUF files needs the 'gguf' package: pip install gguf") from e
    return gguf


def open_gguf(path: str):
    """A ``gguf.GGUFReader`` for *path*; ValueError if it is not a readable, complete GGUF file."""
    gguf = _gguf()
    path = os.fspath(path)
    if not os.path.isfile(path):
        raise ValueError(f"{path}: no such file")
    with open(path, "rb") as f:
        magic = f.read(4)
    if magic != b"GGUF":
        raise ValueError(f"{path}: not a GGUF file (bad magic {magic!r}, expected b'GGUF')")
    # gguf's reader trusts the counts and lengths it reads (an array length past the end of the
    # file makes it loop without end): the layout is checked against the file's size first.
    check_layout(path)
    try:
        reader = gguf.GGUFReader(path, "r")
    except Exception as e:  # truncated header, bad counts, unknown value types...
        raise ValueError(f"{path}: corrupt or truncated GGUF file ({type(e).__name__}: {e})") from e
    size = os.path.getsize(path)
    for t in reader.tensors:
        end = int(t.data_offset) + int(t.n_bytes)
        if end > size or t.data.nbytes != int(t.n_bytes):
            raise ValueError(
                f"{path}: truncated GGUF file (tensor {t.name!r} needs bytes up to {end}, "
                f"the file has {size})")
    return reader


# GGUF metadata value types: fixed sizes of the scalar ones; 8 is a string, 9 an array.
_SCALAR_BYTES = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}
_STRING, _ARRAY, _UINT32 = 8, 9, 4
_MAX_DIMS = 4  # GGML_MAX_DIMS


def check_layout(path: str) -> None:
    """Walk a GGUF file's header (metadata, tensor infos) and check every count, length, type and
    tensor range against the file before anything trusts them; ValueError saying what is wrong.

    Every length is bounded by the bytes left, so a corrupt file costs at most one pass over its
    header: no loop runs on a count the file cannot hold, nothing is allocated for one.
    """
    import mmap

    gguf = _gguf()
    path = os.fspath(path)
    with open(path, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        if size < 24:
            raise ValueError(f"{path}: corrupt or truncated GGUF file ({size} bytes is shorter "
                             "than a GGUF header)")
        buf = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
    try:
        _walk_layout(path, buf, size, gguf)
    finally:
        buf.close()


def _walk_layout(path: str, buf, size: int, gguf) -> None:
    def bad(why: str) -> ValueError:
        return ValueError(f"{path}: corrupt or truncated GGUF file ({why})")

    pos = 4
    (version,) = struct.unpack_from("<I", buf, pos)
    order = ">" if version & 0xFFFF == 0 else "<"  # a byte-swapped (big-endian) file
    (version,) = struct.unpack_from(order + "I", buf, pos)
    if version not in (2, 3):
        raise bad(f"GGUF version {version}; versions 2 and 3 are supported")
    n_tensors, n_kv = struct.unpack_from(order + "QQ", buf, 8)
    pos = 24

    def need(n: int, what: str) -> None:
        if n > size - pos:
            raise bad(f"{what} at byte {pos} needs {n} bytes; the file has {size - pos} left")

    def u32(what: str) -> int:
        nonlocal pos
        need(4, what)
        (v,) = struct.unpack_from(order + "I", buf, pos)
        pos += 4
        return v

    def u64(what: str) -> int:
        nonlocal pos
        need(8, what)
        (v,) = struct.unpack_from(order + "Q", buf, pos)
        pos += 8
        return v

    def string(what: str) -> str:
        nonlocal pos
        n = u64(f"the length of {what}")
        need(n, f"{what} ({n} bytes)")
        try:
            text = bytes(buf[pos:pos + n]).decode("utf-8")
        except UnicodeDecodeError:
            raise bad(f"{what} at byte {pos} is not UTF-8") from None
        pos += n
        return text

    # The smallest entries: a metadata pair (empty key, type, one byte), a tensor info (empty
    # name, 0 dims, type, offset).
    if n_kv > (size - pos) // 13:
        raise bad(f"{n_kv} metadata entries cannot fit in {size} bytes")
    if n_tensors > (size - pos) // 24:
        raise bad(f"{n_tensors} tensors cannot fit in {size} bytes")
    keys = set()
    alignment = 32
    for _ in range(n_kv):
        key = string("a metadata key")
        if key in keys:
            raise bad(f"duplicate metadata key {key!r}")
        keys.add(key)
        vtype = u32(f"the type of {key!r}")
        if vtype in _SCALAR_BYTES:
            if key == "general.alignment":
                if vtype != _UINT32:
                    raise bad("general.alignment must be a uint32")
                alignment = u32("general.alignment")
                if alignment == 0 or alignment & (alignment - 1):
                    raise bad(f"general.alignment {alignment} is not a power of two")
                continue
            need(_SCALAR_BYTES[vtype], f"the value of {key!r}")
            pos += _SCALAR_BYTES[vtype]
        elif vtype == _STRING:
            string(f"the value of {key!r}")
        elif vtype == _ARRAY:
            etype = u32(f"the element type of {key!r}")
            count = u64(f"the length of {key!r}")
            if etype in _SCALAR_BYTES:
                need(count * _SCALAR_BYTES[etype], f"the {count} values of {key!r}")
                pos += count * _SCALAR_BYTES[etype]
            elif etype == _STRING:
                if count > (size - pos) // 8:
                    raise bad(f"{count} strings of {key!r} cannot fit in the file")
                for i in range(count):
                    string(f"{key}[{i}]")
            else:
                raise bad(f"{key!r} is an array of value type {etype} (nested arrays and unknown "
                          "types are not supported)")
        else:
            raise bad(f"{key!r} has unknown value type {vtype}")
    infos = []
    names = set()
    for _ in range(n_tensors):
        name = string("a tensor name")
        if name in names:
            raise bad(f"duplicate tensor {name!r}")
        names.add(name)
        n_dims = u32(f"the dimension count of {name!r}")
        if n_dims > _MAX_DIMS:
            raise bad(f"tensor {name!r} has {n_dims} dimensions; at most {_MAX_DIMS}")
        dims = [u64(f"the dimensions of {name!r}") for _ in range(n_dims)]
        ttype = u32(f"the type of {name!r}")
        try:
            qtype = gguf.GGMLQuantizationType(ttype)
            block, type_size = gguf.GGML_QUANT_SIZES[qtype]
        except (ValueError, KeyError):
            raise bad(f"tensor {name!r} has unknown type {ttype}") from None
        if dims and dims[0] % block:
            raise bad(f"tensor {name!r}: {dims[0]} values per row is not a multiple of "
                      f"{qtype.name}'s block of {block}")
        n = 1
        for d in dims:
            n *= d
        offset = u64(f"the data offset of {name!r}")
        infos.append((offset, n // block * type_size, name))
    start = pos + (-pos % alignment)
    end_prev, prev = start, None
    for offset, nbytes, name in sorted(infos):
        lo, hi = start + offset, start + offset + nbytes
        if hi > size:
            raise bad(f"tensor {name!r} data (bytes {lo} to {hi}) runs past the end of the file "
                      f"({size} bytes)")
        if lo < end_prev:
            raise bad(f"tensor {name!r} data (from byte {lo}) overlaps "
                      + (f"tensor {prev!r}" if prev else "the header"))
        end_prev, prev = hi, name


def _field(reader, key: str, default: Any = None) -> Any:
    f = reader.fields.get(key)
    if f is None:
        return default
    gguf = _gguf()
    try:
        v = f.contents()
    except Exception as e:  # noqa: BLE001 - gguf decodes the raw parts here
        raise ValueError(f"GGUF metadata {key!r} cannot be read ({type(e).__name__}: "
                         f"{e})") from None
    if f.types == [gguf.GGUFValueType.FLOAT32] and isinstance(v, float):
        v = float(str(np.float32(v)))  # shortest repr: 1e-05, not 9.999999747378752e-06
    return v


def _typed(reader, key: str, kind, what: str, default: Any = None) -> Any:
    """Metadata ``key`` when it is a ``kind`` (``str``, ``int``, ``list`` of ``str``...);
    ValueError naming the key, its value and ``what`` it must be otherwise."""
    v = _field(reader, key)
    if v is None:
        return default
    ok = (isinstance(v, list) and all(isinstance(x, kind[0]) and not isinstance(x, bool)
                                      for x in v)) if isinstance(kind, list) else (
        isinstance(v, kind) and (kind is bool or not isinstance(v, bool)))
    if not ok:
        text = repr(v)
        raise ValueError(f"GGUF metadata {key} must be {what}; got "
                         f"{text if len(text) <= 80 else text[:77] + '...'}")
    return v


def _require(reader, key: str) -> Any:
    v = _field(reader, key)
    if v is None:
        raise ValueError(f"GGUF metadata lacks required key {key!r}")
    return v


def _architecture(reader) -> str:
    arch = _field(reader, "general.architecture")
    if arch is None:
        raise ValueError("GGUF metadata lacks 'general.architecture'")
    if not isinstance(arch, str) or arch not in SUPPORTED_ARCHITECTURES:
        raise ValueError(
            f"unsupported GGUF architecture {arch!r}; supported: {', '.join(SUPPORTED_ARCHITECTURES)}")
    return arch


# --------------------------------------------------------------------------------------------
# config


def _config_keys(arch: str) -> Dict[str, str]:
    """The GGUF metadata key each config value comes from (for error messages)."""
    keys = {"hidden_size": "embedding_length", "intermediate_size": "feed_forward_length",
            "num_hidden_layers": "block_count", "num_attention_heads": "attention.head_count",
            "num_key_value_heads": "attention.head_count_kv", "head_dim": "attention.key_length",
            "rms_norm_eps": "attention.layer_norm_rms_epsilon", "rope_theta": "rope.freq_base",
            "max_position_embeddings": "context_length",
            "rope_scaling.factor": "rope.scaling.factor",
            "rope_scaling.rope_type": "rope.scaling.type"}
    out = {k: f"{arch}.{v}" for k, v in keys.items()}
    out.update({"vocab_size": "vocab_size (the rows of token_embd.weight)",
                "bos_token_id": "tokenizer.ggml.bos_token_id",
                "eos_token_id": "tokenizer.ggml.eos_token_id",
                "pad_token_id": "tokenizer.ggml.padding_token_id"})
    return out


def build_config(reader, source: str = "GGUF metadata") -> Dict[str, Any]:
    """A Hugging Face ``LlamaForCausalLM`` config dict from the GGUF metadata, checked by
    :meth:`ModelConfig.from_dict` (the same checks as a ``config.json``; errors name the GGUF
    key)."""
    from pyspec.models.config import ModelConfig

    arch = _architecture(reader)
    tensors = {t.name: t for t in reader.tensors}
    if "token_embd.weight" not in tensors:
        raise ValueError("GGUF file has no 'token_embd.weight' tensor")
    if "rope_freqs.weight" in tensors:
        raise ValueError("GGUF file uses per-frequency rope factors (rope_freqs.weight, Llama 3.1 "
                         "style rope scaling), which this converter does not support")
    embd = [int(d) for d in tensors["token_embd.weight"].shape]  # ggml order: [hidden, vocab]
    if len(embd) != 2:
        raise ValueError(f"GGUF tensor 'token_embd.weight' must be 2-D; it has shape "
                         f"{tuple(reversed(embd))}")
    rope_scaling = None
    scaling_type = _field(reader, f"{arch}.rope.scaling.type")
    if scaling_type not in (None, "none"):
        if scaling_type != "linear":
            raise ValueError(f"unsupported rope scaling type {scaling_type!r}")
        rope_scaling = {"rope_type": "linear",
                        "factor": _require(reader, f"{arch}.rope.scaling.factor")}
    config = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": _require(reader, f"{arch}.embedding_length"),
        "intermediate_size": _require(reader, f"{arch}.feed_forward_length"),
        "num_hidden_layers": _require(reader, f"{arch}.block_count"),
        "num_attention_heads": _require(reader, f"{arch}.attention.head_count"),
        "num_key_value_heads": _field(reader, f"{arch}.attention.head_count_kv"),
        "head_dim": _field(reader, f"{arch}.attention.key_length"),
        "hidden_act": "silu",
        "rms_norm_eps": _field(reader, f"{arch}.attention.layer_norm_rms_epsilon", 1e-5),
        "rope_theta": _field(reader, f"{arch}.rope.freq_base", 10000.0),
        "rope_scaling": rope_scaling,
        "max_position_embeddings": _field(reader, f"{arch}.context_length", 2048),
        "vocab_size": embd[1],
        "tie_word_embeddings": "output.weight" not in tensors,
        "attention_bias": False,
        "mlp_bias": False,
        "bos_token_id": _field(reader, "tokenizer.ggml.bos_token_id"),
        "eos_token_id": _field(reader, "tokenizer.ggml.eos_token_id"),
        "pad_token_id": _field(reader, "tokenizer.ggml.padding_token_id"),
        "initializer_range": 0.02,
        "torch_dtype": "float32",
        "use_cache": True,
    }
    keys = _config_keys(arch)
    cfg = ModelConfig.from_dict(config, source=source, key_names=keys)
    # What the dict left to defaults, as the check resolved it.
    config.update(num_key_value_heads=cfg.num_key_value_heads, head_dim=cfg.head_dim)
    pad = config["pad_token_id"]
    if pad is not None and not (isinstance(pad, int) and not isinstance(pad, bool)
                                and 0 <= pad < cfg.vocab_size):
        raise ValueError(f"{source}: {keys['pad_token_id']} must be a token id in [0, "
                         f"{cfg.vocab_size}); got {pad!r}")
    for key, why in ((f"{arch}.attention.value_length", "value heads of another size"),
                     (f"{arch}.rope.dimension_count", "partial rotary embeddings")):
        v = _field(reader, key)
        if v is not None and v != cfg.head_dim:
            raise ValueError(f"{source}: {key} must equal the head dimension ({cfg.head_dim}; "
                             f"{why} are not supported); got {v!r}")
    return config


# --------------------------------------------------------------------------------------------
# tensors


def permute_qk(w: np.ndarray, n_head: int) -> np.ndarray:
    """Hugging Face -> llama.cpp row order of a Q or K projection (pairs rotary halves)."""
    rows = w.shape[0]
    return (w.reshape(n_head, 2, rows // n_head // 2, *w.shape[1:])
            .swapaxes(1, 2).reshape(w.shape))


def unpermute_qk(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp -> Hugging Face row order of a Q or K projection (inverse of :func:`permute_qk`).

    *n_head* is the number of heads the projection produces: attention heads for Q, KV heads
    for K.
    """
    rows = w.shape[0]
    if rows % (2 * n_head):
        raise ValueError(f"cannot un-permute {rows} rows into {n_head} heads of even size")
    return np.ascontiguousarray(
        w.reshape(n_head, rows // n_head // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape))


_LAYER_NAMES = {
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_output.weight": "self_attn.o_proj.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
    "attn_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
}
_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}


def hf_tensor_name(gguf_name: str, n_layers: int) -> str:
    """The Hugging Face name of a GGUF tensor; ValueError for a tensor the converter does not know."""
    if gguf_name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[gguf_name]
    parts = gguf_name.split(".", 2)
    if len(parts) == 3 and parts[0] == "blk" and parts[1].isdigit() and parts[2] in _LAYER_NAMES:
        i = int(parts[1])
        if i >= n_layers:
            raise ValueError(f"tensor {gguf_name!r} is past the last layer ({n_layers} layers)")
        return f"model.layers.{i}.{_LAYER_NAMES[parts[2]]}"
    raise ValueError(f"unsupported tensor {gguf_name!r} in a llama GGUF file")


def _dequantize(t) -> np.ndarray:
    gguf = _gguf()
    shape = tuple(int(d) for d in reversed(t.shape))  # ggml lists the fastest dimension first
    try:
        w = gguf.quants.dequantize(np.asarray(t.data), t.tensor_type)
    except NotImplementedError as e:
        raise ValueError(f"tensor {t.name!r}: unsupported GGUF tensor type "
                         f"{t.tensor_type.name}") from e
    except Exception as e:
        raise ValueError(f"tensor {t.name!r}: cannot dequantize {t.tensor_type.name} data "
                         f"({type(e).__name__}: {e})") from e
    if w.size != int(np.prod(shape)):
        raise ValueError(f"tensor {t.name!r}: {w.size} values after dequantization, "
                         f"expected shape {shape}")
    return np.ascontiguousarray(w.reshape(shape), dtype=np.float32)


def _plan_tensors(reader, config: Dict[str, Any]) -> List[Tuple[str, Any, Tuple[int, ...]]]:
    """(hf_name, reader tensor, hf shape) for every tensor, in file order; checks names/shapes."""
    from pyspec.models.config import ModelConfig
    from pyspec.models.loader import _Shapes

    n_layers = config["num_hidden_layers"]
    plan = []
    seen = set()
    for t in reader.tensors:
        name = hf_tensor_name(t.name, n_layers)
        if name in seen:
            raise ValueError(f"duplicate tensor {t.name!r}")
        seen.add(name)
        plan.append((name, t, tuple(int(d) for d in reversed(t.shape))))
    # Looked up per tensor: the block count is a claim of the metadata (2**31 layers must not
    # make a table of that many names).
    shapes = _Shapes(ModelConfig.from_dict(config, source="GGUF metadata"))
    required = sum(shapes.get(name)[1] for name, _, _ in plan)
    if required < shapes.count:
        missing = shapes.missing(seen, limit=6)
        raise ValueError(f"GGUF file lacks tensors: {', '.join(missing[:5])}"
                         + (" ..." if shapes.count - required > 5 else ""))
    for name, t, shape in plan:
        want = shapes.get(name)[0]
        if shape != want:
            raise ValueError(f"tensor {t.name!r} has shape {shape}, expected {want} "
                             "(from the GGUF metadata)")
    return plan


def _write_safetensors(path: str, items: List[Tuple[str, Tuple[int, ...]]], produce,
                       progress: bool = False, desc: str = "converting") -> None:
    """Stream float32 tensors into a safetensors file: *produce(i)* returns tensor *i*."""
    header: Dict[str, Any] = {"__metadata__": {"format": "pt"}}
    offset = 0
    for name, shape in items:
        n = int(np.prod(shape)) * 4
        header[name] = {"dtype": "F32", "shape": list(shape), "data_offsets": [offset, offset + n]}
        offset += n
    blob = json.dumps(header, separators=(",", ":")).encode("utf-8")
    blob += b" " * (-len(blob) % 8)
    bar = None
    if progress:
        from tqdm.auto import tqdm

        bar = tqdm(total=offset, unit="B", unit_scale=True, desc=desc)
    try:
        with open(path, "wb") as f:
            f.write(struct.pack("<Q", len(blob)))
            f.write(blob)
            for i, (name, shape) in enumerate(items):
                w = produce(i)
                if w.shape != tuple(shape) or w.dtype != np.float32:
                    raise AssertionError(f"{name}: produced {w.dtype}{w.shape}, planned {shape}")
                f.write(np.ascontiguousarray(w).astype("<f4", copy=False).tobytes())
                if bar is not None:
                    bar.update(w.nbytes)
            f.flush()
            os.fsync(f.fileno())
    finally:
        if bar is not None:
            bar.close()


# --------------------------------------------------------------------------------------------
# tokenizer


def _token_strings(reader) -> List[str]:
    tokens = _typed(reader, "tokenizer.ggml.tokens", [str], "a list of strings")
    if not tokens:
        raise ValueError("GGUF metadata has no tokenizer (tokenizer.ggml.tokens)")
    return tokens


def _token_types(reader, tokens: List[str]) -> List[int]:
    types = _typed(reader, "tokenizer.ggml.token_type", [int], "a list of integers") or \
        [1] * len(tokens)
    if len(types) != len(tokens):
        raise ValueError(f"{len(types)} token types for {len(tokens)} tokens")
    return types


def _token_id(reader, key: str, tokens: List[str]) -> Optional[int]:
    """Metadata ``key`` (a special token's id) checked to be a token of the vocabulary."""
    i = _typed(reader, key, int, "a token id")
    if i is not None and not 0 <= i < len(tokens):
        raise ValueError(f"GGUF metadata {key} must be a token id in [0, {len(tokens)}) (the "
                         f"tokens of tokenizer.ggml.tokens); got {i}")
    return i


def build_tokenizer(reader):
    """A ``tokenizers.Tokenizer`` equivalent to the GGUF's byte-level BPE vocabulary."""
    kind = _field(reader, "tokenizer.ggml.model")
    if not isinstance(kind, str) or kind != "gpt2":
        raise ValueError(f"unsupported GGUF tokenizer model {kind!r}; only byte-level BPE "
                         "('gpt2') vocabularies are supported")
    pre = _field(reader, "tokenizer.ggml.pre", "default")
    if not isinstance(pre, str) or pre not in _PRE_TOKENIZERS:
        raise ValueError(f"unsupported GGUF pre-tokenizer {pre!r}; supported: "
                         f"{', '.join(sorted(_PRE_TOKENIZERS))}")
    tokens = _token_strings(reader)
    merges = _typed(reader, "tokenizer.ggml.merges", [str], "a list of strings")
    if not merges:
        raise ValueError("GGUF byte-level BPE vocabulary has no merges (tokenizer.ggml.merges)")
    types = _token_types(reader, tokens)
    bos = _token_id(reader, "tokenizer.ggml.bos_token_id", tokens)
    eos = _token_id(reader, "tokenizer.ggml.eos_token_id", tokens)
    add_bos = _typed(reader, "tokenizer.ggml.add_bos_token", bool, "true or false", False)
    add_eos = _typed(reader, "tokenizer.ggml.add_eos_token", bool, "true or false", False)
    try:
        return _make_tokenizer(tokens, merges, types, pre, bos if add_bos else None,
                               eos if add_eos else None)
    except ValueError:
        raise
    except Exception as e:  # noqa: BLE001 - tokenizers raises bare Exceptions
        raise ValueError(f"the GGUF vocabulary does not make a tokenizer ({type(e).__name__}: "
                         f"{e})") from None


def _make_tokenizer(tokens, merges, types, pre, bos, eos):
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers, processors

    vocab: Dict[str, int] = {}
    for i, tok in enumerate(tokens):
        vocab.setdefault(tok, i)  # first occurrence wins on (rare) duplicates
    pairs = []
    for m in merges:
        a, sep, b = m.partition(" ")
        if not sep:
            raise ValueError(f"malformed BPE merge {m!r}")
        pairs.append((a, b))

    tk = Tokenizer(models.BPE(vocab=vocab, merges=pairs, dropout=None, unk_token=None,
                              fuse_unk=False, byte_fallback=False))
    digits, split = _PRE_TOKENIZERS[pre]
    steps = []
    if digits:
        steps.append(pre_tokenizers.Digits(individual_digits=True))
    if split is None:
        steps.append(pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True))
    else:
        steps.append(pre_tokenizers.Split(Regex(split), behavior="isolated", invert=False))
        steps.append(pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False))
    tk.pre_tokenizer = steps[0] if len(steps) == 1 else pre_tokenizers.Sequence(steps)
    tk.decoder = decoders.ByteLevel()

    special = [AddedToken(tokens[i], special=True, normalized=False)
               for i, ty in enumerate(types) if ty == _TOKEN_CONTROL]
    user = [AddedToken(tokens[i], special=False, normalized=False)
            for i, ty in enumerate(types) if ty == _TOKEN_USER_DEFINED]
    if special:
        tk.add_special_tokens(special)
    if user:
        tk.add_tokens(user)

    add_bos, add_eos = bos is not None, eos is not None
    if add_bos or add_eos:
        b, e = (tokens[int(bos)] if add_bos else None), (tokens[int(eos)] if add_eos else None)
        single = ([b] if b else []) + ["$A"] + ([e] if e else [])
        pair = single + ([f"{b}:1"] if b else []) + ["$B:1"] + ([f"{e}:1"] if e else [])
        specials = sorted({(b, int(bos)) if b else None, (e, int(eos)) if e else None} - {None})
        tk.post_processor = processors.TemplateProcessing(
            single=" ".join(single), pair=" ".join(pair), special_tokens=specials)
    else:
        tk.post_processor = processors.ByteLevel(trim_offsets=False)
    if tk.get_vocab_size(with_added_tokens=True) != len(tokens):
        raise ValueError(f"tokenizer has {tk.get_vocab_size(with_added_tokens=True)} entries, "
                         f"the GGUF lists {len(tokens)} tokens (duplicate token strings?)")
    return tk


def build_tokenizer_config(reader, config: Dict[str, Any]) -> Dict[str, Any]:
    tokens = _token_strings(reader)
    types = _token_types(reader, tokens)

    def tok(key):
        i = _field(reader, key)
        ok = isinstance(i, int) and not isinstance(i, bool) and 0 <= i < len(tokens)
        return tokens[i] if ok else None

    added = {}
    for i, ty in enumerate(types):
        if ty in (_TOKEN_CONTROL, _TOKEN_USER_DEFINED):
            added[str(i)] = {"content": tokens[i], "lstrip": False, "normalized": False,
                             "rstrip": False, "single_word": False,
                             "special": ty == _TOKEN_CONTROL}
    out = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "add_bos_token": _typed(reader, "tokenizer.ggml.add_bos_token", bool, "true or false",
                                False),
        "add_eos_token": _typed(reader, "tokenizer.ggml.add_eos_token", bool, "true or false",
                                False),
        "bos_token": tok("tokenizer.ggml.bos_token_id"),
        "eos_token": tok("tokenizer.ggml.eos_token_id"),
        "unk_token": tok("tokenizer.ggml.unknown_token_id"),
        "pad_token": tok("tokenizer.ggml.padding_token_id"),
        "clean_up_tokenization_spaces": False,
        "model_max_length": config["max_position_embeddings"],
        "added_tokens_decoder": added,
    }
    template = _typed(reader, "tokenizer.chat_template", str, "a string")
    if template:
        out["chat_template"] = template
    return {k: v for k, v in out.items() if v is not None}


def build_generation_config(config: Dict[str, Any]) -> Dict[str, Any]:
    out = {k: config[k] for k in ("bos_token_id", "eos_token_id", "pad_token_id")
           if config.get(k) is not None}
    out["_from_model_config"] = True
    return out


# --------------------------------------------------------------------------------------------
# driver


def _write_json(path: str, obj: Any) -> None:
    with open(path, "w", encoding="utf-8") as f:
        json.dump(obj, f, indent=2, ensure_ascii=False)
        f.write("\n")


def convert_into(gguf_path: str, out_dir: str, *, progress: bool = False) -> Dict[str, Any]:
    """Write the converted checkpoint into the existing, empty folder *out_dir* (not atomic).

    Returns the model config. Everything is validated before the weights are written.
    """
    reader = open_gguf(gguf_path)
    config = build_config(reader, source=os.fspath(gguf_path))
    tokenizer = build_tokenizer(reader)
    if tokenizer.get_vocab_size(with_added_tokens=True) > config["vocab_size"]:
        raise ValueError(f"tokenizer has {tokenizer.get_vocab_size(with_added_tokens=True)} "
                         f"tokens, the embedding only {config['vocab_size']} rows")
    plan = _plan_tensors(reader, config)
    n_head, n_kv = config["num_attention_heads"], config["num_key_value_heads"]
    supported = _supported_types()
    for _, t, _ in plan:  # fail on an unsupported type before writing anything
        if supported is not None and t.tensor_type.name not in supported:
            raise ValueError(f"tensor {t.name!r}: unsupported GGUF tensor type {t.tensor_type.name}")

    def produce(i: int) -> np.ndarray:
        name, t, _ = plan[i]
        w = _dequantize(t)
        if name.endswith("q_proj.weight"):
            w = unpermute_qk(w, n_head)
        elif name.endswith("k_proj.weight"):
            w = unpermute_qk(w, n_kv)
        return w

    _write_safetensors(os.path.join(out_dir, "model.safetensors"),
                       [(name, shape) for name, _, shape in plan], produce, progress=progress,
                       desc=f"converting {os.path.basename(os.fspath(gguf_path))}")
    _write_json(os.path.join(out_dir, "config.json"), config)
    tokenizer.save(os.path.join(out_dir, "tokenizer.json"))
    _write_json(os.path.join(out_dir, "tokenizer_config.json"),
                build_tokenizer_config(reader, config))
    _write_json(os.path.join(out_dir, "generation_config.json"), build_generation_config(config))
    st = os.stat(gguf_path)
    _write_json(os.path.join(out_dir, MARKER_FILE), {
        "converter_version": CONVERTER_VERSION,
        "source": os.path.basename(os.fspath(gguf_path)),
        "source_bytes": st.st_size,
        "dtype": "float32",
    })
    return config


def _supported_types() -> Optional[set]:
    """Names of the tensor types gguf can dequantize, or None when it cannot say."""
    gguf = _gguf()
    traits = getattr(gguf.quants, "_type_traits", None)
    if not isinstance(traits, dict):
        return None
    return {"F32", "F16"} | {q.name for q in traits}


def make_temp_dir(out_dir: str) -> str:
    """A fresh hidden folder next to *out_dir* (same file system, so it can be renamed onto it)."""
    tmp = tempfile.mkdtemp(prefix=f".{os.path.basename(out_dir)}.tmp-",
                           dir=os.path.dirname(out_dir))
    mask = os.umask(0)
    os.umask(mask)
    os.chmod(tmp, 0o777 & ~mask)  # mkdtemp makes it private; the result is an ordinary folder
    return tmp


def convert_gguf(gguf_path: str, out_dir: str, *, progress: bool = False) -> str:
    """Convert *gguf_path* into the Hugging Face folder *out_dir* and return its path.

    *out_dir* must not exist or be empty. The folder is written under a temporary name next to
    it and renamed into place at the end, so an interrupted conversion leaves no partial folder.
    """
    out_dir = os.path.abspath(os.fspath(out_dir))
    if os.path.exists(out_dir):
        if not os.path.isdir(out_dir) or os.listdir(out_dir):
            raise ValueError(f"{out_dir} exists and is not an empty directory")
    parent = os.path.dirname(out_dir)
    os.makedirs(parent, exist_ok=True)
    tmp = make_temp_dir(out_dir)
    try:
        convert_into(gguf_path, tmp, progress=progress)
        if os.path.isdir(out_dir):
            os.rmdir(out_dir)  # empty (checked above); fails if someone filled it meanwhile
        os.rename(tmp, out_dir)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out_dir
