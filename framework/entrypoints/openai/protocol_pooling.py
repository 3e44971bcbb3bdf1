"""Request and response bodies of vLLM's ``POST /pooling``: a pooling model's raw output for each
input, for any of the engine's tasks (``task``; the model's first by default): a prompt's vector
(``embed``), a classifier's outputs (``classify``), or one row per prompt token (``token_embed``,
``token_classify``: a token classifier's or a reward model's).

The inputs are those ``/v1/embeddings`` takes (text, texts, token ids, lists of token ids, or the
chat form) with its vLLM extras; the embedding fields (``dimensions``, ``normalize``) apply to
the embedding tasks and ``use_activation`` to the classifier's, each refused (a 400 naming it)
on a task it does not apply to. As the other request models (``protocol``): strict JSON types,
and unknown fields kept only so that ``request_checks`` can refuse each one with a 400 naming it.
"""

from __future__ import annotations

import time
from typing import Literal

from pydantic import Field

from sparrow.entrypoints.openai.protocol import INT32_MAX, OpenAIBaseModel
from sparrow.entrypoints.openai.protocol_classify import ClassificationRequest, ClassificationUsage
from sparrow.pooling_params import POOLING_TASKS


class PoolingRequest(ClassificationRequest):
    """/classify's request (its inputs, ``use_activation`` and vLLM extras) with the task and the
    embedding tasks' fields."""

    task: Literal[POOLING_TASKS] | None = Field(  # type: ignore[valid-type]
        None, description="The pooling task (one of the model's; null: its first): embed, classify, score, "
        "token_embed or token_classify (encode: the model's token-level task).")
    encoding_format: Literal["float", "base64"] = Field(
        "float", description="float: numbers (a list per token for a token-level task); base64: the output's "
        "little-endian float32 bytes, row after row, base64-encoded.")
    dimensions: int | None = Field(
        None, ge=1, le=INT32_MAX, description="Embedding tasks: keep each vector's first values only (then "
        "normalize); only for a model that declares Matryoshka embeddings.")
    normalize: bool | None = Field(None, description="Embedding tasks: L2-normalize each vector (null: the "
                                   "model's pooler default).")


class PoolingResponseData(OpenAIBaseModel):
    index: int  # the input's position in the request
    object: Literal["pooling"] = "pooling"
    # float: [width] numbers, or [prompt tokens][width] for a token-level task; base64: the same as
    # little-endian float32 bytes, row after row.
    data: list[list[float]] | list[float] | str


class PoolingResponse(OpenAIBaseModel):
    id: str
    object: Literal["list"] = "list"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    data: list[PoolingResponseData]
    usage: ClassificationUsage  # the same counts as /classify's
