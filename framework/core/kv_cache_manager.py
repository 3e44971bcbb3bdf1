"""KVCacheManager: which blocks each request holds, prefix-cache lookups, slot allocation.

Pure Python (no torch). The scheduler asks two questions per request:
``get_computed_blocks`` (how much of it is already cached?) and ``allocate_slots`` (can the next
tokens get KV slots? ``None`` means no: preempt someone or wait).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from sparrow.core.block_pool import BlockPool
from sparrow.core.eviction import EvictionPolicy
from sparrow.core.kv_cache_utils import (
    KVCacheBlock,
    KVCacheGroupSpec,
    PrefixCacheStats,
    update_request_block_hashes,
)
from sparrow.core.request import Request
from sparrow.core.single_type_kv_cache_manager import FullAttentionManager, make_single_type_manager


@dataclass(slots=True)
class KVCacheBlocks:
    """Blocks handed to the scheduler; it sees block ids, not pool internals.

    ``blocks`` are those of KV cache group 0, which is every layer unless the cache is hybrid
    (see ``KVCacheGroupSpec``); a hybrid cache's groups 1.. are in ``extra_groups``, one list each.
    """

    blocks: list[KVCacheBlock] = field(default_factory=list)
    extra_groups: list[list[KVCacheBlock]] | None = None

    def get_block_ids(self) -> list[int]:
        """Block ids of group 0."""
        return [block.block_id for block in self.blocks]

    def get_extra_group_block_ids(self) -> list[list[int]]:
        """Block ids of groups 1.. (empty unless the cache is hybrid)."""
        return [[block.block_id for block in blocks] for blocks in self.extra_groups or ()]


class KVCacheManager:
    """Maps ``request_id -> [KVCacheBlock]`` per KV cache group, on top of one BlockPool.

    A request's blocks cover its tokens in order: block ``i`` holds the KV of tokens
    ``[i * block_size, (i + 1) * block_size)``. Blocks shared through the prefix cache appear
    in several requests' lists with ``ref_cnt`` equal to the number of holders. A group of
    sliding-window layers frees the blocks that slid out of its window (the list keeps the
    pool's null block there); a hybrid cache (several groups) gives every group its own blocks
    for the same tokens, all drawn from the one pool.
    """

    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        enable_caching: bool = True,
        kv_cache_groups: Sequence[KVCacheGroupSpec] | None = None,
        max_num_batched_tokens: int | None = None,
        eviction_policy: type[EvictionPolicy] | None = None,
    ) -> None:
        if not isinstance(block_size, int) or block_size < 1:
            raise ValueError(f"block_size must be an integer >= 1, got {block_size!r}")
        if max_num_batched_tokens is not None and max_num_batched_tokens < 1:
            raise ValueError(f"max_num_batched_tokens must be >= 1, got {max_num_batched_tokens}")
        self.block_size = block_size
        self.enable_caching = enable_caching
        # None (one group of full-attention layers) is the plain cache.
        self.kv_cache_groups = list(kv_cache_groups or [KVCacheGroupSpec(None, ())])
        windows = [group.sliding_window for group in self.kv_cache_groups]
        self.block_pool = BlockPool(num_blocks, enable_caching,
                                    reserve_null_block=any(window is not None for window in windows),
                                    eviction_policy=eviction_policy)
        self.managers: list[FullAttentionManager] = [
            make_single_type_manager(self.block_pool, block_size, window, group_id)
            for group_id, window in enumerate(windows)
        ]
        self._sliding_managers = [manager for manager in self.managers if manager.sliding_window is not None]
        # The most tokens a request gets in one step (bounds what a sliding-window group holds).
        self.max_num_batched_tokens = max_num_batched_tokens
        # Group 0's maps: request_id -> blocks in token order; request_id -> leading blocks
        # already indexed in the prefix cache.
        self.req_to_blocks = self.managers[0].req_to_blocks
        self.num_cached_blocks = self.managers[0].num_cached_blocks
        # Cumulative since the manager was built; never reset by reading (see make_prefix_cache_stats).
        self.prefix_cache_stats = PrefixCacheStats()

    @property
    def num_kv_cache_groups(self) -> int:
        return len(self.managers)

    # -- prefix cache -------------------------------------------------------------------------
    def get_computed_blocks(self, request: Request, record_stats: bool = True) -> tuple[KVCacheBlocks, int]:
        """Longest cached prefix of ``request``: its blocks and num_computed_tokens.

        Called by the scheduler when it considers admitting a waiting request (new or resumed
        after preemption). The block holding the last token (index ``num_tokens - 1``) is never
        a hit: that token must go through the model to produce logits. Every call counts in
        the prefix-cache stats unless ``record_stats`` is False (the scheduler records only the
        admissions that succeed, so a request retried while memory is short counts once).
        A sliding-window group's hit needs only the window before the hit point; with several
        groups, the hit is the longest length that is a hit in every group.
        """
        if not self.enable_caching or request.skip_reading_prefix_cache:
            # Prompt logprobs and token-level pooling need the model's output at every prompt
            # position: nothing may be skipped.
            return self._no_blocks(), 0
        block_hashes = update_request_block_hashes(request, self.block_size)
        max_num_hit_blocks = (request.num_tokens - 1) // self.block_size
        hits = [manager.find_longest_cache_hit(block_hashes, max_num_hit_blocks) for manager in self.managers]
        num_hit_blocks = min(len(hit_blocks) for hit_blocks in hits)
        while any(len(hit_blocks) != num_hit_blocks for hit_blocks in hits):
            # Groups must agree. A full-attention hit stays a hit when cut shorter; a sliding
            # one may not (the window before the new end must be cached), so it looks again.
            # The length only shrinks, so this ends.
            for group_id, manager in enumerate(self.managers):
                if len(hits[group_id]) > num_hit_blocks:
                    hits[group_id] = (hits[group_id][:num_hit_blocks] if manager.sliding_window is None
                                      else manager.find_longest_cache_hit(block_hashes, num_hit_blocks))
            num_hit_blocks = min(len(hit_blocks) for hit_blocks in hits)
        num_computed_tokens = num_hit_blocks * self.block_size
        if record_stats:
            self.prefix_cache_stats.record(request.num_tokens, num_computed_tokens)
        return KVCacheBlocks(hits[0], hits[1:] if len(hits) > 1 else None), num_computed_tokens

    def cache_blocks(self, request: Request, num_computed_tokens: int) -> None:
        """Index the request's blocks that are full within its first ``num_computed_tokens``.

        Called by ``allocate_slots`` for the tokens the step will write, so that a block is
        shared through the prefix cache as soon as its content is complete.
        """
        if not self.enable_caching:
            return
        if num_computed_tokens < 0:
            raise ValueError(f"num_computed_tokens must be >= 0, got {num_computed_tokens}")
        for manager in self.managers:
            manager.cache_blocks(request, num_computed_tokens)

    # -- allocation ---------------------------------------------------------------------------
    def allocate_slots(
        self,
        request: Request,
        num_new_tokens: int,
        num_new_computed_tokens: int = 0,
        new_computed_blocks: KVCacheBlocks | None = None,
    ) -> KVCacheBlocks | None:
        """Give ``request`` slots for its next ``num_new_tokens`` tokens; None if they don't fit.

        Called by the scheduler for every request it schedules this step. After the call the
        request's blocks cover::

            | num_computed_tokens | num_new_computed_tokens | num_new_tokens |
            |<--- already held -->|<-- new_computed_blocks->|<-- newly allocated -->|

        ``new_computed_blocks``/``num_new_computed_tokens`` come from ``get_computed_blocks``
        (plus any tokens a KV connector will load). Check-then-act: on None nothing has changed
        but the release of blocks that had slid out of a window (no step reads them again).
        Returns only the newly allocated blocks, not the prefix-cache hits.
        """
        for name, value in (
            ("num_new_tokens", num_new_tokens),
            ("num_new_computed_tokens", num_new_computed_tokens),
        ):
            if value < 0:
                raise ValueError(f"{name} must be >= 0, got {value}")
        computed_blocks = new_computed_blocks.blocks if new_computed_blocks is not None else []
        if computed_blocks and not self.enable_caching:
            raise ValueError("new_computed_blocks must be empty when prefix caching is disabled")
        if num_new_computed_tokens < len(computed_blocks) * self.block_size:
            raise ValueError(
                f"num_new_computed_tokens={num_new_computed_tokens} is less than the "
                f"{len(computed_blocks)} new_computed_blocks cover"
            )
        num_tokens_needed = request.num_computed_tokens + num_new_computed_tokens + num_new_tokens
        if len(self.managers) > 1:
            return self._allocate_in_every_group(request, num_tokens_needed, new_computed_blocks)

        # One group (the common case, kept lean: this runs for every request in every step).
        manager = self.managers[0]
        request_id = request.request_id
        if manager.sliding_window is not None:
            manager.remove_skipped_blocks(request_id, request.num_computed_tokens)
        if manager.num_blocks_to_allocate(request_id, num_tokens_needed, computed_blocks) > \
                self.block_pool.get_num_free_blocks():
            return None
        if computed_blocks:
            # Before allocating, so the new blocks cannot evict the hits we are about to use.
            manager.save_new_computed_blocks(request_id, computed_blocks)
        new_blocks = manager.allocate_new_blocks(request_id, num_tokens_needed)
        if self.enable_caching:
            # Cache only what this step's forward pass will actually write: never past the
            # tokens the request has, even when a caller asks for more slots than that.
            manager.cache_blocks(request, min(num_tokens_needed, request.num_tokens))
        return KVCacheBlocks(new_blocks)

    def _allocate_in_every_group(self, request: Request, num_tokens_needed: int,
                                 new_computed_blocks: KVCacheBlocks | None) -> KVCacheBlocks | None:
        """``allocate_slots`` for a hybrid cache: every group must fit, or none allocates."""
        request_id = request.request_id
        computed_per_group = self._blocks_per_group(new_computed_blocks)
        for manager in self._sliding_managers:
            manager.remove_skipped_blocks(request_id, request.num_computed_tokens)
        num_blocks_needed = 0
        for manager, blocks in zip(self.managers, computed_per_group):
            num_blocks_needed += manager.num_blocks_to_allocate(request_id, num_tokens_needed, blocks)
        if num_blocks_needed > self.block_pool.get_num_free_blocks():
            return None
        # Hits first, in every group: a new block of one group must not evict another's hit.
        for manager, blocks in zip(self.managers, computed_per_group):
            if blocks:
                manager.save_new_computed_blocks(request_id, blocks)
        new_blocks = [manager.allocate_new_blocks(request_id, num_tokens_needed) for manager in self.managers]
        if self.enable_caching:
            for manager in self.managers:
                manager.cache_blocks(request, min(num_tokens_needed, request.num_tokens))
        return KVCacheBlocks(new_blocks[0], new_blocks[1:])

    def _blocks_per_group(self, blocks: KVCacheBlocks | None) -> list[list[KVCacheBlock]]:
        num_groups = len(self.managers)
        if blocks is None:
            return [[]] * num_groups
        if not blocks.extra_groups and not blocks.blocks:
            return [blocks.blocks] + [[]] * (num_groups - 1)
        if len(blocks.extra_groups or ()) != num_groups - 1:
            raise ValueError(f"new_computed_blocks holds {1 + len(blocks.extra_groups or ())} KV cache "
                             f"groups' blocks; the cache has {num_groups} groups")
        return [blocks.blocks, *(blocks.extra_groups or ())]

    def _no_blocks(self) -> KVCacheBlocks:
        num_extra_groups = len(self.managers) - 1
        return KVCacheBlocks([], [[] for _ in range(num_extra_groups)] if num_extra_groups else None)

    def can_fit(self, num_tokens: int) -> bool:
        """Whether a request of ``num_tokens`` tokens could ever fit, with the cache to itself.

        Called when a request is added, so an impossible one is rejected instead of waiting
        forever. A sliding-window group needs only its window plus one step's tokens.
        """
        needed = sum(manager.max_blocks_per_request(num_tokens, self.max_num_batched_tokens)
                     for manager in self.managers)
        return needed <= self.block_pool.num_usable_blocks

    def free(self, request: Request) -> None:
        """Release a finished or preempted request's blocks and forget it."""
        for manager in self.managers:
            manager.free(request.request_id)

    # -- queries ------------------------------------------------------------------------------
    def get_blocks(self, request_id: str) -> KVCacheBlocks:
        blocks = [list(manager.req_to_blocks.get(request_id, [])) for manager in self.managers]
        return KVCacheBlocks(blocks[0], blocks[1:] if len(blocks) > 1 else None)

    def get_block_ids(self, request_id: str) -> list[int]:
        """Group 0's block ids (every layer's unless hybrid); a slid-out block is the null block."""
        return [block.block_id for block in self.req_to_blocks.get(request_id, [])]

    def get_extra_group_block_ids(self, request_id: str) -> list[list[int]]:
        """Block ids of groups 1.. (empty unless the cache is hybrid)."""
        return [[block.block_id for block in manager.req_to_blocks.get(request_id, [])]
                for manager in self.managers[1:]]

    def get_num_blocks_held(self, request_id: str) -> int:
        """Pool blocks the request holds over all groups (the null block is none)."""
        null_block = self.block_pool.null_block
        return sum(1 for manager in self.managers for block in manager.req_to_blocks.get(request_id, ())
                   if block is not null_block)

    @property
    def num_blocks(self) -> int:
        return self.block_pool.num_blocks

    @property
    def num_free_blocks(self) -> int:
        return self.block_pool.get_num_free_blocks()

    @property
    def usage(self) -> float:
        """Fraction of blocks held by requests: 1 - free / total."""
        return self.block_pool.get_usage()

    def reset_prefix_cache(self) -> bool:
        """Forget every cached prefix; only possible while no request holds blocks."""
        return self.block_pool.reset_prefix_cache()

    def make_prefix_cache_stats(self) -> PrefixCacheStats:
        """A copy of the prefix-cache counters, cumulative since the manager was built. Reading
        them resets nothing: a hit rate over an interval is the difference of two snapshots."""
        return PrefixCacheStats(
            requests=self.prefix_cache_stats.requests,
            queries=self.prefix_cache_stats.queries,
            hits=self.prefix_cache_stats.hits,
        )
