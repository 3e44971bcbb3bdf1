"""BlockPool: owns every KV-cache block, the free queue and the prefix-cache index.

Pure Python (no torch): the pool only does bookkeeping; the tensors live in the workers.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING, Any

from sparrow.core.eviction import EvictionPolicy, LRUPolicy, overrides_on_hit
from sparrow.core.kv_cache_utils import BlockHash, FreeKVCacheBlockQueue, KVCacheBlock, group_block_hash
from sparrow.wire import AllBlocksCleared, BlockRemoved, BlockStored

if TYPE_CHECKING:
    from sparrow.core.request import Request


class BlockPool:
    """Every block is in exactly one of two places:

    - referenced: ``ref_cnt > 0``, held by one or more requests, not in the free queue;
    - free: ``ref_cnt == 0``, in the free queue, possibly still holding a cached prefix
      (``block_hash`` set) that a later request can revive with ``touch``.

    A free block keeps its hash until it is handed out again by ``get_new_blocks``: that is the
    moment its cached content is evicted. Which free block goes first is the free queue's call:
    blocks without cached content, then cached ones in the order of ``eviction_policy`` (an
    ``EvictionPolicy`` subclass, built once per pool; default ``LRUPolicy``).
    """

    def __init__(self, num_blocks: int, enable_caching: bool = True, reserve_null_block: bool = False,
                 eviction_policy: type[EvictionPolicy] | None = None) -> None:
        min_num_blocks = 2 if reserve_null_block else 1
        if not isinstance(num_blocks, int) or num_blocks < min_num_blocks:
            raise ValueError(f"num_blocks must be an integer >= {min_num_blocks}, got {num_blocks!r}")
        if eviction_policy is None:
            eviction_policy = LRUPolicy
        if not (isinstance(eviction_policy, type) and issubclass(eviction_policy, EvictionPolicy)):
            raise TypeError(f"eviction_policy must be a subclass of sparrow.core.eviction.EvictionPolicy, "
                            f"got {eviction_policy!r}")
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.eviction_policy_cls = eviction_policy
        # block_id -> block; index == block_id
        self.blocks: list[KVCacheBlock] = [KVCacheBlock(block_id) for block_id in range(num_blocks)]
        self.free_block_queue = self._new_free_queue(self.blocks)
        # Sliding windows: a request's blocks that slid out of the window are freed and replaced
        # in its table by this block, so that block index == position // block_size still holds.
        # It is never handed out, written or cached; kernels may read it (and mask what they read).
        self.null_block: KVCacheBlock | None = self.free_block_queue.popleft() if reserve_null_block else None
        self.num_usable_blocks = num_blocks - min_num_blocks + 1
        # block_hash -> {block_id: block}. Several blocks may hold the same content when two
        # requests computed the same prefix before either was cached; any one of them serves a
        # hit, and evicting one must not forget the others.
        self.cached_block_hash_to_block: dict[BlockHash, dict[int, KVCacheBlock]] = {}
        # vLLM's KV cache events (kv_events_config): what changed in the prefix cache since the
        # engine core last took them; None (the default) records nothing.
        self.kv_events: list[Any] | None = None

    def take_events(self) -> list[Any]:
        """The KV cache events since the last call (sparrow.wire.BlockStored, ...), oldest first."""
        if not self.kv_events:
            return []
        events, self.kv_events = self.kv_events, []
        return events

    def _new_free_queue(self, blocks: Iterable[KVCacheBlock]) -> FreeKVCacheBlockQueue:
        policy = self.eviction_policy_cls(self.num_blocks)
        # Bound once: a policy that ignores hits (LRU) costs touch() nothing.
        self._on_hit = policy.on_hit if overrides_on_hit(policy) else None
        return FreeKVCacheBlockQueue(blocks, policy)

    # -- prefix cache -------------------------------------------------------------------------
    def get_cached_block(self, block_hash: BlockHash) -> KVCacheBlock | None:
        same_content = self.cached_block_hash_to_block.get(block_hash)
        if not same_content:
            return None
        return next(iter(same_content.values()))

    def cache_full_blocks(
        self,
        request: Request,
        blocks: Sequence[KVCacheBlock],
        num_cached_blocks: int,
        num_full_blocks: int,
        block_size: int,
        kv_cache_group_id: int = 0,
    ) -> None:
        """Index ``blocks[num_cached_blocks:num_full_blocks]``, which have just become full.

        Their hashes come from ``request.block_hashes`` (which must already cover them), keyed by
        ``kv_cache_group_id`` (see ``group_block_hash``). Blocks that already carry a hash
        (prefix-cache hits shared with another request) and the null block are left as they
        are. ``block_size`` is accepted to mirror the manager's call; hashes are already
        per-block so it is only used for the error message.
        """
        if not self.enable_caching or num_full_blocks <= num_cached_blocks:
            return
        if num_cached_blocks < 0:
            raise ValueError(f"num_cached_blocks must be >= 0, got {num_cached_blocks}")
        if num_full_blocks > len(blocks):
            raise ValueError(
                f"num_full_blocks={num_full_blocks} exceeds the request's {len(blocks)} blocks"
            )
        block_hashes = request.block_hashes
        if num_full_blocks > len(block_hashes):
            raise ValueError(
                f"request {request.request_id!r} has {len(block_hashes)} block hashes but "
                f"num_full_blocks={num_full_blocks} (block_size={block_size}); "
                "call update_request_block_hashes first"
            )
        stored = []
        for block_index in range(num_cached_blocks, num_full_blocks):
            block = blocks[block_index]
            if block.block_hash is not None or block is self.null_block:
                continue
            self.cache_block(block, group_block_hash(block_hashes[block_index], kv_cache_group_id))
            stored.append(block_index)
        if self.kv_events is not None and stored:
            self.kv_events.extend(stored_events(request, stored, block_size, kv_cache_group_id))

    def cache_block(self, block: KVCacheBlock, block_hash: BlockHash) -> None:
        """Index one held, full block under ``block_hash`` (a block already indexed keeps its
        hash). For callers that key blocks themselves (a draft model's cache)."""
        if block.block_hash is not None or block is self.null_block or not self.enable_caching:
            return
        block.block_hash = block_hash
        self.cached_block_hash_to_block.setdefault(block_hash, {})[block.block_id] = block

    def _evict_cached_content(self, block: KVCacheBlock) -> None:
        block_hash = block.block_hash
        if block_hash is None:
            return
        block.block_hash = None
        same_content = self.cached_block_hash_to_block.get(block_hash)
        if same_content is None:
            return
        same_content.pop(block.block_id, None)
        if not same_content:
            del self.cached_block_hash_to_block[block_hash]
            if self.kv_events is not None:  # the last copy of the content is gone
                self.kv_events.append(BlockRemoved(block_hashes=[bytes(block_hash)]))

    def reset_prefix_cache(self) -> bool:
        """Forget every cached hash. Only possible while no block is in use; returns success."""
        if self.get_num_free_blocks() != self.num_usable_blocks:
            return False
        # Every free block loses its content: rebuild the queue (with a fresh policy, whose
        # counts were about contents now gone), all in the uncached tier, keeping their order.
        free_blocks = self.free_block_queue.get_all_free_blocks()
        self.free_block_queue.popleft_n(len(free_blocks))
        self.cached_block_hash_to_block.clear()
        for block in self.blocks:
            block.block_hash = None
        self.free_block_queue = self._new_free_queue(free_blocks)
        if self.kv_events is not None:
            self.kv_events.append(AllBlocksCleared())
        return True

    # -- allocation ---------------------------------------------------------------------------
    def get_new_blocks(self, num_blocks: int) -> list[KVCacheBlock]:
        """Hand out ``num_blocks`` blocks from the head of the free queue (uncached blocks first,
        then the eviction policy's victims; with LRU, least recently freed first).

        Each comes back with ``ref_cnt == 1`` and no hash: whatever prefix it cached is evicted.
        """
        num_free_blocks = self.free_block_queue.num_free_blocks
        if not 0 <= num_blocks <= num_free_blocks:
            raise ValueError(
                f"num_blocks must be in [0, {num_free_blocks}] (free blocks), got {num_blocks}"
            )
        blocks = self.free_block_queue.popleft_n(num_blocks)
        for block in blocks:
            self._evict_cached_content(block)
            block.ref_cnt = 1
        return blocks

    def touch(self, blocks: Iterable[KVCacheBlock]) -> None:
        """Take a reference on blocks found in the prefix cache, reviving free ones."""
        on_hit = self._on_hit
        for block in blocks:
            if block is self.null_block:
                continue
            if block.ref_cnt == 0:
                self.free_block_queue.remove(block)
            block.ref_cnt += 1
            if on_hit is not None:
                on_hit(block)

    def free_blocks(self, ordered_blocks: Iterable[KVCacheBlock]) -> None:
        """Drop one reference per listed block; blocks reaching 0 join the free queue.

        The order is the eviction order among these blocks under LRU (the first listed is
        evicted first) and breaks ties under other policies.
        The null block is skipped. Validated before anything changes, so a bad call leaves the
        pool as it was.
        """
        null_block = self.null_block
        ordered_blocks = [block for block in ordered_blocks if block is not null_block]
        num_releases = Counter(block.block_id for block in ordered_blocks)
        for block_id, count in num_releases.items():
            ref_cnt = self.blocks[block_id].ref_cnt
            if count > ref_cnt:
                raise ValueError(
                    f"cannot free block {block_id} {count} time(s): its ref_cnt is {ref_cnt}; "
                    "ref_cnt would go negative"
                )
        for block in ordered_blocks:
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                self.free_block_queue.append(block)

    # -- accounting ---------------------------------------------------------------------------
    def get_num_free_blocks(self) -> int:
        return self.free_block_queue.num_free_blocks

    def get_usage(self) -> float:
        """Fraction of blocks held by requests (0.0 when idle, 1.0 when full); the null block
        counts for neither."""
        return 1.0 - self.get_num_free_blocks() / self.num_usable_blocks


def stored_events(request: Request, block_indices: list[int], block_size: int, group: int) -> list[BlockStored]:
    """BlockStored events for ``request``'s blocks at ``block_indices`` (ascending), one per run
    of consecutive blocks, with each run's parent hash and tokens."""
    hashes = request.block_hashes
    lora = request.lora_request
    events: list[BlockStored] = []
    start = 0
    for position in range(1, len(block_indices) + 1):
        if position < len(block_indices) and block_indices[position] == block_indices[position - 1] + 1:
            continue
        first, last = block_indices[start], block_indices[position - 1]
        events.append(BlockStored(
            block_hashes=[bytes(group_block_hash(hashes[index], group)) for index in range(first, last + 1)],
            parent_block_hash=bytes(group_block_hash(hashes[first - 1], group)) if first > 0 else None,
            token_ids=list(request.all_token_ids[first * block_size:(last + 1) * block_size]),
            block_size=block_size, lora_id=lora.lora_int_id if lora is not None else None))
        start = position
    return events
