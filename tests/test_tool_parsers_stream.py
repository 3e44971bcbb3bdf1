"""The mistral, pythonic and qwen3_coder tool parsers inside the chat endpoint's streaming: model
text arriving in pieces (as the engine's delta outputs do) goes through ``OpenAIServingChat._stream``
with ``tool_choice`` auto, and the SDK's own stream state reassembles the chunks into tool calls
whose arguments parse, with the finish reason ``tool_calls``; the whole (non-streamed) reply
gives the same calls. No model runs: the engine's outputs are written by hand."""

from __future__ import annotations

import asyncio
import json

import pytest

from sparrow.entrypoints.openai.chat_output import ReplyParsers
from sparrow.entrypoints.openai.protocol import ChatCompletionRequest
from sparrow.entrypoints.openai.tool_calling import resolve_tool_choice
from sparrow.plugins import get_registry, resolve_parser

TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
    "required": ["city", "days"]}}}]
MESSAGES = [{"role": "user", "content": "Weather in Paris?"}]
CALLS = [("get_weather", {"city": "Paris", "days": 3}), ("get_weather", {"city": "Oslo", "days": 1})]
TEXTS = {
    "mistral": 'Checking.[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris", "days": 3}}, '
               '{"name": "get_weather", "arguments": {"city": "Oslo", "days": 1}}]',
    # A pythonic reply is the call list alone (text before it makes the whole reply text).
    "pythonic": '[get_weather(city="Paris", days=3), get_weather(city=\'Oslo\', days=1)]',
    "qwen3_coder": "Checking.\n<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n"
                   "<parameter=days>\n3\n</parameter>\n</function>\n</tool_call>\n<tool_call>\n"
                   "<function=get_weather>\n<parameter=city>\nOslo\n</parameter>\n<parameter=days>\n1\n"
                   "</parameter>\n</function>\n</tool_call>",
}


def run_stream(name: str, text: str, piece: int):
    from openai.lib.streaming.chat import ChatCompletionStreamState
    from openai.types.chat import ChatCompletionChunk

    from sparrow.entrypoints.openai.serving_chat import OpenAIServingChat, Reply
    from sparrow.outputs import CompletionOutput, RequestOutput

    request = ChatCompletionRequest(model="m", messages=MESSAGES, tools=TOOLS, stream=True)
    parser_cls = resolve_parser("tool parser", name, get_registry().tool_parsers)
    parsers = ReplyParsers(request, resolve_tool_choice(request, auto_enabled=True), [1, 2, 3],
                           tool_parser_cls=parser_cls)
    pieces = [text[start:start + piece] for start in range(0, len(text), piece)]

    async def engine():
        for index, chunk in enumerate(pieces):
            last = index == len(pieces) - 1
            yield RequestOutput("r", None, [1, 2, 3], None,
                                [CompletionOutput(0, chunk, [5], None, None, "stop" if last else None)], last)

    async def lines():
        serving = object.__new__(OpenAIServingChat)
        return [line async for line in serving._stream("r", "m", 1, engine(), Reply.of(request, 3), parsers)]

    state = ChatCompletionStreamState(input_tools=[])
    for line in asyncio.run(lines()):
        payload = line.removeprefix("data: ").strip()
        if payload != "[DONE]":
            state.handle_chunk(ChatCompletionChunk.model_validate_json(payload))
    return state.get_final_completion().choices[0]


@pytest.mark.parametrize("name", sorted(TEXTS))
@pytest.mark.parametrize("piece", [1, 3, 17])
def test_streamed_auto_calls_reassemble_in_the_sdk(name, piece):
    choice = run_stream(name, TEXTS[name], piece)
    assert choice.finish_reason == "tool_calls", choice
    calls = [(call.function.name, json.loads(call.function.arguments)) for call in choice.message.tool_calls]
    assert calls == CALLS
    content = None if name == "pythonic" else "Checking."
    # The first chunk opens the message with content "" (as vLLM's does), so the SDK's reassembly
    # of a reply without text is "", not None.
    assert choice.message.content == (content or "")
    assert len({call.id for call in choice.message.tool_calls}) == 2
    # The whole reply, as the non-streamed endpoint splits it, agrees.
    parser = resolve_parser("tool parser", name, get_registry().tool_parsers)(None, None)
    whole = parser.extract_tool_calls(TEXTS[name])
    assert [(call.name, json.loads(call.arguments)) for call in whole.tool_calls] == CALLS
    assert whole.content == content
