"""The ``glm45`` tool parser on hand-written model text in GLM-4.5's format (``<tool_call>NAME``
then ``<arg_key>``/``<arg_value>`` pairs, ``</tool_call>``): values typed by the request's tool
schemas, whole and streamed in random chunkings that must add up to the whole, with OpenAI's
delta shape. The parser comes through the registry (its lazy registration)."""

from __future__ import annotations

import json
import random
from types import SimpleNamespace

import pytest

from sparrow.plugins import get_registry, resolve_parser
from tests.tool_parser_streams import random_pieces, reassemble

WEATHER = {"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"},
                                            "units": {"type": "object"}, "zip": {"type": "string"}}}
REQUEST = SimpleNamespace(tools=[SimpleNamespace(function=SimpleNamespace(name="get_weather", parameters=WEATHER))])


def call(name: str, **pairs: str) -> str:
    body = "".join(f"<arg_key>{key}</arg_key>\n<arg_value>{value}</arg_value>\n" for key, value in pairs.items())
    return f"<tool_call>{name}\n{body}</tool_call>"


CASES = [
    # (model text, expected content, expected [(name, arguments)])
    (call("get_weather", city="Paris", days="3"), None, [("get_weather", {"city": "Paris", "days": 3})]),
    # a string stays a string ("02134" is not a number there), an object is read as JSON
    ("Checking the forecast.\n" + call("get_weather", city="Boston", zip="02134", units='{"temp": "C"}')
     + "\n" + call("get_time") + "\ntext after the calls",
     "Checking the forecast.", [("get_weather", {"city": "Boston", "zip": "02134", "units": {"temp": "C"}}),
                                ("get_time", {})]),
    # not among the tools: JSON when it parses, else the text
    ("<tool_call>lookup\n<arg_key>ids</arg_key><arg_value>[1, 2]</arg_value><arg_key>q</arg_key>"
     "<arg_value>\n two words \n</arg_value></tool_call>", None, [("lookup", {"ids": [1, 2], "q": "two words"})]),
    # no calls
    ("An answer that mentions <tool> and </tool_call> alone.",
     "An answer that mentions <tool> and </tool_call> alone.", []),
    # malformed (before any call went out): the whole text is the answer
    ("<tool_call>get weather\n</tool_call>", "<tool_call>get weather\n</tool_call>", []),
    ("Hm.<tool_call>f\nstray text<arg_key>a</arg_key><arg_value>1</arg_value></tool_call>",
     "Hm.<tool_call>f\nstray text<arg_key>a</arg_key><arg_value>1</arg_value></tool_call>", []),
    ("<tool_call>f\n<arg_key>a</arg_key>", "<tool_call>f\n<arg_key>a</arg_key>", []),
]


def parser():
    return resolve_parser("tool parser", "glm45", get_registry().tool_parsers)(None, REQUEST)


@pytest.mark.parametrize(("text", "content", "calls"), CASES)
def test_whole_and_streamed_in_random_pieces(text, content, calls):
    extracted = parser().extract_tool_calls(text)
    assert extracted.content == content
    assert [(c.name, json.loads(c.arguments)) for c in extracted.tool_calls] == calls
    rng = random.Random(len(text))
    for _ in range(20):
        streamed_content, streamed_calls = reassemble(parser(), random_pieces(text, rng))
        assert streamed_content == content
        assert [(name, json.loads(arguments)) for name, arguments in streamed_calls] == calls
