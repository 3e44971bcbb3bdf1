"""``llama3_json``: Llama 3.x's JSON tool calls, ``{"name": ..., "parameters": {...}}``, several
separated by ``;``, optionally after ``<|python_tag|>`` (vLLM's ``llama3_json``).

An output is calls when it starts (after whitespace) with ``{`` or ``<|python_tag|>``, and is
then all calls: text after them is not part of the reply. Anything else is the answer. An output
that starts with ``{`` but is no call (JSON without a "name") turns out to be the answer too.
"""

from __future__ import annotations

from sparrow.entrypoints.openai.markers import opens_with
from sparrow.entrypoints.openai.tool_parsers.base import StreamingToolParser

_SEPARATORS = " \t\r\n;"


class Llama3JsonToolParser(StreamingToolParser):
    python_tag = "<|python_tag|>"
    arg_keys = ("parameters", "arguments")

    def __init__(self, tokenizer=None, request=None) -> None:
        super().__init__(tokenizer, request)
        self._phase = "open"  # open -> (text | call -> between -> call ... -> rest)

    def _step(self, final: bool) -> bool:
        text = self.text
        if self._phase == "open":
            rest = text[self.pos:]
            tagged = opens_with(rest, self.python_tag, final=final)
            if tagged is None:
                return False
            leading = len(rest) - len(rest.lstrip())
            if tagged:
                self.pos += leading + len(self.python_tag)
                self._phase = "between"
            elif rest[leading:leading + 1] == "{":
                self.pos += leading
                self._phase = "call"
                self._start_scanning()
            else:
                self._phase = "text"
            return True
        if self._phase == "text":
            self._send_content(len(text))
            self.pos = len(text)
            return False
        if self._phase == "call":
            outcome = self._scan_call(final)
            if outcome == "done":
                self._phase = "between"
            return outcome != "wait"
        if self._phase == "between":
            while self.pos < len(text) and text[self.pos] in _SEPARATORS:
                self.pos += 1
            if self.pos == len(text):
                if final and not self.calls:
                    self._fail("<|python_tag|> is not followed by a call")
                    return True
                return False
            if text[self.pos] == "{":
                self._phase = "call"
                self._start_scanning()
            elif not self.calls:
                self._fail("<|python_tag|> is not followed by a JSON call")
            else:
                self._phase = "rest"
            return True
        self.pos = len(text)  # rest: text after the calls is not part of the reply
        return False
