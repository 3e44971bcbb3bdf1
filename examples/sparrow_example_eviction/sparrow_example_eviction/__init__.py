"""Segmented LRU for Sparrow's KV cache, registered as ``slru``.

Two LRU segments of free cached blocks: *probation* (content never reused since it was computed)
and *protected* (content reused at least once). Victims come from probation while it has any, so a
prefix shared by several requests outlives any number of one-off prompts; among the protected ones,
least recently freed first. ``on_hit`` is the pool's notice that a request reuses a block.
"""

from __future__ import annotations

from sparrow.core.eviction import EvictionPolicy, LRUPolicy
from sparrow.hookspecs import hookimpl

SPARROW_CONTRACT = ">=1.0,<2"


class SegmentedLRUPolicy(EvictionPolicy):
    __slots__ = ("_probation", "_protected", "_reused", "_segment_of")

    def __init__(self, num_blocks: int) -> None:
        # Each block sits in at most one segment; both thread their list through the block.
        self._probation = LRUPolicy()
        self._protected = LRUPolicy()
        self._reused: set[int] = set()  # block ids whose current content had a prefix-cache hit
        self._segment_of: dict[int, LRUPolicy] = {}  # block id -> segment holding it

    def __len__(self) -> int:
        return len(self._segment_of)

    def push(self, block) -> None:
        segment = self._protected if block.block_id in self._reused else self._probation
        segment.push(block)
        self._segment_of[block.block_id] = segment

    def remove(self, block) -> None:
        self._segment_of.pop(block.block_id).remove(block)

    def pop(self):
        segment = self._probation if len(self._probation) else self._protected
        block = segment.pop()
        del self._segment_of[block.block_id]
        self._reused.discard(block.block_id)  # its content is evicted; the next starts unproven
        return block

    def on_hit(self, block) -> None:
        self._reused.add(block.block_id)

    def blocks_in_order(self):
        return self._probation.blocks_in_order() + self._protected.blocks_in_order()


@hookimpl
def sparrow_register_kv_eviction_policies(register) -> None:
    register("slru", SegmentedLRUPolicy)
