"""Scan one tool call's JSON object, ``{"name": "f", "arguments": {...}}``, as its characters arrive.

A stream must name a call as soon as its name is complete and pass its arguments on as they are
written, long before the object closes. This scanner follows the object's top level (keys,
values, nesting inside values, strings and escapes) character by character, and knows at every
moment the call's name (once its string closed) and the raw text of its arguments so far. The
arguments are passed on as the model wrote them, so the pieces of a stream add up to exactly the
text a whole response reports. When the object closes it is checked with ``json.loads``.

Positions are indexes into the text the caller keeps growing; the scanner holds no copy.
"""

from __future__ import annotations

import json

_WHITESPACE = " \t\r\n"


class CallObjectScanner:
    """One call object, from its (optional leading whitespace and) ``{`` to its ``}``.

    ``arg_keys``: the keys whose value is the arguments (hermes writes ``arguments``, Llama 3
    ``parameters``). After :meth:`scan`: ``name`` (str, once complete), ``done`` (the object
    closed and checked), ``failed`` (why it is not a call, or None).
    """

    def __init__(self, arg_keys: tuple[str, ...] = ("arguments",)) -> None:
        self.arg_keys = arg_keys
        self.name: str | None = None
        self.done = False
        self.failed: str | None = None
        self._phase = "start"
        self._pos = 0  # where scanning continues
        self._object_start = -1
        self._key_start = -1
        self._key: str | None = None
        self._value_start = -1
        self._value_depth = 0  # brackets open inside the current value
        self._in_string = False
        self._escaped = False
        self._args: tuple[int, int] | None = None  # [start, end) of the arguments' text

    def arguments_so_far(self, text: str) -> str:
        """The raw arguments text written so far ("" before they start)."""
        if self._args is not None:
            return text[self._args[0]:self._args[1]]
        if self._phase == "value" and self._key in self.arg_keys:
            return text[self._value_start:self._pos]
        return ""

    def arguments(self, text: str) -> str:
        """The whole arguments text of a done call; ``{}`` when the call has none."""
        return text[self._args[0]:self._args[1]] if self._args is not None else "{}"

    def scan(self, text: str, pos: int) -> int:
        """Consume ``text[pos:]`` up to the end of the object; return where scanning stopped
        (just past the closing brace once done)."""
        self._pos = pos
        end = len(text)
        while self._pos < end and not self.done and self.failed is None:
            char = text[self._pos]
            if self._phase == "value":
                self._value_char(text, char)
            elif self._phase == "key":
                self._key_char(text, char)
            elif char in _WHITESPACE:
                self._pos += 1
            else:
                self._structural_char(text, char)
        return self._pos

    # -- the object's own punctuation ----------------------------------------------------------
    def _structural_char(self, text: str, char: str) -> None:
        phase = self._phase
        if phase == "start":
            if char != "{":
                self.failed = "a tool call is a JSON object"
                return
            self._object_start = self._pos
            self._phase = "first_key"
        elif phase in ("first_key", "next_key"):
            if char == '"':
                self._key_start = self._pos
                self._phase = "key"
            elif char == "}" and phase == "first_key":
                self._close(text)
                return
            else:
                self.failed = f"unexpected {char!r} where a key should be"
                return
        elif phase == "colon":
            if char != ":":
                self.failed = f"unexpected {char!r} after a key"
                return
            self._phase = "value_start"
        elif phase == "value_start":
            self._value_start = self._pos
            self._value_depth = 0
            self._phase = "value"
            return  # the value's first character is scanned as part of the value
        elif phase == "after_value":
            if char == ",":
                self._phase = "next_key"
            elif char == "}":
                self._close(text)
                return
            else:
                self.failed = f"unexpected {char!r} after a value"
                return
        self._pos += 1

    def _key_char(self, text: str, char: str) -> None:
        self._pos += 1
        if self._escaped:
            self._escaped = False
        elif char == "\\":
            self._escaped = True
        elif char == '"':
            try:
                self._key = json.loads(text[self._key_start:self._pos])
            except ValueError:
                self.failed = "a key is not a valid JSON string"
                return
            self._phase = "colon"

    # -- inside a value -------------------------------------------------------------------------
    def _value_char(self, text: str, char: str) -> None:
        if self._in_string:
            self._pos += 1
            if self._escaped:
                self._escaped = False
            elif char == "\\":
                self._escaped = True
            elif char == '"':
                self._in_string = False
                if self._value_depth == 0:
                    self._end_value(text, self._pos)
            return
        if self._value_depth == 0 and (char in ",}" or char in _WHITESPACE):
            self._end_value(text, self._pos)  # a number or literal ended; the char is not the value's
            return
        self._pos += 1
        if char == '"':
            self._in_string = True
        elif char in "{[":
            self._value_depth += 1
        elif char in "}]":
            self._value_depth -= 1
            if self._value_depth == 0:
                self._end_value(text, self._pos)
            elif self._value_depth < 0:
                self.failed = f"unbalanced {char!r}"

    def _end_value(self, text: str, end: int) -> None:
        self._phase = "after_value"
        if self._key == "name":
            try:
                name = json.loads(text[self._value_start:end])
            except ValueError:
                name = None
            if not isinstance(name, str) or not name:
                self.failed = "the call's name is not a non-empty string"
                return
            self.name = name
        elif self._key in self.arg_keys:
            self._args = (self._value_start, end)

    def _close(self, text: str) -> None:
        self._pos += 1
        try:
            call = json.loads(text[self._object_start:self._pos])
        except ValueError as exc:
            self.failed = f"not valid JSON: {exc}"
            return
        if not isinstance(call, dict) or self.name is None:
            self.failed = "the object has no \"name\""
            return
        if self._args is not None and not isinstance(json.loads(self.arguments(text)), dict):
            self.failed = f"the call's {self.arg_keys[0]} are not a JSON object"
            return
        self.done = True


class ArgumentsScanner(CallObjectScanner):
    """A call's arguments alone, one JSON object, for formats that write the name outside the
    JSON (Mistral's ``name[ARGS]{...}``). ``name`` is known from the start; otherwise it reads as a
    :class:`CallObjectScanner` does, as if the object were the value of an "arguments" key, and is
    done (checked with ``json.loads``) when that object closes."""

    def __init__(self, name: str) -> None:
        super().__init__(("arguments",))
        self.name = name
        self._key = "arguments"
        self._phase = "value_start"

    def _structural_char(self, text: str, char: str) -> None:
        if self._phase == "value_start" and char != "{":
            self.failed = "a call's arguments are a JSON object"
            return
        super()._structural_char(text, char)

    def _end_value(self, text: str, end: int) -> None:
        super()._end_value(text, end)
        try:
            json.loads(self.arguments(text))
        except ValueError as exc:
            self.failed = f"the arguments are not valid JSON: {exc}"
            return
        self.done = True
