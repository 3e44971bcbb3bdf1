"""User-facing engine configuration (pydantic), with vLLM's argument names.

``EngineConfig.from_kwargs(**kwargs)`` takes the flat keywords ``LLM(...)`` and ``sparrow serve``
accept and routes each to its section; an unknown or invalid value raises :class:`ConfigError`
naming the field and what is allowed.

The sections share one base (``sparrow.config_base``: strict types, :class:`ConfigError`); the
model section, the largest, is ``sparrow.config_model``. Both are re-exported here, so callers
import every name from ``sparrow.config``.
"""

from __future__ import annotations

import json
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from sparrow.config_base import ConfigError, _describe, _Section, expand_dict_argument  # noqa: F401 - re-exported
from sparrow.config_model import DTYPES, ModelConfig  # noqa: F401 - re-exported
from sparrow.config_vllm import VLLM_ARGUMENTS_NOT_TAKEN, check_engine_argument_name  # noqa: F401 - re-exported

# kv_cache_dtype values (vLLM's names); "fp8" and "fp8_e4m3" both mean float8_e4m3fn.
KV_CACHE_DTYPES = ("auto", "bfloat16", "fp8", "fp8_e4m3")


class CacheConfig(_Section):
    block_size: int | None = Field(None, gt=0, le=1024, description="Tokens per KV cache block "
                                   "(default: the platform's, 16 on CPU and CUDA).")
    enable_prefix_caching: bool = Field(True, description="Reuse the KV blocks of prompt prefixes already computed.")
    kv_eviction_policy: str = Field("lru", description="Which free cached KV block is evicted first when a new "
                                    "one is needed: lru (least recently freed), lfu (least used, with aging), "
                                    "or a plugin's (`sparrow plugins` lists them).")
    kv_cache_memory_bytes: int | None = Field(None, gt=0, description="KV cache size in bytes on CPU-like devices "
                                              "(default: a quarter of free RAM, at most 1 GiB).")
    gpu_memory_utilization: float = Field(0.9, gt=0.0, le=1.0, description="Share of GPU memory for weights, "
                                          "activations and the KV cache, in (0, 1].")
    num_kv_blocks: int | None = Field(None, gt=0, description="Number of KV cache blocks, instead of sizing the "
                                      "cache from memory (default: measured).")
    num_gpu_blocks_override: int | None = Field(None, gt=0, description="vLLM's name for num_kv_blocks (with "
                                                "it, both must agree).")
    kv_cache_dtype: str = Field(
        "auto", description="Storage dtype of the KV cache: auto (the model's dtype); bfloat16 (a float32 "
        "model's cache in half the memory; CPU only); or fp8 / fp8_e4m3 (float8_e4m3fn with a per-tensor scale "
        "per layer, half the memory of bf16; CUDA only).")
    kv_events_config: dict[str, Any] | None = Field(
        None, description='vLLM\'s KV cache events: {"enable_kv_cache_events": true, "publisher": "zmq", '
        '"endpoint": "tcp://*:5557", "topic": "kv-events"} publishes every stored and evicted prefix-cache block '
        "on a ZeroMQ PUB socket (msgpack, as vLLM's), for KV-aware routers; needs enable_prefix_caching.")

    @field_validator("kv_events_config")
    @classmethod
    def _kv_events(cls, value: dict[str, Any] | None) -> dict[str, Any] | None:
        from sparrow.engine.kv_events import check_kv_events_config

        return None if value is None else check_kv_events_config(value)

    @model_validator(mode="after")
    def _events_need_caching(self) -> CacheConfig:
        events = self.kv_events_config
        if events is not None and events["enable_kv_cache_events"] and not self.enable_prefix_caching:
            raise ValueError("kv_events_config: KV cache events report the prefix cache, and "
                             "enable_prefix_caching is off")
        return self

    @model_validator(mode="after")
    def _num_gpu_blocks_override(self) -> CacheConfig:
        override = self.num_gpu_blocks_override
        if override is not None and override != self.num_kv_blocks:
            if self.num_kv_blocks is not None:
                raise ValueError(f"num_gpu_blocks_override={override} and num_kv_blocks={self.num_kv_blocks} "
                                 "disagree; give one of them")
            object.__setattr__(self, "num_kv_blocks", override)  # not an assignment: that would validate again
        return self

    @field_validator("kv_cache_dtype")
    @classmethod
    def _check_kv_cache_dtype(cls, value: str) -> str:
        # vLLM's names. Which of them a device can store is the platform's call (preflight).
        if value == "fp8_e5m2":
            raise ValueError("fp8_e5m2 is not implemented; use fp8 (fp8_e4m3) or auto")
        if value not in KV_CACHE_DTYPES:
            raise ValueError(f"must be one of {', '.join(KV_CACHE_DTYPES)}")
        return value


class SchedulerConfig(_Section):
    scheduler: str = Field("fcfs", description="Scheduling policy: fcfs, priority, sjf, lpm, or a plugin's "
                           "(`sparrow plugins` lists them).")
    scheduling_policy: Literal["fcfs", "priority"] | None = Field(
        None, description="vLLM's name for its two policies: sets scheduler to fcfs or priority (with "
        "scheduler, both must agree).")
    max_num_seqs: int = Field(256, gt=0, description="Most requests running in one step.")
    max_num_batched_tokens: int | None = Field(None, gt=0, description="Token budget per step, prompt and output "
                                               "tokens together (default: the platform's, CPU 2048, CUDA 8192).")
    enable_chunked_prefill: bool = Field(True, description="Split a long prompt across steps instead of computing "
                                         "it in one.")
    long_prefill_token_threshold: int | None = Field(None, gt=0, description="Most tokens of one prompt per step "
                                                     "(default: no cap beyond the step's budget).")
    stream_interval: int = Field(1, ge=1, description="vLLM's: a streamed request's outputs carry at least this "
                                 "many new tokens each (its first token and its last output are sent at once); "
                                 "larger values send fewer, bigger chunks.")
    async_scheduling: bool | None = Field(None, description="Overlapped scheduling: the engine core schedules "
                                          "step n+1 while step n runs; not with speculative decoding or a KV "
                                          "connector (default: the platform's; off on the built-in CPU and CUDA "
                                          "platforms).")

    @model_validator(mode="after")
    def _scheduling_policy(self) -> SchedulerConfig:
        policy = self.scheduling_policy
        if policy is not None and policy != self.scheduler:
            if "scheduler" in self.model_fields_set:
                raise ValueError(f"scheduling_policy={policy!r} and scheduler={self.scheduler!r} disagree; "
                                 "give one of them")
            object.__setattr__(self, "scheduler", policy)  # not an assignment: that would validate again
        return self


class ParallelConfig(_Section):
    tensor_parallel_size: int = Field(1, gt=0, description="Ranks (processes or devices) that shard the model.")
    pipeline_parallel_size: int = Field(1, description="vLLM's pipeline stages: only 1 (Sparrow shards a model "
                                        "with tensor_parallel_size).")
    disable_custom_all_reduce: bool = Field(False, description="vLLM's switch off its custom all-reduce kernel; "
                                            "Sparrow has none (every all-reduce is its platform communicator's), "
                                            "so either value runs the same.")
    data_parallel_size: int = Field(1, gt=0, description="Engine cores behind one frontend, each with a whole "
                                    "copy of the model.")
    enable_expert_parallel: bool = Field(
        False, description="vLLM's: mixture-of-experts layers split their experts over the tensor-parallel ranks "
        "(each rank holds whole experts, the first ranks one more when they do not divide evenly) instead of "
        "every expert's intermediate size; attention is split as before.")
    data_parallel_rank: int = Field(0, ge=0, description="This engine core's index under data parallelism "
                                    "(set by the frontend; picks its devices after the lower ranks').")
    worker_extension_cls: str | None = Field(
        None, min_length=1, description="vLLM's: a class ('package.module:Class' or 'package.module.Class') whose "
        "methods are added to every worker, to call with collective_rpc('method') (RLHF weight sync, "
        "probes); it may not replace anything of the worker's.")
    distributed_executor_backend: Literal["uni", "mp"] | None = Field(
        None, description="uni: the worker runs in the engine-core process; mp: one process per rank "
        "(default: uni for one rank, mp for several).")
    # Several machines (docs/distributed.md); each falls back to its environment variable.
    nnodes: int | None = Field(None, gt=0, description="Machines this engine's tensor-parallel ranks span "
                               "(default: SPARROW_NNODES, else 1).")
    master_addr: str | None = Field(None, min_length=1, description="Node 0's address, reachable from the "
                                    "other nodes (default: MASTER_ADDR).")
    master_port: int | None = Field(None, gt=0, lt=65536, description="A free port on node 0 for "
                                    "torch.distributed's store (default: MASTER_PORT).")

    @field_validator("pipeline_parallel_size")
    @classmethod
    def _no_pipeline_stages(cls, value: int) -> int:
        if value != 1:
            raise ValueError("pipeline parallelism is not implemented: only 1; shard the model with "
                             "tensor_parallel_size (across machines too, see docs/distributed.md)")
        return value

    @field_validator("nnodes")
    @classmethod
    def _nodes_share_the_ranks(cls, value: int | None, info: Any) -> int | None:
        tp = info.data.get("tensor_parallel_size", 1)
        if value is not None and value > 1 and tp % value != 0:
            raise ValueError(f"tensor_parallel_size ({tp}) must be a multiple of nnodes ({value}): "
                             "every node runs the same number of ranks")
        return value


class LoadConfig(_Section):
    load_format: str = Field("auto", min_length=1, description="How the weights are loaded: auto (safetensors), "
                             "safetensors, dummy (random weights, seeded, no checkpoint read) or a plugin's "
                             "loader (`sparrow plugins` lists them).")


class DeviceConfig(_Section):
    device: str = Field("auto", description="Platform to run on: auto picks the best one present; or a "
                        "registered name (cpu, cuda, a plugin's).")
    attention_backend: str = Field("auto", description="Attention implementation: auto, or one the platform "
                                   "offers (CPU: torch; CUDA: triton, flashinfer).")
    enforce_eager: bool = Field(False, description="CUDA: run every step eagerly, without CUDA graphs.")


class KVTransferConfig(_Section):
    kv_connector: str | None = Field(None, description="KV connector that moves KV blocks between engines, "
                                     "e.g. shared_storage (default: none).")
    kv_role: Literal["kv_producer", "kv_consumer", "kv_both"] | None = Field(
        None, description="This engine's side of the KV transfer (default: none).")
    kv_connector_extra_config: dict[str, Any] = Field(
        default_factory=dict, description='The connector\'s settings, e.g. {"storage_path": "/dir"}.')
    kv_transfer_config: dict[str, Any] | None = Field(
        None, description='vLLM\'s form of the three above in one dict, e.g. {"kv_connector": "shared_storage", '
        '"kv_role": "kv_both", "kv_connector_extra_config": {"storage_path": "/dir"}}; not with them.')

    @model_validator(mode="before")
    @classmethod
    def _vllm_dict(cls, values: Any) -> Any:
        return expand_dict_argument(values, "kv_transfer_config", _kv_transfer_key)

    @model_validator(mode="after")
    def _needs_a_connector(self) -> KVTransferConfig:
        if self.kv_connector is None:
            for name in ("kv_role", "kv_connector_extra_config"):
                if getattr(self, name):
                    raise ValueError(f"{name} is set but kv_connector is not: it applies to a KV connector only")
        return self


def _kv_transfer_key(key: str, value: Any) -> dict[str, Any]:
    if key not in ("kv_connector", "kv_role", "kv_connector_extra_config"):
        raise ValueError(f"kv_transfer_config.{key} is not supported: Sparrow's KV connectors take kv_connector, "
                         "kv_role and kv_connector_extra_config (a connector's own settings go in the last)")
    return {key: value}


class SpeculativeSection(_Section):
    speculative_config: dict[str, Any] | None = Field(
        None, description='Speculative decoding, vLLM\'s dictionary, e.g. {"method": "ngram", '
        '"num_speculative_tokens": 4, "prompt_lookup_max": 4, "prompt_lookup_min": 1}, or method "draft_model" '
        '/ "eagle" with "model": a draft model or EAGLE head directory (default: off).')

    @field_validator("speculative_config", mode="before")
    @classmethod
    def _check_speculative(cls, value: Any) -> Any:
        from sparrow.spec_decode.config import parse_speculative_config

        return parse_speculative_config(value)


class LoRAConfig(_Section):
    enable_lora: bool = Field(False, description="Serve LoRA adapters: requests name one with lora_request "
                              "(offline) or as their model (server).")
    max_loras: int = Field(1, gt=0, description="Most distinct LoRA adapters in one batch (adapter slots on "
                           "the device); more adapters take turns, swapped in least recently used first.")
    max_lora_rank: int = Field(16, gt=0, le=512, description="Largest adapter rank served; an adapter of a "
                               "higher rank is refused.")
    max_cpu_loras: int | None = Field(None, gt=0, description="Adapters kept loaded in host memory, at least "
                                      "max_loras; others are read from disk again when used (default: max_loras).")

    @field_validator("max_cpu_loras")
    @classmethod
    def _at_least_max_loras(cls, value: int | None, info: Any) -> int | None:
        max_loras = info.data.get("max_loras", 1)
        if value is not None and value < max_loras:
            raise ValueError(f"must be >= max_loras ({max_loras}): the adapters on the device are kept on the "
                             "host too")
        return value


class ObservabilityConfig(_Section):
    disable_log_stats: bool | None = Field(
        None, description="Do not log the engine's throughput, queue and KV cache usage every log_stats_interval "
        "seconds (default: logged by sparrow serve and AsyncLLM, not by LLM, as in vLLM).")
    log_stats_interval: float = Field(
        10.0, gt=0, description="Seconds between two stats log lines (vLLM's VLLM_LOG_STATS_INTERVAL).")
    stat_loggers: list[str] | None = Field(
        None, description="Custom stat loggers fed every batch's statistics in the frontend: names registered by "
        "plugins (`sparrow plugins` lists them) or qualified names package.module:Class of StatLoggerBase "
        "subclasses (default: none; the stats line and the Prometheus metrics are built in).")

    @field_validator("stat_loggers", mode="before")
    @classmethod
    def _stat_logger_names(cls, value: Any) -> Any:
        # A module-level class is kept as "module:QualName", so the configuration stays plain data.
        if value is None:
            return None
        if isinstance(value, (str, bytes)) or not isinstance(value, (list, tuple)):
            raise ValueError("must be a list of names or 'package.module:Class' strings")
        names = []
        for item in value:
            if isinstance(item, type) and "<locals>" not in item.__qualname__:
                item = f"{item.__module__}:{item.__qualname__}"
            if not isinstance(item, str) or not item.strip():
                raise ValueError(f"every entry must be a registered name or 'package.module:Class', got {item!r} "
                                 "(pass classes and factories to LLM(stat_loggers=...) or the engine's constructor)")
            names.append(item.strip())
        return names


class PluginsConfig(_Section):
    additional_config: dict[str, Any] = Field(
        default_factory=dict, description='Settings for plugins (a platform\'s, say), passed through untouched '
        'and read as config.additional_config, e.g. {"my_platform": {"fast_path": true}}; must be JSON.')

    @field_validator("additional_config")
    @classmethod
    def _json_only(cls, value: dict[str, Any]) -> dict[str, Any]:
        # It crosses process boundaries (and machines, as JSON), so it must survive a JSON round trip.
        try:
            json.dumps(value, allow_nan=False)
        except (TypeError, ValueError) as exc:
            raise ValueError(f"must be JSON-serialisable (strings, numbers, booleans, None, lists and "
                             f"objects with string keys): {exc}") from None
        return value


# Engine arguments for which None is a value rather than "the default": seed=None draws a random
# seed (vLLM's), where the default is 0.
NONE_IS_A_VALUE = frozenset({"seed"})

class EngineConfig(BaseModel):
    # validate_assignment: a platform's check_and_update_config may replace a whole section.
    model_config = ConfigDict(extra="forbid", protected_namespaces=(), validate_assignment=True)

    model: ModelConfig = Field(default_factory=ModelConfig)
    cache: CacheConfig = Field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = Field(default_factory=SchedulerConfig)
    parallel: ParallelConfig = Field(default_factory=ParallelConfig)
    device: DeviceConfig = Field(default_factory=DeviceConfig)
    kv_transfer: KVTransferConfig = Field(default_factory=KVTransferConfig)
    load: LoadConfig = Field(default_factory=LoadConfig)
    plugins: PluginsConfig = Field(default_factory=PluginsConfig)
    observability: ObservabilityConfig = Field(default_factory=ObservabilityConfig)
    speculative: SpeculativeSection = Field(default_factory=SpeculativeSection)
    lora: LoRAConfig = Field(default_factory=LoRAConfig)

    @property
    def additional_config(self) -> dict[str, Any]:
        """Plugin-specific settings (vLLM's ``additional_config``), from ``LLM(additional_config=...)``
        or ``--additional-config``; the same dict in every process."""
        return self.plugins.additional_config

    @additional_config.setter
    def additional_config(self, value: dict[str, Any]) -> None:
        self.plugins.additional_config = value

    @classmethod
    def sections(cls) -> dict[str, type[_Section]]:
        return {name: f.annotation for name, f in cls.model_fields.items()}  # type: ignore[misc]

    @classmethod
    def field_names(cls) -> dict[str, str]:
        """flat argument name -> section name."""
        return {arg: section for section, sec_cls in cls.sections().items() for arg in sec_cls.model_fields}

    @classmethod
    def from_kwargs(cls, **kwargs: Any) -> EngineConfig:
        """The configuration of ``LLM(**kwargs)``. None stands for an argument's default (what
        ``EngineArgs.add_cli_args``' unset flags are, so ``LLM(**vars(args))`` works as in vLLM)."""
        owners = cls.field_names()
        grouped: dict[str, dict[str, Any]] = {section: {} for section in cls.sections()}
        for key, value in kwargs.items():
            check_engine_argument_name(key, owners)
            if value is None and key not in NONE_IS_A_VALUE:  # the default (an optional field's is None)
                continue
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

