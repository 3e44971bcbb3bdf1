"""``phi4_mini_json``: Phi-4-mini's tool calls (vLLM's ``phi4_mini_json``): ``functools`` and a
JSON list of call objects, ``functools[{"name": "f", "arguments": {...}}, ...]`` ("parameters" is
taken for "arguments").

The answer is the text before ``functools`` (its trailing whitespace dropped; vLLM drops it, this
server keeps it); text after the list is not part of the reply. A ``functools`` not followed by a
list of calls is malformed (:meth:`StreamingToolParser._fail`: before any call went out, all the
text is the answer). The list is read as ``granite``'s is, each call streamed as it is written.
"""

from __future__ import annotations

from sparrow.entrypoints.openai.tool_parsers.granite import GraniteToolParser


class Phi4MiniJsonToolParser(GraniteToolParser):
    keeps_special_tokens = False  # "functools" is plain text
    marker = "functools"
    arg_keys = ("arguments", "parameters")

    def _step(self, final: bool) -> bool:
        if self._phase != "open":
            return super()._step(final)
        found = self._answer_until(self.marker, final)
        if found < 0:
            return False
        at = found + len(self.marker)
        while at < len(self.text) and self.text[at] in " \t\r\n":
            at += 1
        if at == len(self.text) and not final:
            return False  # the marker came; its list has not
        if not self.text.startswith("[", at):
            self._fail("functools is not followed by a JSON list of calls")
            return True
        self.pos = at + 1
        self._phase = "item"
        return True
