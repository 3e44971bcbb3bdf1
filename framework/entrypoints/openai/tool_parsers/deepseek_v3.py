"""``deepseek_v3``: DeepSeek-V3's and DeepSeek-R1's tool calls (vLLM's ``deepseek_v3``).

The calls come after the answer, between special tokens, each a type, a name and its arguments as a
fenced JSON block::

    answer<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>get_weather
    ```json
    {"city": "Paris"}
    ```<｜tool▁call▁end｜><｜tool▁call▁begin｜>...<｜tool▁call▁end｜><｜tool▁calls▁end｜>

The answer is the text before ``<｜tool▁calls▁begin｜>`` (its trailing whitespace dropped); text
after ``<｜tool▁calls▁end｜>`` is not part of the reply. Inside the calls, whitespace between them is
skipped and anything else is a malformed call (:meth:`StreamingToolParser._fail`: before any call
went out, all the text is the answer). A call's name goes out once its line is complete, its
arguments as they are written. The markers are special tokens of DeepSeek's vocabulary, so the
parser sets ``keeps_special_tokens`` (the request is decoded with ``skip_special_tokens`` false).
"""

from __future__ import annotations

import re

from sparrow.entrypoints.openai.tool_parsers.base import StreamingToolParser
from sparrow.entrypoints.openai.tool_parsers.json_scanner import ArgumentsScanner

_WHITESPACE = " \t\r\n"
# A call's header after <｜tool▁call▁begin｜>: its type, the separator, the name, the opening fence.
_HEADER = re.compile(r"([A-Za-z_]*)<｜tool▁sep｜>([^\n`<]+?)\s*\n?```(?:json)?[ \t]*\r?\n")


class DeepSeekV3ToolParser(StreamingToolParser):
    keeps_special_tokens = True
    calls_start = "<｜tool▁calls▁begin｜>"
    calls_end = "<｜tool▁calls▁end｜>"
    call_start = "<｜tool▁call▁begin｜>"
    call_end = "<｜tool▁call▁end｜>"

    def __init__(self, tokenizer=None, request=None) -> None:
        super().__init__(tokenizer, request)
        self._phase = "text"  # text -> calls -> (header -> call -> close -> calls)* -> after

    def _step(self, final: bool) -> bool:
        phase = self._phase
        if phase == "text":
            found = self._answer_until(self.calls_start, final)
            if found < 0:
                return False
            self.pos = found + len(self.calls_start)
            self._phase = "calls"
            return True
        if phase == "calls":
            return self._between_calls(final)
        if phase == "header":
            return self._header(final)
        if phase == "call":
            outcome = self._scan_call(final)
            if outcome == "done":
                self._phase = "close"
            return outcome != "wait"
        if phase == "close":  # the closing fence, then <｜tool▁call▁end｜>
            found = self._skip_until(self.call_end)
            if found < 0:
                if final:
                    self._fail("the output ended before <｜tool▁call▁end｜>")
                    return True
                return False
            if self.text[self.pos:found].strip(_WHITESPACE + "`"):
                self._fail("text after a call's arguments")
                return True
            self.pos = found + len(self.call_end)
            self._phase = "calls"
            return True
        self.pos = len(self.text)  # after <｜tool▁calls▁end｜>: not part of the reply
        return False

    def _between_calls(self, final: bool) -> bool:
        while self.pos < len(self.text) and self.text[self.pos] in _WHITESPACE:
            self.pos += 1
        rest = self.text[self.pos:]
        for marker, phase in ((self.call_start, "header"), (self.calls_end, "after")):
            if rest.startswith(marker):
                self.pos += len(marker)
                self._phase = phase
                return True
        if not final and (self.call_start.startswith(rest) or self.calls_end.startswith(rest)):
            return False  # nothing yet, or the start of a marker
        if self.calls or not rest:
            self._phase = "after"  # the calls ended without their closing marker
            return True
        self._fail("<｜tool▁calls▁begin｜> is not followed by a call")
        return True

    def _header(self, final: bool) -> bool:
        match = _HEADER.match(self.text, self.pos)
        if match is None:
            rest = self.text[self.pos:]
            if final or "\n" in rest.partition("```")[2] or len(rest) > 512:
                self._fail("a call's header is not TYPE<｜tool▁sep｜>NAME and a ```json fence")
                return True
            return False
        # The call is announced only once its arguments are seen to open (a stream cannot take a
        # call back, so "[...]" there is found malformed before anything went out).
        at = match.end()
        while at < len(self.text) and self.text[at] in _WHITESPACE:
            at += 1
        if at == len(self.text):
            if final:
                self._fail("the output ended before a call's arguments")
                return True
            return False
        if self.text[at] != "{":
            self._fail("a call's arguments are a JSON object")
            return True
        self.pos = at
        self._scanner = ArgumentsScanner(match.group(2).strip())
        self._phase = "call"
        return True
