"""``speculative_config``: vLLM's dictionary, validated here with errors that name the field.

    LLM(..., speculative_config={"method": "ngram", "num_speculative_tokens": 4,
                                 "prompt_lookup_max": 4, "prompt_lookup_min": 1})
    LLM(..., speculative_config={"method": "draft_model", "model": DRAFT_DIR, "num_speculative_tokens": 4})
    LLM(..., speculative_config={"method": "eagle", "model": EAGLE_HEAD_DIR, "num_speculative_tokens": 4})

Pure Python (pydantic only): the engine configuration validates it in the frontend, before any
engine process starts.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError

# vLLM's methods that Sparrow does not implement yet: refused by name rather than as unknown.
NOT_IMPLEMENTED_METHODS = ("eagle3", "medusa", "mlp_speculator", "mtp")
BUILTIN_METHODS = ("ngram", "draft_model", "eagle")
# Methods whose proposer loads ``speculative_config.model``.
MODEL_METHODS = ("draft_model", "eagle")
# config.json architectures of EAGLE-1 heads (vLLM's names): sparrow.spec_decode.eagle.
EAGLE_ARCHITECTURES = ("EagleLlamaForCausalLM", "EAGLEModel")
# vLLM's default lookup window when neither bound is given.
DEFAULT_PROMPT_LOOKUP = 5


class SpeculativeConfig(BaseModel):
    """The validated settings; every proposer gets this object."""

    model_config = ConfigDict(extra="forbid", frozen=True, protected_namespaces=())

    method: str = Field(description="Which proposer guesses the drafts: ngram, draft_model, eagle, or a plugin's.")
    num_speculative_tokens: int = Field(gt=0, description="Draft tokens proposed per request per step (k).")
    prompt_lookup_max: int | None = Field(None, gt=0, description="ngram: the longest n-gram looked up.")
    prompt_lookup_min: int | None = Field(None, gt=0, description="ngram: the shortest n-gram looked up.")
    model: str | None = Field(None, description="Draft model or head directory (methods that use one).")


def parse_speculative_config(value: Any) -> dict[str, Any] | None:
    """Validate ``speculative_config`` (a dict, a SpeculativeConfig or None) and return it as a
    plain dict with the defaults filled in; ValueError naming ``speculative_config.<field>``."""
    if value is None:
        return None
    if isinstance(value, SpeculativeConfig):
        value = value.model_dump()
    if not isinstance(value, dict):
        raise ValueError(f"speculative_config must be a dict such as {{'method': 'ngram', "
                         f"'num_speculative_tokens': 4}}, got {type(value).__name__}")
    if "method" not in value:
        raise ValueError("speculative_config.method is required (ngram, draft_model, eagle, or a plugin's method)")
    method = value["method"]
    if not isinstance(method, str) or not method:
        raise ValueError(f"speculative_config.method must be a non-empty string, got {method!r}")
    if method in NOT_IMPLEMENTED_METHODS:
        raise ValueError(f"speculative_config.method {method!r} is not implemented in Sparrow yet; "
                         f"available: {', '.join(available_methods())}")
    if method not in BUILTIN_METHODS and method not in available_methods():
        raise ValueError(f"speculative_config.method {method!r} is unknown; available: "
                         f"{', '.join(available_methods())}")
    if "num_speculative_tokens" not in value:
        raise ValueError("speculative_config.num_speculative_tokens is required (the drafts per step, >= 1)")
    try:
        config = SpeculativeConfig(**value)
    except ValidationError as exc:
        err = exc.errors()[0]
        field = ".".join(str(part) for part in err["loc"])
        raise ValueError(f"speculative_config.{field}: {err['msg']} (got {err.get('input')!r})") from None
    if method == "ngram":
        config = _ngram_defaults(config)
    elif method in MODEL_METHODS:
        config = config.model_copy(update={"model": str(_check_model_dir(method, config.model))})
    return config.model_dump()


def _read_config_json(model_dir: str | Path) -> dict[str, Any]:
    try:
        data = json.loads((Path(model_dir) / "config.json").read_text())
    except (OSError, ValueError) as exc:
        raise ValueError(f"speculative_config.model: cannot read {str(model_dir)!r}/config.json: {exc}") from None
    if not isinstance(data, dict):
        raise ValueError(f"speculative_config.model: {str(model_dir)!r}/config.json is not a JSON object")
    return data


def _check_model_dir(method: str, model: str | None) -> Path:
    """The draft model or head directory as an absolute path: it exists, has a config.json, and
    its architecture is one the method can load."""
    what = "draft model" if method == "draft_model" else "EAGLE head"
    if not model:
        raise ValueError(f"speculative_config.model is required for method {method!r} (the {what} directory)")
    from sparrow.engine.setup import resolve_hub_id

    path = Path(resolve_hub_id(model)).expanduser()  # a Hub id: its snapshot in the Hugging Face cache
    if not path.is_dir():
        raise ValueError(f"speculative_config.model: {model!r} is not a directory (the {what}'s local "
                         "Hugging Face directory, or a Hub id already in the Hugging Face cache; Sparrow never "
                         "downloads models)")
    if not (path / "config.json").is_file():
        raise ValueError(f"speculative_config.model: {model!r} has no config.json")
    architectures = list(_read_config_json(path).get("architectures") or [])
    if method == "eagle":
        supported: list[str] = list(EAGLE_ARCHITECTURES)
    else:
        from sparrow.model_registry import ModelRegistry

        supported = ModelRegistry.get_supported_archs()
    if not any(architecture in supported for architecture in architectures):
        raise ValueError(f"speculative_config.model: the {what}'s architectures {architectures} are not "
                         f"supported; supported: {', '.join(supported)}")
    return path.resolve()


def check_against_target(spec_config: dict[str, Any] | None, target_config: Any, tokenizer_dir: str | None) -> None:
    """The draft model or head fits the target (``target_config``: its transformers config): the
    same vocabulary size, the same tokenizer vocabulary where both directories hold a
    tokenizer.json, and for EAGLE the target's hidden size. ValueError naming
    ``speculative_config.model``; the frontend's pre-flight checks run it."""
    if spec_config is None or spec_config.get("method") not in MODEL_METHODS:
        return
    model = spec_config["model"]
    draft = _read_config_json(model)
    target_vocab = getattr(target_config, "vocab_size", None)
    if draft.get("vocab_size") != target_vocab:
        raise ValueError(f"speculative_config.model: {model!r} has vocab_size {draft.get('vocab_size')}, the "
                         f"target model {target_vocab}; the draft must share the target's vocabulary")
    if spec_config["method"] == "eagle":
        hidden = getattr(target_config, "hidden_size", None)
        if draft.get("hidden_size") != hidden:
            raise ValueError(f"speculative_config.model: the EAGLE head {model!r} has hidden_size "
                             f"{draft.get('hidden_size')}, the target {hidden}; the head reads the target's "
                             "hidden states")
    if tokenizer_dir is None:
        return
    draft_vocab = _tokenizer_vocab(model)
    target_tokens = _tokenizer_vocab(tokenizer_dir)
    if draft_vocab is not None and target_tokens is not None and draft_vocab != target_tokens:
        raise ValueError(f"speculative_config.model: the tokenizer of {model!r} differs from the target's "
                         f"({tokenizer_dir!r}); the draft must share the target's vocabulary")


def _tokenizer_vocab(directory: str | Path) -> Any:
    """The token -> id table and added tokens of ``directory``/tokenizer.json (None: no such file,
    so the vocabulary size is all that is compared)."""
    try:
        data = json.loads((Path(directory) / "tokenizer.json").read_text())
    except (OSError, ValueError):
        return None
    added = sorted((token.get("id"), token.get("content")) for token in data.get("added_tokens") or [])
    return (data.get("model") or {}).get("vocab"), added


def _ngram_defaults(config: SpeculativeConfig) -> SpeculativeConfig:
    low, high = config.prompt_lookup_min, config.prompt_lookup_max
    if low is None and high is None:
        low = high = DEFAULT_PROMPT_LOOKUP
    elif low is None:
        low = high
    elif high is None:
        high = low
    if low > high:
        raise ValueError(f"speculative_config.prompt_lookup_min ({low}) must be <= "
                         f"speculative_config.prompt_lookup_max ({high})")
    return config.model_copy(update={"prompt_lookup_min": low, "prompt_lookup_max": high})


def available_methods() -> list[str]:
    """The methods the ``sparrow_register_spec_proposers`` hook registered (built-ins included)."""
    from sparrow.plugins import get_registry

    return sorted(get_registry().spec_proposers)
