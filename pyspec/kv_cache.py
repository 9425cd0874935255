"""Paged KV cache bookkeeping: the block manager (DESIGN section 2, "Paged KV with lazy
materialization").

The KV pool itself is a set of tensors ``[num_blocks, block_size, kv_heads, head_dim]`` per layer (K
and V) owned by the model runner. :class:`BlockManager` decides which block holds which request's
tokens: per-request block tables, reference counts, a prefix cache of full blocks keyed by a chained
hash of their tokens (LRU eviction of unreferenced cached blocks) and copy-on-write for forked
requests. The algorithms live in C++ (``pyspec._C.BlockManager``); this class adds argument checks
and documentation.

Protocol of one request (``T`` = ``num_tokens``, ``C`` = ``num_computed``)::

    cached = bm.add_request(rid, prompt)          # -1: no room now (the scheduler preempts)
    # prefill in chunks of c tokens
    bm.reserve(rid, 0); slots = bm.slots_for(rid, C, c)
    <forward writes K/V into slots>; bm.mark_computed(rid, c)
    # speculative step with a tree of depth d (root = last token, at position T - 1)
    bm.reserve(rid, d + 1)                        # False: preempt someone and retry
    for src, dst in bm.take_pending_copies(): <copy block src -> dst in every layer>
    <draft + verify: the tree's K/V live in scratch>
    slots = bm.slots_for(rid, T - 1, a + 1)       # root + a accepted drafts
    ops.materialize_kv(scratch, pages, rows, slots)
    bm.commit(rid, accepted_tokens + [bonus], num_computed=a + 1)
    bm.free(rid)                                  # finished or preempted

Draft tokens never get blocks; rejected tree nodes cost nothing to drop.
"""

from __future__ import annotations

from typing import List, Tuple

from pyspec import _C

__all__ = ["BlockManager", "NO_SPACE"]

#: ``BlockManager.add_request`` result when the pool cannot hold the prompt.
NO_SPACE: int = int(_C.BlockManager.NO_SPACE)


def _check_int(value, name: str) -> int:
    if isinstance(value, bool) or not hasattr(value, "__index__"):
        raise ValueError(f"{name} must be an int; got {type(value).__name__}")
    return value.__index__()


class BlockManager:
    """Hands out KV blocks to requests and keeps their block tables and a prefix cache.

    Args:
        num_blocks: blocks in the pool (>= 1), the first dimension of the runner's KV tensors.
        block_size: token slots per block (1..65536).
        enable_prefix_cache: reuse cached full blocks across requests with a common prefix.

    A block is always exactly one of: *used* (in a block table, or the source of a pending copy),
    *free*, or *evictable* (cached but unreferenced). ``num_free_blocks`` counts free + evictable:
    what an allocation can take. Prefix-cache counters are in tokens.

    Pool exhaustion is not an error: ``add_request`` returns :data:`NO_SPACE` (-1) and ``reserve`` /
    ``commit`` return ``False``, each leaving the manager unchanged. Bad arguments (unknown or
    duplicate request ids, negative counts, positions past the reserved capacity) raise
    ``ValueError`` naming the argument.

    Not thread-safe: one scheduler owns an instance.
    """

    NO_SPACE = NO_SPACE

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_cache: bool = True):
        num_blocks = _check_int(num_blocks, "num_blocks")
        block_size = _check_int(block_size, "block_size")
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1; got {num_blocks}")
        if not 1 <= block_size <= 65536:
            raise ValueError(f"block_size must be in [1, 65536]; got {block_size}")
        self._m = _C.BlockManager(num_blocks, block_size, bool(enable_prefix_cache))

    # ---- request lifecycle -----------------------------------------------------------------------

    def add_request(self, request_id: int, prompt) -> int:
        """Register ``request_id`` with its prompt and allocate blocks for all prompt tokens.

        ``prompt``: a list of ints or a 1-D int32/int64 CPU tensor with at least one token. The
        longest run of full prompt blocks found in the prefix cache is shared instead of allocated.

        Returns the number of prompt tokens whose KV is already cached (``num_computed``; a multiple
        of ``block_size``, at most ``(len(prompt) - 1) // block_size * block_size`` so that at least
        one token is computed and yields logits), or :data:`NO_SPACE` (-1) when the pool cannot hold
        the prompt even after evicting unreferenced cached blocks; then nothing was changed.
        """
        return self._m.add_request(_check_int(request_id, "request_id"), prompt)

    def reserve(self, request_id: int, num_extra_tokens: int) -> bool:
        """Ensure private blocks cover positions ``[num_computed, num_tokens + num_extra_tokens)``.

        Call it before writing KV: before a prefill chunk (``num_extra_tokens=0``) and before a
        speculative step (``depth + 1``: the accepted path plus the bonus token). Shared blocks in
        that range (after :meth:`fork`) are replaced by fresh ones; see :meth:`take_pending_copies`.
        Returns ``False``, changing nothing, if the pool cannot supply the blocks.
        """
        return self._m.reserve(request_id, num_extra_tokens)

    def can_reserve(self, request_id: int, num_extra_tokens: int) -> bool:
        """Whether ``reserve(request_id, num_extra_tokens)`` would succeed now. Changes nothing."""
        return self._m.can_reserve(request_id, num_extra_tokens)

    def blocks_needed_to_reserve(self, request_id: int, num_extra_tokens: int) -> int:
        """Blocks ``reserve(request_id, num_extra_tokens)`` would take (new + copy-on-write)."""
        return self._m.blocks_needed_to_reserve(request_id, num_extra_tokens)

    def commit(self, request_id: int, tokens, num_computed: int = 0) -> bool:
        """Append accepted tokens, then advance ``num_computed`` by ``num_computed``.

        ``tokens``: the accepted draft tokens plus the bonus/recovered token (list of ints or 1-D
        int tensor). ``num_computed``: positions whose KV was just materialized (root + accepted
        drafts). Newly full, computed blocks enter the prefix cache. Returns ``False``, changing
        nothing, if the pool cannot hold the tokens.
        """
        return self._m.commit(request_id, tokens, num_computed)

    def mark_computed(self, request_id: int, n: int) -> None:
        """Record that the KV of the next ``n`` tokens is now in the pages (after a prefill chunk).

        Raises ``ValueError`` if that would exceed ``num_tokens`` or if a written block is shared
        with another request (``reserve`` was not called before writing).
        """
        self._m.mark_computed(request_id, n)

    def slots_for(self, request_id: int, start: int, n: int, out=None):
        """Slot ids ``block_table[p // bs] * bs + p % bs`` for positions ``[start, start + n)``.

        The positions must lie within the reserved capacity (``capacity(request_id)``), else
        ``ValueError``. Returns a list of ints, or fills and returns ``out`` (a contiguous 1-D int64
        CPU tensor with at least ``n`` elements) without allocating.
        """
        return self._m.slots_for(request_id, start, n, out)

    def fork(self, parent_id: int, child_id: int) -> None:
        """Register ``child_id`` as a copy of ``parent_id`` sharing all its blocks (parallel
        sampling, shared prefixes). Blocks are copied lazily when either request next writes
        (copy-on-write)."""
        self._m.fork(parent_id, child_id)

    def free(self, request_id: int) -> None:
        """Release the request's blocks. Cached blocks stay in the prefix cache as evictable; the
        request's tail blocks are evicted before its prefix."""
        self._m.free(request_id)

    def take_pending_copies(self) -> List[Tuple[int, int]]:
        """Return and clear the pending copy-on-write copies ``[(src_block, dst_block), ...]``.

        The runner must copy every layer's K and V block ``src -> dst``, in list order, before the
        forward that writes into ``dst``.
        """
        return self._m.take_pending_copies()

    def peek_pending_copies(self) -> List[Tuple[int, int]]:
        """The pending copies, without clearing them."""
        return self._m.peek_pending_copies()

    def reset_prefix_cache(self) -> int:
        """Drop every unreferenced cached block (blocks in use stay cached). Returns how many."""
        return self._m.reset_prefix_cache()

    def reset_counters(self) -> None:
        """Zero ``prefix_queries`` and ``prefix_hits``."""
        self._m.reset_counters()

    # ---- queries ---------------------------------------------------------------------------------

    def has_request(self, request_id: int) -> bool:
        return self._m.has_request(request_id)

    def __contains__(self, request_id: int) -> bool:
        return self._m.has_request(request_id)

    def __len__(self) -> int:
        return self._m.num_requests

    def block_table(self, request_id: int) -> List[int]:
        """The request's block ids, one per ``block_size`` positions (a copy)."""
        return self._m.block_table(request_id)

    def tokens(self, request_id: int) -> List[int]:
        """The request's known tokens: prompt + committed (a copy)."""
        return self._m.tokens(request_id)

    def num_tokens(self, request_id: int) -> int:
        """Tokens known for the request (prompt + committed)."""
        return self._m.num_tokens(request_id)

    def num_computed(self, request_id: int) -> int:
        """Tokens whose KV is materialized in the pages."""
        return self._m.num_computed(request_id)

    def capacity(self, request_id: int) -> int:
        """Token positions covered by the request's blocks."""
        return self._m.capacity(request_id)

    def ref_count(self, block: int) -> int:
        """References to ``block``: block tables plus pending copies reading it."""
        return self._m.ref_count(block)

    def is_cached(self, block: int) -> bool:
        """Whether ``block`` is registered in the prefix cache."""
        return self._m.is_cached(block)

    def check_invariants(self) -> None:
        """Verify every internal invariant (no leaked block, refcounts equal table references, hash
        chain and LRU order consistent); raises ``RuntimeError`` naming the first violation."""
        self._m.check_invariants()

    @property
    def block_size(self) -> int:
        return self._m.block_size

    @property
    def prefix_cache_enabled(self) -> bool:
        return self._m.prefix_cache_enabled

    @property
    def num_requests(self) -> int:
        return self._m.num_requests

    @property
    def num_total_blocks(self) -> int:
        return self._m.num_total_blocks

    @property
    def num_free_blocks(self) -> int:
        """Blocks an allocation can take: free plus evictable cached blocks."""
        return self._m.num_free_blocks

    @property
    def num_evictable_blocks(self) -> int:
        return self._m.num_evictable_blocks

    @property
    def num_used_blocks(self) -> int:
        return self._m.num_used_blocks

    @property
    def num_cached_blocks(self) -> int:
        return self._m.num_cached_blocks

    @property
    def num_pending_copies(self) -> int:
        return self._m.num_pending_copies

    @property
    def usage_ratio(self) -> float:
        """``num_used_blocks / num_total_blocks``."""
        return self._m.usage_ratio

    @property
    def prefix_queries(self) -> int:
        """Prompt tokens looked up in the prefix cache by admitted requests."""
        return self._m.prefix_queries

    @property
    def prefix_hits(self) -> int:
        """Prompt tokens found cached (the sum of ``add_request`` results)."""
        return self._m.prefix_hits

    @property
    def hit_ratio(self) -> float:
        """``prefix_hits / prefix_queries`` (0.0 before any query)."""
        return self._m.hit_ratio

    @property
    def handle(self) -> "_C.BlockManager":
        """The underlying C++ object."""
        return self._m

    def __repr__(self) -> str:
        return repr(self._m)
