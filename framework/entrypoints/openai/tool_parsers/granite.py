"""``granite``: IBM Granite 3.x's tool calls (vLLM's ``granite``).

An output is calls when it starts (after whitespace) with ``<|tool_call|>`` (Granite 3.0's token),
``<tool_call>`` (3.1's text) or directly with ``[``, followed by a JSON list of call objects::

    <|tool_call|>[{"name": "get_weather", "arguments": {"city": "Paris"}}, {"name": "get_time", "arguments": {}}]

The reply then has no answer text, and text after the list is not part of it. Anything else is the
answer. A list that turns out not to be calls (not JSON, an item without a "name") is the answer
too (:meth:`StreamingToolParser._fail`), unless a call had already gone out.
"""

from __future__ import annotations

from sparrow.entrypoints.openai.markers import opens_with
from sparrow.entrypoints.openai.tool_parsers.base import StreamingToolParser

_WHITESPACE = " \t\r\n"
MARKERS = ("<|tool_call|>", "<tool_call>")


class GraniteToolParser(StreamingToolParser):
    keeps_special_tokens = True  # <|tool_call|> is a special token of Granite 3.0's vocabulary

    def __init__(self, tokenizer=None, request=None) -> None:
        super().__init__(tokenizer, request)
        self._phase = "open"  # open -> (text | list -> (call -> next)* -> rest)

    def _skip_whitespace(self) -> None:
        while self.pos < len(self.text) and self.text[self.pos] in _WHITESPACE:
            self.pos += 1

    def _step(self, final: bool) -> bool:
        text = self.text
        if self._phase == "open":
            rest = text[self.pos:]
            opens = [opens_with(rest, marker, final=final) for marker in MARKERS]
            if True not in opens and None in opens:
                return False  # only whitespace so far, or the start of a marker
            self._skip_whitespace()
            for marker, opened in zip(MARKERS, opens):
                if opened:
                    self.pos += len(marker)
            self._skip_whitespace()
            if self.pos == len(text) and not final:
                return False  # the marker came; its list has not
            if text.startswith("[", self.pos):
                self.pos += 1
                self._phase = "item"
            elif True in opens:
                self._fail("the tool-call marker is not followed by a JSON list")
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
                self._phase = "next"
            return outcome != "wait"
        if self._phase in ("item", "next"):
            self._skip_whitespace()
            if self.pos == len(text):
                if final and not self.calls:
                    self._fail("the output ended inside the list of calls")
                    return True
                return False
            char = text[self.pos]
            if char == "{" and self._phase == "item":
                self._start_scanning()
                self._phase = "call"
            elif char == "," and self._phase == "next":
                self.pos += 1
                self._phase = "item"
            elif char == "]":
                self.pos += 1
                self._phase = "rest"
            else:
                self._fail(f"unexpected {char!r} in the list of calls")
            return True
        self.pos = len(text)  # rest: text after the list is not part of the reply
        return False
