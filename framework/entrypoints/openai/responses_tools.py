"""Function tools on ``/v1/responses``: the request's ``tools`` and ``tool_choice`` checked and
handed to the chat endpoint's tool calling (``tool_calling``), and the tool items of ``input``.

    tools [{"type": "function", "name", "description"?, "parameters"?, "strict"?}]
                          -> chat's [{"type": "function", "function": {name, description, ...}}]
    tool_choice           "auto" | "none" | "required" as they are; {"type": "function", "name": f}
                          -> {"type": "function", "function": {"name": f}}; "auto" and "none"
                          without tools ask for nothing (the chat endpoint would refuse "auto")
    parallel_tool_calls   as it is
    function_call item    -> a tool call of an assistant message
    function_call_output  -> a tool message answering a call made earlier in the conversation

Other tool types (web_search, file_search, mcp, ...) are refused naming ``tools[i].type``. The
chat endpoint then resolves the choice with its own refusals ("auto" needs the server's
--enable-auto-tool-choice, a named function must be among the tools, ...).
"""

from __future__ import annotations

from typing import Any

from pydantic import ValidationError

from sparrow.entrypoints.openai.protocol_responses import FunctionTool, InputItem, ResponsesRequest
from sparrow.entrypoints.openai.request_checks import RequestFieldError, not_supported, refuse_key

TOOL_CHOICES = ("auto", "none", "required")
_NAMED = '{"type": "function", "name": "..."}'


def check_tools(request: ResponsesRequest) -> None:
    """Refuse, naming the field, a tool that is not a well-formed function tool and a tool_choice
    that is none of OpenAI's function choices."""
    function_tools(request.tools)
    choice = request.tool_choice
    if isinstance(choice, str) and choice not in TOOL_CHOICES:
        raise RequestFieldError(f"tool_choice: auto, none, required or a named function {_NAMED}, got {choice!r}",
                                "tool_choice")
    if isinstance(choice, dict):
        _named_function(choice)


def function_tools(tools: list[dict[str, Any]] | None) -> list[FunctionTool]:
    checked = []
    for index, tool in enumerate(tools or ()):
        where = f"tools[{index}]"
        kind = tool.get("type")
        if kind != "function":
            raise not_supported(f"{where}.type", f"a tool of type {kind!r}", "; supported: function")
        if "function" in tool:
            raise RequestFieldError(f"{where}.function: a function tool of the Responses API is flat, "
                                    '{"type": "function", "name": ..., "parameters": {...}} (the chat endpoint nests '
                                    "it under function)", f"{where}.function")
        try:
            function = FunctionTool.model_validate(tool)
        except ValidationError as exc:
            error = exc.errors()[0]
            field = ".".join([where, *(str(part) for part in error["loc"][:1])])
            raise RequestFieldError(f"{field}: {error['msg']}", field) from None
        for key in function.model_extra or {}:
            raise refuse_key(f"{where}.{key}", key)
        checked.append(function)
    return checked


def _named_function(choice: dict[str, Any]) -> str:
    if choice.get("type") != "function":
        raise not_supported("tool_choice", f"a tool choice of type {choice.get('type')!r}",
                            f"; supported: auto, none, required, {_NAMED}")
    for key in choice:
        if key == "function":
            raise RequestFieldError(f"tool_choice.function: a named tool choice of the Responses API is {_NAMED} "
                                    "(the chat endpoint nests the name under function)", "tool_choice")
        if key not in ("type", "name"):
            raise refuse_key(f"tool_choice.{key}", key)
    name = choice.get("name")
    if not isinstance(name, str) or not name:
        raise RequestFieldError(f"tool_choice: a named tool choice is {_NAMED}", "tool_choice")
    return name


def chat_tool_fields(request: ResponsesRequest) -> dict[str, Any]:
    """The chat request's tools, tool_choice and parallel_tool_calls."""
    fields: dict[str, Any] = {"parallel_tool_calls": request.parallel_tool_calls}
    tools = function_tools(request.tools)
    if tools:
        fields["tools"] = [{"type": "function", "function": tool.model_dump(exclude={"type"})} for tool in tools]
    choice = request.tool_choice
    if isinstance(choice, dict):
        fields["tool_choice"] = {"type": "function", "function": {"name": _named_function(choice)}}
    elif choice is not None and (tools or choice not in ("auto", "none")):
        fields["tool_choice"] = choice
    return fields


# -- input items ---------------------------------------------------------------------------------
def _required(where: str, item: InputItem, name: str) -> Any:
    value = getattr(item, name)
    if value is None:
        raise RequestFieldError(f"{where}.{name}: a {item.type} item needs {name}", f"{where}.{name}")
    return value


def tool_call(index: int, item: InputItem) -> dict[str, Any]:
    """A function_call item as the chat endpoint's tool call (its arguments are checked, as JSON,
    when the conversation is rendered)."""
    where = f"input[{index}]"
    return {"id": _required(where, item, "call_id"), "type": "function",
            "function": {"name": _required(where, item, "name"), "arguments": _required(where, item, "arguments")}}


def tool_message(index: int, item: InputItem, content: Any, messages: list[dict[str, Any]]) -> dict[str, Any]:
    """A function_call_output item as the chat endpoint's tool message; ``content`` is its output,
    ``messages`` the conversation before it, where the call it answers must be."""
    where = f"input[{index}]"
    call_id = _required(where, item, "call_id")
    _required(where, item, "output")
    if not any(call.get("id") == call_id for message in messages for call in message.get("tool_calls") or ()):
        raise RequestFieldError(f"{where}.call_id: no function_call with call_id {call_id!r} earlier in the "
                                "conversation (send the call's item, or continue its response with "
                                "previous_response_id)", f"{where}.call_id")
    return {"role": "tool", "tool_call_id": call_id, "content": content}
