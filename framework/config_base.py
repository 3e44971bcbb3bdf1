"""What every section of the engine configuration shares: strict validation, the few conversions
a Python caller expects (a path, a numpy number, a tuple), and :class:`ConfigError`, whose message
names the field.

``sparrow.config`` re-exports :class:`ConfigError`; import it from there.
"""

from __future__ import annotations

import numbers
import os
from typing import Any

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
