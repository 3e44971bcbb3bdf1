"""Turning user arguments into a complete engine configuration (frontend side)."""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from sparrow.config import ConfigError, EngineConfig
from sparrow.engine.preflight import (
    apply_platform_config,
    async_scheduling_problem,
    check_engine_config,
    check_model_dir,
    check_plugin_names,
    load_plugin_files,
    resolve_configured_platform,
)
from sparrow.hub_cache import resolve_hub_id  # spec_decode.config imports it from here
from sparrow.plugins import get_registry
from sparrow.pooling import PREFIX_CACHE_SAFE, PoolingConfigError, resolve_pooler_config, resolve_runner

logger = logging.getLogger(__name__)

BUILTIN_MODELS = ("sparrow-tiny",)


def resolve_model_path(model: str | None, revision: str | None = None, download_dir: str | None = None) -> str:
    """A local model directory; None or a built-in name builds the built-in model on first use;
    a Hub id (``org/name``) that is not a local path is its snapshot in the Hugging Face cache,
    if it is there (nothing is downloaded): ``revision`` and ``download_dir`` (the cache) choose it."""
    if model is None or model in BUILTIN_MODELS:
        for field, value in (("revision", revision), ("download_dir", download_dir)):
            if value is not None:
                raise ConfigError(f"invalid engine argument {field!r}: the built-in {model or 'sparrow-tiny'} is "
                                  "built locally; it applies to a Hub id in the Hugging Face cache")
        from sparrow.tiny.model import get_builtin_model_path

        return str(get_builtin_model_path(model or "sparrow-tiny"))
    if download_dir is not None and Path(model).expanduser().exists():
        raise ConfigError(f"invalid engine argument 'download_dir': {model!r} is a local path; download_dir is the "
                          "Hugging Face cache a Hub id is read from")
    model = resolve_hub_id(model, revision, download_dir)
    try:
        path = check_model_dir(model)
    except ConfigError as exc:
        raise ConfigError(f"{exc}. Built-in: {', '.join(BUILTIN_MODELS)}") from None
    return str(path.resolve())


def _model_limits(model_path: str, trust_remote_code: bool = False, hf_overrides: dict[str, Any] | None = None,
                  disable_sliding_window: bool = False) -> tuple[Any, int]:
    from sparrow.model_loader import get_hf_config, get_max_model_len
    from sparrow.models.windows import layer_sliding_windows

    try:
        hf_config = get_hf_config(model_path, trust_remote_code, hf_overrides)
        model_max = get_max_model_len(hf_config)
        windows = [window for window in layer_sliding_windows(hf_config) if window is not None]
        if disable_sliding_window and windows:  # vLLM's: full attention, the context cut to the window
            model_max = min(model_max, min(windows))
        return hf_config, model_max
    except ConfigError:  # names its own argument (trust_remote_code)
        raise
    except (OSError, ValueError) as exc:
        raise ConfigError(f"invalid engine argument 'model': the config.json of {model_path!r} cannot be "
                          f"used: {exc}") from None


def _check_max_model_len(max_model_len: int, model_max: int, disable_sliding_window: bool = False) -> None:
    if max_model_len > model_max:
        raise ConfigError(
            f"invalid engine argument 'max_model_len': {max_model_len} exceeds the model's maximum {model_max}"
            + (" (its sliding window: disable_sliding_window is set)" if disable_sliding_window else "")
        )


def _pooling_settings(model: Any, hf_config: Any, model_path: str) -> dict[str, Any]:
    """The runner resolved ("generate" or "pooling"; vLLM's task and convert folded into it), a
    pooling model's head as ``convert`` ("embed" or "classify") and its whole pooler_config
    (sparrow.pooling)."""
    try:
        runner, head = resolve_runner(model.runner, model.task, model.convert, hf_config)
        given = model.pooler_config
        if model.override_pooler_config is not None:
            if given is not None and given != model.override_pooler_config:
                raise PoolingConfigError("override_pooler_config", "override_pooler_config (vLLM's older name) and "
                                         "pooler_config disagree; give pooler_config alone")
            given = model.override_pooler_config
        if runner != "pooling" and given is not None:
            raise PoolingConfigError("pooler_config", "pooler_config applies to a pooling model; this one runs "
                                     "as runner='generate' (set runner='pooling' to embed with it)")
        pooler = resolve_pooler_config(given, model_path, head) if runner == "pooling" else None
    except PoolingConfigError as exc:
        raise ConfigError(f"invalid engine argument {exc.field!r}: {exc}") from None
    # Finalized, vLLM's three spellings are one: the runner, and the head as convert.
    return {"runner": runner, "task": "auto", "convert": "auto" if runner == "generate" else head,
            "pooler_config": pooler, "override_pooler_config": None}


def _pooling_io(config: EngineConfig, hf_config: Any) -> Any:
    if config.model.runner != "pooling" or not config.model.pooler_config:
        return None
    from sparrow.engine.pooling_io import PoolingIO

    return PoolingIO(config.model.pooler_config, hf_config, config.model.convert)


def _quantization(requested: str | None, hf_config: Any) -> str | None:
    # A quantized checkpoint names its method in config.json (vLLM's detection).
    from sparrow.quantization import resolve_quantization

    try:
        return resolve_quantization(requested, hf_config)
    except ValueError as exc:
        raise ConfigError(str(exc)) from None


def finalize_config(config: EngineConfig) -> EngineConfig:
    """Fill what the user left to defaults (model path, tokenizer, max_model_len, served name), let
    the platform adjust the configuration (its ``check_and_update_config``), fill the platform's
    defaults it left unset (token budget), then run the pre-flight checks (``check_engine_config``):
    every configuration error is a ConfigError raised here, before any engine process starts. The
    caller's ``config`` is not changed."""
    requested = config.model
    model_path = resolve_model_path(requested.model, requested.revision, requested.download_dir)
    # The tokenizer: its own argument, else the model's id at tokenizer_revision, else the model's path.
    tokenizer_source = requested.tokenizer or (requested.model if requested.tokenizer_revision is not None else None)
    if tokenizer_source is None and requested.tokenizer_revision is not None:
        raise ConfigError("invalid engine argument 'tokenizer_revision': the built-in model's tokenizer is built "
                          "locally; tokenizer_revision applies to a Hub id in the Hugging Face cache")
    tokenizer_path = model_path if tokenizer_source is None else resolve_hub_id(
        tokenizer_source, requested.tokenizer_revision, requested.download_dir, "tokenizer_revision")
    hf_config, model_max = _model_limits(model_path, config.model.trust_remote_code, config.model.hf_overrides,
                                         config.model.disable_sliding_window)
    max_model_len = config.model.max_model_len
    if max_model_len is None:
        max_model_len = model_max
    _check_max_model_len(max_model_len, model_max, config.model.disable_sliding_window)
    model = config.model.model_copy(update={
        "model": model_path,
        "tokenizer": tokenizer_path,
        # Applied: the paths are the snapshots (a second finalize_config must not apply them again).
        "revision": None, "tokenizer_revision": None, "download_dir": None,
        "max_model_len": max_model_len,
        "served_model_name": config.model.served_model_name or (config.model.model or "sparrow-tiny"),
        "quantization": _quantization(config.model.quantization, hf_config),
        **_pooling_settings(config.model, hf_config, model_path),
    })
    # Deep: the platform's hook changes sections in place, and the caller's config must stay as given.
    finalized = config.model_copy(deep=True, update={"model": model})
    load_plugin_files(finalized)
    registry = get_registry()
    # Names are checked before the platform is resolved, so a wrong one is reported as itself.
    check_plugin_names(finalized, registry)
    platform = resolve_configured_platform(finalized.device.device, registry)
    if finalized.device.device == "auto" and getattr(platform, "name", None) in registry.platforms:
        # Every engine process resolves the platform by this name: the one configured here.
        finalized.device.device = platform.name
    finalized = apply_platform_config(finalized, platform)
    if finalized.model.model != model_path:  # the platform pointed at other weights
        finalized.model.model = resolve_model_path(finalized.model.model)
        hf_config, model_max = _model_limits(finalized.model.model, finalized.model.trust_remote_code,
                                            finalized.model.hf_overrides, finalized.model.disable_sliding_window)
    _check_max_model_len(finalized.model.max_model_len or 0, model_max, finalized.model.disable_sliding_window)
    if finalized.scheduler.max_num_batched_tokens is None:
        finalized.scheduler.max_num_batched_tokens = platform.default_max_num_batched_tokens
    if finalized.model.runner == "pooling" and "enable_prefix_caching" not in config.cache.model_fields_set \
            and (finalized.model.pooler_config or {}).get("pooling_type") not in PREFIX_CACHE_SAFE:
        # MEAN and CLS read every prompt token's hidden state: a prefix-cache hit would skip some.
        finalized.cache.enable_prefix_caching = False
    if finalized.scheduler.async_scheduling is None:
        finalized.scheduler.async_scheduling = bool(getattr(platform, "default_async_scheduling", False)) \
            and async_scheduling_problem(finalized) is None
    try:
        check_engine_config(finalized, hf_config=hf_config, platform=platform)
    except BaseException:
        # A check after the tokenizer's (tokenizer_mode "slow" hands it over) failed: no frontend
        # will take the tokenizer, which would otherwise stay in the store for the process's life.
        settings = finalized.model
        drop_handed_tokenizer(settings.tokenizer or str(settings.model), settings.trust_remote_code,
                              settings.tokenizer_mode)
        raise
    return finalized


# A tokenizer the pre-flight loaded (whether tokenizer_mode "slow" can be honoured is only known by
# loading it), handed to the frontend that asks for the same one next instead of loading it twice.
# Taken once: two engines never share a tokenizer object.
_preflight_tokenizers: dict[tuple[str, bool, str], Any] = {}


def hand_over_tokenizer(path: str, trust_remote_code: bool, tokenizer_mode: str, tokenizer: Any) -> None:
    _preflight_tokenizers[(path, bool(trust_remote_code), tokenizer_mode)] = tokenizer


def drop_handed_tokenizer(path: str, trust_remote_code: bool, tokenizer_mode: str) -> None:
    """Forget the pre-flight's tokenizer of these settings, if any: the start-up failed."""
    _preflight_tokenizers.pop((path, bool(trust_remote_code), tokenizer_mode), None)


def frontend_tokenizer(path: str, trust_remote_code: bool = False, tokenizer_mode: str = "auto") -> Any:
    """The pre-flight's tokenizer of these settings if it loaded one (taken), else a new load."""
    handed = _preflight_tokenizers.pop((path, bool(trust_remote_code), tokenizer_mode), None)
    return handed if handed is not None else load_tokenizer(path, trust_remote_code, tokenizer_mode)


def load_tokenizer(path: str, trust_remote_code: bool = False, tokenizer_mode: str = "auto") -> Any:
    """The tokenizer of the local directory ``path`` as the engine arguments ``trust_remote_code``
    and ``tokenizer_mode`` ask, or a ConfigError naming the one that cannot be honoured.

    transformers 5 ignores ``use_fast``: a directory has one tokenizer class, the Rust-backed one
    where there is one. So "slow" gives a Python tokenizer where the directory has one (its only
    class, or the slow class its own code lists first in tokenizer_config.json's auto_map, which
    needs trust_remote_code), and refuses a directory whose tokenizer is only the Rust one rather
    than load that under "slow"."""
    from transformers import AutoTokenizer

    from sparrow.model_loader import remote_code_message

    if tokenizer_mode not in ("auto", "slow"):
        raise ConfigError(f"invalid engine argument 'tokenizer_mode': {tokenizer_mode!r}; expected auto or slow")
    try:
        slow_class = _remote_slow_tokenizer_class(path) if tokenizer_mode == "slow" and trust_remote_code else None
        if slow_class is not None:
            tokenizer = slow_class.from_pretrained(path, local_files_only=True, trust_remote_code=True)
        else:
            # trust_remote_code always a bool: None would make transformers ask on stdin.
            tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True,
                                                      trust_remote_code=bool(trust_remote_code),
                                                      use_fast=tokenizer_mode != "slow")
    except ValueError as exc:
        if trust_remote_code or "trust_remote_code" not in str(exc):
            raise
        raise ConfigError(remote_code_message(f"the tokenizer of {path!r}")) from None
    if tokenizer_mode == "slow" and getattr(tokenizer, "is_fast", False):
        import transformers

        raise ConfigError(
            f"invalid engine argument 'tokenizer_mode': 'slow' needs a Python (slow) tokenizer, and the tokenizer of "
            f"{path!r} is only the Rust-backed {type(tokenizer).__name__}: transformers {transformers.__version__} "
            "ignores use_fast=False and has no slow class for it; use tokenizer_mode 'auto'")
    return tokenizer


def _remote_slow_tokenizer_class(path: str) -> Any:
    """The slow class a directory's own code lists first in tokenizer_config.json's auto_map
    (``"AutoTokenizer": [slow, fast]``), imported; None when it lists none. transformers 5's
    AutoTokenizer always takes the fast one."""
    try:
        auto_map = json.loads((Path(path) / "tokenizer_config.json").read_text()).get("auto_map")
    except (OSError, ValueError, AttributeError):
        return None
    entry = auto_map.get("AutoTokenizer") if isinstance(auto_map, dict) else auto_map  # a list: the legacy form
    if not isinstance(entry, (list, tuple)) or not entry or not isinstance(entry[0], str):
        return None
    from transformers.dynamic_module_utils import get_class_from_dynamic_module

    return get_class_from_dynamic_module(entry[0], path, local_files_only=True)


def model_eos_token_ids(model_dir: str) -> list[int]:
    """eos ids from generation_config.json (falling back to config.json)."""
    for name in ("generation_config.json", "config.json"):
        path = Path(model_dir) / name
        if path.is_file():
            value = json.loads(path.read_text()).get("eos_token_id")
            if value is not None:
                return [value] if isinstance(value, int) else list(value)
    return []


@dataclass(slots=True)
class Frontend:
    """What LLMEngine and AsyncLLM build the same way from a finalized configuration."""

    tokenizer: Any
    hf_config: Any
    input_processor: Any
    output_processor: Any
    # SamplingParams keywords for parameters a request leaves unset (sparrow.engine.generation_defaults)
    default_sampling_params: dict[str, Any]


def build_frontend(config: EngineConfig) -> Frontend:
    from sparrow.engine.input_processor import InputProcessor
    from sparrow.engine.output_processor import OutputProcessor
    from sparrow.model_loader import model_hf_config

    model_dir = config.model.model
    tokenizer = None if config.model.skip_tokenizer_init else frontend_tokenizer(
        config.model.tokenizer, config.model.trust_remote_code, config.model.tokenizer_mode)
    hf_config = model_hf_config(config.model)
    processor_classes = []
    if config.model.logits_processors:  # checked by the pre-flight; the built-ins need no validation
        from sparrow.sample.logits_processor.load import enabled_classes

        processor_classes = enabled_classes(config.model.logits_processors)
    from sparrow.plugins import get_registry, resolve_parser

    scheduler = config.scheduler.scheduler
    scheduler_cls = resolve_parser("scheduler", scheduler, get_registry().schedulers)
    input_processor = InputProcessor(tokenizer, max_model_len=config.model.max_model_len,
                                     vocab_size=hf_config.vocab_size, eos_token_ids=model_eos_token_ids(model_dir),
                                     max_logprobs=(hf_config.vocab_size if config.model.max_logprobs == -1
                                                   else config.model.max_logprobs),
                                     logits_processor_classes=processor_classes,
                                     scheduler=None if getattr(scheduler_cls, "uses_priority", False) else scheduler,
                                     pooling=_pooling_io(config, hf_config),
                                     prompt_embeds_hidden_size=(
                                         hf_config.hidden_size if config.model.enable_prompt_embeds else None))
    if config.model.reasoning_parser is not None:
        # Built once here, before any engine process starts, so that a tokenizer without the
        # parser's tokens is a ConfigError now rather than a failure of the first request using it;
        # the input processor keeps it for the markers of thinking_token_budget.
        parser_cls = resolve_parser("reasoning_parser", config.model.reasoning_parser,
                                    get_registry().reasoning_parsers)
        try:
            input_processor.reasoning_parser = parser_cls(tokenizer)
        except ValueError as exc:
            message = str(exc).removeprefix("reasoning_parser: ")
            raise ConfigError(f"invalid engine argument 'reasoning_parser': {config.model.reasoning_parser!r} "
                              f"cannot work with the tokenizer of {config.model.tokenizer!r}: {message}") from None
    from sparrow.engine.generation_defaults import generation_defaults

    output_processor = OutputProcessor(tokenizer, input_processor.pooling, config.scheduler.stream_interval)
    return Frontend(tokenizer, hf_config, input_processor, output_processor, generation_defaults(config.model))
