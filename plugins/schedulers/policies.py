"""Ordering policies: each is a key or two on top of the kernel's scheduling machinery."""

from __future__ import annotations

from typing import Any

from sparrow.core.kv_cache_utils import update_request_block_hashes
from sparrow.core.request import Request
from sparrow.core.sched.scheduler import Scheduler


class FCFSScheduler(Scheduler):
    """First come, first served; the latest arrival is preempted first."""


class PriorityScheduler(Scheduler):
    """Lower ``priority`` value first (vLLM's convention), then arrival; the request with the
    largest (priority, arrival) is preempted first."""

    sort_waiting = True
    uses_priority = True

    def waiting_key(self, request: Request) -> Any:
        return (request.priority, request.arrival_time)

    def victim_key(self, request: Request) -> Any:
        return (request.priority, request.arrival_time)


class ShortestJobFirstScheduler(Scheduler):
    """Shortest job first by prompt length plus ``max_tokens``; the longest job is preempted first."""

    sort_waiting = True

    def waiting_key(self, request: Request) -> Any:
        return (request.num_prompt_tokens + request.max_tokens, request.arrival_time)

    def victim_key(self, request: Request) -> Any:
        return (request.num_prompt_tokens + request.max_tokens, request.arrival_time)


class LongestPrefixMatchScheduler(Scheduler):
    """Cache-aware (SGLang's "lpm"): admit first the waiting request whose prompt has the longest
    prefix already in the prefix cache, so it is served before that prefix is evicted."""

    sort_waiting = True

    def waiting_key(self, request: Request) -> Any:
        return (-self._cached_prefix_blocks(request), request.arrival_time)

    def _cached_prefix_blocks(self, request: Request) -> int:
        manager = self.kv_cache_manager
        if not manager.enable_caching:
            return 0
        update_request_block_hashes(request, manager.block_size)
        pool = manager.block_pool
        hits = 0
        for block_hash in request.block_hashes:
            if pool.get_cached_block(block_hash) is None:
                break
            hits += 1
        return hits
