"""The OpenAI-compatible API's base models, error bodies and model cards (pydantic), shared by
every endpoint's protocol module; ``sparrow.entrypoints.openai.protocol`` re-exports them.

``OpenAIBaseModel`` keeps unknown fields (``extra="allow"``) only so that ``request_checks`` can
refuse each one with a 400 naming it; ``RequestModel`` is strict about JSON types.
"""

from __future__ import annotations

import time
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field


class OpenAIBaseModel(BaseModel):
    model_config = ConfigDict(extra="allow", allow_inf_nan=False, protected_namespaces=())


class RequestModel(OpenAIBaseModel):
    """A request body or a part of one: no coercion between JSON types (``"4"`` is not 4, ``true``
    is not 1), so that a client's mistake is a 400 naming the field rather than a guess."""

    model_config = ConfigDict(strict=True)


# -- errors -----------------------------------------------------------------------------------
class ErrorInfo(OpenAIBaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | int | None = None


class ErrorResponse(OpenAIBaseModel):
    error: ErrorInfo


# -- models -----------------------------------------------------------------------------------
class ModelCard(OpenAIBaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=lambda: int(time.time()))
    owned_by: str = "sparrow"
    root: str | None = None
    parent: str | None = None  # a LoRA adapter's base model
    max_model_len: int | None = None


class ModelList(OpenAIBaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard] = Field(default_factory=list)
