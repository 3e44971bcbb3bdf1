"""The worker lives in the engine-core process."""

from __future__ import annotations

from typing import Any, Callable

from sparrow.config import EngineConfig
from sparrow.core.sched.output import SchedulerOutput
from sparrow.executor.abstract import Executor, KVCacheInfo
from sparrow.platforms import resolve_platform
from sparrow.plugins import get_plugin_manager, import_object, kernel_default_only
from sparrow.worker.outputs import ModelRunnerOutput


class UniProcExecutor(Executor):
    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self.platform = resolve_platform(config.device.device)
        worker_cls = import_object(self.platform.worker_cls)
        self.worker = worker_cls(config=config, platform=self.platform, rank=0, local_rank=0,
                                 world_size=1, distributed_init_method=None)
        self._execute = execute_step(get_plugin_manager(), self.worker)

    def initialize(self) -> KVCacheInfo:
        self.worker.init_device()
        self.worker.load_model()
        num_blocks = self.worker.determine_num_kv_blocks()
        self.worker.initialize_kv_cache(num_blocks)
        return KVCacheInfo(num_blocks=num_blocks, block_size=self.worker.block_size)

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        output = self._execute(scheduler_output)
        if output is None:
            raise RuntimeError(f"no plugin executed the model for platform {self.platform.name!r}")
        return output

    def collective_rpc(self, method: str, args: tuple = (), kwargs: dict | None = None) -> list[Any]:
        return [getattr(self.worker, method)(*args, **(kwargs or {}))]

    def shutdown(self) -> None:
        shutdown = getattr(self.worker, "shutdown", None)
        if shutdown is not None:
            shutdown()


def execute_step(pm: Any, worker: Any) -> Callable[[SchedulerOutput], ModelRunnerOutput | None]:
    """The step's model call on ``worker``, resolved once: ``worker.execute_model`` itself while the
    kernel's default is the only ``sparrow_execute_model`` implementation, else the hook (a plugin
    replaces or wraps the step)."""
    if kernel_default_only(pm, "sparrow_execute_model"):
        return worker.execute_model
    hook = pm.hook.sparrow_execute_model
    return lambda scheduler_output: hook(worker=worker, scheduler_output=scheduler_output)
