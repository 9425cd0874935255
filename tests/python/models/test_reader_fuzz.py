"""Fuzz tests of the weight-file readers: the safetensors reader (pyspec.models.loader:
iter_tensors, load_weights) and the GGUF reader (pyspec.models.gguf_convert: open_gguf, then the
conversion).

Each starts from a valid tiny file and mutates it, a few hundred deterministic cases per reader
(truncation, byte flips in the header, huge / negative / past-the-end lengths and offsets, wrong
dtypes, overlapping or out-of-file tensor ranges, non-UTF-8 and non-JSON headers, duplicated names,
huge dimension counts and string lengths). Every case must end in a correct load (the loaded
tensors are what the config needs; a converted GGUF folder loads) or a ValueError with a message:
never another exception type, a hang (each case runs under an alarm), or a huge allocation (the
process's peak memory is checked).
"""

import contextlib
import json
import os
import random
import resource
import signal
import struct
import time

import gguf  # a runtime dependency of pyspec (GGUF conversion)
import numpy as np
import pytest
import torch

from pyspec.models.config import ModelConfig
from pyspec.models.loader import expected_shapes, iter_tensors, load_weights

# Mutated tensor data dequantizes to NaN / infinity: numpy says so, the conversion goes on.
pytestmark = pytest.mark.filterwarnings("ignore::RuntimeWarning")

CASES = 300  # per reader
CASE_SECONDS = 2  # a case taking longer counts as a hang
MAX_GROWTH_MB = 512  # peak memory growth allowed over a whole run


class _Hang(Exception):
    pass


@contextlib.contextmanager
def _deadline(seconds):
    """Raise _Hang in a case that runs past ``seconds`` (Python-level loops; a hang inside native
    code that never returns would stall the test run instead, which is also visible)."""
    def on_alarm(signum, frame):
        raise _Hang(f"still running after {seconds}s")

    old = signal.signal(signal.SIGALRM, on_alarm)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)


def _peak_mb():
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux: KiB


def _run_cases(make_case, check, tmp_path, n=CASES):
    """Run ``n`` seeded cases: ``make_case(rng, dir)`` writes the mutated file and returns a
    description, ``check(dir)`` reads it. Returns {outcome: count}; fails listing every case that
    raised anything but a ValueError with a message, or hung."""
    bad, outcomes = [], {}
    peak0 = _peak_mb()
    slowest = 0.0
    for seed in range(n):
        rng = random.Random(seed)
        case_dir = tmp_path / f"case{seed}"
        case_dir.mkdir()
        what = make_case(rng, case_dir)
        t0 = time.perf_counter()
        try:
            with _deadline(CASE_SECONDS):
                check(case_dir)
            outcome = "loaded"
        except ValueError as e:
            outcome = "ValueError"
            if not str(e).strip():
                bad.append(f"seed {seed} ({what}): ValueError without a message")
        except _Hang as e:
            outcome = "hang"
            bad.append(f"seed {seed} ({what}): {e}")
        except Exception as e:  # noqa: BLE001 - the point of the test
            outcome = type(e).__name__
            bad.append(f"seed {seed} ({what}): {type(e).__name__}: {e}"[:300])
        slowest = max(slowest, time.perf_counter() - t0)
        outcomes[outcome] = outcomes.get(outcome, 0) + 1
    growth = _peak_mb() - peak0
    assert not bad, f"{len(bad)} of {n} cases failed:\n" + "\n".join(bad[:20])
    assert growth < MAX_GROWTH_MB, f"peak memory grew by {growth:.0f} MB"
    assert slowest < CASE_SECONDS
    return outcomes


# ---- safetensors --------------------------------------------------------------------------------

ST_CONFIG = dict(architectures=["LlamaForCausalLM"], model_type="llama", vocab_size=16,
                 hidden_size=8, intermediate_size=12, num_hidden_layers=1, num_attention_heads=2,
                 num_key_value_heads=1, max_position_embeddings=64, tie_word_embeddings=False)


def _st_cfg():
    return ModelConfig.from_dict(dict(ST_CONFIG), source="fuzz")


def _st_good():
    """A valid tiny checkpoint's model.safetensors bytes (F32 and F16 tensors)."""
    from safetensors.torch import save

    g = torch.Generator().manual_seed(0)
    w = {}
    for i, (name, shape) in enumerate(sorted(expected_shapes(_st_cfg()).items())):
        t = torch.randn(shape, generator=g)
        w[name] = t.half() if i % 3 == 0 else t
    return save(w, metadata={"format": "pt"})


def _split_st(data):
    (n,) = struct.unpack_from("<Q", data)
    return json.loads(data[8:8 + n]), data[8 + n:]


def _join_st(header_text, body, pad=True):
    raw = header_text.encode("utf-8") if isinstance(header_text, str) else header_text
    if pad:
        raw += b" " * (-len(raw) % 8)
    return struct.pack("<Q", len(raw)) + raw + body


_BIG = [2**32, 2**53, 2**63 - 1, 2**63, 2**64 - 1, 2**64, 10**30]
_DTYPES = ["F32", "F16", "BF16", "F64", "I8", "I16", "I32", "I64", "U8", "U16", "U32", "U64",
           "BOOL", "F8_E4M3", "F8_E5M2", "C64", "F4", "XYZ", "", 5, None]


def _st_mutation(rng, good):
    """A mutated safetensors file and what was done to it."""
    header, body = _split_st(good)
    names = [k for k in header if k != "__metadata__"]
    name = rng.choice(names)
    entry = header[name]
    kind = rng.randrange(16)
    if kind == 0:
        n = rng.randrange(len(good))
        return good[:n], f"truncated to {n} bytes"
    if kind == 1:
        hlen = struct.unpack_from("<Q", good)[0]
        data = bytearray(good)
        flips = rng.randint(1, 4)
        for _ in range(flips):
            data[rng.randrange(8 + hlen)] ^= 1 << rng.randrange(8)
        return bytes(data), f"{flips} bit flips in the header"
    if kind == 2:
        n = rng.choice([0, 1, 7, len(good) - 8, len(good) - 7, len(good), 100 * 2**20,
                        2**31, 2**63, 2**64 - 1, rng.randrange(2**64)])
        return struct.pack("<Q", n) + good[8:], f"header length {n}"
    if kind == 3:
        choice = rng.choice(["begin", "end", "both", "swap", "negative", "float", "short", "str"])
        b, e = entry["data_offsets"]
        if choice == "begin":
            entry["data_offsets"] = [rng.choice(_BIG + [e + 4, len(body)]), e]
        elif choice == "end":
            entry["data_offsets"] = [b, rng.choice(_BIG + [len(body) + 4, b, b + 1])]
        elif choice == "both":
            x = rng.choice(_BIG)
            entry["data_offsets"] = [x, x + (e - b)]
        elif choice == "swap":
            entry["data_offsets"] = [e, b]
        elif choice == "negative":
            entry["data_offsets"] = [-(e - b), 0] if rng.random() < 0.5 else [b, -1]
        elif choice == "float":
            entry["data_offsets"] = [float(b), float(e)]
        elif choice == "short":
            entry["data_offsets"] = [b]
        else:
            entry["data_offsets"] = [str(b), str(e)]
        return _join_st(json.dumps(header), body), f"{name}: data_offsets {choice}"
    if kind == 4:  # one tensor's range overlapping another's
        other = header[rng.choice(names)]
        entry["data_offsets"] = list(other["data_offsets"])
        return _join_st(json.dumps(header), body), f"{name}: overlapping range"
    if kind == 5:
        entry["dtype"] = rng.choice(_DTYPES)
        return _join_st(json.dumps(header), body), f"{name}: dtype {entry['dtype']!r}"
    if kind == 6:
        choice = rng.choice(["huge", "negative", "empty", "extra", "zero", "str", "float",
                             "nested", "swap"])
        shape = entry["shape"]
        entry["shape"] = {
            "huge": [2**40, 2**40], "negative": [-s for s in shape], "empty": [],
            "extra": shape + [1, 1, 1, 1, 1, 1, 1, 1], "zero": [0] + shape[1:],
            "str": [str(s) for s in shape], "float": [s + 0.5 for s in shape],
            "nested": [shape], "swap": shape[::-1]}[choice]
        return _join_st(json.dumps(header), body), f"{name}: shape {choice}"
    if kind == 7:  # a name given twice in the JSON text
        text = json.dumps(header)
        dup = json.dumps({name: header[rng.choice(names)]})[1:-1]
        return _join_st(text[:-1] + ", " + dup + "}", body), f"duplicated name {name}"
    if kind == 8:
        new = rng.choice(["", "lm_head.weight", "model.layers.7.mlp.up_proj.weight", "x" * 300,
                          "\u00e9\u4e2d", "__metadata__"])
        header[new] = header.pop(name)
        return _join_st(json.dumps(header), body), f"renamed {name} to {new[:20]!r}"
    if kind == 9:
        header["__metadata__"] = rng.choice([{"format": 5}, ["x"], "x", {"a": {"b": 1}}, None])
        return _join_st(json.dumps(header), body), "bad __metadata__"
    if kind == 10:  # not UTF-8
        raw = bytearray(json.dumps(header).encode())
        for _ in range(rng.randint(1, 3)):
            raw[rng.randrange(len(raw))] = rng.choice([0xFF, 0xFE, 0xC0, 0x80])
        return _join_st(bytes(raw), body), "non-UTF-8 header"
    if kind == 11:  # not JSON
        text = rng.choice(["", "[]", "null", "1", '"x"', "{", "{}", "[" * 100000,
                           '{"a": ' * 5000 + "1" + "}" * 5000,
                           bytes(rng.randrange(256) for _ in range(64))])
        return _join_st(text, body), f"non-JSON header {text[:10]!r}"
    if kind == 12:
        del header[name]
        return _join_st(json.dumps(header), body), f"dropped {name}"
    if kind == 13:
        extra = rng.choice([b"", b"\0" * 4, bytes(rng.randrange(256) for _ in range(64))])
        cut = rng.randrange(len(body))
        return _join_st(json.dumps(header), body[:cut] + extra), "body changed"
    if kind == 14:  # data bytes flipped: still loads, with other values
        data = bytearray(good)
        hlen = struct.unpack_from("<Q", good)[0]
        for _ in range(8):
            data[8 + hlen + rng.randrange(len(good) - 8 - hlen)] ^= 0xFF
        return bytes(data), "data bytes flipped"
    # a tensor entry replaced by something that is not one
    header[name] = rng.choice([1, "x", [], None, {}, {"dtype": "F32"},
                               {"dtype": "F32", "shape": [1], "data_offsets": [0, 4], "x": 1}])
    return _join_st(json.dumps(header), body), f"{name}: entry replaced"


def _st_check(case_dir):
    cfg = _st_cfg()
    for name, t in iter_tensors(str(case_dir)):
        assert isinstance(name, str) and isinstance(t, torch.Tensor)
    w = load_weights(str(case_dir), cfg, torch.float32)
    want = expected_shapes(cfg)
    assert set(w) == set(want)
    assert all(tuple(w[k].shape) == s and w[k].dtype == torch.float32 for k, s in want.items())


def test_safetensors_reader_fuzz(tmp_path):
    good = _st_good()
    (tmp_path / "ok").mkdir()
    (tmp_path / "ok" / "model.safetensors").write_bytes(good)
    _st_check(tmp_path / "ok")  # the unmutated file loads

    def make(rng, case_dir):
        data, what = _st_mutation(rng, good)
        (case_dir / "model.safetensors").write_bytes(data)
        return what

    outcomes = _run_cases(make, _st_check, tmp_path)
    assert outcomes.get("loaded", 0) > 0 and outcomes.get("ValueError", 0) > CASES // 2, outcomes


def test_safetensors_duplicate_names_and_claimed_layers(tmp_path):
    """A header naming a tensor twice is refused (a reader would keep one of them); a config that
    claims 2**31 - 1 layers over a one-layer file is a missing-tensors error found per tensor the
    file holds, not after listing every claimed name."""
    good = _st_good()
    header, body = _split_st(good)
    dup = json.dumps(header)[:-1] + ", " + json.dumps({"model.norm.weight":
                                                       header["model.norm.weight"]})[1:-1] + "}"
    (tmp_path / "model.safetensors").write_bytes(_join_st(dup, body))
    with pytest.raises(ValueError, match="its header names 'model.norm.weight' more than once"):
        list(iter_tensors(str(tmp_path)))
    # Two tensors sharing bytes (each entry in range, of the right size): refused, naming both.
    moved = json.loads(json.dumps(header))
    size = moved["model.norm.weight"]["data_offsets"]
    moved["model.norm.weight"]["data_offsets"] = [0, size[1] - size[0]]
    (tmp_path / "model.safetensors").write_bytes(_join_st(json.dumps(moved), body))
    with pytest.raises(ValueError, match=r"data_offsets \[.*\], overlapping tensor '"):
        list(iter_tensors(str(tmp_path)))
    (tmp_path / "model.safetensors").write_bytes(good)
    cfg = ModelConfig.from_dict(dict(ST_CONFIG, num_hidden_layers=2**31 - 1))
    peak, t0 = _peak_mb(), time.perf_counter()
    with pytest.raises(ValueError, match=r"missing tensors: \['model.layers.1.input_layernorm."
                                         r"weight', .*\] \(\+19327352809 more\)"):
        load_weights(str(tmp_path), cfg, torch.float32)
    # No list of 2^31 names is built: bounded memory, and no hang (a generous guard).
    assert time.perf_counter() - t0 < 30 and _peak_mb() - peak < 100


@pytest.mark.parametrize("index", [
    b"{", b"\xff\xfe", b"[]", b'{"weight_map": []}', b'{"weight_map": {"a": ["x"]}}',
    b'{"weight_map": {"a": 5}}', b'{"weight_map": {"a": "../model.safetensors"}}',
    b'{"weight_map": {"a": "/etc/passwd"}}', b'{"weight_map": {"a": ""}}',
    b'{"weight_map": {"a": "missing.safetensors"}}', b'{"metadata": {}}'])
def test_safetensors_index_is_checked(tmp_path, index):
    """A sharded checkpoint's index names shard files of its own folder, or is a ValueError."""
    (tmp_path / "model.safetensors").write_bytes(_st_good())
    (tmp_path / "model.safetensors.index.json").write_bytes(index)
    with pytest.raises(ValueError, match="model.safetensors.index.json"):
        _st_check(tmp_path)


@pytest.mark.parametrize("kind", ["dangling link", "directory"])
def test_weights_that_are_not_a_file(tmp_path, kind):
    """model.safetensors as a link to a blob never downloaded, or a folder: a ValueError naming
    it, not an OSError from deep in the reader."""
    if kind == "directory":
        (tmp_path / "model.safetensors").mkdir()
    else:
        os.symlink(tmp_path / "blobs" / "missing", tmp_path / "model.safetensors")
    with pytest.raises(ValueError, match=r"model.safetensors is (a link to nothing|not a regular "
                                         r"file): the weights are missing"):
        list(iter_tensors(str(tmp_path)))


# ---- GGUF ---------------------------------------------------------------------------------------

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
TOKENS = SPECIALS + list("abcdefghijklmnopqrstuvwxyz") + ["\u0120", "th", "the", "\u0120the"]
MERGES = ["t h", "th e", "\u0120 the"]
GH, GNH, GNKV, GFF = 32, 2, 1, 64  # hidden, heads, KV heads, MLP width (head dim 16)


def _write_gguf(path):
    from gguf import GGMLQuantizationType as Q

    rng = np.random.default_rng(0)
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_block_count(1)
    w.add_context_length(128)
    w.add_embedding_length(GH)
    w.add_feed_forward_length(GFF)
    w.add_head_count(GNH)
    w.add_head_count_kv(GNKV)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_rope_freq_base(10000.0)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("default")
    w.add_token_list(TOKENS)
    w.add_token_types([3] * len(SPECIALS) + [1] * (len(TOKENS) - len(SPECIALS)))
    w.add_token_merges(MERGES)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_add_bos_token(False)
    w.add_chat_template("{{ messages[0]['content'] }}")

    def m(*shape):
        return (rng.standard_normal(shape) * 0.1).astype(np.float32)

    embd = gguf.quants.quantize(m(len(TOKENS), GH), Q.Q8_0)
    w.add_tensor("token_embd.weight", embd, raw_dtype=Q.Q8_0)
    hd = GH // GNH
    for name, shape in (("attn_q", (GNH * hd, GH)), ("attn_k", (GNKV * hd, GH)),
                        ("attn_v", (GNKV * hd, GH)), ("attn_output", (GH, GNH * hd)),
                        ("ffn_gate", (GFF, GH)), ("ffn_up", (GFF, GH)), ("ffn_down", (GH, GFF))):
        x = m(*shape)
        w.add_tensor(f"blk.0.{name}.weight", x.astype(np.float16) if name == "ffn_up" else x)
    w.add_tensor("blk.0.attn_norm.weight", 1 + m(GH))
    w.add_tensor("blk.0.ffn_norm.weight", 1 + m(GH))
    w.add_tensor("output_norm.weight", 1 + m(GH))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def _gguf_layout(path):
    """Where the numbers and strings of a GGUF header are: {role: [(offset, dtype)]} for the
    counts, string lengths, value types, array element types and lengths, scalar values, tensor
    dimension counts, dimensions, types and data offsets; (offset, length) of every string's
    bytes; and where the tensor data starts."""
    r = gguf.GGUFReader(str(path))
    base = r.data.__array_interface__["data"][0]

    def at(part, i=0):
        return (part.__array_interface__["data"][0] - base + i * part.dtype.itemsize,
                part.dtype.newbyteorder("<"))

    roles = {"count": [], "string length": [], "value type": [], "array type": [],
             "array length": [], "value": [], "hparam": [], "n_dims": [], "dim": [],
             "tensor type": [], "tensor offset": []}
    strings = []
    for name, f in r.fields.items():
        if name.startswith("GGUF."):
            roles["count" if name != "GGUF.version" else "value"].append(at(f.parts[0]))
            continue
        roles["string length"].append(at(f.parts[0]))
        roles["value type"].append(at(f.parts[2]))
        rest = f.parts[3:]
        if f.types[0] == gguf.GGUFValueType.ARRAY:
            roles["array type"].append(at(rest[0]))
            roles["array length"].append(at(rest[1]))
            rest = rest[2:]
        for p in rest:
            if p.dtype == np.uint64 and p.size == 1 and f.types[-1] == gguf.GGUFValueType.STRING:
                roles["string length"].append(at(p))
            elif p.dtype.itemsize > 1:
                hparam = name.startswith("llama.") or name.endswith("_token_id")
                roles["hparam" if hparam else "value"] += [at(p, i) for i in range(min(p.size, 4))]
    for t in r.tensors:
        name_len, _, n_dims, dims, ttype, offset = t.field.parts
        roles["string length"].append(at(name_len))
        roles["n_dims"].append(at(n_dims))
        roles["dim"] += [at(dims, i) for i in range(dims.size)]
        roles["tensor type"].append(at(ttype))
        roles["tensor offset"].append(at(offset))
    for parts in [f.parts for f in r.fields.values()] + [t.field.parts for t in r.tensors]:
        strings += [(at(p)[0], p.size) for p in parts if p.dtype.itemsize == 1 and p.size > 1]
    return roles, strings, r.data_offset


def _number(rng, dtype, old):
    if dtype.kind == "f":
        return rng.choice([float("nan"), float("inf"), -1.0, 0.0, -old, old * 1e30, 1e-30])
    bits = dtype.itemsize * 8
    v = rng.choice([0, 1, 2, 3, 4, 5, 7, 8, 9, 10, 12, 13, 31, 32, 33, 2**(bits - 1) - 1,
                    2**(bits - 1), 2**bits - 1, old + 1, old - 1, old * 2, old + 2**20,
                    rng.randrange(2**bits)])
    return v % 2**bits


def _gguf_mutation(rng, good, layout):
    roles, strings, data_start = layout
    kind = rng.randrange(7)
    data = bytearray(good)
    if kind == 0:
        n = rng.randrange(len(good))
        return good[:n], f"truncated to {n} bytes"
    if kind == 1:
        flips = rng.randint(1, 6)
        for _ in range(flips):
            data[rng.randrange(data_start)] ^= 1 << rng.randrange(8)
        return bytes(data), f"{flips} bit flips in the header"
    if kind in (2, 3, 4):  # a count, length, type, dimension, offset or value
        role = rng.choice(sorted(roles))
        off, dtype = rng.choice(roles[role])
        old = np.frombuffer(good, dtype, 1, off)[0].item()
        new = _number(rng, dtype, old)
        raw = (np.array([new], dtype) if dtype.kind == "f" else
               np.array([new], np.dtype(f"<u{dtype.itemsize}")))  # the bits, signed or not
        data[off:off + dtype.itemsize] = raw.tobytes()
        return bytes(data), f"{role} ({dtype}) at byte {off}: {old} -> {new}"
    if kind == 5:  # a string's bytes: not UTF-8, or another string of the same length
        off, n = rng.choice(strings)
        same = [s for s in strings if s[1] == n and s[0] != off]
        if same and rng.random() < 0.5:
            src = rng.choice(same)[0]
            data[off:off + n] = good[src:src + n]
            return bytes(data), f"string at byte {off} duplicated from byte {src}"
        data[off + rng.randrange(n)] = rng.choice([0xFF, 0xC3, 0x80])
        return bytes(data), f"string at byte {off} made non-UTF-8"
    # the tensor data changed: loads, with other values (or is cut short)
    for _ in range(8):
        data[data_start + rng.randrange(len(good) - data_start)] ^= 0xFF
    if rng.random() < 0.3:
        del data[rng.randrange(data_start, len(good)):]
    return bytes(data), "tensor data changed"


def _gguf_sweep(good, layout):
    """Every count, length, type, dimension, offset and hyperparameter of the header set in turn
    to 0, the largest signed and unsigned values of its width and one past its value (floats: NaN,
    -1, infinity): (file bytes, what) for each."""
    roles = layout[0]
    out = []
    for role in sorted(roles):
        if role == "value":  # token types: covered by the random cases
            continue
        for off, dtype in roles[role]:
            old = np.frombuffer(good, dtype, 1, off)[0].item()
            if dtype.kind == "f":
                values, raw_dtype = [float("nan"), -1.0, float("inf")], dtype
            else:
                bits = dtype.itemsize * 8
                values = [0, 2**(bits - 1) - 1, 2**bits - 1, (old + 1) % 2**bits]
                raw_dtype = np.dtype(f"<u{dtype.itemsize}")
            for v in values:
                data = bytearray(good)
                data[off:off + dtype.itemsize] = np.array([v], raw_dtype).tobytes()
                out.append((bytes(data), f"{role} ({dtype}) at byte {off}: {old} -> {v}"))
    return out


def _gguf_check(case_dir):
    from pyspec.models import gguf_convert as gc
    from pyspec.tokenizer import Tokenizer

    out = case_dir / "out"
    out.mkdir()
    config = gc.convert_into(str(case_dir / "m.gguf"), str(out))
    # A conversion that succeeds makes a folder that loads.
    cfg = ModelConfig.from_file(str(out))
    assert cfg.num_hidden_layers == config["num_hidden_layers"]
    load_weights(str(out), cfg, torch.float32)
    Tokenizer(str(out))


def test_gguf_reader_fuzz(tmp_path):
    src = tmp_path / "good.gguf"
    _write_gguf(src)
    good = src.read_bytes()
    layout = _gguf_layout(src)
    (tmp_path / "ok").mkdir()
    (tmp_path / "ok" / "m.gguf").write_bytes(good)
    _gguf_check(tmp_path / "ok")  # the unmutated file converts and loads

    def make(rng, case_dir):
        data, what = _gguf_mutation(rng, good, layout)
        (case_dir / "m.gguf").write_bytes(data)
        return what

    outcomes = _run_cases(make, _gguf_check, tmp_path)
    assert outcomes.get("loaded", 0) > 0 and outcomes.get("ValueError", 0) > CASES // 2, outcomes


def test_gguf_reader_sweep(tmp_path):
    """Each number of the header in turn at the values that break readers (huge, zero, one off)."""
    src = tmp_path / "good.gguf"
    _write_gguf(src)
    good = src.read_bytes()
    cases = iter(_gguf_sweep(good, _gguf_layout(src)))
    n = len(_gguf_sweep(good, _gguf_layout(src)))

    def make(rng, case_dir):
        data, what = next(cases)
        (case_dir / "m.gguf").write_bytes(data)
        return what

    outcomes = _run_cases(make, _gguf_check, tmp_path, n)
    assert outcomes.get("ValueError", 0) > n // 2, outcomes
