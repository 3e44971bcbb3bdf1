"""``qwen3_coder``: Qwen3-Coder's XML-like calls (vLLM's ``--tool-call-parser qwen3_coder``)::

    Some text
    <tool_call>
    <function=get_weather>
    <parameter=city>
    Paris
    </parameter>
    <parameter=days>
    3
    </parameter>
    </function>
    </tool_call>

The answer is the text before the first ``<tool_call>`` (its trailing whitespace dropped); text
between and after the calls is not part of the reply, as with ``hermes``. A ``<tool_call>`` block
may hold several ``<function=...>`` elements, each one call; ``</tool_call>`` itself is optional
(whatever follows a ``</function>`` that is not another ``<function=`` is skipped up to the next
``<tool_call>``).

A parameter's value is the raw text between ``<parameter=NAME>`` and the first ``</parameter>``
after it, less one leading and one trailing newline, converted by the type the request's tool
schema declares for it (:func:`convert_value`). The arguments are the JSON object of the converted
values in the order written, as ``json.dumps(arguments, ensure_ascii=False)`` writes it.

Streamed, a call is announced (index, id, name) once ``<function=NAME>`` is complete; each
parameter's ``"name": value`` goes out when its ``</parameter>`` arrives (the first prefixed with
``{``, the next with ``, ``) and the closing ``}`` with ``</function>``, so the fragments add up to
exactly the arguments ``extract_tool_calls`` returns. Partial markers are held back.

Malformed output (a ``<tool_call>`` without ``<function=``, an empty name, a name running past a
newline or ``<``, text other than whitespace between parameters, a repeated parameter, or output
ending inside a function) follows the base class's rules: before any call went out the whole text
is the answer; after one went out the rest is dropped.
"""

from __future__ import annotations

import ast
import json
import math
import re
from typing import Any

from sparrow.entrypoints.openai.tool_parsers.base import StreamingToolParser

CALL_START = "<tool_call>"
FUNCTION_START = "<function="
FUNCTION_END = "</function>"
PARAMETER_START = "<parameter="
PARAMETER_END = "</parameter>"

_INTEGER = re.compile(r"[-+]?\d+")
_NUMBER = re.compile(r"[-+]?(?:\d+\.?\d*|\.\d+)(?:[eE][-+]?\d+)?")
# Loose type names some schemas use, read as their JSON Schema names.
_TYPE_ALIASES = {"int": "integer", "long": "integer", "float": "number", "double": "number",
                 "bool": "boolean", "dict": "object", "list": "array", "str": "string"}


class _NotThisType(Exception):
    """The value does not read as the type tried."""


def _reject_constant(name: str) -> Any:
    raise ValueError(f"{name} is not JSON")


def _strict_json(text: str) -> Any:
    """``json.loads`` without NaN/Infinity; raises ValueError."""
    return json.loads(text, parse_constant=_reject_constant)


def _declared_types(schema: Any) -> list[str]:
    """The JSON Schema type names ``schema`` allows: its ``type`` (a name or a list of names), else
    the types of its ``anyOf``/``oneOf`` members; ``[]`` when it declares none."""
    if not isinstance(schema, dict):
        return []
    declared = schema.get("type")
    if isinstance(declared, str):
        names = [declared]
    elif isinstance(declared, list):
        names = [name for name in declared if isinstance(name, str)]
    else:
        names = []
        for key in ("anyOf", "oneOf"):
            members = schema.get(key)
            if isinstance(members, list):
                for member in members:
                    names.extend(name for name in _declared_types(member) if name not in names)
    return [_TYPE_ALIASES.get(name.lower(), name.lower()) for name in names]


def _as_type(text: str, type_name: str) -> Any:
    """``text`` read as ``type_name``; raises :class:`_NotThisType` when it does not read so."""
    value = text.strip()
    if type_name == "integer":
        if _INTEGER.fullmatch(value):
            try:
                return int(value)
            except ValueError:  # past Python's digit limit
                pass
    elif type_name == "number":
        if _NUMBER.fullmatch(value):
            if "." not in value and "e" not in value.lower():
                try:
                    return int(value)
                except ValueError:
                    pass
            number = float(value)
            if math.isfinite(number):
                return number
    elif type_name == "boolean":
        if value.lower() in ("true", "false"):
            return value.lower() == "true"
    elif type_name == "null":
        if value == "null":
            return None
    elif type_name in ("object", "array"):
        kind = dict if type_name == "object" else list
        try:
            parsed = _strict_json(value)
            if isinstance(parsed, kind):
                return parsed
        except ValueError:
            pass
        try:
            parsed = ast.literal_eval(value)
            if isinstance(parsed, kind):
                # Only what JSON can carry, as JSON has it (tuples become lists).
                return json.loads(json.dumps(parsed, allow_nan=False))
        except (ValueError, TypeError, SyntaxError, MemoryError, RecursionError):
            pass
    raise _NotThisType(type_name)


def convert_value(text: str, schema: Any) -> Any:
    """A parameter's value (its text, the newlines around it already removed) as the JSON value
    its schema declares.

    The declared types (``type``, a list of types, or the types of ``anyOf``/``oneOf`` members)
    are tried in the order written, ``string`` last since any text is one:

    * ``string``: the text as it is;
    * ``integer``: ``int`` of the text (whitespace around it ignored) when it is an optional sign
      and digits;
    * ``number``: an ``int`` when it is written as one, a ``float`` for a decimal/exponent form
      (finite only);
    * ``boolean``: ``true``/``false``, in any case;
    * ``null``: ``None`` for ``null``;
    * ``object``/``array``: ``json.loads`` of the text when it gives a dict/list, else
      ``ast.literal_eval`` (Python literals such as ``{'a': True}``) when it gives one JSON can
      carry.

    When none of the declared types reads the text, it stays a string. A parameter the schema
    does not declare, or no schema at all (no request, the function not among its tools, a schema
    without types): ``json.loads`` of the whole text when it is valid JSON (not NaN/Infinity),
    else the text as a string -- so there ``3`` is a number and ``"x"`` the string ``x``.
    """
    types = _declared_types(schema)
    if not types:
        try:
            return _strict_json(text)
        except ValueError:
            return text
    for type_name in sorted(types, key=lambda name: name == "string"):
        if type_name == "string":
            return text
        try:
            return _as_type(text, type_name)
        except _NotThisType:
            continue
    return text


def tool_parameters(request: Any) -> dict[str, dict[str, Any]]:
    """Each tool's name -> its parameters' ``properties`` schemas, from the request's tools."""
    found: dict[str, dict[str, Any]] = {}
    for tool in getattr(request, "tools", None) or []:
        function = getattr(tool, "function", None)
        name = getattr(function, "name", None)
        parameters = getattr(function, "parameters", None)
        if isinstance(name, str) and name not in found:
            properties = parameters.get("properties") if isinstance(parameters, dict) else None
            found[name] = properties if isinstance(properties, dict) else {}
    return found


def _strip_one_newline(text: str) -> str:
    if text.startswith("\n"):
        text = text[1:]
    if text.endswith("\n"):
        text = text[:-1]
    return text


def _dumps(value: Any) -> str:
    return json.dumps(value, ensure_ascii=False)


class Qwen3CoderToolParser(StreamingToolParser):
    def __init__(self, tokenizer=None, request=None) -> None:
        super().__init__(tokenizer, request)
        # text -> open -> name -> body <-> (param_name -> value) -> next -> (name | between) ...
        self._phase = "text"
        self._tools = tool_parameters(request)
        self._properties: dict[str, Any] = {}  # of the current call's function
        self._params: set[str] = set()  # written so far in the current call
        self._arguments = ""  # the current call's arguments JSON so far (without the closing brace)
        self._param_name = ""
        self._value_start = 0
        self._search_from = 0  # where to look for </parameter> next

    def _step(self, final: bool) -> bool:
        phase = self._phase
        if phase in ("text", "between"):
            return self._find_call(final)
        if phase in ("open", "next"):
            return self._open_function(final)
        if phase in ("name", "param_name"):
            return self._read_name(final)
        if phase == "body":
            return self._body(final)
        return self._value(final)

    # -- the phases -------------------------------------------------------------------------------
    def _find_call(self, final: bool) -> bool:
        if self._phase == "text":
            found = self._answer_until(CALL_START, final)
        else:  # between calls: skip text, keeping what may start the next call
            found = self._skip_until(CALL_START)
        if found < 0:
            return False
        self.pos = found + len(CALL_START)
        self._phase = "open"
        return True

    def _open_function(self, final: bool) -> bool:
        """After ``<tool_call>`` (phase open) or a ``</function>`` (phase next): ``<function=``."""
        rest = self.text[self.pos:].lstrip()
        start = len(self.text) - len(rest)
        if rest.startswith(FUNCTION_START):
            self.pos = start + len(FUNCTION_START)
            self._phase = "name"
            return True
        if not final and FUNCTION_START.startswith(rest):
            self.pos = start
            return False
        if self._phase == "next":  # the block holds no more functions
            self._phase = "between"
            return True
        self._fail("a <tool_call> without <function=" if rest else "the output ended inside a tool call")
        return True

    def _read_name(self, final: bool) -> bool:
        """The name of ``<function=NAME>`` or ``<parameter=NAME>``, up to its ``>``."""
        text = self.text
        end = text.find(">", self.pos)
        written = text[self.pos:] if end < 0 else text[self.pos:end]
        if "\n" in written or "<" in written:
            self._fail("a <function= or <parameter= tag without its closing >")
            return True
        if end < 0:
            if final:
                self._fail("the output ended inside a tool call")
                return True
            return False
        name = written.strip()
        if not name:
            self._fail("a tool call with an empty function or parameter name")
            return True
        self.pos = end + 1
        if self._phase == "name":
            self._announce(name)
            self._properties = self._tools.get(name, {})
            self._params = set()
            self._arguments = ""
            self._phase = "body"
            return True
        if name in self._params:
            self._fail(f"parameter {name!r} given twice in one tool call")
            return True
        self._param_name = name
        self._value_start = self._search_from = self.pos
        self._phase = "value"
        return True

    def _body(self, final: bool) -> bool:
        """Inside ``<function=...>``: the next ``<parameter=`` or the ``</function>``."""
        rest = self.text[self.pos:].lstrip()
        start = len(self.text) - len(rest)
        if rest.startswith(PARAMETER_START):
            self.pos = start + len(PARAMETER_START)
            self._phase = "param_name"
            return True
        if rest.startswith(FUNCTION_END):
            self.pos = start + len(FUNCTION_END)
            self._end_function()
            self._phase = "next"
            return True
        if not final and (PARAMETER_START.startswith(rest) or FUNCTION_END.startswith(rest)):
            self.pos = start
            return False
        self._fail("text other than parameters inside a <function=...>" if rest
                   else "the output ended inside a tool call")
        return True

    def _value(self, final: bool) -> bool:
        text = self.text
        end = text.find(PARAMETER_END, self._search_from)
        if end < 0:
            if final:
                self._fail("the output ended inside a parameter value")
                return True
            self._search_from = max(self._value_start, len(text) - len(PARAMETER_END) + 1)
            return False
        name = self._param_name
        value = convert_value(_strip_one_newline(text[self._value_start:end]), self._properties.get(name))
        self._arguments += ("{" if not self._params else ", ") + f"{_dumps(name)}: {_dumps(value)}"
        self._params.add(name)
        self._send_arguments(self._arguments)
        self.pos = end + len(PARAMETER_END)
        self._phase = "body"
        return True

    def _end_function(self) -> None:
        call = self._current
        assert call is not None
        arguments = (self._arguments or "{") + "}"
        self._send_arguments(arguments)
        call.arguments = arguments
        self.calls.append(call)
        self._current = None
