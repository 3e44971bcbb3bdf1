"""The worker lives in the engine-core process.

With overlapped scheduling (``async_scheduling``) the worker runs on a thread of its own, so that
the engine core schedules step n+1 while step n runs; every call into the worker (steps and
collective calls alike) then goes through that one thread, in order, so the worker never sees two
callers at once. The thread does not wait for a step's sampled tokens either: it hands back a
deferred output and goes on to the next step, which is fed the tokens on the device
(sparrow.worker.deferred_tokens); the engine core's thread waits for them when it collects.
"""

from __future__ import annotations

import concurrent.futures
import functools
import time
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Callable

from sparrow.config import EngineConfig
from sparrow.core.sched.output import SchedulerOutput
from sparrow.executor import rpc
from sparrow.executor.abstract import Executor, KVCacheInfo, StepHandle
from sparrow.executor.worker_extension import worker_class
from sparrow.platforms import resolve_platform
from sparrow.plugins import check_hook_result, get_plugin_manager, kernel_default_only
from sparrow.worker.outputs import ModelRunnerOutput


class UniProcExecutor(Executor):
    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self.platform = resolve_platform(config.device.device)
        worker_cls = worker_class(self.platform.worker_cls, config)
        self.worker = worker_cls(config=config, platform=self.platform, rank=0, local_rank=0,
                                 world_size=1, distributed_init_method=None)
        self._execute = execute_step(get_plugin_manager(), self.worker, defer=bool(config.scheduler.async_scheduling))
        self._thread: ThreadPoolExecutor | None = None
        if config.scheduler.async_scheduling:
            self._thread = ThreadPoolExecutor(1, thread_name_prefix="sparrow-worker",
                                              initializer=_bind_device, initargs=(self.worker,))

    def initialize(self) -> KVCacheInfo:
        self.worker.init_device()
        self.worker.load_model()
        num_blocks = self.worker.determine_num_kv_blocks()
        self.worker.initialize_kv_cache(num_blocks)
        return KVCacheInfo(num_blocks=num_blocks, block_size=self.worker.block_size)

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        if self._thread is not None:
            return self.execute_model_async(scheduler_output).result()
        return self._execute_step(scheduler_output)

    def execute_model_async(self, scheduler_output: SchedulerOutput) -> StepHandle:
        if self._thread is None:
            return super().execute_model_async(scheduler_output)
        return _Collected(self._thread.submit(self._execute_step, scheduler_output))

    def _execute_step(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        output = self._execute(scheduler_output)
        if output is None:
            raise RuntimeError(f"no plugin executed the model for platform {self.platform.name!r}")
        return output

    def collective_rpc(self, method: str | bytes, args: tuple = (), kwargs: dict | None = None,
                       timeout_s: float | None = None) -> list[Any]:
        """``worker.method(*args, **kwargs)``, or a pickled function of the worker (sparrow.executor.rpc).
        On the worker thread (async scheduling) the wait is bounded by ``timeout_s``; inline the call
        runs to its end, and one that took longer than ``timeout_s`` is a TimeoutError all the same."""
        if isinstance(method, bytes):
            call = functools.partial(rpc.run_function, self.worker, method, args, kwargs)
        else:
            value = rpc.resolve(self.worker, method)
            if not callable(value):
                return [value]
            call = functools.partial(value, *args, **(kwargs or {}))
        if self._thread is not None:
            try:
                return [self._thread.submit(call).result(timeout_s)]
            except concurrent.futures.TimeoutError:
                raise TimeoutError(f"collective_rpc({rpc.describe(method)}) took longer than {timeout_s} s") from None
        started = time.monotonic()
        result = call()
        if timeout_s is not None and time.monotonic() - started > timeout_s:
            raise TimeoutError(f"collective_rpc({rpc.describe(method)}) took longer than {timeout_s} s")
        return [result]

    def shutdown(self) -> None:
        if self._thread is not None:
            self._thread.shutdown(wait=True, cancel_futures=True)
        shutdown = getattr(self.worker, "shutdown", None)
        if shutdown is not None:
            shutdown()


class _Collected:
    """A step on the worker thread: ``result()`` waits for the thread, then for the step's sampled
    tokens when the worker deferred them."""

    __slots__ = ("_future",)

    def __init__(self, future: Future) -> None:
        self._future = future

    def result(self) -> ModelRunnerOutput:
        output = self._future.result()
        return output if isinstance(output, ModelRunnerOutput) else output.result()


def _bind_device(worker: Any) -> None:
    """The worker thread uses the worker's device: torch keeps the current CUDA device per thread."""
    device = getattr(worker, "device", None)
    if getattr(device, "type", None) == "cuda":
        import torch

        torch.cuda.set_device(device)


def execute_step(pm: Any, worker: Any, defer: bool = False) -> Callable[[SchedulerOutput], Any]:
    """The step's model call on ``worker``, resolved once: ``worker.execute_model`` itself while the
    kernel's default is the only ``sparrow_execute_model`` implementation, else the hook (a plugin
    replaces or wraps the step, and gets and returns plain outputs). With ``defer`` (overlapped
    scheduling) the kernel's own step is ``worker.execute_model_deferred`` where the worker has it:
    its output may be a deferred one, whose ``result()`` is the ``ModelRunnerOutput``."""
    if kernel_default_only(pm, "sparrow_execute_model"):
        deferred = getattr(worker, "execute_model_deferred", None) if defer else None
        return deferred or worker.execute_model
    hook = pm.hook.sparrow_execute_model
    return lambda scheduler_output: check_hook_result(
        pm, "sparrow_execute_model", hook(worker=worker, scheduler_output=scheduler_output), ModelRunnerOutput)
