"""User-facing engine configuration (pydantic), with vLLM's argument names.

``EngineConfig.from_kwargs(**kwargs)`` takes the flat keywords ``LLM(...)`` and ``sparrow serve``
accept and routes each to its section; an unknown or invalid value raises :class:`ConfigError`
naming the field and what is allowed.
"""

from __future__ import annotations

import json
import logging
import numbers
import os
import random
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

logger = logging.getLogger(__name__)

DTYPES = ("auto", "float32", "bfloat16", "float16")
# kv_cache_dtype values (vLLM's names); "fp8" and "fp8_e4m3" both mean float8_e4m3fn.
KV_CACHE_DTYPES = ("auto", "bfloat16", "fp8", "fp8_e4m3")


def _plain(value: Any) -> Any:
    """A path as its string, a numpy number as a Python one, a tuple as a list."""
    if isinstance(value, os.PathLike):
        return os.fspath(value)
    if isinstance(value, numbers.Number) and not isinstance(value, (bool, int, float)) and hasattr(value, "item"):
        return value.item()
    if isinstance(value, tuple):
        return list(value)
    return value


class ConfigError(ValueError):
    """An engine argument has an invalid value; the message names the field."""


class _Section(BaseModel):
    # strict: a string is not a number and a bool is not an integer (enforce_eager="yes" and
    # max_model_len=True are mistakes, not 1); the few conversions a Python caller expects are
    # made before the check (_plain_values).
    model_config = ConfigDict(extra="forbid", validate_assignment=True, protected_namespaces=(), strict=True)

    @model_validator(mode="before")
    @classmethod
    def _plain_values(cls, values: Any) -> Any:
        if isinstance(values, dict):
            return {key: _plain(value) for key, value in values.items()}
        return values


class ModelConfig(_Section):
    # Every description is also the --help text of its flag: say what the value does and, where
    # the default is None, what None means ("(default: ...)"); the CLI appends other defaults.
    model: str | None = Field(None, description="Local Hugging Face model directory (config.json, *.safetensors, "
                              "tokenizer files); never downloaded (default: the built-in sparrow-tiny).")
    tokenizer: str | None = Field(None, description="Tokenizer directory (default: the model directory).")
    runner: str = Field("auto", description="vLLM's model runner kind: auto or generate (Sparrow runs generative "
                        "models only; pooling is refused).")
    task: str = Field("auto", description="vLLM's older name for runner: auto or generate.")
    dtype: str = Field("auto", description="Weight and activation dtype: auto, float32, bfloat16 or float16; "
                       "auto is the platform's choice (CPU float32, CUDA bfloat16).")
    max_model_len: int | None = Field(None, gt=0, description="Longest context, prompt plus output, in tokens "
                                      "(default: the model's max_position_embeddings).")
    seed: int = Field(0, ge=0, description="Seed for requests without their own seed and for load_format=dummy "
                      "weights (None: a random one, chosen once at start-up and logged).")
    served_model_name: str | None = Field(None, description="Model name the server reports and accepts "
                                          "(default: the model path).")
    structured_outputs_any_whitespace: bool = Field(
        False, description="Structured outputs: let JSON grammars put any whitespace between tokens (the "
        "default allows only compact JSON, so that a weak model cannot emit whitespace until max_tokens; "
        "vLLM's disable_any_whitespace, inverted).")
    structured_outputs_compile_timeout: float = Field(
        30.0, gt=0, description="Structured outputs: seconds a grammar may take to compile; a request whose grammar "
        "takes longer fails, and the compile is stopped (a short regex can take xgrammar minutes).")
    structured_outputs_mask_budget_ms: float = Field(
        100.0, gt=0, description="Structured outputs: milliseconds one request's grammar may take to compute a "
        "token mask. A grammar over it at its first token fails its request at compile time; one over it on "
        "three steps fails then (every request in the batch waits for the masks).")
    reasoning_parser: str | None = Field(
        None, description="How the model marks its reasoning: qwen3, deepseek_r1 (<think>...</think>) or a "
        "plugin's. The server splits reasoning_content from content, and structured outputs apply only after "
        "the reasoning ends (default: none).")
    logits_processors: list[str] | None = Field(
        None, description="Logits processors to enable besides the built-ins: names registered by plugins "
        "(`sparrow plugins` lists them) or qualified names package.module:Class (default: the built-ins only).")
    quantization: str | None = Field(
        None, description="Quantization method for the weights: a name a plugin registers (`sparrow plugins` "
        "lists them) (default: none, the weights run in dtype).")
    trust_remote_code: bool = Field(
        False, description="Let transformers run the Python code a model or tokenizer directory ships for its config "
        "or tokenizer class (auto_map in config.json / tokenizer_config.json); only for directories you trust. The "
        "model itself always runs Sparrow's implementation of its architecture.")
    hf_overrides: dict[str, Any] = Field(
        default_factory=dict, description="Values that replace the model's config.json fields, e.g. "
        "'{\"max_position_embeddings\": 131072, \"rope_scaling\": {\"rope_type\": \"yarn\", \"factor\": 4.0, "
        "\"original_max_position_embeddings\": 32768}}'; a dict value is merged into the field's dict (rope_scaling "
        "into rope_parameters, keeping rope_theta).")
    tokenizer_mode: Literal["auto", "slow"] = Field(
        "auto", description="auto: the fast (Rust) tokenizer when the directory has one; slow: the Python "
        "tokenizer class, where the directory has one (its own code's slow class, with trust_remote_code, or a "
        "Python-only tokenizer; transformers 5 has no slow twin of a fast tokenizer, so a fast-only directory is "
        "refused). vLLM's mistral and custom modes are not supported.")
    generation_config: str = Field(
        "auto", min_length=1, description="Where the default sampling parameters come from: auto (the model "
        "directory's generation_config.json: temperature, top_p, top_k, min_p, repetition_penalty, and "
        "max_new_tokens as max_tokens), vllm (the neutral defaults; the file is ignored), or a directory holding a "
        "generation_config.json. Used where a request leaves a parameter unset.")
    override_generation_config: dict[str, Any] = Field(
        default_factory=dict, description="Generation-config values that replace the file's, e.g. "
        "'{\"temperature\": 0.5}'; a max_new_tokens here also caps every request's max_tokens on the server.")
    max_logprobs: int = Field(
        20, ge=-1, description="Most log probabilities per token a request may ask for (logprobs, prompt_logprobs, "
        "top_logprobs); -1: the vocabulary size.")

    @field_validator("logits_processors", mode="before")
    @classmethod
    def _processor_names(cls, value: Any) -> Any:
        # vLLM also takes classes: they travel to the engine's processes as "module:QualName",
        # which must be importable there (the name is checked before any process starts).
        if value is None:
            return None
        if isinstance(value, (str, bytes)) or not isinstance(value, (list, tuple)):
            raise ValueError("must be a list of names or 'package.module:Class' strings (or classes)")
        names = []
        for item in value:
            if isinstance(item, type):
                if "<locals>" in item.__qualname__:
                    raise ValueError(f"{item.__qualname__} is defined inside a function, so no other process can "
                                     "import it; define it at module level")
                item = f"{item.__module__}:{item.__qualname__}"
            if not isinstance(item, str) or not item.strip():
                raise ValueError(f"every entry must be a non-empty name or class, got {item!r}")
            names.append(item.strip())
        return names

    @field_validator("seed", mode="before")
    @classmethod
    def _random_seed(cls, value: Any) -> Any:
        # vLLM's seed=None: not reproducible run to run; one seed drawn here serves every process.
        if value is None:
            seed = random.SystemRandom().randrange(2**31)
            logger.info("seed=None: using seed %d", seed)
            return seed
        return value

    @field_validator("dtype")
    @classmethod
    def _check_dtype(cls, value: str) -> str:
        aliases = {"float": "float32", "fp32": "float32", "bf16": "bfloat16", "half": "float16", "fp16": "float16"}
        value = aliases.get(value, value)
        if value not in DTYPES:
            raise ValueError(f"must be one of {', '.join(DTYPES)}")
        return value

    @field_validator("runner", "task")
    @classmethod
    def _generative_only(cls, value: str) -> str:
        if value not in ("auto", "generate"):
            raise ValueError("Sparrow runs generative models only: auto or generate (pooling, embedding and "
                             "scoring models are not supported)")
        return value


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
    kv_cache_dtype: str = Field(
        "auto", description="Storage dtype of the KV cache: auto (the model's dtype); bfloat16 (a float32 "
        "model's cache in half the memory; CPU only); or fp8 / fp8_e4m3 (float8_e4m3fn with a per-tensor scale "
        "per layer, half the memory of bf16; CUDA only).")

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
    data_parallel_rank: int = Field(0, ge=0, description="This engine core's index under data parallelism "
                                    "(set by the frontend; picks its devices after the lower ranks').")
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

    @model_validator(mode="after")
    def _needs_a_connector(self) -> KVTransferConfig:
        if self.kv_connector is None:
            for name in ("kv_role", "kv_connector_extra_config"):
                if getattr(self, name):
                    raise ValueError(f"{name} is set but kv_connector is not: it applies to a KV connector only")
        return self


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
        message = err["msg"].removeprefix("Value error, ")
        if not err["loc"]:  # a check across fields: its message names them
            parts.append(f"invalid engine arguments: {message}")
            continue
        field = ".".join(str(p) for p in err["loc"])
        parts.append(f"invalid engine argument {field!r}: {message} (got {err.get('input')!r})")
    return "; ".join(parts)
