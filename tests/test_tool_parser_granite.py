"""The ``granite`` tool parser on hand-written model text in Granite 3.x's format (``<|tool_call|>``,
``<tool_call>`` or nothing, then a JSON list of call objects): whole, and streamed in random
chunkings that must add up to the whole, with OpenAI's delta shape. The parser comes through the
registry (its lazy registration)."""

from __future__ import annotations

import json
import random

import pytest

from sparrow.plugins import get_registry, resolve_parser
from tests.tool_parser_streams import random_pieces, reassemble

TRICKY = {"city": "Paris", "note": 'a "quoted" } brace { ] [', "n": [1, {"x": [2, "]"]}]}
LIST = json.dumps([{"name": "get_weather", "arguments": TRICKY}, {"name": "get_time", "arguments": {}}])
CASES = [
    # (model text, expected content, expected [(name, arguments)])
    ("<|tool_call|>" + LIST, None, [("get_weather", TRICKY), ("get_time", {})]),
    ('  <tool_call> [{"name": "get_time", "arguments": {"tz": "UTC"}}]\nthat was the call', None,
     [("get_time", {"tz": "UTC"})]),
    ('[{"arguments": {"tz": "CET"}, "name": "get_time"}]', None, [("get_time", {"tz": "CET"})]),
    # answers
    ("The answer is 42.", "The answer is 42.", []),
    ("[1] A numbered reference, not a call.", "[1] A numbered reference, not a call.", []),
    ("<|tool_call|>not a list", "<|tool_call|>not a list", []),
    ('<tool_call>[{"arguments": {}}]', '<tool_call>[{"arguments": {}}]', []),
    ("<|tool_call|>[", "<|tool_call|>[", []),
]


def parser():
    return resolve_parser("tool parser", "granite", get_registry().tool_parsers)(None, None)


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
