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

from sparrow.entrypoints.openai.tool_parsers.json_scanner import ArgumentsScanner
from sparrow.entrypoints.openai.tool_parsers.sectioned import WHITESPACE, SectionToolParser

# A call's header after <｜tool▁call▁begin｜>: its type, the separator, the name, the opening fence.
_HEADER = re.compile(r"([A-Za-z_]*)<｜tool▁sep｜>([^\n`<]+?)\s*\n?```(?:json)?[ \t]*\r?\n")


class DeepSeekV3ToolParser(SectionToolParser):
    section_starts = ("<｜tool▁calls▁begin｜>",)
    section_ends = ("<｜tool▁calls▁end｜>",)
    call_start = "<｜tool▁call▁begin｜>"
    call_end = "<｜tool▁call▁end｜>"
    after_arguments = WHITESPACE + "`"  # the closing fence
    no_call_reason = "<｜tool▁calls▁begin｜> is not followed by a call"

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
        while at < len(self.text) and self.text[at] in WHITESPACE:
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
