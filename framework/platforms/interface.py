"""What a platform plugin provides: identity, defaults, its worker class, and its say over the
engine configuration (``check_and_update_config``)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from sparrow.config import EngineConfig


class Platform:
    """Subclass per device type. Instances are cheap; heavy imports happen in the worker."""

    name: str = "abstract"
    device_type: str = "cpu"  # torch device type
    dist_backend: str = "gloo"  # torch.distributed backend for tensor parallel
    default_block_size: int = 16
    # Token budget per step when the user sets none (max_num_batched_tokens).
    default_max_num_batched_tokens: int = 8192
    # Overlapped scheduling (async_scheduling) when the user sets none and the configuration
    # allows it (no speculative decoding, no KV connector).
    default_async_scheduling: bool = False
    default_dtype: str = "float32"
    supported_dtypes: tuple[str, ...] = ("float32", "bfloat16")
    # kv_cache_dtype values this platform can store its KV cache in ("auto" = the model dtype).
    # A platform that lists "fp8" / "fp8_e4m3" allocates float8_e4m3fn caches and its attention
    # backends take per-layer ``k_scale`` / ``v_scale`` keywords (see docs/plugins.md).
    supported_kv_cache_dtypes: tuple[str, ...] = ("auto",)
    # "package.module:WorkerClass"
    worker_cls: str = ""
    # The device communicator (collectives of tensor parallelism) by its registered name
    # (sparrow_register_device_communicators); the built-in wraps torch.distributed.
    communicator: str = "torch_distributed"
    # Whether the platform's workers run pooling (embedding) models: a model runner built on
    # sparrow.worker.model_runner.ModelRunner does; one that prices steps without running the
    # model (the simulated device) says False, and runner="pooling" is refused on it.
    supports_pooling: bool = True

    def check_and_update_config(self, config: EngineConfig) -> None:
        """Adjust and validate the engine configuration for this platform (vLLM's name).

        Called once, in the frontend process, after the user's arguments are parsed and this
        platform is resolved, before any engine process starts or anything is built; the config
        it leaves is the one every process (engine core, workers) receives. Fields the user left
        unset are still None here (block_size, max_num_batched_tokens...): set what the platform
        needs, and the kernel fills what stays None from the platform's defaults afterwards.
        Plugin settings are in ``config.additional_config``. Every assignment is validated, and the
        whole configuration is checked again afterwards; raise
        :class:`sparrow.config.ConfigError` naming the field to refuse a value. The default changes
        nothing.
        """

    def resolve_dtype(self, requested: str) -> str:
        dtype = self.default_dtype if requested == "auto" else requested
        if dtype not in self.supported_dtypes:
            raise ValueError(
                f"dtype {requested!r} is not supported on platform {self.name!r}; "
                f"supported: {', '.join(self.supported_dtypes)}"
            )
        return dtype

    def device_for_rank(self, local_rank: int) -> Any:
        import torch

        return torch.device(self.device_type)

    def __repr__(self) -> str:
        return f"{type(self).__name__}(name={self.name!r})"
