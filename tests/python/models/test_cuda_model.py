"""The model on a CUDA device (``device="cuda"``): its forward against the same model on the CPU,
and greedy speculative decoding through the engine equal to plain greedy decoding on that device
(up to measured near-ties: the CUDA tree kernel is not bitwise equal to one-token decode steps)
for every kind of drafter: host-side ones (prompt lookup, corpus), heads reading the target's
hidden states (EAGLE, Medusa: they run on the host), a separate draft model on the host, and
layer skipping, which runs the target's first layers on its own KV pages on the device.

The device argument's errors run everywhere; the rest is ``cuda``-marked."""

import pytest
import torch

from helpers import assert_equal_up_to_near_ties
from pyspec import TokenTree
from pyspec.engine import Engine, SamplingParams
from pyspec.models.llama import LlamaForCausalLM, resolve_device
from pyspec.runner import ModelRunner, SeqStep
from helpers import tiny_config
from drafters_support import MAX_TOKENS, _drafter, prompts


def _cuda_usable() -> bool:
    try:
        resolve_device("cuda")
        return True
    except ValueError:
        return False


def test_device_argument_errors(tmp_path):
    for bad in ("mps", "not a device", "meta"):
        with pytest.raises(ValueError, match="device must be 'cpu', 'cuda' or 'cuda:N'"):
            resolve_device(bad)
    # The model path is checked first, then the device, before any file is read.
    with pytest.raises(ValueError, match="device must be"):
        LlamaForCausalLM.from_pretrained(str(tmp_path), device="mps")
    with pytest.raises(ValueError, match="device must be"):
        LlamaForCausalLM.random(tiny_config()).to("mps")
    import pyspec
    from models_support import write_tiny_model

    folder = write_tiny_model(tmp_path / "tiny")
    with pytest.raises(ValueError, match="device must be"):
        pyspec.LLM(str(folder), draft="none", device="mps", progress=False)
    assert pyspec.LLM(str(folder), draft="none", device="cpu").model.device.type == "cpu"
    assert resolve_device("cpu") == torch.device("cpu")
    if not _cuda_usable():
        # A CPU-only machine or build says which of the two it is.
        with pytest.raises(ValueError, match=r"device 'cuda'.*(no CUDA kernels|no usable CUDA "
                                             r"device|no CUDA support)"):
            resolve_device("cuda")
        with pytest.raises(ValueError, match="device 'cuda:0'"):
            LlamaForCausalLM.from_pretrained(str(tmp_path), device="cuda:0")
    else:
        n = torch.cuda.device_count()
        with pytest.raises(ValueError, match="CUDA device"):
            resolve_device(f"cuda:{n + 3}")


def _models(dtype):
    cpu = LlamaForCausalLM.random(tiny_config(), seed=0, dtype=dtype)
    gpu = LlamaForCausalLM.random(tiny_config(), seed=0, dtype=dtype).to("cuda")
    return cpu, gpu


# Beyond conftest's check (a CUDA build and a device): also a torch with CUDA support.
needs_cuda_model = pytest.mark.skipif(not _cuda_usable(), reason="no usable CUDA device for "
                                      "the model (see resolve_device)")


@pytest.mark.cuda
@needs_cuda_model
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_forward_on_cuda_matches_the_cpu(dtype):
    cpu, gpu = _models(dtype)
    assert gpu.device.type == "cuda" and gpu.embed.is_cuda and gpu.layers[0]["wqkv"].is_cuda
    prompt = prompts()[3]
    tree = TokenTree.from_paths([[0], [1], [0, 0], [0, 1], [1, 0], [0, 0, 0]])
    tree_tokens = [prompt[-1], 5, 9, 17, 3, 40, 22]
    logits = []
    for m in (cpu, gpu):
        r = ModelRunner(m, num_blocks=16, block_size=8)
        n = len(prompt) - 1
        out = r.step([SeqStep(prompt[:-1], 0, list(range(16)), None, "all")])
        r.commit_kv(out, 0, range(n), list(range(n)))
        tree_out = r.step([SeqStep(tree_tokens, n, list(range(16)), tree, "all")])
        assert out.logits.device.type == "cpu" and tree_out.logits.device.type == "cpu"
        assert out.k_new.device == m.device  # the scratch K/V stays with the model
        logits.append(torch.cat([out.logits, tree_out.logits]))
    ref, got = logits
    scale = float(ref.abs().max())
    tol = 2e-3 if dtype == torch.float32 else 0.08
    diff = float((got - ref).abs().max())
    assert diff <= tol * max(scale, 1.0), f"{dtype}: max |cuda - cpu| = {diff:.3e} (scale {scale:.2f})"


KINDS = ["ngram", "suffix", "layer-skip", "draft-model", "medusa", "eagle", "ngram|eagle"]


@pytest.mark.cuda
@needs_cuda_model
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("kind", KINDS)
def test_greedy_speculation_on_cuda_equals_plain(kind, dtype, tmp_path):
    model = LlamaForCausalLM.random(tiny_config(), seed=0, dtype=dtype).to("cuda")
    ps = prompts()
    params = SamplingParams(max_tokens=MAX_TOKENS)
    plain_eng = Engine(ModelRunner(model, num_blocks=64, block_size=8), drafter=None,
                       max_num_seqs=8, max_num_batched_tokens=80, max_prefill_chunk=16)
    plain = [r.token_ids for r in plain_eng.generate(ps, params)]
    runner = ModelRunner(model, num_blocks=64, block_size=8)
    drafter = _drafter(kind, runner, model, str(tmp_path), plain)
    if kind in ("medusa", "eagle"):  # head drafters run on the target's device
        assert drafter.device == model.device
        assert (drafter.w[0] if kind == "medusa" else drafter.runner.kv.k).is_cuda
    eng = Engine(runner, drafter=drafter,
                 max_num_seqs=8, max_num_batched_tokens=80, max_prefill_chunk=16, adaptive=False)
    res = eng.generate(ps, params)
    for i, r in enumerate(res):
        assert not r.stats.fallbacks.get("drafter_error"), f"{kind} failed on request {i}"
    assert sum(r.stats.draft_tokens for r in res) > 0
    near_tie = 1e-3 if dtype == torch.float32 else 0.0625
    assert_equal_up_to_near_ties(model, ps, [r.token_ids for r in res], plain, near_tie,
                                 f"{kind} {dtype} on cuda: ")
    s = eng.scheduler
    assert s.num_free_blocks == s.num_total_blocks


@pytest.mark.cuda
@needs_cuda_model
@pytest.mark.parametrize("graphs", [False, True])
@pytest.mark.parametrize("kind", ["ngram", "eagle"])
def test_greedy_speculation_with_triton_attention_equals_plain(kind, graphs, tmp_path):
    """The whole engine with the Triton tree-attention kernel (bfloat16), and with its steps in
    CUDA graphs (an EAGLE head's verify steps return the target's hidden states from theirs):
    greedy speculative output equals plain greedy output with pyspec's own kernel, up to measured
    near-ties."""
    pytest.importorskip("triton")
    model = LlamaForCausalLM.random(tiny_config(), seed=0, dtype=torch.bfloat16).to("cuda")
    ps = prompts()
    params = SamplingParams(max_tokens=MAX_TOKENS)
    plain_eng = Engine(ModelRunner(model, num_blocks=64, block_size=8), drafter=None,
                       max_num_seqs=8, max_num_batched_tokens=80, max_prefill_chunk=16)
    plain = [r.token_ids for r in plain_eng.generate(ps, params)]
    model.set_attention_backend("triton")
    runner = ModelRunner(model, num_blocks=64, block_size=8)
    if graphs:
        runner.enable_cuda_graphs(max_batch=8, max_tokens=512)
    eng = Engine(runner, drafter=_drafter(kind, runner, model, str(tmp_path), plain),
                 max_num_seqs=8, max_num_batched_tokens=80, max_prefill_chunk=16, adaptive=False)
    res = eng.generate(ps, params)
    assert sum(r.stats.draft_tokens for r in res) > 0
    if graphs:
        assert runner.graphs.describe()["replays"] > 0
    model.set_attention_backend("native")  # the near-tie check's forward uses pyspec's kernel
    assert_equal_up_to_near_ties(model, ps, [r.token_ids for r in res], plain, 0.0625,
                                 f"{kind} with triton attention: ")


@pytest.mark.cuda
@needs_cuda_model
def test_sampled_acceptance_on_the_device_matches_plain_sampling():
    """The engine keeps a GPU model's logits on the device: filters and the tree walk run there
    and only decisions come back. With prompt lookup's deterministic drafts the sampled output is
    plain sampling's very output for the seed (float32: the tree step's logits equal the decode
    step's to ~1e-6, so a draw landing between them is not expected at this size)."""
    model = LlamaForCausalLM.random(tiny_config(), seed=0, dtype=torch.float32).to("cuda")
    ps = prompts()
    params = [SamplingParams(max_tokens=MAX_TOKENS, temperature=0.8, top_p=0.9, seed=s)
              for s in range(len(ps))]
    params[1] = SamplingParams(max_tokens=MAX_TOKENS)  # a greedy neighbour in the same batch
    outs = []
    for drafter in (None, "ngram"):
        eng = Engine(ModelRunner(model, num_blocks=64, block_size=8), drafter=drafter,
                     max_num_seqs=8, max_num_batched_tokens=80, max_prefill_chunk=16,
                     adaptive=False)
        outs.append(eng.generate(ps, params))
    plain, spec = outs
    assert sum(r.stats.accepted_tokens for r in spec) > 0  # the device walk accepted drafts
    assert [r.token_ids for r in spec] == [r.token_ids for r in plain]


@pytest.mark.cuda
@needs_cuda_model
def test_accept_step_on_the_device_equals_the_cpu():
    """The engine's ACCEPT stage on GPU logits against the same logits on the CPU, request for
    request: greedy, sampled with deterministic children, and sampled children with draft
    distributions (recursive rejection sampling), in one batch."""
    from types import SimpleNamespace

    from pyspec.drafters.base import Draft
    from pyspec.engine.accept import accept_step

    g = torch.Generator().manual_seed(0)
    vocab, reqs, drafts = 300, [], []
    for k in range(24):
        n = 1 + k % 7
        parents = [-1] + [int(torch.randint(0, i, (1,), generator=g)) for i in range(1, n)]
        tokens = torch.randint(0, vocab, (n,), generator=g).tolist()
        kind = k % 3  # 0 greedy, 1 sampled (deterministic children), 2 sampled children
        temp = 0.0 if kind == 0 else 0.9
        probs = None
        if kind == 2:
            probs = torch.softmax(torch.randn(n, vocab, generator=g) * 2, -1)
            for i in range(1, n):  # a sampled child must have been possible under q
                probs[parents[i], tokens[i]] += 0.05
            probs = probs / probs.sum(-1, keepdim=True)
        drafts.append(Draft(tokens, parents, probs))
        reqs.append(SimpleNamespace(
            params=SimpleNamespace(temperature=temp, top_k=50 * (k % 2), top_p=0.95, min_p=0.0),
            seed=1000 + k, context=list(range(10 + k))))
    rows = sum(len(d.tokens) for d in drafts)
    logits = torch.randn(rows, vocab, generator=g) * 3
    # Draft tokens made likely, so that some are accepted.
    flat = [t for d in drafts for t in d.tokens]
    logits[torch.arange(rows - 1), torch.tensor(flat[1:])] += 4
    cpu = accept_step(reqs, drafts, logits, vocab)
    gpu = accept_step(reqs, drafts, logits.cuda(), vocab)
    assert gpu == cpu
    assert sum(cpu[2]) > 0
