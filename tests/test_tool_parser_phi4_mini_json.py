"""The ``phi4_mini_json`` tool parser on hand-written model text in Phi-4-mini's format
(``functools[{...}, ...]``): whole, and streamed in random chunkings that must add up to the whole,
with OpenAI's delta shape. The parser comes through the registry (its lazy registration)."""

from __future__ import annotations

import json
import random

import pytest

from sparrow.plugins import get_registry, resolve_parser
from tests.tool_parser_streams import random_pieces, reassemble

TRICKY = {"city": "Paris", "note": 'a "quoted" } brace { ] functools[', "n": [1, {"x": [2, "]"]}]}
CASES = [
    # (model text, expected content, expected [(name, arguments)])
    ('functools[{"name": "get_weather", "arguments": ' + json.dumps(TRICKY) + '}, {"name": "get_time", '
     '"parameters": {"tz": "UTC"}}]', None, [("get_weather", TRICKY), ("get_time", {"tz": "UTC"})]),
    ('Let me check.\nfunctools [ {"name": "get_time", "arguments": {}} ] and that is all',
     "Let me check.", [("get_time", {})]),
    # answers
    ("No calls here, just [brackets] and {braces}.", "No calls here, just [brackets] and {braces}.", []),
    ("functools is a Python module.", "functools is a Python module.", []),
    ('functools[{"arguments": {}}]', 'functools[{"arguments": {}}]', []),
]


def parser():
    return resolve_parser("tool parser", "phi4_mini_json", get_registry().tool_parsers)(None, None)


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
