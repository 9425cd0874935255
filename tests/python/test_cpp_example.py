"""The C++ embedding example (cpp/examples/speculate.cc) against pyspec.LLM(draft="ngram") with
a float32 KV cache, as the example's: the same greedy token ids for the same prompt ids, from a
tiny random Llama checkpoint.

The example is a C++ program built with the core (``pyspec_speculate`` in a CMake build's
``cpp/examples``, or ``speculate`` of ``tests/consumer`` against the installed package); these
tests run the binary named by ``PYSPEC_SPECULATE_EXAMPLE`` (``.ci/run`` sets it) and skip without.
Where the ids differ, the first difference must be a near-tie of the target's top-2 logits (RoPE
tables computed with the C library's pow/cos/sin can differ from torch's in the last bit)."""

import os
import shutil
import subprocess

import pytest
import torch

import pyspec
from models_support import write_tiny_model

EXAMPLE = os.environ.get("PYSPEC_SPECULATE_EXAMPLE")
pytestmark = pytest.mark.skipif(
    not EXAMPLE, reason="set PYSPEC_SPECULATE_EXAMPLE to a built cpp/examples/speculate.cc binary")


def test_the_named_binary_exists():
    """Named but missing (a build step that did not produce it): a failure, not a skip."""
    assert os.access(EXAMPLE, os.X_OK), \
        f"PYSPEC_SPECULATE_EXAMPLE={EXAMPLE!r} is not an executable file"

# Repeats give prompt lookup something to copy; the last prompt is a single token (no prefill).
PROMPTS = [
    [5, 6, 7, 8, 9, 5, 6, 7, 8, 9, 5, 6],
    [40, 41, 42, 43, 44, 45, 46, 47, 48, 49, 50, 51, 52, 53, 54, 55, 56, 57, 58, 59, 60, 40, 41],
    [200, 3, 17, 200, 3],
    [77],
]


def run_example(model_dir, prompt, max_new, max_draft=5, env=None, stderr=False):
    p = subprocess.run([EXAMPLE, str(model_dir), ",".join(map(str, prompt)), str(max_new),
                        str(max_draft)], capture_output=True, text=True, timeout=300,
                       env=None if env is None else dict(os.environ, **env))
    assert p.returncode == 0, p.stderr
    lines = p.stdout.strip().split("\n")
    assert len(lines) == 2, p.stdout
    ids = [int(t) for t in lines[0].split()]
    fields = dict(kv.split("=") for kv in lines[1].split())
    out = ids, int(fields["steps"]), int(fields["accepted"])
    return out + (p.stderr,) if stderr else out


def python_ids(llm, prompt, max_new):
    out = llm.generate(list(prompt), pyspec.SamplingParams(max_tokens=max_new, ignore_eos=True))
    return list(out[0].token_ids)


def top2_gap(llm, prompt, max_new, index):
    """The target's top-2 logit gap at generated token ``index`` (the engine's recorded rows)."""
    eng = llm.engine
    rid = eng.add_request(list(prompt), pyspec.SamplingParams(max_tokens=max_new,
                                                              ignore_eos=True))
    eng.record_logits(rid)
    while eng.has_unfinished():
        eng.step()
    rows = eng.recorded_logits(rid)
    eng.result(rid, pop=True)
    top = torch.topk(rows[index], 2).values
    return float(top[0] - top[1]), float(top[0].abs())


def check_same(llm, prompt, max_new, cpp, py):
    assert len(cpp) == len(py) == max_new
    if cpp == py:
        return
    k = next(i for i, (a, b) in enumerate(zip(cpp, py)) if a != b)
    gap, scale = top2_gap(llm, prompt, max_new, k)
    assert gap <= 1e-4 * max(1.0, scale), (
        f"C++ and Python differ at generated token {k} ({cpp[k]} vs {py[k]}) where the top-2 "
        f"logits are {gap:g} apart, not a near-tie:\nC++    {cpp}\nPython {py}")


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    path = write_tiny_model(tmp_path_factory.mktemp("cpp_example") / "model", layers=2, seed=3)
    return path, pyspec.LLM(path, draft="ngram", progress=False, kv_cache_dtype="float32")


@pytest.fixture(scope="module")
def loopy(tmp_path_factory, tiny):
    """The tiny model with its layers' output projections (o_proj, down_proj) scaled by 0.03: the
    next token depends mostly on the last one, so greedy decoding falls into loops that prompt
    lookup copies (a random model at full scale almost never accepts a draft), while the context
    still matters. Steps then accept drafts and commit several rows."""
    from safetensors.torch import load_file, save_file

    src, _ = tiny
    dst = tmp_path_factory.mktemp("cpp_example_loopy") / "model"
    shutil.copytree(src, dst)
    w = load_file(os.path.join(src, "model.safetensors"))
    save_file({k: v * 0.03 if ("o_proj" in k or "down_proj" in k) else v for k, v in w.items()},
              str(dst / "model.safetensors"))
    return str(dst), pyspec.LLM(str(dst), draft="ngram", progress=False,
                                kv_cache_dtype="float32")


@pytest.mark.parametrize("model", ["tiny", "loopy"])
@pytest.mark.parametrize("prompt", PROMPTS, ids=["repeats", "long-repeat", "short", "one-token"])
def test_same_ids_as_llm(request, model, prompt):
    path, llm = request.getfixturevalue(model)
    n = 48
    cpp, steps, accepted = run_example(path, prompt, n)
    check_same(llm, prompt, n, cpp, python_ids(llm, prompt, n))
    # Every step emits its accepted drafts and one more token.
    assert steps + accepted == n and 1 <= steps <= n


def test_long_prompt(tiny):
    """A prefill longer than the core's fast rows (Python runs its matrices through torch's GEMM,
    which may round differently: a near-tie may then differ)."""
    path, llm = tiny
    g = torch.Generator().manual_seed(0)
    prompt = torch.randint(0, 259, (300,), generator=g).tolist()
    n = 32
    cpp, _, _ = run_example(path, prompt, n)
    check_same(llm, prompt, n, cpp, python_ids(llm, prompt, n))


def test_drafts_are_accepted_and_plain_decoding_agrees(loopy):
    path, llm = loopy
    prompt, n = PROMPTS[0], 96
    spec, steps, accepted = run_example(path, prompt, n, 5)
    plain, plain_steps, plain_accepted = run_example(path, prompt, n, 0)
    assert accepted >= 10 and steps + accepted == n
    assert (plain_steps, plain_accepted) == (n, 0)
    assert spec == plain  # drafting never changes the greedy ids
    check_same(llm, prompt, n, spec, python_ids(llm, prompt, n))


def test_sharded_checkpoint(tmp_path, tiny):
    """model.safetensors.index.json and its shards read as the single file does."""
    import json

    from safetensors.torch import load_file, save_file

    src, _ = tiny
    dst = tmp_path / "model"
    shutil.copytree(src, dst)
    w = load_file(str(dst / "model.safetensors"))
    os.remove(dst / "model.safetensors")
    names = sorted(w)
    parts = {"model-00001-of-00002.safetensors": names[:len(names) // 2],
             "model-00002-of-00002.safetensors": names[len(names) // 2:]}
    for f, ns in parts.items():
        save_file({n: w[n] for n in ns}, str(dst / f))
    with open(dst / "model.safetensors.index.json", "w") as f:
        json.dump({"metadata": {}, "weight_map": {n: f for f, ns in parts.items() for n in ns}},
                  f)
    assert run_example(dst, PROMPTS[0], 16) == run_example(src, PROMPTS[0], 16)


def test_qwen2_biases_and_tied_embeddings(tmp_path, tiny):
    """q/k/v biases (a fused bqkv) and an lm_head tied to the embedding table."""
    import json

    from safetensors.torch import load_file, save_file

    src, _ = tiny
    dst = tmp_path / "model"
    shutil.copytree(src, dst)
    with open(dst / "config.json") as f:
        cfg = json.load(f)
    cfg.update(architectures=["Qwen2ForCausalLM"], model_type="qwen2", attention_bias=True,
               tie_word_embeddings=True)
    with open(dst / "config.json", "w") as f:
        json.dump(cfg, f)
    w = load_file(os.path.join(src, "model.safetensors"))
    del w["lm_head.weight"]
    g = torch.Generator().manual_seed(5)
    q, kv = cfg["hidden_size"], cfg["hidden_size"] // cfg["num_attention_heads"] * \
        cfg["num_key_value_heads"]
    for layer in range(cfg["num_hidden_layers"]):
        for name, n in (("q", q), ("k", kv), ("v", kv)):
            w[f"model.layers.{layer}.self_attn.{name}_proj.bias"] = 0.1 * torch.randn(
                n, generator=g)
    save_file(w, str(dst / "model.safetensors"))
    llm = pyspec.LLM(str(dst), draft="ngram", progress=False, kv_cache_dtype="float32")
    for prompt in (PROMPTS[0], PROMPTS[3]):
        cpp, _, _ = run_example(dst, prompt, 32)
        check_same(llm, prompt, 32, cpp, python_ids(llm, prompt, 32))


def test_packed_checkpoint(tmp_path, tiny):
    """Matrices that are exactly 4-bit (q, k, v, gate, up) or 8-bit (o, down, lm_head) blocks are
    also held as codes, in C++ as in pyspec, with the same ids either way."""
    from safetensors.torch import load_file, save_file

    src, _ = tiny
    g = torch.Generator().manual_seed(1)

    def q4(n, k):  # w = d * q + lo per group of 32, q in 0..15 (both ends used)
        d = (torch.rand(n, k // 32, 1, generator=g) * 0.01 + 0.005).half().float()
        lo = (-(torch.rand(n, k // 32, 1, generator=g) * 0.05 + 0.02)).half().float()
        q = torch.randint(0, 16, (n, k // 32, 32), generator=g).float()
        q[..., 0], q[..., 1] = 0, 15
        return (q * d + lo).view(n, k)

    def q8(n, k):  # w = d * q per group of 32, |q| <= 127 (127 used)
        d = (torch.rand(n, k // 32, 1, generator=g) * 0.02 + 0.01).half().float()
        q = torch.randint(-127, 128, (n, k // 32, 32), generator=g).float()
        q[..., 0] = 127
        return (q * d).view(n, k)

    w = load_file(os.path.join(src, "model.safetensors"))
    for name, t in w.items():
        if any(p in name for p in ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj")):
            w[name] = q4(*t.shape)
        elif any(p in name for p in ("o_proj", "down_proj", "lm_head")):
            w[name] = q8(*t.shape)
    dst = tmp_path / "model"
    shutil.copytree(src, dst)
    save_file(w, str(dst / "model.safetensors"))
    llm = pyspec.LLM(str(dst), draft="ngram", progress=False, kv_cache_dtype="float32")
    packed = llm.describe()["packed"]
    if packed is None:
        pytest.skip("this CPU has no packed kernel (LinearPacked needs AVX2)")
    assert packed["matrices"] == 2 * 4 + 1 and packed["bits"] == [4, 8]
    prompt, n = PROMPTS[0], 32
    cpp, _, _, err = run_example(dst, prompt, n, stderr=True)
    assert f"{packed['matrices']} matrices also as packed codes" in err, err
    check_same(llm, prompt, n, cpp, python_ids(llm, prompt, n))
    dense, _, _, err = run_example(dst, prompt, n, env={"PYSPEC_PACKED_WEIGHTS": "0"},
                                   stderr=True)
    assert "0 matrices also as packed codes" in err, err
    assert dense == cpp  # the codes give the float32 matrices' results bit for bit


@pytest.mark.slow
def test_default_model():
    """The real default model (SmolLM2-135M-Instruct: tied embeddings, 9 query / 3 KV heads,
    every matrix packed)."""
    from pyspec.models.default import default_model_path

    path = default_model_path(progress=False)
    llm = pyspec.LLM(path, draft="ngram", progress=False, kv_cache_dtype="float32")
    prompt = llm.tokenizer.encode("def fib(n):\n    if n < 2:\n        return n\n    return "
                                  "fib(n - 1) + fib(n - 2)\n\nprint(fib(10))\n\ndef fib")
    n = 48
    cpp, _, accepted = run_example(path, prompt, n)
    check_same(llm, prompt, n, cpp, python_ids(llm, prompt, n))
    assert accepted > 0


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_checkpoints(tmp_path, tiny, dtype):
    """F16 / BF16 tensors are converted to float32 as pyspec loads them (dtype float32), and their
    matrices are also held as 16-bit codes, in C++ as in pyspec, with the same ids either way."""
    from safetensors.torch import load_file, save_file

    src, _ = tiny
    dst = tmp_path / "model"
    shutil.copytree(src, dst)
    w = load_file(os.path.join(src, "model.safetensors"))
    save_file({k: v.to(dtype) for k, v in w.items()}, str(dst / "model.safetensors"))
    llm = pyspec.LLM(str(dst), draft="ngram", progress=False, kv_cache_dtype="float32")
    prompt, n = PROMPTS[0], 16
    cpp, _, _, err = run_example(dst, prompt, n, stderr=True)
    check_same(llm, prompt, n, cpp, python_ids(llm, prompt, n))
    packed = llm.describe()["packed"]
    if packed is None:
        pytest.skip("this CPU has no packed kernel (LinearPacked needs AVX2)")
    assert packed["bits"] == [16]
    assert f"{packed['matrices']} matrices also as packed codes" in err, err
    dense, _, _, err = run_example(dst, prompt, n, env={"PYSPEC_PACKED_WEIGHTS": "0"},
                                   stderr=True)
    assert "0 matrices also as packed codes" in err, err
    assert dense == cpp  # the codes give the float32 matrices' results bit for bit


def test_errors_name_the_file_or_tensor(tmp_path, tiny):
    src, _ = tiny
    bad = tmp_path / "truncated"
    shutil.copytree(src, bad)
    with open(bad / "model.safetensors", "r+b") as f:
        f.truncate(100)
    p = subprocess.run([EXAMPLE, str(bad), "1,2", "4"], capture_output=True, text=True)
    assert p.returncode != 0 and "model.safetensors" in p.stderr, p.stderr

    from safetensors.torch import load_file, save_file

    missing = tmp_path / "missing"
    shutil.copytree(src, missing)
    w = load_file(os.path.join(src, "model.safetensors"))
    del w["model.layers.1.mlp.up_proj.weight"]
    save_file(w, str(missing / "model.safetensors"))
    p = subprocess.run([EXAMPLE, str(missing), "1,2", "4"], capture_output=True, text=True)
    assert p.returncode != 0 and "model.layers.1.mlp.up_proj.weight" in p.stderr, p.stderr

    p = subprocess.run([EXAMPLE, str(src), "1,99999", "4"], capture_output=True, text=True)
    assert p.returncode != 0 and "99999" in p.stderr, p.stderr
