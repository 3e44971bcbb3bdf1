"""The output of ``tool_choice: "required"`` and of a named function, as tool calls.

Both are generated under a JSON grammar (``tool_calling``), so their text is known to be valid:

    required   ``[{"name": "f", "parameters": {...}}, ...]``, one call per element
    named      the arguments object itself; the call's name is the one the request named

These are not registered (a request's tool_choice picks them, not ``--tool-call-parser``).
"""

from __future__ import annotations

from typing import Any

from sparrow.entrypoints.openai.tool_parsers.base import ExtractedToolCalls, ParsedToolCall, StreamingToolParser

_WHITESPACE = " \t\r\n"


class _ForcedParser(StreamingToolParser):
    """The text is calls by construction: a whole response reports exactly what a stream sent,
    including a call cut short by max_tokens (its arguments then end early, and finish_reason is
    "length"), never the text as an answer."""

    def extract_tool_calls(self, text: str) -> ExtractedToolCalls:
        self.feed(text)
        self.finish()
        calls = list(self.calls)
        if self._current is not None:
            calls.append(ParsedToolCall(self._current.id, self._current.name, self._arguments_sent))
        return ExtractedToolCalls(calls, None)

    def _fail(self, reason: str) -> None:
        super()._fail(reason)
        self._as_text, self._dropped = False, True  # never an answer, even cut short before a name


class RequiredToolCallsParser(_ForcedParser):
    """A JSON array of ``{"name", "parameters"}`` objects."""

    arg_keys = ("parameters",)

    def __init__(self, tokenizer: Any = None, request: Any = None) -> None:
        super().__init__(tokenizer, request)
        self._phase = "open"  # open -> element -> call -> after -> element ... -> rest

    def _step(self, final: bool) -> bool:
        if self._phase == "call":
            outcome = self._scan_call(final)
            if outcome == "done":
                self._phase = "after"
            return outcome != "wait"
        text = self.text
        while self.pos < len(text) and text[self.pos] in _WHITESPACE:
            self.pos += 1
        if self.pos == len(text):
            return False
        char = text[self.pos]
        expected = {"open": "[", "element": "{", "after": ",]", "rest": ""}[self._phase]
        if self._phase == "rest":
            self.pos = len(text)
            return False
        if char not in expected:
            self._fail(f"unexpected {char!r} in the array of tool calls")
            return True
        if self._phase == "element":
            self._phase = "call"
            self._start_scanning()
            return True
        self.pos += 1
        self._phase = {"[": "element", ",": "element", "]": "rest"}[char]
        return True


class NamedToolCallParser(_ForcedParser):
    """All the text is the arguments of one call to ``name``, announced before its first piece."""

    def __init__(self, tokenizer: Any = None, request: Any = None, *, name: str) -> None:
        super().__init__(tokenizer, request)
        self.name = name

    def _step(self, final: bool) -> bool:
        if self._current is None and not self.calls:
            self._announce(self.name)
        if self._current is not None:
            self._send_arguments(self.text)
            if final:
                self._current.arguments = self.text
                self.calls.append(self._current)
                self._current = None
        self.pos = len(self.text)
        return False
