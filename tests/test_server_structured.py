"""Structured outputs through `sparrow serve`: the real `openai` client with response_format
(json_schema, json_object), the SDK's parse() with a pydantic model, vLLM's structured_outputs
field and the legacy guided_* fields, streamed and not; every bad input is a 400 naming its field.
One server on 127.0.0.1 with the random-weight test model; schemas are bounded so every output
fits in max_tokens and must end with "stop"."""

from __future__ import annotations

import json
import re
from typing import Literal

import jsonschema
import openai
import pytest
from pydantic import BaseModel, Field

from tests.test_server import MODEL_NAME, PROMPT, serve_for_module

MESSAGES = [{"role": "user", "content": "Describe a pet as JSON."}]
MAX_TOKENS = 120
PET_SCHEMA = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 6},
    "age": {"type": "integer", "minimum": 0, "maximum": 30},
    "kind": {"enum": ["cat", "dog", "fish"]},
    "toys": {"type": "array", "items": {"type": "string", "maxLength": 4}, "maxItems": 2}},
    "required": ["name", "age", "kind", "toys"], "additionalProperties": False}


class Pet(BaseModel):
    name: str = Field(max_length=6)
    age: int = Field(ge=0, le=30)
    kind: Literal["cat", "dog", "fish"]


@pytest.fixture(scope="module")
def server(qwen3_dir, tmp_path_factory):
    # A short compile timeout for the slow-grammar test (the others compile in milliseconds).
    yield from serve_for_module(qwen3_dir, tmp_path_factory, "structured-logs",
                                "--structured-outputs-compile-timeout", "5")


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return server.client()


def json_schema_format(schema: dict) -> dict:
    return {"type": "json_schema", "json_schema": {"name": "pet", "schema": schema, "strict": True}}


def test_chat_json_schema_streamed_and_not(client):
    for temperature in (0.0, 1.0):
        response = client.chat.completions.create(
            model=MODEL_NAME, messages=MESSAGES, temperature=temperature, seed=3, max_completion_tokens=MAX_TOKENS,
            n=2, response_format=json_schema_format(PET_SCHEMA))
        for choice in response.choices:
            assert choice.finish_reason == "stop", choice.message.content
            jsonschema.validate(json.loads(choice.message.content), PET_SCHEMA)
    stream = client.chat.completions.create(
        model=MODEL_NAME, messages=MESSAGES, temperature=1.0, seed=4, max_completion_tokens=MAX_TOKENS, stream=True,
        response_format=json_schema_format(PET_SCHEMA))
    text, finish = "", None
    for chunk in stream:
        for choice in chunk.choices:
            text += choice.delta.content or ""
            finish = choice.finish_reason or finish
    assert finish == "stop"
    jsonschema.validate(json.loads(text), PET_SCHEMA)


def test_sdk_parse_returns_a_pydantic_object(client):
    parse = getattr(client.chat.completions, "parse", None) or client.beta.chat.completions.parse
    for seed in (1, 2, 3):
        completion = parse(model=MODEL_NAME, messages=MESSAGES, temperature=1.0, seed=seed,
                           max_completion_tokens=MAX_TOKENS, response_format=Pet)
        pet = completion.choices[0].message.parsed
        assert isinstance(pet, Pet) and 0 <= pet.age <= 30 and len(pet.name) <= 6
        assert completion.choices[0].finish_reason == "stop"


def test_json_object_is_a_json_object(client, qwen3_dir):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(qwen3_dir)
    # A random model rarely closes an open-ended object by itself: biasing the braces makes the
    # shortest object likely, and the grammar makes anything else still valid JSON.
    braces = {str(tokenizer.convert_tokens_to_ids(token)): 100
              for token in ("{", "}") if token in tokenizer.get_vocab()}
    assert braces
    response = client.chat.completions.create(model=MODEL_NAME, messages=MESSAGES, temperature=0.0,
                                              max_completion_tokens=MAX_TOKENS, logit_bias=braces,
                                              response_format={"type": "json_object"})
    choice = response.choices[0]
    assert choice.finish_reason == "stop" and isinstance(json.loads(choice.message.content), dict)


# vLLM's structural tag in xgrammar's format: <pet>, a JSON object of the schema, </pet>.
PET_TAG = {"type": "tag", "begin": "<pet>", "end": "</pet>",
           "content": {"type": "json_schema", "json_schema": PET_SCHEMA}}


def pet_tag_ok(text: str) -> bool:
    match = re.fullmatch(r"<pet>(.*)</pet>", text, re.S)
    return match is not None and jsonschema.validate(json.loads(match.group(1)), PET_SCHEMA) is None


@pytest.mark.parametrize("extra, check", [
    ({"guided_regex": r"[a-z]{1,6}@(foo|bar)\.com"}, lambda text: re.fullmatch(r"[a-z]{1,6}@(foo|bar)\.com", text)),
    ({"guided_choice": ["yes", "no"]}, lambda text: text in ("yes", "no")),
    ({"guided_grammar": 'root ::= "(" [0-9] [0-9]? ")"'}, lambda text: re.fullmatch(r"\(\d\d?\)", text)),
    ({"guided_json": PET_SCHEMA}, lambda text: jsonschema.validate(json.loads(text), PET_SCHEMA) is None),
    ({"structured_outputs": {"choice": ["left", "right"]}}, lambda text: text in ("left", "right")),
    ({"structured_outputs": {"regex": "[0-9]{3}"}}, lambda text: re.fullmatch("[0-9]{3}", text)),
    ({"structured_outputs": {"json": PET_SCHEMA, "disable_any_whitespace": True, "disable_fallback": True}},
     lambda text: jsonschema.validate(json.loads(text), PET_SCHEMA) is None and not re.search(r"\s\s|\n|\{ ", text)),
    ({"response_format": json_schema_format(PET_SCHEMA)},
     lambda text: jsonschema.validate(json.loads(text), PET_SCHEMA) is None),
    ({"response_format": {"type": "structural_tag", "format": PET_TAG}}, pet_tag_ok),
    ({"structured_outputs": {"structural_tag": json.dumps({"type": "structural_tag", "format": PET_TAG})}},
     pet_tag_ok),
    ({"structural_tag": json.dumps({"type": "structural_tag", "format": PET_TAG})}, pet_tag_ok),
])
def test_completions_honour_every_way_to_ask(client, extra, check):
    for stream in (False, True):
        response = client.completions.create(model=MODEL_NAME, prompt=PROMPT, temperature=1.0, seed=5,
                                             max_tokens=MAX_TOKENS, stream=stream, extra_body=extra)
        chunks = list(response) if stream else [response]
        text = "".join(chunk.choices[0].text for chunk in chunks if chunk.choices)
        finish = [chunk.choices[0].finish_reason for chunk in chunks if chunk.choices][-1]
        assert finish == "stop" and check(text), text


@pytest.mark.parametrize("extra, param, phrase", [
    ({"response_format": json_schema_format({"type": "no-such-type"})}, "response_format", "invalid"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}, "response_format", "schema"),
    ({"guided_regex": "([a-z]"}, "guided_regex", "invalid"),
    ({"guided_grammar": "root ::= undefined_rule"}, "guided_grammar", "invalid"),
    ({"guided_json": "{not json"}, "guided_json", "not valid JSON"),
    ({"guided_choice": []}, "guided_choice", "non-empty"),
    ({"structured_outputs": {"regex": "a", "choice": ["b"]}}, "structured_outputs", "exactly one"),
    ({"structured_outputs": {"regex": "a", "whitespace_pattern": " "}}, "structured_outputs.whitespace_pattern",
     "not supported"),
    ({"structured_outputs": {"regex": "a", "disable_additional_properties": True}},
     "structured_outputs.disable_additional_properties", "applies to a json schema"),
    ({"structured_outputs": {"regex": "a", "backend": "outlines"}}, "structured_outputs.backend", "not supported"),
    ({"guided_regex": "a", "guided_choice": ["b"]}, "guided_choice", "only one"),
    ({"response_format": {"type": "structural_tag"}}, "response_format", "neither"),
    ({"response_format": {"type": "structural_tag", "format": PET_TAG, "triggers": ["<"]}}, "response_format",
     "not both"),
    ({"response_format": {"type": "structural_tag", "format": {"type": "nope"}}}, "response_format", "invalid"),
    ({"response_format": {"type": "structural_tag", "triggers": ["["],
                          "structures": [{"begin": "<a>", "schema": {}, "end": "</a>"}]}}, "response_format",
     "begins none"),
    ({"response_format": {"type": "json_object", "format": PET_TAG}}, "response_format.format",
     "only allowed with type structural_tag"),
    ({"structural_tag": "{not json"}, "structural_tag", "not valid JSON"),
])
def test_bad_structured_outputs_are_400_naming_the_field(client, extra, param, phrase):
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model=MODEL_NAME, messages=MESSAGES, max_completion_tokens=4, extra_body=extra)
    error = info.value.body
    assert error["param"] == param and phrase in error["message"], error
    # The server carries on.
    ok = client.completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=2, extra_body={"ignore_eos": True})
    assert ok.usage.completion_tokens == 2


def test_a_grammar_too_slow_to_compile_is_refused_and_the_others_are_served(server, client):
    # "(a|b)*" 2,000 times compiles in xgrammar for about two minutes of one core: stopped after
    # --structured-outputs-compile-timeout (5 s), while other requests, constrained or not, run.
    import concurrent.futures

    slow = {"guided_regex": "(a|b)*" * 2000}
    with concurrent.futures.ThreadPoolExecutor(3) as pool:
        refused = pool.submit(client.completions.create, model=MODEL_NAME, prompt=PROMPT, max_tokens=4,
                              extra_body=slow)
        plain = pool.submit(client.completions.create, model=MODEL_NAME, prompt=PROMPT, max_tokens=8,
                            extra_body={"ignore_eos": True})
        choice = pool.submit(client.chat.completions.create, model=MODEL_NAME, messages=MESSAGES,
                             max_completion_tokens=8, extra_body={"guided_choice": ["yes", "no"]})
        assert plain.result(timeout=60).usage.completion_tokens == 8
        assert choice.result(timeout=60).choices[0].message.content in ("yes", "no")
        with pytest.raises(openai.BadRequestError) as info:
            refused.result(timeout=60)
    error = info.value.body
    assert "did not compile within 5 s" in error["message"], error
    assert "structured_outputs_compile_timeout" in error["message"], error
    # The engine core's failure names the field the client wrote the grammar in.
    assert error["param"] == "guided_regex" and error["message"].startswith("guided_regex: "), error
    assert "was killed" in server.log()


def test_engine_side_grammar_failures_name_the_requests_field():
    from types import SimpleNamespace

    from sparrow.entrypoints.openai.protocol import ResponseFormat
    from sparrow.entrypoints.openai.request_checks import RequestFieldError
    from sparrow.entrypoints.openai.structured_outputs import in_request_words
    from sparrow.errors import InvalidArgumentError, error_from_engine

    def failure(kind: str) -> ValueError:  # as the engine core sends it (sparrow.engine.core)
        field = f"structured_outputs.{kind}"
        return error_from_engine(f"{field}: the grammar did not compile within 5 s", field)

    def request(**fields):
        return SimpleNamespace(**{"response_format": None, "structured_outputs": None, "guided_json": None,
                                  "guided_regex": None, "guided_choice": None, "guided_grammar": None, **fields})

    cases = [
        (request(guided_regex="a+"), "regex", "guided_regex", "guided_regex: the grammar"),
        (request(structured_outputs={"regex": "a+"}), "regex", "structured_outputs",
         "structured_outputs.regex: the grammar"),
        (request(response_format=ResponseFormat.model_validate(json_schema_format(PET_SCHEMA))), "json",
         "response_format", "response_format.json_schema.schema: the grammar"),
        (request(), "json", "tool_choice", "tool_choice: structured_outputs.json: the grammar"),
    ]
    for api_request, kind, param, start in cases:
        error = in_request_words(failure(kind), api_request)
        assert isinstance(error, RequestFieldError) and error.param == param, (error, param)
        assert str(error).startswith(start), str(error)
    other = InvalidArgumentError("max_tokens: too many", "max_tokens")
    assert in_request_words(other, request(guided_regex="a+")) is other
    assert in_request_words(ValueError("boom"), request(guided_regex="a+")).args == ("boom",)
