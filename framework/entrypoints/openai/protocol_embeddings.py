"""Request and response bodies of ``POST /v1/embeddings``, in OpenAI's shapes (pydantic), with
vLLM's extras (``truncate_prompt_tokens``, ``add_special_tokens``, ``priority``, ``normalize``).

As the other request models (``protocol``): strict JSON types, and unknown fields kept only so
that ``request_checks`` can refuse each one with a 400 naming it. vLLM's chat form of the request
(``messages`` instead of ``input``, rendered with the chat template into one input) is taken too.
"""

from __future__ import annotations

import time
from typing import Any, Literal

from pydantic import Field

from sparrow.entrypoints.openai.protocol import (
    INT32_MAX,
    INT64_MAX,
    ChatMessage,
    OpenAIBaseModel,
    RequestModel,
    TokenId,
)

# OpenAI's limit on the inputs of one request; each input is one engine request.
MAX_EMBEDDING_INPUTS = 2048


class ChatFormFields(RequestModel):
    """vLLM's chat form of a pooling request (/v1/embeddings, /classify): the messages rendered
    with the chat template are one input."""

    messages: list[ChatMessage] | None = Field(
        None, min_length=1, description="vLLM's chat form: chat messages, rendered with the chat template into "
        "one input (one result). Either this or input.")
    add_generation_prompt: bool = Field(False, description="With messages: open the assistant's turn after them.")
    continue_final_message: bool = Field(False, description="With messages: leave the last message open.")
    chat_template: str | None = Field(
        None, description="With messages: a Jinja chat template (needs --trust-request-chat-template).")
    chat_template_kwargs: dict[str, Any] | None = Field(None, description="With messages: extra template variables.")


class EmbeddingRequest(ChatFormFields):
    model: str | None = Field(None, description="Served model name; defaults to the first one served.")
    input: str | list[str] | list[TokenId] | list[list[TokenId]] | None = Field(
        None, description=f"Text, several texts, token ids, or several lists of token ids (at most "
        f"{MAX_EMBEDDING_INPUTS} inputs); one vector per input, none of them empty. Either this or messages.")

    encoding_format: Literal["float", "base64"] = Field(
        "float", description="float: a list of numbers; base64: the vector's little-endian float32 bytes, "
        "base64-encoded (the openai client asks for this one and decodes it).")
    dimensions: int | None = Field(
        None, ge=1, le=INT32_MAX, description="Keep the vector's first values only (then normalize); only for "
        "a model that declares Matryoshka embeddings.")
    user: str | None = Field(None, description="OpenAI's end-user id; accepted, as the other endpoints accept it.")
    # vLLM's extras
    truncate_prompt_tokens: int | None = Field(
        None, ge=-1, le=INT32_MAX,
        description="Keep only each input's last k tokens (-1: the most the model takes, max_model_len).")
    add_special_tokens: bool | None = Field(
        None, description="Let the tokenizer add its special tokens (BOS, EOS, ...) to text inputs (default: true "
        "for input, false for messages, whose template writes them).")
    priority: int = Field(0, ge=-INT64_MAX, le=INT64_MAX,
                          description="vLLM's: the scheduling priority (needs a priority scheduler).")
    normalize: bool | None = Field(
        None, description="L2-normalize the vector (null: the model's pooler default).")


class EmbeddingData(OpenAIBaseModel):
    object: Literal["embedding"] = "embedding"
    # float: [dimensions] numbers; base64: the same as little-endian float32 bytes.
    embedding: list[float] | str
    index: int  # the input's position in the request


class EmbeddingUsage(OpenAIBaseModel):
    """OpenAI's embedding usage: the tokens the inputs were (after truncation); nothing is generated."""

    prompt_tokens: int = 0
    total_tokens: int = 0


class EmbeddingResponse(OpenAIBaseModel):
    id: str
    object: Literal["list"] = "list"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    data: list[EmbeddingData]
    usage: EmbeddingUsage
