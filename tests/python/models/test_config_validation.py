"""Model config validation at load (pyspec.models.config.ModelConfig): every config.json value the
model uses is checked as the file is read, each bad one a one-line ValueError naming the file, the
key, the value and what is allowed; a GGUF's metadata, mapped into the same config, goes through
the same check (errors name the GGUF key); the CLI prints such an error as one line."""

import json
import os
import subprocess
import sys

import gguf  # a runtime dependency of pyspec (GGUF conversion)
import pytest

from pyspec.models.config import ModelConfig

BASE = dict(architectures=["LlamaForCausalLM"], model_type="llama", vocab_size=64, hidden_size=32,
            intermediate_size=48, num_hidden_layers=1, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=128, rms_norm_eps=1e-6,
            rope_theta=10000.0, tie_word_embeddings=False, bos_token_id=1, eos_token_id=2,
            torch_dtype="float32", hidden_act="silu")

LLAMA3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
          "original_max_position_embeddings": 64}
INT = "must be a positive integer (at most 2147483647)"
FLOAT = "must be a finite number > 0"
IDS = "must be a token id or a list of token ids in [0, 64) (the model's vocab_size)"

# (changes to BASE, the message after "<file>: ")
BAD = [
    ({"vocab_size": 0}, f"vocab_size {INT}; got 0"),
    ({"vocab_size": "64"}, f'vocab_size {INT}; got "64"'),
    ({"vocab_size": True}, f"vocab_size {INT}; got true"),
    ({"hidden_size": -32}, f"hidden_size {INT}; got -32"),
    ({"hidden_size": 32.0}, f"hidden_size {INT}; got 32.0"),
    ({"intermediate_size": 0}, f"intermediate_size {INT}; got 0"),
    ({"num_hidden_layers": 0}, f"num_hidden_layers {INT}; got 0"),
    ({"num_hidden_layers": 2**31}, f"num_hidden_layers {INT}; got 2147483648"),
    ({"num_attention_heads": 0}, f"num_attention_heads {INT}; got 0"),
    ({"num_attention_heads": 3, "num_key_value_heads": 1},
     "num_attention_heads must be a divisor of hidden_size (32) when head_dim is not given; got 3"),
    ({"num_key_value_heads": 3}, "num_key_value_heads must be a divisor of num_attention_heads "
                                 "(4 is not a multiple of 3); got 3"),
    ({"num_key_value_heads": 8}, "num_key_value_heads must be a divisor of num_attention_heads "
                                 "(4 is not a multiple of 8); got 8"),
    ({"num_key_value_heads": 0}, f"num_key_value_heads {INT}; got 0"),
    ({"head_dim": 0}, f"head_dim {INT}; got 0"),
    ({"head_dim": 7}, "head_dim must be even (RoPE rotates pairs of dimensions); got 7"),
    ({"head_dim": "8"}, f'head_dim {INT}; got "8"'),
    ({"hidden_size": 36}, "head_dim (hidden_size / num_attention_heads = 36 / 4) must be even for "
                          "RoPE; got 9"),
    ({"rms_norm_eps": -1}, f"rms_norm_eps {FLOAT}; got -1"),
    ({"rms_norm_eps": 0}, f"rms_norm_eps {FLOAT}; got 0"),
    ({"rms_norm_eps": "1e-6"}, f'rms_norm_eps {FLOAT}; got "1e-6"'),
    ({"rms_norm_eps": float("nan")}, f"rms_norm_eps {FLOAT}; got NaN"),
    ({"rope_theta": -5}, f"rope_theta {FLOAT}; got -5"),
    ({"rope_theta": float("inf")}, f"rope_theta {FLOAT}; got Infinity"),
    ({"rope_theta": 10**400}, f"rope_theta {FLOAT}; got 1000000000"),
    ({"rope_parameters": {"rope_type": "default", "rope_theta": 0}},
     f"rope_parameters.rope_theta {FLOAT}; got 0"),
    ({"rope_scaling": [2.0]}, "rope_scaling must be an object (or null); got [2.0]"),
    ({"rope_scaling": {"rope_type": "yarn", "factor": 2.0}},
     'rope_scaling.rope_type must be one of default, dynamic, linear, llama3 (the supported RoPE '
     'types); got "yarn"'),
    ({"rope_scaling": {"type": 3}}, "rope_scaling.type must be one of default, dynamic, linear, "
                                    "llama3 (the supported RoPE types); got 3"),
    ({"rope_scaling": {"type": "linear"}},
     'rope_scaling.factor must be given for rope_scaling.type "linear"'),
    ({"rope_scaling": {"type": "linear", "factor": 0.5}},
     "rope_scaling.factor must be a finite number >= 1; got 0.5"),
    ({"rope_parameters": {"rope_type": "dynamic", "factor": "2"}},
     'rope_parameters.factor must be a finite number >= 1; got "2"'),
    ({"rope_scaling": dict(LLAMA3, high_freq_factor=0.5)},
     "rope_scaling.high_freq_factor must be a finite number > low_freq_factor (1); got 0.5"),
    ({"rope_scaling": dict(LLAMA3, low_freq_factor=-1.0)},
     "rope_scaling.low_freq_factor must be a finite number > 0; got -1.0"),
    ({"rope_scaling": dict(LLAMA3, original_max_position_embeddings=0)},
     f"rope_scaling.original_max_position_embeddings {INT}; got 0"),
    ({"rope_scaling": {k: v for k, v in LLAMA3.items() if k != "low_freq_factor"}},
     'rope_scaling.low_freq_factor must be given for rope_scaling.rope_type "llama3"'),
    ({"max_position_embeddings": 0}, f"max_position_embeddings {INT}; got 0"),
    ({"max_position_embeddings": -4096}, f"max_position_embeddings {INT}; got -4096"),
    ({"tie_word_embeddings": "false"}, 'tie_word_embeddings must be true or false; got "false"'),
    ({"tie_word_embeddings": 1}, "tie_word_embeddings must be true or false; got 1"),
    ({"attention_bias": "yes"}, 'attention_bias must be true or false; got "yes"'),
    ({"mlp_bias": True}, "mlp_bias must be false (MLP biases are not supported); got true"),
    ({"model_type": "mistral", "sliding_window": 0}, f"sliding_window {INT}; got 0"),
    ({"use_sliding_window": "no"}, 'use_sliding_window must be true or false; got "no"'),
    ({"eos_token_id": 64}, f"eos_token_id {IDS}; got 64"),
    ({"eos_token_id": -1}, f"eos_token_id {IDS}; got -1"),
    ({"eos_token_id": [2, 99]}, f"eos_token_id {IDS}; got [2, 99]"),
    ({"eos_token_id": "2"}, f'eos_token_id {IDS}; got "2"'),
    ({"eos_token_id": True}, f"eos_token_id {IDS}; got true"),
    ({"bos_token_id": 1000}, f"bos_token_id {IDS}; got 1000"),
    ({"torch_dtype": "int8"}, 'torch_dtype must be one of float32, float16, bfloat16, float64; '
                              'got "int8"'),
    ({"torch_dtype": None, "dtype": 16}, "dtype must be one of float32, float16, bfloat16, "
                                         "float64; got 16"),
    ({"hidden_act": "gelu"}, 'hidden_act must be "silu" (or its alias "swish"), the only '
                             'supported activation; got "gelu"'),
    ({"architectures": "LlamaForCausalLM"},
     'architectures must be a list of architecture names; got "LlamaForCausalLM"'),
    ({"architectures": ["GPT2LMHeadModel"], "model_type": None},
     "unsupported architecture ['GPT2LMHeadModel']"),
    ({"model_type": "gpt2", "architectures": None}, "unsupported model_type 'gpt2'"),
    ({"hidden_size": None}, "missing required field 'hidden_size'"),
]


def _write(path, changes):
    conf = dict(BASE, **changes)
    os.makedirs(path, exist_ok=True)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump({k: v for k, v in conf.items() if v is not None}, f)
    return os.path.join(path, "config.json")


@pytest.mark.parametrize("changes,message", BAD, ids=[
    "-".join(f"{k}={v!r}"[:40] for k, v in c.items()) for c, _ in BAD])
def test_bad_config_value_is_one_line_naming_file_key_value(tmp_path, changes, message):
    from pyspec.models.llama import LlamaForCausalLM

    path = _write(str(tmp_path), changes)
    with pytest.raises(ValueError) as e:
        ModelConfig.from_file(str(tmp_path))
    assert str(e.value).startswith(f"{path}: {message}") and "\n" not in str(e.value)
    # Loading a model checks the config before anything else (this folder has no weights).
    with pytest.raises(ValueError, match="^" + path):
        LlamaForCausalLM.from_pretrained(str(tmp_path))


def test_good_configs_load(tmp_path):
    """What the checks allow: every RoPE type, id lists, transformers 5 keys, an explicit
    head_dim other than hidden / heads, a Qwen2 sliding window that is off."""
    for i, changes in enumerate([
            {},
            {"rope_scaling": {"type": "linear", "factor": 2.0}},
            {"rope_scaling": {"rope_type": "dynamic", "factor": 1}},
            {"rope_scaling": dict(LLAMA3)},
            {"rope_scaling": None, "rope_theta": None,
             "rope_parameters": {"rope_type": "default", "rope_theta": 5e5}},
            {"eos_token_id": [0, 2, 63], "bos_token_id": None},
            {"torch_dtype": None, "dtype": "bfloat16"},
            {"head_dim": 16},
            {"hidden_act": "swish", "attention_bias": True, "tie_word_embeddings": True},
            {"model_type": "qwen2", "architectures": ["Qwen2ForCausalLM"], "sliding_window": 0,
             "use_sliding_window": False},
            {"model_type": "mistral", "architectures": None, "sliding_window": 64}]):
        _write(str(tmp_path / str(i)), changes)
        cfg = ModelConfig.from_file(str(tmp_path / str(i)))
        assert cfg.vocab_size == 64
    assert cfg.sliding_window == 64 and cfg.context_limit == 64
    cfg = ModelConfig.from_file(str(tmp_path / "3"))
    assert cfg.rope_scaling.rope_type == "llama3" and cfg.rope_scaling.factor == 8.0
    assert ModelConfig.from_file(str(tmp_path / "4")).rope_theta == 5e5
    assert ModelConfig.from_file(str(tmp_path / "7")).q_size == 64


def test_generation_config_ids_are_checked_with_the_config(tmp_path):
    """generation_config.json's end-of-sequence ids stop generation: one outside the vocabulary
    is an error at load, not a stop_token_ids error at the first request."""
    _write(str(tmp_path), {})
    gen = tmp_path / "generation_config.json"
    gen.write_text(json.dumps({"eos_token_id": [2, 5000]}))
    with pytest.raises(ValueError) as e:
        ModelConfig.from_file(str(tmp_path))
    assert str(e.value) == f"{gen}: eos_token_id {IDS}; got [2, 5000]"
    gen.write_text(json.dumps({"eos_token_id": [2, 3], "bos_token_id": 1}))
    assert ModelConfig.from_file(str(tmp_path)).eos_token_id == 2


def test_llm_refuses_a_tokenizer_eos_outside_the_vocabulary(tmp_path):
    """The tokenizer's eos_token (tokenizer_config.json) maps to an id past the model's
    embedding rows: refused when the LLM loads, not at the first request."""
    import pyspec
    from models_support import write_tiny_model

    path = write_tiny_model(tmp_path / "m")
    cfg = json.loads((tmp_path / "m" / "config.json").read_text())
    (tmp_path / "m" / "config.json").write_text(json.dumps(dict(cfg, eos_token_id=None)))
    tc = json.loads((tmp_path / "m" / "tokenizer_config.json").read_text())
    from tokenizers import AddedToken, Tokenizer

    tk = Tokenizer.from_file(os.path.join(path, "tokenizer.json"))
    tk.add_special_tokens([AddedToken("<|stop|>", special=True, normalized=False)])
    tk.save(os.path.join(path, "tokenizer.json"))
    (tmp_path / "m" / "tokenizer_config.json").write_text(
        json.dumps(dict(tc, eos_token="<|stop|>")))
    with pytest.raises(ValueError, match=r"the tokenizer's eos_token '<\|stop\|>' is token id 259, "
                                         r"outside the model's vocabulary \[0, 259\)"):
        pyspec.LLM(path, draft="none", kv_cache_tokens=64)


def test_cli_prints_one_line(tmp_path, capsys):
    from pyspec import cli

    path = _write(str(tmp_path), {"rms_norm_eps": -1})
    assert cli.main(["generate", "--model", str(tmp_path), "hi"]) == 2
    err = capsys.readouterr().err
    assert err == f"pyspec: error: {path}: rms_norm_eps must be a finite number > 0; got -1\n"


def test_cli_process_prints_no_traceback(tmp_path):
    path = _write(str(tmp_path), {"rope_theta": -5})
    r = subprocess.run([sys.executable, "-m", "pyspec", "generate", "--model", str(tmp_path), "hi"],
                       capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert r.returncode == 2, r.stderr
    assert r.stderr == f"pyspec: error: {path}: rope_theta must be a finite number > 0; got -5\n"


# ---- the GGUF path: its metadata mapped into the same config, through the same check ------------


def _write_gguf(path, **meta):
    """A tiny llama GGUF; ``meta`` overrides metadata values (GGUF key -> value)."""
    import numpy as np

    tokens = ["<s>", "</s>", "a", "b", "ab"]
    values = {"llama.block_count": 1, "llama.context_length": 64, "llama.embedding_length": 8,
              "llama.feed_forward_length": 16, "llama.attention.head_count": 2,
              "llama.attention.head_count_kv": 1, "llama.attention.layer_norm_rms_epsilon": 1e-5,
              "llama.rope.freq_base": 10000.0, "tokenizer.ggml.bos_token_id": 0,
              "tokenizer.ggml.eos_token_id": 1}
    values.update(meta)
    w = gguf.GGUFWriter(str(path), "llama")
    for key, v in values.items():
        if isinstance(v, float):
            w.add_float32(key, v)
        elif isinstance(v, str):
            w.add_string(key, v)
        elif isinstance(v, int) and v < 0:
            w.add_int32(key, v)
        else:
            w.add_uint32(key, v)
    w.add_tokenizer_model("gpt2")
    w.add_token_list(tokens)
    w.add_token_merges(["a b"])
    rng = np.random.default_rng(0)
    for name, shape in (("token_embd", (5, 8)), ("output_norm", (8,)), ("blk.0.attn_norm", (8,)),
                        ("blk.0.ffn_norm", (8,)), ("blk.0.attn_q", (8, 8)),
                        ("blk.0.attn_k", (4, 8)),
                        ("blk.0.attn_v", (4, 8)), ("blk.0.attn_output", (8, 8)),
                        ("blk.0.ffn_gate", (16, 8)), ("blk.0.ffn_up", (16, 8)),
                        ("blk.0.ffn_down", (8, 16))):
        w.add_tensor(name + ".weight", rng.standard_normal(shape).astype(np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return str(path)


GGUF_BAD = [
    ({"llama.attention.layer_norm_rms_epsilon": -1.0},
     f"llama.attention.layer_norm_rms_epsilon {FLOAT}; got -1.0"),
    ({"llama.rope.freq_base": -5.0}, f"llama.rope.freq_base {FLOAT}; got -5.0"),
    ({"llama.context_length": 0}, f"llama.context_length {INT}; got 0"),
    ({"llama.attention.head_count": 0}, f"llama.attention.head_count {INT}; got 0"),
    ({"llama.attention.head_count_kv": 2, "llama.attention.head_count": 3},
     "llama.attention.head_count_kv must be a divisor of llama.attention.head_count"),
    ({"llama.block_count": 2**31}, f"llama.block_count {INT}; got 2147483648"),
    ({"llama.embedding_length": "8"}, f'llama.embedding_length {INT}; got "8"'),
    ({"tokenizer.ggml.eos_token_id": 5},
     "tokenizer.ggml.eos_token_id must be a token id or a list of token ids in [0, 5)"),
    ({"llama.rope.scaling.type": "linear", "llama.rope.scaling.factor": 0.5},
     "llama.rope.scaling.factor must be a finite number >= 1; got 0.5"),
    ({"llama.attention.key_length": 3}, "llama.attention.key_length must be even (RoPE rotates "
                                         "pairs of dimensions); got 3"),
]


def test_good_gguf_converts(tmp_path):
    from pyspec.models.gguf_convert import convert_gguf

    out = convert_gguf(_write_gguf(tmp_path / "m.gguf"), tmp_path / "out")
    assert ModelConfig.from_file(out).head_dim == 4


@pytest.mark.parametrize("meta,message", GGUF_BAD, ids=[",".join(m) for m, _ in GGUF_BAD])
def test_bad_gguf_metadata_goes_through_the_same_check(tmp_path, meta, message):
    from pyspec import cli

    path = _write_gguf(tmp_path / "m.gguf", **meta)
    assert cli.main(["convert-gguf", path, str(tmp_path / "out")]) == 2
    assert not (tmp_path / "out").exists()
    # The same check, one place: ModelConfig.from_dict raised it.
    from pyspec.models import gguf_convert as gc
    with pytest.raises(ValueError) as e:
        gc.convert_into(path, str(tmp_path))
    assert str(e.value).startswith(f"{path}: {message}") and "\n" not in str(e.value)
    assert "from_dict" in [entry.name for entry in e.traceback]


def test_gguf_only_metadata_is_checked_too(tmp_path):
    from pyspec.models import gguf_convert as gc

    path = _write_gguf(tmp_path / "m.gguf", **{"llama.attention.value_length": 2})
    with pytest.raises(ValueError) as e:
        gc.convert_into(path, str(tmp_path))
    assert str(e.value) == (f"{path}: llama.attention.value_length must equal the head dimension "
                            "(4; value heads of another size are not supported); got 2")
