"""POST /v1/responses (OpenAI's Responses API) through a real `sparrow serve` on 127.0.0.1 and the
real `openai` client: `responses.create`, whole and streamed, the `responses.stream` helper,
`responses.retrieve` / `delete` and `previous_response_id`, `text.format` structured outputs,
logprobs, function tools (calls forced by tool_choice required or named, so every argument object
validates with `jsonschema`; the two-turn tool loop), and a 400 naming each field the endpoint
refuses.

Model outputs are checked against Hugging Face transformers on the same model directory (greedy
generation and log-softmax over the chat template's tokens), never against the engine's own
output. The reasoning items are checked on the output builder alone, with the real Qwen3
reasoning parser and a tokenizer that has `<think>` tokens (`tests.test_reasoning`)."""

from __future__ import annotations

import json
from typing import Literal

import httpx
import jsonschema
import openai
import pytest
from pydantic import BaseModel, Field

from sparrow.outputs import CompletionOutput
from tests.test_server import API_KEY, MODEL_NAME, serve_for_module, wait_until

INSTRUCTIONS = "Answer in one short sentence."
MESSAGES = [
    {"role": "user", "content": [{"type": "input_text", "text": "Name a colour."}]},
    {"role": "assistant", "content": [{"type": "output_text", "text": "Blue.", "annotations": []}]},
    {"type": "message", "role": "user", "content": "And a bird?"},
]
# The same conversation as chat messages, as the template sees it.
CHAT = [{"role": "system", "content": INSTRUCTIONS}, {"role": "user", "content": "Name a colour."},
        {"role": "assistant", "content": "Blue."}, {"role": "user", "content": "And a bird?"}]
MAX_TOKENS = 8
SCHEMA = {"type": "object", "properties": {
    "n": {"type": "integer", "minimum": 0, "maximum": 99}, "kind": {"enum": ["cat", "dog"]}},
    "required": ["n", "kind"], "additionalProperties": False}
LOGPROBS = "message.output_text.logprobs"
WEATHER = {"type": "object", "properties": {
    "city": {"enum": ["Paris", "Rome", "Oslo"]}, "days": {"type": "integer", "minimum": 1, "maximum": 7}},
    "required": ["city", "days"], "additionalProperties": False}
TIME = {"type": "object", "properties": {"tz": {"enum": ["UTC", "CET"]}}, "required": ["tz"],
        "additionalProperties": False}
# The Responses API's flat function tools, and the same as the chat template sees them.
TOOLS = [{"type": "function", "name": "get_weather", "description": "Weather forecast", "parameters": WEATHER,
          "strict": True},
         {"type": "function", "name": "get_time", "parameters": TIME, "strict": True}]
CHAT_TOOLS = [{"type": "function", "function": {key: value for key, value in tool.items() if key != "type"}}
              for tool in TOOLS]
SCHEMAS = {"get_weather": WEATHER, "get_time": TIME}


@pytest.fixture(scope="module")
def server(qwen3_dir, tmp_path_factory):
    yield from serve_for_module(qwen3_dir, tmp_path_factory, "responses-logs", "--enable-request-id-headers",
                                "--enable-log-requests", "--enable-auto-tool-choice", "--tool-call-parser", "hermes")


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return server.client()


@pytest.fixture(scope="module")
def hf(qwen3_dir):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(qwen3_dir, dtype=torch.float32).eval()
    return model, AutoTokenizer.from_pretrained(qwen3_dir)


def prompt_ids(tokenizer, messages: list[dict], tools: list[dict] | None = None) -> list[int]:
    text = tokenizer.apply_chat_template(messages, tools=tools, add_generation_prompt=True, tokenize=False)
    return tokenizer(text, add_special_tokens=False).input_ids


def hf_greedy(hf, ids: list[int], max_tokens: int) -> list[int]:
    import torch

    model, _ = hf
    with torch.no_grad():
        out = model.generate(torch.tensor([ids]), max_new_tokens=max_tokens, do_sample=False, pad_token_id=0)
    return out[0, len(ids):].tolist()


def create(client, **kwargs):
    return client.responses.create(model=MODEL_NAME, **{"temperature": 0.0, "max_output_tokens": MAX_TOKENS,
                                                         **kwargs})


def check_events(events: list, final_type: str = "response.completed", created: str = "in_progress") -> list[str]:
    """OpenAI's event order for one message item, numbered 0, 1, ...; the text deltas. ``created``:
    the status response.created carries (a background response's is queued)."""
    types = [event.type for event in events]
    deltas = types.count("response.output_text.delta")
    assert types == ["response.created", "response.in_progress", "response.output_item.added",
                     "response.content_part.added", *["response.output_text.delta"] * deltas,
                     "response.output_text.done", "response.content_part.done", "response.output_item.done",
                     final_type], types
    assert [event.sequence_number for event in events] == list(range(len(events)))
    final = events[-1].response
    assert events[0].response.id == final.id and events[0].response.status == created
    assert events[1].response.status == "in_progress"
    message = final.output[0]
    assert events[2].item.id == events[-2].item.id == message.id and events[2].item.status == "in_progress"
    for event in events[3:-2]:
        assert (event.item_id, event.output_index, event.content_index) == (message.id, 0, 0)
    text = [event.delta for event in events if event.type == "response.output_text.delta"]
    assert events[-4].text == "".join(text) == final.output_text
    return text


# -- whole responses --------------------------------------------------------------------------
def test_cache_salt_keys_the_prefix_cache_as_on_chat(client):
    """vLLM's cache_salt on /v1/responses: only a request with the same salt reads the blocks."""
    words = " ".join(f"salt{index}" for index in range(40))

    def cached(salt):
        response = client.responses.create(model=MODEL_NAME, input=words, max_output_tokens=2, temperature=0.0,
                                           extra_body={"cache_salt": salt})
        return response.usage.input_tokens_details.cached_tokens

    assert cached("tenant-a") == 0
    assert cached("tenant-a") >= 16 and cached("tenant-b") == 0
    with pytest.raises(openai.BadRequestError) as info:
        cached("")
    assert info.value.body["param"] == "cache_salt"


def test_greedy_text_and_usage_equal_hf(client, hf):
    _, tokenizer = hf
    raw = client.responses.with_raw_response.create(
        model=MODEL_NAME, input=MESSAGES, instructions=INSTRUCTIONS, temperature=0.0, max_output_tokens=MAX_TOKENS,
        metadata={"case": "greedy"}, user="u-1")
    assert len(raw.headers["x-request-id"]) == 32  # --enable-request-id-headers
    response = raw.parse()
    ids = prompt_ids(tokenizer, CHAT)
    generated = hf_greedy(hf, ids, MAX_TOKENS)
    assert response.output_text == tokenizer.decode(generated, skip_special_tokens=True)
    usage = response.usage
    assert (usage.input_tokens, usage.output_tokens, usage.total_tokens) == (len(ids), len(generated),
                                                                             len(ids) + len(generated))
    assert usage.input_tokens_details.cached_tokens >= 0 and usage.output_tokens_details.reasoning_tokens == 0
    assert response.id.startswith("resp_") and response.object == "response" and response.model == MODEL_NAME
    [message] = response.output
    assert message.type == "message" and message.role == "assistant" and message.id.startswith("msg_")
    assert message.content[0].type == "output_text" and message.content[0].annotations == []
    assert response.status == ("incomplete" if len(generated) == MAX_TOKENS else "completed")
    # The request's settings, echoed.
    assert (response.instructions, response.metadata, response.user) == (INSTRUCTIONS, {"case": "greedy"}, "u-1")
    assert (response.max_output_tokens, response.temperature, response.top_p) == (MAX_TOKENS, 0.0, 1.0)
    assert (response.tools, response.tool_choice, response.parallel_tool_calls) == ([], "auto", True)
    assert (response.truncation, response.text.format.type, response.previous_response_id) == ("disabled", "text",
                                                                                              None)


def test_max_output_tokens_ends_it_incomplete(client):
    response = create(client, input="Count to ten.", max_output_tokens=3, extra_body={"ignore_eos": True})
    assert response.status == "incomplete" and response.incomplete_details.reason == "max_output_tokens"
    assert response.output[0].status == "incomplete" and response.usage.output_tokens == 3
    events = list(create(client, input="Count to ten.", max_output_tokens=3, extra_body={"ignore_eos": True},
                         stream=True))
    assert "".join(check_events(events, "response.incomplete")) == response.output_text
    assert events[-1].response.incomplete_details.reason == "max_output_tokens"


# -- streaming ------------------------------------------------------------------------------
def test_both_sdk_stream_paths_equal_the_whole_text(client):
    whole = create(client, input=MESSAGES, instructions=INSTRUCTIONS)
    final_type = f"response.{whole.status}"
    events = list(create(client, input=MESSAGES, instructions=INSTRUCTIONS, stream=True))
    assert "".join(check_events(events, final_type)) == whole.output_text
    assert events[-1].response.usage.output_tokens == whole.usage.output_tokens
    with client.responses.stream(model=MODEL_NAME, input=MESSAGES, instructions=INSTRUCTIONS, temperature=0.0,
                                 max_output_tokens=MAX_TOKENS) as stream:
        helper_events = list(stream)
    assert "".join(check_events(helper_events, final_type)) == whole.output_text
    # The helper's final response needs response.completed: an answer under a grammar ends by itself.
    answer = {"format": {"type": "json_schema", "name": "answer", "schema": {"enum": ["yes", "no"]}}}
    ended = create(client, input=MESSAGES, text=answer)
    assert ended.status == "completed" and json.loads(ended.output_text) in ("yes", "no")
    with client.responses.stream(model=MODEL_NAME, input=MESSAGES, temperature=0.0, max_output_tokens=MAX_TOKENS,
                                 text=answer) as stream:
        final = stream.get_final_response()
    assert final.output_text == ended.output_text and final.status == "completed"


def test_a_disconnected_stream_is_aborted(server):
    before = server.metrics().get('sparrow:request_success_total{finished_reason="abort"}', 0.0)
    body = {"model": MODEL_NAME, "input": "Go on.", "max_output_tokens": 400, "stream": True, "ignore_eos": True}
    with httpx.stream("POST", server.url + "/v1/responses", json=body, timeout=30,
                      headers={"Authorization": f"Bearer {API_KEY}"}) as response:
        lines = response.iter_lines()
        assert next(line for line in lines if "response.output_text.delta" in line)
    wait_until(lambda: server.metrics()["sparrow:num_requests_running"] == 0, what="the request to stop")
    assert server.metrics()['sparrow:request_success_total{finished_reason="abort"}'] == before + 1
    assert "Received request resp_" in server.log()  # --enable-log-requests logs it under the response id


# -- the store ------------------------------------------------------------------------------
def test_store_retrieve_and_continue_a_conversation(client, hf):
    _, tokenizer = hf
    first = create(client, input="Name a colour.", instructions="Be brief.", metadata={"turn": "1"})
    assert client.responses.retrieve(first.id).model_dump() == first.model_dump()
    # instructions are not carried over (OpenAI's rule); the new ones come first.
    second = create(client, input="And a bird?", previous_response_id=first.id, instructions=INSTRUCTIONS)
    expected = [{"role": "system", "content": INSTRUCTIONS}, {"role": "user", "content": "Name a colour."},
                {"role": "assistant", "content": first.output_text}, {"role": "user", "content": "And a bird?"}]
    assert second.usage.input_tokens == len(prompt_ids(tokenizer, expected))
    assert second.previous_response_id == first.id
    # The same conversation sent whole, the first reply as the SDK returned it.
    resent = create(client, input=[{"role": "user", "content": "Name a colour."}, *first.output,
                                   {"role": "user", "content": "And a bird?"}], instructions=INSTRUCTIONS)
    assert (resent.output_text, resent.usage.input_tokens) == (second.output_text, second.usage.input_tokens)
    third = create(client, input="And a fish?", previous_response_id=second.id)
    continued = [*expected[1:], {"role": "assistant", "content": second.output_text},
                 {"role": "user", "content": "And a fish?"}]
    assert third.usage.input_tokens == len(prompt_ids(tokenizer, continued))

    unstored = create(client, input="Name a colour.", store=False)
    assert unstored.store is False
    for response_id in (unstored.id, "resp_unknown"):
        with pytest.raises(openai.NotFoundError) as info:
            client.responses.retrieve(response_id)
        assert info.value.body["param"] == "response_id"
        with pytest.raises(openai.BadRequestError) as info:
            create(client, input="Go on.", previous_response_id=response_id)
        assert info.value.body["param"] == "previous_response_id"
        assert info.value.body["code"] == "previous_response_not_found"
    client.responses.delete(first.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(first.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.delete(first.id)


# -- background responses, cancel, input items --------------------------------------------------
def poll(client, response_id: str):
    """The background response once it has left queued / in_progress."""
    def finished():
        response = client.responses.retrieve(response_id)
        return response if response.status not in ("queued", "in_progress") else None

    return wait_until(finished, what="the background response to finish")


def test_a_background_response_polled_to_completion_equals_the_foreground_one(client, hf):
    _, tokenizer = hf
    kwargs = dict(input=MESSAGES, instructions=INSTRUCTIONS, metadata={"case": "background"})
    queued = create(client, background=True, **kwargs)
    assert queued.status in ("queued", "in_progress") and queued.background is True
    assert queued.output == [] and queued.usage is None and queued.metadata == {"case": "background"}
    done = poll(client, queued.id)
    foreground = create(client, **kwargs)
    generated = hf_greedy(hf, prompt_ids(tokenizer, CHAT), MAX_TOKENS)
    assert done.output_text == foreground.output_text == tokenizer.decode(generated, skip_special_tokens=True)
    tokens = [(r.usage.input_tokens, r.usage.output_tokens, r.usage.total_tokens) for r in (done, foreground)]
    assert tokens[0] == tokens[1] and done.status == foreground.status and done.background is True
    # Finished: cancelling returns it as it is (OpenAI's: cancelling twice returns the final response).
    assert client.responses.cancel(done.id).model_dump() == done.model_dump()
    # Its conversation continues as any stored response's.
    again = create(client, input="And a fish?", previous_response_id=done.id)
    continued = [*CHAT[1:], {"role": "assistant", "content": done.output_text},
                 {"role": "user", "content": "And a fish?"}]
    assert again.usage.input_tokens == len(prompt_ids(tokenizer, continued))


def test_a_dropped_background_stream_goes_on_and_resumes_after_a_sequence_number(server, client):
    body = {"model": MODEL_NAME, "input": "Go on.", "max_output_tokens": 60, "temperature": 0.0, "ignore_eos": True,
            "stream": True, "background": True}
    seen = []
    with httpx.stream("POST", server.url + "/v1/responses", json=body, timeout=30,
                      headers={"Authorization": f"Bearer {API_KEY}"}) as response:
        for line in response.iter_lines():
            if line.startswith("data: "):
                seen.append(json.loads(line.removeprefix("data: ")))
                if seen[-1]["type"] == "response.output_text.delta":
                    break  # the client goes; the response goes on
    response_id = seen[0]["response"]["id"]
    assert seen[0]["response"]["status"] == "queued" and seen[1]["response"]["status"] == "in_progress"
    rest = list(client.responses.retrieve(response_id, stream=True, starting_after=seen[-1]["sequence_number"]))
    assert rest[0].sequence_number == seen[-1]["sequence_number"] + 1 and rest[-1].type == "response.incomplete"
    final = client.responses.retrieve(response_id)
    assert final.usage.output_tokens == 60 and rest[-1].response == final
    whole = list(client.responses.retrieve(response_id, stream=True))  # replayed from the start
    assert [event.sequence_number for event in whole] == list(range(len(seen) + len(rest)))
    assert "".join(check_events(whole, "response.incomplete", created="queued")) == final.output_text
    # The SDK's create(background, stream) reads the same events.
    events = list(create(client, input=MESSAGES, instructions=INSTRUCTIONS, background=True, stream=True))
    assert "".join(check_events(events, f"response.{events[-1].response.status}", created="queued")) == \
        create(client, input=MESSAGES, instructions=INSTRUCTIONS).output_text
    # Only a background stream can be streamed again; the query values are checked.
    foreground = create(client, input="Hi", max_output_tokens=1)
    for response_id_, query, param in ((foreground.id, {"stream": "true"}, "stream"),
                                       (response_id, {"stream": "maybe"}, "stream"),
                                       (response_id, {"starting_after": "2"}, "starting_after"),
                                       (response_id, {"stream": "true", "starting_after": "100000"}, "starting_after"),
                                       (response_id, {"stream": "true", "starting_after": "x"}, "starting_after"),
                                       (response_id, {"include[]": LOGPROBS}, "include")):
        response = httpx.get(f"{server.url}/v1/responses/{response_id_}", params=query,
                             headers={"Authorization": f"Bearer {API_KEY}"})
        assert response.status_code == 400 and response.json()["error"]["param"] == param, (query, response.text)


def test_cancelling_a_running_background_response_aborts_it(server, client):
    aborted = 'sparrow:request_success_total{finished_reason="abort"}'
    before = server.metrics().get(aborted, 0.0)
    running = create(client, input="Go on.", background=True, max_output_tokens=480, extra_body={"ignore_eos": True})
    wait_until(lambda: client.responses.retrieve(running.id).status == "in_progress", what="generation to start")
    cancelled = client.responses.cancel(running.id)
    assert (cancelled.id, cancelled.status, cancelled.background) == (running.id, "cancelled", True)
    assert client.responses.retrieve(running.id).status == "cancelled"
    assert client.responses.cancel(running.id).status == "cancelled"  # again: as it is
    wait_until(lambda: server.metrics()["sparrow:num_requests_running"] == 0, what="the request to stop")
    assert server.metrics()[aborted] == before + 1
    assert create(client, input="Name a colour.").usage.output_tokens > 0  # the engine is free
    foreground = create(client, input="Hi", max_output_tokens=1)
    with pytest.raises(openai.BadRequestError) as info:  # created without background
        client.responses.cancel(foreground.id)
    assert info.value.body["param"] == "response_id" and "background" in info.value.body["message"]
    with pytest.raises(openai.NotFoundError) as info:
        client.responses.cancel("resp_unknown")
    assert info.value.body["param"] == "response_id" and info.value.body["type"] == "NotFoundError"
    # Deleting a running one cancels it first.
    deleted = create(client, input="Go on.", background=True, max_output_tokens=480, extra_body={"ignore_eos": True})
    client.responses.delete(deleted.id)
    wait_until(lambda: server.metrics()["sparrow:num_requests_running"] == 0, what="the request to stop")
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(deleted.id)


def test_input_items_list_the_input_in_order_with_pagination(server, client):
    response = create(client, input=[*MESSAGES, {"role": "developer", "content": "Be brief.", "id": "msg_mine"}],
                      max_output_tokens=1)
    items = client.responses.input_items.list(response.id, order="asc").data
    assert [(item.type, item.role, item.status) for item in items] == [
        ("message", "user", "completed"), ("message", "assistant", "completed"), ("message", "user", "completed"),
        ("message", "developer", "completed")]
    assert [[part.type for part in item.content] for item in items] == [["input_text"], ["output_text"],
                                                                         ["input_text"], ["input_text"]]
    assert [item.content[0].text for item in items] == ["Name a colour.", "Blue.", "And a bird?", "Be brief."]
    ids = [item.id for item in items]
    assert len(set(ids)) == 4 and ids[3] == "msg_mine" and ids[0].startswith("msg_")
    assert [item.id for item in client.responses.input_items.list(response.id).data] == ids[::-1]  # desc
    page = client.responses.input_items.list(response.id, limit=3, order="asc")
    assert [item.id for item in page.data] == ids[:3] and page.has_more
    assert (page.first_id, page.last_id) == (ids[0], ids[2])
    last = client.responses.input_items.list(response.id, limit=3, order="asc", after=ids[2])
    assert [item.id for item in last.data] == ids[3:] and not last.has_more
    assert [item.id for item in client.responses.input_items.list(response.id, after=ids[2])] == ids[1::-1]
    # The SDK's auto-pagination follows has_more and the last id.
    assert [item.id for item in client.responses.input_items.list(response.id, limit=1, order="asc")] == ids
    headers = {"Authorization": f"Bearer {API_KEY}"}
    for query, param in (({"limit": "0"}, "limit"), ({"limit": "101"}, "limit"), ({"limit": "ten"}, "limit"),
                         ({"order": "up"}, "order"), ({"after": "msg_nope"}, "after"), ({"include[]": LOGPROBS},
                                                                                         "include")):
        reply = httpx.get(f"{server.url}/v1/responses/{response.id}/input_items", params=query, headers=headers)
        assert reply.status_code == 400 and reply.json()["error"]["param"] == param, (query, reply.text)
        assert reply.json()["error"]["message"].startswith(param)
    with pytest.raises(openai.NotFoundError):
        client.responses.input_items.list("resp_unknown")


# -- structured outputs and logprobs ----------------------------------------------------------
class Pet(BaseModel):
    kind: Literal["cat", "dog"]
    age: int = Field(ge=0, le=30)


def test_text_format_json_schema_and_json_object(client, hf):
    for seed in (1, 2):
        response = create(client, input="A pet as JSON.", temperature=1.0, max_output_tokens=120,
                          text={"format": {"type": "json_schema", "name": "pet", "schema": SCHEMA, "strict": True}},
                          extra_body={"seed": seed})
        assert response.status == "completed", response.output_text
        jsonschema.validate(json.loads(response.output_text), SCHEMA)
        assert response.text.format.type == "json_schema"
    parsed = client.responses.parse(model=MODEL_NAME, input="A pet.", text_format=Pet, temperature=1.0,
                                    max_output_tokens=120)
    assert isinstance(parsed.output_parsed, Pet)
    # A random model rarely closes an open-ended object: biased braces make the shortest one likely.
    braces = {str(hf[1].convert_tokens_to_ids(token)): 100 for token in ("{", "}")}
    anything = create(client, input="Some JSON.", max_output_tokens=120, text={"format": {"type": "json_object"}},
                      extra_body={"logit_bias": braces})
    assert anything.status == "completed" and isinstance(json.loads(anything.output_text), dict)


def test_logprobs_equal_hfs_log_softmax_streamed_and_not(client, hf):
    import torch

    model, tokenizer = hf
    kwargs = dict(input="Name a colour.", include=[LOGPROBS], top_logprobs=2, extra_body={"ignore_eos": True})
    response = create(client, **kwargs)
    entries = response.output[0].content[0].logprobs
    ids = prompt_ids(tokenizer, [{"role": "user", "content": "Name a colour."}])
    generated = hf_greedy(hf, ids, MAX_TOKENS)
    assert len(entries) == response.usage.output_tokens == len(generated)
    with torch.no_grad():
        log_softmax = model(torch.tensor([ids + generated])).logits[0, len(ids) - 1:-1].log_softmax(-1)
    for position, entry in enumerate(entries):
        assert entry.logprob == pytest.approx(log_softmax[position, generated[position]].item(), abs=1e-3)
        top = log_softmax[position].topk(2).values.tolist()
        assert [alternative.logprob for alternative in entry.top_logprobs] == pytest.approx(top, abs=1e-3)
    events = list(create(client, stream=True, **kwargs))
    streamed = [entry for event in events if event.type == "response.output_text.delta" for entry in event.logprobs]
    assert [(entry.token, entry.logprob) for entry in streamed] == [(entry.token, entry.logprob) for entry in entries]


# -- function tools ---------------------------------------------------------------------------
def check_call(call, name: str | None = None) -> None:
    assert call.type == "function_call" and call.status == "completed", call
    assert call.id.startswith("fc_") and call.call_id.startswith("call_")
    assert call.name == name if name else call.name in SCHEMAS
    jsonschema.validate(json.loads(call.arguments), SCHEMAS[call.name])


def check_call_events(events: list) -> str:
    """OpenAI's event order for one function call item, numbered 0, 1, ...; its arguments."""
    types = [event.type for event in events]
    deltas = types.count("response.function_call_arguments.delta")
    assert types == ["response.created", "response.in_progress", "response.output_item.added",
                     *["response.function_call_arguments.delta"] * deltas, "response.function_call_arguments.done",
                     "response.output_item.done", "response.completed"], types
    assert [event.sequence_number for event in events] == list(range(len(events)))
    [call] = events[-1].response.output
    added = events[2].item
    assert (added.type, added.id, added.call_id, added.name) == ("function_call", call.id, call.call_id, call.name)
    assert (added.arguments, added.status) == ("", "in_progress") and events[-2].item == call
    for event in events[3:-2]:
        assert (event.item_id, event.output_index) == (call.id, 0)
    arguments = "".join(event.delta for event in events[3:-3])
    assert arguments == events[-3].arguments == call.arguments
    return arguments


def test_required_and_named_tool_choices_call_a_function_whole_and_streamed(client):
    kwargs = dict(input="What is the weather in Paris?", tools=TOOLS, max_output_tokens=120, temperature=1.0)
    calls = []
    for choice, name in (("required", None), ({"type": "function", "name": "get_time"}, "get_time")):
        whole = create(client, tool_choice=choice, parallel_tool_calls=False, extra_body={"seed": 3}, **kwargs)
        [call] = whole.output
        check_call(call, name)
        assert whole.status == "completed" and whole.output_text == "" and whole.to_dict()["tool_choice"] == choice
        assert [tool.name for tool in whole.tools] == ["get_weather", "get_time"]
        events = list(create(client, tool_choice=choice, parallel_tool_calls=False, extra_body={"seed": 3},
                             stream=True, **kwargs))
        assert check_call_events(events) == call.arguments and events[-1].response.output[0].name == call.name
        calls.append(call)
    # The SDK's stream helper assembles the call from the same events.
    with client.responses.stream(model=MODEL_NAME, tool_choice="required", parallel_tool_calls=False,
                                 extra_body={"seed": 3}, **kwargs) as stream:
        final = stream.get_final_response()
    assert (final.output[0].name, final.output[0].arguments) == (calls[0].name, calls[0].arguments)


def test_the_two_turn_tool_loop_renders_the_call_and_its_output(client, hf):
    _, tokenizer = hf
    question = {"role": "user", "content": "What is the weather in Paris?"}
    # Parallel calls allowed: the calls of one turn become one assistant message.
    first = create(client, input=[question], tools=TOOLS, tool_choice="required", max_output_tokens=400,
                   temperature=1.0, extra_body={"seed": 4})
    calls = first.output
    for call in calls:
        check_call(call)
    assert client.responses.retrieve(first.id).output == calls  # stored with its calls
    answers = [{"type": "function_call_output", "call_id": call.call_id, "output": "Sunny"} for call in calls]
    expected = [question, {"role": "assistant", "content": None, "tool_calls": [
        {"id": call.call_id, "type": "function", "function": {"name": call.name, "arguments": json.loads(
            call.arguments)}} for call in calls]},
        *[{"role": "tool", "tool_call_id": call.call_id, "content": "Sunny"} for call in calls]]
    input_tokens = len(prompt_ids(tokenizer, expected, CHAT_TOOLS))
    # The output sent back with the results, or the results alone after previous_response_id.
    resent = create(client, input=[question, *calls, *answers], tools=TOOLS)
    continued = create(client, input=answers, previous_response_id=first.id, tools=TOOLS, tool_choice="none")
    assert resent.usage.input_tokens == continued.usage.input_tokens == input_tokens
    assert continued.output[0].type == "message"
    with pytest.raises(openai.BadRequestError) as info:  # a result of no call made before
        create(client, input=answers, tools=TOOLS)
    assert info.value.body["param"] == "input[0].call_id"


def test_auto_without_the_servers_flag_is_the_chat_endpoints_refusal():
    from sparrow.entrypoints.openai.protocol_responses import ResponsesRequest
    from sparrow.entrypoints.openai.request_checks import RequestFieldError
    from sparrow.entrypoints.openai.responses_input import chat_request_of, conversation_of
    from sparrow.entrypoints.openai.tool_calling import resolve_tool_choice

    request = ResponsesRequest.model_validate({"input": "Hi", "tools": TOOLS})
    chat = chat_request_of(request, conversation_of(request, []))
    assert resolve_tool_choice(chat, auto_enabled=True).kind == "auto"  # the default with tools, as on chat
    with pytest.raises(RequestFieldError, match="requires --enable-auto-tool-choice") as info:
        resolve_tool_choice(chat, auto_enabled=False)
    assert info.value.param == "tool_choice"


# -- refusals -------------------------------------------------------------------------------
FUNCTION = {"type": "function", "name": "f"}
REFUSED = [
    (dict(tools=[{"type": "web_search"}]), "tools[0].type"),
    (dict(tools=[{"type": "function", "parameters": {}}]), "tools[0].name"),
    (dict(tools=[{**FUNCTION, "parameters": "{}"}]), "tools[0].parameters"),
    (dict(tools=[{**FUNCTION, "bogus": 1}]), "tools[0].bogus"),
    (dict(tools=[{"type": "function", "function": FUNCTION}]), "tools[0].function"),
    (dict(tools=[{**FUNCTION, "parameters": {"type": "no-such-type"}}], tool_choice={**FUNCTION}), "tools"),
    (dict(tools=[FUNCTION], tool_choice={"type": "function", "name": "g"}), "tool_choice"),
    (dict(tools=[FUNCTION], tool_choice={"type": "web_search_preview"}), "tool_choice"),
    (dict(tools=[FUNCTION], tool_choice="required", text={"format": {"type": "json_object"}}), "tool_choice"),
    (dict(tool_choice="required"), "tool_choice"),
    (dict(truncation="auto"), "truncation"),
    (dict(background=True, store=False), "background"),
    (dict(reasoning={"effort": "extreme"}), "reasoning.effort"),
    (dict(reasoning={"summary": "auto"}), "reasoning.summary"),
    (dict(include=["reasoning.encrypted_content"]), "include"),
    (dict(top_logprobs=2), "top_logprobs"),
    (dict(text={"format": {"type": "json_schema", "name": "x"}}), "text.format"),
    (dict(text={"format": {"type": "json_schema", "name": "x", "schema": {"type": "bogus"}}}), "text.format"),
    (dict(text={"format": {"type": "text"}, "verbosity": "low"}), "text.verbosity"),
    (dict(metadata={str(key): "v" for key in range(17)}), "metadata"),
    (dict(max_output_tokens=10_000), "max_output_tokens"),
    (dict(extra_body={"conversation": "conv_1"}), "conversation"),
    (dict(extra_body={"prompt_cache_key": "k"}), "prompt_cache_key"),
    (dict(extra_body={"response_format": {"type": "json_object"}}), "response_format"),
    (dict(extra_body={"bogus": 1}), "bogus"),
    (dict(input=[{"role": "user", "content": [{"type": "input_image", "image_url": "https://x/y.png"}]}]),
     "input[0].content"),
    (dict(input=[{"role": "user", "content": [{"type": "input_text", "text": "a", "bogus": 1}]}]),
     "input[0].content[0].bogus"),
    (dict(input=[{"role": "bot", "content": "Hi"}]), "input[0].role"),
    (dict(input=[{"type": "function_call_output", "call_id": "c", "output": "{}"}]), "input[0].call_id"),
    (dict(input=[{"type": "function_call", "call_id": "c", "name": "f", "arguments": "{oops"}]), "input[0].arguments"),
    (dict(input=[{"role": "user", "content": "Hi"}, {"type": "function_call", "call_id": "c", "name": "f"}]),
     "input[1].arguments"),
    (dict(input=[{"role": "user", "content": "Hi", "call_id": "c"}]), "input[0].call_id"),
    (dict(input=[{"type": "file_search_call", "id": "fs_1"}]), "input[0].type"),
    (dict(input=[{"role": "user", "content": "Hi"}, {"type": "reasoning", "summary": [],
                                                      "content": [{"type": "reasoning_text", "text": "x"}]}]),
     "input[1]"),
    (dict(input=[]), "input"),
]


@pytest.mark.parametrize(("fields", "param"), REFUSED, ids=[param for _, param in REFUSED])
def test_refused_fields_are_400s_naming_them(client, fields, param):
    with pytest.raises(openai.BadRequestError) as info:
        create(client, **{"input": "Hi", **fields})
    body = info.value.body
    assert body["param"] == param and body["message"].startswith(param.split("[")[0]), body
    assert body["type"] == "BadRequestError"


def test_raw_bodies_are_checked_as_the_chat_endpoints_are(server):
    headers = {"Authorization": f"Bearer {API_KEY}", "Content-Type": "application/json"}
    for body, param in ((b'{"input": "Hi", "temperature": "1"}', "temperature"),
                        (b'{"input": [{"role": "user", "content": "\\ud800"}]}', "input"),
                        (b'{"model": "other", "input": "Hi"}', "model")):
        response = httpx.post(server.url + "/v1/responses", content=body, headers=headers, timeout=30)
        assert response.status_code in (400, 404) and response.json()["error"]["param"] == param, response.text
    assert httpx.post(server.url + "/v1/responses", json={"input": "Hi"}).status_code == 401


# -- reasoning items (the output builder, with the real parser) --------------------------------
@pytest.fixture(scope="module")
def think_tokenizer(qwen3_dir, tmp_path_factory):
    from transformers import AutoTokenizer

    from tests.test_reasoning import add_think_tokens

    return AutoTokenizer.from_pretrained(add_think_tokens(qwen3_dir, tmp_path_factory.mktemp("think") / "model"))


def build(tokenizer, text: str, chunked: bool, incomplete: bool = False):
    from sparrow.entrypoints.openai.responses_output import OutputBuilder
    from sparrow.reasoning import Qwen3ReasoningParser

    prompt = tokenizer("<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n", add_special_tokens=False).input_ids
    builder = OutputBuilder(prompt, reasoner=Qwen3ReasoningParser(tokenizer), tokenizer=tokenizer)
    ids = tokenizer(text, add_special_tokens=False).input_ids
    pieces = [[token_id] for token_id in ids] if chunked else [ids]
    events = []
    for piece in pieces:
        events += builder.feed(CompletionOutput(0, tokenizer.decode(piece), piece, None, None))
    events += builder.close(incomplete)
    return builder, ids, events


def test_reasoning_is_an_item_before_the_message_whole_and_streamed(think_tokenizer):
    text = "<think>\nA colour, then.</think>\n\nBlue."
    whole, ids, _ = build(think_tokenizer, text, chunked=False)
    streamed, _, events = build(think_tokenizer, text, chunked=True)
    for builder in (whole, streamed):
        reasoning, message = builder.items()
        assert (reasoning.type, reasoning.content[0].text, reasoning.status) == ("reasoning", "\nA colour, then.",
                                                                                 "completed")
        assert (message.content[0].text, message.status) == ("\n\nBlue.", "completed")
        assert builder.reasoning_tokens == ids.index(think_tokenizer.convert_tokens_to_ids("</think>")) + 1
    kinds = [event["type"] for event in events]
    first_text = kinds.index("response.output_text.delta")
    assert kinds[:2] == ["response.output_item.added", "response.content_part.added"]
    assert kinds[first_text - 5:first_text] == ["response.reasoning_text.done", "response.content_part.done",
                                                "response.output_item.done", "response.output_item.added",
                                                "response.content_part.added"]
    assert [event["output_index"] for event in events if "delta" in event] == \
        [0] * kinds.count("response.reasoning_text.delta") + [1] * kinds.count("response.output_text.delta")
    # Cut off while reasoning: the reasoning item alone, incomplete.
    cut, _, _ = build(think_tokenizer, "<think>\nStill thinking", chunked=True, incomplete=True)
    [reasoning] = cut.items()
    assert (reasoning.status, reasoning.content[0].text) == ("incomplete", "\nStill thinking")


def test_reasoning_effort_goes_to_the_chat_template_as_on_chat(client):
    """reasoning.effort is the chat endpoint's reasoning_effort: the template's reasoning_effort
    variable (tests/test_server_flags.py checks what a template makes of it)."""
    from sparrow.entrypoints.openai.protocol_responses import ResponsesRequest
    from sparrow.entrypoints.openai.responses_input import chat_request_of, conversation_of

    request = ResponsesRequest.model_validate({"model": MODEL_NAME, "input": "Hi", "reasoning": {"effort": "low"}})
    assert chat_request_of(request, conversation_of(request, [])).reasoning_effort == "low"
    response = client.responses.create(model=MODEL_NAME, input="Hi", reasoning={"effort": "high"},
                                       max_output_tokens=3)
    assert response.status in ("completed", "incomplete")
