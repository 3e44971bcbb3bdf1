"""langchain-openai against `sparrow serve`: ChatOpenAI's with_structured_output (both of its
methods: a json_schema response_format and a forced function call) returns the pydantic object,
and bind_tools with a named or "any" tool_choice returns tool calls whose arguments validate,
streamed and not. The random-weight test model; bounded schemas, so every output ends."""

from __future__ import annotations

from typing import Literal

import langchain_openai  # the dev extra's; a missing install fails here rather than skipping
import pytest
from pydantic import BaseModel, Field

from tests.test_server import API_KEY, MODEL_NAME, serve_for_module


class Pet(BaseModel):
    """A pet."""

    kind: Literal["cat", "dog", "fish"]
    age: int = Field(ge=0, le=30)


class GetWeather(BaseModel):
    """Get the weather forecast for a city."""

    city: Literal["Paris", "Rome"]
    days: int = Field(ge=1, le=7)


class GetTime(BaseModel):
    """Get the time in a time zone."""

    tz: Literal["UTC", "CET"]


@pytest.fixture(scope="module")
def server(qwen3_dir, tmp_path_factory):
    yield from serve_for_module(qwen3_dir, tmp_path_factory, "langchain-logs",
                                "--enable-auto-tool-choice", "--tool-call-parser", "hermes")


def chat_model(server, seed: int):
    return langchain_openai.ChatOpenAI(model=MODEL_NAME, base_url=server.url + "/v1", api_key=API_KEY,
                                       temperature=1.0, seed=seed, max_tokens=120, max_retries=0)


@pytest.mark.parametrize("method", ["json_schema", "function_calling"])
def test_with_structured_output_returns_the_pydantic_object(server, method):
    for seed in (1, 2):
        structured = chat_model(server, seed).with_structured_output(Pet, method=method)
        pet = structured.invoke("Describe a pet.")
        assert isinstance(pet, Pet) and 0 <= pet.age <= 30


@pytest.mark.parametrize("tool_choice", ["GetWeather", "any"])
def test_bind_tools_returns_valid_tool_calls_streamed_and_not(server, tool_choice):
    model = chat_model(server, 3).bind_tools([GetWeather, GetTime], tool_choice=tool_choice, parallel_tool_calls=False)
    message = model.invoke("What is the weather in Paris?")
    assert len(message.tool_calls) == 1, message
    call = message.tool_calls[0]
    if tool_choice != "any":
        assert call["name"] == tool_choice
    schema = {"GetWeather": GetWeather, "GetTime": GetTime}[call["name"]]
    schema.model_validate(call["args"])
    assert call["id"].startswith("chatcmpl-tool-")
    chunks = list(model.stream("What is the weather in Paris?"))
    merged = chunks[0]
    for chunk in chunks[1:]:
        merged += chunk
    assert [(c["name"], c["args"]) for c in merged.tool_calls] == [(call["name"], call["args"])]
