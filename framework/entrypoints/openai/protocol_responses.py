"""Request and response bodies of ``/v1/responses`` (OpenAI's Responses API), in OpenAI's shapes.

The request is checked as the chat endpoint's is (``request_checks``): a key no model here declares
is a 400 naming it, at any depth. Some OpenAI fields are declared only so that their neutral value
is accepted (``truncation: "disabled"``); ``responses_input``
refuses the others, naming them. ``tools`` and ``tool_choice`` stay dicts, checked by
``responses_tools`` (``FunctionTool``), so that a web_search tool is "not supported" rather than
a list of unknown keys. vLLM's sampling extras that the chat endpoint implements (top_k, seed,
ignore_eos, ...) are declared with the chat endpoint's bounds and handed to it unchanged.

A response serializes to what the ``openai`` SDK's ``Response`` parses:

    Response  id "resp_...", status completed | incomplete (incomplete_details.reason) | failed;
              a background one queued | in_progress until it ends, or cancelled
      output  [ReasoningItem]  only with a reasoning parser, when the model reasoned
              [OutputMessage]  role assistant, content [OutputText {text, annotations: [], logprobs}]
              [FunctionCallItem ...]  one per tool call {id "fc_...", call_id "call_...", name,
                               arguments (JSON text)}, after the message (if any)
      usage   input_tokens (input_tokens_details.cached_tokens), output_tokens
              (output_tokens_details.reasoning_tokens), total_tokens
      + the request's settings, echoed (instructions, max_output_tokens, metadata, text, ...)
"""

from __future__ import annotations

import time
from typing import Any, Literal

from pydantic import Field

from sparrow.entrypoints.openai.protocol import INT32_MAX, INT64_MAX, INT64_MIN, OpenAIBaseModel, RequestModel

MAX_TOP_LOGPROBS = 20  # OpenAI's bound on top_logprobs


# -- the request ------------------------------------------------------------------------------
class InputItem(RequestModel):
    """One item of ``input``: a message (``type`` "message" or absent), a reasoning item, a
    function_call or a function_call_output, as the SDK sends them and as a response's ``output``
    returns them, so that ``input=[*previous.output, {...}]`` carries a conversation on. Content
    parts stay dicts: ``responses_input`` checks them, so that an image part is "not supported"
    rather than a list of unknown keys; it also refuses the fields of another item type."""

    type: str | None = None
    role: str | None = None
    content: str | list[dict[str, Any]] | None = None
    # What an output item carries when sent back; they describe it, the prompt does not show them.
    id: str | None = None
    status: str | None = None
    # A reasoning item's: summary parts (this server writes none) and OpenAI's encrypted reasoning.
    summary: list[dict[str, Any]] | None = None
    encrypted_content: str | None = None
    # A function_call's (call_id, name, arguments: JSON text) and a function_call_output's (call_id, output).
    call_id: str | None = None
    name: str | None = None
    arguments: str | None = None
    output: str | list[dict[str, Any]] | None = None


class FunctionTool(RequestModel):
    """A function tool in the Responses API's flat shape (the chat endpoint's nests all but
    ``type`` under ``function``)."""

    type: Literal["function"]
    name: str = Field(min_length=1)
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class TextFormat(RequestModel):
    """``text.format``: ``{"type": "text"}`` (the default), ``{"type": "json_object"}``, or
    ``{"type": "json_schema", "name": ..., "schema": {...}, "strict": ...}``; the JSON types are
    generated under a grammar (the chat endpoint's ``response_format``), so ``strict`` always holds."""

    type: str = "text"
    name: str | None = None
    description: str | None = None
    # ``schema`` would shadow a BaseModel attribute; the client writes "schema".
    json_schema: dict[str, Any] | bool | None = Field(None, alias="schema")
    strict: bool | None = None


class TextConfig(RequestModel):
    format: TextFormat | None = None
    verbosity: str | None = None  # refused unless null: no way to make a model terser


class ResponsesRequest(RequestModel):
    """POST /v1/responses. ``input`` is a string (one user message) or a list of items; the
    conversation is ``instructions`` (a system message), then the previous response's conversation
    (``previous_response_id``), then ``input``."""

    model: str | None = Field(None, description="Served model name; defaults to the first one served.")
    input: str | list[InputItem] = Field(..., description="A user message, or a list of message items.")
    instructions: str | None = Field(None, description="A system message placed before everything else; "
                                                       "not carried over by previous_response_id.")
    max_output_tokens: int | None = Field(None, ge=1, le=INT32_MAX)
    temperature: float | None = Field(None, ge=0.0, description="Default 1.0 (or the generation config's); 0 is "
                                                                "greedy.")
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    stream: bool | None = False
    store: bool | None = Field(True, description="Keep the response (GET /v1/responses/{id}, previous_response_id).")
    previous_response_id: str | None = Field(None, description="Continue the conversation of a stored response.")
    metadata: dict[str, str] | None = Field(None, description="Up to 16 pairs, echoed back and stored.")
    user: str | None = None
    safety_identifier: str | None = None
    text: TextConfig | None = None
    parallel_tool_calls: bool | None = True
    truncation: str | None = Field("disabled", description='Only "disabled": a prompt too long is a 400.')
    tool_choice: str | dict[str, Any] | None = None
    tools: list[dict[str, Any]] | None = Field(None, description='Function tools: {"type": "function", "name", '
                                                                 '"description", "parameters", "strict"}.')
    max_tool_calls: int | None = Field(None, ge=1, le=INT32_MAX)
    top_logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)
    include: list[str] | None = Field(None, description='Only "message.output_text.logprobs".')
    reasoning: dict[str, Any] | None = None
    background: bool | None = Field(False, description="Generate in a task of the server: the response returns "
                                                       "queued at once; poll, cancel or stream it by id (needs store).")
    # vLLM's sampling extras, honoured by the chat machinery as on /v1/chat/completions
    top_k: int | None = Field(None, ge=-1, le=INT32_MAX)
    min_p: float | None = Field(None, ge=0.0, le=1.0)
    repetition_penalty: float | None = Field(None, gt=0.0)
    presence_penalty: float | None = Field(0.0, ge=-2.0, le=2.0)
    frequency_penalty: float | None = Field(0.0, ge=-2.0, le=2.0)
    seed: int | None = Field(None, ge=INT64_MIN, le=INT64_MAX)
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    min_tokens: int = Field(0, ge=0, le=INT32_MAX)
    logit_bias: dict[str, float] | None = None
    priority: int = Field(0, ge=-INT64_MAX, le=INT64_MAX)
    skip_special_tokens: bool = True
    chat_template_kwargs: dict[str, Any] | None = Field(None, description="Extra variables for the chat template.")
    cache_salt: str | None = Field(None, min_length=1, description="vLLM's: keys the request's prefix-cache blocks "
                                   "(shared only with requests of the same salt).")


# Fields handed to ChatCompletionRequest under the same name.
CHAT_PASS_THROUGH = ("temperature", "top_p", "user", "top_k", "min_p", "repetition_penalty", "presence_penalty",
                     "frequency_penalty", "seed", "stop", "stop_token_ids", "ignore_eos", "min_tokens", "logit_bias",
                     "priority", "skip_special_tokens", "chat_template_kwargs", "cache_salt")


# -- the response -----------------------------------------------------------------------------
class OutputText(OpenAIBaseModel):
    type: Literal["output_text"] = "output_text"
    text: str
    annotations: list[Any] = Field(default_factory=list)
    # With include ["message.output_text.logprobs"]: one entry per answer token.
    logprobs: list[dict[str, Any]] | None = None


class OutputMessage(OpenAIBaseModel):
    id: str
    type: Literal["message"] = "message"
    role: Literal["assistant"] = "assistant"
    status: str  # completed, or incomplete when the length limit cut it
    content: list[OutputText]


class FunctionCallItem(OpenAIBaseModel):
    id: str  # fc_...
    type: Literal["function_call"] = "function_call"
    call_id: str  # call_...: what a function_call_output answers
    name: str
    arguments: str  # a JSON object, as text
    status: str  # in_progress (while streamed), completed, or incomplete when the length limit cut it


class ReasoningText(OpenAIBaseModel):
    type: Literal["reasoning_text"] = "reasoning_text"
    text: str


class ReasoningItem(OpenAIBaseModel):
    id: str
    type: Literal["reasoning"] = "reasoning"
    summary: list[Any] = Field(default_factory=list)
    content: list[ReasoningText]
    status: str


class InputTokensDetails(OpenAIBaseModel):
    cached_tokens: int = 0  # prompt tokens the prefix cache held


class OutputTokensDetails(OpenAIBaseModel):
    reasoning_tokens: int = 0


class ResponseUsage(OpenAIBaseModel):
    input_tokens: int
    input_tokens_details: InputTokensDetails
    output_tokens: int
    output_tokens_details: OutputTokensDetails
    total_tokens: int


class IncompleteDetails(OpenAIBaseModel):
    reason: str  # max_output_tokens


class ResponseError(OpenAIBaseModel):
    code: str
    message: str


class ResponseObject(OpenAIBaseModel):
    id: str
    object: Literal["response"] = "response"
    created_at: int = Field(default_factory=lambda: int(time.time()))
    # queued, in_progress (stream events; a background response until it ends), completed,
    # incomplete, failed, cancelled (a background response)
    status: str
    error: ResponseError | None = None
    incomplete_details: IncompleteDetails | None = None
    model: str
    output: list[ReasoningItem | OutputMessage | FunctionCallItem] = Field(default_factory=list)
    usage: ResponseUsage | None = None
    # the request's settings
    instructions: str | None = None
    max_output_tokens: int | None = None
    max_tool_calls: int | None = None
    metadata: dict[str, str] = Field(default_factory=dict)
    parallel_tool_calls: bool = True
    previous_response_id: str | None = None
    reasoning: dict[str, Any] | None = None
    background: bool = False
    service_tier: str = "default"
    store: bool = True
    temperature: float | None = None
    top_p: float | None = None
    text: dict[str, Any] = Field(default_factory=lambda: {"format": {"type": "text"}})
    tool_choice: str | dict[str, Any] = "auto"
    tools: list[dict[str, Any]] = Field(default_factory=list)
    top_logprobs: int = 0
    truncation: str = "disabled"
    user: str | None = None
    safety_identifier: str | None = None


class DeletedResponse(OpenAIBaseModel):
    id: str
    object: Literal["response"] = "response"
    deleted: bool = True


class InputItemList(OpenAIBaseModel):
    """GET /v1/responses/{id}/input_items: one page of a response's input items, each with its ``id``
    (a message is ``{"type": "message", "role", "content": [parts], "status"}``)."""

    object: Literal["list"] = "list"
    data: list[dict[str, Any]]
    first_id: str | None = None
    last_id: str | None = None
    has_more: bool = False
