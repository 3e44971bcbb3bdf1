"""Request and response bodies of vLLM's ``POST /classify``: a sequence classifier's class
probabilities for each input (a ``*ForSequenceClassification`` checkpoint served with
``--runner pooling``, the default for one), in vLLM's ClassificationResponse shape.

The inputs are those ``/v1/embeddings`` takes (text, texts, token ids, lists of token ids) with
its vLLM extras (``truncate_prompt_tokens``, ``add_special_tokens``, ``priority``), and the
classifier's ``use_activation``. As the other request models (``protocol``): strict JSON types,
and unknown fields kept only so that ``request_checks`` can refuse each one with a 400 naming it;
vLLM's deprecated spellings of ``use_activation`` (``softmax``, ``activation``) and its chat form
of the request (``messages``) are among those refused.
"""

from __future__ import annotations

import time
from typing import Literal

from pydantic import Field

from sparrow.entrypoints.openai.protocol import INT32_MAX, INT64_MAX, OpenAIBaseModel, TokenId
from sparrow.entrypoints.openai.protocol_embeddings import MAX_EMBEDDING_INPUTS, ChatFormFields

# At most this many inputs per request: each is one engine request, as on /v1/embeddings.
MAX_CLASSIFY_INPUTS = MAX_EMBEDDING_INPUTS


class ClassificationRequest(ChatFormFields):
    model: str | None = Field(None, description="Served model name; defaults to the first one served.")
    input: str | list[str] | list[TokenId] | list[list[TokenId]] | None = Field(
        None, description=f"Text, several texts, token ids, or several lists of token ids (at most "
        f"{MAX_CLASSIFY_INPUTS} inputs); one result per input, none of them empty. Either this or messages.")
    truncate_prompt_tokens: int | None = Field(
        None, ge=-1, le=INT32_MAX,
        description="Keep only each input's last k tokens (-1: the most the model takes, max_model_len).")
    use_activation: bool | None = Field(
        None, description="Apply the classifier's activation (softmax; sigmoid for one label) to its logits "
        "(false: the raw logits; null: the model's pooler default).")
    user: str | None = Field(None, description="An end-user id; accepted, as the other endpoints accept it.")
    add_special_tokens: bool | None = Field(
        None, description="Let the tokenizer add its special tokens (BOS, EOS, ...) to text inputs (default: true "
        "for input, false for messages, whose template writes them).")
    priority: int = Field(0, ge=-INT64_MAX, le=INT64_MAX,
                          description="vLLM's: the scheduling priority (needs a priority scheduler).")


class ClassificationData(OpenAIBaseModel):
    index: int  # the input's position in the request
    label: str  # config.json's id2label of the most probable class
    probs: list[float]  # one per class: after the activation, or the logits with use_activation false
    num_classes: int


class ClassificationUsage(OpenAIBaseModel):
    """vLLM's usage: the tokens classified (after truncation); nothing is generated."""

    prompt_tokens: int = 0
    total_tokens: int = 0
    completion_tokens: int = 0
    prompt_tokens_details: None = None


class ClassificationResponse(OpenAIBaseModel):
    id: str
    object: Literal["list"] = "list"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    data: list[ClassificationData]
    usage: ClassificationUsage
