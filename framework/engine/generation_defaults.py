"""Default sampling parameters from the model's ``generation_config.json`` (vLLM's
``generation_config`` and ``override_generation_config`` engine arguments).

Model authors ship recommended sampling settings (Qwen3: temperature 0.6, top_k 20, top_p 0.95);
vLLM uses them wherever a request leaves a parameter unset, and so does Sparrow:

- ``LLM.generate`` / ``LLM.chat`` / ``AsyncLLM.generate`` with ``sampling_params=None`` use
  ``SamplingParams(**defaults)`` (``LLM.get_default_sampling_params()``); a ``SamplingParams`` the
  caller built is used as it is.
- The OpenAI server fills each of temperature, top_p, top_k, min_p and repetition_penalty a request
  omits from the defaults, and max_tokens where the request has none; a ``max_new_tokens`` in
  ``override_generation_config`` caps every request's max_tokens (``server_max_tokens_cap``).

Only those six fields are read (``max_new_tokens`` becomes ``max_tokens``); ``do_sample: false``
does not make requests greedy, as in vLLM. ``generation_config="vllm"`` ignores the file.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

from sparrow.config import ConfigError, ModelConfig

logger = logging.getLogger(__name__)

GENERATION_CONFIG_FILE = "generation_config.json"
# generation_config.json key -> SamplingParams field
SAMPLING_KEYS = {
    "temperature": "temperature",
    "top_p": "top_p",
    "top_k": "top_k",
    "min_p": "min_p",
    "repetition_penalty": "repetition_penalty",
    "max_new_tokens": "max_tokens",
}


def _read_file(directory: str, field: str) -> dict[str, Any]:
    path = Path(directory).expanduser() / GENERATION_CONFIG_FILE
    if not path.is_file():
        if field == "model":  # a model directory need not have one
            return {}
        raise ConfigError(f"invalid engine argument 'generation_config': {directory!r} has no "
                          f"{GENERATION_CONFIG_FILE} (use 'auto' for the model's, 'vllm' for none, or a directory "
                          "holding one)")
    try:
        values = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ConfigError(f"invalid engine argument '{'generation_config' if field != 'model' else 'model'}': "
                          f"{str(path)!r} cannot be read as JSON: {exc}") from None
    if not isinstance(values, dict):
        raise ConfigError(f"invalid engine argument 'generation_config': {str(path)!r} holds a "
                          f"{type(values).__name__}, not a JSON object")
    return {key: value for key, value in values.items() if key in SAMPLING_KEYS and value is not None}


def _check(values: dict[str, Any], argument: str, source: str) -> dict[str, Any]:
    """``values`` as SamplingParams keywords, or ConfigError naming ``argument`` if they are invalid."""
    from sparrow.sampling_params import SamplingParams

    defaults = {SAMPLING_KEYS[key]: value for key, value in values.items() if value is not None}
    try:
        SamplingParams(**defaults)
    except (TypeError, ValueError) as exc:
        where = f" (generation_config={source!r})" if argument == "generation_config" else ""
        raise ConfigError(f"invalid engine argument {argument!r}: the default sampling parameters {defaults}{where} "
                          f"are invalid: {exc}") from None
    return defaults


def generation_defaults(model: ModelConfig) -> dict[str, Any]:
    """The ``SamplingParams`` keywords a request's unset parameters default to, for a finalized
    model section (``model.model`` is a local directory). ConfigError naming the argument when the
    file, an override or a resulting value is invalid."""
    source = model.generation_config
    if source == "vllm":
        values: dict[str, Any] = {}
    elif source == "auto":
        values = _read_file(str(model.model), "model")
    else:
        values = _read_file(source, "generation_config")
    _check(values, "generation_config", source)
    for key, value in model.override_generation_config.items():
        if key not in SAMPLING_KEYS:
            raise ConfigError(f"invalid engine argument 'override_generation_config': key {key!r} is not a "
                              f"sampling default; allowed: {', '.join(SAMPLING_KEYS)}")
        values[key] = value
    defaults = _check(values, "override_generation_config", source)
    if defaults:
        logger.info("default sampling parameters from the generation config: %s (generation_config=%r; pass "
                    "generation_config='vllm' to use the neutral defaults)", defaults, source)
    return defaults


def server_max_tokens_cap(model: ModelConfig, defaults: dict[str, Any]) -> int | None:
    """The server's cap on every request's max_tokens (vLLM's ``override_max_tokens``): the
    ``max_new_tokens`` of ``override_generation_config``, or, when ``generation_config`` names a
    directory, that file's; None when neither sets one."""
    if model.generation_config in ("auto", "vllm"):
        return model.override_generation_config.get("max_new_tokens")
    return defaults.get("max_tokens")
