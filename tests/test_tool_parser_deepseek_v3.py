"""The ``deepseek_v3`` tool parser on hand-written model text in DeepSeek-V3's format (the calls
between ``<｜tool▁calls▁begin｜>`` and ``<｜tool▁calls▁end｜>``, each ``function<｜tool▁sep｜>name``
and a fenced JSON block): whole, and streamed in random chunkings that must add up to the whole,
with OpenAI's delta shape. The parser comes through the registry (its lazy registration)."""

from __future__ import annotations

import json
import random

import pytest

from sparrow.plugins import get_registry, resolve_parser
from tests.tool_parser_streams import random_pieces, reassemble

BEGIN, END = "<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>"
TRICKY = {"city": "Paris", "note": 'a "quoted" } brace { and ```fence```', "n": [1, {"x": [2, "]"]}]}


def call(name: str, arguments: dict | str, kind: str = "function") -> str:
    body = arguments if isinstance(arguments, str) else json.dumps(arguments)
    return f"<｜tool▁call▁begin｜>{kind}<｜tool▁sep｜>{name}\n```json\n{body}\n```<｜tool▁call▁end｜>"


CASES = [
    # (model text, expected content, expected [(name, arguments)])
    (BEGIN + call("get_weather", {"city": "Paris"}) + END, None, [("get_weather", {"city": "Paris"})]),
    ("Let me look that up." + BEGIN + call("get_weather", TRICKY) + call("get_time", {}) + END,
     "Let me look that up.", [("get_weather", TRICKY), ("get_time", {})]),
    ("Two calls:\n\n" + BEGIN + call("get_time", {"tz": "UTC"}) + "\n" + call("get_time", {"tz": "CET"}) + END
     + "text after the calls is not part of the reply",
     "Two calls:", [("get_time", {"tz": "UTC"}), ("get_time", {"tz": "CET"})]),
    (BEGIN + call("get_time", '{\n  "tz": "UTC"\n}'), None, [("get_time", {"tz": "UTC"})]),  # no closing marker
    # no calls
    ("Plain answer with a ```json\n{}\n``` block and <｜tool▁sep｜> alone.",
     "Plain answer with a ```json\n{}\n``` block and <｜tool▁sep｜> alone.", []),
    # malformed (before any call went out): the whole text is the answer
    (BEGIN + "not a call", BEGIN + "not a call", []),
    ("Hm." + BEGIN + "<｜tool▁call▁begin｜>function<｜tool▁sep｜>f\n```json\n[1, 2]\n```<｜tool▁call▁end｜>" + END,
     "Hm." + BEGIN + "<｜tool▁call▁begin｜>function<｜tool▁sep｜>f\n```json\n[1, 2]\n```<｜tool▁call▁end｜>" + END, []),
]


def parser():
    return resolve_parser("tool parser", "deepseek_v3", get_registry().tool_parsers)(None, None)


@pytest.mark.parametrize(("text", "content", "calls"), CASES)
def test_whole_and_streamed_in_random_pieces(text, content, calls):
    extracted = parser().extract_tool_calls(text)
    assert extracted.content == content
    assert [(c.name, json.loads(c.arguments)) for c in extracted.tool_calls] == calls
    rng = random.Random(hash(text) % 1000)
    for _ in range(20):
        streamed_content, streamed_calls = reassemble(parser(), random_pieces(text, rng))
        assert streamed_content == content
        assert [(name, json.loads(arguments)) for name, arguments in streamed_calls] == calls


def test_the_markers_need_special_tokens_kept():
    assert parser().keeps_special_tokens


def test_a_call_cut_short_is_answer_text_whole_and_dropped_streamed():
    """The output ends inside a call's arguments: whole, the text is the answer (vLLM's rule for
    a malformed call); streamed, the call had gone out, so the rest is dropped."""
    text = "Sure." + BEGIN + '<｜tool▁call▁begin｜>function<｜tool▁sep｜>f\n```json\n{"a": 1'
    extracted = parser().extract_tool_calls(text)
    assert (extracted.content, extracted.tool_calls) == (text, [])
    content, calls = reassemble(parser(), [text[:60], text[60:]])
    assert content == "Sure." and [name for name, _ in calls] == ["f"]
