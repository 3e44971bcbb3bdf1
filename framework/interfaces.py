"""The seams between the kernel and what plugins provide, as structural types.

Each Protocol lists what the kernel actually reads or calls on the object, nothing more, so a
plugin may satisfy one without inheriting from Sparrow's base classes (most reuse them anyway:
:class:`sparrow.platforms.interface.Platform`, :class:`sparrow.worker.worker_base.WorkerBase`,
:class:`sparrow.worker.model_runner.ModelRunner`). They type the hookspecs' arguments and are
``runtime_checkable``, so ``isinstance(obj, Worker)`` checks that the attributes exist (not their
signatures). Importing this module imports neither torch nor the engine.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

if TYPE_CHECKING:
    from sparrow.config import EngineConfig
    from sparrow.core.sched.output import SchedulerOutput
    from sparrow.engine.messages import EngineCoreOutputs, EngineCoreRequest
    from sparrow.worker.outputs import ModelRunnerOutput

__all__ = ["AsyncEngineCoreClient", "EngineCoreClient", "ModelRunner", "Platform", "Worker"]


@runtime_checkable
class Platform(Protocol):
    """A device type: identity, defaults and the worker class (resolved from ``device=``)."""

    name: str  # what users pass as device=
    device_type: str  # the torch device type
    dist_backend: str  # torch.distributed backend of tensor parallelism
    default_block_size: int
    default_max_num_batched_tokens: int
    default_dtype: str
    supported_dtypes: tuple[str, ...]
    worker_cls: str  # "package.module:WorkerClass"
    communicator: str  # a registered device communicator's name

    def check_and_update_config(self, config: EngineConfig) -> None:
        """Adjust and validate the configuration, in the frontend, before anything is built."""
        ...

    def resolve_dtype(self, requested: str) -> str:
        """The dtype name to run (``requested`` may be ``"auto"``); ValueError when unsupported."""
        ...

    def device_for_rank(self, local_rank: int) -> Any:
        """The torch device of the rank with this index on its machine."""
        ...


@runtime_checkable
class ModelRunner(Protocol):
    """Owns the model and its KV cache on one rank; turns a scheduled step into sampled tokens."""

    model: Any  # the torch module
    kv_caches: list[Any]  # one tensor per layer, [2, num_blocks, block_size, num_kv_heads, head_dim]
    kv_connector: Any  # the worker half of a KV connector, or None

    def kv_cache_bytes_per_block(self) -> int:
        ...

    def initialize_kv_cache(self, num_blocks: int) -> None:
        ...

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        ...


@runtime_checkable
class Worker(Protocol):
    """One rank of a platform, built as ``worker_cls(config=, platform=, rank=, local_rank=,
    world_size=, distributed_init_method=)`` by the executor; the executor calls the methods in
    this order at start-up, then ``execute_model`` once per step."""

    platform: Platform
    block_size: int  # tokens per KV block on this rank

    def init_device(self) -> None:
        ...

    def load_model(self) -> None:
        ...

    def determine_num_kv_blocks(self) -> int:
        ...

    def initialize_kv_cache(self, num_blocks: int) -> None:
        ...

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        ...

    def shutdown(self) -> None:
        ...


@runtime_checkable
class EngineCoreClient(Protocol):
    """What ``LLMEngine`` calls on its engine core, in-process or in another process."""

    def add_request(self, request: EngineCoreRequest) -> None:
        ...

    def abort_requests(self, request_ids: list[str]) -> None:
        ...

    def get_output(self) -> EngineCoreOutputs:
        """The next step's outputs; blocks until there are some."""
        ...

    def call_utility(self, method: str, *args: Any) -> Any:
        """``EngineCore.<method>(*args)`` in the engine core, and its result."""
        ...

    def shutdown(self) -> None:
        ...


@runtime_checkable
class AsyncEngineCoreClient(Protocol):
    """What ``AsyncLLM`` calls on its engine core (always in another process)."""

    kv_cache_info: dict[str, int]  # {"num_blocks": ..., "block_size": ...}

    @property
    def is_dead(self) -> bool:
        ...

    @property
    def dead_error(self) -> Exception | None:
        """The ``EngineDeadError`` once the engine core is gone, else None."""
        ...

    async def add_request_async(self, request: EngineCoreRequest) -> None:
        ...

    def abort_requests(self, request_ids: list[str]) -> None:
        """Callable from sync code (a closing generator): sending never waits on the engine."""
        ...

    async def abort_requests_async(self, request_ids: list[str]) -> None:
        ...

    async def get_output_async(self) -> EngineCoreOutputs:
        ...

    async def call_utility_async(self, method: str, *args: Any) -> Any:
        ...

    def shutdown(self) -> None:
        ...
