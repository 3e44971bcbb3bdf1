"""The ``mistral`` tool parser on hand-written model text, both formats (pre-v11 ``[TOOL_CALLS]``
and a JSON list of calls; v11+ ``[TOOL_CALLS]name[ARGS]{...}``): whole, and streamed in random
chunkings that must add up to the whole, with OpenAI's delta shape. The parser comes through the
registry, so its lazy registration is tested too."""

from __future__ import annotations

import json
import random

import pytest

from sparrow.entrypoints.openai.tool_parsers.json_scanner import ArgumentsScanner
from sparrow.plugins import get_registry, resolve_parser
from tests.tool_parser_streams import random_pieces, reassemble

TRICKY = {"city": "Paris", "note": 'a "quoted" } brace {', "n": [1, {"x": [2, "]"]}], "path": "C:\\tmp"}
TRICKY_JSON = json.dumps(TRICKY)
CASES = [
    # (model text, expected content, expected [(name, arguments)])
    # pre-v11: a list of call objects
    ('[TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Paris"}}, {"name": "get_time", "arguments": {}}]',
     None, [("get_weather", {"city": "Paris"}), ("get_time", {})]),
    (f'Let me check.\n\n[TOOL_CALLS][{{"name": "get_weather", "arguments": {TRICKY_JSON}, "id": "a1B2c3D4e"}}]',
     "Let me check.", [("get_weather", TRICKY)]),
    ('[TOOL_CALLS]  [ {"id": "Zz9Yy8Xx7", "parameters" : {"tz": "UTC"}, "name":"get_time" } ,\n'
     '{"name": "get_weather"} ]\nextra text after the calls',
     None, [("get_time", {"tz": "UTC"}), ("get_weather", {})]),
    ('[TOOL_CALLS] {"name": "get_time", "arguments": {"tz": "CET"}}', None, [("get_time", {"tz": "CET"})]),
    ('[TOOL_CALLS] [{"name": "get_time", "arguments": {"tz": "UTC"}}', None, [("get_time", {"tz": "UTC"})]),
    # v11+: name[ARGS]{...}
    ('[TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}', None, [("get_weather", {"city": "Paris"})]),
    (f'Sure [thinking [brackets] aside].[TOOL_CALLS]get_weather[ARGS]{TRICKY_JSON}[TOOL_CALLS]get_time[ARGS]{{}}',
     "Sure [thinking [brackets] aside].", [("get_weather", TRICKY), ("get_time", {})]),
    ('[TOOL_CALLS]get_weather[ARGS]{"city": "Rome", "days": 3}get_time[ARGS] {"tz": "UTC"}\n\nI called two tools.',
     None, [("get_weather", {"city": "Rome", "days": 3}), ("get_time", {"tz": "UTC"})]),
    ('[TOOL_CALLS]get_time[CALL_ID]k3J9x0PqR[ARGS]{"tz": "CET"}', None, [("get_time", {"tz": "CET"})]),
    ('Checking.[TOOL_CALLS]get_time{"tz": "UTC"}', "Checking.", [("get_time", {"tz": "UTC"})]),
    # no calls
    ("No tools needed: [TOOL] and [TOOL_CALL are not markers, {braces} neither.",
     "No tools needed: [TOOL] and [TOOL_CALL are not markers, {braces} neither.", []),
    ("  spaced answer \n", "  spaced answer \n", []),
    # malformed (before any call went out): the whole text is the answer
    ("[TOOL_CALLS] not json at all", "[TOOL_CALLS] not json at all", []),
    ('Hm. [TOOL_CALLS] [{"arguments": {"city": "Oslo"}}]', 'Hm. [TOOL_CALLS] [{"arguments": {"city": "Oslo"}}]', []),
    ('[TOOL_CALLS] [{name: get_weather}]', '[TOOL_CALLS] [{name: get_weather}]', []),
    ('[TOOL_CALLS]get weather[ARGS]{"city": "Paris"}', '[TOOL_CALLS]get weather[ARGS]{"city": "Paris"}', []),
    ('[TOOL_CALLS]get_weather[ARGS]["Paris"]', '[TOOL_CALLS]get_weather[ARGS]["Paris"]', []),
    ('[TOOL_CALLS]get_weather', '[TOOL_CALLS]get_weather', []),
    ("The end.\n[TOOL_CALLS]", "The end.\n[TOOL_CALLS]", []),
]


def parser_for():
    return resolve_parser("tool parser", "mistral", get_registry().tool_parsers)(None, None)


def is_mistral_id(call_id) -> bool:
    return isinstance(call_id, str) and len(call_id) == 9 and call_id.isascii() and call_id.isalnum()


def whole(text: str):
    extracted = parser_for().extract_tool_calls(text)
    assert all(is_mistral_id(call.id) for call in extracted.tool_calls)
    assert len({call.id for call in extracted.tool_calls}) == len(extracted.tool_calls)
    return extracted.content, [(call.name, call.arguments) for call in extracted.tool_calls]


def streamed(text: str, rng: random.Random):
    """Feed ``text`` in random pieces; reassemble it as a client would (tests/tool_parser_streams),
    with Mistral's 9-character ids."""
    return reassemble(parser_for(), random_pieces(text, rng, most=16), id_ok=is_mistral_id)


@pytest.mark.parametrize("text, content, calls", CASES)
def test_whole_text_splits_into_content_and_calls(text, content, calls):
    got_content, got_calls = whole(text)
    assert got_content == content
    assert [(name, json.loads(arguments)) for name, arguments in got_calls] == calls


@pytest.mark.parametrize("text", [case[0] for case in CASES])
def test_streaming_in_random_chunkings_equals_the_whole(text):
    expected = whole(text)
    rng = random.Random(text)
    for _ in range(40):
        assert streamed(text, rng) == expected
    # and one character at a time
    parser, content = parser_for(), ""
    for char in text:
        content += parser.feed(char).content
    assert (content + parser.finish().content or None) == expected[0]


def test_arguments_go_out_as_written_and_markers_are_held_back():
    parser = parser_for()
    assert parser.feed("Checking \n[TOOL_").content == "Checking"  # may precede a call
    delta = parser.feed("CALLS]get_weather[AR")
    assert not delta  # the name is not complete before [ARGS]
    delta = parser.feed('GS]{"city": "Pa')
    assert delta.content == "" and delta.tool_calls[0].name == "get_weather"
    assert delta.tool_calls[0].arguments == '{"city": "Pa'
    assert parser.feed('ris"}').tool_calls[0].arguments == 'ris"}'
    delta = parser.feed('[TOOL_CALLS][{"name": "get_time", "arguments": {"tz"')  # formats may mix
    assert [(call.index, call.name, call.arguments) for call in delta.tool_calls] == [(1, "get_time", '{"tz"')]
    assert parser.feed(': "UTC"}}]').tool_calls[0].arguments == ': "UTC"}'
    assert not parser.finish() and parser.failed is None
    parser = parser_for()
    assert parser.feed("a [TOOL").content == "a"
    assert parser.feed("S]").content == " [TOOLS]"  # not the marker after all


def test_a_malformed_call_after_one_went_out_drops_the_rest():
    text = '[TOOL_CALLS]get_time[ARGS]{"tz": "UTC"}[TOOL_CALLS]get_weather[ARGS]{"city": Paris}'
    content, calls = whole(text)
    assert content == text and calls == []  # as vLLM: the whole text is the answer
    parser = parser_for()
    split = text.index("Paris}")  # the second call is announced before its arguments break
    deltas = [parser.feed(text[:split]), parser.feed(text[split:]), parser.finish()]
    assert [call.name for delta in deltas for call in delta.tool_calls] == ["get_time", "get_weather"]
    assert parser.failed and not "".join(delta.content for delta in deltas)


def test_the_arguments_scanner_streams_one_object():
    text = ' {"a": "}", "b": [1, {"c": 2}]} trailing'
    scanner = ArgumentsScanner("f")
    assert scanner.name == "f"
    pos = scanner.scan(text[:12], 0)
    assert not scanner.done and scanner.arguments_so_far(text) == '{"a": "}", '
    pos = scanner.scan(text, pos)
    assert scanner.done and text[pos:] == " trailing"
    assert json.loads(scanner.arguments(text)) == {"a": "}", "b": [1, {"c": 2}]}
    for bad in ('"text"', "[1]", '{"a": }'):
        scanner = ArgumentsScanner("f")
        scanner.scan(bad, 0)
        assert scanner.failed and not scanner.done


def test_a_request_it_parses_is_decoded_with_special_tokens():
    """[TOOL_CALLS] is a special token: with tool_choice auto the request keeps special tokens in
    its text (vLLM's adjust_request); forced choices and other parsers leave the request alone."""
    from sparrow.entrypoints.openai.protocol import ChatCompletionRequest
    from sparrow.entrypoints.openai.tool_parsers.base import adjust_request
    from sparrow.entrypoints.openai.tool_parsers.hermes import HermesToolParser

    parser_cls = resolve_parser("tool parser", "mistral", get_registry().tool_parsers)
    for cls, kind, skipped in ((parser_cls, "auto", False), (parser_cls, "required", True),
                               (HermesToolParser, "auto", True), (None, "auto", True)):
        request = ChatCompletionRequest(model="m", messages=[{"role": "user", "content": "hi"}])
        adjust_request(cls, request, kind)
        assert request.skip_special_tokens is skipped, (cls, kind)
