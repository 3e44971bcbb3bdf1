"""The KV connector contract, in two halves that live in different processes.

Scheduler side (engine core): how many tokens beyond the local prefix-cache hit can be loaded
from outside, bookkeeping once blocks are allocated, and per-step metadata for the workers.
Worker side: load KV into the paged cache before the forward, save KV after it.
"""

from __future__ import annotations

import enum
from abc import ABC, abstractmethod
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from sparrow.config import KVTransferConfig
    from sparrow.core.kv_cache_manager import KVCacheBlocks
    from sparrow.core.request import Request
    from sparrow.core.sched.output import SchedulerOutput


class KVConnectorRole(enum.IntEnum):
    SCHEDULER = 0
    WORKER = 1


class KVConnectorBase(ABC):
    """One class, built twice: ``role`` says which half this instance serves."""

    def __init__(self, role: KVConnectorRole, config: KVTransferConfig, block_size: int) -> None:
        self.role = role
        # Set by the scheduler (scheduler side) / by the worker (worker side).
        self.kv_cache_manager: Any = None
        self.kv_caches: list[Any] = []
        self.rank = 0
        self.config = config
        self.block_size = block_size

    @property
    def is_producer(self) -> bool:
        return self.config.kv_role in ("kv_producer", "kv_both")

    @property
    def is_consumer(self) -> bool:
        return self.config.kv_role in ("kv_consumer", "kv_both")

    # -- scheduler side -----------------------------------------------------------------------
    @abstractmethod
    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> int:
        """Tokens after the first ``num_computed_tokens`` (the local hit) that can be loaded from
        outside. Called when a waiting request is about to be admitted. Never all of the prompt:
        the last prompt token must be computed to sample from it."""

    @abstractmethod
    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int) -> None:
        """Called after the request's blocks were allocated; ``blocks`` are all of its blocks."""

    @abstractmethod
    def build_connector_meta(self, scheduler_output: SchedulerOutput, requests: dict[str, Request]) -> Any:
        """What the workers must load and save this step (a msgspec-serialisable value). Called at
        the end of ``schedule()``, while ``requests[id].num_computed_tokens`` is still the count
        before this step."""

    def request_finished(self, request: Request) -> None:  # noqa: B027 - optional
        """Called when a request finishes or is aborted, before its blocks are freed."""

    # -- worker side --------------------------------------------------------------------------
    def register_kv_caches(self, kv_caches: list[Any]) -> None:
        """The worker's per-layer caches ``[2, num_blocks, block_size, num_kv_heads, head_dim]``."""
        self.kv_caches = kv_caches

    @abstractmethod
    def start_load_kv(self, metadata: Any) -> None:
        """Before the forward: fill the blocks the scheduler reserved for external tokens."""

    @abstractmethod
    def save_kv(self, metadata: Any) -> None:
        """After the forward: store the blocks this step finished."""


def build_connector(config: Any, role: KVConnectorRole, block_size: int) -> KVConnectorBase | None:
    """The configured connector's half for ``role``, or None when no connector is configured."""
    kv_config = config.kv_transfer
    if kv_config.kv_connector is None:
        return None
    from sparrow.plugins import get_registry

    connectors = get_registry().kv_connectors
    connector_cls = connectors.get(kv_config.kv_connector)
    if connector_cls is None:
        raise ValueError(
            f"unknown kv_connector {kv_config.kv_connector!r}; registered: {', '.join(sorted(connectors)) or 'none'}"
        )
    if kv_config.kv_role is None:
        raise ValueError("kv_role must be set (kv_producer, kv_consumer or kv_both) when kv_connector is set")
    return connector_cls(role, kv_config, block_size)
