import random

import numpy as np
import pytest

from pyspec import TokenTree


def _mask_matrix(tree):
    words = tree.ancestor_masks()
    n = tree.num_nodes
    bits = np.unpackbits(words.view(np.uint8), axis=1, bitorder="little")[:, :n]
    return bits.astype(bool)


def test_chain_and_kary():
    c = TokenTree.chain(4)
    assert c.parents == [-1, 0, 1, 2, 3]
    assert c.is_chain and c.max_depth == 4
    np.testing.assert_array_equal(_mask_matrix(c), np.tril(np.ones((5, 5), bool)))
    k = TokenTree.kary(3, 2)
    assert k.num_nodes == 13 and not k.is_chain
    assert k.children(0) == [1, 2, 3]


def test_random_trees_masks_paths():
    rng = random.Random(3)
    for _ in range(100):
        n = rng.randint(1, 64)
        parents = [-1] + [rng.randrange(i) for i in range(1, n)]
        tokens = [rng.randrange(111) for _ in range(n)]
        t = TokenTree(parents, tokens)
        assert t.tokens == tokens
        m = _mask_matrix(t)
        for i in range(n):
            path = t.path_to(i)
            assert path[0] == 0 and path[-1] == i
            assert set(np.flatnonzero(m[i])) == set(path)
        rebuilt = TokenTree.from_paths(t.to_paths())
        assert sorted(map(tuple, rebuilt.to_paths())) == sorted(map(tuple, t.to_paths()))


def test_from_paths_and_tokens():
    t = TokenTree.from_paths([[0], [1], [0, 0], [0, 1], [1, 0]])
    assert t.parents == [-1, 0, 0, 1, 1, 2]
    assert t.tokens == [-1] * 6
    t.tokens = [5, 6, 7, 8, 9, 10]
    assert t.tokens[3] == 8
    assert "TokenTree(num_nodes=6" in repr(t)


@pytest.mark.parametrize(
    "parents, match",
    [
        ([], "root"),
        ([0], "parents\\[0\\]"),
        ([-1, 1], "parents\\[1\\]"),
        ([-1, 0, 5], "parents\\[2\\]"),
        ([-1] * 2, "parents\\[1\\]"),
        ([-1] + [0] * 256, "at most 256"),
    ],
)
def test_bad_parents_are_value_errors(parents, match):
    with pytest.raises(ValueError, match=match):
        TokenTree(parents)


def test_bad_templates():
    with pytest.raises(ValueError, match="prefix"):
        TokenTree.from_paths([[1, 0]])
    with pytest.raises(ValueError, match="gamma"):
        TokenTree.chain(-2)
    with pytest.raises(ValueError, match="tokens"):
        TokenTree([-1, 0], [1, 2, 3])
    with pytest.raises(ValueError):
        TokenTree.chain(2).tokens = [1]
    with pytest.raises(TypeError):
        TokenTree(["a"])
