"""What every section of the engine configuration shares: strict validation, the few conversions
a Python caller expects (a path, a numpy number, a tuple), and :class:`ConfigError`, whose message
names the field.

``sparrow.config`` re-exports :class:`ConfigError`; import it from there.
"""

from __future__ import annotations

import numbers
import os
from typing import Any, Callable

from pydantic import BaseModel, ConfigDict, ValidationError, model_validator


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


def expand_dict_argument(values: Any, name: str, translate: Callable[[str, Any], dict[str, Any]]) -> Any:
    """vLLM's dict form of several flat arguments (``kv_transfer_config={...}``): ``values`` (a
    section's raw input) with each of the dict's keys set as the flat fields ``translate(key,
    value)`` returns (it raises ValueError for a key Sparrow does not take) and ``name`` itself
    cleared. A field given both ways is refused, as is a dict that is not one."""
    if not isinstance(values, dict) or values.get(name) is None:
        return values
    given = values[name]
    if isinstance(given, BaseModel):  # vLLM's config object; here a section of Sparrow's own
        given = given.model_dump(exclude_unset=True)
    if not isinstance(given, dict):
        raise ValueError(f"{name} must be a dict (a JSON object on the command line), got {type(given).__name__}")
    out = {key: value for key, value in values.items() if key != name}
    for key, value in given.items():
        for field, field_value in translate(key, value).items():
            if values.get(field) not in (None, {}):
                raise ValueError(f"{name}.{key} and {field} are both given; give one of them")
            out[field] = field_value
    return out
