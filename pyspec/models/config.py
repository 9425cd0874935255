"""Model configuration parsed from a Hugging Face ``config.json`` (Llama, Mistral, Qwen2 families)."""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass, field
from typing import Any, Dict, Optional

SUPPORTED_ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",
}
SUPPORTED_MODEL_TYPES = {"llama", "mistral", "qwen2"}
ROPE_TYPES = {"default", "linear", "dynamic", "llama3"}
# The torch_dtype (transformers 5: dtype) values a config may name; the weights are converted to
# the dtype the caller asks for whatever it says.
_CONFIG_DTYPES = ("float32", "float16", "bfloat16", "float64")
# Sizes go to the core's kernels as 32-bit ints.
_MAX_INT = 2**31 - 1


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_number(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def _finite(v) -> bool:
    try:
        return math.isfinite(v)
    except OverflowError:  # an int past float's range
        return False


def _show(v, limit: int = 80) -> str:
    """A config value as its JSON text (shortened): what the user sees in their file."""
    try:
        text = json.dumps(v, ensure_ascii=False)
    except (TypeError, ValueError):
        text = repr(v)
    return text if len(text) <= limit else text[:limit - 3] + "..."


@dataclass
class RopeScaling:
    """RoPE variant. ``default``: none; ``linear``: positions / factor; ``dynamic``: NTK-aware base
    growth past ``max_position_embeddings``; ``llama3``: Llama 3.1 wavelength-dependent scaling."""

    rope_type: str = "default"
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192


@dataclass
class ModelConfig:
    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: RopeScaling = field(default_factory=RopeScaling)
    max_position_embeddings: int = 2048
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    sliding_window: Optional[int] = None
    bos_token_id: Optional[int] = None
    eos_token_id: Any = None
    torch_dtype: Optional[str] = None
    raw: Dict[str, Any] = field(default_factory=dict, repr=False)

    @property
    def q_size(self) -> int:
        return self.num_attention_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_key_value_heads * self.head_dim

    @property
    def context_limit(self) -> int:
        """The most tokens (prompt + new) a request may span: the sliding window, and the
        trained context unless dynamic RoPE scaling extends it."""
        return min(self.sliding_window or (1 << 62), self.max_position_embeddings
                   if self.rope_scaling.rope_type != "dynamic" else (1 << 62))

    @classmethod
    def from_dict(cls, d: Dict[str, Any], source: str = "config",
                  key_names: Optional[Dict[str, str]] = None) -> "ModelConfig":
        """The config of a Hugging Face ``config.json`` dict (the GGUF converter maps a GGUF's
        metadata into the same dict). Every value the model uses is checked here, once: a bad
        one is a one-line ValueError naming ``source``, the key, the value and what is allowed.
        ``key_names``: how to name a key in those messages where the dict was mapped from
        another format (``{"rms_norm_eps": "llama.attention.layer_norm_rms_epsilon"}``)."""
        if not isinstance(d, dict):
            raise ValueError(f"{source}: must hold a JSON object; got {_show(d)}")
        d = {k: v for k, v in d.items() if v is not None}  # null means "not set"
        names = dict(key_names or {})

        def name(key):
            return names.get(key, key)

        def fail(key, allowed, value):
            raise ValueError(f"{source}: {name(key)} must be {allowed}; got {_show(value)}")

        def need(key):
            if key not in d:
                raise ValueError(f"{source}: missing required field '{name(key)}'")
            return d[key]

        def positive_int(key, value):
            if not _is_int(value) or not 0 < value <= _MAX_INT:
                fail(key, f"a positive integer (at most {_MAX_INT})", value)
            return value

        def positive_float(key, value, minimum=0.0, inclusive=False, bound=None):
            ok = _is_number(value) and _finite(value) and (
                value >= minimum if inclusive else value > minimum)
            if not ok:
                fail(key, f"a finite number {'>=' if inclusive else '>'} {bound or f'{minimum:g}'}",
                     value)
            return float(value)

        def flag(key, default):
            value = d.get(key, default)
            if not isinstance(value, bool):
                fail(key, "true or false", value)
            return value

        archs = d.get("architectures", [])
        if not isinstance(archs, list) or not all(isinstance(a, str) for a in archs):
            fail("architectures", "a list of architecture names", archs)
        model_type = d.get("model_type")
        if archs and not any(a in SUPPORTED_ARCHITECTURES for a in archs):
            raise ValueError(f"{source}: unsupported architecture {archs}; supported: "
                             f"{sorted(SUPPORTED_ARCHITECTURES)}")
        if model_type is None and archs:
            model_type = next(SUPPORTED_ARCHITECTURES[a] for a in archs if a in SUPPORTED_ARCHITECTURES)
        if not isinstance(model_type, str) or model_type not in SUPPORTED_MODEL_TYPES:
            raise ValueError(f"{source}: unsupported model_type {model_type!r}; supported: "
                             f"{sorted(SUPPORTED_MODEL_TYPES)}")
        vocab = positive_int("vocab_size", need("vocab_size"))
        hidden = positive_int("hidden_size", need("hidden_size"))
        inter = positive_int("intermediate_size", need("intermediate_size"))
        layers = positive_int("num_hidden_layers", need("num_hidden_layers"))
        heads = positive_int("num_attention_heads", need("num_attention_heads"))
        kv_heads = positive_int("num_key_value_heads", d.get("num_key_value_heads", heads))
        if heads % kv_heads:
            fail("num_key_value_heads", f"a divisor of {name('num_attention_heads')} ({heads} "
                 f"is not a multiple of {kv_heads})", kv_heads)
        if "head_dim" in d:
            head_dim = positive_int("head_dim", d["head_dim"])
            if head_dim % 2:
                fail("head_dim", "even (RoPE rotates pairs of dimensions)", head_dim)
        else:
            if hidden % heads:
                fail("num_attention_heads", f"a divisor of {name('hidden_size')} ({hidden}) when "
                     f"{name('head_dim')} is not given", heads)
            head_dim = hidden // heads
            if head_dim % 2:
                raise ValueError(f"{source}: {name('head_dim')} ({name('hidden_size')} / "
                                 f"{name('num_attention_heads')} = {hidden} / {heads}) must be "
                                 f"even for RoPE; got {head_dim}")
        # transformers 4 writes "rope_scaling" (+ top-level rope_theta); 5 writes "rope_parameters"
        # holding rope_theta too.
        rs_key = "rope_parameters" if d.get("rope_parameters") else "rope_scaling"
        rs = d.get(rs_key) or {}
        if not isinstance(rs, dict):
            fail(rs_key, "an object (or null)", rs)
        if "rope_theta" in rs:
            rope_theta = positive_float(f"{rs_key}.rope_theta", rs["rope_theta"])
        else:
            rope_theta = positive_float("rope_theta", d.get("rope_theta", 10000.0))
        act = d.get("hidden_act", "silu")
        if act not in ("silu", "swish"):
            fail("hidden_act", '"silu" (or its alias "swish"), the only supported activation', act)
        if flag("mlp_bias", False):
            fail("mlp_bias", "false (MLP biases are not supported)", True)
        type_key = "rope_type" if "rope_type" in rs else "type" if "type" in rs else "rope_type"
        rope_type = rs.get(type_key, "default")
        if not isinstance(rope_type, str) or rope_type not in ROPE_TYPES:
            fail(f"{rs_key}.{type_key}", "one of " + ", ".join(sorted(ROPE_TYPES)) +
                 " (the supported RoPE types)", rope_type)
        scaling = RopeScaling(rope_type=rope_type)
        if rope_type != "default":
            def field_(key, check, *args):
                full = f"{rs_key}.{key}"
                if key not in rs:
                    raise ValueError(f"{source}: {name(full)} must be given for "
                                     f"{name(rs_key)}.{type_key} {_show(rope_type)}")
                return check(full, rs[key], *args)

            scaling.factor = field_("factor", positive_float, 1.0, True)
            if rope_type == "llama3":
                scaling.low_freq_factor = field_("low_freq_factor", positive_float)
                low = scaling.low_freq_factor
                scaling.high_freq_factor = field_("high_freq_factor", positive_float, low, False,
                                                  f"low_freq_factor ({low:g})")
                scaling.original_max_position_embeddings = field_(
                    "original_max_position_embeddings", positive_int)
        max_pos = positive_int("max_position_embeddings", d.get("max_position_embeddings", 2048))
        eps = positive_float("rms_norm_eps", d.get("rms_norm_eps", 1e-6))
        tie = flag("tie_word_embeddings", False)
        # Qwen2 always has q/k/v biases; Llama-family configs say so with attention_bias.
        bias = flag("attention_bias", model_type == "qwen2")
        # Qwen2 configs carry a sliding_window that is off unless use_sliding_window is set.
        sliding = None
        if flag("use_sliding_window", model_type != "qwen2") and "sliding_window" in d:
            sliding = positive_int("sliding_window", d["sliding_window"])

        bos, eos = (_check_token_ids(source, key, d.get(key), vocab, name(key))
                    for key in ("bos_token_id", "eos_token_id"))
        dtype_key = "torch_dtype" if "torch_dtype" in d else "dtype"
        dtype = d.get(dtype_key)
        if dtype is not None and dtype not in _CONFIG_DTYPES:
            fail(dtype_key, "one of " + ", ".join(_CONFIG_DTYPES), dtype)
        return cls(
            model_type=model_type,
            vocab_size=vocab,
            hidden_size=hidden,
            intermediate_size=inter,
            num_hidden_layers=layers,
            num_attention_heads=heads,
            num_key_value_heads=kv_heads,
            head_dim=head_dim,
            rms_norm_eps=eps,
            rope_theta=rope_theta,
            rope_scaling=scaling,
            max_position_embeddings=max_pos,
            tie_word_embeddings=tie,
            attention_bias=bias,
            sliding_window=sliding,
            bos_token_id=bos,
            eos_token_id=eos,
            torch_dtype=dtype,
            raw=dict(d),
        )

    @classmethod
    def from_file(cls, path: str) -> "ModelConfig":
        """The config of a checkpoint folder (or its ``config.json``), checked by
        :meth:`from_dict`; the token ids of a ``generation_config.json`` beside it (its
        end-of-sequence ids stop generation) are checked against the vocabulary too."""
        if os.path.isdir(path):
            path = os.path.join(path, "config.json")
        if not os.path.isfile(path):
            raise ValueError(f"no config.json at {path}")
        cfg = cls.from_dict(_read_object(path), source=path)
        gen = os.path.join(os.path.dirname(path), "generation_config.json")
        if os.path.isfile(gen):
            g = _read_object(gen)
            for key in ("bos_token_id", "eos_token_id"):
                _check_token_ids(gen, key, g.get(key), cfg.vocab_size)
        return cfg


def _read_object(path: str) -> Dict[str, Any]:
    try:
        with open(path, encoding="utf-8") as f:
            d = json.load(f)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"{path} is not valid JSON: {e}") from None
    if not isinstance(d, dict):
        raise ValueError(f"{path} must hold a JSON object")
    return d


def _check_token_ids(source: str, key: str, value: Any, vocab: int, name: Optional[str] = None):
    """``value`` (null, a token id or a list of them) when every id is in [0, vocab)."""
    ids = value if isinstance(value, list) else [value]
    if value is not None and not all(_is_int(i) and 0 <= i < vocab for i in ids):
        raise ValueError(f"{source}: {name or key} must be a token id or a list of token ids in "
                         f"[0, {vocab}) (the model's vocab_size); got {_show(value)}")
    return value
