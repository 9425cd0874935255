"""Lookahead decoding (pyspec.drafters.lookahead): the Jacobi window is the target's predictions
beyond the accepted path, rejected nodes become pool n-grams, the pool is bounded, and the spec
options are checked. Losslessness through the engine is in test_drafters.py (greedy),
tests/python/engine/test_spec_sampling.py (sampled) and test_default_model.py (the real model)."""

import pytest

from pyspec.drafters import Draft, DraftRequest, Verified, make_drafter
from pyspec.drafters.lookahead import MAX_KEYS, LookaheadDrafter


def _req(ctx, budget=6, depth=4, rid=0):
    return DraftRequest(rid, list(ctx), len(ctx) - 1, [0], budget, max_depth=depth)


def _observe(d, req, draft, committed, predicted):
    d.observe([Verified(req.request_id, req.start, committed, committed[1:] + [predicted[0]],
                        [0], tree=draft, predicted=predicted)])


def test_window_is_the_targets_predictions_beyond_the_accepted_path():
    d = LookaheadDrafter(window=3, ngram=2, pool=4, context=0)
    ctx = [1, 2, 3, 4]  # no repeats: the first guess is the context's last tokens
    req = _req(ctx)
    draft = d.propose([req])[0]
    assert draft.tokens == [4, 2, 3, 4] and draft.parents == [-1, 0, 1, 2]
    # The target accepts guess 2, predicts 7 after it (so 3 is rejected), 8 after 3, 9 after 4.
    _observe(d, req, draft, [4, 2], [2, 7, 8, 9])
    # New root 7 at position start + 2; the next guess is the predictions at the rejected
    # branch: 8 (after the guessed 3) and 9.
    nxt = d.propose([_req(ctx + [2, 7])])[0]
    assert nxt.tokens[:3] == [7, 8, 9] and nxt.parents[:3] == [-1, 0, 1]
    # The rejected nodes left their n-grams: after 3 comes 8, after 4 comes 9.
    st = d._states[0]
    assert (2, 8) in st.pool[3] and (3, 9) in st.pool[4]
    assert 2 not in st.pool  # the accepted node's n-gram is committed text, not a guess


def test_pool_ngrams_are_drafted_from_the_root_preferring_the_same_preceding_token():
    d = LookaheadDrafter(window=1, ngram=3, pool=4, context=1)
    # The committed text holds 5 -> (6, 7) after 4 and 5 -> (8, 9) after 1 (newer).
    ctx = [4, 5, 6, 7, 1, 5, 8, 9, 2, 4, 5]
    draft = d.propose([_req(ctx, budget=8, depth=2)])[0]
    paths = set()
    for i in range(1, len(draft.tokens)):
        path, j = [], i
        while j > 0:
            path.append(draft.tokens[j])
            j = draft.parents[j]
        paths.add(tuple(path[::-1]))
    assert (6, 7) in paths and (8, 9) in paths
    first = d._candidates(d._states[0], 5, 4)
    assert first[0] == (6, 7)  # seen after 4, like the context's 4, 5: tried first
    assert d._candidates(d._states[0], 5, 3)[0] == (8, 9)  # otherwise the newest first


def test_tree_respects_budget_and_depth():
    d = LookaheadDrafter(window=8, ngram=4, pool=8, max_nodes=12)
    ctx = [1, 2, 3, 4, 1, 2, 5, 6, 1, 2, 7, 8, 1, 2, 9, 3, 1]
    for budget, depth in ((1, 1), (3, 2), (5, 5), (12, 8)):
        dr = d.propose([_req(ctx, budget=budget, depth=depth)])[0]
        assert 2 <= len(dr.tokens) <= budget + 1
        for i in range(1, len(dr.tokens)):
            lvl, j = 0, i
            while j > 0:
                lvl, j = lvl + 1, dr.parents[j]
            assert lvl <= depth
    assert d.node_budget(8) == 12 and d.node_budget(1) == 2 and d.max_draft_depth == 8


def test_pool_is_bounded_and_released():
    d = LookaheadDrafter(ngram=2, pool=2)
    ctx = list(range(MAX_KEYS + 500)) + [0, 9, 0, 8, 0, 7]
    d.propose([_req(ctx)])
    st = d._states[0]
    assert len(st.pool) <= MAX_KEYS
    assert len(st.pool[0]) == 2  # newest two continuations of 0: 8 and 7
    assert {e[1] for e in st.pool[0]} == {8, 7}
    d.release(0)
    assert 0 not in d._states


def test_observe_of_a_foreign_step_is_ignored():
    d = LookaheadDrafter()
    req = _req([1, 2, 3])
    draft = d.propose([req])[0]
    # A step this drafter did not propose (another root position) or another tree's path.
    d.observe([Verified(0, req.start + 5, [3], [4], [0], tree=draft, predicted=[4] * len(
        draft.tokens))])
    d.observe([Verified(0, req.start, [3, 99], [99, 4], [0], tree=draft,
                        predicted=[4] * len(draft.tokens))])
    d.observe([Verified(0, req.start, [3], [4], [0])])  # no predictions given


@pytest.mark.parametrize("spec, match", [
    ("lookahead@window=0", "window must be an int in \\[1, 16\\]"),
    ("lookahead@ngram=1", "ngram must be an int in \\[2, 8\\]"),
    ("lookahead@pool=65", "pool must be an int in \\[1, 64\\]"),
    ("lookahead@context=2", "context must be an int in \\[0, 1\\]"),
    ("lookahead@nodes=0", "nodes must be an int in \\[1, 255\\]"),
    ("lookahead@width=3", "unknown lookahead option 'width'; allowed: window=, ngram=, pool="),
    ("lookahead@window=x", "window=N needs an integer N"),
])
def test_bad_options_are_named(spec, match):
    with pytest.raises(ValueError, match=match):
        make_drafter(spec, None)


def test_spec_options_reach_the_drafter():
    d = make_drafter("lookahead@window=6,ngram=4,pool=8,nodes=16,context=0", None)
    assert (d.window, d.ngram, d.pool_size, d.max_nodes, d.use_context) == (6, 4, 8, 16, False)
    assert "lookahead" in d.describe()
