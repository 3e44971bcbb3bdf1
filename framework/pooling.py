"""Pooling (embedding) models: which runner a model gets, and how its pooler is configured.

An engine runs ``runner="generate"`` (text) or ``runner="pooling"`` (one vector per prompt,
vLLM's embedding models). ``auto`` picks pooling for a checkpoint whose architecture is a bare
encoder (``Qwen3Model``, ``*EmbeddingModel``, ``*ForTextEncoding``, as ``AutoModel`` saves it)
and generate for ``*ForCausalLM``; ``runner="pooling"`` (or vLLM's ``convert="embed"``, or the
older ``task="embed"``) runs a ``*ForCausalLM`` checkpoint such as Qwen3-Embedding as an
embedding model, its LM head unused.

The pooler (``pooler_config``): ``pooling_type`` LAST (the last prompt token's final hidden
state), MEAN (the mean over the prompt) or CLS (the first token's), and ``normalize`` (L2).
Defaults, as vLLM's: the model directory's sentence-transformers files (``modules.json``, the
``1_Pooling/config.json`` mode and a ``Normalize`` module), else LAST with normalize. Pure Python
and files only: the worker's pooling is ``sparrow.worker.pooler``.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

POOLING_TYPES = ("LAST", "MEAN", "CLS")
# Architecture names that are encoders without an LM head (vLLM's automatic conversion to embed).
_ENCODER_SUFFIXES = ("EmbeddingModel", "ForTextEncoding", "Model")
# sentence-transformers' 1_Pooling/config.json flags -> our pooling type.
_ST_MODES = {"pooling_mode_lasttoken": "LAST", "pooling_mode_mean_tokens": "MEAN", "pooling_mode_cls_token": "CLS"}
PREFIX_CACHE_SAFE = ("LAST",)


class PoolingConfigError(ValueError):
    """A pooling setting that cannot run; ``field`` is the engine argument it is about (the
    message names it too)."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(message)
        self.field = field


def architecture_is_encoder(hf_config: Any) -> bool:
    architectures = list(getattr(hf_config, "architectures", None) or [])
    return bool(architectures) and architectures[0].endswith(_ENCODER_SUFFIXES) \
        and not architectures[0].endswith(("ForCausalLM", "LMHeadModel"))


def resolve_runner(runner: str, task: str, convert: str, hf_config: Any) -> str:
    """"generate" or "pooling" from vLLM's three ways of saying it (they must agree)."""
    wanted = {name: value for name, value in (
        ("runner", {"auto": None, "generate": "generate", "pooling": "pooling"}[runner]),
        ("task", {"auto": None, "generate": "generate", "embed": "pooling"}[task]),
        ("convert", {"auto": None, "none": None, "embed": "pooling"}[convert]),
    ) if value is not None}
    if len(set(wanted.values())) > 1:
        given = ", ".join(f"{name}={dict(runner=runner, task=task, convert=convert)[name]!r}" for name in wanted)
        raise PoolingConfigError(next(iter(wanted)), f"{given} disagree: a model runs either as a generative model "
                                 "or as a pooling (embedding) one")
    encoder = architecture_is_encoder(hf_config)
    if wanted.get("runner", wanted.get("task")) == "generate" and encoder:
        field = "runner" if "runner" in wanted else "task"
        raise PoolingConfigError(field, f"{field}='generate': architecture {hf_config.architectures[0]} is an encoder "
                                 "saved without its LM head, so it cannot generate text; it runs as runner='pooling'")
    if wanted:
        return next(iter(wanted.values()))
    return "pooling" if encoder else "generate"


def check_pooler_config(value: Any, field: str = "pooler_config") -> dict[str, Any]:
    """A user's pooler_config as {"pooling_type": ..., "normalize": ...} with only the keys given."""
    if not isinstance(value, dict):
        raise PoolingConfigError(field, f"{field} must be a mapping such as {{'pooling_type': 'MEAN', "
                                 f"'normalize': true}}, got {type(value).__name__}")
    checked: dict[str, Any] = {}
    for key, item in value.items():
        if key == "pooling_type":
            if item is None:
                continue
            if not isinstance(item, str) or item.upper() not in POOLING_TYPES:
                raise PoolingConfigError(f"{field}.pooling_type", f"{field}.pooling_type must be one of "
                                         f"{', '.join(POOLING_TYPES)}, got {item!r} (vLLM's ALL and STEP poolers "
                                         "are not supported)")
            checked[key] = item.upper()
        elif key == "normalize":
            if item is None:
                continue
            if not isinstance(item, bool):
                raise PoolingConfigError(f"{field}.normalize", f"{field}.normalize must be true or false, got {item!r}")
            checked[key] = item
        else:
            raise PoolingConfigError(f"{field}.{key}", f"{field}.{key} is not supported (a pooler_config takes "
                                     "pooling_type and normalize; classification, reward and chunked-embedding "
                                     "settings are not built)")
    return checked


def sentence_transformers_pooler(model_dir: str | Path) -> dict[str, Any]:
    """What a sentence-transformers directory says about pooling ({} when it says nothing)."""
    model_dir = Path(model_dir)
    try:
        modules = json.loads((model_dir / "modules.json").read_text())
    except (OSError, ValueError):
        return {}
    if not isinstance(modules, list):
        return {}
    found: dict[str, Any] = {}
    for module in modules:
        if not isinstance(module, dict):
            continue
        kind = str(module.get("type", ""))
        if kind.endswith(".Normalize"):
            found["normalize"] = True
        elif kind.endswith(".Pooling"):
            try:
                settings = json.loads((model_dir / str(module.get("path", "")) / "config.json").read_text())
            except (OSError, ValueError):
                continue
            modes = [mode for flag, mode in _ST_MODES.items() if isinstance(settings, dict) and settings.get(flag)]
            if len(modes) == 1:
                found["pooling_type"] = modes[0]
    if found:
        found.setdefault("normalize", False)  # a sentence-transformers model without Normalize is not normalized
    return found


def resolve_pooler_config(given: dict[str, Any] | None, model_dir: str | Path) -> dict[str, Any]:
    """The whole pooler: the user's keys over the directory's sentence-transformers files over
    vLLM's default for embedding (LAST, normalized)."""
    resolved: dict[str, Any] = {"pooling_type": "LAST", "normalize": True}
    resolved.update(sentence_transformers_pooler(model_dir))
    resolved.update(check_pooler_config(given or {}))
    return resolved


def matryoshka_dimensions(hf_config: Any) -> list[int] | None:
    """The output sizes a Matryoshka model was trained for ([] when any size is allowed), or None
    when the model does not declare itself one (``dimensions`` is refused then, as in vLLM)."""
    dimensions = getattr(hf_config, "matryoshka_dimensions", None)
    if dimensions:
        return [int(value) for value in dimensions]
    return [] if getattr(hf_config, "is_matryoshka", False) else None


def pooling_problems(config: Any) -> list[tuple[str, str]]:
    """(field, reason) for each setting a pooling engine cannot honour (empty: none)."""
    problems = []
    pooler = config.model.pooler_config or {}
    if config.cache.enable_prefix_caching and pooler.get("pooling_type") not in PREFIX_CACHE_SAFE:
        problems.append(("enable_prefix_caching", f"{pooler.get('pooling_type')} pooling reads the hidden state of "
                         "every prompt token, and a prefix-cache hit skips computing them; use LAST pooling or "
                         "enable_prefix_caching=False"))
    for field, value, reason in (
        ("speculative_config", config.speculative.speculative_config, "a pooling model generates no tokens"),
        ("reasoning_parser", config.model.reasoning_parser, "a pooling model generates no text to parse"),
        ("kv_connector", config.kv_transfer.kv_connector, "KV connectors are not supported on pooling models"),
    ):
        if value:
            problems.append((field, f"is not supported with runner='pooling': {reason}"))
    return problems
