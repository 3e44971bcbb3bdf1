"""The executor contract the engine core relies on."""

from __future__ import annotations

from abc import ABC, abstractmethod
from concurrent.futures import Future
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    from sparrow.config import EngineConfig
    from sparrow.core.sched.output import SchedulerOutput
    from sparrow.worker.outputs import ModelRunnerOutput


@dataclass(slots=True, frozen=True)
class KVCacheInfo:
    num_blocks: int
    block_size: int


class StepHandle(Protocol):
    """A step started by ``Executor.execute_model_async``: a ``concurrent.futures.Future`` or
    anything with its ``result()``."""

    def result(self) -> ModelRunnerOutput: ...


class Executor(ABC):
    @abstractmethod
    def initialize(self) -> KVCacheInfo:
        """Start the workers, load the model, size and allocate the KV cache (engine start-up)."""

    @abstractmethod
    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        """Run one step on every worker; rank 0's output is returned."""

    def execute_model_async(self, scheduler_output: SchedulerOutput) -> StepHandle:
        """Start one step and return at once (overlapped scheduling); steps run in the order they
        are started. The default runs the step before returning, in a future already done: an
        executor that can overlap overrides it."""
        future: Future[ModelRunnerOutput] = Future()
        try:
            future.set_result(self.execute_model(scheduler_output))
        except BaseException as exc:  # noqa: BLE001 - handed to whoever waits on the step
            future.set_exception(exc)
        return future

    def collective_rpc(self, method: str | bytes, args: tuple = (), kwargs: dict | None = None,
                       timeout_s: float | None = None) -> list[Any]:
        """Call ``worker.method(*args, **kwargs)`` on every worker, or a pickled function of the
        worker (``sparrow.executor.rpc``); results in rank order; TimeoutError past ``timeout_s``."""
        raise NotImplementedError

    def check_health(self) -> None:
        """Raise if a worker died."""

    def shutdown(self) -> None:
        """Stop the workers and free their resources."""


def make_executor(config: EngineConfig) -> Executor:
    backend = config.parallel.distributed_executor_backend
    if backend is None:
        backend = "mp" if config.parallel.tensor_parallel_size > 1 else "uni"
    if backend == "uni":
        if config.parallel.tensor_parallel_size > 1:
            raise ValueError("tensor_parallel_size > 1 needs distributed_executor_backend='mp'")
        from sparrow.executor.uniproc import UniProcExecutor

        return UniProcExecutor(config)
    from sparrow.executor.multiproc import MultiprocExecutor

    return MultiprocExecutor(config)
