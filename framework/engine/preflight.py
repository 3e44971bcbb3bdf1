"""Pre-flight checks: configuration errors found in the caller, before any process starts.

``finalize_config`` (which ``LLMEngine`` and ``AsyncLLM`` call first) lets the platform adjust
the configuration (``apply_platform_config``) and ends with ``check_engine_config``, so a wrong
name, a missing file or an impossible budget is a :class:`~sparrow.config.ConfigError` naming the
field within a second, instead of an ``EngineStartupError`` after the engine process has loaded
the model (or, for a budget, a batch lost later). Everything here reads files and the plugin
registry only: no model, no device.

What is checked:

    model / tokenizer      the directory exists with config.json, the weights the load_format's
                           loader reads (auto: *.safetensors, every file its index names) and
                           tokenizer files
    trust_remote_code      set when config.json needs the code the directory ships (auto_map)
    tokenizer_mode         slow: the tokenizer loads as a Python (slow) one (transformers 5 has
                           none for a directory whose tokenizer is only the Rust one)
    scheduler, device,     names the plugin registry knows (the device present on this machine);
    kv_connector,          kv_role set with a connector
    load_format,
    quantization,
    kv_eviction_policy
    reasoning_parser       a registered reasoning parser
    logits_processors      registered names, or 'package.module:Class' names that import here and
                           name a logits processor class
    stat_loggers           registered names, or 'package.module:Class' names that import here
    attention_backend      offered by the platform (its ``sparrow_attention_backend`` hook answers)
    dtype                  supported by the platform
    kv_cache_dtype         in the platform's supported_kv_cache_dtypes (and the requested backend's)
    quantization           the method accepts the configuration (``QuantizationMethod.check_config``)
    speculative_config     a draft model or EAGLE head shares the target's vocabulary (and hidden size);
                           not with enable_prompt_embeds
    enable_lora            a llama-family architecture (tensor parallelism, quantization and
                           speculative decoding all combine with it)
    communicator           with tensor_parallel_size > 1, the platform's device communicator is
                           registered
    tensor_parallel_size,  the ranks divide the heads and sizes they split; expert parallelism
    enable_expert_parallel has experts to split, a dense checkpoint, one engine (preflight_parallel)
    budgets                chunked prefill off needs max_num_batched_tokens >= max_model_len (a
                           longer prompt could never be scheduled); max_model_len >= 2
    async_scheduling       no speculative decoding, KV connector or pooling model
    runner="pooling"       a platform that pools, a pooler prefix caching can serve (LAST), and
                           nothing that generates (speculative decoding, a reasoning parser, a
                           KV connector)
    worker_extension_cls   imports, is a class, and replaces nothing of the platform's worker
    parallel               the model's heads and MLP split evenly over tensor_parallel_size;
                           data_parallel_rank < data_parallel_size
"""

from __future__ import annotations

import json
import logging
import types
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from sparrow.config import ConfigError, EngineConfig, _describe
from sparrow.engine.preflight_files import (  # noqa: F401 - TOKENIZER_FILES re-exported
    TOKENIZER_FILES,
    _error,
    check_model_dir,
    check_model_files,
    check_tokenizer_mode,
)
from sparrow.engine.preflight_parallel import check_parallel, tp_split_problem
from sparrow.plugin_files import load_reasoning_parser_plugin
from sparrow.plugins import Registry, check_attention_backend, get_plugin_manager, get_registry, import_object

logger = logging.getLogger(__name__)

# -- plugin names ---------------------------------------------------------------------------------
def _registered(names: Any) -> str:
    return ", ".join(sorted(names)) or "none"


def load_plugin_files(config: EngineConfig) -> None:
    """Load the plugin files engine arguments name (``reasoning_parser_plugin``) into this
    process, before its registry is read; ConfigError naming the argument."""
    try:
        load_reasoning_parser_plugin(config.model.reasoning_parser_plugin)
    except ValueError as exc:
        raise _error("reasoning_parser_plugin", str(exc).removeprefix("reasoning_parser_plugin: ")) from None


def check_plugin_names(config: EngineConfig, registry: Registry) -> None:
    scheduler = config.scheduler.scheduler
    if scheduler not in registry.schedulers:
        raise _error("scheduler", f"unknown scheduler {scheduler!r}; registered: {_registered(registry.schedulers)}")
    eviction_policy = config.cache.kv_eviction_policy
    if eviction_policy not in registry.kv_eviction_policies:
        raise _error("kv_eviction_policy", f"unknown kv_eviction_policy {eviction_policy!r}; registered: "
                     f"{_registered(registry.kv_eviction_policies)}")
    device = config.device.device
    if device != "auto" and device not in registry.platforms:
        raise _error("device", f"unknown device {device!r}; installed platforms: {_registered(registry.platforms)}")
    kv = config.kv_transfer
    if kv.kv_connector is not None:
        if kv.kv_connector not in registry.kv_connectors:
            raise _error("kv_connector", f"unknown kv_connector {kv.kv_connector!r}; registered: "
                         f"{_registered(registry.kv_connectors)}")
        if kv.kv_role is None:
            raise _error("kv_role", "must be set (kv_producer, kv_consumer or kv_both) when kv_connector is set")
    load_format = config.load.load_format
    if load_format != "auto" and load_format not in registry.model_loaders:
        raise _error("load_format", f"unknown load_format {load_format!r}; registered: auto, "
                     f"{_registered(registry.model_loaders)}")
    quantization = config.model.quantization
    if quantization is not None and quantization not in registry.quantization_methods:
        raise _error("quantization", f"unknown quantization method {quantization!r}; registered: "
                     f"{_registered(registry.quantization_methods)}")
    reasoning_parser = config.model.reasoning_parser
    if reasoning_parser is not None and reasoning_parser not in registry.reasoning_parsers:
        raise _error("reasoning_parser", f"unknown reasoning parser {reasoning_parser!r}; registered: "
                     f"{_registered(registry.reasoning_parsers)}")
    if config.model.logits_processors:
        from sparrow.sample.logits_processor.load import LogitsProcessorLookupError, enabled_classes

        try:
            enabled_classes(config.model.logits_processors, registry)
        except LogitsProcessorLookupError as exc:
            raise _error("logits_processors", str(exc)) from None
    if config.observability.stat_loggers:
        from sparrow.engine.stat_loggers import resolve_stat_loggers

        try:
            resolve_stat_loggers(config.observability.stat_loggers)
        except ValueError as exc:
            raise _error("stat_loggers", str(exc).removeprefix("stat_loggers: ")) from None


def resolve_configured_platform(device: str, registry: Registry | None = None) -> Any:
    """The platform object ``device`` names (or "auto" picks), or ConfigError naming 'device'."""
    registry = registry or get_registry()
    if device == "auto":
        from sparrow.platforms import resolve_platform

        try:
            return resolve_platform("auto")
        except RuntimeError as exc:
            raise _error("device", str(exc)) from None
    entry = registry.platforms.get(device)
    if entry is None:
        raise _error("device", f"unknown device {device!r}; installed platforms: {_registered(registry.platforms)}")
    try:
        import_path = entry.detect()
    except Exception as exc:  # noqa: BLE001 - a broken detector is reported, with its plugin's name
        raise _error("device", f"platform {device!r} (plugin {entry.plugin!r}) failed to detect its device: "
                     f"{exc!r}") from None
    if import_path is None:
        raise _error("device", f"{device!r} is installed but its plugin found no such device on this machine")
    return import_object(import_path)()


def apply_platform_config(config: EngineConfig, platform: Any) -> EngineConfig:
    """Let ``platform`` adjust ``config`` (its ``check_and_update_config``, which changes it in
    place), then validate the whole configuration again: the returned config is what every engine
    process receives. A refusal or an invalid value is a ConfigError naming the platform and field."""
    name = getattr(platform, "name", type(platform).__name__)
    hook = getattr(platform, "check_and_update_config", None)
    if hook is None:  # a platform class that does not derive from sparrow.platforms.Platform
        return config
    before = config.flat()
    device = config.device.device
    try:
        hook(config)
    except ConfigError:
        raise
    except ValidationError as exc:  # an assignment the field's validation refused
        raise ConfigError(f"platform {name!r} set an invalid value: {_describe(exc)}") from None
    except ValueError as exc:
        raise ConfigError(f"platform {name!r} refused the configuration: {exc}") from None
    # Assignments inside a section are validated one by one; checks across fields (nnodes and
    # tensor_parallel_size, say) run only when a section is built, so build them all again.
    try:
        checked = EngineConfig.model_validate(config.model_dump())
    except ValidationError as exc:
        raise ConfigError(f"platform {name!r} left an invalid configuration: {_describe(exc)}") from None
    if checked.device.device != device:
        raise _error("device", f"platform {name!r} changed it to {checked.device.device!r}; a platform "
                     "configures itself, it cannot hand the engine to another")
    after = checked.flat()
    changed = [f"{key}: {before.get(key)!r} -> {value!r}" for key, value in after.items() if before.get(key) != value]
    if changed:
        logger.info("platform %s changed the configuration: %s", name, "; ".join(changed))
    return checked


def check_communicator(config: EngineConfig, platform: Any, registry: Registry) -> None:
    if config.parallel.tensor_parallel_size == 1:
        return  # a single rank has no collectives
    name = getattr(platform, "communicator", "torch_distributed")
    if name not in registry.device_communicators:
        raise _error("tensor_parallel_size", f"platform {getattr(platform, 'name', platform)!r} uses device "
                     f"communicator {name!r}, which no plugin registers (registered: "
                     f"{_registered(registry.device_communicators)}), so its ranks cannot communicate")


def check_quantization(config: EngineConfig, hf_config: Any, platform: Any) -> None:
    if config.model.quantization is None:
        return
    from sparrow.quantization import get_quantization_method, op_overrides_for

    try:
        method = get_quantization_method(config, hf_config)
    except ValueError as exc:
        raise _error("quantization", str(exc)) from None
    assert method is not None  # quantization is set
    method.check_config(config)
    # What each worker will ask for, asked here first: a broken method fails before start-up.
    try:
        op_overrides_for(config, getattr(platform, "name", str(platform)), hf_config)
    except ConfigError:
        raise
    except ValueError as exc:
        raise _error("quantization", str(exc)) from None


def check_platform_settings(config: EngineConfig, platform: Any, hf_config: Any) -> None:
    try:
        platform.resolve_dtype(config.model.dtype)
    except ValueError as exc:
        raise _error("dtype", str(exc)) from None
    kv_cache_dtype = config.cache.kv_cache_dtype
    supported_kv = getattr(platform, "supported_kv_cache_dtypes", ("auto",))
    if kv_cache_dtype not in supported_kv:
        raise _error("kv_cache_dtype", f"{kv_cache_dtype!r} is not supported on platform "
                     f"{getattr(platform, 'name', platform)!r}; supported: {', '.join(supported_kv)}")
    requested = config.device.attention_backend
    if requested == "auto":
        return
    # The same question the worker asks at start-up, asked here first. Only a refusal (ValueError,
    # or no plugin answering) is the user's error; anything else is left for the worker to report.
    try:
        backend = get_plugin_manager().hook.sparrow_attention_backend(
            platform=platform, requested=requested, model_config=hf_config)
    except ValueError as exc:
        raise _error("attention_backend", str(exc)) from None
    except Exception as exc:  # noqa: BLE001 - see above
        logger.debug("attention backend %r could not be checked before start-up: %r", requested, exc)
        return
    backend = check_attention_backend(get_plugin_manager(), backend)
    if backend is None:
        raise _error("attention_backend", f"no plugin offers attention backend {requested!r} for platform "
                     f"{getattr(platform, 'name', platform)!r}")
    if kv_cache_dtype != "auto" and kv_cache_dtype not in getattr(backend, "supported_kv_cache_dtypes", ("auto",)):
        raise _error("kv_cache_dtype", f"{kv_cache_dtype!r} is not supported by attention backend {requested!r}")


def check_speculative(config: EngineConfig, hf_config: Any) -> None:
    from sparrow.spec_decode.config import MODEL_METHODS, check_against_target

    spec_config = config.speculative.speculative_config
    if spec_config is not None and config.model.enable_prompt_embeds:
        raise _error("enable_prompt_embeds", "is not supported with speculative decoding (speculative_config): "
                     "drafts are proposed from token ids, which a prompt given as embeddings does not have")
    try:
        check_against_target(spec_config, hf_config, config.model.tokenizer)
    except ValueError as exc:
        raise _error("speculative_config", str(exc)) from None
    if spec_config is not None and spec_config.get("method") in MODEL_METHODS:
        # A draft model or head is split over the same ranks as the target.
        draft = types.SimpleNamespace(**json.loads((Path(spec_config["model"]) / "config.json").read_text()))
        problem = tp_split_problem(config.parallel.tensor_parallel_size, draft, "draft model")
        if problem is not None:
            raise _error("tensor_parallel_size", f"{problem} (speculative_config.model {spec_config['model']!r})")


def check_lora(config: EngineConfig, hf_config: Any) -> None:
    from sparrow.lora.engine import check_lora_config

    problem = check_lora_config(config, hf_config)
    if problem is not None:
        raise _error(*problem)


# -- numbers --------------------------------------------------------------------------------------
def check_budgets(config: EngineConfig) -> None:
    max_model_len = config.model.max_model_len or 0
    if max_model_len < 2:
        raise _error("max_model_len", f"must be at least 2 (one prompt and one output token), got {max_model_len}")
    if config.scheduler.async_scheduling:
        problem = async_scheduling_problem(config)
        if problem is not None:
            raise _error("async_scheduling", f"is not supported with this configuration: {problem}")
    budget = config.scheduler.max_num_batched_tokens
    if budget is not None and not config.scheduler.enable_chunked_prefill and budget < max_model_len:
        # A prompt is then computed in one step: one longer than the budget could never run.
        raise _error("max_num_batched_tokens", f"{budget} is smaller than max_model_len={max_model_len} with "
                     "enable_chunked_prefill=False, so longer prompts could never be scheduled; raise "
                     "max_num_batched_tokens, lower max_model_len or enable chunked prefill")


def check_architecture(hf_config: Any, registry: Any) -> None:
    """A registered model class serves the checkpoint (before any process starts to load it)."""
    from sparrow.model_loader import architectures as registered
    from sparrow.models.registry import registered_architecture, unsupported_message

    architectures = registered(registry)
    if registered_architecture(hf_config, architectures) is None:
        raise _error("model", unsupported_message(hf_config, architectures))


# -- all of it ------------------------------------------------------------------------------------
def check_engine_config(config: EngineConfig, hf_config: Any = None, platform: Any = None) -> None:
    """Raise ConfigError, naming the field, for a configuration the engine could never start or run.

    ``config`` is finalized (``sparrow.engine.setup.finalize_config``, which calls this); ``hf_config``
    and ``platform`` save reading them again when the caller has them. Starts no process and loads
    no model, so a server can call it before anything else.
    """
    model = config.model.model
    if model is None:
        raise _error("model", "is not resolved; call sparrow.engine.setup.finalize_config first")
    load_plugin_files(config)
    registry = get_registry()
    check_model_dir(model)
    check_plugin_names(config, registry)
    skip_tokenizer = config.model.skip_tokenizer_init
    check_model_files(model, None if skip_tokenizer else config.model.tokenizer, config.load.load_format, registry,
                      check_tokenizer=not skip_tokenizer)
    if skip_tokenizer and config.model.reasoning_parser is not None:
        raise _error("reasoning_parser", f"{config.model.reasoning_parser!r} reads the tokenizer's tokens; "
                     "not with skip_tokenizer_init=True")
    if not skip_tokenizer:
        check_tokenizer_mode(config)
    if hf_config is None:
        from sparrow.model_loader import model_hf_config

        hf_config = model_hf_config(config.model)
    check_architecture(hf_config, registry)
    check_classifier_tokens(config, hf_config)
    if platform is None:
        platform = resolve_configured_platform(config.device.device, registry)
    check_platform_settings(config, platform, hf_config)
    check_communicator(config, platform, registry)
    if config.parallel.worker_extension_cls:
        from sparrow.executor.worker_extension import check_worker_extension

        try:
            check_worker_extension(config.parallel.worker_extension_cls, platform.worker_cls)
        except ValueError as exc:
            raise _error("worker_extension_cls", str(exc)) from None
    check_quantization(config, hf_config, platform)
    check_speculative(config, hf_config)
    check_budgets(config)
    check_parallel(config, hf_config)
    check_lora(config, hf_config)
    if config.model.runner == "pooling":
        from sparrow.pooling import pooling_problems

        if not getattr(platform, "supports_pooling", True):
            raise _error("runner", f"'pooling' is not supported on the {platform.name!r} platform (its workers do "
                         "not run pooling models)")
        for field, message in pooling_problems(config):
            raise _error(field, message)


def check_classifier_tokens(config: EngineConfig, hf_config: Any) -> None:
    """A causal LM converted into a classifier (classifier_from_token): its tokens are in the
    vocabulary, which the workers read to build the score layer (sparrow.pooling_convert)."""
    from sparrow.pooling_convert import classifier_token_ids, conversion_method, tokenizer_for

    if conversion_method(hf_config) is None:
        return
    if config.model.skip_tokenizer_init:
        raise _error("skip_tokenizer_init", "cannot be True with hf_overrides classifier_from_token: the score layer "
                     "is built from the rows of those tokens, which the tokenizer names")
    classifier_token_ids(tokenizer_for(config.model), list(hf_config.classifier_from_token))


def async_scheduling_problem(config: EngineConfig) -> str | None:
    """Why ``config`` cannot overlap scheduling with the running step, or None."""
    if config.speculative.speculative_config is not None:
        return "speculative decoding needs each step's accepted tokens before it schedules the next drafts"
    if config.kv_transfer.kv_connector is not None:
        return "a KV connector loads and saves KV around each step in turn"
    if config.model.runner == "pooling":
        return "a pooling request ends with its prompt's last step, which the next step's schedule must see"
    return None
