"""Findings of a user audit of `sparrow serve`'s request handling, each checked through a real
server on 127.0.0.1: the real `openai` client where it can say what is meant, httpx for raw bodies
it cannot send (wrong JSON types, broken bytes, odd headers).

Every bad input is a 400 in OpenAI's shape naming what is wrong; `prompt_logprobs` is returned
whenever asked for; JSON types are strict, as OpenAI's are."""

from __future__ import annotations

import gzip
import json

import httpx
import openai
import pytest
from transformers import AutoTokenizer

from tests.test_server import API_KEY, MAX_BODY_BYTES, MODEL_NAME, PROMPT, serve_for_module

MESSAGES = [{"role": "user", "content": "Name a colour."}]
JSON_HEADERS = {"Authorization": f"Bearer {API_KEY}", "Content-Type": "application/json"}
CHAT, COMPLETIONS = "/v1/chat/completions", "/v1/completions"
BASE = {CHAT: {"model": MODEL_NAME, "messages": MESSAGES, "max_tokens": 2},
        COMPLETIONS: {"model": MODEL_NAME, "prompt": PROMPT, "max_tokens": 2}}
TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}]
INT64_MIN = -(2**63)


@pytest.fixture(scope="module")
def server(qwen3_dir, tmp_path_factory):
    yield from serve_for_module(qwen3_dir, tmp_path_factory, "audit-logs", "--disable-fastapi-docs",
                                "--trust-request-chat-template")


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return server.client()


@pytest.fixture(scope="module")
def tokenizer(qwen3_dir):
    return AutoTokenizer.from_pretrained(qwen3_dir)


def post(server, path: str, body: dict | bytes, headers: dict | None = None) -> httpx.Response:
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    return httpx.post(server.url + path, content=content, headers=JSON_HEADERS if headers is None else headers,
                      timeout=60)


def error_of(response: httpx.Response, status: int = 400) -> dict:
    """The error of a response in OpenAI's shape (and only those four keys)."""
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}, error
    assert error["type"] == ("BadRequestError" if status == 400 else error["type"]), error
    return error


def refused(server, path: str, fields: dict, param: str | None, *phrases: str) -> dict:
    """POST the endpoint's base body with ``fields``: a 400 naming ``param`` and saying ``phrases``."""
    error = error_of(post(server, path, {**BASE[path], **fields}))
    assert error["param"] == param, (fields, error)
    for phrase in phrases:
        assert phrase in error["message"], (fields, error)
    return error


def assert_still_serving(client: openai.OpenAI) -> None:
    response = client.completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=2, temperature=0.0,
                                         extra_body={"ignore_eos": True})
    assert response.usage.completion_tokens == 2


def sse_chunks(response: httpx.Response) -> list[dict]:
    assert response.status_code == 200, response.text
    lines = [line.removeprefix("data: ") for line in response.text.splitlines() if line.startswith("data: ")]
    assert lines[-1] == "[DONE]"
    return [json.loads(line) for line in lines[:-1]]


# -- 1. prompt_logprobs --------------------------------------------------------------------------------
def test_prompt_logprobs_are_returned_whenever_asked_streamed_and_not(server, client, tokenizer):
    prompt_ids = tokenizer.encode(PROMPT)
    # The reference: the same engine scoring the prompt the lm-eval way (echo, max_tokens 0).
    scored = client.completions.create(model=MODEL_NAME, prompt=prompt_ids, max_tokens=0, echo=True, logprobs=2)
    expected = scored.choices[0].logprobs.token_logprobs
    body = {"model": MODEL_NAME, "prompt": PROMPT, "max_tokens": 4, "temperature": 0.0, "n": 2,
            "prompt_logprobs": 2, "ignore_eos": True}
    whole = post(server, COMPLETIONS, body).json()
    assert len(whole["choices"]) == 2
    for choice in whole["choices"]:
        positions = choice["prompt_logprobs"]
        assert len(positions) == len(prompt_ids) and positions[0] is None
        for position, token_id in enumerate(prompt_ids[1:], start=1):
            entries = positions[position]
            # vLLM's shape: token id (a string key) -> {logprob, rank, decoded_token}; the prompt's
            # token first, then the top 2 (which may hold it again).
            assert 2 <= len(entries) <= 3 and next(iter(entries)) == str(token_id)
            assert entries[str(token_id)]["logprob"] == pytest.approx(expected[position], abs=1e-4)
            assert {1, 2} <= {entry["rank"] for entry in entries.values()}
            for key, entry in entries.items():
                assert set(entry) == {"logprob", "rank", "decoded_token"}
                assert entry["decoded_token"] == tokenizer.decode([int(key)])
    assert whole["choices"][0]["prompt_logprobs"] == whole["choices"][1]["prompt_logprobs"]

    # Streamed: in each choice's first chunk only, the same as whole.
    chunks = sse_chunks(post(server, COMPLETIONS, {**body, "stream": True}))
    seen: dict[int, list] = {}
    for chunk in chunks:
        for choice in chunk["choices"]:
            if choice["index"] in seen:
                assert choice["prompt_logprobs"] is None, choice
            else:
                seen[choice["index"]] = choice["prompt_logprobs"]
    assert seen == {0: whole["choices"][0]["prompt_logprobs"], 1: whole["choices"][1]["prompt_logprobs"]}
    texts = ["".join(c["text"] for chunk in chunks for c in chunk["choices"] if c["index"] == i) for i in (0, 1)]
    assert texts == [choice["text"] for choice in whole["choices"]]

    # Several prompts: each choice has its own prompt's; the openai client exposes the field.
    several = client.completions.create(model=MODEL_NAME, prompt=[PROMPT, "Hello there"], max_tokens=1,
                                        extra_body={"prompt_logprobs": 0})
    lengths = [len(choice.model_extra["prompt_logprobs"]) for choice in several.choices]
    assert lengths == [len(prompt_ids), len(tokenizer.encode("Hello there"))]
    # Not asked for: null, as in vLLM's responses.
    plain = post(server, COMPLETIONS, BASE[COMPLETIONS]).json()
    assert plain["choices"][0]["prompt_logprobs"] is None


# -- 2, 3. unknown keys at any depth; json_schema only with its type -------------------------------------
SCHEMA = {"type": "object", "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 9, "x-unit": "kg"}},
          "required": ["a"], "additionalProperties": False, "x-note": "JSON schemas are free-form"}
ASSISTANT_CALL = {"role": "assistant", "content": None, "tool_calls": [
    {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]}
NESTED_REFUSALS = [
    (CHAT, {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": SCHEMA, "bogus": 1}}},
     "response_format.json_schema.bogus", "unknown field"),
    (COMPLETIONS, {"response_format": {"type": "json_object", "bogus": 1}}, "response_format.bogus", "unknown field"),
    (CHAT, {"messages": [{"role": "user", "content": [{"type": "text", "text": "hi", "bogus": 1}]}]},
     "messages[0].content[0].bogus", "unknown field"),
    (CHAT, {"messages": [{"role": "user", "content": [
        {"type": "text", "text": "hi"}, {"type": "text", "text": "there", "cache_control": {"type": "ephemeral"}}]}]},
     "messages[0].content[1].cache_control", "not supported"),
    (CHAT, {"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "get_weather", "bogus": 1}}},
     "tool_choice.function.bogus", "unknown field"),
    (CHAT, {"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "get_weather"}, "bogus": 1}},
     "tool_choice.bogus", "unknown field"),
    (CHAT, {"tools": [{"type": "function", "function": {"name": "f", "bogus": 1}}], "tool_choice": "none"},
     "tools[0].function.bogus", "unknown field"),
    (CHAT, {"messages": [{"role": "user", "content": "hi"}, {**ASSISTANT_CALL, "tool_calls": [
        {**ASSISTANT_CALL["tool_calls"][0], "function": {"name": "f", "arguments": "{}", "bogus": 1}}]}]},
     "messages[1].tool_calls[0].function.bogus", "unknown field"),
    (CHAT, {"stream": True, "stream_options": {"include_usage": True, "typo": 1}}, "stream_options.typo",
     "unknown field"),
    (CHAT, {"response_format": {"type": "json_object", "json_schema": {"name": "x", "schema": SCHEMA}}},
     "response_format.json_schema", "only allowed with type json_schema"),
    (COMPLETIONS, {"response_format": {"type": "text", "json_schema": {"name": "x", "schema": SCHEMA}}},
     "response_format.json_schema", "only allowed with type json_schema"),
]


def test_unknown_nested_keys_and_a_json_schema_its_type_ignores_are_400s(server, client):
    for path, fields, param, phrase in NESTED_REFUSALS:
        refused(server, path, fields, param, param, phrase)
    assert_still_serving(client)


def test_json_schemas_stay_free_form(client):
    """Keys inside a JSON schema (``schema``, a tool's ``parameters``) are the schema's business."""
    response = client.chat.completions.create(
        model=MODEL_NAME, messages=MESSAGES, max_completion_tokens=20, temperature=0.0,
        response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": SCHEMA, "strict": True}})
    assert set(json.loads(response.choices[0].message.content)) == {"a"}
    tools = [{"type": "function", "function": {"name": "f", "parameters": SCHEMA}}]
    assert client.chat.completions.create(model=MODEL_NAME, messages=MESSAGES, max_completion_tokens=2,
                                          tools=tools, tool_choice="none").choices
    # json_schema: null with another type is no schema to ignore.
    assert client.chat.completions.create(model=MODEL_NAME, messages=MESSAGES, max_completion_tokens=2,
                                          extra_body={"response_format": {"type": "text", "json_schema": None}})


# -- 4. an earlier turn's tool call arguments ---------------------------------------------------------------
ECHO_CALLS = ("{% for m in messages %}[{{ m.role }}] {{ m.content or '' }}{% for c in m.tool_calls or [] %}"
              "{{ c.function.name }}={{ c.function.arguments | tojson }}{% endfor %}\n{% endfor %}[assistant]")


def test_tool_call_arguments_must_be_a_json_object(server, client):
    def turns(arguments: str) -> list[dict]:
        call = {**ASSISTANT_CALL["tool_calls"][0], "function": {"name": "get_weather", "arguments": arguments}}
        return [{"role": "user", "content": "Weather?"}, {**ASSISTANT_CALL, "tool_calls": [call]},
                {"role": "tool", "tool_call_id": "call_1", "content": "sunny"}]

    for arguments, phrase in (("{bad", "not valid JSON"), ("[1, 2]", "JSON object"), ("3", "JSON object")):
        refused(server, CHAT, {"messages": turns(arguments), "chat_template": ECHO_CALLS},
                "messages[1].tool_calls[0].function.arguments", phrase)
        # /tokenize renders with the chat endpoint's code: the same refusal.
        error = error_of(post(server, "/tokenize", {"messages": turns(arguments), "chat_template": ECHO_CALLS}))
        assert error["param"] == "messages[1].tool_calls[0].function.arguments", error
    # The template gets the arguments as an object; "" is {} (vLLM's reading).
    for arguments, rendered in (('{"city": "Paris"}', 'get_weather={"city": "Paris"}'), ("", "get_weather={}")):
        tokens = post(server, "/tokenize", {"messages": turns(arguments), "chat_template": ECHO_CALLS}).json()["tokens"]
        assert rendered in post(server, "/detokenize", {"tokens": tokens}).json()["prompt"]
        assert client.chat.completions.create(model=MODEL_NAME, messages=turns(arguments), max_completion_tokens=2,
                                              extra_body={"chat_template": ECHO_CALLS}).choices


# -- 5, 6. bodies that are not JSON objects sent as JSON -----------------------------------------------
def test_malformed_bodies_are_400s_saying_what_is_wrong(server, client):
    valid = json.dumps(BASE[COMPLETIONS]).encode()
    cases = [
        (b'{"model": "%s", "prompt": "caf\xe9"}' % MODEL_NAME.encode(), {}, "not valid UTF-8", "0xe9"),
        (gzip.compress(valid), {"Content-Encoding": "gzip"}, "Content-Encoding 'gzip'", "uncompressed"),
        (b'{"prompt": ' + b"[" * 3000 + b"]" * 3000 + b"}", {}, "too deeply"),
        (b'{"prompt": "x", "max_tokens": 1' + b"0" * 4999 + b"}", {}, "digits"),
        (valid[:-9], {}, "not valid JSON", "at position"),
        (b"{'prompt': 'x'}", {}, "not valid JSON", "position 1"),
    ]
    for body, headers, *phrases in cases:
        error = error_of(post(server, COMPLETIONS, body, JSON_HEADERS | headers))
        assert error["param"] is None and error["code"] == "invalid_value", error
        for phrase in phrases:
            assert phrase in error["message"], (body[:40], error)
    assert_still_serving(client)


def test_a_body_must_be_sent_as_json(server):
    """Form, text/plain and untyped bodies are what a page may send cross-origin without a CORS
    preflight: they are refused, however JSON their bytes are."""
    body = json.dumps(BASE[COMPLETIONS]).encode()
    auth = {"Authorization": f"Bearer {API_KEY}"}
    for content_type in ("application/x-www-form-urlencoded", "text/plain", None):
        headers = auth | ({"Content-Type": content_type} if content_type else {})
        error = error_of(post(server, COMPLETIONS, body, headers))
        assert "Content-Type: application/json" in error["message"] and error["param"] is None, error
        assert (content_type or "there was none") in error["message"], error
    for content_type in ("application/json; charset=utf-8", "application/vnd.example+json"):
        assert post(server, COMPLETIONS, body, auth | {"Content-Type": content_type}).status_code == 200


def test_a_chunked_body_over_the_cap_is_413_request_too_large(server):
    big = json.dumps({"model": MODEL_NAME, "prompt": "x" * (MAX_BODY_BYTES + 10)}).encode()

    def chunked():  # no Content-Length: the cap is found while the body is read
        for start in range(0, len(big), 65536):
            yield big[start:start + 65536]

    for content in (big, chunked()):
        response = httpx.post(server.url + COMPLETIONS, content=content, headers=JSON_HEADERS, timeout=60)
        assert error_of(response, 413)["code"] == "request_too_large"


# -- 7. messages in the client's words ------------------------------------------------------------------
def test_messages_name_what_the_client_sent(server, client):
    refused(server, CHAT, {"messages": [{"role": "user", "content": [{"type": "text"}]}]},
            "messages[0].content", "messages[0].content[0].text", "needs its text")
    refused(server, CHAT, {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]},
            "messages[0].content", "only text parts")
    refused(server, CHAT, {"chat_template": ""}, "chat_template", "empty prompt")
    turns = [*MESSAGES, {"role": "assistant", "content": "No.", "refusal": "I won't"}, {"role": "user", "content": "?"}]
    error = refused(server, CHAT, {"messages": turns}, "messages[1].refusal", "non-empty refusal", "not supported")
    assert error["code"] == "unsupported" and "unknown" not in error["message"]
    for path, fields, param, start in [
        (COMPLETIONS, {"stop": ["ok", ""]}, "stop", "stop[1] "),
        (COMPLETIONS, {"min_tokens": 5}, "min_tokens", "min_tokens "),
        (CHAT, {"structured_outputs": {"regex": "a", "choice": ["b"]}}, "structured_outputs",
         "structured_outputs: exactly one of"),
        (CHAT, {"guided_json": "{not json"}, "guided_json", "guided_json is not valid JSON"),
        (CHAT, {"guided_regex": "([a-z"}, "guided_regex", "guided_regex is invalid"),
        (CHAT, {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nope"}}}},
         "response_format", "response_format.json_schema.schema is invalid"),
    ]:
        error = refused(server, path, fields, param)
        assert error["message"].startswith(start), error
        assert "SamplingParams" not in error["message"] and "StructuredOutputsParams" not in error["message"], error
    assert_still_serving(client)


# -- 8, 9. JSON types are strict; seeds are signed -------------------------------------------------------
STRICT_TYPES = [
    (COMPLETIONS, {"max_tokens": "4"}, "max_tokens"),
    (COMPLETIONS, {"max_tokens": True}, "max_tokens"),
    (COMPLETIONS, {"max_tokens": 4.0}, "max_tokens"),
    (COMPLETIONS, {"n": "2"}, "n"),
    (COMPLETIONS, {"temperature": "0.5"}, "temperature"),
    (COMPLETIONS, {"temperature": True}, "temperature"),
    (COMPLETIONS, {"seed": "1"}, "seed"),
    (COMPLETIONS, {"stream": "yes"}, "stream"),
    (COMPLETIONS, {"stream": 1}, "stream"),
    (COMPLETIONS, {"echo": "yes"}, "echo"),
    (COMPLETIONS, {"logprobs": True}, "logprobs"),
    (COMPLETIONS, {"prompt": [True]}, "prompt"),
    (COMPLETIONS, {"prompt": [[1, "2"]]}, "prompt"),
    (COMPLETIONS, {"stop": 5}, "stop"),
    (COMPLETIONS, {"logit_bias": {"5": "1"}}, "logit_bias"),
    (COMPLETIONS, {"ignore_eos": "true"}, "ignore_eos"),
    (CHAT, {"max_completion_tokens": "4"}, "max_completion_tokens"),
    (CHAT, {"logprobs": "true"}, "logprobs"),
    (CHAT, {"top_logprobs": True, "logprobs": True}, "top_logprobs"),
    (CHAT, {"stream": True, "stream_options": {"include_usage": "yes"}}, "stream_options"),
    (CHAT, {"messages": [{"role": "user", "content": 5}]}, "messages[0].content"),  # the message and key
    (CHAT, {"messages": [{"role": 5, "content": "x"}]}, "messages[0].role"),
    (CHAT, {"n": "2"}, "n"),
]


def test_json_types_are_strict(server, client):
    for path, fields, param in STRICT_TYPES:
        refused(server, path, fields, param)
    assert_still_serving(client)


def test_what_common_clients_send_still_works(server, client, tokenizer):
    # An integer where a float is expected, and null for optional fields.
    for fields in ({"temperature": 1, "top_p": 1, "presence_penalty": 0}, {"temperature": 0},
                   {"temperature": None, "top_p": None, "seed": None, "stop": None, "logprobs": None, "user": None,
                    "max_tokens": 3, "n": None}):
        response = post(server, COMPLETIONS, {**BASE[COMPLETIONS], **fields})
        assert response.status_code == 200, (fields, response.text)
    assert post(server, CHAT, {**BASE[CHAT], "max_tokens": None, "max_completion_tokens": 2, "temperature": 1,
                               "logprobs": None, "tools": None, "tool_choice": None}).status_code == 200
    # lm-evaluation-harness's loglikelihood requests: token-id prompts, logprobs, echo, max_tokens 0.
    ids = [tokenizer.encode(text) for text in (PROMPT, "Hello there")]
    scored = client.completions.create(model=MODEL_NAME, prompt=ids, max_tokens=0, echo=True, logprobs=1,
                                       temperature=0, seed=1234)
    assert [len(choice.logprobs.tokens) for choice in scored.choices] == [len(token_ids) for token_ids in ids]


def test_negative_seeds_reproduce_a_sample(server, client):
    def sample(seed: int) -> str:
        return client.completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=12, temperature=1.0, seed=seed,
                                         extra_body={"ignore_eos": True}).choices[0].text

    assert sample(-1) == sample(-1) != sample(-2)
    assert sample(INT64_MIN) == sample(INT64_MIN)
    refused(server, COMPLETIONS, {"seed": INT64_MIN - 1}, "seed")
    refused(server, COMPLETIONS, {"seed": 2**63}, "seed")


def test_disable_fastapi_docs_serves_no_schema_pages(server):
    # This module's server runs with --disable-fastapi-docs (vLLM's flag); the API still answers.
    for path in ("/docs", "/redoc", "/openapi.json"):
        assert httpx.get(server.url + path, timeout=30).status_code == 404, path
    assert httpx.get(server.url + "/health", timeout=30).status_code == 200


def test_tokenizer_info_is_served_without_vllms_flag(server):
    # This module's server lacks --enable-tokenizer-info-endpoint (tests/test_server_tokenization.py's
    # has it): the endpoint answers anyway, for lm-evaluation-harness.
    auth = {"Authorization": f"Bearer {API_KEY}"}
    assert httpx.get(server.url + "/tokenizer_info", headers=auth, timeout=30).json()["tokenizer_class"]
    # And GET /load (vLLM's) reads 0 without --enable-server-load-tracking.
    assert httpx.get(server.url + "/load", headers=auth, timeout=30).json() == {"server_load": 0}
