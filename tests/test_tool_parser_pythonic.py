"""The ``pythonic`` tool parser on hand-written model text: whole (``extract_tool_calls``), and
streamed in random chunkings that must add up to the whole, with OpenAI's delta shape (a call
opens with its index, id and name, then sends argument text only). No model, no server."""

from __future__ import annotations

import json
import random

import pytest

from sparrow.plugins import get_registry, resolve_parser
from tests.tool_parser_streams import random_pieces, reassemble

NESTED = ('[plan(steps=[{"do": "fly", "to": ["Rome", "Oslo"]}, {"do": "rest", "hours": 8}], '
          'meta={"tags": ("a", "b"), "depth": {"x": {"y": []}}})]')
CASES = [
    # (model text, expected content, expected [(name, arguments)])
    ('[get_weather(city="Paris", days=3)]', None, [("get_weather", {"city": "Paris", "days": 3})]),
    ("[get_weather(city='Rome', days=2), get_time(tz='UTC'), get_time(tz=\"CET\")]",
     None, [("get_weather", {"city": "Rome", "days": 2}), ("get_time", {"tz": "UTC"}), ("get_time", {"tz": "CET"})]),
    (NESTED, None, [("plan", {"steps": [{"do": "fly", "to": ["Rome", "Oslo"]}, {"do": "rest", "hours": 8}],
                              "meta": {"tags": ["a", "b"], "depth": {"x": {"y": []}}}})]),
    ("""[say(text='it\\'s "fine"', other="a \\"b\\" \\\\ c", nl='x\\ny', raw=r'\\d+', tri='''x ' "y" ''')]""",
     None, [("say", {"text": 'it\'s "fine"', "other": 'a "b" \\ c', "nl": "x\ny", "raw": "\\d+",
                     "tri": "x ' \"y\" "})]),
    ('[search(query="a ] bracket ) and [ ( inside", note=\'#not a comment\')]',
     None, [("search", {"query": "a ] bracket ) and [ ( inside", "note": "#not a comment"})]),
    ("[configure(on=True, off=False, nothing=None, ratio=0.25, big=1e3, neg=-7, units='°C')]",
     None, [("configure", {"on": True, "off": False, "nothing": None, "ratio": 0.25, "big": 1000.0, "neg": -7,
                           "units": "°C"})]),
    ("[get_time(), refresh( )]", None, [("get_time", {}), ("refresh", {})]),
    ('<|python_start|>[get_weather(city="Oslo", days=1)]<|python_end|>',
     None, [("get_weather", {"city": "Oslo", "days": 1})]),
    ('<|python_start|> [get_time(tz="UTC"), get_time(tz="CET")]<|python_end|>',
     None, [("get_time", {"tz": "UTC"}), ("get_time", {"tz": "CET"})]),
    ('\n  [get_time(tz="UTC")]', None, [("get_time", {"tz": "UTC"})]),
    ('[\n  get_time(tz="UTC",),  # the time\n  get_weather(\n    city="Paris",\n    days=2,\n  ),\n]',
     None, [("get_time", {"tz": "UTC"}), ("get_weather", {"city": "Paris", "days": 2})]),
    ('[get_time(tz="UTC")] and then some text the reply drops', None, [("get_time", {"tz": "UTC"})]),
    # answer text, whole
    ("The weather in Paris is sunny.", "The weather in Paris is sunny.", []),
    ("  I'd call [get_time(tz='UTC')] here.", "  I'd call [get_time(tz='UTC')] here.", []),
    ("<|python_start|>print('hi')<|python_end|>", "<|python_start|>print('hi')<|python_end|>", []),
    ("<|python", "<|python", []),
    ("   ", "   ", []),
    ("[1, 2, 3] are the numbers.", "[1, 2, 3] are the numbers.", []),
    ("[see above]", "[see above]", []),
    ("[]", "[]", []),
    ('[get_weather("Paris", days=3)]', '[get_weather("Paris", days=3)]', []),
    ("[weather.get(city='Paris')]", "[weather.get(city='Paris')]", []),
    ("[get_time(tz=zone)]", "[get_time(tz=zone)]", []),
    ("[get_time(tz='U' + 'TC')]", "[get_time(tz='U' + 'TC')]", []),
    ("[get_time(**{'tz': 'UTC'})]", "[get_time(**{'tz': 'UTC'})]", []),
    ("[get_time(tz={'UTC', 'CET'})]", "[get_time(tz={'UTC', 'CET'})]", []),
    ("[get_time(tz='UTC'), 42]", "[get_time(tz='UTC'), 42]", []),
    ("[get_time(tz='UTC'] oops)", "[get_time(tz='UTC'] oops)", []),
    ('[get_weather(city="Paris", days=3), get_time(tz="UT', '[get_weather(city="Paris", days=3), get_time(tz="UT', []),
    ("[get_time(tz='UTC')", "[get_time(tz='UTC')", []),
]


def parser():
    return resolve_parser("tool parser", "pythonic", get_registry().tool_parsers)(None, None)


def whole(text: str):
    extracted = parser().extract_tool_calls(text)
    for call in extracted.tool_calls:
        assert call.id.startswith("chatcmpl-tool-")
    return extracted.content, [(call.name, call.arguments) for call in extracted.tool_calls]


def streamed(text: str, rng: random.Random):
    """Feed ``text`` in random pieces; reassemble it as a client would (tests/tool_parser_streams)."""
    return reassemble(parser(), random_pieces(text, rng))


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
    the_parser = parser()
    deltas = [the_parser.feed(char) for char in text] + [the_parser.finish()]
    assert ("".join(delta.content for delta in deltas) or None) == expected[0]
    assert [(call.name, call.arguments) for delta in deltas for call in delta.tool_calls] == expected[1]


def test_arguments_are_json_dumps_of_the_values():
    _, calls = whole("[f(a=True, b=None, c='é', d=(1, 2.5))]")
    assert calls == [("f", '{"a": true, "b": null, "c": "é", "d": [1, 2.5]}')]


def test_text_streams_at_once_and_a_list_is_held_until_it_closes():
    the_parser = parser()
    assert the_parser.feed("Sunny, ").content == "Sunny, "
    assert the_parser.feed("[22 C]").content == "[22 C]"
    the_parser = parser()
    assert not the_parser.feed("  [get_time(tz='UTC'")
    assert not the_parser.feed("), get_weather(city='a]'")
    delta = the_parser.feed(", days=1)]<|python_end|>")
    assert delta.content == ""
    assert [(call.index, call.name, call.arguments) for call in delta.tool_calls] == [
        (0, "get_time", '{"tz": "UTC"}'), (1, "get_weather", '{"city": "a]", "days": 1}')]
    assert [call.id for call in delta.tool_calls] == [call.id for call in the_parser.calls]
    assert not the_parser.feed(" trailing text") and not the_parser.finish()


def test_a_list_that_cannot_be_calls_is_let_go_before_it_closes():
    the_parser = parser()
    assert the_parser.feed("[1").content == "[1"  # a call starts with a name
    the_parser = parser()
    assert not the_parser.feed("[see")
    assert the_parser.feed(" above").content == "[see above"  # a name, then not "("
    the_parser = parser()
    assert the_parser.feed("[get_time(tz='x\n").content == "[get_time(tz='x\n"  # a one-quote string spans lines


def test_an_unclosed_list_is_content_at_finish():
    the_parser = parser()
    assert not the_parser.feed("[get_time(tz='UTC')")
    assert the_parser.finish().content == "[get_time(tz='UTC')"
