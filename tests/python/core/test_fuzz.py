"""Malformed-input fuzzing of the core's ops at the binding level (``pyspec._C``).

Each case starts from a valid call, applies 1-3 random mutations (dtype, rank, sizes, values such as
NaN/inf/negative/out-of-range ids, non-contiguous strides, non-tensors) and calls the op. The only
acceptable outcomes are a normal return or ``ValueError``; anything else — another exception type, a
crash, a hang — fails. The raw bindings are fuzzed (not the Python wrappers) because C++ embedders
and the wrappers both rely on the core's own validation.
"""

import random

import pytest
import torch

from pyspec import _C

DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.int32, torch.int64,
          torch.uint8, torch.bool, torch.int8]
CASES_PER_OP = 2600  # x 5 op families >= 10^4 malformed calls


def _mutate_tensor(t: torch.Tensor, rng: random.Random):
    kind = rng.randrange(9)
    if kind == 0:
        dt = rng.choice(DTYPES)
        return t.to(dt)
    if kind == 1 and t.dim() > 0 and t.numel() > 0:  # drop a dim
        return t.reshape(-1)[: t.numel() // t.shape[0]] if t.dim() > 1 else t[0]
    if kind == 2:  # add a dim
        return t.unsqueeze(rng.randrange(t.dim() + 1))
    if kind == 3 and t.dim() > 0:  # resize one dim (0, -1, +1, x2)
        d = rng.randrange(t.dim())
        new = list(t.shape)
        new[d] = rng.choice([0, max(new[d] - 1, 0), new[d] + 1, new[d] * 2 + 1])
        out = torch.zeros(new, dtype=t.dtype)
        sl = tuple(slice(0, min(a, b)) for a, b in zip(new, t.shape))
        out[sl] = t[sl]
        return out
    if kind == 4 and t.numel() > 0:  # poison values
        t = t.clone(memory_format=torch.contiguous_format)
        flat = t.view(-1)
        i = rng.randrange(flat.numel())
        if t.is_floating_point():
            flat[i] = rng.choice([float("nan"), float("inf"), -float("inf"), -1.0, 1e30, 2.0])
        elif t.dtype != torch.bool:
            info = torch.iinfo(t.dtype)
            flat[i] = rng.choice([-1, -2, info.max, info.min, 1 << 20 if info.bits > 16 else info.max])
        return t
    if kind == 5 and t.dim() >= 2 and t.shape[0] > 1:  # non-contiguous
        return t.transpose(0, 1)
    if kind == 6 and t.dim() >= 1 and t.shape[-1] > 1:  # strided view
        return t[..., ::2]
    if kind == 7:
        return rng.choice([None, [1, 2, 3], 3, "x", torch.tensor(1.0)])
    if t.dim() > 0 and t.shape[0] > 0:  # shuffle values along dim 0
        return t[torch.randperm(t.shape[0])]
    return t


def _fuzz(make_valid, call, rng: random.Random, n: int):
    ok = errors = 0
    for i in range(n):
        args = make_valid(rng)
        keys = [k for k, v in args.items() if isinstance(v, torch.Tensor)]
        for _ in range(rng.randint(1, 3)):
            k = rng.choice(keys)
            if isinstance(args[k], torch.Tensor):
                args[k] = _mutate_tensor(args[k], rng)
        try:
            call(**args)
            ok += 1
        except ValueError:
            errors += 1
        except Exception as e:  # noqa: BLE001 - the point of the test
            pytest.fail(f"case {i}: {type(e).__name__}: {e}\nargs: "
                        + ", ".join(f"{k}={getattr(v, 'shape', v)}/{getattr(v, 'dtype', '')}"
                                    for k, v in args.items()))
    return ok, errors


def _tree_batch(rng, b, vocab):
    parents, indptr, tokens = [], [0], []
    for _ in range(b):
        n = rng.randint(1, 6)
        parents += [-1] + [rng.randrange(i) for i in range(1, n)]
        tokens += [rng.randrange(vocab) for _ in range(n)]
        indptr.append(len(parents))
    return (torch.tensor(parents, dtype=torch.int32), torch.tensor(indptr, dtype=torch.int64),
            torch.tensor(tokens, dtype=torch.int32))


def test_fuzz_materialize_kv():
    def make(rng):
        return dict(scratch=torch.randn(5, 2, 8), pages=torch.zeros(3, 4, 2, 8),
                    src_rows=torch.tensor([0, 4, 2]), dst_slots=torch.tensor([1, 11, 5]))

    ok, err = _fuzz(make, _C.materialize_kv, random.Random(1), CASES_PER_OP)
    assert err > CASES_PER_OP // 4  # the mutations really do produce bad input


def test_fuzz_sampling_filters():
    def make(rng):
        n, v = rng.randint(1, 4), rng.randint(2, 40)
        return dict(logits=torch.randn(n, v), temperature=torch.rand(n) + 0.1,
                    top_k=torch.randint(0, v + 1, (n,), dtype=torch.int32),
                    top_p=torch.rand(n) * 0.9 + 0.1, min_p=torch.rand(n) * 0.5,
                    probs=torch.empty(n, v))

    ok, err = _fuzz(make, _C.apply_sampling_filters, random.Random(2), CASES_PER_OP)
    assert err > CASES_PER_OP // 4


def test_fuzz_accept_trees():
    def make(rng):
        b, v = rng.randint(1, 3), rng.randint(3, 12)
        parents, indptr, tokens = _tree_batch(rng, b, v)
        n = parents.shape[0]
        p = torch.softmax(torch.randn(n, v), -1)
        q = torch.softmax(torch.randn(n, v), -1)
        depth = 8
        return dict(target_probs=p, draft_probs=q, tokens=tokens, parents=parents,
                    tree_indptr=indptr, greedy=torch.tensor([rng.random() < 0.3] * b),
                    sampled_children=torch.tensor([False] * b),
                    seeds=torch.arange(b, dtype=torch.int64),
                    offsets=torch.zeros(b, dtype=torch.int64),
                    accepted_nodes=torch.empty(b, depth, dtype=torch.int32),
                    emitted_tokens=torch.empty(b, depth, dtype=torch.int32),
                    num_accepted=torch.empty(b, dtype=torch.int32))

    ok, err = _fuzz(make, _C.accept_trees, random.Random(3), CASES_PER_OP)
    assert err > CASES_PER_OP // 4 and ok > 0


def test_fuzz_attention():
    hq, hkv, d, bs, nb = 4, 2, 16, 4, 12

    def make(rng):
        b = rng.randint(1, 3)
        q_len = [rng.randint(1, 4) for _ in range(b)]
        prefix = [rng.randint(0, 8) for _ in range(b)]
        tables = torch.full((b, 3), -1, dtype=torch.int32)
        perm = torch.randperm(nb)
        for i in range(b):
            need = (prefix[i] + bs - 1) // bs
            tables[i, :need] = perm[3 * i: 3 * i + need].to(torch.int32)
        tparents, tindptr = [], [0]
        for i in range(b):
            if rng.random() < 0.5:
                tparents += [-1] + [rng.randrange(j) for j in range(1, q_len[i])]
            tindptr.append(len(tparents))
        t = sum(q_len)
        return dict(q_indptr=torch.tensor([0] + list(torch.tensor(q_len).cumsum(0))),
                    prefix_lens=torch.tensor(prefix), block_tables=tables, block_size=bs,
                    tree_parents=torch.tensor(tparents, dtype=torch.int32),
                    tree_indptr=torch.tensor(tindptr), num_blocks=nb,
                    q=torch.randn(t, hq, d), k_pages=torch.randn(nb, bs, hkv, d),
                    v_pages=torch.randn(nb, bs, hkv, d), k_new=torch.randn(t, hkv, d),
                    v_new=torch.randn(t, hkv, d), out=torch.empty(t, hq, d),
                    lse=torch.empty(t, hq))

    def call(q_indptr, prefix_lens, block_tables, block_size, tree_parents, tree_indptr,
             num_blocks, q, k_pages, v_pages, k_new, v_new, out, lse):
        plan = _C.plan_attention(q_indptr, prefix_lens, block_tables, block_size, tree_parents,
                                 tree_indptr, num_blocks)
        _C.run_attention(plan, q, k_pages, v_pages, k_new, v_new, out, lse, 0.25)

    ok, err = _fuzz(make, call, random.Random(4), CASES_PER_OP)
    assert err > CASES_PER_OP // 4 and ok > 0


def test_fuzz_trees_and_block_manager():
    rng = random.Random(5)
    bad = 0
    for i in range(CASES_PER_OP):
        n = rng.randint(0, 8)
        parents = [rng.randint(-3, 9) for _ in range(n)]
        try:
            _C.TokenTree(parents)
        except ValueError:
            bad += 1
        bm = _C.BlockManager(rng.randint(1, 6), rng.choice([1, 2, 16]))
        calls = [
            lambda: bm.add_request(rng.randint(-2, 3), [rng.randint(-5, 200) for _ in range(rng.randint(0, 40))]),
            lambda: bm.reserve(rng.randint(-1, 3), rng.randint(-3, 40)),
            lambda: bm.commit(rng.randint(-1, 3), [rng.randint(-5, 50) for _ in range(rng.randint(0, 5))]),
            lambda: bm.mark_computed(rng.randint(-1, 3), rng.randint(-3, 40)),
            lambda: bm.slots_for(rng.randint(-1, 3), rng.randint(-3, 40), rng.randint(-3, 40)),
            lambda: bm.fork(rng.randint(-1, 3), rng.randint(-1, 3)),
            lambda: bm.free(rng.randint(-1, 3)),
        ]
        for _ in range(4):
            try:
                rng.choice(calls)()
            except ValueError:
                bad += 1
            bm.check_invariants()  # raises RuntimeError (failing the test) on corruption
    assert bad > CASES_PER_OP // 2


@pytest.mark.parametrize("call", [
    lambda bm: bm.slots_for(1, 2**63 - 1, 1),
    lambda bm: (bm.mark_computed(1, 1), bm.mark_computed(1, 2**63 - 1)),
    lambda bm: (bm.mark_computed(1, 1), bm.commit(1, [], 2**63 - 1)),
    lambda bm: bm.reserve(1, 2**63 - 1),
    lambda bm: bm.can_reserve(1, 2**63 - 2),
    # Marking tokens computed past the reserved capacity would cache blocks never written.
    lambda bm: bm.commit(1, list(range(10)), 13),
])
def test_block_manager_extreme_counts_are_value_errors(call):
    bm = _C.BlockManager(8, 4)
    bm.add_request(1, [1, 2, 3])
    with pytest.raises(ValueError):
        call(bm)
    bm.check_invariants()
    assert bm.num_cached_blocks == 0


def test_tree_batch_indptr_past_the_nodes_is_a_value_error():
    with pytest.raises(ValueError, match="indptr"):
        _C.tree_batch_max_depth(torch.tensor([-1], dtype=torch.int32),
                                torch.tensor([0, 200, 1], dtype=torch.int64))


def test_attention_thread_count_is_bounded():
    with pytest.raises(ValueError, match="num_threads"):
        _C.plan_attention(torch.tensor([0, 1]), torch.tensor([0]),
                          torch.zeros(1, 1, dtype=torch.int32), 4, torch.empty(0, dtype=torch.int32),
                          torch.tensor([0, 0]), 1, num_threads=2**30)


def test_zero_rows_cannot_pass_a_loose_tolerance():
    from pyspec.sampling import accept

    for tol in (1.0, 0.9):
        with pytest.raises(ValueError, match="row_sum_tolerance"):
            accept(torch.zeros(1, 5), torch.tensor([0]), torch.tensor([-1]), torch.tensor([0, 1]),
                   seeds=0, row_sum_tolerance=tol)


def test_dlpack_producers_that_may_own_a_copy_are_refused():
    import numpy as np

    class Wrapper:  # hands out a fresh buffer that only the capsule would keep alive
        def __init__(self, a):
            self.a = a

        def __dlpack__(self, stream=None):
            return np.ascontiguousarray(self.a).__dlpack__()

    with pytest.raises(ValueError, match="torch.Tensor or numpy.ndarray"):
        _C.materialize_kv(Wrapper(np.zeros((4, 2, 8), np.float32)), torch.zeros(2, 16, 2, 8),
                          torch.tensor([1]), torch.tensor([3]))
    # numpy arrays are fine (they export their own storage).
    pages = np.zeros((2, 16, 2, 8), np.float32)
    _C.materialize_kv(np.ones((4, 2, 8), np.float32), pages, np.array([1]), np.array([3]))
    assert pages.reshape(32, 2, 8)[3].sum() == 16
