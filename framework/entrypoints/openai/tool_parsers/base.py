"""The tool-parser interface: from a model's output text to OpenAI tool calls, whole or streamed.

A parser is registered by name (``sparrow_register_tool_parsers``, chosen with
``--tool-call-parser``). The server builds one instance per choice of a request,
``parser_cls(tokenizer, request)``, and either

    feeds it the choice's text as it is generated (``feed`` for each delta, ``finish`` at the
    end), sending what each call returns: answer text, then tool-call deltas in OpenAI's shape
    (a call's first delta carries its index, id and name; the next ones argument fragments); or
    asks for the whole split at once (``extract_tool_calls``).

:class:`StreamingToolParser` does the bookkeeping for parsers written as a small state machine
over the text (the built-in ``hermes`` and ``llama3_json``): subclasses implement ``_step``.
Nothing here imports the HTTP stack.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass, field
from typing import Any

from sparrow.entrypoints.openai.markers import partial_marker_len
from sparrow.entrypoints.openai.tool_parsers.json_scanner import CallObjectScanner


def new_tool_call_id() -> str:
    """A tool call id in vLLM's form."""
    return f"chatcmpl-tool-{uuid.uuid4().hex}"


@dataclass(slots=True)
class ToolCallDelta:
    """A piece of call ``index``: its first piece has ``id`` and ``name``; every piece may add
    argument text."""

    index: int
    arguments: str = ""
    id: str | None = None
    name: str | None = None


@dataclass(slots=True)
class ToolStreamDelta:
    content: str = ""
    tool_calls: list[ToolCallDelta] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.content or self.tool_calls)


@dataclass(slots=True)
class ParsedToolCall:
    id: str
    name: str
    arguments: str  # a JSON object, as text


@dataclass(slots=True)
class ExtractedToolCalls:
    tool_calls: list[ParsedToolCall]
    content: str | None  # the answer text besides the calls, None when there is none


class ToolParser:
    """Base of every tool parser.

    ``keeps_special_tokens``: the parser reads markers that are special tokens (Mistral's
    ``[TOOL_CALLS]``), so a request it parses is decoded with ``skip_special_tokens`` false, as
    vLLM's parsers set it in ``adjust_request`` (:func:`adjust_request`)."""

    keeps_special_tokens: bool = False

    def __init__(self, tokenizer: Any = None, request: Any = None) -> None:
        self.tokenizer = tokenizer
        self.request = request  # the ChatCompletionRequest (tools, tool_choice, ...)

    def feed(self, text: str) -> ToolStreamDelta:
        """The next piece of the choice's text; returns what can be sent for it now."""
        raise NotImplementedError

    def finish(self) -> ToolStreamDelta:
        """The choice has ended: whatever was held back."""
        raise NotImplementedError

    def extract_tool_calls(self, text: str) -> ExtractedToolCalls:
        """The tool calls and the answer text of a whole choice."""
        raise NotImplementedError


def adjust_request(parser_cls: type[ToolParser] | None, request: Any, tool_choice_kind: str,
                   reasoner: Any = None) -> None:
    """Before the request is submitted: decode it with special tokens when ``parser_cls`` will
    parse its reply (``tool_choice`` auto) and reads special-token markers, or when the
    ``reasoner`` (the engine's reasoning parser) does (Mistral's ``[THINK]``)."""
    if tool_choice_kind == "auto" and parser_cls is not None and parser_cls.keeps_special_tokens:
        request.skip_special_tokens = False
    if reasoner is not None and reasoner.keeps_special_tokens:
        request.skip_special_tokens = False


class StreamingToolParser(ToolParser):
    """A parser as a state machine over the text so far (``self.text``, parsed up to ``self.pos``).

    The answer text is always a prefix of the output (the text before the first call, or all of
    it), sent up to ``content_end``. A call is scanned by a :class:`CallObjectScanner`; it is
    announced once its name is complete and its arguments follow as they arrive.

    When the output turns out not to be a call after all (not JSON, no name), :meth:`_fail`
    decides: if no call was announced yet, everything not yet sent becomes answer text (so
    ``extract_tool_calls`` and any streaming of the same text agree); once one was, the rest is
    dropped (a stream cannot take back what it sent) and ``extract_tool_calls`` reports the whole
    text as the answer, as vLLM does for a malformed call.
    """

    arg_keys: tuple[str, ...] = ("arguments",)

    def __init__(self, tokenizer: Any = None, request: Any = None) -> None:
        super().__init__(tokenizer, request)
        self.text = ""
        self.pos = 0
        self.content_end = 0
        self.calls: list[ParsedToolCall] = []
        self.failed: str | None = None
        self._as_text = False  # failed before any call: the rest is answer text
        self._dropped = False  # failed after a call went out: the rest is ignored
        self._scanner: CallObjectScanner | None = None
        self._current: ParsedToolCall | None = None  # announced, not done
        self._arguments_sent = ""  # of the announced call
        self._out = ToolStreamDelta()

    # -- the interface ----------------------------------------------------------------------------
    def feed(self, text: str) -> ToolStreamDelta:
        self.text += text
        return self._run(final=False)

    def finish(self) -> ToolStreamDelta:
        return self._run(final=True)

    def extract_tool_calls(self, text: str) -> ExtractedToolCalls:
        self.feed(text)
        self.finish()
        if self.failed is not None:
            return ExtractedToolCalls([], text or None)
        return ExtractedToolCalls(list(self.calls), self.text[:self.content_end] or None)

    # -- for subclasses ---------------------------------------------------------------------------
    def _step(self, final: bool) -> bool:
        """Parse on from ``self.pos``; True when it made progress and should be called again."""
        raise NotImplementedError

    def _send_content(self, end: int) -> None:
        """Send the answer text up to ``end``."""
        if end > self.content_end:
            self._out.content += self.text[self.content_end:end]
            self.content_end = end

    def _answer_until(self, marker: str, final: bool) -> int:
        """In the answer text: send it up to ``marker`` (its trailing whitespace dropped) and
        return where the marker starts, or -1 while it has not come; then a partial marker at the
        end and the whitespace before it are held back, unless the text is ``final``."""
        text = self.text
        found = text.find(marker, self.pos)
        if found < 0:
            if final:
                self._send_content(len(text))
                self.pos = len(text)
                return -1
            safe = len(text) - partial_marker_len(text[self.content_end:], marker)
            self._send_content(self.content_end + len(text[self.content_end:safe].rstrip()))
            self.pos = self.content_end
            return -1
        self._send_content(self.content_end + len(text[self.content_end:found].rstrip()))
        return found

    def _skip_until(self, marker: str) -> int:
        """Between calls (text that is not part of the reply): where ``marker`` starts, or -1,
        having skipped all but what may be the start of it."""
        found = self.text.find(marker, self.pos)
        if found < 0:
            self.pos = max(self.pos, len(self.text) - partial_marker_len(self.text[self.pos:], marker))
        return found

    def _start_scanning(self) -> None:
        self._scanner = CallObjectScanner(self.arg_keys)

    def _scan_call(self, final: bool) -> str:
        """Scan the current call on; "done" when it closed, "failed", or "wait" for more text."""
        scanner = self._scanner
        assert scanner is not None, "_start_scanning first"
        self.pos = scanner.scan(self.text, self.pos)
        if scanner.failed is None and scanner.name is not None and self._current is None:
            self._announce(scanner.name)
        if scanner.failed is None and final and not scanner.done:
            scanner.failed = "the output ended inside a tool call"
        if scanner.failed is not None:
            self._fail(scanner.failed)
            return "failed"
        if self._current is not None:
            self._send_arguments(scanner.arguments(self.text) if scanner.done else scanner.arguments_so_far(self.text))
        if not scanner.done:
            return "wait"
        self._end_call()
        return "done"

    def _announce(self, name: str) -> None:
        self._current = ParsedToolCall(new_tool_call_id(), name, "")
        self._arguments_sent = ""
        self._out.tool_calls.append(ToolCallDelta(index=len(self.calls), id=self._current.id, name=name))

    def _send_arguments(self, arguments: str) -> None:
        new = arguments[len(self._arguments_sent):]
        if not new:
            return
        self._arguments_sent = arguments
        index = len(self.calls)
        last = self._out.tool_calls[-1] if self._out.tool_calls else None
        if last is not None and last.index == index:
            last.arguments += new
        else:
            self._out.tool_calls.append(ToolCallDelta(index=index, arguments=new))

    def _end_call(self) -> None:
        call = self._current
        assert call is not None and self._scanner is not None
        call.arguments = self._scanner.arguments(self.text)
        self.calls.append(call)
        self._current = None
        self._scanner = None

    def _fail(self, reason: str) -> None:
        self.failed = reason
        self._scanner = None
        if self.calls or self._current is not None:
            self._dropped = True
        else:
            self._as_text = True

    # -- the loop ---------------------------------------------------------------------------------
    def _run(self, final: bool) -> ToolStreamDelta:
        while True:
            if self._as_text:
                self._send_content(len(self.text))
                self.pos = len(self.text)
                break
            if self._dropped:
                self.pos = len(self.text)
                break
            if not self._step(final):
                break
        out, self._out = self._out, ToolStreamDelta()
        return out
