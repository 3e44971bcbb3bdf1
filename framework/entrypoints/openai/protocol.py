"""Request and response bodies of the OpenAI-compatible API, in OpenAI's shapes (pydantic).

Requests accept OpenAI's fields plus vLLM's extras (top_k, min_p, repetition_penalty, ignore_eos,
min_tokens, stop_token_ids, priority, truncate_prompt_tokens, chat_template, ...). The models keep
unknown fields (``extra="allow"``) only so that ``request_checks`` can refuse each one with a 400
naming it: nothing a client sends is silently ignored, except the few harmless fields listed there.
Request models are strict about JSON types, as OpenAI is: a string is not a number and a boolean
is not an integer (an integer is a float, though: ``temperature: 1``). Integers are bounded to what
the engine can carry (64-bit), floats must be finite.
"""

from __future__ import annotations

import time
from typing import Any, ClassVar, Literal

from pydantic import Field, SerializerFunctionWrapHandler, model_serializer

# The base models, error bodies and model cards live in protocol_base (re-exported: the endpoints
# import them from here).
from sparrow.entrypoints.openai.protocol_base import (  # noqa: F401
    ErrorInfo,
    ErrorResponse,
    ModelCard,
    ModelList,
    OpenAIBaseModel,
    RequestModel,
)

# The sampling fields both generation endpoints take live in protocol_sampling (re-exported).
from sparrow.entrypoints.openai.protocol_sampling import (  # noqa: F401
    INT32_MAX,
    INT64_MAX,
    INT64_MIN,
    MAX_N,
    JsonSchemaFormat,
    ResponseFormat,
    SamplingFields,
    StreamOptions,
    TokenId,
)

# -- shared -----------------------------------------------------------------------------------


class PromptTokensDetails(OpenAIBaseModel):
    cached_tokens: int = 0  # prompt tokens found in the prefix cache (computed by an earlier request)


class UsageInfo(OpenAIBaseModel):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0
    prompt_tokens_details: PromptTokensDetails | None = None  # with --enable-prompt-tokens-details


# -- completions ------------------------------------------------------------------------------
class CompletionRequest(SamplingFields):
    prompt: str | list[str] | list[TokenId] | list[list[TokenId]] | None = Field(
        None, description="Text, several texts, token ids, or several lists of token ids (required unless "
        "prompt_embeds are given; then an empty prompt adds none).")
    prompt_embeds: str | list[str] | None = Field(
        None, description="vLLM's: prompts given as embeddings, each a base64 torch.save'd tensor [num_tokens, "
        "hidden_size], answered before the prompts of 'prompt' (needs --enable-prompt-embeds).")
    max_tokens: int | None = Field(16, ge=0, le=INT32_MAX,
                                   description="0 only with echo: score the prompt, generate nothing.")
    logprobs: int | None = Field(None, ge=0, le=INT32_MAX)
    echo: bool | None = False
    suffix: str | None = None
    best_of: int | None = Field(None, ge=1, le=MAX_N)
    prompt_logprobs: int | None = Field(None, ge=0, le=INT32_MAX)
    add_special_tokens: bool = Field(True, description="Let the tokenizer add its special tokens (BOS, ...).")


class CompletionLogProbs(OpenAIBaseModel):
    text_offset: list[int] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)
    tokens: list[str] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)


class PromptLogprob(OpenAIBaseModel):
    """vLLM's Logprob: one token's logprob at one prompt position."""

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


class WithTokenIds(OpenAIBaseModel):
    """A response part with vLLM's ``return_token_ids`` keys (``prompt_token_ids``, ``token_ids``):
    serialized only when set, so that a response that did not ask for them is OpenAI's shape. (No
    return annotation: pydantic would make it the OpenAPI schema, losing the fields.)"""

    _ASKED_FOR_ONLY: ClassVar[tuple[str, ...]] = ("prompt_token_ids", "token_ids")

    @model_serializer(mode="wrap")
    def _drop_unasked_token_ids(self, handler: SerializerFunctionWrapHandler):
        data = handler(self)
        for key in self._ASKED_FOR_ONLY:
            if key in data and data[key] is None:
                del data[key]
        return data


class CompletionResponseChoice(WithTokenIds):
    index: int
    text: str
    logprobs: CompletionLogProbs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    # vLLM's: one entry per prompt token, None for the first (no context predicts it), else
    # token id (a JSON key, so a string) -> its Logprob; streamed in a choice's first chunk.
    prompt_logprobs: list[dict[str, PromptLogprob] | None] | None = None
    prompt_token_ids: list[int] | None = None  # vLLM's return_token_ids (streamed: in the first chunk)
    token_ids: list[int] | None = None  # vLLM's return_token_ids: the generated tokens (streamed: new ones)


class CompletionResponse(OpenAIBaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[CompletionResponseChoice]
    usage: UsageInfo


class CompletionStreamResponse(OpenAIBaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[CompletionResponseChoice]
    usage: UsageInfo | None = None


# -- chat -------------------------------------------------------------------------------------
class FunctionCall(RequestModel):
    name: str
    arguments: str = Field("", description="The call's arguments, a JSON object as a string.")


class ToolCall(RequestModel):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class FunctionDefinition(RequestModel):
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class Tool(RequestModel):
    type: Literal["function"] = "function"
    function: FunctionDefinition


class ToolChoiceFunction(RequestModel):
    name: str | None = None


class NamedToolChoice(RequestModel):
    """``{"type": "function", "function": {"name": ...}}``; ``tool_calling`` checks that both are
    there, so that a half-written choice gets a message showing the whole form."""

    type: str = "function"
    function: ToolChoiceFunction | None = None


class ChatMessage(RequestModel):
    role: str
    # Content parts stay dicts: a part of another type than text is "not supported yet" rather
    # than a list of its unknown keys; request_checks checks each part's keys.
    content: str | list[dict[str, Any]] | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = Field(None, description="An assistant turn's tool calls, for the template.")
    tool_call_id: str | None = Field(None, description="A tool message's answer to this call id, for the template.")
    reasoning_content: str | None = Field(
        None, description="An assistant turn's reasoning as this server returned it, for templates that show it.")


# OpenAI's reasoning efforts, passed to the chat template as its reasoning_effort (chat, Responses).
ReasoningEffort = Literal["none", "minimal", "low", "medium", "high"]


class ChatCompletionRequest(SamplingFields):
    messages: list[ChatMessage] = Field(..., min_length=1)
    max_tokens: int | None = Field(None, ge=1, le=INT32_MAX,
                                   description="Deprecated by OpenAI; see max_completion_tokens.")
    max_completion_tokens: int | None = Field(None, ge=1, le=INT32_MAX)
    logprobs: bool | None = False
    top_logprobs: int | None = Field(None, ge=0, le=INT32_MAX)
    prompt_logprobs: int | None = Field(None, ge=0, le=INT32_MAX,
                                        description="vLLM's: the rendered prompt's logprobs (not with stream).")
    tools: list[Tool] | None = Field(None, description="Functions the model may call; shown to the chat template.")
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = Field(
        None, description="none: a text reply; auto (the default with tools): the tool parser finds calls in the "
        "output (needs --enable-auto-tool-choice and --tool-call-parser); required: at least one call; "
        "{'type': 'function', 'function': {'name': ...}}: a call to that function. required and named calls are "
        "generated under a JSON grammar, so their arguments match the tool's parameters schema.")
    parallel_tool_calls: bool | None = Field(
        True, description="false: at most one call per reply (required: exactly one).")
    # vLLM's chat extras
    echo: bool = Field(False, description="Put the last message's content in front of the reply when it is "
                                          "the replying role's (continuing a message).")
    add_generation_prompt: bool = True
    continue_final_message: bool = Field(
        False, description="Continue the last message (needs add_generation_prompt=false).")
    add_special_tokens: bool = Field(False, description="The chat template writes the special tokens; default false.")
    chat_template: str | None = Field(
        None, description="A Jinja chat template for this request instead of the tokenizer's.")
    chat_template_kwargs: dict[str, Any] | None = Field(None, description="Extra variables for the chat template.")
    documents: list[dict[str, str]] | None = Field(
        None, description="vLLM's: documents for a retrieval-augmented chat template (its documents variable), "
        "each a dict of strings such as {'title': ..., 'text': ...}.")
    reasoning_effort: ReasoningEffort | None = Field(
        None, description="OpenAI's: passed to the chat template as its reasoning_effort variable (for templates "
        "that read it; chat_template_kwargs may set it instead).")
    include_reasoning: bool = Field(True, description="vLLM's: with a reasoning parser, return reasoning_content "
                                                      "(false: drop it, keep only the answer).")


class ChatCompletionTopLogprob(OpenAIBaseModel):
    token: str
    logprob: float
    bytes: list[int] | None = None


class ChatCompletionLogProb(ChatCompletionTopLogprob):
    top_logprobs: list[ChatCompletionTopLogprob] = Field(default_factory=list)


class ChatCompletionLogProbs(OpenAIBaseModel):
    content: list[ChatCompletionLogProb] | None = None


class ChatResponseMessage(OpenAIBaseModel):
    role: str = "assistant"
    content: str | None = None
    reasoning_content: str | None = None
    tool_calls: list[ToolCall] = Field(default_factory=list)


class ChatCompletionResponseChoice(WithTokenIds):
    index: int
    message: ChatResponseMessage
    logprobs: ChatCompletionLogProbs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    token_ids: list[int] | None = None  # vLLM's, with return_token_ids: the tokens the choice generated


class ChatCompletionResponse(WithTokenIds):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatCompletionResponseChoice]
    usage: UsageInfo
    prompt_token_ids: list[int] | None = None  # vLLM's, with return_token_ids: the rendered prompt's
    # vLLM's, with prompt_logprobs: per rendered prompt token None (the first) or id -> Logprob.
    prompt_logprobs: list[dict[str, PromptLogprob] | None] | None = None

    _ASKED_FOR_ONLY: ClassVar[tuple[str, ...]] = ("prompt_token_ids", "prompt_logprobs")


class _WithoutNones(OpenAIBaseModel):
    """Serialized without its unset (None) fields: a tool-call delta after the first carries only
    its index and argument text, so that clients which concatenate every string they get (the
    openai SDK's stream helpers) do not add a null id or name to the call."""

    @model_serializer(mode="wrap")
    def _drop_nones(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        return {key: value for key, value in handler(self).items() if value is not None}


class DeltaFunctionCall(_WithoutNones):
    name: str | None = None
    arguments: str | None = None


class DeltaToolCall(_WithoutNones):
    index: int
    id: str | None = None
    type: Literal["function"] | None = None
    function: DeltaFunctionCall | None = None


class DeltaMessage(OpenAIBaseModel):
    role: str | None = None
    content: str | None = None
    reasoning_content: str | None = None
    tool_calls: list[DeltaToolCall] | None = None


class ChatCompletionResponseStreamChoice(WithTokenIds):
    index: int
    delta: DeltaMessage
    logprobs: ChatCompletionLogProbs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    token_ids: list[int] | None = None  # vLLM's, with return_token_ids: this chunk's new tokens


class ChatCompletionStreamResponse(WithTokenIds):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatCompletionResponseStreamChoice]
    usage: UsageInfo | None = None
    prompt_token_ids: list[int] | None = None  # vLLM's, with return_token_ids: in the first chunk only
