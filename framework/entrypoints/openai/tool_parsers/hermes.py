"""``hermes``: calls written as ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``, as
Qwen2.5, Qwen3 and Hermes models do (their chat templates describe the format to the model).

The answer is the text before the first ``<tool_call>`` (its trailing whitespace dropped); text
between and after the calls is not part of the reply, as in vLLM's parser. Streamed, the answer
goes out as it comes, except for what may be the start of ``<tool_call>`` or whitespace that may
precede one.
"""

from __future__ import annotations

from sparrow.entrypoints.openai.tool_parsers.base import StreamingToolParser


class HermesToolParser(StreamingToolParser):
    call_start = "<tool_call>"
    arg_keys = ("arguments", "parameters")

    def __init__(self, tokenizer=None, request=None) -> None:
        super().__init__(tokenizer, request)
        self._phase = "text"  # text -> call -> between -> call ...

    def _step(self, final: bool) -> bool:
        if self._phase == "call":
            outcome = self._scan_call(final)
            if outcome == "done":
                self._phase = "between"
            return outcome != "wait"
        if self._phase == "text":
            found = self._answer_until(self.call_start, final)
        else:  # between calls: skip text, keeping what may start the next call
            found = self._skip_until(self.call_start)
        if found < 0:
            return False
        self.pos = found + len(self.call_start)
        self._phase = "call"
        self._start_scanning()
        return True
