"""Combined drafters (pyspec.drafters.merged): merged drafts are a trie within the node budget
(``A+B``); ``A|B`` takes the first part that drafts and keeps every part up to date."""

import pytest
import torch

from pyspec.drafters import Draft, Drafter, FirstDrafter


def test_merge_drafts_is_a_trie_within_the_budget():
    from pyspec.drafters import merge_drafts

    a = Draft([9, 1, 2, 3], [-1, 0, 1, 2])  # chain 1-2-3
    b = Draft([9, 1, 5, 4, 6], [-1, 0, 0, 1, 1])  # 1 (shared), 5; under 1: 4, 6
    m = merge_drafts([a, b], budget=10)
    paths = set()
    for i in range(1, len(m.tokens)):
        p, path = i, []
        while p > 0:
            path.append(m.tokens[p])
            p = m.parents[p]
        paths.add(tuple(reversed(path)))
    assert paths == {(1,), (1, 2), (1, 2, 3), (5,), (1, 4), (1, 6)}
    assert all(m.parents[i] < i for i in range(1, len(m.tokens)))  # parents first
    cut = merge_drafts([a, b], budget=4)  # the first draft's nodes first, then b's in its order
    assert cut.tokens == [9, 1, 2, 3, 5] and cut.parents == [-1, 0, 1, 2, 0]
    assert merge_drafts([a, b], budget=0).tokens == [9]
    sampled = Draft([9, 7], [-1, 0], torch.full((2, 4), 0.25))
    assert merge_drafts([a, sampled], budget=10) is sampled  # not mergeable: used alone
    with pytest.raises(ValueError, match="root"):
        merge_drafts([a, Draft([8, 1], [-1, 0])], budget=10)


class Scripted(Drafter):
    """Drafts a fixed token chain for the request ids it knows, nothing for the others; records
    what it was asked and told."""

    def __init__(self, name, chains):
        self.name, self.chains = name, chains
        self.asked, self.seen = [], []

    def propose(self, reqs):
        self.asked.append([r.request_id for r in reqs])
        out = []
        for r in reqs:
            c = self.chains.get(r.request_id, [])
            out.append(Draft([r.context[-1]] + c, list(range(-1, len(c)))))
        return out

    def observe(self, results):
        self.seen.extend(v.request_id for v in results)


def test_first_drafter_takes_the_first_part_that_drafts():
    from pyspec.drafters.base import DraftRequest, Verified

    a = Scripted("a", {1: [5, 6], 3: [7]})
    b = Scripted("b", {1: [8], 2: [9, 9], 3: [4]})
    f = FirstDrafter([a, b])
    reqs = [DraftRequest(i, [1, 2, 3], 3, [0], 4, max_depth=4) for i in (1, 2, 3, 4)]
    ds = f.propose(reqs)
    assert [d.tokens for d in ds] == [[3, 5, 6], [3, 9, 9], [3, 7], [3]]
    assert a.asked == [[1, 2, 3, 4]] and b.asked == [[2, 4]]  # b only where a had nothing
    f.observe([Verified(1, 3, [3, 5], [5, 6], [0])])
    assert a.seen == b.seen == [1]  # every part keeps up with every request
    assert f.describe() and f.name == "a|b"
