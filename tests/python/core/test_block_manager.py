import random

import numpy as np
import pytest
import torch

from pyspec import _C
BlockManager = _C.BlockManager
NO_SPACE = _C.BlockManager.NO_SPACE


def test_basic_flow():
    bm = BlockManager(num_blocks=12, block_size=4)
    assert bm.num_total_blocks == 12 and bm.num_free_blocks == 12 and bm.usage_ratio == 0.0
    assert bm.add_request(7, list(range(1, 11))) == 0
    assert 7 in bm and len(bm) == 1
    assert bm.num_tokens(7) == 10 and bm.num_computed(7) == 0 and bm.capacity(7) == 12
    table = bm.block_table(7)
    assert len(table) == 3
    assert bm.slots_for(7, 0, 12) == [table[p // 4] * 4 + p % 4 for p in range(12)]

    # Prefill in two chunks, keeping the last prompt token as the first step's root.
    assert bm.reserve(7, 0)
    bm.mark_computed(7, 5)
    bm.mark_computed(7, 4)
    assert bm.num_cached_blocks == 2

    # One speculative step: tree depth 3, 2 drafts accepted + bonus.
    assert bm.reserve(7, 4)
    out = torch.full((5,), -1, dtype=torch.int64)
    assert bm.slots_for(7, 9, 3, out=out) is out
    assert out[:3].tolist() == bm.slots_for(7, 9, 3) and out[3].item() == -1
    assert bm.commit(7, [11, 12, 13], num_computed=3)
    assert bm.num_tokens(7) == 13 and bm.num_computed(7) == 12
    assert bm.tokens(7)[-3:] == [11, 12, 13]
    assert bm.num_used_blocks + bm.num_free_blocks == bm.num_total_blocks
    bm.check_invariants()

    # A second prompt with the same first 8 tokens shares two blocks.
    assert bm.add_request(8, torch.arange(1, 10, dtype=torch.int32)) == 8
    assert bm.block_table(8)[:2] == table[:2]
    assert bm.ref_count(table[0]) == 2 and bm.is_cached(table[0])
    assert bm.prefix_hits == 8 and bm.prefix_queries == 19
    assert bm.hit_ratio == pytest.approx(8 / 19)

    bm.free(7)
    bm.free(8)
    assert bm.num_used_blocks == 0 and bm.num_evictable_blocks == bm.num_cached_blocks > 0
    assert bm.reset_prefix_cache() > 0 and bm.num_cached_blocks == 0
    bm.check_invariants()
    assert "BlockManager(num_blocks=12" in repr(bm)


def test_exhaustion_returns_status():
    bm = BlockManager(3, 4)
    assert bm.add_request(1, list(range(12))) == 0
    assert bm.add_request(2, [5]) == NO_SPACE == -1
    assert 2 not in bm
    assert not bm.can_reserve(1, 1) and not bm.reserve(1, 1)
    assert bm.blocks_needed_to_reserve(1, 1) == 1
    assert not bm.commit(1, [1, 2])
    assert bm.num_tokens(1) == 12
    bm.check_invariants()


def test_fork_copy_on_write():
    bm = BlockManager(8, 4)
    bm.add_request(1, np.arange(6, dtype=np.int64))
    bm.mark_computed(1, 5)
    bm.fork(1, 2)
    assert bm.block_table(1) == bm.block_table(2)
    with pytest.raises(ValueError, match="shared block"):
        bm.slots_for(2, 5, 1)
    assert bm.reserve(2, 2)
    parent, child = bm.block_table(1), bm.block_table(2)
    assert child[0] == parent[0] and child[1] != parent[1]
    assert bm.peek_pending_copies() == [(parent[1], child[1])]
    assert bm.take_pending_copies() == [(parent[1], child[1])]
    assert bm.num_pending_copies == 0
    bm.check_invariants()


def test_random_ops_keep_invariants():
    rng = random.Random(5)
    bm = BlockManager(24, 2)
    prefixes = [[rng.randrange(3) for _ in range(rng.randrange(8))] for _ in range(4)]
    live, next_id = [], 0
    for _ in range(2000):
        r = rng.random()
        if not live or r < 0.3:
            prompt = rng.choice(prefixes) + [rng.randrange(3) for _ in range(rng.randint(1, 5))]
            got = bm.add_request(next_id, prompt)
            if got == NO_SPACE:
                if live:
                    bm.free(live.pop(rng.randrange(len(live))))
            else:
                assert got % 2 == 0 and got <= (len(prompt) - 1) // 2 * 2
                live.append(next_id)
            next_id += 1
        elif r < 0.6:
            rid = rng.choice(live)
            todo = bm.num_tokens(rid) - bm.num_computed(rid)
            if todo > 1 and bm.reserve(rid, 0):
                bm.take_pending_copies()
                bm.mark_computed(rid, rng.randint(1, todo - 1))
            elif todo == 1 and bm.reserve(rid, 3):
                bm.take_pending_copies()
                a = rng.randint(0, 2)
                assert bm.commit(rid, [rng.randrange(3) for _ in range(a + 1)], a + 1)
        elif r < 0.7:
            bm.fork(rng.choice(live), next_id)
            live.append(next_id)
            next_id += 1
        else:
            bm.free(live.pop(rng.randrange(len(live))))
        bm.check_invariants()
    assert bm.prefix_hits > 0


@pytest.mark.parametrize(
    "args, match",
    [
        ((0, 4), "num_blocks"),
        ((-1, 4), "num_blocks"),
        ((4, 0), "block_size"),
        ((4, 70000), "block_size"),
        ((4.5, 4), "num_blocks"),
        ((4, True), "block_size"),
    ],
)
def test_constructor_errors(args, match):
    with pytest.raises(ValueError, match=match):
        BlockManager(*args)


def test_raw_binding_constructor_errors():
    with pytest.raises(ValueError, match="num_blocks"):
        _C.BlockManager(0, 16)
    with pytest.raises(ValueError, match="block_size"):
        _C.BlockManager(16, 0)


def test_argument_errors_name_the_argument():
    bm = BlockManager(8, 4)
    bm.add_request(1, [1, 2, 3, 4, 5])
    with pytest.raises(ValueError, match="request_id 9"):
        bm.reserve(9, 1)
    with pytest.raises(ValueError, match="request_id 9"):
        bm.free(9)
    with pytest.raises(ValueError, match="request_id 9"):
        bm.block_table(9)
    with pytest.raises(ValueError, match="request_id 1 is already registered"):
        bm.add_request(1, [1])
    with pytest.raises(ValueError, match="child_id 1"):
        bm.fork(1, 1)
    with pytest.raises(ValueError, match="num_extra_tokens"):
        bm.reserve(1, -1)
    with pytest.raises(ValueError, match="n must be >= 0"):
        bm.mark_computed(1, -2)
    with pytest.raises(ValueError, match="n must be >= 0"):
        bm.slots_for(1, 0, -1)
    with pytest.raises(ValueError, match="start"):
        bm.slots_for(1, -1, 1)
    with pytest.raises(ValueError, match="capacity"):
        bm.slots_for(1, 6, 3)
    for n in (1 << 27, 1 << 40):  # checked before the list is allocated (no MemoryError)
        with pytest.raises(ValueError, match="capacity"):
            bm.slots_for(1, 0, n)
    with pytest.raises(ValueError, match="num_computed"):
        bm.commit(1, [1], num_computed=-1)
    with pytest.raises(ValueError, match="more tokens computed"):
        bm.mark_computed(1, 6)
    with pytest.raises(ValueError, match="prompt"):
        bm.add_request(2, [])
    with pytest.raises(ValueError, match="prompt"):
        bm.add_request(2, "abc")
    with pytest.raises(ValueError, match=r"'prompt'\[1\]"):
        bm.add_request(2, [1, 2**40])
    with pytest.raises(ValueError, match=r"'prompt'\[0\]"):
        bm.add_request(2, [1.5])
    with pytest.raises(ValueError, match="prompt"):
        bm.add_request(2, torch.zeros(3, dtype=torch.float32))
    with pytest.raises(ValueError, match="prompt"):
        bm.add_request(2, torch.zeros(2, 2, dtype=torch.int32))
    with pytest.raises(ValueError, match="tokens"):
        bm.commit(1, [None])
    with pytest.raises(ValueError, match="out"):
        bm.slots_for(1, 0, 4, out=torch.zeros(4, dtype=torch.int32))
    with pytest.raises(ValueError, match="out"):
        bm.slots_for(1, 0, 4, out=torch.zeros(3, dtype=torch.int64))
    with pytest.raises(ValueError, match="request_id"):
        bm.add_request("x", [1])
    with pytest.raises(ValueError, match="block"):
        bm.ref_count(8)
    # Nothing changed.
    assert bm.num_tokens(1) == 5 and bm.num_used_blocks == 2 and 2 not in bm
    bm.check_invariants()


def test_tensor_prompts_with_strides():
    bm = BlockManager(8, 2)
    t = torch.arange(12, dtype=torch.int64)[::2]  # non-contiguous view
    assert bm.add_request(1, t) == 0
    assert bm.tokens(1) == [0, 2, 4, 6, 8, 10]
    bm.mark_computed(1, 6)
    assert bm.add_request(2, np.array([0, 2, 4, 6, 8, 10, 1], dtype=np.int32)) == 6
