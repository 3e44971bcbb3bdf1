"""Pooling models: which runner a model gets, which head it pools into, and how its pooler is configured.

An engine runs ``runner="generate"`` (text) or ``runner="pooling"`` (one vector per prompt).
``auto`` picks pooling for a checkpoint whose architecture is a bare encoder (``Qwen3Model``,
``*EmbeddingModel``, ``*ForTextEncoding``, as ``AutoModel`` saves it) or a classifier
(``*ForSequenceClassification``, ``*ForTokenClassification``), and generate for
``*ForCausalLM``; ``runner="pooling"`` (or vLLM's ``convert="embed"``, or the older
``task="embed"``) runs a ``*ForCausalLM`` checkpoint such as Qwen3-Embedding as an embedding
model, its LM head unused.

A pooling engine's head (finalized as ``convert``): ``embed`` (the pooled hidden state is the
vector) or ``classify`` (the checkpoint's ``score`` layer maps it to ``num_labels`` logits:
``LLM.classify``, and cross-encoder ``LLM.score`` / rerank when ``num_labels`` is 1). A request
may ask for every prompt token's vector instead (``token_embed``, ``token_classify``: vLLM's
token-level tasks, a token classifier's only one; ``LLM.reward``).

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
CLASSIFIER_SUFFIX = "ForSequenceClassification"
# A token classifier: the same score layer, read at every token (its only task is token_classify).
TOKEN_CLASSIFIER_SUFFIX = "ForTokenClassification"
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


def architecture_is_classifier(hf_config: Any) -> bool:
    """A sequence or a token classifier: a checkpoint with a ``score`` layer."""
    architectures = list(getattr(hf_config, "architectures", None) or [])
    return bool(architectures) and architectures[0].endswith((CLASSIFIER_SUFFIX, TOKEN_CLASSIFIER_SUFFIX))


def architecture_is_token_classifier(hf_config: Any) -> bool:
    architectures = list(getattr(hf_config, "architectures", None) or [])
    return bool(architectures) and architectures[0].endswith(TOKEN_CLASSIFIER_SUFFIX)


# What each of vLLM's three spellings asks for: (runner, head), None where it says nothing.
_SPELLINGS: dict[str, dict[str, tuple[str | None, str | None]]] = {
    "runner": {"auto": (None, None), "generate": ("generate", None), "pooling": ("pooling", None)},
    "task": {"auto": (None, None), "generate": ("generate", None), "embed": ("pooling", "embed"),
             "classify": ("pooling", "classify"), "score": ("pooling", "classify")},
    "convert": {"auto": (None, None), "none": (None, None), "embed": ("pooling", "embed"),
                "classify": ("pooling", "classify")},
}


def resolve_runner(runner: str, task: str, convert: str, hf_config: Any) -> tuple[str, str]:
    """(runner, head) from vLLM's three ways of saying it (they must agree): runner "generate" or
    "pooling"; head "none" for a generative model, else "embed" or "classify"."""
    given = {"runner": runner, "task": task, "convert": convert}
    asked = {name: _SPELLINGS[name][value] for name, value in given.items()}
    for index in (0, 1):  # the runners, then the heads
        wanted = {name: kinds[index] for name, kinds in asked.items() if kinds[index] is not None}
        if len(set(wanted.values())) > 1:
            said = ", ".join(f"{name}={given[name]!r}" for name in wanted)
            raise PoolingConfigError(next(iter(wanted)), f"{said} disagree: a model runs either as a generative "
                                     "model or as a pooling one, with one head (embed or classify)")
    runners = {name: kinds[0] for name, kinds in asked.items() if kinds[0] is not None}
    heads = {name: kinds[1] for name, kinds in asked.items() if kinds[1] is not None}
    classifier = architecture_is_classifier(hf_config)
    encoder = classifier or architecture_is_encoder(hf_config)
    if "generate" in runners.values() and encoder:
        field = next(iter(runners))
        kind = "a classifier" if classifier else "an encoder saved without its LM head"
        raise PoolingConfigError(field, f"{field}={given[field]!r}: architecture {hf_config.architectures[0]} is "
                                 f"{kind}, so it cannot generate text; it runs as runner='pooling'")
    resolved_runner = next(iter(runners.values())) if runners else ("pooling" if encoder else "generate")
    if resolved_runner == "generate":
        return "generate", "none"
    head = next(iter(heads.values())) if heads else ("classify" if classifier else "embed")
    if head == "classify" and not classifier:
        field = next(iter(heads))
        architecture = (list(getattr(hf_config, "architectures", None) or []) or ["(none)"])[0]
        raise PoolingConfigError(field, f"{field}={given[field]!r} needs a sequence-classification checkpoint "
                                 f"(architecture *{CLASSIFIER_SUFFIX} or *{TOKEN_CLASSIFIER_SUFFIX}, with a score "
                                 f"layer); {architecture} has none: to run a causal LM as a classifier from "
                                 "its LM head's rows (LLM rerankers such as Qwen3-Reranker), set hf_overrides "
                                 "architectures to its *ForSequenceClassification name with classifier_from_token "
                                 "and method (docs/user-guide.md)")
    return "pooling", head


def num_labels(hf_config: Any) -> int:
    """A classifier's number of outputs (config.json ``num_labels`` / ``id2label``)."""
    return int(getattr(hf_config, "num_labels", 2) or 2)


_ST_ACTIVATIONS = {"torch.nn.modules.linear.Identity": "identity", "torch.nn.modules.activation.Sigmoid": None,
                   "torch.nn.modules.activation.Softmax": None}


def classifier_activation(hf_config: Any, task: str) -> str:
    """"softmax", "sigmoid" or "identity": what turns a classifier's logits into its output, as
    vLLM decides it. ``classify`` follows transformers' loss for ``problem_type`` (regression:
    identity; multi-label: sigmoid; otherwise softmax, or sigmoid for a single label);
    ``score`` (a cross-encoder) first reads sentence-transformers' ``activation_fn``. Raises
    ValueError for an activation it does not know."""
    if task == "score":
        st = getattr(hf_config, "sentence_transformers", None)
        name = st.get("activation_fn") if isinstance(st, dict) else None
        name = name or getattr(hf_config, "sbert_ce_default_activation_function", None)
        if name:
            if name not in _ST_ACTIVATIONS:
                raise ValueError(f"the model's cross-encoder activation_fn {name!r} is not supported (one of "
                                 f"{', '.join(_ST_ACTIVATIONS)})")
            chosen = _ST_ACTIVATIONS[name]
            if chosen is not None:
                return chosen
    problem_type = getattr(hf_config, "problem_type", None) or ""
    if problem_type == "regression":
        return "identity"
    if problem_type == "multi_label_classification":
        return "sigmoid"
    return "sigmoid" if num_labels(hf_config) < 2 else "softmax"


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
        elif key in ("normalize", "use_activation"):
            if item is None:
                continue
            if not isinstance(item, bool):
                raise PoolingConfigError(f"{field}.{key}", f"{field}.{key} must be true or false, got {item!r}")
            checked[key] = item
        else:
            raise PoolingConfigError(f"{field}.{key}", f"{field}.{key} is not supported (a pooler_config takes "
                                     "pooling_type, normalize (embedding) and use_activation (classification); "
                                     "reward, step and chunked-embedding settings are not built)")
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


def resolve_pooler_config(given: dict[str, Any] | None, model_dir: str | Path, head: str = "embed") -> dict[str, Any]:
    """The whole pooler: the user's keys over the directory's sentence-transformers files over
    vLLM's defaults (embed: LAST, normalized; classify: LAST, with the activation on)."""
    given = check_pooler_config(given or {})
    wrong = "use_activation" if head == "embed" else "normalize"
    if wrong in given:
        applies = "a classifier's outputs (convert='classify')" if head == "embed" else "embedding vectors"
        raise PoolingConfigError(f"pooler_config.{wrong}", f"pooler_config.{wrong} applies to {applies}; this "
                                 f"model's head is {head!r}")
    if head == "classify":
        return {"pooling_type": "LAST", "use_activation": True, **given}
    resolved: dict[str, Any] = {"pooling_type": "LAST", "normalize": True}
    resolved.update(sentence_transformers_pooler(model_dir))
    resolved.update(given)
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
