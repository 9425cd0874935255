"""Model layer: HF checkpoints load and match transformers' logits (fp32, 1e-4) for prefill and for
token-by-token decode on pyspec's paged KV; tree nodes match their paths; loading errors are clear.
transformers is a test-only dependency."""

import json
import os

import pytest
import torch

from pyspec import TokenTree
from pyspec.models.config import ModelConfig
from pyspec.models.llama import LlamaForCausalLM
from pyspec.runner import ModelRunner, SeqStep

from helpers import require_module  # noqa: E402

require_module("transformers")
import transformers  # noqa: E402
os.environ.setdefault("HF_HUB_OFFLINE", "1")

BASE = dict(vocab_size=111, hidden_size=128, intermediate_size=200, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
            rms_norm_eps=1e-5, rope_theta=10000.0, tie_word_embeddings=False)


def _hf_model(kind, tmp_path, shard=False, **overrides):
    torch.manual_seed(0)
    kw = dict(BASE, **overrides)
    if kind == "qwen2":
        cfg = transformers.Qwen2Config(**kw)
        model = transformers.Qwen2ForCausalLM(cfg)
    elif kind == "mistral":
        cfg = transformers.MistralConfig(sliding_window=None, **kw)
        model = transformers.MistralForCausalLM(cfg)
    else:
        cfg = transformers.LlamaConfig(**kw)
        model = transformers.LlamaForCausalLM(cfg)
    # Non-trivial norms and biases so a wrong mapping cannot hide behind ones/zeros.
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight") or name.endswith(".bias"):
                p.add_(0.1 * torch.randn_like(p))
    model = model.float().eval()
    path = tmp_path / kind
    model.save_pretrained(path, max_shard_size="200KB" if shard else "5GB")
    model.config._attn_implementation = "eager"
    return model, str(path)


def _ours(path, num_blocks=64, block_size=4):
    model = LlamaForCausalLM.from_pretrained(path, dtype="float32")
    return model, ModelRunner(model, num_blocks=num_blocks, block_size=block_size)


def _prefill_logits(runner, toks, table):
    out = runner.step([SeqStep(toks, 0, table, None, "all")])
    return out


CASES = [
    ("llama", {}),
    ("qwen2", {}),
    ("mistral", {}),
    ("llama", {"rope_scaling": {"rope_type": "linear", "factor": 2.0}}),
    ("llama", {"rope_scaling": {"rope_type": "dynamic", "factor": 2.0}, "max_position_embeddings": 16}),
    ("llama", {"rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                "high_freq_factor": 4.0, "original_max_position_embeddings": 32}}),
    ("llama", {"tie_word_embeddings": True, "hidden_size": 192, "head_dim": 64,
               "num_attention_heads": 3, "num_key_value_heads": 1}),
]


@pytest.mark.parametrize("kind, overrides", CASES)
def test_prefill_and_decode_match_transformers(kind, overrides, tmp_path):
    hf, path = _hf_model(kind, tmp_path, shard=(kind == "qwen2"), **overrides)
    model, runner = _ours(path)
    g = torch.Generator().manual_seed(1)
    toks = torch.randint(0, BASE["vocab_size"], (23,), generator=g).tolist()
    with torch.no_grad():
        ref = hf(torch.tensor([toks])).logits[0].float()
    # Prefill of the whole sequence at once.
    table = list(range(0, 8))
    got = runner.step([SeqStep(toks, 0, table, None, "all")]).logits
    torch.testing.assert_close(got, ref, atol=1e-4, rtol=1e-4)
    # Token by token on the paged KV: each step commits its K/V, the next reads them from pages.
    # The reference is transformers' own cached decode (for dynamic RoPE it differs from prefill).
    table2 = list(range(8, 16))[::-1]  # a permuted block table
    bs = runner.block_size
    past = None
    for i, tok in enumerate(toks):
        with torch.no_grad():
            r = hf(torch.tensor([[tok]]), past_key_values=past, use_cache=True)
        past = r.past_key_values
        out = runner.step([SeqStep([tok], i, table2, None, "last")])
        runner.commit_kv(out, 0, [0], [table2[i // bs] * bs + i % bs])
        torch.testing.assert_close(out.logits[0], r.logits[0, -1].float(), atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("overrides", [
    {},
    # Dynamic NTK RoPE past the trained length: every tree node must get the scaling a plain decode
    # step at its position gets, or speculation would not be lossless.
    {"rope_scaling": {"rope_type": "dynamic", "factor": 2.0}, "max_position_embeddings": 8},
])
def test_tree_nodes_match_their_paths(tmp_path, overrides):
    _, path = _hf_model("llama", tmp_path, **overrides)
    model, runner = _ours(path)
    g = torch.Generator().manual_seed(2)
    prompt = torch.randint(0, 111, (13,), generator=g).tolist()
    table = [5, 2, 9, 7, 1, 3, 0, 4]
    bs = runner.block_size
    out = runner.step([SeqStep(prompt, 0, table, None, "none")])
    runner.commit_kv(out, 0, range(len(prompt)), [table[i // bs] * bs + i % bs for i in range(13)])
    tree = TokenTree.from_paths([[0], [1], [2], [0, 0], [0, 1], [1, 0], [0, 0, 0], [0, 1, 0]])
    toks = torch.randint(0, 111, (tree.num_nodes,), generator=g).tolist()
    got = runner.step([SeqStep(toks, 13, table, tree, "all")]).logits
    for node in range(tree.num_nodes):
        # Reference: plain decoding of the node's path, one token per step (each step commits its
        # K/V, the next reads it from the pages) — what speculation must reproduce.
        for i, tok in enumerate(tree.path_to(node)):
            pos = 13 + i
            out = runner.step([SeqStep([toks[tok]], pos, table, None, "last")])
            runner.commit_kv(out, 0, [0], [table[pos // bs] * bs + pos % bs])
        torch.testing.assert_close(got[node], out.logits[0], atol=1e-4, rtol=1e-4)


def test_mixed_batch_matches_single_requests(tmp_path):
    """A step mixing a prefill chunk, a decode token and a tree gives each request its own logits."""
    _, path = _hf_model("qwen2", tmp_path)
    model, runner = _ours(path, num_blocks=40)
    g = torch.Generator().manual_seed(3)
    a = torch.randint(0, 111, (9,), generator=g).tolist()
    b = torch.randint(0, 111, (6,), generator=g).tolist()
    bs = runner.block_size
    ta, tb = [0, 1, 2], [10, 11, 12]
    out = runner.step([SeqStep(b[:5], 0, tb, None, "none")])
    runner.commit_kv(out, 0, range(5), [tb[i // bs] * bs + i % bs for i in range(5)])
    tree = TokenTree.kary(2, 2)
    tt = torch.randint(0, 111, (tree.num_nodes,), generator=g).tolist()
    seqs = [SeqStep(a, 0, ta, None, "last"), SeqStep([b[5]], 5, tb, None, "last"),
            SeqStep(tt, 5, tb, tree, "all")]
    mixed = runner.step(seqs)
    for i, s in enumerate(seqs):
        alone = runner.step([s]).logits
        torch.testing.assert_close(mixed.logits_of(i), alone, atol=1e-5, rtol=1e-5)


def test_hidden_layers(tmp_path):
    """``return_hidden`` with layer numbers: the outputs of those layers, concatenated in the order
    asked; layer 1 matches transformers' hidden_states[1], the last the final hidden state."""
    hf, path = _hf_model("llama", tmp_path)
    model, runner = _ours(path)
    toks = torch.randint(0, 111, (10,), generator=torch.Generator().manual_seed(4)).tolist()
    table = list(range(3))
    final = runner.step([SeqStep(toks, 0, table, None, "none")], return_hidden=True).hidden
    both = runner.step([SeqStep(toks, 0, table, None, "none")], return_hidden=(2, 1)).hidden
    assert both.shape == (10, 2 * 128)
    torch.testing.assert_close(both[:, :128], final)
    with torch.no_grad():
        ref = hf(torch.tensor([toks]), output_hidden_states=True).hidden_states[1][0]
    torch.testing.assert_close(both[:, 128:], ref, atol=1e-4, rtol=1e-4)
    first = runner.step([SeqStep(toks, 0, table, None, "none")], return_hidden=[1]).hidden
    torch.testing.assert_close(first, both[:, 128:])  # one layer that is not the last
    for bad in ((0, 2), (1, 3), (2, 2), (), "x"):
        with pytest.raises(ValueError, match="layer"):
            runner.step([SeqStep(toks, 0, table, None, "none")], return_hidden=bad)


def test_bf16_runs_close_to_fp32(tmp_path):
    _, path = _hf_model("llama", tmp_path)
    m32 = LlamaForCausalLM.from_pretrained(path, dtype="float32")
    m16 = LlamaForCausalLM.from_pretrained(path, dtype="bfloat16")
    toks = list(range(1, 20))
    l32 = ModelRunner(m32, 16, 4).step([SeqStep(toks, 0, list(range(5)), None, "all")]).logits
    l16 = ModelRunner(m16, 16, 4).step([SeqStep(toks, 0, list(range(5)), None, "all")]).logits
    assert l16.dtype == torch.float32
    assert (l16.argmax(-1) == l32.argmax(-1)).float().mean() > 0.8
    assert (l16 - l32).abs().max() < 0.25


def _write_config(path, **changes):
    cfg = json.loads((path / "config.json").read_text())
    cfg.update(changes)
    (path / "config.json").write_text(json.dumps(cfg))


def test_loading_errors_are_clear(tmp_path):
    from safetensors.torch import load_file, save_file

    _, path = _hf_model("llama", tmp_path)
    p = tmp_path / "llama"
    weights = load_file(str(p / "model.safetensors"))

    with pytest.raises(ValueError, match="not a directory"):
        LlamaForCausalLM.from_pretrained(str(p / "nope"))
    with pytest.raises(ValueError, match="dtype"):
        LlamaForCausalLM.from_pretrained(str(p), dtype="int8")
    with pytest.raises(ValueError, match="device must be 'cpu', 'cuda' or 'cuda:N'"):
        LlamaForCausalLM.from_pretrained(str(p), device="tpu")

    _write_config(p, architectures=["GPT2LMHeadModel"], model_type="gpt2")
    with pytest.raises(ValueError, match="unsupported architecture"):
        LlamaForCausalLM.from_pretrained(str(p))
    _write_config(p, architectures=["LlamaForCausalLM"], model_type="llama")

    _write_config(p, num_key_value_heads=3)
    with pytest.raises(ValueError, match="multiple of"):
        LlamaForCausalLM.from_pretrained(str(p))
    _write_config(p, num_key_value_heads=2)

    _write_config(p, rope_parameters={"rope_type": "yarn", "factor": 4.0})
    with pytest.raises(ValueError, match='rope_parameters.rope_type must be one of .*; got "yarn"'):
        LlamaForCausalLM.from_pretrained(str(p))
    _write_config(p, rope_parameters=None)

    missing = dict(weights)
    del missing["model.layers.1.mlp.up_proj.weight"]
    save_file(missing, str(p / "model.safetensors"))
    with pytest.raises(ValueError, match="missing tensors.*up_proj"):
        LlamaForCausalLM.from_pretrained(str(p))

    extra = dict(weights, **{"model.layers.0.extra.weight": torch.zeros(3)})
    save_file(extra, str(p / "model.safetensors"))
    with pytest.raises(ValueError, match="does not use.*extra"):
        LlamaForCausalLM.from_pretrained(str(p))

    bad = dict(weights)
    bad["model.norm.weight"] = torch.zeros(7)
    save_file(bad, str(p / "model.safetensors"))
    with pytest.raises(ValueError, match="model.norm.weight.*shape"):
        LlamaForCausalLM.from_pretrained(str(p))

    save_file(weights, str(p / "model.safetensors"))
    data = (p / "model.safetensors").read_bytes()
    (p / "model.safetensors").write_bytes(data[: len(data) // 2])
    with pytest.raises(ValueError, match="truncated or corrupt"):
        LlamaForCausalLM.from_pretrained(str(p))
    (p / "model.safetensors").write_bytes(b"not a safetensors file at all")
    with pytest.raises(ValueError, match="truncated or corrupt"):
        LlamaForCausalLM.from_pretrained(str(p))

    (p / "config.json").write_text("{ nope")
    with pytest.raises(ValueError, match="not valid JSON"):
        LlamaForCausalLM.from_pretrained(str(p))


def test_config_validation():
    with pytest.raises(ValueError, match="hidden_size"):
        ModelConfig.from_dict({"model_type": "llama", "vocab_size": 5})
    with pytest.raises(ValueError, match="positive integer"):
        ModelConfig.from_dict(dict(BASE, model_type="llama", num_hidden_layers=0))
    cfg = ModelConfig.from_dict(dict(BASE, model_type="qwen2"))
    assert cfg.attention_bias and cfg.head_dim == 32


def test_decode_sized_steps_run_torch_ops_on_one_thread(tmp_path, monkeypatch, torch_threads_2):
    """Steps of up to the core kernel's row limit run torch's glue ops on one thread (its OpenMP
    workers would spin against the core's thread pool), larger steps keep torch's threads, and the
    thread count is restored after either, also when the step raises."""
    from pyspec.linear import max_fast_rows
    _, path = _hf_model("llama", tmp_path)
    model, runner = _ours(path, num_blocks=64)
    seen = []
    embedding = torch.nn.functional.embedding  # a torch op every step runs
    monkeypatch.setattr(torch.nn.functional, "embedding",
                        lambda *a: (seen.append(torch.get_num_threads()), embedding(*a))[1])
    threads = torch_threads_2
    limit = max_fast_rows(torch.float32)
    assert model._serial_rows == limit
    runner.step([SeqStep(list(range(5)), 0, list(range(3)), None, "last")])
    assert seen and set(seen) == {1}
    assert torch.get_num_threads() == threads
    seen.clear()
    big = limit + 1
    runner.step([SeqStep([i % 111 for i in range(big)], 0, list(range(-(-big // 4))), None,
                         "last")])
    assert seen and set(seen) == {threads}
    monkeypatch.setattr(torch.nn.functional, "embedding", lambda *a: 1 / 0)
    with pytest.raises(ZeroDivisionError):
        runner.step([SeqStep([1, 2], 0, [0], None, "last")])
    assert torch.get_num_threads() == threads
    # A large step inside a small step's block (a drafter catching up within an engine step)
    # takes torch's threads back for itself.
    with model.step_threads(1):
        assert torch.get_num_threads() == 1
        with model.step_threads(limit + 1):
            assert torch.get_num_threads() == threads
            with model.step_threads(2):
                assert torch.get_num_threads() == 1
            assert torch.get_num_threads() == threads
        assert torch.get_num_threads() == 1
    assert torch.get_num_threads() == threads


def test_runner_refuses_out_of_range_token_ids():
    """Checked on the host before the forward: on a GPU an out-of-range id in the embedding would
    be a device-side assert that ends the CUDA context for every later request."""
    from pyspec.runner import ModelRunner, SeqStep
    from helpers import tiny_config

    m = LlamaForCausalLM.random(tiny_config(), seed=0)
    r = ModelRunner(m, num_blocks=4, block_size=8)
    for bad in (m.cfg.vocab_size, -1):
        with pytest.raises(ValueError, match=rf"token id {bad} is out of range \[0, 111\)"):
            r.step([SeqStep([1, bad, 2], 0, [0], None, "last")])
    out = r.step([SeqStep([1, 110, 2], 0, [0], None, "last")])  # the last id is fine
    assert out.logits.shape == (1, m.cfg.vocab_size)
    assert m.device == torch.device("cpu") and LlamaForCausalLM.random(tiny_config()).to(
        "cpu").device == torch.device("cpu")


def test_runner_logits_for_the_last_k_rows():
    """SeqStep.logits = k: exactly the last k rows of "all" (scoring a continuation, e.g. the
    serve quality gate, without a [tokens, vocab] array for the prompt)."""
    from pyspec.runner import ModelRunner, SeqStep
    from helpers import tiny_config

    m = LlamaForCausalLM.random(tiny_config(), seed=0)
    seq = list(range(3, 40))
    full = ModelRunner(m, 8, 8).step([SeqStep(seq, 0, list(range(5)), None, "all")]).logits
    for k in (1, 5, len(seq)):
        got = ModelRunner(m, 8, 8).step([SeqStep(seq, 0, list(range(5)), None, k)]).logits
        assert got.shape == (k, m.cfg.vocab_size)
        torch.testing.assert_close(got, full[-k:], atol=0, rtol=0)
    for bad in (0, len(seq) + 1, True, "some"):
        with pytest.raises(ValueError, match="logits"):
            ModelRunner(m, 8, 8).step([SeqStep(seq, 0, list(range(5)), None, bad)])
