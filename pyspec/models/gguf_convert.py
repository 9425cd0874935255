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


def _field(reader, key: str, default: Any = None) -> Any:
    f = reader.fields.get(key)
    if f is None:
        return default
    gguf = _gguf()
    v = f.contents()
    if f.types and f.types[0] == gguf.GGUFValueType.FLOAT32:
        v = float(str(np.float32(v)))  # shortest repr: 1e-05, not 9.999999747378752e-06
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
    if arch not in SUPPORTED_ARCHITECTURES:
        raise ValueError(
            f"unsupported GGUF architecture {arch!r}; supported: {', '.join(SUPPORTED_ARCHITECTURES)}")
    return arch


# --------------------------------------------------------------------------------------------
# config


def build_config(reader) -> Dict[str, Any]:
    """A Hugging Face ``LlamaForCausalLM`` config dict from the GGUF metadata."""
    arch = _architecture(reader)
    tensors = {t.name: t for t in reader.tensors}
    if "token_embd.weight" not in tensors:
        raise ValueError("GGUF file has no 'token_embd.weight' tensor")
    if "rope_freqs.weight" in tensors:
        raise ValueError("GGUF file uses per-frequency rope factors (rope_freqs.weight, Llama 3.1 "
                         "style rope scaling), which this converter does not support")
    hidden = int(_require(reader, f"{arch}.embedding_length"))
    n_head = int(_require(reader, f"{arch}.attention.head_count"))
    n_kv = int(_field(reader, f"{arch}.attention.head_count_kv", n_head))
    head_dim = int(_field(reader, f"{arch}.attention.key_length", hidden // n_head))
    v_dim = int(_field(reader, f"{arch}.attention.value_length", head_dim))
    if v_dim != head_dim:
        raise ValueError(f"key_length {head_dim} != value_length {v_dim} is not supported")
    rope_dim = int(_field(reader, f"{arch}.rope.dimension_count", head_dim))
    if rope_dim != head_dim:
        raise ValueError(f"partial rotary embeddings (rope dim {rope_dim} < head dim {head_dim}) "
                         "are not supported")
    vocab = int(tensors["token_embd.weight"].shape[-1])  # ggml order: [hidden, vocab]
    rope_scaling = None
    scaling_type = _field(reader, f"{arch}.rope.scaling.type")
    if scaling_type not in (None, "none"):
        if scaling_type != "linear":
            raise ValueError(f"unsupported rope scaling type {scaling_type!r}")
        factor = float(_require(reader, f"{arch}.rope.scaling.factor"))
        rope_scaling = {"rope_type": "linear", "factor": factor}
    bos = _field(reader, "tokenizer.ggml.bos_token_id")
    eos = _field(reader, "tokenizer.ggml.eos_token_id")
    pad = _field(reader, "tokenizer.ggml.padding_token_id")
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": hidden,
        "intermediate_size": int(_require(reader, f"{arch}.feed_forward_length")),
        "num_hidden_layers": int(_require(reader, f"{arch}.block_count")),
        "num_attention_heads": n_head,
        "num_key_value_heads": n_kv,
        "head_dim": head_dim,
        "hidden_act": "silu",
        "rms_norm_eps": float(_field(reader, f"{arch}.attention.layer_norm_rms_epsilon", 1e-5)),
        "rope_theta": float(_field(reader, f"{arch}.rope.freq_base", 10000.0)),
        "rope_scaling": rope_scaling,
        "max_position_embeddings": int(_field(reader, f"{arch}.context_length", 2048)),
        "vocab_size": vocab,
        "tie_word_embeddings": "output.weight" not in tensors,
        "attention_bias": False,
        "mlp_bias": False,
        "bos_token_id": None if bos is None else int(bos),
        "eos_token_id": None if eos is None else int(eos),
        "pad_token_id": None if pad is None else int(pad),
        "initializer_range": 0.02,
        "torch_dtype": "float32",
        "use_cache": True,
    }


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
    n_layers = config["num_hidden_layers"]
    plan = []
    seen = set()
    for t in reader.tensors:
        name = hf_tensor_name(t.name, n_layers)
        if name in seen:
            raise ValueError(f"duplicate tensor {t.name!r}")
        seen.add(name)
        plan.append((name, t, tuple(int(d) for d in reversed(t.shape))))
    expected = {"model.embed_tokens.weight", "model.norm.weight"}
    for i in range(n_layers):
        expected.update(f"model.layers.{i}.{v}" for v in _LAYER_NAMES.values())
    missing = sorted(expected - seen)
    if missing:
        raise ValueError(f"GGUF file lacks tensors: {', '.join(missing[:5])}"
                         + (" ..." if len(missing) > 5 else ""))
    h, hd = config["hidden_size"], config["head_dim"]
    want = {"q_proj": (config["num_attention_heads"] * hd, h),
            "k_proj": (config["num_key_value_heads"] * hd, h)}
    for name, t, shape in plan:
        for key, s in want.items():
            if f".{key}." in name and shape != s:
                raise ValueError(f"tensor {t.name!r} has shape {shape}, expected {s}")
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
    tokens = _field(reader, "tokenizer.ggml.tokens")
    if not tokens:
        raise ValueError("GGUF metadata has no tokenizer (tokenizer.ggml.tokens)")
    return tokens


def build_tokenizer(reader):
    """A ``tokenizers.Tokenizer`` equivalent to the GGUF's byte-level BPE vocabulary."""
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers, processors

    kind = _field(reader, "tokenizer.ggml.model")
    if kind != "gpt2":
        raise ValueError(f"unsupported GGUF tokenizer model {kind!r}; only byte-level BPE "
                         "('gpt2') vocabularies are supported")
    pre = _field(reader, "tokenizer.ggml.pre", "default")
    if pre not in _PRE_TOKENIZERS:
        raise ValueError(f"unsupported GGUF pre-tokenizer {pre!r}; supported: "
                         f"{', '.join(sorted(_PRE_TOKENIZERS))}")
    tokens = _token_strings(reader)
    merges = _field(reader, "tokenizer.ggml.merges")
    if not merges:
        raise ValueError("GGUF byte-level BPE vocabulary has no merges (tokenizer.ggml.merges)")
    types = _field(reader, "tokenizer.ggml.token_type") or [1] * len(tokens)
    if len(types) != len(tokens):
        raise ValueError(f"{len(types)} token types for {len(tokens)} tokens")
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

    bos = _field(reader, "tokenizer.ggml.bos_token_id")
    eos = _field(reader, "tokenizer.ggml.eos_token_id")
    add_bos = bool(_field(reader, "tokenizer.ggml.add_bos_token", False)) and bos is not None
    add_eos = bool(_field(reader, "tokenizer.ggml.add_eos_token", False)) and eos is not None
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
    types = _field(reader, "tokenizer.ggml.token_type") or [1] * len(tokens)

    def tok(key):
        i = _field(reader, key)
        return tokens[int(i)] if i is not None and 0 <= int(i) < len(tokens) else None

    added = {}
    for i, ty in enumerate(types):
        if ty in (_TOKEN_CONTROL, _TOKEN_USER_DEFINED):
            added[str(i)] = {"content": tokens[i], "lstrip": False, "normalized": False,
                             "rstrip": False, "single_word": False,
                             "special": ty == _TOKEN_CONTROL}
    out = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "add_bos_token": bool(_field(reader, "tokenizer.ggml.add_bos_token", False)),
        "add_eos_token": bool(_field(reader, "tokenizer.ggml.add_eos_token", False)),
        "bos_token": tok("tokenizer.ggml.bos_token_id"),
        "eos_token": tok("tokenizer.ggml.eos_token_id"),
        "unk_token": tok("tokenizer.ggml.unknown_token_id"),
        "pad_token": tok("tokenizer.ggml.padding_token_id"),
        "clean_up_tokenization_spaces": False,
        "model_max_length": config["max_position_embeddings"],
        "added_tokens_decoder": added,
    }
    template = _field(reader, "tokenizer.chat_template")
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
    config = build_config(reader)
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
