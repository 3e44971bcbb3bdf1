"""From a chat choice's generated text to its reply: reasoning, answer and tool calls.

Each choice's text goes through up to two parsers, in this order:

    text -> reasoning parser (--reasoning-parser)  -> reasoning_content
                         \\-> the answer -> tool parser (tool_choice) -> content, tool_calls

A whole response parses the whole text; a stream feeds every delta through the same parsers,
which hold back only what may still be a marker, so the pieces of a stream add up to the whole
response (for outputs that are what the parsers expect).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from sparrow.entrypoints.openai.protocol import (
    ChatResponseMessage,
    DeltaFunctionCall,
    DeltaMessage,
    DeltaToolCall,
    FunctionCall,
    ToolCall,
)
from sparrow.entrypoints.openai.tool_calling import ToolChoice
from sparrow.entrypoints.openai.tool_parsers.base import ParsedToolCall, ToolCallDelta, ToolParser
from sparrow.entrypoints.openai.tool_parsers.forced import NamedToolCallParser, RequiredToolCallsParser


@dataclass(slots=True)
class ReplyParsers:
    """What shapes the choices of one request (built by the endpoint, one per request)."""

    request: Any  # ChatCompletionRequest
    tool_choice: ToolChoice
    prompt_token_ids: Sequence[int]
    tokenizer: Any = None
    reasoner: Any = None  # a ReasoningParser, or None
    tool_parser_cls: type[ToolParser] | None = None  # for tool_choice auto

    def _tool_parser(self) -> ToolParser | None:
        kind = self.tool_choice.kind
        if kind == "auto" and self.tool_parser_cls is not None:
            return self.tool_parser_cls(self.tokenizer, self.request)
        if kind == "required":
            return RequiredToolCallsParser(self.tokenizer, self.request)
        if kind == "named":
            return NamedToolCallParser(self.tokenizer, self.request, name=self.tool_choice.name)
        return None

    @property
    def one_call(self) -> bool:
        return self.request.parallel_tool_calls is False

    def finish_reason(self, reason: str | None, called: bool) -> str | None:
        """OpenAI's finish reason: tool_calls when a required or auto reply ended with calls."""
        if reason == "stop" and called and self.tool_choice.kind in ("auto", "required"):
            return "tool_calls"
        return reason

    # -- a whole response -----------------------------------------------------------------------
    def message(self, role: str, echo: str, text: str) -> tuple[ChatResponseMessage, bool]:
        """The reply message of a choice whose whole text is ``text``, and whether it called tools."""
        reasoning, answer = None, text
        if self.reasoner is not None:
            reasoning, answer = self.reasoner.extract_reasoning(text, self.prompt_token_ids)
            answer = answer or ""
        calls: list[ParsedToolCall] = []
        parser = self._tool_parser()
        if parser is not None:
            extracted = parser.extract_tool_calls(answer)
            calls, answer = extracted.tool_calls, extracted.content or ""
            if self.one_call:
                calls = calls[:1]
        content: str | None = echo + answer
        if not content and (calls or reasoning is not None):
            content = None
        message = ChatResponseMessage(
            role=role, content=content,
            reasoning_content=reasoning if self.request.include_reasoning else None,
            tool_calls=[ToolCall(id=call.id, function=FunctionCall(name=call.name, arguments=call.arguments))
                        for call in calls])
        return message, bool(calls)

    def stream(self) -> ChoiceStream:
        reasoning = self.reasoner.new_stream(self.prompt_token_ids) if self.reasoner is not None else None
        return ChoiceStream(self, reasoning, self._tool_parser())


@dataclass(slots=True)
class ChoiceStream:
    """One choice of a stream: feed it each delta of text, get the delta message to send."""

    parsers: ReplyParsers
    reasoning: Any  # a ReasoningStream, or None
    tools: ToolParser | None
    called: bool = False  # whether a tool call went out

    def feed(self, text: str, final: bool) -> DeltaMessage | None:
        """The delta for the next piece of text (``final``: the choice ends with it); None when
        nothing can be sent yet."""
        reasoning, answer = "", text
        if self.reasoning is not None:
            pieces = [self.reasoning.feed(text)] + ([self.reasoning.finish()] if final else [])
            reasoning = "".join(piece.reasoning for piece in pieces)
            answer = "".join(piece.content for piece in pieces)
        content, calls = answer, []
        if self.tools is not None:
            pieces = [self.tools.feed(answer)] + ([self.tools.finish()] if final else [])
            content = "".join(piece.content for piece in pieces)
            calls = [call for piece in pieces for call in piece.tool_calls]
            if self.parsers.one_call:
                calls = [call for call in calls if call.index == 0]
        self.called = self.called or bool(calls)
        if not self.parsers.request.include_reasoning:
            reasoning = ""
        if not (content or reasoning or calls):
            return None
        return DeltaMessage(content=content or None, reasoning_content=reasoning or None,
                            tool_calls=[_delta_tool_call(call) for call in calls] or None)


def _delta_tool_call(call: ToolCallDelta) -> DeltaToolCall:
    if call.name is not None:
        return DeltaToolCall(index=call.index, id=call.id, type="function",
                             function=DeltaFunctionCall(name=call.name, arguments=call.arguments))
    return DeltaToolCall(index=call.index, function=DeltaFunctionCall(arguments=call.arguments))
