"""EngineCore: one step is schedule -> execute_model -> update_from_output."""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable
from typing import Any

from sparrow.config import EngineConfig
from sparrow.core.kv_cache_manager import KVCacheManager
from sparrow.core.request import Request, RequestStatus
from sparrow.core.sched.interface import SchedulerInterface
from sparrow.engine.messages import EngineCoreOutputs, EngineCoreRequest, SchedulerStats
from sparrow.executor import Executor, make_executor
from sparrow.kv_transfer import KVConnectorRole, build_connector
from sparrow.plugins import get_plugin_manager, get_registry

logger = logging.getLogger(__name__)


class EngineCore:
    """The engine's inner loop. Runs in-process (``InprocClient``) or in its own process."""

    def __init__(self, config: EngineConfig, executor: Executor | None = None) -> None:
        if config.model.max_model_len is None:
            raise ValueError("EngineCore needs a resolved max_model_len (see sparrow.engine.setup)")
        self.config = config
        self.pm = get_plugin_manager()
        self.executor = executor if executor is not None else make_executor(config)
        started = time.perf_counter()
        kv_info = self.executor.initialize()
        logger.info("engine core ready in %.2fs: %d KV blocks of %d tokens",
                    time.perf_counter() - started, kv_info.num_blocks, kv_info.block_size)
        self.num_kv_blocks = kv_info.num_blocks
        self.block_size = kv_info.block_size
        self.kv_cache_manager = KVCacheManager(
            num_blocks=kv_info.num_blocks, block_size=kv_info.block_size,
            enable_caching=config.cache.enable_prefix_caching, max_model_len=config.model.max_model_len,
        )
        self.scheduler = build_scheduler(config, self.kv_cache_manager, self.pm)
        self._schedule = self.pm.hook.sparrow_schedule

    # -- requests ---------------------------------------------------------------------------
    def add_request(self, request: EngineCoreRequest) -> None:
        """Raises ValueError when the request can never run (the caller reports it)."""
        self.scheduler.add_request(Request(
            request_id=request.request_id,
            prompt_token_ids=request.prompt_token_ids,
            sampling_params=request.sampling_params,
            eos_token_id=request.eos_token_id,
            arrival_time=request.arrival_time or None,
            priority=request.priority,
            max_tokens=request.max_tokens,
            kv_transfer_params=request.kv_transfer_params,
            client_index=request.client_index,
        ))

    def abort_requests(self, request_ids: Iterable[str]) -> None:
        self.scheduler.finish_requests(list(request_ids), RequestStatus.FINISHED_ABORTED)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests()

    # -- the step ---------------------------------------------------------------------------
    def step(self) -> EngineCoreOutputs:
        if not self.scheduler.has_unfinished_requests():
            return EngineCoreOutputs(scheduler_stats=self.scheduler.make_stats(), timestamp=time.monotonic())
        scheduler_output = self._schedule(scheduler=self.scheduler)
        if scheduler_output is None:
            raise RuntimeError("no plugin answered sparrow_schedule")
        if scheduler_output.total_num_scheduled_tokens == 0:
            # Nothing fits this step (e.g. waiting on remote KV, or a plugin vetoed every
            # allocation): yield the CPU briefly instead of spinning the busy loop.
            time.sleep(0.001)
            return EngineCoreOutputs(scheduler_stats=self.scheduler.make_stats(), timestamp=time.monotonic())
        model_output = self.executor.execute_model(scheduler_output)
        outputs = self.scheduler.update_from_output(scheduler_output, model_output)
        return EngineCoreOutputs(outputs=outputs, scheduler_stats=self.scheduler.make_stats(),
                                 timestamp=time.monotonic())

    # -- utilities (callable by name from the frontend) -------------------------------------
    def reset_prefix_cache(self) -> bool:
        return self.scheduler.reset_prefix_cache()

    def get_scheduler_stats(self) -> SchedulerStats:
        return self.scheduler.make_stats()

    def get_kv_cache_info(self) -> dict[str, int]:
        return {"num_blocks": self.num_kv_blocks, "block_size": self.block_size,
                "num_free_blocks": self.kv_cache_manager.num_free_blocks}

    def collective_rpc(self, method: str, args: tuple = (), kwargs: dict | None = None) -> list[Any]:
        return self.executor.collective_rpc(method, args, kwargs)

    def shutdown(self) -> None:
        self.executor.shutdown()


def build_scheduler(config: EngineConfig, kv_cache_manager: KVCacheManager, pm: Any = None) -> SchedulerInterface:
    pm = pm or get_plugin_manager()
    schedulers = get_registry(pm).schedulers
    name = config.scheduler.scheduler
    scheduler_cls = schedulers.get(name)
    if scheduler_cls is None:
        raise ValueError(f"unknown scheduler {name!r}; registered: {', '.join(sorted(schedulers)) or 'none'}")
    return scheduler_cls(
        kv_cache_manager=kv_cache_manager,
        max_num_seqs=config.scheduler.max_num_seqs,
        max_num_batched_tokens=config.max_num_batched_tokens,
        max_model_len=config.model.max_model_len,
        enable_chunked_prefill=config.scheduler.enable_chunked_prefill,
        long_prefill_token_threshold=config.scheduler.long_prefill_token_threshold,
        allocate_slots=pm.hook.sparrow_allocate_slots,
        kv_connector=build_connector(config, KVConnectorRole.SCHEDULER, kv_cache_manager.block_size),
    )
