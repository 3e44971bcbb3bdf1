"""Tool calling on the chat endpoint: what a request's ``tools`` and ``tool_choice`` ask for.

    tool_choice       how the calls are made                        finish_reason with calls
    none              not at all: a text reply (the tools still reach the template)
    auto              the model writes calls its own way; the server's tool parser
                      (``--tool-call-parser``) finds them in the text  tool_calls
    required          generated under a JSON grammar: an array of
                      ``{"name", "parameters"}``, one per call          tool_calls
    {"type": "function", "function": {"name": f}}
                      generated under the JSON grammar of f's
                      ``parameters``: the text is the arguments         stop (as OpenAI and vLLM)

``auto`` is the default when tools are given, as in OpenAI's API and vLLM, and like vLLM it needs
the server started with ``--enable-auto-tool-choice`` and ``--tool-call-parser``. ``required``
yields at most ``MAX_PARALLEL_TOOL_CALLS`` calls, exactly one with ``parallel_tool_calls: false``;
``auto`` with ``parallel_tool_calls: false`` keeps the first call the parser finds.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from sparrow.entrypoints.openai.request_checks import RequestFieldError
from sparrow.sampling_params import StructuredOutputsParams

# The bound on calls in one "required" reply: the array's maxItems. A weak model may otherwise
# keep adding calls until max_tokens.
MAX_PARALLEL_TOOL_CALLS = 8
_EMPTY_PARAMETERS: dict[str, Any] = {"type": "object", "properties": {}}


@dataclass(slots=True)
class ToolChoice:
    """A request's resolved tool_choice: ``kind`` is none, auto, required or named; ``name`` the
    function a named choice calls."""

    kind: str
    name: str | None = None

    @property
    def forced(self) -> bool:
        """Whether the calls are generated under a grammar (required, named)."""
        return self.kind in ("required", "named")


def resolve_tool_choice(request: Any, *, auto_enabled: bool) -> ToolChoice:
    """The request's tool_choice, checked against its tools and the server's flags; a
    RequestFieldError (400) naming tool_choice or tools when they disagree.

    ``auto_enabled``: the server runs with --enable-auto-tool-choice and a --tool-call-parser.
    """
    tools = request.tools or []
    choice = request.tool_choice
    if choice is None:
        choice = "auto" if tools else "none"
    if not isinstance(choice, str):  # a NamedToolChoice
        name = choice.function.name if choice.function is not None else None
        if choice.type != "function" or not name:
            raise RequestFieldError("tool_choice: a named tool choice is {\"type\": \"function\", \"function\": "
                                    "{\"name\": \"...\"}}", "tool_choice")
        names = [tool.function.name for tool in tools]
        if not tools:
            raise RequestFieldError(f"tool_choice: function {name!r} is named but the request has no tools",
                                    "tool_choice")
        if name not in names:
            raise RequestFieldError(f"tool_choice: function {name!r} is not among the tools ({', '.join(names)})",
                                    "tool_choice")
        return ToolChoice("named", name)
    if choice == "none":
        return ToolChoice("none")
    if not tools:
        raise RequestFieldError(f"tool_choice: {choice!r} needs tools", "tool_choice")
    if choice == "auto" and not auto_enabled:
        raise RequestFieldError('tool_choice: "auto" tool choice requires --enable-auto-tool-choice and '
                                "--tool-call-parser to be set when the server starts (tool_choice \"auto\" is the "
                                "default when tools are given; send \"none\", \"required\" or a named function "
                                "otherwise)", "tool_choice", code="unsupported")
    return ToolChoice(choice)


def _parameters(tool: Any) -> dict[str, Any]:
    parameters = tool.function.parameters
    return parameters if parameters else dict(_EMPTY_PARAMETERS)


def _call_schema(tool: Any) -> dict[str, Any]:
    """One element of the "required" array: a call of this tool."""
    return {"type": "object", "properties": {"name": {"type": "string", "enum": [tool.function.name]},
                                             "parameters": _parameters(tool)},
            "required": ["name", "parameters"], "additionalProperties": False}


def required_schema(tools: list[Any], parallel_tool_calls: bool) -> dict[str, Any]:
    """The JSON schema of a "required" reply: an array of calls, each of one of the tools."""
    calls = [_call_schema(tool) for tool in tools]
    return {"type": "array", "minItems": 1, "maxItems": MAX_PARALLEL_TOOL_CALLS if parallel_tool_calls else 1,
            "items": calls[0] if len(calls) == 1 else {"anyOf": calls}}


def tool_structured_outputs(request: Any, choice: ToolChoice) -> StructuredOutputsParams | None:
    """The grammar that enforces a required or named choice (None for none and auto), checked
    like any structured output: a bad parameters schema is a 400 naming tools. Blocking (the
    first check imports xgrammar): the endpoint runs it off the event loop."""
    from sparrow.structured_output.grammar import check_structured_outputs

    if not choice.forced:
        return None
    formatted = request.response_format is not None and request.response_format.type != "text"
    if formatted or any(getattr(request, name, None) is not None
                        for name in ("structured_outputs", "guided_json", "guided_regex", "guided_choice",
                                     "guided_grammar")):
        raise RequestFieldError(f"tool_choice: {choice.kind if choice.kind == 'required' else 'a named function'} "
                                "is generated under its own grammar, so it cannot be combined with response_format "
                                "or another structured output", "tool_choice")
    tools = request.tools
    if choice.kind == "named":
        tool = next(tool for tool in tools if tool.function.name == choice.name)
        schema = _parameters(tool)
        where = f"tools[{tools.index(tool)}].function.parameters"
    else:
        schema = required_schema(tools, request.parallel_tool_calls is not False)
        where = "tools"
    try:
        params = StructuredOutputsParams(json=schema)
        check_structured_outputs(params)
    except (TypeError, ValueError) as exc:
        raise RequestFieldError(f"{where}: not a JSON schema the grammar accepts: {exc}", "tools") from None
    return params
