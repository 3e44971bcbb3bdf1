"""``glm45``: GLM-4.5's and GLM-4.6's tool calls (vLLM's ``glm45``).

Each call names its function on the first line, then its arguments as key/value tags::

    answer<tool_call>get_weather
    <arg_key>city</arg_key>
    <arg_value>Paris</arg_value>
    <arg_key>days</arg_key>
    <arg_value>3</arg_value>
    </tool_call><tool_call>get_time
    </tool_call>

Each value (whitespace around it dropped) becomes the JSON value the tool's schema declares for
that key (:func:`sparrow.entrypoints.openai.tool_parsers.qwen3_coder.convert_value`: a ``string``
stays text, ``3`` is a number for an ``integer``; without a schema, JSON when it parses). The answer
is the text before the first ``<tool_call>`` (its trailing whitespace dropped); text after the calls
is not part of the reply. A call goes out whole, name and arguments, once its ``</tool_call>``
has come, as vLLM streams it; one that is not a name and key/value pairs is malformed
(:meth:`StreamingToolParser._fail`). The tags are added tokens of GLM's vocabulary, so the parser
sets ``keeps_special_tokens`` (vLLM's parser decodes such requests with special tokens too).
"""

from __future__ import annotations

import json
import re

from sparrow.entrypoints.openai.tool_parsers.base import StreamingToolParser
from sparrow.entrypoints.openai.tool_parsers.qwen3_coder import convert_value, tool_parameters

_PAIR = re.compile(r"<arg_key>(.*?)</arg_key>\s*<arg_value>(.*?)</arg_value>", re.DOTALL)
_NAME = re.compile(r"[A-Za-z0-9_.\-]+")
_WHITESPACE = " \t\r\n"


class Glm45ToolParser(StreamingToolParser):
    keeps_special_tokens = True
    call_start = "<tool_call>"
    call_end = "</tool_call>"

    def __init__(self, tokenizer=None, request=None) -> None:
        super().__init__(tokenizer, request)
        self._phase = "text"  # text -> (call -> between)* -> after
        self._parameters = tool_parameters(request)  # function name -> its properties' schemas

    def _step(self, final: bool) -> bool:
        if self._phase == "text":
            found = self._answer_until(self.call_start, final)
            if found < 0:
                return False
            self.pos = found + len(self.call_start)
            self._phase = "call"
            return True
        if self._phase == "call":
            return self._call(final)
        if self._phase == "between":
            while self.pos < len(self.text) and self.text[self.pos] in _WHITESPACE:
                self.pos += 1
            rest = self.text[self.pos:]
            if rest.startswith(self.call_start):
                self.pos += len(self.call_start)
                self._phase = "call"
                return True
            if not final and self.call_start.startswith(rest):
                return False  # nothing yet, or the start of another call
            self._phase = "after"
            return True
        self.pos = len(self.text)  # after the calls: not part of the reply
        return False

    def _call(self, final: bool) -> bool:
        end = self.text.find(self.call_end, self.pos)
        if end < 0:
            if final:
                self._fail("the output ended inside a tool call")
                return True
            return False
        name, _, body = self.text[self.pos:end].partition("\n")
        name = name.strip()
        if not _NAME.fullmatch(name) or _PAIR.sub("", body).strip(_WHITESPACE):
            self._fail("a tool call is a function name, then <arg_key>/<arg_value> pairs")
            return True
        schemas = self._parameters.get(name, {})
        arguments = {key.strip(): convert_value(value.strip(_WHITESPACE), schemas.get(key.strip()))
                     for key, value in _PAIR.findall(body)}
        self._announce(name)
        call = self._current
        assert call is not None  # _announce made it
        call.arguments = json.dumps(arguments, ensure_ascii=False)
        self._send_arguments(call.arguments)
        self.calls.append(call)
        self._current = None
        self.pos = end + len(self.call_end)
        self._phase = "between"
        return True
