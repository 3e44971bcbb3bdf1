""":class:`SectionToolParser`: the state machine of formats whose calls follow the answer in a
section of special-token markers (``deepseek_v3``, ``kimi_k2``)::

    answer SECTION_START (CALL_START header arguments CALL_END)* SECTION_END

The answer is the text before the section's start (any of ``section_starts``; its trailing
whitespace dropped); text after the section's end is not part of the reply. Between calls only
whitespace may stand, and between a call's arguments and ``call_end`` only ``after_arguments``;
anything else is a malformed call (:meth:`StreamingToolParser._fail`). A subclass names its markers
and reads a call's header (``_header``: set ``self._scanner`` and the phase "call", or fail or wait).
"""

from __future__ import annotations

from typing import Any

from sparrow.entrypoints.openai.markers import partial_marker_len
from sparrow.entrypoints.openai.tool_parsers.base import StreamingToolParser

WHITESPACE = " \t\r\n"


class SectionToolParser(StreamingToolParser):
    keeps_special_tokens = True
    section_starts: tuple[str, ...] = ()
    section_ends: tuple[str, ...] = ()
    call_start = ""
    call_end = ""
    after_arguments = WHITESPACE
    no_call_reason = "the tool-call section does not start with a call"

    def __init__(self, tokenizer: Any = None, request: Any = None) -> None:
        super().__init__(tokenizer, request)
        self._phase = "text"  # text -> section -> (header -> call -> close -> section)* -> after

    def _header(self, final: bool) -> bool:
        raise NotImplementedError

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
            return self._close(final)
        self.pos = len(self.text)  # after the section: not part of the reply
        return False

    def _text(self, final: bool) -> bool:
        """The answer, up to the section's start in any spelling (as ``_answer_until``, which
        takes one marker: a partial marker at the end, and the whitespace before it, wait)."""
        text = self.text
        hits = [(at, marker) for marker in self.section_starts if (at := text.find(marker, self.pos)) >= 0]
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
        held = max(partial_marker_len(text[self.content_end:], marker) for marker in self.section_starts)
        self._send_content(self.content_end + len(text[self.content_end:len(text) - held].rstrip()))
        self.pos = self.content_end
        return False

    def _section(self, final: bool) -> bool:
        while self.pos < len(self.text) and self.text[self.pos] in WHITESPACE:
            self.pos += 1
        rest = self.text[self.pos:]
        if rest.startswith(self.call_start):
            self.pos += len(self.call_start)
            self._phase = "header"
            return True
        for marker in self.section_ends:
            if rest.startswith(marker):
                self.pos += len(marker)
                self._phase = "after"
                return True
        if not final and any(marker.startswith(rest) for marker in (self.call_start, *self.section_ends)):
            return False  # nothing yet, or the start of a marker
        if self.calls or not rest:
            self._phase = "after"  # the section ended without its closing marker
            return True
        self._fail(self.no_call_reason)
        return True

    def _close(self, final: bool) -> bool:
        found = self._skip_until(self.call_end)
        if found < 0:
            if final:
                self._fail(f"the output ended before {self.call_end}")
                return True
            return False
        if self.text[self.pos:found].strip(self.after_arguments):
            self._fail("text after a call's arguments")
            return True
        self.pos = found + len(self.call_end)
        self._phase = "section"
        return True
