"""A draft tree verified in one target step scores every node bit for bit as decoding the node's
path one token at a time does, in float32 and bfloat16: the dense layers compute a row the same
whatever the rows beside it, and the CPU attention walks a tree node's prefix and ancestors in the
same position-aligned tiles as a single-token decode step (then its own key alone). Greedy
speculative output is then plain greedy output exactly, not up to rounding.

Contexts around the attention's 64-key tile boundaries (63, 64, 65), past several tiles (nodes
then cross a tile boundary at different depths) and long enough for split-KV (1,150: a tree step
and its nodes' one-token steps once cut the prefix at different places; 2,100); trees of up to the
dense kernel's row limit.
"""

import random

import pytest
import torch

from pyspec import TokenTree
from pyspec.linear import max_fast_rows
from pyspec.models.llama import LlamaForCausalLM
from pyspec.runner import ModelRunner, SeqStep

from models_support import VOCAB, write_tiny_model


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return write_tiny_model(tmp_path_factory.mktemp("tiny_exact"))


def _path(parents, j):
    path = []
    while j >= 0:
        path.append(j)
        j = parents[j]
    return path[::-1]


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("ctx_len", [5, 40, 63, 64, 65, 200, 250, 1150, 2100])
def test_tree_rows_equal_decoding_their_paths(model_dir, dtype, ctx_len):
    model = LlamaForCausalLM.from_pretrained(model_dir, dtype=dtype)
    bs = 16
    blocks = (ctx_len + 160) // bs + 2
    runner = ModelRunner(model, num_blocks=blocks, block_size=bs)
    table = list(range(blocks))

    def slots(start, n):
        return [table[(start + i) // bs] * bs + (start + i) % bs for i in range(n)]

    rng = random.Random(ctx_len)
    ctx = [rng.randrange(3, VOCAB) for _ in range(ctx_len)]
    out = runner.step([SeqStep(ctx, 0, table, None, "none")])
    runner.commit_kv(out, 0, range(ctx_len), slots(0, ctx_len))
    # Up to the dense kernel's row limit (more rows go to torch's GEMM, whose rows depend on the
    # batch): a chain of 2/3 of the nodes, the rest leaves hung on random chain nodes.
    n = min(40, max_fast_rows(getattr(torch, dtype)))
    chain = 2 * n // 3
    parents = [-1] + list(range(chain - 1)) + [rng.randrange(chain) for _ in range(chain, n)]
    toks = [rng.randrange(3, VOCAB) for _ in range(n)]
    tree_logits = runner.step([SeqStep(toks, ctx_len, table, TokenTree(parents), "all")]).logits
    checked = 0
    picks = sorted(set([0, 1, chain // 2, chain - 1] + rng.sample(range(chain, n), (n - chain) // 2)))
    for j in picks:
        for d, node in enumerate(_path(parents, j)):
            out = runner.step([SeqStep([toks[node]], ctx_len + d, table, None, "last")])
            runner.commit_kv(out, 0, [0], slots(ctx_len + d, 1))
        row = out.logits[-1]
        assert torch.equal(row, tree_logits[j]), (
            f"{dtype} node {j} (depth {d}): max |diff| "
            f"{(row - tree_logits[j]).abs().max().item():.3e} against decoding its path")
        checked += 1
    assert checked == len(picks) >= 5


def test_greedy_speculation_is_plain_greedy_exactly_in_bfloat16(model_dir):
    """Through the engine: trees from prompt lookup and a chain drafter, bfloat16, token for token
    equal to plain decoding (no near-tie allowance)."""
    import pyspec

    prompts = ["abc abc abc abc abc", "the cat sat on the mat. the cat sat on the",
               "1 2 3 4 5 6 7 8 9 10 1 2 3 4 5 6", "x y z"]
    plain = pyspec.LLM(model_dir, draft="none", dtype="bfloat16", progress=False)
    params = dict(max_tokens=48, ignore_eos=True)
    ref = [o.token_ids for o in plain.generate(prompts, params)]
    # A fixed draft length: the adaptive cost model follows measured step times, and on a loaded
    # machine it could draft too little for any token to be accepted.
    spec = pyspec.LLM(model_dir, draft="ngram", dtype="bfloat16", progress=False,
                      spec=pyspec.SpecConfig(adaptive=False))
    outs = spec.generate(prompts, params)
    assert [o.token_ids for o in outs] == ref
    assert sum(o.stats.draft_tokens for o in outs) > 0  # trees were verified
    assert sum(o.stats.accepted_tokens for o in outs) > 0
