"""One KV cache group's bookkeeping: which blocks each request holds for one kind of layer.

``FullAttentionManager`` keeps every block of a request. ``SlidingWindowManager`` frees the
blocks that slid out of the window as the request advances, leaving the pool's null block in
their place so that block index == position // block_size still holds. Both draw from the one
BlockPool of the KVCacheManager; in a hybrid cache each group holds its own blocks for the same
tokens. Pure Python. (The split is vLLM V1's single-type managers.)
"""

from __future__ import annotations

from collections.abc import Sequence

from sparrow.core.block_pool import BlockPool
from sparrow.core.kv_cache_utils import BlockHash, KVCacheBlock, group_block_hash, update_request_block_hashes
from sparrow.core.request import Request


def cdiv(numerator: int, denominator: int) -> int:
    return -(-numerator // denominator)


class FullAttentionManager:
    """Block ``i`` of a request holds the KV of its tokens ``[i * block_size, (i + 1) * block_size)``."""

    sliding_window: int | None = None

    def __init__(self, block_pool: BlockPool, block_size: int, kv_cache_group_id: int = 0) -> None:
        self.block_pool = block_pool
        self.block_size = block_size
        self.kv_cache_group_id = kv_cache_group_id
        # request_id -> blocks, in token order
        self.req_to_blocks: dict[str, list[KVCacheBlock]] = {}
        # request_id -> how many of its leading blocks are already indexed in the prefix cache
        self.num_cached_blocks: dict[str, int] = {}

    # -- allocation: check, then act ----------------------------------------------------------
    def num_blocks_to_allocate(self, request_id: str, num_tokens: int,
                               new_computed_blocks: Sequence[KVCacheBlock]) -> int:
        """Free-queue blocks the request needs to cover ``num_tokens`` tokens after taking
        ``new_computed_blocks``: the new ones, plus the hits that sit in the free queue (taking
        them takes them out of it)."""
        num_held = len(self.req_to_blocks.get(request_id, ())) + len(new_computed_blocks)
        num_new_blocks = max(0, cdiv(num_tokens, self.block_size) - num_held)
        if not new_computed_blocks:
            return num_new_blocks
        null_block = self.block_pool.null_block
        return num_new_blocks + sum(
            1 for block in new_computed_blocks if block.ref_cnt == 0 and block is not null_block)

    def save_new_computed_blocks(self, request_id: str, new_computed_blocks: Sequence[KVCacheBlock]) -> None:
        """Take a reference on the prefix-cache hits and append them to the request's blocks.

        Every group takes its hits before any group allocates new blocks: a new block comes off
        the free queue, where another group's hit may sit.
        """
        self.block_pool.touch(new_computed_blocks)
        self.req_to_blocks.setdefault(request_id, []).extend(new_computed_blocks)

    def allocate_new_blocks(self, request_id: str, num_tokens: int) -> list[KVCacheBlock]:
        """Append enough new blocks to cover ``num_tokens``; returns them. The caller has checked
        with ``num_blocks_to_allocate`` that they fit."""
        req_blocks = self.req_to_blocks.setdefault(request_id, [])
        new_blocks = self.block_pool.get_new_blocks(max(0, cdiv(num_tokens, self.block_size) - len(req_blocks)))
        req_blocks.extend(new_blocks)
        return new_blocks

    def remove_skipped_blocks(self, request_id: str, num_computed_tokens: int) -> None:
        """Free the blocks no token from ``num_computed_tokens`` on will read: none here."""

    def max_blocks_per_request(self, num_tokens: int, max_tokens_per_step: int | None) -> int:
        """The most blocks a request of ``num_tokens`` tokens holds at once in this group."""
        return cdiv(num_tokens, self.block_size)

    # -- prefix cache ---------------------------------------------------------------------------
    def cache_blocks(self, request: Request, num_computed_tokens: int) -> None:
        """Index the request's blocks that are full within its first ``num_computed_tokens``."""
        request_id = request.request_id
        blocks = self.req_to_blocks.get(request_id, [])
        num_full_blocks = num_computed_tokens // self.block_size
        num_cached_blocks = self.num_cached_blocks.get(request_id, 0)
        if num_full_blocks <= num_cached_blocks:
            return
        if num_full_blocks > len(blocks):
            raise ValueError(
                f"num_computed_tokens={num_computed_tokens} needs {num_full_blocks} blocks but "
                f"request {request_id!r} holds {len(blocks)}"
            )
        update_request_block_hashes(request, self.block_size)
        self.block_pool.cache_full_blocks(
            request, blocks, num_cached_blocks, num_full_blocks, self.block_size, self.kv_cache_group_id)
        self.num_cached_blocks[request_id] = num_full_blocks

    def find_longest_cache_hit(self, block_hashes: Sequence[BlockHash], max_num_blocks: int) -> list[KVCacheBlock]:
        """The cached blocks of the longest prefix of at most ``max_num_blocks`` blocks."""
        hit_blocks: list[KVCacheBlock] = []
        group_id = self.kv_cache_group_id
        for block_hash in block_hashes[:max_num_blocks]:
            block = self.block_pool.get_cached_block(group_block_hash(block_hash, group_id))
            if block is None:
                break
            hit_blocks.append(block)
        return hit_blocks

    # -- release --------------------------------------------------------------------------------
    def free(self, request_id: str) -> None:
        """Release the request's blocks tail first, so among them the end of the sequence is
        evicted before its beginning: the beginning is what other requests likeliest share."""
        blocks = self.req_to_blocks.pop(request_id, [])
        self.num_cached_blocks.pop(request_id, None)
        self.block_pool.free_blocks(reversed(blocks))


class SlidingWindowManager(FullAttentionManager):
    """Layers whose token at position p reads only the keys at ``p - W + 1 .. p`` (W = window).

    A request holds real blocks only for the last W - 1 tokens before its next token and for the
    tokens of the current step; the leading blocks of its list are the pool's null block (which
    ``BlockPool.free_blocks`` skips when the request is freed).
    """

    sliding_window: int

    def __init__(self, block_pool: BlockPool, block_size: int, sliding_window: int,
                 kv_cache_group_id: int = 0) -> None:
        if not isinstance(sliding_window, int) or sliding_window < 1:
            raise ValueError(f"sliding_window must be an integer >= 1, got {sliding_window!r}")
        if block_pool.null_block is None:
            raise ValueError("a sliding-window KV cache group needs a BlockPool with reserve_null_block=True")
        super().__init__(block_pool, block_size, kv_cache_group_id)
        self.sliding_window = sliding_window
        # Blocks before a prefix-cache hit point that the next token reads (its W - 1 keys before it).
        self.num_window_blocks = max(1, cdiv(sliding_window - 1, block_size))

    def remove_skipped_blocks(self, request_id: str, num_computed_tokens: int) -> None:
        """Free the blocks that lie wholly before position ``num_computed_tokens - W + 1``, the
        first key the request's next token reads.

        The workers keep the freed ids in their block tables (they hear only of new blocks); the
        attention kernels never use what they read there, as it is outside every token's window.
        """
        num_skipped_blocks = (num_computed_tokens - self.sliding_window + 1) // self.block_size
        blocks = self.req_to_blocks.get(request_id)
        if num_skipped_blocks <= 0 or not blocks:
            return
        null_block = self.block_pool.null_block
        if null_block is None:  # the pool reserves one whenever a sliding-window group exists
            raise RuntimeError("a sliding-window KV cache group needs the block pool's null block")
        removed: list[KVCacheBlock] = []
        # Null blocks form a prefix of the list: walk back from the last skipped block to it.
        for index in range(min(num_skipped_blocks, len(blocks)) - 1, -1, -1):
            if blocks[index] is null_block:
                break
            removed.append(blocks[index])
            blocks[index] = null_block
        # Oldest first: the oldest is the first to be evicted from the prefix cache.
        self.block_pool.free_blocks(reversed(removed))

    def max_blocks_per_request(self, num_tokens: int, max_tokens_per_step: int | None) -> int:
        # In one step a request holds the window before its first new token plus the step's
        # tokens: W - 1 + max_tokens_per_step tokens, which straddle at most one more block.
        all_blocks = cdiv(num_tokens, self.block_size)
        if max_tokens_per_step is None:
            return all_blocks
        return min(all_blocks, cdiv(self.sliding_window - 1 + max_tokens_per_step, self.block_size) + 1)

    def find_longest_cache_hit(self, block_hashes: Sequence[BlockHash], max_num_blocks: int) -> list[KVCacheBlock]:
        """The longest hit of at most ``max_num_blocks`` blocks whose last ``num_window_blocks``
        blocks are cached (or all of them, when the hit is that short); earlier ones are null.

        Searched from the end: the hit ends at the last run of enough cached blocks.
        """
        null_block = self.block_pool.null_block
        assert null_block is not None  # checked in __init__
        group_id = self.kv_cache_group_id
        hit_blocks: list[KVCacheBlock] = [null_block] * max_num_blocks
        num_contiguous = 0
        for index in range(max_num_blocks - 1, -1, -1):
            block = self.block_pool.get_cached_block(group_block_hash(block_hashes[index], group_id))
            if block is None:
                num_contiguous = 0
                continue
            hit_blocks[index] = block
            num_contiguous += 1
            if num_contiguous == self.num_window_blocks:
                return hit_blocks[:index + num_contiguous]
        # No run long enough: only a run from the very first block is a hit (nothing before it).
        return hit_blocks[:num_contiguous]


def make_single_type_manager(block_pool: BlockPool, block_size: int, sliding_window: int | None,
                             kv_cache_group_id: int) -> FullAttentionManager:
    if sliding_window is None:
        return FullAttentionManager(block_pool, block_size, kv_cache_group_id)
    return SlidingWindowManager(block_pool, block_size, sliding_window, kv_cache_group_id)
