"""The ``qwen3_coder`` tool parser on hand-written Qwen3-Coder text: split whole
(``extract_tool_calls``) and streamed in random chunkings (and one character at a time) that must
add up to the whole, with OpenAI's delta shape; parameter values typed by the request's tool
schemas, and without a request; malformed calls before and after a call went out."""

from __future__ import annotations

import json
import random

import pytest

from sparrow.entrypoints.openai.protocol import ChatCompletionRequest
from sparrow.entrypoints.openai.tool_parsers.qwen3_coder import convert_value
from sparrow.plugins import get_registry, resolve_parser
from tests.tool_parser_streams import random_pieces as shared_random_pieces
from tests.tool_parser_streams import reassemble

WEATHER = {"type": "object", "properties": {
    "city": {"type": "string"}, "days": {"type": "integer"}, "metric": {"type": "boolean"},
    "ratio": {"type": "number"}, "tags": {"type": "array", "items": {"type": "string"}},
    "opts": {"type": "object"}, "note": {"type": ["string", "null"]}}}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": WEATHER}},
         {"type": "function", "function": {"name": "get_time",
                                           "parameters": {"type": "object", "properties": {"tz": {"type": "string"}}}}}]
REQUEST = ChatCompletionRequest(model="m", messages=[{"role": "user", "content": "Weather?"}], tools=TOOLS)


def call(name: str, *params: tuple[str, str]) -> str:
    body = "".join(f"<parameter={key}>\n{value}\n</parameter>\n" for key, value in params)
    return f"<tool_call>\n<function={name}>\n{body}</function>\n</tool_call>"


PARIS = call("get_weather", ("city", "Paris"), ("days", "3"))
CODE = "def f(x):\n    if x < 3:\n        return '</param'\n\n    return x\n"
TYPED = call("get_weather", ("city", "123"), ("days", "three"), ("metric", "TRUE"), ("ratio", "0.5"),
             ("tags", "['a', 'b']"), ("opts", '{"x": [1, {"y": null}]}'), ("note", "null"), ("extra", "[1, 2]"))
CASES = [
    # (id, model text, with the request's tools?, expected content, expected [(name, arguments)])
    ("one call", PARIS, False, None, [("get_weather", {"city": "Paris", "days": 3})]),
    ("content and two calls",
     "Let me check both.\n\n" + PARIS + "\nand then\n" + call("get_time", ("tz", "UTC")) + "\nDone.", False,
     "Let me check both.", [("get_weather", {"city": "Paris", "days": 3}), ("get_time", {"tz": "UTC"})]),
    ("multi-line string", call("write_file", ("path", "a.py"), ("content", "\n" + CODE + "\n")), True, None,
     [("write_file", {"path": "a.py", "content": "\n" + CODE + "\n"})]),
    ("markup fragments in a value",
     call("get_time", ("tz", "a < b </param </parameter x <parameter=y> </function> <tool_call>")), True, None,
     [("get_time", {"tz": "a < b </param </parameter x <parameter=y> </function> <tool_call>"})]),
    ("typed by the request", TYPED, True, None,
     [("get_weather", {"city": "123", "days": "three", "metric": True, "ratio": 0.5, "tags": ["a", "b"],
                       "opts": {"x": [1, {"y": None}]}, "note": None, "extra": [1, 2]})]),
    ("no request: JSON when it parses", TYPED, False, None,
     [("get_weather", {"city": 123, "days": "three", "metric": "TRUE", "ratio": 0.5, "tags": "['a', 'b']",
                       "opts": {"x": [1, {"y": None}]}, "note": None, "extra": [1, 2]})]),
    ("no parameters, no </tool_call>, unicode",
     "Ça va 🙂\n<tool_call><function=get_time></function>\n<tool_call>\n<function=get_weather>\n"
     "<parameter=city>Zürich</parameter><parameter=metric>false</parameter></function>", True,
     "Ça va 🙂", [("get_time", {}), ("get_weather", {"city": "Zürich", "metric": False})]),
    ("two functions in one block",
     "<tool_call>\n<function=get_time>\n<parameter=tz>\nCET\n</parameter>\n</function>\n"
     "<function=get_weather>\n<parameter=days>\n7\n</parameter>\n</function>\n</tool_call>\n", True, None,
     [("get_time", {"tz": "CET"}), ("get_weather", {"days": 7})]),
    ("no calls", "No tools: 2 < 3, <tool is not a tag, nor is <function=x> alone.\n", False,
     "No tools: 2 < 3, <tool is not a tag, nor is <function=x> alone.\n", []),
    ("malformed: no <function=", "Try: <tool_call>\nget_weather(city='Paris')\n</tool_call>", False,
     "Try: <tool_call>\nget_weather(city='Paris')\n</tool_call>", []),
    ("malformed: unclosed at the end", "Hm.\n<tool_call>\n<function=get_ti", False,
     "Hm.\n<tool_call>\n<function=get_ti", []),
    ("malformed: only <tool_call>", "Hm. <tool_call>\n", False, "Hm. <tool_call>\n", []),
    ("malformed: empty name", "<tool_call>\n<function=>\n</function>\n</tool_call>", False,
     "<tool_call>\n<function=>\n</function>\n</tool_call>", []),
    ("malformed: name runs past a newline", "<tool_call>\n<function=get_time\n</function>", False,
     "<tool_call>\n<function=get_time\n</function>", []),
]


def parser(with_tools: bool):
    cls = resolve_parser("tool parser", "qwen3_coder", get_registry().tool_parsers)
    return cls(None, REQUEST if with_tools else None)


def whole(text: str, with_tools: bool):
    extracted = parser(with_tools).extract_tool_calls(text)
    return extracted.content, tuple((call.name, call.arguments) for call in extracted.tool_calls)


def streamed(text: str, with_tools: bool, pieces: list[str]):
    """Feed ``pieces``; reassemble them as a client would (tests/tool_parser_streams)."""
    assert "".join(pieces) == text
    content, calls = reassemble(parser(with_tools), pieces)
    return content, tuple(calls)


def random_pieces(text: str, rng: random.Random) -> list[str]:
    return shared_random_pieces(text, rng, most=min(len(text), 40))


IDS = [case[0] for case in CASES]


@pytest.mark.parametrize("text, with_tools, content, calls", [case[1:] for case in CASES], ids=IDS)
def test_whole_text_is_split_into_content_and_calls(text, with_tools, content, calls):
    got_content, got_calls = whole(text, with_tools)
    assert got_content == content
    assert [name for name, _ in got_calls] == [name for name, _ in calls]
    for (_, arguments), (_, expected) in zip(got_calls, calls):
        assert arguments == json.dumps(expected, ensure_ascii=False)  # the exact text, in the order written


@pytest.mark.parametrize("text, with_tools", [case[1:3] for case in CASES], ids=IDS)
def test_streaming_in_random_chunkings_equals_the_whole(text, with_tools):
    expected = whole(text, with_tools)
    rng = random.Random(text)
    for _ in range(40):
        assert streamed(text, with_tools, random_pieces(text, rng)) == expected
    assert streamed(text, with_tools, list(text)) == expected


def test_arguments_go_out_as_each_parameter_completes():
    stream = parser(True)
    assert stream.feed("Sure.\n<tool_").content == "Sure."  # a partial <tool_call> and the newline held back
    delta = stream.feed("call>\n<function=get_weather>\n<parameter=ci")
    assert delta.content == ""
    assert [(d.index, d.name, d.arguments) for d in delta.tool_calls] == [(0, "get_weather", "")]
    assert not stream.feed("ty>\nParis\n</param")
    assert [d.arguments for d in stream.feed("eter>\n<parameter=days>\n3\n</parameter>\n").tool_calls] == \
        ['{"city": "Paris", "days": 3']
    assert not stream.feed("</func")
    delta = stream.feed("tion>\n</tool_call>")
    assert [(d.index, d.id, d.name, d.arguments) for d in delta.tool_calls] == [(0, None, None, "}")]
    assert not stream.finish()
    stream = parser(False)
    assert stream.feed("a <tool").content == "a"
    assert stream.feed("box>").content == " <toolbox>"  # not a tag after all


PARIS_ARGUMENTS = '{"city": "Paris", "days": 3}'


@pytest.mark.parametrize("text, sent", [
    ("Hm.\n<tool_call>\n<function=get_time>\n<parameter=tz>\nUTC\n",  # announced, never closed
     ("Hm.", (("get_time", ""),))),
    (PARIS + "\n<tool_call>\n<function=get_time>\n<parameter=tz>\nUTC\n",  # the second never closes
     (None, (("get_weather", PARIS_ARGUMENTS), ("get_time", "")))),
    (PARIS + "<tool_call>\nget_time()\n</tool_call>", (None, (("get_weather", PARIS_ARGUMENTS),))),  # no <function=
    ("Ok.\n<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n"  # a parameter twice
     "<parameter=city>\nRome\n</parameter>\n</function>\n</tool_call>",
     ("Ok.", (("get_weather", '{"city": "Paris"'),))),
    ("<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\nstray text\n</function>",
     (None, (("get_weather", '{"city": "Paris"'),))),
])
def test_malformed_after_a_call_went_out_drops_the_rest(text, sent):
    extracted = parser(False).extract_tool_calls(text)
    assert extracted.tool_calls == [] and extracted.content == text  # whole: all of it is the answer
    rng = random.Random(text)
    for _ in range(40):  # streamed: what went out before the failure, whatever the chunking
        assert streamed(text, False, random_pieces(text, rng)) == sent
    assert streamed(text, False, list(text)) == sent


@pytest.mark.parametrize("value, schema, expected", [
    ("42", {"type": "integer"}, 42), (" -7 ", {"type": "integer"}, -7), ("4.0", {"type": "integer"}, "4.0"),
    ("1_000", {"type": "integer"}, "1_000"), ("2", {"type": "number"}, 2), ("2.5e3", {"type": "number"}, 2500.0),
    ("1e999", {"type": "number"}, "1e999"), ("NaN", {"type": "number"}, "NaN"), ("False", {"type": "boolean"}, False),
    ("yes", {"type": "boolean"}, "yes"), ("null", {"type": "null"}, None), ("null", {"type": ["string", "null"]}, None),
    ("nil", {"type": ["null", "string"]}, "nil"), ("5", {"anyOf": [{"type": "string"}, {"type": "integer"}]}, 5),
    ("{'a': (1, 2), 'b': None}", {"type": "object"}, {"a": [1, 2], "b": None}),
    ("[1, 2]", {"type": "object"}, "[1, 2]"),
    ("{1, 2}", {"type": "array"}, "{1, 2}"), (" 7 ", {"type": "string"}, " 7 "), ("7", {"enum": [7, 8]}, 7),
    ("true", {"type": "bool"}, True), ('"quoted"', None, "quoted"), ("Paris", None, "Paris"), ("NaN", None, "NaN"),
])
def test_value_conversion_by_declared_type(value, schema, expected):
    assert convert_value(value, schema) == expected
