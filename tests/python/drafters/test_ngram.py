"""Prompt lookup (pyspec.drafters.ngram): each match length is its own draft source, and in
``ngram|B`` B's sources follow prompt lookup's."""

from pyspec.drafters import FirstDrafter, NgramDrafter

from drafters_support import SomeSteps


def test_prompt_lookup_sources_are_match_lengths():
    from pyspec.drafters.ngram import prompt_lookup_match
    from pyspec.drafters.base import DraftRequest

    d = NgramDrafter(3)
    assert d.num_draft_sources == 3
    ctx = [5, 6, 7, 8, 1, 6, 7, 8]  # "6 7 8" occurred before, followed by 1
    assert prompt_lookup_match(ctx, 3) == (3, 4)
    assert d.draft_source(ctx) == 0
    ctx = [5, 7, 8, 1, 2, 7, 8]  # "7 8" occurred before ("2 7 8" did not), followed by 1
    assert prompt_lookup_match(ctx, 3) == (2, 3)
    assert d.draft_source(ctx) == 1
    ctx = [1, 2, 3, 9, 4, 3]  # only the single token 3 repeats
    assert prompt_lookup_match(ctx, 3) == (1, 3)
    assert d.draft_source(ctx) == 2
    ctx = [1, 2, 3, 4]
    assert prompt_lookup_match(ctx, 3) == (0, -1)
    assert d.draft_source(ctx) is None
    req = DraftRequest(0, ctx, 3, [0], 3)
    assert d.propose([req])[0].tokens == [4]  # nothing drafted, as it said
    # In `ngram|B`, B's sources follow prompt lookup's three.
    first = FirstDrafter([d, SomeSteps(d)])
    assert first.num_draft_sources == 4
    assert first.draft_source([1, 2, 3, 4, 5]) == 3  # no match: B (5 % 5 < 3)
    assert first.draft_source([1, 2, 3, 9, 4, 3]) == 2
