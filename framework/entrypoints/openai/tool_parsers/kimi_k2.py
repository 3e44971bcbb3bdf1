"""``kimi_k2``: Kimi K2's tool calls (vLLM's ``kimi_k2``).

The calls come after the answer in a section of special tokens, each with the id the model gives
it (``functions.NAME:INDEX``) and its JSON arguments::

    answer<|tool_calls_section_begin|><|tool_call_begin|>functions.get_weather:0
    <|tool_call_argument_begin|>{"city": "Paris"}<|tool_call_end|><|tool_call_begin|>...
    <|tool_call_end|><|tool_calls_section_end|>

(``<|tool_call_section_begin|>``/``_end|>``, the singular spellings, are taken too.) The call's id
is the model's, as vLLM sets it: Kimi's chat template reads it back from the next request's
messages. The name is the id without its ``functions.`` prefix and ``:INDEX``. The answer is the
text before the section (its trailing whitespace dropped); text after it is not part of the
reply; inside it, anything but calls and whitespace is a malformed call
(:meth:`StreamingToolParser._fail`). A call goes out once its arguments open with ``{``, then
its arguments as they are written. The markers are special tokens: ``keeps_special_tokens``.
"""

from __future__ import annotations

import re

from sparrow.entrypoints.openai.markers import partial_marker_len
from sparrow.entrypoints.openai.tool_parsers.base import StreamingToolParser
from sparrow.entrypoints.openai.tool_parsers.json_scanner import ArgumentsScanner

_WHITESPACE = " \t\r\n"
SECTION_STARTS = ("<|tool_calls_section_begin|>", "<|tool_call_section_begin|>")
SECTION_ENDS = ("<|tool_calls_section_end|>", "<|tool_call_section_end|>")
CALL_START, CALL_END, ARGUMENTS = "<|tool_call_begin|>", "<|tool_call_end|>", "<|tool_call_argument_begin|>"
_CALL_ID = re.compile(r"\s*((?:[A-Za-z_][\w\-]*\.)?([A-Za-z_][\w.\-]*?):\d+)\s*" + re.escape(ARGUMENTS) + r"\s*")


class KimiK2ToolParser(StreamingToolParser):
    keeps_special_tokens = True

    def __init__(self, tokenizer=None, request=None) -> None:
        super().__init__(tokenizer, request)
        self._phase = "text"  # text -> section -> (header -> call -> close -> section)* -> after
        self._call_id = ""

    def _announce(self, name: str) -> None:
        super()._announce(name)
        assert self._current is not None
        self._current.id = self._out.tool_calls[-1].id = self._call_id

    def _step(self, final: bool) -> bool:
        phase = self._phase
        if phase == "text":
            return self._text(final)
        if phase == "section":
            return self._section(final)
        if phase == "header":
            return self._header(final)
        if phase == "call":
            outcome = self._scan_call(final)
            if outcome == "done":
                self._phase = "close"
            return outcome != "wait"
        if phase == "close":
            found = self._skip_until(CALL_END)
            if found < 0:
                if final:
                    self._fail("the output ended before <|tool_call_end|>")
                    return True
                return False
            if self.text[self.pos:found].strip(_WHITESPACE):
                self._fail("text after a call's arguments")
                return True
            self.pos = found + len(CALL_END)
            self._phase = "section"
            return True
        self.pos = len(self.text)  # after the section: not part of the reply
        return False

    def _text(self, final: bool) -> bool:
        """The answer, up to the section's start in either spelling (as ``_answer_until``, which
        takes one marker: a partial marker at the end, and the whitespace before it, wait)."""
        text = self.text
        hits = [(at, marker) for marker in SECTION_STARTS if (at := text.find(marker, self.pos)) >= 0]
        if hits:
            at, marker = min(hits)
            self._send_content(self.content_end + len(text[self.content_end:at].rstrip()))
            self.pos = at + len(marker)
            self._phase = "section"
            return True
        if final:
            self._send_content(len(text))
            self.pos = len(text)
            return False
        safe = len(text) - max(partial_marker_len(text[self.content_end:], marker) for marker in SECTION_STARTS)
        self._send_content(self.content_end + len(text[self.content_end:safe].rstrip()))
        self.pos = self.content_end
        return False

    def _section(self, final: bool) -> bool:
        while self.pos < len(self.text) and self.text[self.pos] in _WHITESPACE:
            self.pos += 1
        rest = self.text[self.pos:]
        if rest.startswith(CALL_START):
            self.pos += len(CALL_START)
            self._phase = "header"
            return True
        for marker in SECTION_ENDS:
            if rest.startswith(marker):
                self.pos += len(marker)
                self._phase = "after"
                return True
        if not final and any(marker.startswith(rest) for marker in (CALL_START, *SECTION_ENDS)):
            return False  # nothing yet, or the start of a marker
        if self.calls or not rest:
            self._phase = "after"  # the section ended without its closing marker
            return True
        self._fail("the tool-call section does not start with a call")
        return True

    def _header(self, final: bool) -> bool:
        match = _CALL_ID.match(self.text, self.pos)
        if match is None or match.end() == len(self.text):
            rest = self.text[self.pos:]
            if final or (match is None and (ARGUMENTS in rest or len(rest) > 256)):
                self._fail("a call is functions.NAME:INDEX<|tool_call_argument_begin|> and its arguments")
                return True
            return False
        if self.text[match.end()] != "{":
            self._fail("a call's arguments are a JSON object")
            return True
        self.pos = match.end()
        self._call_id = match.group(1)
        self._scanner = ArgumentsScanner(match.group(2))
        self._phase = "call"
        return True
