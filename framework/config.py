"""User-facing engine configuration (pydantic), with vLLM's argument names.

``EngineConfig.from_kwargs(**kwargs)`` takes the flat keywords ``LLM(...)`` and ``sparrow serve``
accept and routes each to its section; an unknown or invalid value raises :class:`ConfigError`
naming the field and what is allowed.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

DTYPES = ("auto", "float32", "bfloat16", "float16")


class ConfigError(ValueError):
    """An engine argument has an invalid value; the message names the field."""


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True, protected_namespaces=())


class ModelConfig(_Section):
    model: str | None = Field(None, description="Local Hugging Face model directory; None is the built-in sparrow-tiny.")
    tokenizer: str | None = Field(None, description="Tokenizer directory; defaults to the model directory.")
    dtype: str = Field("auto", description="auto, float32, bfloat16 or float16 (auto: the platform's default).")
    max_model_len: int | None = Field(None, gt=0, description="Context length; defaults to the model's.")
    seed: int = Field(0, ge=0, description="Seed for weights built locally and unseeded sampling.")
    served_model_name: str | None = Field(None, description="Name the server reports; defaults to the model path.")

    @field_validator("dtype")
    @classmethod
    def _check_dtype(cls, value: str) -> str:
        value = {"float": "float32", "fp32": "float32", "bf16": "bfloat16", "half": "float16", "fp16": "float16"}.get(value, value)
        if value not in DTYPES:
            raise ValueError(f"must be one of {', '.join(DTYPES)}")
        return value


class CacheConfig(_Section):
    block_size: int | None = Field(None, gt=0, le=1024, description="Tokens per KV block; defaults to the platform's (16).")
    enable_prefix_caching: bool = True
    kv_cache_memory_bytes: int | None = Field(None, gt=0, description="KV cache size on CPU-like devices.")
    gpu_memory_utilization: float = Field(0.9, gt=0.0, le=1.0)
    num_kv_blocks: int | None = Field(None, gt=0, description="Override of the measured number of KV blocks.")


class SchedulerConfig(_Section):
    scheduler: str = Field("fcfs", description="Registered scheduler name: fcfs, priority, sjf, lpm, or a plugin's.")
    max_num_seqs: int = Field(256, gt=0)
    max_num_batched_tokens: int | None = Field(None, gt=0, description="Token budget per step; default: the platform's (CPU 2048, CUDA 8192).")
    enable_chunked_prefill: bool = True
    long_prefill_token_threshold: int | None = Field(None, gt=0, description="Cap on a prompt's tokens per step.")


class ParallelConfig(_Section):
    tensor_parallel_size: int = Field(1, gt=0)
    data_parallel_size: int = Field(1, gt=0)
    data_parallel_rank: int = Field(0, ge=0, description="This engine core's index under data parallelism "
                                    "(set by the frontend; picks its devices after the lower ranks').")
    distributed_executor_backend: Literal["uni", "mp"] | None = None
    # Several machines (docs/distributed.md); each falls back to its environment variable.
    nnodes: int | None = Field(None, gt=0, description="Machines this engine's tensor-parallel ranks span "
                               "(default: SPARROW_NNODES, else 1).")
    master_addr: str | None = Field(None, min_length=1, description="Node 0's address, reachable from the "
                                    "other nodes (default: MASTER_ADDR).")
    master_port: int | None = Field(None, gt=0, lt=65536, description="A free port on node 0 for "
                                    "torch.distributed's store (default: MASTER_PORT).")

    @field_validator("nnodes")
    @classmethod
    def _nodes_share_the_ranks(cls, value: int | None, info: Any) -> int | None:
        tp = info.data.get("tensor_parallel_size", 1)
        if value is not None and value > 1 and tp % value != 0:
            raise ValueError(f"tensor_parallel_size ({tp}) must be a multiple of nnodes ({value}): "
                             "every node runs the same number of ranks")
        return value


class DeviceConfig(_Section):
    device: str = Field("auto", description="auto, or a registered platform name (cpu, cuda, ...).")
    attention_backend: str = Field("auto", description="auto or a backend name the platform offers.")
    enforce_eager: bool = False


class KVTransferConfig(_Section):
    kv_connector: str | None = None
    kv_role: Literal["kv_producer", "kv_consumer", "kv_both"] | None = None
    kv_connector_extra_config: dict[str, Any] = Field(default_factory=dict)


class EngineConfig(BaseModel):
    model_config = ConfigDict(extra="forbid", protected_namespaces=())

    model: ModelConfig = Field(default_factory=ModelConfig)
    cache: CacheConfig = Field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = Field(default_factory=SchedulerConfig)
    parallel: ParallelConfig = Field(default_factory=ParallelConfig)
    device: DeviceConfig = Field(default_factory=DeviceConfig)
    kv_transfer: KVTransferConfig = Field(default_factory=KVTransferConfig)

    @classmethod
    def sections(cls) -> dict[str, type[_Section]]:
        return {name: f.annotation for name, f in cls.model_fields.items()}  # type: ignore[misc]

    @classmethod
    def field_names(cls) -> dict[str, str]:
        """flat argument name -> section name."""
        return {arg: section for section, sec_cls in cls.sections().items() for arg in sec_cls.model_fields}

    @classmethod
    def from_kwargs(cls, **kwargs: Any) -> EngineConfig:
        owners = cls.field_names()
        grouped: dict[str, dict[str, Any]] = {section: {} for section in cls.sections()}
        for key, value in kwargs.items():
            if key not in owners:
                raise ConfigError(
                    f"unknown engine argument {key!r}; valid arguments: {', '.join(sorted(owners))}"
                )
            grouped[owners[key]][key] = value
        built = {}
        for section, values in grouped.items():
            try:
                built[section] = cls.sections()[section](**values)
            except ValidationError as exc:
                raise ConfigError(_describe(exc)) from None
        return cls(**built)

    def flat(self) -> dict[str, Any]:
        """The configuration as the flat keywords ``from_kwargs`` accepts."""
        out: dict[str, Any] = {}
        for section in self.sections():
            out.update(getattr(self, section).model_dump())
        return out

    # Derived values the kernel reads; platforms fill the None defaults at start-up.
    @property
    def max_num_batched_tokens(self) -> int:
        return self.scheduler.max_num_batched_tokens or 8192


def _describe(exc: ValidationError) -> str:
    parts = []
    for err in exc.errors():
        field = ".".join(str(p) for p in err["loc"]) or "value"
        parts.append(f"invalid engine argument {field!r}: {err['msg']} (got {err.get('input')!r})")
    return "; ".join(parts)
