"""PoolingParams with vLLM's fields: what a pooling request asks of its vector.

A pooling engine (``runner="pooling"``) runs each prompt once through the model and returns one
vector per prompt, the final hidden states pooled as the engine's pooler says (LAST, MEAN or CLS;
see :mod:`sparrow.pooling`), passed through a classifier's score layer when the model has one.
An embedding request may then cut the vector to its first ``dimensions`` (Matryoshka
embeddings) and choose whether it is L2-normalized; a classification request whether the
activation (softmax or sigmoid) is applied. Pure Python, no torch: the frontend applies these
to the vector the engine core sends back.
"""

from __future__ import annotations

import numbers
from typing import Any

import msgspec

from sparrow.errors import InvalidArgumentError

# The pooling tasks a request may name, vLLM's: an embedding model's ("embed": one vector per
# prompt; "token_embed": one per prompt token), a classifier's ("classify": one output per label;
# "score": a cross-encoder's pair of texts; "token_classify": the labels' outputs at every prompt
# token), and vLLM's older "encode", which names the model's token-level task.
TOKEN_TASKS = ("token_embed", "token_classify")
POOLING_TASKS = ("embed", "classify", "score", *TOKEN_TASKS, "encode")


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
    ``use_activation``: a classifier's softmax / sigmoid over its logits (None: the pooler's
    default, on); False returns the raw logits. ``task``: "embed" or "token_embed" (one vector
    per prompt token, each cut and normalized as a prompt's vector is) for an embedding model;
    "classify", "score" (a cross-encoder's) or "token_classify" (the labels' outputs at every
    prompt token) for a classifier; "encode" is the model's token-level task (None: the engine's
    first task). Embedding fields on a classification task, and ``use_activation`` on an
    embedding one, are refused when the request is submitted.
    """

    truncate_prompt_tokens: int | None = None
    dimensions: int | None = None
    normalize: bool | None = None
    task: str | None = None
    use_activation: bool | None = None

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
        for field in ("normalize", "use_activation"):
            if getattr(self, field) is not None and not isinstance(getattr(self, field), bool):
                _fail(field, "must be True, False or None", getattr(self, field))
        if self.task is not None and self.task not in POOLING_TASKS:
            _fail("task", f"must be one of {', '.join(POOLING_TASKS)}", self.task)

    def clone(self, **changes: Any) -> PoolingParams:
        return msgspec.structs.replace(self, **changes)
