"""What one ``schedule()`` decides (:class:`StepPlan`, shared by its phases) and the default
slot allocation behind the ``sparrow_allocate_slots`` hook."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from sparrow.core.kv_cache_manager import KVCacheBlocks, KVCacheManager
from sparrow.core.request import Request

# allocate_slots(kv_cache_manager=, request=, num_new_tokens=, num_new_computed_tokens=,
#                new_computed_blocks=) -> KVCacheBlocks | None   (the sparrow_allocate_slots hook)
AllocateFn = Callable[..., "KVCacheBlocks | None"]


@dataclass(slots=True)
class StepPlan:
    """What one ``schedule()`` has decided so far; each phase reads and extends it."""

    token_budget: int  # tokens still unassigned this step
    # req_id -> num_new_tokens
    num_scheduled_tokens: dict[str, int] = field(default_factory=dict)
    # req_id -> block ids added this step (running requests only)
    new_block_ids: dict[str, list[int]] = field(default_factory=dict)
    # Hybrid KV cache only: req_id -> block ids added to each of KV cache groups 1..
    new_extra_block_ids: dict[str, list[list[int]]] = field(default_factory=dict)
    scheduled_running: list[Request] = field(default_factory=list)
    scheduled_new: list[Request] = field(default_factory=list)
    # Speculative decoding: req_id -> draft tokens scheduled after its last token
    spec_decode_tokens: dict[str, list[int]] = field(default_factory=dict)
    # Memory ran out this step: no waiting request is admitted.
    preempted: bool = False


def allocate_directly(kv_cache_manager: KVCacheManager, request: Request, num_new_tokens: int,
                      num_new_computed_tokens: int = 0,
                      new_computed_blocks: KVCacheBlocks | None = None) -> KVCacheBlocks | None:
    return kv_cache_manager.allocate_slots(request, num_new_tokens, num_new_computed_tokens, new_computed_blocks)
