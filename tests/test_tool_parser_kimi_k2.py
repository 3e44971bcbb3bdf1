"""The ``kimi_k2`` tool parser on hand-written model text in Kimi K2's format (a section of
``<|tool_call_begin|>functions.NAME:INDEX<|tool_call_argument_begin|>{...}<|tool_call_end|>``
calls): whole, and streamed in random chunkings that must add up to the whole, with OpenAI's delta
shape and the model's own call ids. The parser comes through the registry (lazy registration)."""

from __future__ import annotations

import json
import random

import pytest

from sparrow.plugins import get_registry, resolve_parser
from tests.tool_parser_streams import random_pieces, reassemble

BEGIN, END = "<|tool_calls_section_begin|>", "<|tool_calls_section_end|>"
TRICKY = {"city": "Paris", "note": 'a "quoted" } brace { <|tool_call_end|>', "n": [1, {"x": [2, "]"]}]}


def call(call_id: str, arguments: dict | str) -> str:
    body = arguments if isinstance(arguments, str) else json.dumps(arguments)
    return f"<|tool_call_begin|>{call_id}<|tool_call_argument_begin|>{body}<|tool_call_end|>"


CASES = [
    # (model text, expected content, expected [(id, name, arguments)])
    (BEGIN + call("functions.get_weather:0", {"city": "Paris"}) + END, None,
     [("functions.get_weather:0", "get_weather", {"city": "Paris"})]),
    ("Let me check both.\n" + BEGIN + call("functions.get_weather:0", TRICKY) + "\n"
     + call("functions.get_time:1", {}) + END + "text after the section",
     "Let me check both.",
     [("functions.get_weather:0", "get_weather", TRICKY), ("functions.get_time:1", "get_time", {})]),
    # the singular spelling of the section, an id without the functions. prefix, no closing marker
    ("<|tool_call_section_begin|>" + call("get_time:3", '{ "tz" : "UTC" }'), None,
     [("get_time:3", "get_time", {"tz": "UTC"})]),
    # no calls
    ("An answer naming <|tool_call_begin|> alone.", "An answer naming <|tool_call_begin|> alone.", []),
    # malformed (before any call went out): the whole text is the answer
    (BEGIN + "stray", BEGIN + "stray", []),
    ("Hm." + BEGIN + call("functions.f:0", '["Paris"]') + END, "Hm." + BEGIN + call("functions.f:0", '["Paris"]') + END,
     []),
    (BEGIN + call("no index", {}) + END, BEGIN + call("no index", {}) + END, []),
]


def parser():
    return resolve_parser("tool parser", "kimi_k2", get_registry().tool_parsers)(None, None)


@pytest.mark.parametrize(("text", "content", "calls"), CASES)
def test_whole_and_streamed_in_random_pieces(text, content, calls):
    extracted = parser().extract_tool_calls(text)
    assert extracted.content == content
    assert [(c.id, c.name, json.loads(c.arguments)) for c in extracted.tool_calls] == calls
    ids = [call_id for call_id, _, _ in calls]
    rng = random.Random(len(text))
    for _ in range(20):
        seen: list[str] = []
        streamed_content, streamed_calls = reassemble(parser(), random_pieces(text, rng),
                                                      id_ok=lambda call_id: seen.append(call_id) is None)
        assert streamed_content == content and seen == ids
        assert [(name, json.loads(arguments)) for name, arguments in streamed_calls] == \
            [(name, arguments) for _, name, arguments in calls]
