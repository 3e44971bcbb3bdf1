"""The kernel's own implementations of the core decision hooks: each hands the decision to the
kernel's object (the scheduler, the block pool, the worker).

They are ``trylast``, so a plugin's ``tryfirst`` or plain implementation replaces them and a
``wrapper`` sees their result. While one of them is its hook's only implementation, the engine
skips the hook and calls the object directly (``sparrow.plugins.resolve_hook``); their signatures
are therefore exactly those of the hookspecs, so either can be called with the same keywords.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from sparrow.core.kv_cache_manager import KVCacheBlocks, KVCacheManager
from sparrow.core.request import Request
from sparrow.core.sched.interface import SchedulerInterface
from sparrow.core.sched.output import SchedulerOutput
from sparrow.hookspecs import hookimpl

if TYPE_CHECKING:  # the worker side imports torch; this module must not
    from sparrow.interfaces import Worker
    from sparrow.wire import ModelRunnerOutput


@hookimpl(trylast=True)
def sparrow_schedule(scheduler: SchedulerInterface) -> SchedulerOutput | None:
    return scheduler.schedule()


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


@hookimpl(trylast=True)
def sparrow_execute_model(worker: Worker, scheduler_output: SchedulerOutput) -> ModelRunnerOutput | None:
    return worker.execute_model(scheduler_output)
