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

from sparrow.entrypoints.openai.tool_parsers.json_scanner import ArgumentsScanner
from sparrow.entrypoints.openai.tool_parsers.sectioned import SectionToolParser

SECTION_STARTS = ("<|tool_calls_section_begin|>", "<|tool_call_section_begin|>")
SECTION_ENDS = ("<|tool_calls_section_end|>", "<|tool_call_section_end|>")
CALL_START, CALL_END, ARGUMENTS = "<|tool_call_begin|>", "<|tool_call_end|>", "<|tool_call_argument_begin|>"
_CALL_ID = re.compile(r"\s*((?:[A-Za-z_][\w\-]*\.)?([A-Za-z_][\w.\-]*?):\d+)\s*" + re.escape(ARGUMENTS) + r"\s*")


class KimiK2ToolParser(SectionToolParser):
    section_starts, section_ends, call_start, call_end = SECTION_STARTS, SECTION_ENDS, CALL_START, CALL_END

    def __init__(self, tokenizer=None, request=None) -> None:
        super().__init__(tokenizer, request)
        self._call_id = ""

    def _announce(self, name: str) -> None:
        super()._announce(name)
        assert self._current is not None
        self._current.id = self._out.tool_calls[-1].id = self._call_id

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
