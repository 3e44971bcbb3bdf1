"""KV-cache eviction policies: which free block that still holds a cached prefix is reused next.

A free block keeps its cached content (its ``block_hash``) until the pool hands it out again, so
the order in which free cached blocks are handed out *is* the eviction policy. The pool
(``FreeKVCacheBlockQueue``) keeps the blocks without cached content apart and always hands them
out first (evicting them loses nothing); only cached blocks reach the policy.

Built-ins, registered by name through ``sparrow_register_kv_eviction_policies``:

- ``lru`` (default): least recently freed first; a finished request frees its blocks tail first,
  so its prompt's head outlives its tail. A linked list through the blocks: every operation O(1).
- ``lfu``: least frequently used, with dynamic aging (LFU-DA): a block's priority is the number
  of requests that used its content plus the priority of the last block evicted, so a prefix
  shared by many requests outlives a stream of one-off prompts, and a once-hot prefix that is no
  longer used ages out. A heap with lazy deletion: O(log n) per operation.

Pure Python, no torch: it runs in the engine core's step.
"""

from __future__ import annotations

import heapq
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from sparrow.core.kv_cache_utils import KVCacheBlock


class EvictionPolicy:
    """The order in which free cached blocks are evicted. Subclass it to write a policy.

    The pool calls, for blocks that hold cached content only:

    - ``push(block)``: the block's last holder released it (``ref_cnt == 0``); it may be evicted.
    - ``remove(block)``: a free block the policy holds got a prefix-cache hit and is held again.
    - ``pop()``: the next block to evict; the pool then clears its hash and hands it out. Only
      called when ``len(policy) > 0``.
    - ``on_hit(block)``: a request reuses the block's cached content (called for held and free
      blocks, after ``remove`` for a free one). Optional: the pool skips the call when a policy
      does not override it, so a policy that ignores hits pays nothing for them.

    Every block is pushed at most once between removals; ``push``, ``remove`` and ``pop`` run on
    the engine core's hot path and should be O(1) or O(log n). ``num_blocks`` is the pool's size
    (block ids are ``0 .. num_blocks - 1``), for policies that keep per-block arrays.
    """

    __slots__ = ()

    def __init__(self, num_blocks: int) -> None:
        pass

    def __len__(self) -> int:
        raise NotImplementedError

    def push(self, block: KVCacheBlock) -> None:
        raise NotImplementedError

    def remove(self, block: KVCacheBlock) -> None:
        raise NotImplementedError

    def pop(self) -> KVCacheBlock:
        raise NotImplementedError

    def on_hit(self, block: KVCacheBlock) -> None:
        """A request reuses ``block``'s content. The default ignores it (and is never called)."""

    def blocks_in_order(self) -> list[KVCacheBlock]:
        """The blocks held, next to be evicted first, without changing anything. For tests and
        debugging (may be O(n log n))."""
        raise NotImplementedError


def overrides_on_hit(policy: EvictionPolicy) -> bool:
    return type(policy).on_hit is not EvictionPolicy.on_hit


class LRUPolicy(EvictionPolicy):
    """Least recently freed first: a doubly linked list threaded through the blocks themselves
    (``prev_free_block`` / ``next_free_block``), so removing a block from the middle (a hit on a
    free block) is O(1), which a deque can't do. ``head -> ... -> tail``: pop the head, push at
    the tail. The pool also uses one, for the blocks without cached content."""

    __slots__ = ("_head", "_tail", "_num_blocks")

    def __init__(self, num_blocks: int = 0) -> None:
        self._head: KVCacheBlock | None = None
        self._tail: KVCacheBlock | None = None
        self._num_blocks = 0

    def __len__(self) -> int:
        return self._num_blocks

    def push(self, block: KVCacheBlock) -> None:
        tail = self._tail
        block.prev_free_block = tail
        block.next_free_block = None
        if tail is None:
            self._head = block
        else:
            tail.next_free_block = block
        self._tail = block
        self._num_blocks += 1

    def pop(self) -> KVCacheBlock:
        block = self._head
        if block is None:
            raise IndexError("pop from an empty LRU list")
        # remove(head), inlined: this is the allocation hot path.
        next_block = block.next_free_block
        self._head = next_block
        if next_block is None:
            self._tail = None
        else:
            next_block.prev_free_block = None
        block.next_free_block = None
        self._num_blocks -= 1
        return block

    def remove(self, block: KVCacheBlock) -> None:
        prev_block, next_block = block.prev_free_block, block.next_free_block
        if prev_block is None:
            self._head = next_block
        else:
            prev_block.next_free_block = next_block
        if next_block is None:
            self._tail = prev_block
        else:
            next_block.prev_free_block = prev_block
        block.prev_free_block = block.next_free_block = None
        self._num_blocks -= 1

    def blocks_in_order(self) -> list[KVCacheBlock]:
        blocks: list[KVCacheBlock] = []
        block = self._head
        while block is not None:
            blocks.append(block)
            block = block.next_free_block
        return blocks


class LFUPolicy(EvictionPolicy):
    """LFU with dynamic aging (LFU-DA, Arlitt et al. 2000).

    A block's use count starts at 1 (the request that computed it) and grows by one per
    prefix-cache hit. When it is freed it enters a min-heap with priority ``age + uses``, where
    ``age`` is the priority of the last block evicted: a block used by many requests stays ahead
    of one-off blocks, and since ``age`` climbs as blocks are evicted, a block that was hot long
    ago is eventually evicted too. Equal priorities go least recently freed first.

    ``remove`` leaves the heap entry in place and forgets it (lazy deletion); ``pop`` skips the
    forgotten entries, and the heap is rebuilt when forgotten entries outnumber live ones, so each
    operation is O(log n) amortized.
    """

    __slots__ = ("_heap", "_live", "_uses", "_age", "_seq")

    # Rebuild the heap when it holds more than STALE_FACTOR entries per live one, plus STALE_SLACK.
    STALE_FACTOR = 2
    STALE_SLACK = 64

    def __init__(self, num_blocks: int = 0) -> None:
        # (priority, push sequence, block); the sequence is unique, so blocks are never compared.
        self._heap: list[tuple[int, int, KVCacheBlock]] = []
        # block_id -> push sequence of its live heap entry (blocks held by the policy only)
        self._live: dict[int, int] = {}
        # block_id -> prefix-cache hits on its current content (absent: none yet)
        self._uses: dict[int, int] = {}
        self._age = 0
        self._seq = 0

    def __len__(self) -> int:
        return len(self._live)

    def push(self, block: KVCacheBlock) -> None:
        self._seq += 1
        priority = self._age + 1 + self._uses.get(block.block_id, 0)
        self._live[block.block_id] = self._seq
        heapq.heappush(self._heap, (priority, self._seq, block))

    def remove(self, block: KVCacheBlock) -> None:
        del self._live[block.block_id]
        if len(self._heap) > self.STALE_FACTOR * len(self._live) + self.STALE_SLACK:
            live = self._live
            self._heap = [entry for entry in self._heap if live.get(entry[2].block_id) == entry[1]]
            heapq.heapify(self._heap)

    def pop(self) -> KVCacheBlock:
        heap, live = self._heap, self._live
        while heap:
            priority, seq, block = heapq.heappop(heap)
            if live.get(block.block_id) != seq:
                continue  # removed (revived by a hit) after it was pushed
            del live[block.block_id]
            self._age = priority
            # Its content is evicted: the next content of this block starts counting afresh.
            self._uses.pop(block.block_id, None)
            return block
        raise IndexError("pop from an empty LFU heap")

    def on_hit(self, block: KVCacheBlock) -> None:
        self._uses[block.block_id] = self._uses.get(block.block_id, 0) + 1

    def blocks_in_order(self) -> list[KVCacheBlock]:
        live = self._live
        return [block for _, seq, block in sorted(self._heap, key=lambda entry: entry[:2])
                if live.get(block.block_id) == seq]
