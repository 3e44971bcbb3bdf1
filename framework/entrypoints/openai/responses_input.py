"""From a ``/v1/responses`` request to the chat endpoint's request: what is refused, the
conversation, and errors in the words of the fields the client sent.

    instructions          -> {"role": "system", ...}, first (not stored with the response: as in
                             OpenAI's API, a continued conversation does not carry them over)
    previous_response_id  -> the stored conversation: its input turns, then its reply
    input "text"          -> {"role": "user", "content": "text"}
    input [items]         -> one message per message item (developer is rendered as system, the
                             role chat templates know); a reasoning item becomes the
                             reasoning_content of the assistant message right after it
      function_call       -> a tool call ({"id": call_id, "function": {name, arguments}}) of the
                             assistant message right before it (a message item or calls, as a
                             response's output lists them), else of a new one without content
      function_call_output -> {"role": "tool", "tool_call_id": call_id, "content": output}, for a
                             call made earlier in the conversation
    tools, tool_choice    -> the chat endpoint's (``responses_tools``): its tool calling, as is

The chat machinery then checks, renders and samples exactly as for /v1/chat/completions. Its
errors name chat fields (``messages[3].content``, ``response_format``, ``max_tokens``,
``messages[2].tool_calls[0].function.arguments``, ``tools[0].function.parameters``), which
``in_responses_words`` turns back into this request's (``input[1].content``, ``text.format``,
``max_output_tokens``, ``input[4].arguments``, ``tools[0].parameters``).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any, get_args

from pydantic import ValidationError

from sparrow.entrypoints.openai.protocol import ChatCompletionRequest, ReasoningEffort
from sparrow.entrypoints.openai.protocol_responses import CHAT_PASS_THROUGH, InputItem, ResponsesRequest
from sparrow.entrypoints.openai.request_checks import RequestFieldError, check_fields, not_supported, refuse_key
from sparrow.entrypoints.openai.responses_tools import chat_tool_fields, check_tools, tool_call, tool_message
from sparrow.entrypoints.openai.serving_engine import APIError

LOGPROBS_INCLUDE = "message.output_text.logprobs"
ROLES = {"user": "user", "system": "system", "developer": "system", "assistant": "assistant"}
TEXT_PART_TYPES = ("input_text", "output_text")
FORMAT_TYPES = ("text", "json_object", "json_schema")
# OpenAI's bounds on metadata.
MAX_METADATA_PAIRS, MAX_METADATA_KEY, MAX_METADATA_VALUE = 16, 64, 512
# The fields of each input item type, besides type, id and status (what an output item carries).
ITEM_FIELDS = {"message": ("role", "content"), "reasoning": ("content", "summary", "encrypted_content"),
               "function_call": ("call_id", "name", "arguments"), "function_call_output": ("call_id", "output")}
# OpenAI Responses fields this server does not implement: a 400 saying so rather than "unknown field".
NOT_SUPPORTED: dict[str, str] = {
    "conversation": "conversations (the Conversations API; use previous_response_id)",
    "prompt": "prompt templates",
    "context_management": "context management",
    "prompt_cache_key": "prompt_cache_key (prompt caching here is automatic)",
    "prompt_cache_retention": "prompt_cache_retention (prompt caching here is automatic)",
    "prompt_cache_options": "prompt_cache_options (prompt caching here is automatic)",
    "background_options": "background mode",
    "stream_options": "stream_options (stream obfuscation is never applied here)",
    "image": "image generation",
    "moderation": "moderation",
    "access_programs": "access programs",
}
# The chat endpoint's names for fields this endpoint names otherwise.
CHAT_NAMES = {"messages": "input", "response_format": "text.format", "max_tokens": "max_output_tokens",
              "max_completion_tokens": "max_output_tokens", "logprobs": f'include ["{LOGPROBS_INCLUDE}"]'}


@dataclass(slots=True)
class Conversation:
    """The chat messages of a request, and where the client wrote each one."""

    messages: list[dict[str, Any]]  # as ChatCompletionRequest takes them
    sources: list[str]  # per message: "instructions", "previous_response_id", "input" or "input[i]"
    # Per message made of input items with tool calls: the item of each call ("input[i]").
    call_sources: dict[int, list[str]] = field(default_factory=dict)

    @property
    def turns(self) -> list[dict[str, Any]]:
        """What a stored response keeps of it: everything but the instructions."""
        return [message for message, source in zip(self.messages, self.sources) if source != "instructions"]


def wants_logprobs(request: ResponsesRequest) -> bool:
    return LOGPROBS_INCLUDE in (request.include or ())


def check_request(request: ResponsesRequest, max_logprobs: int) -> None:
    """Refuse, naming the field, what this endpoint does not implement; then every unknown key at
    any depth, as the chat endpoint does (``request_checks.check_fields``)."""
    for name in request.model_extra or {}:
        if name in NOT_SUPPORTED:
            raise not_supported(name, NOT_SUPPORTED[name])
        if name in CHAT_NAMES:
            raise RequestFieldError(f"{name}: not a field of /v1/responses (the chat endpoint's); use "
                                    f"{CHAT_NAMES[name]}", name, code="unknown_field")
    # Before the keys are checked: another item type's keys are not unknown, its type is unsupported.
    for index, item in enumerate(request.input if isinstance(request.input, list) else ()):
        kind = item.type or "message"
        if kind not in ITEM_FIELDS:
            raise not_supported(f"input[{index}].type", f"an input item of type {kind!r}",
                                f"; supported: {', '.join(ITEM_FIELDS)}")
    check_tools(request)  # before the keys too: a web_search tool's type is what is unsupported
    check_fields(request)
    if request.truncation not in (None, "disabled"):
        if request.truncation == "auto":
            raise not_supported("truncation", 'truncation "auto" (dropping the start of a conversation that does not '
                                "fit)", '; "disabled" makes a prompt longer than the model\'s context a 400')
        raise RequestFieldError(f'truncation: "disabled" or "auto", got {request.truncation!r}', "truncation")
    if request.background and request.store is False:
        raise RequestFieldError("background: needs store true (the default): a background response is polled, "
                                "cancelled and resumed by its id, which only a stored response keeps", "background")
    reasoning = request.reasoning or {}
    for key, value in reasoning.items():
        if key == "effort":
            if value is not None and value not in REASONING_EFFORTS:
                raise RequestFieldError(f"reasoning.effort must be one of {', '.join(REASONING_EFFORTS)}, got "
                                        f"{value!r}", "reasoning.effort")
        elif value is not None:
            raise not_supported(f"reasoning.{key}", f"the reasoning option {key}", " (reasoning.effort reaches the "
                                "chat template as its reasoning_effort; chat_template_kwargs can set a template's "
                                "variables, such as enable_thinking)")
    for entry in request.include or ():
        if entry != LOGPROBS_INCLUDE:
            raise not_supported("include", f"include {entry!r}", f"; supported: {LOGPROBS_INCLUDE}")
    if request.top_logprobs and not wants_logprobs(request):
        raise RequestFieldError(f'top_logprobs: needs include ["{LOGPROBS_INCLUDE}"] (the logprobs it ranks)',
                                "top_logprobs")
    if request.top_logprobs is not None and request.top_logprobs > max_logprobs:
        raise RequestFieldError(f"top_logprobs={request.top_logprobs} exceeds the maximum of {max_logprobs} (the "
                                "server's max_logprobs)", "top_logprobs")
    _check_text(request)
    _check_metadata(request.metadata)


def _check_text(request: ResponsesRequest) -> None:
    text = request.text
    if text is None:
        return
    if text.verbosity is not None:
        raise not_supported("text.verbosity", "text.verbosity")
    fmt = text.format
    if fmt is None:
        return
    if fmt.type not in FORMAT_TYPES:
        raise not_supported("text.format", f"text.format of type {fmt.type!r}",
                            f"; supported: {', '.join(FORMAT_TYPES)}")
    if fmt.type == "json_schema" and fmt.json_schema is None:
        raise RequestFieldError('text.format: type json_schema needs schema, a JSON schema object ({"type": '
                                '"json_schema", "name": "x", "schema": {...}})', "text.format")
    if fmt.type != "json_schema":
        for name in ("name", "description", "json_schema", "strict"):
            if getattr(fmt, name) is not None:
                key = "schema" if name == "json_schema" else name
                raise RequestFieldError(f"text.format.{key}: only allowed with type json_schema, got type "
                                        f"{fmt.type!r}", f"text.format.{key}")


def _check_metadata(metadata: dict[str, str] | None) -> None:
    if not metadata:
        return
    if len(metadata) > MAX_METADATA_PAIRS:
        raise RequestFieldError(f"metadata: at most {MAX_METADATA_PAIRS} key-value pairs, got {len(metadata)}",
                                "metadata")
    for key, value in metadata.items():
        if len(key) > MAX_METADATA_KEY:
            raise RequestFieldError(f"metadata: keys are at most {MAX_METADATA_KEY} characters, got one of "
                                    f"{len(key)}", "metadata")
        if len(value) > MAX_METADATA_VALUE:
            raise RequestFieldError(f"metadata.{key}: values are at most {MAX_METADATA_VALUE} characters, got "
                                    f"{len(value)}", "metadata")


# -- the conversation ---------------------------------------------------------------------------
def conversation_of(request: ResponsesRequest, previous: list[dict[str, Any]]) -> Conversation:
    """The chat messages: instructions, the ``previous`` conversation (a stored response's turns),
    then the input."""
    messages: list[dict[str, Any]] = []
    sources: list[str] = []
    call_sources: dict[int, list[str]] = {}
    if request.instructions is not None:
        messages.append({"role": "system", "content": request.instructions})
        sources.append("instructions")
    messages += previous
    sources += ["previous_response_id"] * len(previous)
    if isinstance(request.input, str):
        messages.append({"role": "user", "content": request.input})
        sources.append("input")
    else:
        reasoning: tuple[int, str] | None = None  # a reasoning item waiting for its assistant message
        for index, item in enumerate(request.input):
            kind = item.type or "message"
            _check_item_fields(index, item, kind)
            if kind == "reasoning":
                if reasoning is not None:
                    raise _misplaced_reasoning(reasoning[0])
                reasoning = (index, _reasoning_text(index, item))
                continue
            if kind == "function_call":
                call = tool_call(index, item)
                last = len(messages) - 1
                if reasoning is None and last >= 0 and messages[last]["role"] == "assistant" and \
                        sources[last].startswith("input["):
                    # One more call of the assistant turn right before it (a response's output lists
                    # its message, then its calls).
                    messages[last].setdefault("tool_calls", []).append(call)
                    call_sources.setdefault(last, []).append(f"input[{index}]")
                    continue
                call_sources[len(messages)] = [f"input[{index}]"]
                message = {"role": "assistant", "content": None, "tool_calls": [call]}
            elif kind == "function_call_output":
                message = tool_message(index, item, _content(f"input[{index}].output", item.output), messages)
            else:
                message = _message(index, item)
            if reasoning is not None:
                if message["role"] != "assistant":
                    raise _misplaced_reasoning(reasoning[0])
                message["reasoning_content"] = reasoning[1]
                reasoning = None
            messages.append(message)
            sources.append(f"input[{index}]")
        if reasoning is not None:
            raise _misplaced_reasoning(reasoning[0])
    if not messages:
        raise RequestFieldError("input: the conversation is empty (no instructions, no previous response and no "
                                "input items)", "input")
    return Conversation(messages, sources, call_sources)


def _check_item_fields(index: int, item: InputItem, kind: str) -> None:
    """Refuse a field of another item type (a message's call_id, a reasoning item's role)."""
    allowed = ("type", "id", "status", *ITEM_FIELDS[kind])
    for name in type(item).model_fields:
        if name not in allowed and getattr(item, name) is not None:
            raise RequestFieldError(f"input[{index}].{name}: a {kind} item has no {name}", f"input[{index}].{name}")


def _misplaced_reasoning(index: int) -> RequestFieldError:
    return RequestFieldError(f"input[{index}]: a reasoning item goes right before the assistant message it led to",
                             f"input[{index}]")


def _message(index: int, item: InputItem) -> dict[str, Any]:
    where = f"input[{index}]"
    if item.role not in ROLES:
        got = "none" if item.role is None else repr(item.role)
        raise RequestFieldError(f"{where}.role: a message's role is user, system, developer or assistant, got {got}",
                                f"{where}.role")
    if item.content is None:
        raise RequestFieldError(f"{where}.content: a message needs content, a string or a list of input_text parts",
                                f"{where}.content")
    return {"role": ROLES[item.role], "content": _content(f"{where}.content", item.content)}


def _content(path: str, content: Any) -> Any:
    """A message's content (a function_call_output's output): a string, or text parts."""
    if isinstance(content, list):
        return [{"type": "text", "text": text} for text in _part_texts(path, content)]
    return content


def _part_texts(path: str, parts: list[dict[str, Any]]) -> list[str]:
    """The texts of a message's content parts: ``input_text``, or ``output_text`` as a response
    returns it (its ``logprobs`` describe that reply and are left out of the prompt; its
    ``annotations`` must be empty, as this server writes them)."""
    texts = []
    for position, part in enumerate(parts):
        where = f"{path}[{position}]"
        kind = part.get("type")
        if kind not in TEXT_PART_TYPES:
            raise RequestFieldError(f"{where}: only text parts (input_text, output_text) are supported (Sparrow "
                                    f"serves text-only models), got type {kind!r}", path, code="unsupported")
        if not isinstance(part.get("text"), str):
            raise RequestFieldError(f"{where}.text: a text part needs its text, a string", path)
        for key, value in part.items():
            if key in ("type", "text") or (kind == "output_text" and key == "logprobs"):
                continue
            if kind == "output_text" and key == "annotations":
                if value:
                    raise not_supported(f"{where}.annotations", "non-empty annotations")
                continue
            raise refuse_key(f"{where}.{key}", key)
        texts.append(part["text"])
    return texts


def _reasoning_text(index: int, item: InputItem) -> str:
    where = f"input[{index}]"
    if item.encrypted_content is not None:
        raise not_supported(f"{where}.encrypted_content", "encrypted reasoning")
    if item.summary:
        raise not_supported(f"{where}.summary", "reasoning summaries", "; send the reasoning as content "
                            '[{"type": "reasoning_text", "text": ...}]')
    parts = item.content if isinstance(item.content, list) else []
    if isinstance(item.content, str):
        raise RequestFieldError(f'{where}.content: a list of {{"type": "reasoning_text", "text": ...}} parts',
                                f"{where}.content")
    texts = []
    for position, part in enumerate(parts):
        if part.get("type") != "reasoning_text" or not isinstance(part.get("text"), str):
            raise RequestFieldError(f'{where}.content[{position}]: a reasoning part is {{"type": "reasoning_text", '
                                    '"text": str}', f"{where}.content")
        for key in part:
            if key not in ("type", "text"):
                raise refuse_key(f"{where}.content[{position}].{key}", key)
        texts.append(part["text"])
    return "\n".join(texts)


# -- the chat request -----------------------------------------------------------------------
# OpenAI's reasoning efforts, passed to the chat template as its reasoning_effort (as on chat).
REASONING_EFFORTS = get_args(ReasoningEffort)


def chat_request_of(request: ResponsesRequest, conversation: Conversation) -> ChatCompletionRequest:
    """The chat endpoint's request for this one: its messages, sampling fields and structured output."""
    body: dict[str, Any] = {"model": request.model, "messages": conversation.messages,
                            "max_completion_tokens": request.max_output_tokens, "stream": bool(request.stream)}
    for name in CHAT_PASS_THROUGH:
        body[name] = getattr(request, name)
    body.update(chat_tool_fields(request))
    if wants_logprobs(request):
        body.update(logprobs=True, top_logprobs=request.top_logprobs or 0)
    if request.reasoning and request.reasoning.get("effort") is not None:
        body["reasoning_effort"] = request.reasoning["effort"]
    fmt = request.text.format if request.text is not None else None
    if fmt is not None and fmt.type != "text":
        body["response_format"] = {"type": fmt.type}
        if fmt.type == "json_schema":
            body["response_format"]["json_schema"] = {"name": fmt.name, "description": fmt.description,
                                                      "schema": fmt.json_schema, "strict": fmt.strict}
    try:
        return ChatCompletionRequest.model_validate(body)
    except ValidationError as exc:  # checked above with the same bounds; a safety net naming the input
        raise RequestFieldError(f"input: {exc.errors()[0].get('msg')}", "input") from None


# -- errors in the client's words -----------------------------------------------------------
_MESSAGE = re.compile(r"\bmessages\[(\d+)\](?:\.tool_calls\[(\d+)\](?:\.function)?)?(\.[a-z_]+)?")
_RENAMES = [(re.compile(r"\b(tools\[\d+\])\.function\b"), r"\1"),
            (re.compile(r"\bresponse_format\.json_schema\.schema\b"), "text.format.schema"),
            (re.compile(r"\bresponse_format(\.json_schema)?\b"), "text.format"),
            (re.compile(r"\bmax_(completion_)?tokens\b"), "max_output_tokens"),
            (re.compile(r"^messages\b"), "input")]


def in_responses_words(exc: APIError, conversation: Conversation) -> APIError:
    """An error of the chat machinery with this request's field names: ``messages[k].content`` as
    where the client wrote message k (``input[2].content``; ``instructions``,
    ``previous_response_id`` or a string ``input`` as they are), a tool call's
    ``messages[k].tool_calls[j].function.arguments`` as its function_call item's
    ``input[i].arguments``, ``tools[i].function.parameters`` as ``tools[i].parameters``,
    ``response_format`` as ``text.format``, ``max_tokens`` as ``max_output_tokens``."""
    sources = conversation.sources

    def source(match: re.Match[str]) -> str:
        index = int(match.group(1))
        where = sources[index] if index < len(sources) else "input"
        calls = conversation.call_sources.get(index)
        if calls is not None and match.group(2) is not None and int(match.group(2)) < len(calls):
            where = calls[int(match.group(2))]
        return where + (match.group(3) or "") if where.startswith("input[") else where

    def rename(text: str) -> str:
        text = _MESSAGE.sub(source, text)
        for pattern, name in _RENAMES:
            text = pattern.sub(name, text)
        return text

    param = None if exc.param is None else rename(exc.param)
    return APIError(exc.status_code, rename(exc.message), exc.err_type, param=param, code=exc.code)
