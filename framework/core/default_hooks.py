"""The kernel's own implementation of ``sparrow_allocate_slots``: the block pool decides."""

from __future__ import annotations

from sparrow.core.kv_cache_manager import KVCacheBlocks, KVCacheManager
from sparrow.core.request import Request
from sparrow.hookspecs import hookimpl


@hookimpl(trylast=True)
def sparrow_allocate_slots(
    kv_cache_manager: KVCacheManager,
    request: Request,
    num_new_tokens: int,
    num_new_computed_tokens: int,
    new_computed_blocks: KVCacheBlocks | None,
) -> KVCacheBlocks | None:
    return kv_cache_manager.allocate_slots(
        request, num_new_tokens, num_new_computed_tokens, new_computed_blocks
    )
