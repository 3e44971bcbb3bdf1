"""PoolingParams with vLLM's fields: what a pooling (embedding) request asks of its vector.

A pooling engine (``runner="pooling"``) runs each prompt once through the model and returns one
vector per prompt, the final hidden states pooled as the engine's pooler says (LAST, MEAN or CLS;
see :mod:`sparrow.pooling`). A request may then cut the vector to its first ``dimensions``
(Matryoshka embeddings) and choose whether it is L2-normalized. Pure Python, no torch: the
frontend applies these to the vector the engine core sends back.
"""

from __future__ import annotations

import numbers
from typing import Any

import msgspec

from sparrow.errors import InvalidArgumentError

# The pooling tasks a request may name, and what Sparrow's pooler returns for each.
POOLING_TASKS = ("embed", "encode")


def _fail(field: str, requirement: str, value: Any) -> None:
    raise InvalidArgumentError(f"PoolingParams.{field} {requirement}, got {value!r} ({type(value).__name__})", field)


class PoolingParams(
    msgspec.Struct, omit_defaults=True, array_like=True, kw_only=True,  # type: ignore[call-arg]
    forbid_unknown_fields=True,
):
    """vLLM's ``PoolingParams`` for embedding requests.

    ``truncate_prompt_tokens``: keep only the prompt's last k tokens (-1: ``max_model_len``).
    ``dimensions``: keep the first ``dimensions`` values of the vector (before normalizing);
    only for a model that declares Matryoshka dimensions (``is_matryoshka`` or
    ``matryoshka_dimensions`` in config.json, or through ``hf_overrides``), as vLLM refuses it
    otherwise. ``normalize``: L2-normalize the vector (None: the pooler's default, which is the
    model's sentence-transformers ``Normalize`` module or ``pooler_config.normalize``).
    ``task``: "embed" (default) or "encode", which are the same here: one vector per prompt.
    """

    truncate_prompt_tokens: int | None = None
    dimensions: int | None = None
    normalize: bool | None = None
    task: str | None = None

    def __post_init__(self) -> None:
        keep = self.truncate_prompt_tokens
        if keep is not None:
            if isinstance(keep, bool) or not isinstance(keep, numbers.Integral) or (keep != -1 and keep < 1):
                _fail("truncate_prompt_tokens", "must be -1 or a positive integer", keep)
            self.truncate_prompt_tokens = int(keep)
        if self.dimensions is not None:
            if isinstance(self.dimensions, bool) or not isinstance(self.dimensions, numbers.Integral) \
                    or self.dimensions < 1:
                _fail("dimensions", "must be a positive integer", self.dimensions)
            self.dimensions = int(self.dimensions)
        if self.normalize is not None and not isinstance(self.normalize, bool):
            _fail("normalize", "must be True, False or None", self.normalize)
        if self.task is not None and self.task not in POOLING_TASKS:
            _fail("task", f"must be one of {', '.join(POOLING_TASKS)} (Sparrow's pooling models embed; "
                  "classification, scoring and reward heads are not supported)", self.task)

    def clone(self, **changes: Any) -> PoolingParams:
        return msgspec.structs.replace(self, **changes)
