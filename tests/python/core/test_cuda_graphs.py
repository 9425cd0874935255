"""CUDA graphs of decode and verify steps (pyspec.cuda_graphs) and the fixed launches they replay
(pyspec.triton_attention.StaticAttention).

On a GPU the steps are captured and replayed. Without one, ``emulate=True`` runs the same padded
steps on the CPU with the Triton kernels in Triton's interpreter (``TRITON_INTERPRET=1``, a
whole-process switch): those cases run in a child process, whose failures fail the test here.
Either way a graphed step's logits and K/V must equal an eager step's, and the engine's greedy
output must equal plain decoding's.
"""

import random

import pytest
import torch

pytest.importorskip("triton", reason="CUDA graphs run the Triton attention kernel")

from pyspec import TokenTree  # noqa: E402
from pyspec.attention import tree_attention  # noqa: E402
from pyspec.cuda_graphs import batch_buckets, rows_buckets  # noqa: E402
from pyspec.engine import Engine  # noqa: E402
from pyspec.models.llama import LlamaForCausalLM  # noqa: E402
from pyspec.runner import ModelRunner, SeqStep  # noqa: E402
from pyspec.triton_attention import StaticAttention  # noqa: E402
from helpers import (assert_equal_up_to_near_ties, default_prompt, run_interpreted,  # noqa: E402
                     tiny_config)
from test_attention import F32, BF16, make_step, plan_for  # noqa: E402
from test_triton_attention import check_partition  # noqa: E402

from pyspec.params import SamplingParams  # noqa: E402


def test_buckets():
    assert batch_buckets(32) == [1, 2, 4, 8, 16, 24, 32]
    assert batch_buckets(1) == [1] and batch_buckets(5) == [1, 2, 4, 5]
    assert batch_buckets(20) == [1, 2, 4, 8, 16, 20]
    assert rows_buckets(64) == [1, 2, 4, 8, 16, 32, 64] and rows_buckets(6) == [1, 2, 4, 6]
    assert rows_buckets(1) == [1]


def _runner(dtype=torch.float32, device="cpu", seed=0):
    model = LlamaForCausalLM.random(tiny_config(), seed=seed, dtype=dtype).to(device)
    return ModelRunner(model, 64, 16, kv_dtype=dtype)


def test_bucket_selection_and_refusals():
    runner = _runner()
    g = runner.enable_cuda_graphs(max_batch=8, max_rows=16, max_tokens=64, emulate=True)
    assert g.bucket([1], [0]) == (1, 1)
    assert g.bucket([1, 1, 1], [5, 0, 700]) == (4, 1)
    assert g.bucket([3, 1, 16], [0, 0, 0]) == (4, 16)
    assert g.bucket([5] * 8, [0] * 8) == (8, 8)
    assert g.bucket([9] * 8, [0] * 8) is None  # 8 x 16 rows: past max_tokens
    assert g.bucket([17], [0]) is None  # a prefill chunk: eager
    assert g.bucket([1] * 9, [0] * 9) is None
    assert g.bucket([], []) is None
    assert g.bucket([1], [4096 + 16]) is None  # past the model's positions: the eager error
    with pytest.raises(ValueError, match="max_batch must be an int in"):
        runner.enable_cuda_graphs(max_batch=0, emulate=True)
    with pytest.raises(ValueError, match="need a model on a CUDA device"):
        runner.enable_cuda_graphs()
    half = ModelRunner(runner.model, 64, 16, kv_dtype=torch.float16)  # LLM()'s default here
    with pytest.raises(ValueError, match="reads K/V in the model's dtype"):
        half.enable_cuda_graphs(emulate=True)


def test_a_failed_capture_leaves_eager_steps(monkeypatch):
    """A capture that raises: a warning naming the bucket and the error, the step itself and
    every later one run eagerly with the same results, and no capture is tried again."""
    from pyspec.cuda_graphs import GraphedSteps

    eager = _runner()
    eager.kv.k.normal_()  # (the steps' prefixes read pages no step wrote)
    eager.kv.v.normal_()
    runner = ModelRunner(eager.model, 64, 16, kv=eager.kv)
    g = runner.enable_cuda_graphs(max_batch=4, max_rows=8, emulate=True)
    tries = []

    def broken(self, key, attn, taps, final, tapped):
        tries.append(key)
        raise RuntimeError("operation not permitted when stream is capturing")

    monkeypatch.setattr(GraphedSteps, "_capture", broken)
    steps = list(random_steps(random.Random(5), eager.model.cfg.vocab_size, 3, max_batch=3))
    with pytest.warns(UserWarning, match=r"CUDA graphs are off .* capturing bucket \(\d+, \d+\) "
                                         "failed: RuntimeError: operation not permitted"):
        out = runner.step(steps[0])
    torch.testing.assert_close(out.logits, eager.step(steps[0]).logits, atol=0, rtol=0)
    for seqs in steps[1:]:
        torch.testing.assert_close(runner.step(seqs).logits, eager.step(seqs).logits, atol=0,
                                   rtol=0)
    info = g.describe()
    assert len(tries) == 1 and info["replays"] == 0 and "RuntimeError" in info["failed"]
    assert g.bucket([1], [0]) is None


def test_llm_and_cli_settings():
    from pyspec import LLM
    from pyspec.cli import build_parser

    # Refused before the model loads.
    with pytest.raises(ValueError, match="needs device='cuda' .* and attention_backend='triton'"):
        LLM("/nonexistent", cuda_graphs=True)
    with pytest.raises(ValueError, match="needs device='cuda'"):
        LLM("/nonexistent", device="cuda", cuda_graphs=True)  # the native backend
    with pytest.raises(ValueError, match="cuda_graphs must be a bool"):
        LLM("/nonexistent", cuda_graphs="yes")
    for cmd in ("generate", "serve"):
        args = build_parser().parse_args([cmd, "--cuda-graphs", "--device", "cuda"])
        assert args.cuda_graphs is True


def test_static_attention_work_lists_fit_and_pad():
    """Steps of every size in a bucket: the fixed item and merge lists hold their whole
    partition (each row's prefix once, its new tokens once), and every unused entry points at
    the padding request, which has no rows."""
    rng = random.Random(0)
    sa = StaticAttention("cpu", 6, 16, 8, 2, 64, 16, 6 * 300, num_sms=16, min_chunk=64)
    assert sa.block_m == 64 and sa.splits > 1 and sa.num_merges > 0
    for _ in range(30):
        batch = rng.randint(1, 6)
        reqs = [(rng.choice([0, 3, 63, 64, 500, 4000]), rng.choice([1, 2, 7, 16]), None)
                for _ in range(batch)]
        c = make_step(reqs, 16, 8, 2, 8, F32, "cpu", seed=rng.randrange(99))
        sa.write(plan_for(c, 8, 2))
        v = sa._host_views
        lens, prefixes = [n for _, n, _ in reqs], [p for p, _, _ in reqs]
        items = [tuple(x) for x in v["items"].view(-1, 6).tolist()]
        merges = [tuple(x) for x in v["merges"].view(-1, 4).tolist()][:sa.num_merges]
        real = [it for it in items if it[0] != sa._pad]
        assert all(it == (sa._pad, 0, 0, 0, 0, -1) for it in items[len(real):])
        real_merges = [m for m in merges if m[0] != sa._pad]
        assert all(m == (sa._pad, 0, 0, 0) for m in merges[len(real_merges):])
        parts = sum(m[3] for m in real_merges) * sa.block_m
        check_partition({sa.block_m: (real, real_merges)}, parts, lens, prefixes,
                        lambda rows: 64, min_chunk=64)
        q = v["q_indptr"].tolist()
        assert q[:batch + 1] == c["q_indptr"].tolist() and set(q[batch + 1:]) == {q[batch]}
    # run() checks its tensors against the last write (before any kernel launch).
    c = make_step([(40, 3, None), (0, 5, None)], 16, 8, 2, 64, F32, "cpu")
    sa.write(plan_for(c, 8, 2))
    t, nb = c["q"].shape[0], c["k_pages"].shape[0]
    with pytest.raises(ValueError, match=f"StaticAttention for {t} .. 96 rows"):
        sa.run(c["q"][:t - 1], c["k_pages"], c["v_pages"], c["k_new"][:t - 1],
               c["v_new"][:t - 1], 0.125)
    with pytest.raises(ValueError, match=rf"K/V pages \[{nb}, 16, 2, 64\]"):
        sa.run(c["q"], c["k_pages"][:, :, :1].contiguous(), c["v_pages"], c["k_new"],
               c["v_new"], 0.125)
    with pytest.raises(ValueError, match="'out' must be shaped as q"):
        sa.run(c["q"], c["k_pages"], c["v_pages"], c["k_new"], c["v_new"], 0.125,
               out=torch.empty(t + 1, 8, 64))
    c = make_step([(0, 17, None)], 16, 8, 2, 8, F32, "cpu")
    with pytest.raises(ValueError, match="does not fit a StaticAttention of 6 requests, 16"):
        sa.write(plan_for(c, 8, 2))
    c = make_step([(0, 1, None)], 16, 4, 2, 8, F32, "cpu")
    with pytest.raises(ValueError, match="built for 4/2 q/kv heads"):
        sa.write(plan_for(c, 4, 2))


# ---- the kernels and steps themselves (interpreter on the CPU, compiled on a GPU) -------------

def run_static_attention(device):
    """Successive steps through one StaticAttention (the buffers a graph would replay), with
    query rows padded past the step's: equal to the eager kernel on the same step."""
    rng = random.Random(1)
    for hq, hkv, d, dtype in ((8, 2, 64, F32), (9, 3, 64, BF16)):
        sa = StaticAttention(device, 4, 8, hq, hkv, d, 16, 4 * 200, num_sms=8, min_chunk=64)
        for step in range(4):
            reqs = []
            for _ in range(rng.randint(1, 4)):
                n = rng.choice([1, 3, 8])
                parents = [-1] + [rng.randrange(i) for i in range(1, n)] if n > 1 else None
                reqs.append((rng.choice([0, 40, 700, 1500]), n, parents))
            c = make_step(reqs, 16, hq, hkv, d, dtype, device, seed=step)
            plan = plan_for(c, hq, hkv)
            want = tree_attention(plan, c["q"], c["k_pages"], c["v_pages"], c["k_new"],
                                  c["v_new"], scale=0.125, backend="triton")
            t = c["q"].shape[0]
            pad = 4 * 8

            def padded(x):
                return torch.cat([x, torch.randn(pad - t, *x.shape[1:]).to(x)])

            sa.write(plan)
            got = tree_attention(sa, padded(c["q"]), c["k_pages"], c["v_pages"],
                                 padded(c["k_new"]), padded(c["v_new"]), scale=0.125)
            tol = 1e-5 if dtype == F32 else 2e-2
            torch.testing.assert_close(got[:t], want, atol=tol, rtol=0)


def random_steps(rng, vocab, count, max_batch=5):
    """Steps of decode tokens, draft trees and causal chunks over fresh pages."""
    for _ in range(count):
        seqs, used = [], 0
        for _ in range(rng.randint(1, max_batch)):
            n = rng.choice([1, 1, 3, 5, 8])
            pre = rng.randint(0, 60)
            blocks = -(-(pre + n) // 16)
            tree, logits = None, "last"
            if n > 1 and rng.random() < 0.7:
                tree = TokenTree([-1] + [rng.randrange(i) for i in range(1, n)])
                logits = "all"
            seqs.append(SeqStep([rng.randrange(vocab) for _ in range(n)], pre,
                                list(range(used, used + blocks)), tree, logits))
            used += blocks
        yield seqs


def run_graphed_steps(device, dtype=torch.float32, emulate=True):
    """Graphed (padded, fixed-launch) steps against eager steps of the same runner's pool: same
    logits and K/V; one capture per bucket; steps no graph holds run eagerly."""
    eager = _runner(dtype, device)
    eager.kv.k.normal_()
    eager.kv.v.normal_()
    runner = ModelRunner(eager.model, 64, 16, kv=eager.kv)
    g = runner.enable_cuda_graphs(max_batch=8, max_rows=8, max_tokens=64, emulate=emulate)
    tol = 1e-4 if dtype == torch.float32 else 5e-2
    rng = random.Random(2)
    vocab = eager.model.cfg.vocab_size
    for seqs in random_steps(rng, vocab, 8):
        a, b = eager.step(seqs), runner.step(seqs)
        torch.testing.assert_close(b.logits, a.logits, atol=tol, rtol=0)
        torch.testing.assert_close(b.k_new.float(), a.k_new.float(), atol=tol, rtol=0)
        assert b.logits_indptr == a.logits_indptr and b.row_indptr == a.row_indptr
    info = g.describe()
    assert info["replays"] == 8 and info["captures"] == len(info["buckets"]) < 8
    # A prefill chunk past the rows buckets: eager.
    long = [SeqStep(list(range(20)), 0, [0, 1], None, "last")]
    torch.testing.assert_close(runner.step(long).logits, eager.step(long).logits, atol=tol,
                               rtol=0)
    assert g.describe()["replays"] == 8
    # Steps asking for hidden states (head drafters): graphed too, one graph per bucket and
    # layer list, the same logits, K/V and hidden states as eager steps.
    layers = eager.model.cfg.num_hidden_layers
    step = [SeqStep([1, 2, 3], 20, [0, 1], TokenTree([-1, 0, 0]), "all"),
            SeqStep([4], 7, [2], None, "last")]
    for hidden in (True, (1, layers), (1, layers), (1,), True):
        a, b = eager.step(step, return_hidden=hidden), runner.step(step, return_hidden=hidden)
        torch.testing.assert_close(b.logits, a.logits, atol=tol, rtol=0)
        torch.testing.assert_close(b.k_new.float(), a.k_new.float(), atol=tol, rtol=0)
        torch.testing.assert_close(b.hidden.float(), a.hidden.float(), atol=tol, rtol=0)
    info = g.describe()
    assert info["replays"] == 13
    assert {(2, 4, (layers,)), (2, 4, (1, layers)), (2, 4, (1,))} <= set(info["buckets"])
    # The hidden states a step returned are its own: the next replay does not overwrite them.
    kept = b.hidden.clone()
    runner.step(step, return_hidden=True)
    assert torch.equal(b.hidden, kept)


def run_engine_greedy(device, emulate=True, heads_dir=None):
    """Speculative decoding through graphed steps (n-gram drafts, and an EAGLE head reading two
    target layers when ``heads_dir`` is given): greedy output equal to plain decoding's."""
    from drafters_support import _heads_dir

    model = LlamaForCausalLM.random(tiny_config(), seed=3).to(device)
    prompts = [default_prompt(seed=s) for s in (1, 2, 3)]
    params = SamplingParams(max_tokens=24)

    def engine(draft, graphs):
        runner = ModelRunner(model, 96, 16, kv_dtype=torch.float32)
        if graphs:
            runner.enable_cuda_graphs(max_batch=4, max_rows=16, emulate=emulate)
        if draft == "eagle":
            from pyspec.drafters import load_heads

            draft = load_heads(_heads_dir(heads_dir, model, "eagle-fused"), runner)
            return Engine(runner, drafter=draft, adaptive=False), runner
        eng = Engine(runner, drafter=draft, gamma=4 if draft != "none" else None,
                     adaptive=False, **({"initial_draft_tokens": 4} if draft != "none" else {}))
        return eng, runner

    plain, _ = engine("none", False)
    refs = [r.token_ids for r in plain.generate(prompts, params)]
    for kind in ("ngram",) + (("eagle",) if heads_dir else ()):
        spec, runner = engine(kind, True)
        outs = spec.generate(prompts, params)
        info = runner.graphs.describe()
        assert info["replays"] > 0 and not info["failed"]
        if kind == "eagle":  # the verify steps that return the head's two layers were graphed
            assert any(len(k) == 3 and k[2] == (1, 2) for k in info["buckets"]), info
        # Drafts were verified in graphs (a random head's are rarely right: drafted, at least).
        assert sum(r.stats.accepted_tokens if kind == "ngram" else r.stats.draft_tokens
                   for r in outs) > 0
        identical, ties = assert_equal_up_to_near_ties(
            model, prompts, [r.token_ids for r in outs], refs, near_tie=1e-3)
        assert identical + len(ties) == len(prompts), kind


def run_all(device, heads_dir):
    run_static_attention(device)
    run_graphed_steps(device)
    run_engine_greedy(device, heads_dir=heads_dir)


def test_interpreted_graphed_steps(tmp_path):
    run_interpreted(__file__, f"run_all('cpu', {str(tmp_path)!r})")


@pytest.mark.cuda
def test_cuda_static_attention():
    run_static_attention("cuda")


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cuda_graphed_steps(dtype):
    run_graphed_steps("cuda", dtype, emulate=False)


@pytest.mark.cuda
def test_cuda_graphed_engine_greedy(tmp_path):
    run_engine_greedy("cuda", emulate=False, heads_dir=str(tmp_path))
