"""``pythonic``: calls written as a Python list, ``[get_weather(city="Paris", days=3), get_time()]``,
optionally wrapped as ``<|python_start|>[...]<|python_end|>`` (Llama 3.2, Llama 4 and other models
whose chat templates ask for this; vLLM's ``--tool-call-parser pythonic``).

An output is calls when it starts (after whitespace) with ``[`` or ``<|python_start|>[``; the list
must then parse, with :mod:`ast`, as calls of plain names with keyword arguments only, each value a
Python literal (strings, numbers, ``True``/``False``/``None``, lists, tuples, dicts), which become
the call's JSON arguments object (``True`` -> ``true``, ``None`` -> ``null``). Text after the
list's closing ``]`` (a ``<|python_end|>``, or anything else) is not part of the reply. Anything
else is the answer, whole: an output that does not open a list, a list that is not calls
(``[1, 2]``, ``[see above]``, positional arguments, attribute calls, expressions, ``**kwargs``,
values JSON cannot hold such as sets or bytes), or a list the output never closes.

Streaming differs from vLLM's parser, which re-parses the unfinished list after each delta (closing
it tentatively) and streams each call's name and argument text as they grow. Here everything from
the opening ``[`` is held back until the list's top-level ``]`` arrives (the scan follows brackets,
strings and comments, so a ``]`` inside a string does not end it); then the list is parsed once
and every call goes out at once, each as one delta with its index, id, name and whole arguments.
Whether the text is calls at all cannot be known before the list closes (``[f(x=1), 2]`` is
answer text), and a stream cannot take back what it sent, so this is what keeps a stream's content
and calls exactly those of :meth:`extract_tool_calls` on the same text. The scan gives up early,
and the held text goes out as content, as soon as the list cannot be calls (``[1``, ``[see``,
``[f.x``); an output that does not start with a list streams as content at once; one that ends
inside the list sends the held text as content at :meth:`finish`.
"""

from __future__ import annotations

import ast
import json
import warnings
from typing import Any

from sparrow.entrypoints.openai.markers import opens_with
from sparrow.entrypoints.openai.tool_parsers.base import (
    ExtractedToolCalls,
    ParsedToolCall,
    ToolCallDelta,
    ToolParser,
    ToolStreamDelta,
    new_tool_call_id,
)

_WHITESPACE = " \t\r\n\f\v"
_CLOSERS = {")": "(", "]": "[", "}": "{"}


def _starts_name(char: str) -> bool:
    return char.isidentifier()


def _continues_name(char: str) -> bool:
    return ("_" + char).isidentifier()


class _ListScanner:
    """Finds where a Python list of calls ends, in text that arrives in pieces.

    Fed the same growing text each time, it scans on from where it stopped (at first, the list's
    opening ``[``). At the list's own level it checks the shape ``name(...), name(...)``; inside
    a call's parentheses it follows brackets, strings (both quotes, triple quotes, escapes) and
    comments only, leaving the rest to :mod:`ast`. ``end`` is set when the list closes, ``failed``
    when the text cannot be a list of calls.
    """

    def __init__(self, start: int) -> None:
        self.start = self.pos = start  # where the list's "[" is in the text
        self.end: int | None = None  # just past the closing "]"
        self.failed = False
        self._stack: list[str] = []
        self._quote: str | None = None  # the open string's quotes: ', ", ''' or """
        self._comment = False
        # The list's own level: "first" (after "["), "name", "paren" (a name, then space),
        # "after_call" (expect "," or "]"), "next" (after ",": a name or "]").
        self._level = "first"

    def scan(self, text: str) -> None:
        i = self.pos
        while i < len(text) and self.end is None and not self.failed:
            step = self._char(text, i)
            if step == 0:  # needs to see further text first
                break
            i += step
        self.pos = i

    def _char(self, text: str, i: int) -> int:
        """Consume the text at ``i``; returns how many characters, 0 to wait for more text."""
        char = text[i]
        if not self._stack:  # the opening "["
            self._stack.append(char)
            return 1
        if self._comment:
            self._comment = char not in "\r\n"
            return 1
        if self._quote is not None:
            return self._in_string(text, i)
        if char == "#":
            self._comment = True
            if len(self._stack) == 1 and self._level == "name":
                self._level = "paren"
            return 1
        if len(self._stack) == 1:
            self._at_list_level(char, i)
            return 1
        if char in "'\"":
            if len(text) < i + 3:  # one quote or three? Wait to see
                return 0
            self._quote = char * 3 if text[i:i + 3] == char * 3 else char
            return len(self._quote)
        if char in "([{":
            self._stack.append(char)
        elif char in _CLOSERS:
            if self._stack.pop() != _CLOSERS[char]:
                self.failed = True
            elif len(self._stack) == 1:
                self._level = "after_call"
        return 1

    def _in_string(self, text: str, i: int) -> int:
        quote = self._quote
        assert quote is not None
        char = text[i]
        if char == "\\":
            return 2 if i + 1 < len(text) else 0  # the escaped character is part of the string
        if len(quote) == 1:
            if char in "\r\n":  # a one-quote string cannot span lines
                self.failed = True
            elif char == quote:
                self._quote = None
            return 1
        if char == quote[0]:
            if len(text) < i + 3:
                return 0
            if text[i:i + 3] == quote:
                self._quote = None
                return 3
        return 1

    def _at_list_level(self, char: str, i: int) -> None:
        level = self._level
        if char in _WHITESPACE:
            if level == "name":
                self._level = "paren"
        elif level in ("first", "next") and _starts_name(char):
            self._level = "name"
        elif level == "name" and _continues_name(char):
            pass
        elif level in ("name", "paren") and char == "(":
            self._stack.append(char)
        elif level == "after_call" and char == ",":
            self._level = "next"
        elif level in ("after_call", "next") and char == "]":
            self._stack.pop()
            self.end = i + 1
        else:
            self.failed = True


def _literal_arguments(call: ast.expr) -> str | None:
    """The JSON arguments object of one call node, None when it is not a call we take."""
    if not isinstance(call, ast.Call) or not isinstance(call.func, ast.Name) or call.args:
        return None
    arguments: dict[str, Any] = {}
    for keyword in call.keywords:
        if keyword.arg is None:  # **kwargs
            return None
        arguments[keyword.arg] = ast.literal_eval(keyword.value)
    text = json.dumps(arguments, ensure_ascii=False, allow_nan=False)
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:  # a lone surrogate from an escape: keep it escaped
        text = json.dumps(arguments, allow_nan=False)
    return text


def parse_call_list(source: str) -> list[tuple[str, str]] | None:
    """``[name(key=literal, ...), ...]`` as (name, JSON arguments) pairs; None when ``source`` is
    not such a list (including an empty one)."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # invalid escape sequences and the like
            tree = ast.parse(source.strip(), mode="eval")
        if not isinstance(tree.body, ast.List) or not tree.body.elts:
            return None
        calls = []
        for node in tree.body.elts:
            arguments = _literal_arguments(node)
            if arguments is None:
                return None
            assert isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
            calls.append((node.func.id, arguments))
        return calls
    except (SyntaxError, ValueError, TypeError, RecursionError, MemoryError):
        return None


class PythonicToolParser(ToolParser):
    python_start = "<|python_start|>"

    def __init__(self, tokenizer: Any = None, request: Any = None) -> None:
        super().__init__(tokenizer, request)
        self.text = ""
        self.calls: list[ParsedToolCall] = []
        self._phase = "open"  # open -> tagged? -> list -> (calls | text)
        self._tag_end = 0
        self._scanner: _ListScanner | None = None
        self._content_sent = 0

    # -- the interface ----------------------------------------------------------------------------
    def feed(self, text: str) -> ToolStreamDelta:
        self.text += text
        return self._run(final=False)

    def finish(self) -> ToolStreamDelta:
        return self._run(final=True)

    def extract_tool_calls(self, text: str) -> ExtractedToolCalls:
        self.feed(text)
        self.finish()
        if self._phase == "calls":
            return ExtractedToolCalls(list(self.calls), None)
        return ExtractedToolCalls([], text or None)

    # -- the steps --------------------------------------------------------------------------------
    def _run(self, final: bool) -> ToolStreamDelta:
        out = ToolStreamDelta()
        if self._phase == "open":
            self._open(final)
        if self._phase == "tagged":
            self._tagged(final)
        if self._phase == "list":
            self._list(final, out)
        if self._phase == "text":
            out.content = self.text[self._content_sent:]
            self._content_sent = len(self.text)
        return out  # "calls": the rest is not part of the reply

    def _open(self, final: bool) -> None:
        stripped = self.text.lstrip()
        if stripped.startswith("["):
            self._scanner = _ListScanner(len(self.text) - len(stripped))
            self._phase = "list"
            return
        tagged = opens_with(self.text, self.python_start, final=final)
        if tagged:
            self._tag_end = len(self.text) - len(stripped) + len(self.python_start)
            self._phase = "tagged"
        elif tagged is False:
            self._phase = "text"

    def _tagged(self, final: bool) -> None:
        rest = self.text[self._tag_end:]
        stripped = rest.lstrip()
        if stripped.startswith("["):
            self._scanner = _ListScanner(len(self.text) - len(stripped))
            self._phase = "list"
        elif stripped or final:
            self._phase = "text"

    def _list(self, final: bool, out: ToolStreamDelta) -> None:
        scanner = self._scanner
        assert scanner is not None
        scanner.scan(self.text)
        if scanner.failed or (scanner.end is None and final):
            self._phase = "text"
            return
        if scanner.end is None:
            return
        parsed = parse_call_list(self.text[scanner.start:scanner.end])
        if parsed is None:
            self._phase = "text"
            return
        self._phase = "calls"
        for index, (name, arguments) in enumerate(parsed):
            call = ParsedToolCall(new_tool_call_id(), name, arguments)
            self.calls.append(call)
            out.tool_calls.append(ToolCallDelta(index=index, arguments=arguments, id=call.id, name=name))
