"""Tool calling: the tool parsers on hand-written model text (whole, and streamed in random
chunkings that must add up to the whole), the parser hook, and `sparrow serve` with the real
`openai` client: tool_choice required and named (generated under a JSON grammar, so every
argument object validates with `jsonschema`), auto (the hermes parser finds calls in the text),
streamed as OpenAI's tool-call deltas and reassembled by the SDK's own helpers; bad choices are
400s naming the field, bad flags one CLI line."""

from __future__ import annotations

import argparse
import json
import random
import subprocess
import sys
from pathlib import Path
from typing import Literal

import jsonschema
import openai
import pytest
from pydantic import BaseModel

from sparrow.entrypoints.openai.api_server import tool_parser_class
from sparrow.entrypoints.openai.chat_output import ReplyParsers
from sparrow.entrypoints.openai.protocol import ChatCompletionRequest
from sparrow.entrypoints.openai.tool_calling import MAX_PARALLEL_TOOL_CALLS, ToolChoice
from sparrow.entrypoints.openai.tool_parsers import HermesToolParser
from sparrow.hookspecs import hookimpl
from sparrow.plugins import PluginError, get_registry, resolve_parser
from tests.test_hooks import registered
from tests.test_server import MODEL_NAME, serve_for_module
from tests.tool_parser_streams import random_pieces, reassemble

WEATHER = {"type": "object", "properties": {
    "city": {"enum": ["Paris", "Rome", "Oslo"]},
    "days": {"type": "integer", "minimum": 1, "maximum": 7}},
    "required": ["city", "days"], "additionalProperties": False}
TIME = {"type": "object", "properties": {"tz": {"enum": ["UTC", "CET"]}}, "required": ["tz"],
        "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather forecast",
                                           "parameters": WEATHER}},
         {"type": "function", "function": {"name": "get_time", "parameters": TIME}}]
SCHEMAS = {"get_weather": WEATHER, "get_time": TIME}
MESSAGES = [{"role": "user", "content": "What is the weather in Paris?"}]
PLUGIN_FILE = Path(__file__).resolve().parent / "tool_parser_plugin.py"
MAX_TOKENS = 120  # above the longest single call the schemas allow


# -- parsers on hand-written text ---------------------------------------------------------------
CALL = '{"name": "get_weather", "arguments": {"city": "Paris", "note": "a \\"quoted\\" } brace", "n": [1, {"x": 2}]}}'
CASES = [
    # (parser, model text, expected content, expected [(name, arguments)])
    ("hermes", f"Let me check.\n<tool_call>\n{CALL}\n</tool_call>",
     "Let me check.", [("get_weather", {"city": "Paris", "note": 'a "quoted" } brace', "n": [1, {"x": 2}]})]),
    ("hermes", '<tool_call>\n{"arguments": {}, "name": "get_time"}\n</tool_call>\n<tool_call>'
               '{"name": "get_weather", "arguments": {"city": "Rome"}}</tool_call>',
     None, [("get_time", {}), ("get_weather", {"city": "Rome"})]),
    ("hermes", '<tool_call>{"name": "get_time"}</tool_call>', None, [("get_time", {})]),
    ("hermes", "No tools needed: 2 < 3 and <tool is not a tag.", "No tools needed: 2 < 3 and <tool is not a tag.", []),
    ("hermes", "Broken: <tool_call>{name: get_weather}</tool_call>",
     "Broken: <tool_call>{name: get_weather}</tool_call>", []),
    ("hermes", '<tool_call>{"name": "get_time", "arguments": {"tz": "UTC"}}', None, [("get_time", {"tz": "UTC"})]),
    ("llama3_json", '{"name": "get_weather", "parameters": {"city": "Oslo", "days": 3}}; '
                    '{"name": "get_time", "parameters": {"tz": "CET"}}',
     None, [("get_weather", {"city": "Oslo", "days": 3}), ("get_time", {"tz": "CET"})]),
    ("llama3_json", '<|python_tag|>{"name": "get_time", "parameters": {"tz": "UTC"}}',
     None, [("get_time", {"tz": "UTC"})]),
    ("llama3_json", "  The answer is {42}.", "  The answer is {42}.", []),
    ("llama3_json", '{"answer": 42}', '{"answer": 42}', []),
    ("llama3_json", "<|python_tag|>print(1)", "<|python_tag|>print(1)", []),
]


def parser_for(name: str):
    return resolve_parser("tool parser", name, get_registry().tool_parsers)(None, None)


def whole(name: str, text: str):
    extracted = parser_for(name).extract_tool_calls(text)
    return extracted.content, [(call.name, call.arguments) for call in extracted.tool_calls]


def streamed(name: str, text: str, rng: random.Random):
    """Feed ``text`` in random pieces; reassemble it as a client would (tests/tool_parser_streams)."""
    return reassemble(parser_for(name), random_pieces(text, rng))


@pytest.mark.parametrize("name, text, content, calls", CASES)
def test_parsers_split_hand_written_model_text(name, text, content, calls):
    got_content, got_calls = whole(name, text)
    assert got_content == content
    assert [(call_name, json.loads(arguments)) for call_name, arguments in got_calls] == calls


@pytest.mark.parametrize("name, text", [(case[0], case[1]) for case in CASES])
def test_streaming_in_random_chunkings_equals_the_whole(name, text):
    expected = whole(name, text)
    rng = random.Random(text)
    for _ in range(40):
        assert streamed(name, text, rng) == expected


def test_a_partial_tag_is_held_back_until_the_next_piece_tells():
    parser = HermesToolParser()
    assert parser.feed("Checking \n<tool_").content == "Checking"  # the space and newline may precede a call
    delta = parser.feed('call>{"name": "get_time", "arguments": {"tz"')
    assert delta.content == "" and delta.tool_calls[0].name == "get_time"
    assert delta.tool_calls[0].arguments == '{"tz"'
    assert parser.feed(': "UTC"}}</tool_call>').tool_calls[0].arguments == ': "UTC"}'
    parser = HermesToolParser()
    assert parser.feed("a <tool").content == "a"
    assert parser.feed("box>").content == " <toolbox>"  # not a tag after all


# -- the hook ----------------------------------------------------------------------------------
class FunctionCallTagParser(HermesToolParser):
    """A plugin's format: hermes with another tag."""

    call_start = "<function_call>"


def test_sparrow_register_tool_parsers():
    class Plugin:
        @hookimpl
        def sparrow_register_tool_parsers(self, register):
            register("function_call_tag", FunctionCallTagParser)

    with registered(Plugin(), "tag-parser-plugin"):
        args = argparse.Namespace(tool_call_parser="function_call_tag", enable_auto_tool_choice=True)
        parser_cls = tool_parser_class(args)
        assert parser_cls is FunctionCallTagParser
        request = ChatCompletionRequest(messages=MESSAGES, tools=TOOLS)
        parsers = ReplyParsers(request, ToolChoice("auto"), [], tool_parser_cls=parser_cls)
        message, called = parsers.message("assistant", "", 'Sure <function_call>{"name": "get_time", '
                                                           '"arguments": {"tz": "CET"}}</function_call>')
        assert called and parsers.finish_reason("stop", called) == "tool_calls"
        assert message.content == "Sure" and message.tool_calls[0].function.name == "get_time"
        assert json.loads(message.tool_calls[0].function.arguments) == {"tz": "CET"}
    with pytest.raises(ValueError, match="--tool-call-parser: unknown tool parser 'function_call_tag'; "
                                         "registered: .*hermes.*llama3_json"):
        tool_parser_class(args)


def test_a_tool_parser_name_clash_names_both_plugins():
    class Clash:
        @hookimpl
        def sparrow_register_tool_parsers(self, register):
            register("hermes", FunctionCallTagParser)

    with registered(Clash(), "clashing-parser"):
        with pytest.raises(PluginError, match="tool parser 'hermes' is registered by both .*clashing-parser"):
            get_registry()


def test_bad_parser_flags_are_one_cli_line_before_the_model_loads(tmp_path):
    for flags, phrase in [(["--tool-call-parser", "nope"], "--tool-call-parser: unknown tool parser 'nope'; "
                                                           "registered: deepseek_v3, glm45, granite, hermes, "
                                                           "kimi_k2, llama3_json"),
                          (["--enable-auto-tool-choice"], "--enable-auto-tool-choice needs --tool-call-parser"),
                          (["--reasoning-parser", "nope"], "'reasoning_parser': unknown reasoning parser 'nope'")]:
        # No model is named: the parser flags are checked before the (built-in) model is even resolved or loaded.
        result = subprocess.run([sys.executable, "-m", "sparrow.entrypoints.cli", "serve", "--port", "0", *flags],
                                capture_output=True, text=True, timeout=120, cwd=tmp_path)
        lines = result.stderr.strip().splitlines()
        assert result.returncode == 2 and len(lines) == 1 and phrase in lines[0], result.stderr


def test_a_tool_parser_plugin_file_registers_its_parsers_and_bad_files_are_one_cli_line(tmp_path):
    from sparrow.plugins import get_plugin_manager

    args = argparse.Namespace(tool_parser_plugin=str(PLUGIN_FILE), tool_call_parser="hermes_from_file",
                              enable_auto_tool_choice=True)
    try:
        parser_cls = tool_parser_class(args)
        assert parser_cls.__name__ == "FileHermesToolParser" and issubclass(parser_cls, HermesToolParser)
        assert tool_parser_class(args) is parser_cls  # loaded once per process
    finally:
        get_plugin_manager().unregister(name=f"tool-parser-plugin:{PLUGIN_FILE.resolve()}")
    no_hook = tmp_path / "no_hook.py"
    no_hook.write_text("X = 1\n")
    broken = tmp_path / "broken.py"
    broken.write_text("import not_a_module_anywhere\n")
    for flags, phrase in [
            (["--tool-parser-plugin", str(PLUGIN_FILE), "--tool-call-parser", "nope"],
             "--tool-call-parser: unknown tool parser 'nope'; registered: deepseek_v3, glm45, granite, hermes, "
             "hermes_from_file, kimi_k2, llama3_json"),
            (["--tool-parser-plugin", str(tmp_path / "missing.py")], "--tool-parser-plugin: no such file"),
            (["--tool-parser-plugin", str(no_hook)], "defines no sparrow_register_tool_parsers hook"),
            (["--tool-parser-plugin", str(broken)], "failed to import: ModuleNotFoundError")]:
        result = subprocess.run([sys.executable, "-m", "sparrow.entrypoints.cli", "serve", "--port", "0", *flags],
                                capture_output=True, text=True, timeout=120, cwd=tmp_path)
        lines = result.stderr.strip().splitlines()
        assert result.returncode == 2 and len(lines) == 1 and phrase in lines[0], result.stderr


# -- through the server --------------------------------------------------------------------------
@pytest.fixture(scope="module")
def server(qwen3_dir, tmp_path_factory):
    # The parser comes from a plain file (--tool-parser-plugin): hermes under another name.
    yield from serve_for_module(qwen3_dir, tmp_path_factory, "tool-logs", "--enable-auto-tool-choice",
                                "--tool-parser-plugin", str(PLUGIN_FILE), "--tool-call-parser", "hermes_from_file")


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return server.client()


def ask(client, stream=False, **kwargs):
    kwargs = {"temperature": 1.0, "max_completion_tokens": MAX_TOKENS, "tools": TOOLS, **kwargs}
    return client.chat.completions.create(model=MODEL_NAME, messages=MESSAGES, stream=stream, **kwargs)


def collect(stream) -> tuple[str | None, list[dict], str | None]:
    """A chat stream's content, tool calls and finish reason, checking each tool-call delta."""
    content, calls, finish = "", {}, None
    for chunk in stream:
        for choice in chunk.choices:
            content += choice.delta.content or ""
            assert not (choice.finish_reason and choice.delta.tool_calls), "a call and its finish share a chunk"
            finish = choice.finish_reason or finish
            for call in choice.delta.tool_calls or []:
                if call.index not in calls:
                    assert call.id and call.type == "function" and call.function.name, call
                    calls[call.index] = {"id": call.id, "name": call.function.name, "arguments": ""}
                else:
                    assert call.id is None and call.function.name is None, call
                calls[call.index]["arguments"] += call.function.arguments or ""
    return content or None, [calls[index] for index in sorted(calls)], finish


def check_calls(calls: list[dict]) -> None:
    for call in calls:
        jsonschema.validate(json.loads(call["arguments"]), SCHEMAS[call["name"]])


def message_calls(message) -> list[dict]:
    return [{"id": call.id, "name": call.function.name, "arguments": call.function.arguments}
            for call in message.tool_calls or []]


def test_required_yields_exactly_one_valid_call_without_parallel_calls(client):
    for temperature, seed in ((0.0, None), (1.0, 1), (1.0, 2), (1.0, 3)):
        response = ask(client, tool_choice="required", parallel_tool_calls=False, temperature=temperature, seed=seed)
        choice = response.choices[0]
        calls = message_calls(choice.message)
        assert choice.finish_reason == "tool_calls" and len(calls) == 1, choice
        assert calls[0]["id"].startswith("chatcmpl-tool-") and choice.message.content is None
        check_calls(calls)
        content, streamed_calls, finish = collect(ask(client, True, tool_choice="required", parallel_tool_calls=False,
                                                      temperature=temperature, seed=seed))
        assert finish == "tool_calls" and content is None and len(streamed_calls) == 1
        check_calls(streamed_calls)
        if seed is not None or temperature == 0.0:  # the same sampling: the same call
            assert [(c["name"], c["arguments"]) for c in streamed_calls] == [(c["name"], c["arguments"]) for c in calls]


def test_required_with_parallel_calls_is_bounded_and_valid(client):
    for seed in (4, 5):
        response = ask(client, tool_choice="required", seed=seed, max_completion_tokens=400)
        choice = response.choices[0]
        calls = message_calls(choice.message)
        assert choice.finish_reason == "tool_calls" and 1 <= len(calls) <= MAX_PARALLEL_TOOL_CALLS, choice
        check_calls(calls)
        assert len({call["id"] for call in calls}) == len(calls)


def test_a_named_function_is_called_and_finishes_with_stop(client):
    named = {"type": "function", "function": {"name": "get_weather"}}
    for seed in (1, 2):
        choice = ask(client, tool_choice=named, seed=seed).choices[0]
        calls = message_calls(choice.message)
        assert choice.finish_reason == "stop" and [call["name"] for call in calls] == ["get_weather"], choice
        check_calls(calls)
        content, streamed_calls, finish = collect(ask(client, True, tool_choice=named, seed=seed))
        assert finish == "stop" and content is None
        assert [(c["name"], c["arguments"]) for c in streamed_calls] == [(c["name"], c["arguments"]) for c in calls]


class GetTime(BaseModel):
    tz: Literal["UTC", "CET"]


def test_the_sdk_helpers_reassemble_and_parse_tool_calls(client):
    tool = openai.pydantic_function_tool(GetTime)
    with client.chat.completions.stream(model=MODEL_NAME, messages=MESSAGES, tools=[tool], tool_choice="required",
                                        parallel_tool_calls=False, temperature=1.0, seed=7,
                                        max_completion_tokens=MAX_TOKENS) as stream:
        events = [event.type for event in stream]
        completion = stream.get_final_completion()
    assert "tool_calls.function.arguments.done" in events
    call = completion.choices[0].message.tool_calls[0]
    assert call.function.name == "GetTime" and isinstance(call.function.parsed_arguments, GetTime)
    parse = getattr(client.chat.completions, "parse", None) or client.beta.chat.completions.parse
    parsed = parse(model=MODEL_NAME, messages=MESSAGES, tools=[tool], temperature=1.0, seed=8,
                   tool_choice={"type": "function", "function": {"name": "GetTime"}}, max_completion_tokens=MAX_TOKENS)
    assert isinstance(parsed.choices[0].message.tool_calls[0].function.parsed_arguments, GetTime)


def test_a_call_that_arrives_with_its_finish_still_gets_the_sdks_done_event():
    """A loaded server hands the stream a whole call and its finish in one engine output; the
    finish must still come in a chunk of its own, or the SDK never fires `arguments.done`."""
    import asyncio

    from openai.lib.streaming.chat import ChatCompletionStreamState
    from openai.types.chat import ChatCompletionChunk

    from sparrow.entrypoints.openai.serving_chat import OpenAIServingChat, Reply
    from sparrow.entrypoints.openai.tool_calling import resolve_tool_choice
    from sparrow.outputs import CompletionOutput, RequestOutput

    tool = openai.pydantic_function_tool(GetTime)
    request = ChatCompletionRequest(model=MODEL_NAME, messages=MESSAGES, tools=[tool], tool_choice="required",
                                    stream=True)
    parsers = ReplyParsers(request, resolve_tool_choice(request, auto_enabled=False), [1, 2, 3])
    text = '[{"name": "GetTime", "parameters": {"tz": "CET"}}]'
    whole = RequestOutput("r", None, [1, 2, 3], None, [CompletionOutput(0, text, [5] * 9, None, None, "stop")], True)

    async def engine():
        yield whole

    async def lines():
        serving = object.__new__(OpenAIServingChat)
        return [line async for line in serving._stream("r", MODEL_NAME, 1, engine(), Reply.of(request, 3), parsers)]

    state = ChatCompletionStreamState(input_tools=[tool])
    events = []
    for line in asyncio.run(lines()):
        payload = line.removeprefix("data: ").strip()
        if payload != "[DONE]":
            events += [event.type for event in state.handle_chunk(ChatCompletionChunk.model_validate_json(payload))]
    assert events.count("tool_calls.function.arguments.done") == 1, events
    choice = state.get_final_completion().choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.tool_calls[0].function.parsed_arguments == GetTime(tz="CET")


# The model's text forced into hermes' format, so that auto has calls to find.
HERMES_REGEX = (r'Sure\.\n<tool_call>\n\{"name": "get_weather", "arguments": \{"city": "(Paris|Rome)", '
                r'"days": [1-7]\}\}\n</tool_call>')


def test_auto_finds_the_calls_the_model_wrote_streamed_and_not(client):
    for seed in (1, 2):
        extra = {"guided_regex": HERMES_REGEX}
        choice = ask(client, seed=seed, extra_body=extra).choices[0]  # tool_choice auto: the default with tools
        calls = message_calls(choice.message)
        assert choice.finish_reason == "tool_calls" and choice.message.content == "Sure.", choice
        assert [call["name"] for call in calls] == ["get_weather"]
        check_calls(calls)
        content, streamed_calls, finish = collect(ask(client, True, seed=seed, tool_choice="auto", extra_body=extra))
        assert (content, finish) == ("Sure.", "tool_calls")
        assert [(c["name"], c["arguments"]) for c in streamed_calls] == [(c["name"], c["arguments"]) for c in calls]


def test_auto_without_calls_and_none_reply_with_text(client):
    for choice_kind in ("auto", "none"):
        choice = ask(client, tool_choice=choice_kind, seed=3, max_completion_tokens=8,
                     extra_body={"guided_regex": "[a-z ]{1,12}"}).choices[0]
        assert choice.message.tool_calls in (None, []) and choice.finish_reason in ("stop", "length")
        assert choice.message.content


@pytest.mark.parametrize("kwargs, param, phrase", [
    ({"tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice", "not among the tools"),
    ({"tool_choice": {"type": "function"}}, "tool_choice", "named tool choice"),
    ({"tools": None, "tool_choice": "required"}, "tool_choice", "needs tools"),
    ({"tools": None, "tool_choice": {"type": "function", "function": {"name": "f"}}}, "tool_choice", "no tools"),
    ({"tool_choice": "required", "response_format": {"type": "json_object"}}, "tool_choice", "cannot be combined"),
    ({"tool_choice": {"type": "function", "function": {"name": "bad"}},
      "tools": [{"type": "function", "function": {"name": "bad", "parameters": {"type": "no-such-type"}}}]},
     "tools", "tools[0].function.parameters"),
])
def test_bad_tool_choices_are_400_naming_the_field(client, kwargs, param, phrase):
    kwargs = {"tools": TOOLS, **kwargs}
    if kwargs["tools"] is None:
        del kwargs["tools"]
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model=MODEL_NAME, messages=MESSAGES, max_completion_tokens=4, **kwargs)
    error = info.value.body
    assert error["param"] == param and phrase in error["message"], error
    assert client.models.list().data  # still serving
