"""Tests of pyspec.sampling: the filter op against a sorted torch reference, the greedy walk against
a Python reference, determinism, validation, and statistical losslessness of the stochastic modes.

Statistical design (fixed seeds; Pearson chi-square; cells with expected count < 5 pooled).

* The target is a first-order Markov chain over a small vocabulary V: the target's next-token
  distribution after token x is the row T[x], whatever came before. So every tree node has a
  defined target row, T[token(node)] (the root uses a fixed root token r0), and so does every
  off-tree token: after a recovered token y the next target distribution is T[y].
* The drafter is a Markov chain Q. In the "sampled" mode the children of a node with token x are
  drawn from Q[x] without replacement, in order (Gumbel top-k, i.e. Plackett-Luce sequential
  sampling), and draft_probs[node] = Q[x]. In the "deterministic" mode the children are the top-k
  tokens of Q[x] and no draft_probs are passed (target-only walk).
* One acceptance round per request, R = 2e5 requests per configuration, each with its own seed.
  First emitted token t1: under the target alone t1 ~ T[r0]. Joint of the first two tokens: if the
  round emitted at least two tokens, t2 is its second one; otherwise (t1 was recovered, nothing
  after it in this round) t2 is drawn by the test from T[t1], exactly what plain decoding would do
  next. Under a lossless sampler P(t1, t2) = T[r0, t1] * T[t1, t2].
* Both the t1 histogram (V cells) and the (t1, t2) histogram (V^2 cells) must pass at p > 1e-3.
  The same harness with the op's deliberately wrong mode (debug_skip_residual: the recovered token
  is sampled from the unmodified target row instead of the residual) must fail at p < 1e-6, which
  shows the test has the power to see a broken sampler.
* Depth 3 (the end of this file): the joint of the first three tokens on tiny vocabularies, and
  subtler breaks (residual or draft row not renormalised after a rejected sibling, a uniform
  reused between two decisions) of a numpy twin of the op, which must fail that same test.
"""

import numpy as np
import pytest
import scipy.stats
import torch

from pyspec import _C, sampling
from helpers import devices

ROUNDS = 200_000

# ---- tree shapes (parent lists, parents before children) -----------------------------------------


def chain(gamma):
    return [-1] + list(range(gamma))


def kary(width, depth):
    parents, level = [-1], [0]
    for _ in range(depth):
        nxt = []
        for p in level:
            for _ in range(width):
                nxt.append(len(parents))
                parents.append(p)
        level = nxt
    return parents


# Medusa/EAGLE-style ragged tree: paths {0},{1},{2},{0,0},{0,1},{1,0},{0,0,0},{0,0,1},{0,1,0}.
RAGGED = [-1, 0, 0, 0, 1, 1, 2, 4, 4, 5]


def children_of(parents):
    kids = [[] for _ in parents]
    for c, p in enumerate(parents):
        if p >= 0:
            kids[p].append(c)
    return kids


# ---- Markov target / drafter ----------------------------------------------------------------------


def markov_rows(rng, vocab, zero_frac, min_support):
    """Random stochastic matrix with some exact zeros; returns (float32 rows, float64 rows that
    are the float32 rows renormalised, i.e. exactly what the op uses)."""
    m = rng.dirichlet(np.full(vocab, 0.7), size=vocab)
    mask = rng.random((vocab, vocab)) < zero_frac
    for r in range(vocab):
        mask[r, rng.permutation(vocab)[:min_support]] = False
    m = np.where(mask, 0.0, m)
    m /= m.sum(1, keepdims=True)
    m32 = m.astype(np.float32)
    m64 = m32.astype(np.float64)
    return m32, m64 / m64.sum(1, keepdims=True)


def make_chains(seed, vocab, width):
    rng = np.random.default_rng(seed)
    t32, t64 = markov_rows(rng, vocab, 0.25, 2)
    qr = rng.dirichlet(np.full(vocab, 0.7), size=vocab)
    q = 0.4 * qr + 0.6 * t64  # a drafter that resembles the target, so deep paths get accepted
    mask = rng.random((vocab, vocab)) < 0.15
    for r in range(vocab):
        mask[r, rng.permutation(vocab)[: max(width + 1, 3)]] = False
    q = np.where(mask, 0.0, q)
    q /= q.sum(1, keepdims=True)
    q32 = q.astype(np.float32)
    q64 = q32.astype(np.float64)
    return t32, t64, q32, q64 / q64.sum(1, keepdims=True)


def draw_tokens(parents, rounds, q64, root, mode, rng):
    """Tokens [rounds, n] of each request's tree; the root gets `root`."""
    n = len(parents)
    tok = np.empty((rounds, n), dtype=np.int64)
    tok[:, 0] = root
    for v, kids in enumerate(children_of(parents)):
        if not kids:
            continue
        rows = q64[tok[:, v]]
        if mode == "sampled":
            with np.errstate(divide="ignore"):
                keys = np.log(rows) + rng.gumbel(size=rows.shape)
        else:
            keys = rows
        tok[:, kids] = np.argsort(-keys, axis=1, kind="stable")[:, : len(kids)]
    return tok


def run_rounds(parents, tok, t32, q32, mode, seed_base, wrong=False, device="cpu"):
    """Runs one acceptance round per request (in chunks to bound memory) on `device`; returns
    emitted tokens [R, W] and num_accepted [R] as numpy arrays."""
    rounds, n = tok.shape
    vocab = t32.shape[1]
    chunk = max(1, 3_000_000 // (n * vocab))
    emitted, accepted = [], []
    par = torch.tensor(parents, dtype=torch.int32)
    for s in range(0, rounds, chunk):
        e = min(rounds, s + chunk)
        flat = tok[s:e].reshape(-1)
        target = torch.from_numpy(t32[flat]).to(device)
        draft = torch.from_numpy(q32[flat]).to(device) if mode == "sampled" else None
        tokens = torch.from_numpy(flat.astype(np.int32)).to(device)
        parents_t = par.repeat(e - s)
        indptr = torch.arange(0, (e - s) * n + 1, n, dtype=torch.int64)
        seeds = torch.arange(s, e, dtype=torch.int64) + seed_base
        if not wrong:
            res = sampling.accept(target, tokens, parents_t, indptr, draft_probs=draft,
                                  seeds=seeds.to(device), offsets=3)
            emitted.append(res.emitted_tokens.cpu().numpy())
            accepted.append(res.num_accepted.cpu().numpy())
        else:
            width = _C.tree_batch_max_depth(parents_t, indptr) + 1
            b = e - s
            out_n = torch.empty((b, width), dtype=torch.int32, device=device)
            out_t = torch.empty((b, width), dtype=torch.int32, device=device)
            out_c = torch.empty((b,), dtype=torch.int32, device=device)
            flag = torch.full((b,), mode == "sampled", dtype=torch.bool, device=device)
            _C.accept_trees(target, draft, tokens, parents_t.to(device), indptr.to(device),
                            torch.zeros(b, dtype=torch.bool, device=device), flag,
                            seeds.to(device), torch.full((b,), 3, dtype=torch.int64, device=device),
                            out_n, out_t, out_c, debug_skip_residual=True)
            emitted.append(out_t.cpu().numpy())
            accepted.append(out_c.cpu().numpy())
    return np.concatenate(emitted), np.concatenate(accepted)


def chi2_pvalue(observed, expected):
    """Pearson chi-square p-value; cells with expected < 5 are pooled (the pool is merged into the
    smallest kept cell if it is itself < 5). Any count in a cell of probability 0 gives 0."""
    o = np.asarray(observed, dtype=np.float64).ravel()
    e = np.asarray(expected, dtype=np.float64).ravel()
    if np.any((e == 0) & (o > 0)):
        return 0.0
    small = e < 5
    ko, ke = list(o[~small]), list(e[~small])
    po, pe = o[small].sum(), e[small].sum()
    if pe > 0:
        if pe >= 5 or not ke:
            ko.append(po)
            ke.append(pe)
        else:
            i = int(np.argmin(ke))
            ko[i] += po
            ke[i] += pe
    ko, ke = np.array(ko), np.array(ke)
    if len(ko) < 2:
        return 1.0
    return float(scipy.stats.chisquare(ko, ke * ko.sum() / ke.sum()).pvalue)


def lossless_pvalues(parents, vocab, mode, seed, wrong=False, device="cpu"):
    width = max(len(k) for k in children_of(parents))
    t32, t64, q32, q64 = make_chains(seed, vocab, width)
    rng = np.random.default_rng(seed + 1)
    root = int(rng.integers(vocab))
    tok = draw_tokens(parents, ROUNDS, q64, root, mode, rng)
    emitted, num_acc = run_rounds(parents, tok, t32, q32, mode, seed_base=seed * 1_000_003,
                                  wrong=wrong, device=device)
    t1 = emitted[:, 0].astype(np.int64)
    # t2: from the round when it emitted two tokens, else the plain-decoding next token.
    cdf = np.cumsum(t64, axis=1)
    u = rng.random(ROUNDS)
    fresh = np.minimum((cdf[t1] < u[:, None]).sum(1), vocab - 1)
    t2 = np.where(num_acc >= 1, emitted[:, 1], fresh).astype(np.int64)
    p_first = chi2_pvalue(np.bincount(t1, minlength=vocab), ROUNDS * t64[root])
    joint = np.bincount(t1 * vocab + t2, minlength=vocab * vocab)
    p_joint = chi2_pvalue(joint, ROUNDS * (t64[root][:, None] * t64))
    return p_first, p_joint, float(num_acc.mean())


LOSSLESS_CASES = [
    # (id, parents, vocab, mode)
    ("chain1-v50-sampled", chain(1), 50, "sampled"),
    ("chain2-v24-sampled", chain(2), 24, "sampled"),
    ("chain3-v16-sampled", chain(3), 16, "sampled"),
    ("chain5-v8-sampled", chain(5), 8, "sampled"),
    ("w4d3-v8-sampled", kary(4, 3), 8, "sampled"),
    ("w2d2-v9-sampled", kary(2, 2), 9, "sampled"),
    ("ragged-v12-sampled", RAGGED, 12, "sampled"),
    ("w4d3-v10-deterministic", kary(4, 3), 10, "deterministic"),
    ("chain4-v16-deterministic", chain(4), 16, "deterministic"),
    ("ragged-v12-deterministic", RAGGED, 12, "deterministic"),
]


@pytest.mark.parametrize("device", devices())
@pytest.mark.parametrize("case", LOSSLESS_CASES, ids=[c[0] for c in LOSSLESS_CASES])
def test_stochastic_acceptance_is_lossless(case, device):
    name, parents, vocab, mode = case
    seed = 17 + LOSSLESS_CASES.index(case)
    p_first, p_joint, mean_acc = lossless_pvalues(parents, vocab, mode, seed, device=device)
    assert p_first > 1e-3, (name, p_first)
    assert p_joint > 1e-3, (name, p_joint)
    if len(parents) > 1:
        assert mean_acc > 0.2, (name, mean_acc)  # the trees are actually exercised


WRONG_CASES = LOSSLESS_CASES  # every configuration; subtler breaks: the three-token tests below


@pytest.mark.parametrize("device", devices())
@pytest.mark.parametrize("case", WRONG_CASES, ids=[c[0] for c in WRONG_CASES])
def test_statistical_test_detects_a_wrong_sampler(case, device):
    name, parents, vocab, mode = case
    seed = 17 + LOSSLESS_CASES.index(case)
    p_first, p_joint, _ = lossless_pvalues(parents, vocab, mode, seed, wrong=True, device=device)
    assert p_joint < 1e-6, (name, p_first, p_joint)


# ---- greedy -------------------------------------------------------------------------------------


def random_batch(rng, batch, vocab, max_nodes=12):
    parents, tokens, indptr = [], [], [0]
    for _ in range(batch):
        n = int(rng.integers(1, max_nodes + 1))
        parents += [-1] + [int(rng.integers(i)) for i in range(1, n)]
        tokens += [0] + [int(rng.integers(vocab)) for _ in range(1, n)]
        indptr.append(len(parents))
    probs = rng.dirichlet(np.full(vocab, 0.3), size=len(parents)).astype(np.float32)
    return (torch.from_numpy(probs), torch.tensor(tokens, dtype=torch.int32),
            torch.tensor(parents, dtype=torch.int32), torch.tensor(indptr, dtype=torch.int64))


def greedy_reference(probs, tokens, parents, indptr):
    out = []
    for b in range(len(indptr) - 1):
        base, n = int(indptr[b]), int(indptr[b + 1] - indptr[b])
        node, emitted = 0, []
        while True:
            t = int(torch.argmax(probs[base + node]))  # first maximum
            emitted.append(t)
            nxt = [c for c in range(1, n) if parents[base + c] == node and tokens[base + c] == t]
            if not nxt:
                break
            node = nxt[0]
        out.append(emitted)
    return out


@pytest.mark.parametrize("device", devices())
def test_greedy_matches_reference_walk(device):
    rng = np.random.default_rng(0)
    probs, tokens, parents, indptr = random_batch(rng, 99, 7)
    # Make matches likely: copy each child's token from its parent's argmax half of the time.
    am = probs.argmax(1)
    for b in range(99):
        base = int(indptr[b])
        for i in range(1, int(indptr[b + 1]) - base):
            if rng.random() < 0.5:
                tokens[base + i] = am[base + int(parents[base + i])]
    res = sampling.accept(probs.to(device), tokens.to(device), parents, indptr, greedy=True,
                          seeds=0)
    res = sampling.AcceptResult(*(t.cpu() for t in (res.accepted_nodes, res.emitted_tokens,
                                                    res.num_accepted)))
    assert res.emitted_lists() == greedy_reference(probs, tokens, parents, indptr)
    assert int(res.num_accepted.max()) >= 2
    # Paths: root first, each node's parent is the previous node, tokens match.
    for b in range(99):
        k = int(res.num_accepted[b])
        path = res.accepted_nodes[b, : k + 1].tolist()
        assert path[0] == 0 and (res.accepted_nodes[b, k + 1:] == -1).all()
        for j in range(1, k + 1):
            assert int(parents[int(indptr[b]) + path[j]]) == path[j - 1]
            assert int(tokens[int(indptr[b]) + path[j]]) == int(res.emitted_tokens[b, j - 1])


# ---- determinism --------------------------------------------------------------------------------


@pytest.mark.parametrize("device", devices())
def test_same_seeds_same_output_and_batch_independence(device):
    rng = np.random.default_rng(1)
    probs, tokens, parents, indptr = random_batch(rng, 60, 11)
    probs, tokens = probs.to(device), tokens.to(device)
    seeds = torch.arange(60, dtype=torch.int64, device=device) * 7919
    kw = dict(draft_probs=probs, seeds=seeds, offsets=torch.arange(60, device=device),
              sampled_children=False)
    a = sampling.accept(probs, tokens, parents, indptr, **kw).emitted_lists()
    b = sampling.accept(probs, tokens, parents, indptr, **kw).emitted_lists()
    assert a == b
    # Requests 10..29 alone, in a different batch: same outputs.
    lo, hi = int(indptr[10]), int(indptr[30])
    sub = sampling.accept(probs[lo:hi], tokens[lo:hi], parents[lo:hi], indptr[10:31] - lo,
                          draft_probs=probs[lo:hi], seeds=seeds[10:30],
                          offsets=torch.arange(10, 30, device=device),
                          sampled_children=False).emitted_lists()
    assert sub == a[10:30]
    # A new step offset draws fresh numbers.
    c = sampling.accept(probs, tokens, parents, indptr, draft_probs=probs, seeds=seeds,
                        offsets=torch.arange(60, device=device) + 1,
                        sampled_children=False).emitted_lists()
    assert c != a


# ---- filters ------------------------------------------------------------------------------------


def filter_reference(logits, t, k, p, m):
    logits = logits.double()
    out = torch.zeros_like(logits)
    for r in range(logits.shape[0]):
        z = logits[r]
        if t[r] == 0:
            out[r, int(torch.argmax(z))] = 1.0
            continue
        order = sorted(range(len(z)), key=lambda i: (-float(z[i]), i))
        order = [i for i in order if z[i] != float("-inf")]
        if 0 < k[r] < len(order):
            order = order[: int(k[r])]
        w = torch.exp((z[order] - z[order[0]]) / float(t[r]))
        if p[r] < 1:
            cum, keep = 0.0, 0
            target = float(p[r]) * float(w.sum())
            while keep < len(order) and cum < target:
                cum += float(w[keep])
                keep += 1
            order, w = order[:keep], w[:keep]
        sel = w >= float(m[r])
        out[r, torch.tensor(order)[sel]] = w[sel] / w[sel].sum()
    return out.float()


@pytest.mark.parametrize("device", devices())
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_filters_match_sorted_reference(dtype, device):
    g = torch.Generator().manual_seed(5)
    n, v = 99, 111
    logits = (torch.randn(n, v, generator=g) * 3).to(dtype)
    logits[3, :50] = float("-inf")
    t = torch.rand(n, generator=g) * 1.5 + 0.2
    t[::7] = 0.0
    k = torch.randint(0, 40, (n,), generator=g, dtype=torch.int32)
    p = torch.where(torch.rand(n, generator=g) < 0.3, torch.ones(n), torch.rand(n, generator=g))
    p = p.clamp(min=0.05)
    m = torch.where(torch.rand(n, generator=g) < 0.5, torch.zeros(n), torch.rand(n, generator=g) * 0.3)
    out = sampling.apply_sampling_filters(logits.to(device), t, k, p, m).cpu()
    ref = filter_reference(logits.float(), t, k, p, m)
    assert ((out > 0) == (ref > 0)).all()
    torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-6)
    torch.testing.assert_close(out.sum(1), torch.ones(n), rtol=0, atol=1e-5)


@pytest.mark.parametrize("device", devices())
def test_filters_scalars_and_1d(device):
    logits = torch.tensor([1.0, 3.0, 3.0, 0.5], device=device)
    assert sampling.apply_sampling_filters(logits, 0.0).tolist() == [0.0, 1.0, 0.0, 0.0]
    out = sampling.apply_sampling_filters(logits.expand(3, 4), temperature=1.0, top_k=1)
    assert (out.argmax(1) == 1).all() and (out.count_nonzero(1) == 1).all()
    out = sampling.apply_sampling_filters(logits, top_p=0.9)
    assert out.count_nonzero() == 2
    buf = torch.empty(4, device=device)
    assert sampling.apply_sampling_filters(logits, out=buf) is buf


# ---- validation ---------------------------------------------------------------------------------


def _args(device="cpu"):
    probs = torch.full((3, 4), 0.25, device=device)
    return dict(target_probs=probs, tokens=torch.tensor([0, 1, 2], dtype=torch.int32, device=device),
                parents=torch.tensor([-1, 0, 1], dtype=torch.int32),
                tree_indptr=torch.tensor([0, 3]), seeds=1)


@pytest.mark.parametrize(
    "mutate, match",
    [
        (lambda a: a.update(target_probs=a["target_probs"].double()), "target_probs"),
        (lambda a: a.update(target_probs=torch.tensor([[0.25, float("nan"), 0.5, 0.25]] * 3)),
         "NaN"),
        (lambda a: a.update(target_probs=a["target_probs"] * 0.5), "target_probs.*sums to"),
        (lambda a: a.update(target_probs=torch.tensor([[1.5, -0.5, 0, 0]] * 3)), "negative"),
        (lambda a: a.update(tokens=torch.tensor([0, 1, 4])), "tokens"),
        (lambda a: a.update(tokens=torch.tensor([0.0, 1.0, 2.0])), "tokens"),
        (lambda a: a.update(parents=torch.tensor([-1, 2, 0])), "parent"),
        (lambda a: a.update(tree_indptr=torch.tensor([0, 2])), "indptr"),
        (lambda a: a.update(draft_probs=torch.full((2, 4), 0.25)), "draft_probs"),
        (lambda a: a.update(sampled_children=True), "draft_probs"),
        (lambda a: a.update(seeds=torch.tensor([1, 2])), "seeds"),
        (lambda a: a.update(seeds=1.5), "seeds"),
        (lambda a: a.update(greedy=torch.tensor([True, False])), "greedy"),
        (lambda a: a.update(target_probs=[0.25] * 4), "target_probs"),
    ],
)
@pytest.mark.parametrize("device", devices())
def test_accept_bad_input(mutate, match, device):
    args = _args(device)
    mutate(args)
    for k in ("target_probs", "draft_probs", "tokens"):
        if isinstance(args.get(k), torch.Tensor):
            args[k] = args[k].to(device)
    with pytest.raises(ValueError, match=match):
        sampling.accept(**args)


def test_accept_trees_refuses_outputs_that_share_memory_with_inputs():
    """The raw op writes its outputs while it still reads its inputs: an output aliasing an input
    (or another output) is a ValueError (it crashed the process: a read of half-written parents,
    or a double free)."""
    b, v = 8, 16
    tp = torch.zeros(4 * b, v)
    tp[:, 3] = 1
    tok = torch.tensor([0, 3, 3, 3] * b, dtype=torch.int32)
    ind = torch.arange(0, 4 * b + 1, 4)
    flags = (torch.ones(b, dtype=torch.bool), torch.zeros(b, dtype=torch.bool),
             torch.zeros(b, dtype=torch.long), torch.zeros(b, dtype=torch.long))

    def run(par, nodes, emitted, count):
        _C.accept_trees(tp, None, tok, par, ind, *flags, nodes, emitted, count)

    buf = torch.zeros(4 * b + 4, dtype=torch.int32)
    par = buf[:4 * b]
    par.copy_(torch.tensor([-1, 0, 1, 2] * b, dtype=torch.int32))
    with pytest.raises(ValueError, match="emitted_tokens.*shares memory with 'parents'"):
        run(par, torch.empty(b, 4, dtype=torch.int32), buf[4:].view(b, 4),
            torch.empty(b, dtype=torch.int32))
    out = torch.empty(2 * b, 4, dtype=torch.int32)
    with pytest.raises(ValueError, match="shares memory with 'accepted_nodes'"):
        run(par.clone(), out[:b], out[b // 2:b // 2 + b], torch.empty(b, dtype=torch.int32))
    # Separate outputs (views of one buffer that do not overlap are fine).
    count = torch.empty(b, dtype=torch.int32)
    run(par.clone(), out[:b], out[b:], count)
    assert count.tolist() == [3] * b


@pytest.mark.parametrize("device", devices())
def test_sampled_child_with_zero_draft_probability_is_an_error(device):
    args = _args(device)
    draft = torch.tensor([[0.5, 0.0, 0.5, 0.0]] * 3, device=device)  # token 1 cannot be drawn
    with pytest.raises(ValueError, match="probability 0"):
        sampling.accept(**args, draft_probs=draft)


@pytest.mark.parametrize(
    "kw, match",
    [
        (dict(temperature=-1.0), "temperature"),
        (dict(top_k=-2), "top_k"),
        (dict(top_k=1.5), "top_k"),
        (dict(top_p=0.0), "top_p"),
        (dict(min_p=2.0), "min_p"),
        (dict(temperature=torch.ones(5)), "temperature"),
    ],
)
@pytest.mark.parametrize("device", devices())
def test_filters_bad_input(kw, match, device):
    with pytest.raises(ValueError, match=match):
        sampling.apply_sampling_filters(torch.zeros(2, 8, device=device), **kw)
    with pytest.raises(ValueError, match="logits"):
        sampling.apply_sampling_filters(torch.tensor([[0.0, float("nan")]], device=device))
    with pytest.raises(ValueError, match="no finite"):
        sampling.apply_sampling_filters(torch.full((1, 3), float("-inf"), device=device))


def test_filters_top_k_past_the_vocabulary_keeps_every_token():
    logits = torch.randn(3, 10)
    ref = sampling.apply_sampling_filters(logits, 0.7, 0)
    for k in (10, 11, 1 << 31, 1 << 40, torch.tensor([1 << 40, 12, 0])):
        torch.testing.assert_close(sampling.apply_sampling_filters(logits, 0.7, k), ref)


# ---- CUDA against the CPU oracle ----------------------------------------------------------------


def _isas():
    """The builds of the row passes this CPU runs, each as the LinearKernels that selects it. One
    it lacks is a warning here, and a failure where PYSPEC_EXPECT_ISAS says it must be there (CI's
    machines: generic, avx2, avx512)."""
    import os
    import warnings

    from pyspec import _C

    have = {}
    for isa in ("generic", "avx2", "avx512"):
        try:
            have[isa] = _C.LinearKernels(isa)
        except ValueError as e:
            if isa in os.environ.get("PYSPEC_EXPECT_ISAS", "").split(","):
                pytest.fail(f"PYSPEC_EXPECT_ISAS names {isa}, but this CPU has no {isa} build "
                            f"of the row passes: {e}")
            warnings.warn(f"no {isa} build of the sampling row passes on this CPU: not compared")
    return have


@pytest.mark.parametrize("vocab", [1, 7, 16, 17, 111, 4099, 49152])
def test_filters_same_bits_in_every_build_of_their_row_passes(vocab):
    """The row passes (maximum scan, weights, kept mass, output) are built for the baseline, AVX2
    and AVX-512: the same probabilities bit for bit in each, the first maximum on ties wherever it
    lies (in a vector lane or the tail), and equal to the sorted reference."""
    from pyspec import _C

    g = torch.Generator().manual_seed(vocab)
    n = 24
    logits = torch.randn(n, vocab, generator=g) * 4
    if vocab > 1:
        logits[1] = logits[1].round()  # many ties
        logits[2, :] = float("-inf")
        logits[2, -1] = 0.5  # the only finite entry, in the tail
        logits[3, ::3] = float("-inf")
        logits[4, :] = 0.0
        logits[4, vocab // 2:] = -0.0  # -0 and +0 tie
        logits[5, vocab - 1] = logits[5].max() + 1  # the maximum in the last entry
        mx = logits[6].max() + 1
        logits[6, vocab - 1] = mx  # a tie between the tail and an earlier lane
        logits[6, max(vocab - 17, 0)] = mx
    t = torch.rand(n, generator=g) + 0.3
    t[::5] = 0.0
    t[[1, 2, 4, 6]] = 0.0  # the rows with ties and the tail's maximum: greedy
    k = torch.where(torch.rand(n, generator=g) < 0.7, 0, torch.randint(1, 50, (n,), generator=g))
    k = k.to(torch.int32)
    p = torch.where(torch.rand(n, generator=g) < 0.5, torch.ones(n), torch.rand(n, generator=g))
    p = p.clamp(min=0.05)
    m = torch.where(torch.rand(n, generator=g) < 0.7, torch.zeros(n),
                    torch.rand(n, generator=g) * 0.2)
    isas = _isas()
    assert "generic" in isas
    outs = {}
    for isa, kernels in isas.items():
        assert _C._sampling_isa(kernels) == isa
        outs[isa] = sampling.apply_sampling_filters(logits, t, k, p, m, kernels=kernels)
        bad = logits.clone()
        bad[0, vocab - 1] = float("nan")
        with pytest.raises(ValueError, match=f"row 0 has a NaN or \\+inf entry at token "
                                             f"{vocab - 1}"):
            sampling.apply_sampling_filters(bad, t, k, p, m, kernels=kernels)
        bad[0, vocab - 1] = float("inf")
        with pytest.raises(ValueError, match="NaN or \\+inf"):
            sampling.apply_sampling_filters(bad, t, k, p, m, kernels=kernels)
        with pytest.raises(ValueError, match="no finite entry"):
            sampling.apply_sampling_filters(torch.full((1, vocab), float("-inf")), 1.0,
                                            kernels=kernels)
    assert _C._sampling_isa() == _C._sampling_isa(_C.LinearKernels())
    assert torch.equal(sampling.apply_sampling_filters(logits, t, k, p, m, kernels="generic"),
                       outs["generic"])  # an ISA name selects the same build
    with pytest.raises(ValueError, match="unknown linear kernel ISA 'sse9'"):
        sampling.apply_sampling_filters(logits, t, k, p, m, kernels="sse9")
    with pytest.raises(ValueError, match="kernels must be a pyspec._C.LinearKernels"):
        sampling.apply_sampling_filters(logits, t, k, p, m, kernels=1.5)
    first = outs["generic"]
    for isa, out in outs.items():
        assert torch.equal(out, first), isa
    greedy = (t == 0).nonzero().flatten()
    assert torch.equal(first[greedy].argmax(1), logits[greedy].argmax(1))  # torch: first maximum
    if vocab <= 4099:
        ref = filter_reference(logits, t, k, p, m)
        assert ((first > 0) == (ref > 0)).all()
        torch.testing.assert_close(first, ref, rtol=1e-4, atol=1e-6)


@pytest.mark.cuda
@pytest.mark.parametrize("vocab", [111, 49152, 128256])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cuda_filters_equal_cpu(vocab, dtype):
    """Same support as the CPU op on every row, probabilities equal up to float rounding; at real
    vocabulary sizes and with ties (bf16 logits tie often)."""
    g = torch.Generator().manual_seed(vocab)
    n = 37
    logits = (torch.randn(n, vocab, generator=g) * 4).to(dtype)
    logits[5, ::3] = float("-inf")
    t = torch.rand(n, generator=g) + 0.3
    t[::9] = 0.0
    k = torch.randint(0, 60, (n,), generator=g, dtype=torch.int32)
    k[1] = vocab - 1
    p = torch.where(torch.rand(n, generator=g) < 0.3, torch.ones(n), torch.rand(n, generator=g))
    p = p.clamp(min=0.01)
    m = torch.where(torch.rand(n, generator=g) < 0.7, torch.zeros(n), torch.rand(n, generator=g) * 0.2)
    cpu = sampling.apply_sampling_filters(logits, t, k, p, m)
    gpu = sampling.apply_sampling_filters(logits.cuda(), t.cuda(), k.cuda(), p.cuda(), m.cuda())
    gpu = gpu.cpu()
    assert ((gpu > 0) == (cpu > 0)).all()
    torch.testing.assert_close(gpu, cpu, rtol=1e-5, atol=1e-7)


@pytest.mark.cuda
def test_cuda_acceptance_equals_cpu_for_the_same_seeds():
    """Greedy identical; stochastic (sampled and deterministic children) identical for the same
    seeds: decisions differ only if a draw lands within ~1e-16 of a boundary."""
    rng = np.random.default_rng(3)
    for vocab in (11, 4099):
        # At most vocab nodes per tree, so sampled siblings can carry distinct tokens.
        probs, tokens, parents, indptr = random_batch(rng, 300, vocab, max_nodes=min(24, vocab))
        draft = torch.from_numpy(rng.dirichlet(np.full(vocab, 0.5), size=probs.shape[0])
                                 .astype(np.float32))
        b = indptr.numel() - 1
        greedy = torch.tensor([i % 3 == 0 for i in range(b)])
        sampled = torch.tensor([i % 3 == 1 for i in range(b)])
        # Sampled children must have q > 0 after their siblings: draw them from q.
        for r in range(b):
            base, n = int(indptr[r]), int(indptr[r + 1] - indptr[r])
            for i in range(1, n):
                row = draft[base + int(parents[base + i])].numpy().astype(np.float64)
                tokens[base + i] = int(rng.choice(vocab, p=row / row.sum()))
        # Siblings must be distinct for sampled children: make them so by re-drawing duplicates.
        for r in range(b):
            base, n = int(indptr[r]), int(indptr[r + 1] - indptr[r])
            seen = {}
            for i in range(1, n):
                par = int(parents[base + i])
                used = seen.setdefault(par, set())
                while int(tokens[base + i]) in used:
                    tokens[base + i] = (int(tokens[base + i]) + 1) % vocab
                used.add(int(tokens[base + i]))
                if float(draft[base + par, int(tokens[base + i])]) == 0.0:
                    draft[base + par, int(tokens[base + i])] = 1e-3
        draft = draft / draft.sum(1, keepdim=True)
        kw = dict(draft_probs=draft, greedy=greedy, sampled_children=sampled,
                  seeds=torch.arange(b) * 31 + 7, offsets=torch.arange(b))
        cpu = sampling.accept(probs, tokens, parents, indptr, **kw)
        gpu = sampling.accept(probs.cuda(), tokens.cuda(), parents, indptr,
                              **{k: (v.cuda() if isinstance(v, torch.Tensor) else v)
                                 for k, v in kw.items()})
        assert torch.equal(gpu.num_accepted.cpu(), cpu.num_accepted)
        assert torch.equal(gpu.accepted_nodes.cpu(), cpu.accepted_nodes)
        assert torch.equal(gpu.emitted_tokens.cpu(), cpu.emitted_tokens)
        assert int(cpu.num_accepted.sum()) > b // 10


def test_wrappers_refuse_values_a_cast_would_wrap():
    """The Python wrappers cast index and top-k tensors to the kernels' int32: a value outside it
    is refused, not wrapped into another valid token, parent or k (2^32 + 1 would read as 1)."""
    tp = torch.zeros(2, 8)
    tp[:, 1] = 1
    good = dict(tokens=torch.tensor([0, 1]), parents=torch.tensor([-1, 0]),
                tree_indptr=torch.tensor([0, 2]))
    assert int(sampling.accept(tp, **good, greedy=True, seeds=0).num_accepted[0]) == 1
    for key, bad in (("tokens", torch.tensor([0, 2 ** 32 + 1])),
                     ("parents", torch.tensor([-1, 2 ** 32]))):
        with pytest.raises(ValueError, match=key):
            sampling.accept(tp, **{**good, key: bad}, greedy=True, seeds=0)
    logits = torch.randn(1, 10)
    for kw, key in (({"top_k": torch.tensor([-(2 ** 32) + 3])}, "top_k"),
                    ({"top_k": -2 ** 40}, "top_k"), ({"temperature": 1e300}, "temperature")):
        with pytest.raises(ValueError, match=key):
            sampling.apply_sampling_filters(logits, **kw)


# ---- depth 3: the joint of the first three tokens, and the power of the test ---------------------
#
# The first-two-token joint above never compares a decision at depth >= 2 (the third token of a
# round: the child tests and residuals carried two levels down, after rejections higher up, and
# the Philox draws of position offset + 2) against a distribution. Here the first three tokens
# (t1, t2, t3) are tested on a tiny vocabulary (V^3 cells), with the same rule as above for tokens
# a round did not emit: they are drawn by the test from the target, as plain decoding would.
# Under a lossless sampler P(t1, t2, t3) = T[r0, t1] * T[t1, t2] * T[t2, t3].
#
# Power: `reference_walk` is a numpy twin of the op's walk (accept_walk.cc), checked to give the
# op's results bit for bit when it is fed the op's Philox draws. Its deliberately broken variants
# (a residual not renormalised after a rejected sibling, a draft row not renormalised after a
# sibling is removed, a random draw reused between two decisions) must fail the same three-token
# test that the op and the faithful twin pass.

DEPTH3_ROUNDS = 200_000


def first_three(emitted, num_acc, t64, rng):
    """(t1, t2, t3) per round: the round's tokens, continued by plain sampling from the target
    where the round emitted fewer than three."""
    cdf = np.cumsum(t64, axis=1)
    vocab = t64.shape[0]

    def fresh(prev):
        u = rng.random(len(prev))
        return np.minimum((cdf[prev] < u[:, None]).sum(1), vocab - 1)

    t1 = emitted[:, 0].astype(np.int64)
    t2 = np.where(num_acc >= 1, emitted[:, 1], fresh(t1)).astype(np.int64)
    e2 = emitted[:, 2] if emitted.shape[1] > 2 else np.zeros_like(t1)
    t3 = np.where(num_acc >= 2, e2, fresh(t2)).astype(np.int64)
    return t1, t2, t3


def joint3_pvalue(emitted, num_acc, t64, root, rng):
    vocab = t64.shape[0]
    t1, t2, t3 = first_three(emitted, num_acc, t64, rng)
    counts = np.bincount((t1 * vocab + t2) * vocab + t3, minlength=vocab ** 3)
    expected = (t64[root][:, None, None] * t64[:, :, None] * t64[None, :, :]) * len(t1)
    return chi2_pvalue(counts, expected)


def _sample_rows(w, u):
    """SampleIndex of accept_walk.cc, vectorised: the first token whose running sum of the
    (unnormalised, non-negative) weights exceeds u * total; the last positive one if none does."""
    total = w.sum(1)
    cum = np.cumsum(w, axis=1)
    hit = (cum > (u * total)[:, None]) & (w > 0)
    first = np.argmax(hit, axis=1)
    last_pos = w.shape[1] - 1 - np.argmax((w > 0)[:, ::-1], axis=1)
    return np.where(hit.any(1), first, last_pos)


BUGS = (None, "residual-not-renormalised", "draft-not-renormalised", "draw-reused-by-siblings",
        "draw-reused-across-positions", "child-test-draw-reused-for-recovery")


def reference_walk(parents, tok, t32, q32, mode, draws, bug=None):
    """The op's walk on every round at once: emitted tokens [R, depth + 1] (-1 padded) and the
    accepted counts [R]. ``draws[r, d, 0]`` is the uniform of the token sampled at depth d (stream
    kDrawSample), ``draws[r, d, 1 + j]`` the one of the test of child j there (kDrawChildTest).

    ``bug`` selects a deliberately wrong variant:
      residual-not-renormalised: after a rejected sibling the residual max(p - q, 0) is used as if
          it still summed to 1 by the next sibling's test and the next residual (the recovered
          token is still drawn from its weights);
      draft-not-renormalised: the draft row without the rejected sibling is used as if it still
          summed to 1;
      draw-reused-by-siblings: every child test at a node uses child 0's draw;
      draw-reused-across-positions: the position is not advanced after an accepted child, so every
          depth reuses depth 0's draws;
      child-test-draw-reused-for-recovery: the recovered token after rejections is drawn with the
          last child test's uniform instead of its own.
    """
    assert bug in BUGS
    rounds, n = tok.shape
    kids = children_of(parents)
    depth_of = [0] * n
    for v in range(1, n):
        depth_of[v] = depth_of[parents[v]] + 1
    width = max(depth_of) + 1
    emitted = np.full((rounds, width), -1, dtype=np.int64)
    num_acc = np.zeros(rounds, dtype=np.int64)
    node = np.zeros(rounds, dtype=np.int64)
    active = np.ones(rounds, dtype=bool)
    for d in range(width):
        dd = 0 if bug == "draw-reused-across-positions" else d
        for v in [v for v in range(n) if depth_of[v] == d]:
            idx = np.nonzero(active & (node == v))[0]
            if idx.size == 0:
                continue
            p = t32[tok[idx, v]].astype(np.float64)
            ks = kids[v]
            if mode != "sampled" or not ks:  # target-only walk, or a leaf: sample the target
                t = _sample_rows(p, draws[idx, dd, 0])
                emitted[idx, d] = t
                nxt = np.full(idx.size, -1)
                for c in reversed(ks):  # the first child holding t
                    nxt = np.where(tok[idx, c] == t, c, nxt)
                moved = nxt >= 0
                node[idx[moved]] = nxt[moved]
                num_acc[idx[moved]] += 1
                active[idx[~moved]] = False
                continue
            q = q32[tok[idx, v]].astype(np.float64)
            pm, qm = p.sum(1), q.sum(1)
            undecided = np.ones(idx.size, dtype=bool)
            nxt = np.full(idx.size, -1)
            last_u = np.zeros(idx.size)
            rows = np.arange(idx.size)
            for j, c in enumerate(ks):
                x = tok[idx, c]
                u = draws[idx, dd, 1 + (0 if bug == "draw-reused-by-siblings" else j)]
                last_u = np.where(undecided, u, last_u)
                px = p[rows, x] / pm
                qx = q[rows, x] / qm
                acc = undecided & (u * qx < px)
                nxt[acc] = c
                rej = undecided & ~acc
                undecided = rej
                if not rej.any():
                    break
                r = rows[rej]
                resid = np.maximum(p[r] / pm[r, None] - q[r] / qm[r, None], 0.0)
                rmass = resid.sum(1)
                qn = q[r].copy()
                qmn = qn.sum(1) - qn[np.arange(r.size), x[r]]
                qn[np.arange(r.size), x[r]] = 0.0
                q[r] = qn
                qm[r] = 1.0 if bug == "draft-not-renormalised" else qmn
                keep = rmass > 1e-9  # kEmptyMass: an empty residual keeps the current p
                p[r[keep]] = resid[keep]
                pm[r[keep]] = 1.0 if bug == "residual-not-renormalised" else rmass[keep]
            moved = nxt >= 0
            emitted[idx[moved], d] = tok[idx[moved], nxt[moved]]
            node[idx[moved]] = nxt[moved]
            num_acc[idx[moved]] += 1
            stop = ~moved  # every child rejected: the recovered token, from the residual
            u = draws[idx[stop], dd, 0]
            if bug == "child-test-draw-reused-for-recovery":
                u = last_u[stop]
            emitted[idx[stop], d] = _sample_rows(p[stop], u)
            active[idx[stop]] = False
    return emitted, num_acc


def philox_draws(seeds, offset, width, kids):
    """The op's uniforms for rounds with `seeds`: [R, width, 1 + kids]."""
    out = np.empty((len(seeds), width, 1 + kids))
    for r, s in enumerate(seeds):
        for d in range(width):
            out[r, d, 0] = _C.philox_uniform(int(s), offset + d, 0, 0)
            for j in range(kids):
                out[r, d, 1 + j] = _C.philox_uniform(int(s), offset + d, 1, j)
    return out


DEPTH3_CASES = [
    # (id, parents, vocab, mode): every path reaches depth >= 2, so t3 can come from the round.
    ("chain3-v5-sampled", chain(3), 5, "sampled"),
    ("chain4-v6-sampled", chain(4), 6, "sampled"),
    ("w2d3-v6-sampled", kary(2, 3), 6, "sampled"),
    ("w3d3-v5-sampled", kary(3, 3), 5, "sampled"),
    ("ragged-v6-sampled", RAGGED, 6, "sampled"),
    ("w2d3-v6-deterministic", kary(2, 3), 6, "deterministic"),
]


def depth3_setup(case):
    name, parents, vocab, mode = case
    seed = 101 + DEPTH3_CASES.index(case)
    width = max(len(k) for k in children_of(parents))
    t32, t64, q32, q64 = make_chains(seed, vocab, width)
    rng = np.random.default_rng(seed + 1)
    root = int(rng.integers(vocab))
    tok = draw_tokens(parents, DEPTH3_ROUNDS, q64, root, mode, rng)
    return parents, mode, seed, t32, t64, q32, root, tok, rng


@pytest.mark.parametrize("device", devices())
@pytest.mark.parametrize("case", DEPTH3_CASES, ids=[c[0] for c in DEPTH3_CASES])
def test_acceptance_is_lossless_on_the_first_three_tokens(case, device):
    parents, mode, seed, t32, t64, q32, root, tok, rng = depth3_setup(case)
    emitted, num_acc = run_rounds(parents, tok, t32, q32, mode, seed_base=seed * 1_000_003,
                                  device=device)
    p = joint3_pvalue(emitted, num_acc, t64, root, rng)
    assert p > 1e-3, (case[0], p)
    # Depth >= 2 is really decided inside the rounds, often enough to matter.
    assert (num_acc >= 2).mean() > 0.15, (case[0], (num_acc >= 2).mean())


@pytest.mark.parametrize("case", DEPTH3_CASES, ids=[c[0] for c in DEPTH3_CASES])
def test_reference_walk_is_the_op(case):
    """The numpy twin, fed the op's Philox draws, gives the op's tokens and counts bit for bit:
    its broken variants below are breaks of the real algorithm."""
    parents, mode, seed, t32, _, q32, _, tok, _ = depth3_setup(case)
    rounds = 3000
    seeds = np.arange(rounds) + 77
    op_e, op_n = run_rounds(parents, tok[:rounds], t32, q32, mode, seed_base=77)
    width = op_e.shape[1]
    draws = philox_draws(seeds, 3, width, max(len(k) for k in children_of(parents)))
    ref_e, ref_n = reference_walk(parents, tok[:rounds], t32, q32, mode, draws)
    assert np.array_equal(ref_n, op_n)
    assert np.array_equal(ref_e, op_e)
    assert len(set(op_n.tolist())) >= 3  # rejections at several depths happened


# Which break each configuration can see (a chain has no siblings; a deterministic tree has no
# child tests or residuals).
POWER_CASES = [
    ("chain3-v5-sampled", "draw-reused-across-positions"),
    ("chain4-v6-sampled", "draw-reused-across-positions"),
    ("chain4-v6-sampled", "child-test-draw-reused-for-recovery"),
    ("w3d3-v5-sampled", "residual-not-renormalised"),
    ("w3d3-v5-sampled", "draft-not-renormalised"),
    ("w3d3-v5-sampled", "draw-reused-by-siblings"),
    ("w2d3-v6-sampled", "draw-reused-by-siblings"),
    ("w2d3-v6-sampled", "draw-reused-across-positions"),
    ("ragged-v6-sampled", "draft-not-renormalised"),
    ("ragged-v6-sampled", "draw-reused-by-siblings"),
    ("ragged-v6-sampled", "child-test-draw-reused-for-recovery"),
    ("w2d3-v6-deterministic", "draw-reused-across-positions"),
]


@pytest.mark.parametrize("name, bug", POWER_CASES, ids=[f"{n}-{b}" for n, b in POWER_CASES])
def test_three_token_test_rejects_subtly_broken_samplers(name, bug):
    """The faithful twin passes the three-token test; each broken variant fails it (p < 1e-6) on
    the same rounds (same trees, same uniforms)."""
    case = next(c for c in DEPTH3_CASES if c[0] == name)
    parents, mode, seed, t32, t64, q32, root, tok, rng = depth3_setup(case)
    width = max(len(k) for k in children_of(parents))
    levels = _C.tree_batch_max_depth(torch.tensor(parents, dtype=torch.int32),
                                      torch.tensor([0, len(parents)])) + 1
    draws = np.random.default_rng(seed + 2).random((DEPTH3_ROUNDS, levels, 1 + width))
    state = rng.bit_generator.state
    good_e, good_n = reference_walk(parents, tok, t32, q32, mode, draws)
    p_good = joint3_pvalue(good_e, good_n, t64, root, rng)
    rng.bit_generator.state = state
    bad_e, bad_n = reference_walk(parents, tok, t32, q32, mode, draws, bug=bug)
    p_bad = joint3_pvalue(bad_e, bad_n, t64, root, rng)
    assert p_good > 1e-3, (name, p_good)
    assert p_bad < 1e-6, (name, bug, p_bad)


def test_draft_probs_problem_names_what_accept_refuses():
    """draft_probs_problem (the engine's per-request check) says no exactly where accept raises,
    on one sampled tree: root with two children (the walk reaches both: the target never takes
    the first), rows over 7 tokens."""
    tokens, parents = [0, 2, 5], [-1, 0, 0]
    target = torch.full((3, 7), 1.0 / 7)
    target[0, 2], target[0, 6] = 0.0, 2.0 / 7  # the first child is always rejected
    good = torch.full((3, 7), 1.0 / 7)
    cases = {"good": good, "sum": good * 2, "negative": good.clone(), "nan": good.clone(),
             "zero child": good.clone(), "repeat": good, "leaf rows are not read": good.clone()}
    cases["negative"][0, 3] = -0.1
    cases["negative"][0, 4] += 0.1
    cases["nan"][0, 1] = float("nan")
    cases["zero child"][0, 5], cases["zero child"][0, 0] = 0.0, 2.0 / 7
    cases["leaf rows are not read"][1:] = 5.0
    for name, probs in cases.items():
        toks = [0, 2, 2] if name == "repeat" else tokens
        problem = sampling.draft_probs_problem(toks, parents, probs)
        try:
            sampling.accept(target, torch.tensor(toks), torch.tensor(parents), torch.tensor([0, 3]),
                   draft_probs=probs, seeds=1)
            refused = False
        except ValueError:
            refused = True
        assert (problem is not None) == refused, (name, problem)
        assert refused == (name not in ("good", "leaf rows are not read")), name
    assert "floating-point" in sampling.draft_probs_problem(tokens, parents, good.to(torch.int64))
    assert "floating-point" in sampling.draft_probs_problem(tokens, parents, good[:2])
