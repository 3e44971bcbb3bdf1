"""``speculative_config``: vLLM's dictionary, validated here with errors that name the field.

    LLM(..., speculative_config={"method": "ngram", "num_speculative_tokens": 4,
                                 "prompt_lookup_max": 4, "prompt_lookup_min": 1})

Pure Python (pydantic only): the engine configuration validates it in the frontend, before any
engine process starts.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError

# vLLM's methods that Sparrow does not implement yet: refused by name rather than as unknown.
NOT_IMPLEMENTED_METHODS = ("draft_model", "eagle", "eagle3", "medusa", "mlp_speculator", "mtp")
BUILTIN_METHODS = ("ngram",)
# vLLM's default lookup window when neither bound is given.
DEFAULT_PROMPT_LOOKUP = 5


class SpeculativeConfig(BaseModel):
    """The validated settings; every proposer gets this object."""

    model_config = ConfigDict(extra="forbid", frozen=True, protected_namespaces=())

    method: str = Field(description="Which proposer guesses the drafts: ngram, or a plugin's.")
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
        raise ValueError("speculative_config.method is required (ngram, or a plugin's method)")
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
    return config.model_dump()


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
