"""Building the engine core's parts: the scheduler (with its scheduling call resolved once), the KV
eviction policy, and what the workers say about their KV cache groups."""

from __future__ import annotations

from typing import Any, Callable

from sparrow.config import EngineConfig
from sparrow.core.kv_cache_manager import KVCacheBlocks, KVCacheManager
from sparrow.core.kv_cache_utils import KVCacheGroupSpec
from sparrow.core.sched.interface import SchedulerInterface
from sparrow.core.sched.output import SchedulerOutput
from sparrow.executor import Executor
from sparrow.kv_transfer import KVConnectorRole, build_connector
from sparrow.plugins import (
    check_hook_result,
    get_plugin_manager,
    get_registry,
    kernel_default_only,
    resolve_hook,
    resolve_parser,
)


def worker_kv_cache_groups(executor: Executor) -> list[KVCacheGroupSpec] | None:
    """How the workers split the layers into KV cache groups (rank 0's answer: every rank loads
    the same model), or None, one group of full-attention layers, for a worker that does not say
    (one not built on ``WorkerBase``, a test's fake)."""
    try:
        groups = executor.collective_rpc("kv_cache_groups")[0]
    except (AttributeError, NotImplementedError):
        return None
    except RuntimeError as exc:  # how the multiprocess executor reports a worker's AttributeError
        if "has no method 'kv_cache_groups'" not in str(exc):
            raise
        return None
    return [KVCacheGroupSpec(window, tuple(layer_indices)) for window, layer_indices in groups]


def check_connector_supports(config: EngineConfig, kv_cache_groups: list[KVCacheGroupSpec] | None) -> None:
    """A KV connector moves whole prefixes block by block; a sliding-window group no longer holds
    the blocks that slid out of its window, so the two do not mix (yet)."""
    windows = sorted({group.sliding_window for group in kv_cache_groups or () if group.sliding_window})
    if windows and config.kv_transfer.kv_connector is not None:
        raise ValueError(
            f"kv_transfer.kv_connector={config.kv_transfer.kv_connector!r} needs every layer to keep the "
            f"whole context, but this model has sliding-window attention layers (window {windows[0]}) "
            "whose KV cache keeps only the window; serve it without a KV connector")


def schedule_step(pm: Any, scheduler: SchedulerInterface) -> Callable[[], SchedulerOutput | None]:
    """The step's scheduling call, resolved once: ``scheduler.schedule`` itself while the kernel's
    default is the only ``sparrow_schedule`` implementation, else the hook (a plugin replaces or
    wraps the decision)."""
    if kernel_default_only(pm, "sparrow_schedule"):
        return scheduler.schedule
    hook = pm.hook.sparrow_schedule
    return lambda: check_hook_result(pm, "sparrow_schedule", hook(scheduler=scheduler), (SchedulerOutput, type(None)))


def eviction_policy_class(name: str, pm: Any = None) -> type:
    """The KV eviction policy class registered as ``name`` (``sparrow_register_kv_eviction_policies``)."""
    return resolve_parser("kv_eviction_policy", name, get_registry(pm or get_plugin_manager()).kv_eviction_policies)


def build_scheduler(config: EngineConfig, kv_cache_manager: KVCacheManager, pm: Any = None) -> SchedulerInterface:
    pm = pm or get_plugin_manager()
    schedulers = get_registry(pm).schedulers
    name = config.scheduler.scheduler
    scheduler_cls = schedulers.get(name)
    if scheduler_cls is None:
        raise ValueError(f"unknown scheduler {name!r}; registered: {', '.join(sorted(schedulers)) or 'none'}")
    scheduler = scheduler_cls(
        kv_cache_manager=kv_cache_manager,
        max_num_seqs=config.scheduler.max_num_seqs,
        max_num_batched_tokens=config.max_num_batched_tokens,
        max_model_len=config.model.max_model_len,
        enable_chunked_prefill=config.scheduler.enable_chunked_prefill,
        long_prefill_token_threshold=config.scheduler.long_prefill_token_threshold,
        allocate_slots=resolve_hook(pm, "sparrow_allocate_slots", returns=(KVCacheBlocks, type(None))),
        kv_connector=build_connector(config, KVConnectorRole.SCHEDULER, kv_cache_manager.block_size),
    )
    if config.lora.enable_lora:
        # Read by Scheduler._schedule_waiting: at most this many distinct adapters per step.
        scheduler.max_loras = config.lora.max_loras
    return scheduler

