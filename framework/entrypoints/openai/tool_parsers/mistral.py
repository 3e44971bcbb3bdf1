"""``mistral``: Mistral models' tool calls, after a ``[TOOL_CALLS]`` marker (vLLM's ``mistral``).

Two formats, told apart by what follows the marker:

    pre-v11 (Mistral 7B Instruct v0.3, Mixtral 8x22B Instruct, Mistral Nemo): a JSON list of
    call objects, ``[TOOL_CALLS] [{"name": "f", "arguments": {...}}, ...]`` ("parameters" is
    taken for "arguments"; other keys, such as the 9-character "id" Mistral's templates write,
    are skipped). A single object without the list is taken too.

    v11+ (Mistral Small 3.2, Magistral, Devstral): the name, then the arguments object,
    ``[TOOL_CALLS]f[ARGS]{...}``, each call after its own ``[TOOL_CALLS]`` or several names
    following one (``f[ARGS]{...}g[ARGS]{...}``). An optional ``[CALL_ID]id`` before ``[ARGS]``
    is skipped, and right after ``[TOOL_CALLS]`` the ``[ARGS]`` may be missing (``f{...}``, as a
    detokenizer that drops it writes the call).

The answer is the text before the first ``[TOOL_CALLS]`` (its trailing whitespace dropped);
text after the calls is not part of the reply, though another ``[TOOL_CALLS]`` there, in either
format, opens more calls; without a marker the whole text is the answer.
Whatever follows a ``[TOOL_CALLS]`` must be a call: anything else (not JSON, no name) is a
malformed call, handled by :meth:`StreamingToolParser._fail` (before any call went out, all the
text is the answer). Streamed, the answer goes out as it comes, except for what may be the start
of ``[TOOL_CALLS]`` (and whitespace before it); the arguments go out as they are written.

Ids: every call gets a new id of 9 letters and digits, as vLLM's parser gives, since Mistral's
chat templates refuse any other id when the call comes back in the next request's messages
("Tool call IDs should be alphanumeric strings with length 9!"). An id the model wrote itself
(a pre-v11 "id" key, a ``[CALL_ID]``) is not used: ours are new for each response.

``[TOOL_CALLS]`` and ``[ARGS]`` are special tokens in Mistral's vocabularies; a detokenizer that
skips special tokens drops them, and then no call can be found. So the parser sets
``keeps_special_tokens``: a request it parses (``tool_choice`` auto) is decoded with
``skip_special_tokens`` false, as vLLM's parser adjusts the request.
"""

from __future__ import annotations

import re
import secrets
import string

from sparrow.entrypoints.openai.tool_parsers.base import StreamingToolParser
from sparrow.entrypoints.openai.tool_parsers.json_scanner import ArgumentsScanner

_ID_ALPHABET = string.ascii_letters + string.digits
_WHITESPACE = " \t\r\n"
_NAME = re.compile(r"([A-Za-z0-9_.\-]+)\s*")  # a v11 call's name, and whitespace after it
_CALL_ID_VALUE = re.compile(r"\s*[A-Za-z0-9_\-]*\s*")


def mistral_tool_call_id() -> str:
    """A tool call id as Mistral's chat templates want it: 9 letters and digits."""
    return "".join(secrets.choice(_ID_ALPHABET) for _ in range(9))


class MistralToolParser(StreamingToolParser):
    keeps_special_tokens = True
    call_start = "[TOOL_CALLS]"
    args_marker = "[ARGS]"
    call_id_marker = "[CALL_ID]"
    arg_keys = ("arguments", "parameters")

    def __init__(self, tokenizer=None, request=None) -> None:
        super().__init__(tokenizer, request)
        # text -> marker -> (list_item -> call -> list_next ... | name -> call -> after_call ...)
        # and between: text after calls, where only another [TOOL_CALLS] counts.
        self._phase = "text"
        self._after_scan = "between"  # the phase once the call being scanned is done
        self._name_after_marker = True  # the name being read follows [TOOL_CALLS] (must be a call)

    def _announce(self, name: str) -> None:
        super()._announce(name)
        assert self._current is not None
        self._current.id = self._out.tool_calls[-1].id = mistral_tool_call_id()

    def _skip(self, chars: str) -> None:
        text = self.text
        while self.pos < len(text) and text[self.pos] in chars:
            self.pos += 1

    def _step(self, final: bool) -> bool:
        phase = self._phase
        if phase == "call":
            outcome = self._scan_call(final)
            if outcome == "done":
                self._phase = self._after_scan
            return outcome != "wait"
        if phase == "text":
            return self._text(final)
        if phase == "between":
            found = self._skip_until(self.call_start)  # keeping what may start a [TOOL_CALLS]
            if found < 0:
                return False
            self.pos = found + len(self.call_start)
            self._phase = "marker"
            return True
        if phase == "marker":
            return self._after_marker(final)
        if phase == "name":
            return self._name(final)
        if phase == "after_call":
            return self._after_call(final)
        return self._in_list(final)

    def _text(self, final: bool) -> bool:
        found = self._answer_until(self.call_start, final)
        if found < 0:
            return False
        self.pos = found + len(self.call_start)
        self._phase = "marker"
        return True

    def _after_marker(self, final: bool) -> bool:
        """Just past a [TOOL_CALLS]: a list of call objects, one object, or a v11 name."""
        self._skip(_WHITESPACE)
        rest = self.text[self.pos:]
        if rest.startswith(self.call_start):  # the marker twice
            self.pos += len(self.call_start)
            return True
        if not final and self.call_start.startswith(rest):  # nothing yet, or maybe the marker again
            return False
        if not rest:
            self._fail("[TOOL_CALLS] ends the output")
        elif rest[0] == "[":
            self.pos += 1
            self._phase = "list_item"
        elif rest[0] == "{":
            self._scan_object("between")
        else:
            self._phase = "name"
            self._name_after_marker = True
        return True

    def _scan_object(self, then: str) -> None:
        self._start_scanning()
        self._phase = "call"
        self._after_scan = then

    def _in_list(self, final: bool) -> bool:
        """In a pre-v11 list: where a call object should start, or after one."""
        self._skip(_WHITESPACE)
        if self.pos == len(self.text):
            if final and self._phase == "list_item":
                self._fail("the output ended inside the list of calls")
                return True
            return False  # after a whole call the list may stay open
        char = self.text[self.pos]
        if self._phase == "list_item":
            if char == "{":
                self._scan_object("list_next")
            elif char == "]":  # an empty list, or a trailing comma
                self.pos += 1
                self._phase = "between"
            else:
                self._fail(f"unexpected {char!r} in the list of calls")
            return True
        if char in ",]":
            self.pos += 1
        self._phase = "list_item" if char == "," else "between"  # anything else: text after the calls
        return True

    def _after_call(self, final: bool) -> bool:
        """After a v11 call: another [TOOL_CALLS], another name[ARGS], or text after the calls."""
        self._skip(_WHITESPACE + ",;")
        rest = self.text[self.pos:]
        if not rest:
            return False
        if rest.startswith(self.call_start):
            self.pos += len(self.call_start)
            self._phase = "marker"
        elif not final and self.call_start.startswith(rest):
            return False
        elif _NAME.match(rest):
            self._phase = "name"
            self._name_after_marker = False
        else:
            self._phase = "between"
        return True

    def _name(self, final: bool) -> bool:
        """A v11 call's ``name[CALL_ID]id[ARGS]`` up to the ``{`` of its arguments."""
        header = self._header(final)
        if header == "wait":
            return False
        if header == "no":
            if self._name_after_marker:
                self._fail("[TOOL_CALLS] is not followed by a call")
            else:
                self._phase = "between"
            return True
        self._scanner = ArgumentsScanner(header)
        self._phase = "call"
        self._after_scan = "after_call"
        return True

    def _header(self, final: bool) -> str:
        """The name, with ``self.pos`` moved to the arguments' ``{``; "wait" while it cannot tell
        yet, "no" when this is no call."""
        text, end = self.text, len(self.text)
        wait = "no" if final else "wait"
        match = _NAME.match(text, self.pos)
        if match is None:
            return "no"
        at = match.end()
        if at == end:
            return wait
        has_args = text.startswith(self.args_marker, at)
        if text.startswith(self.call_id_marker, at):
            id_match = _CALL_ID_VALUE.match(text, at + len(self.call_id_marker))
            assert id_match is not None  # it matches the empty string
            at = id_match.end()
            if not text.startswith(self.args_marker, at):
                return wait if self.args_marker.startswith(text[at:]) else "no"
            has_args = True
        if has_args:
            at += len(self.args_marker)
            while at < end and text[at] in _WHITESPACE:
                at += 1
            if at == end:
                return wait
        elif text[at] != "{" or not self._name_after_marker:
            rest = text[at:]
            could_be = self.args_marker.startswith(rest) or self.call_id_marker.startswith(rest)
            return wait if could_be else "no"
        if text[at] != "{":
            return "no"
        self.pos = at
        return match.group(1)
