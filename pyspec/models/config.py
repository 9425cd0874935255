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
    def from_dict(cls, d: Dict[str, Any], source: str = "config") -> "ModelConfig":
        d = {k: v for k, v in d.items() if v is not None}  # null means "not set"
        def need(key):
            if key not in d:
                raise ValueError(f"{source}: missing required field '{key}'")
            return d[key]

        def positive_int(key, value):
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ValueError(f"{source}: '{key}' must be a positive integer; got {value!r}")
            return value

        archs = d.get("architectures") or []
        model_type = d.get("model_type")
        if archs and not any(a in SUPPORTED_ARCHITECTURES for a in archs):
            raise ValueError(f"{source}: unsupported architecture {archs}; supported: "
                             f"{sorted(SUPPORTED_ARCHITECTURES)}")
        if model_type is None and archs:
            model_type = next(SUPPORTED_ARCHITECTURES[a] for a in archs if a in SUPPORTED_ARCHITECTURES)
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise ValueError(f"{source}: unsupported model_type {model_type!r}; supported: "
                             f"{sorted(SUPPORTED_MODEL_TYPES)}")
        hidden = positive_int("hidden_size", need("hidden_size"))
        heads = positive_int("num_attention_heads", need("num_attention_heads"))
        kv_heads = positive_int("num_key_value_heads", d.get("num_key_value_heads") or heads)
        if heads % kv_heads:
            raise ValueError(f"{source}: num_attention_heads ({heads}) must be a multiple of "
                             f"num_key_value_heads ({kv_heads})")
        head_dim = d.get("head_dim") or hidden // heads
        positive_int("head_dim", head_dim)
        if head_dim % 2:
            raise ValueError(f"{source}: head_dim must be even for RoPE; got {head_dim}")
        # transformers 4 writes "rope_scaling" (+ top-level rope_theta); 5 writes "rope_parameters"
        # holding rope_theta too.
        rs = d.get("rope_parameters") or d.get("rope_scaling") or {}
        if not isinstance(rs, dict):
            raise ValueError(f"{source}: rope_scaling/rope_parameters must be an object; got {rs!r}")
        rope_theta = float(rs.get("rope_theta", d.get("rope_theta", 10000.0)))
        act = d.get("hidden_act", "silu")
        if act not in ("silu", "swish"):
            raise ValueError(f"{source}: unsupported hidden_act {act!r}; supported: 'silu'")
        if d.get("mlp_bias"):
            raise ValueError(f"{source}: mlp_bias=true is not supported")
        rope_type = rs.get("rope_type") or rs.get("type") or "default"
        if rope_type not in ROPE_TYPES:
            raise ValueError(f"{source}: unsupported rope_scaling type {rope_type!r}; supported: "
                             f"{sorted(ROPE_TYPES)}")
        factor = float(rs.get("factor", 1.0))
        if rope_type != "default" and not (math.isfinite(factor) and factor >= 1.0):
            raise ValueError(f"{source}: rope_scaling.factor must be >= 1; got {factor}")
        scaling = RopeScaling(
            rope_type=rope_type, factor=factor,
            low_freq_factor=float(rs.get("low_freq_factor", 1.0)),
            high_freq_factor=float(rs.get("high_freq_factor", 4.0)),
            original_max_position_embeddings=int(rs.get("original_max_position_embeddings", 8192)))
        # Qwen2 configs carry a sliding_window that is off unless use_sliding_window is set.
        sliding = (d.get("sliding_window")
                   if d.get("use_sliding_window", model_type != "qwen2") else None)
        return cls(
            model_type=model_type,
            vocab_size=positive_int("vocab_size", need("vocab_size")),
            hidden_size=hidden,
            intermediate_size=positive_int("intermediate_size", need("intermediate_size")),
            num_hidden_layers=positive_int("num_hidden_layers", need("num_hidden_layers")),
            num_attention_heads=heads,
            num_key_value_heads=kv_heads,
            head_dim=head_dim,
            rms_norm_eps=float(d.get("rms_norm_eps", 1e-6)),
            rope_theta=rope_theta,
            rope_scaling=scaling,
            max_position_embeddings=int(d.get("max_position_embeddings", 2048)),
            tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
            # Qwen2 always has q/k/v biases; Llama-family configs say so with attention_bias.
            attention_bias=bool(d.get("attention_bias", model_type == "qwen2")),
            sliding_window=int(sliding) if sliding else None,
            bos_token_id=d.get("bos_token_id"),
            eos_token_id=d.get("eos_token_id"),
            torch_dtype=d.get("torch_dtype") or d.get("dtype"),
            raw=dict(d),
        )

    @classmethod
    def from_file(cls, path: str) -> "ModelConfig":
        if os.path.isdir(path):
            path = os.path.join(path, "config.json")
        if not os.path.isfile(path):
            raise ValueError(f"no config.json at {path}")
        try:
            with open(path, encoding="utf-8") as f:
                d = json.load(f)
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise ValueError(f"{path} is not valid JSON: {e}") from None
        if not isinstance(d, dict):
            raise ValueError(f"{path} must hold a JSON object")
        return cls.from_dict(d, source=path)
