"""KVCacheManager: which blocks each request holds, prefix-cache lookups, slot allocation.

Pure Python (no torch). The scheduler asks two questions per request:
``get_computed_blocks`` (how much of it is already cached?) and ``allocate_slots`` (can the next
tokens get KV slots? ``None`` means no: preempt someone or wait).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from sparrow.core.block_pool import BlockPool
from sparrow.core.kv_cache_utils import KVCacheBlock, PrefixCacheStats, update_request_block_hashes
from sparrow.core.request import Request


def _cdiv(numerator: int, denominator: int) -> int:
    return -(-numerator // denominator)


@dataclass(slots=True)
class KVCacheBlocks:
    """Blocks handed to the scheduler; it sees block ids, not pool internals."""

    blocks: list[KVCacheBlock] = field(default_factory=list)

    def get_block_ids(self) -> list[int]:
        return [block.block_id for block in self.blocks]


class KVCacheManager:
    """Maps ``request_id -> [KVCacheBlock]`` on top of a BlockPool.

    A request's blocks cover its tokens in order: block ``i`` holds the KV of tokens
    ``[i * block_size, (i + 1) * block_size)``. Blocks shared through the prefix cache appear
    in several requests' lists with ``ref_cnt`` equal to the number of holders.
    """

    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        enable_caching: bool = True,
    ) -> None:
        if not isinstance(block_size, int) or block_size < 1:
            raise ValueError(f"block_size must be an integer >= 1, got {block_size!r}")
        self.block_size = block_size
        self.enable_caching = enable_caching
        self.block_pool = BlockPool(num_blocks, enable_caching)
        # request_id -> blocks, in token order
        self.req_to_blocks: dict[str, list[KVCacheBlock]] = {}
        # request_id -> how many of its leading blocks are already indexed in the prefix cache
        self.num_cached_blocks: dict[str, int] = {}
        # Cumulative since the manager was built; never reset by reading (see make_prefix_cache_stats).
        self.prefix_cache_stats = PrefixCacheStats()

    # -- prefix cache -------------------------------------------------------------------------
    def get_computed_blocks(self, request: Request, record_stats: bool = True) -> tuple[KVCacheBlocks, int]:
        """Longest cached prefix of ``request``: its blocks and num_computed_tokens.

        Called by the scheduler when it considers admitting a waiting request (new or resumed
        after preemption). The block holding the last token (index ``num_tokens - 1``) is never
        a hit: that token must go through the model to produce logits. Every call counts in
        the prefix-cache stats unless ``record_stats`` is False (the scheduler records only the
        admissions that succeed, so a request retried while memory is short counts once).
        """
        if not self.enable_caching or request.sampling_params.prompt_logprobs is not None:
            # Prompt logprobs need the logits at every prompt position: nothing may be skipped.
            return KVCacheBlocks(), 0
        block_hashes = update_request_block_hashes(request, self.block_size)
        max_num_hit_blocks = (request.num_tokens - 1) // self.block_size
        hit_blocks: list[KVCacheBlock] = []
        for block_hash in block_hashes[:max_num_hit_blocks]:
            block = self.block_pool.get_cached_block(block_hash)
            if block is None:
                break
            hit_blocks.append(block)
        num_computed_tokens = len(hit_blocks) * self.block_size
        if record_stats:
            self.prefix_cache_stats.record(request.num_tokens, num_computed_tokens)
        return KVCacheBlocks(hit_blocks), num_computed_tokens

    def cache_blocks(self, request: Request, num_computed_tokens: int) -> None:
        """Index the request's blocks that are full within its first ``num_computed_tokens``.

        Called by ``allocate_slots`` for the tokens the step will write, so that a block is
        shared through the prefix cache as soon as its content is complete.
        """
        if not self.enable_caching:
            return
        if num_computed_tokens < 0:
            raise ValueError(f"num_computed_tokens must be >= 0, got {num_computed_tokens}")
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
            request, blocks, num_cached_blocks, num_full_blocks, self.block_size
        )
        self.num_cached_blocks[request_id] = num_full_blocks

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
        (plus any tokens a KV connector will load). Check-then-act: on None nothing has changed.
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

        num_computed_tokens = request.num_computed_tokens + num_new_computed_tokens
        num_tokens_needed = num_computed_tokens + num_new_tokens
        req_blocks = self.req_to_blocks.get(request.request_id, [])
        num_required_blocks = _cdiv(num_tokens_needed, self.block_size)
        num_new_blocks = max(0, num_required_blocks - len(req_blocks) - len(computed_blocks))
        # A hit on a free block takes it out of the free pool as well.
        num_revived_blocks = sum(1 for block in computed_blocks if block.ref_cnt == 0)
        if num_new_blocks > self.block_pool.get_num_free_blocks() - num_revived_blocks:
            return None

        # Touch before allocating, so the new blocks cannot evict the hits we are about to use.
        self.block_pool.touch(computed_blocks)
        new_blocks = self.block_pool.get_new_blocks(num_new_blocks)
        req_blocks = self.req_to_blocks.setdefault(request.request_id, req_blocks)
        req_blocks.extend(computed_blocks)
        req_blocks.extend(new_blocks)

        if self.enable_caching:
            # Cache only what this step's forward pass will actually write: never past the
            # tokens the request has, even when a caller asks for more slots than that.
            num_tokens_to_cache = min(num_computed_tokens + num_new_tokens, request.num_tokens)
            self.cache_blocks(request, num_tokens_to_cache)
        return KVCacheBlocks(new_blocks)

    def can_fit(self, num_tokens: int) -> bool:
        """Whether a request of ``num_tokens`` tokens could ever fit, with the cache to itself.

        Called when a request is added, so an impossible one is rejected instead of waiting
        forever.
        """
        return _cdiv(num_tokens, self.block_size) <= self.block_pool.num_blocks

    def free(self, request: Request) -> None:
        """Release a finished or preempted request's blocks and forget it.

        Blocks are freed tail first, so among them the end of the sequence is evicted before its
        beginning: the beginning is the part other requests are likeliest to share.
        """
        blocks = self.req_to_blocks.pop(request.request_id, [])
        self.num_cached_blocks.pop(request.request_id, None)
        self.block_pool.free_blocks(reversed(blocks))

    # -- queries ------------------------------------------------------------------------------
    def get_blocks(self, request_id: str) -> KVCacheBlocks:
        return KVCacheBlocks(list(self.req_to_blocks.get(request_id, [])))

    def get_block_ids(self, request_id: str) -> list[int]:
        return [block.block_id for block in self.req_to_blocks.get(request_id, [])]

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
