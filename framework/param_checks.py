"""The value checks of ``SamplingParams`` and ``BeamSearchParams``: each converts a value to the
exact type the wire carries, or raises ``InvalidArgumentError`` naming the field
(``SamplingParams.top_k must be an integer, got 1.5 (float)``)."""

from __future__ import annotations

import math
import numbers
from collections.abc import Iterable, Mapping
from typing import Any

from sparrow.errors import InvalidArgumentError

INT64_MIN = -(2**63)
INT64_MAX = 2**63 - 1

_MAX_SHOWN_CHARS = 60


def _fail(field: str, requirement: str, value: Any, *, path: str | None = None) -> None:
    """Raise naming ``field`` in the message; ``path`` is the error's field when the message's
    name is not one (``logit_bias key``)."""
    shown = repr(value)
    if len(shown) > _MAX_SHOWN_CHARS:
        shown = shown[:_MAX_SHOWN_CHARS] + "..."
    raise InvalidArgumentError(f"SamplingParams.{field} {requirement}, got {shown} ({type(value).__name__})",
                               path or field)


def _int(field: str, value: Any, minimum: int = INT64_MIN, maximum: int = INT64_MAX, *, path: str | None = None) -> int:
    """``value`` as a Python int in [minimum, maximum]; numpy integers are converted."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        _fail(field, "must be an integer", value, path=path)
    value = int(value)
    if not minimum <= value <= maximum:
        _fail(field, f"must be an integer in [{minimum}, {maximum}]", value, path=path)
    return value


def _float(field: str, value: Any) -> float:
    """``value`` as a finite Python float (ints and numpy numbers are converted)."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        _fail(field, "must be a number", value)
    try:
        converted = float(value)
    except (OverflowError, ValueError):
        converted = math.inf
    if not math.isfinite(converted):
        _fail(field, "must be a finite number", value)
    return converted


def _bool(field: str, value: Any) -> bool:
    # numpy's bool is not a bool subclass; it is recognised by its type rather than importing numpy.
    if isinstance(value, bool) or (type(value).__module__ == "numpy" and type(value).__name__ in ("bool", "bool_")):
        return bool(value)
    _fail(field, "must be True or False", value)
    return False  # unreachable


def _token_ids(field: str, values: Any) -> list[int]:
    # Any iterable of integers (a list, a tuple, a numpy array), never a string or a dict.
    if isinstance(values, (str, bytes, Mapping)) or not isinstance(values, Iterable):
        _fail(field, "must be a list of token ids", values)
    return [_int(f"{field}[{index}]", value, 0) for index, value in enumerate(values)]
