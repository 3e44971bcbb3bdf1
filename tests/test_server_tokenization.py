"""The endpoints real clients call besides generation, through a real `sparrow serve`:
/tokenize (text and chat forms), /detokenize, /tokenizer_info, GET /v1/models/{id}, and CORS.

Token ids are checked against the model's own Hugging Face tokenizer and against the prompt the
generation endpoints report (usage.prompt_tokens), so /tokenize cannot drift from what the engine
is sent. CORS is checked with real preflight (OPTIONS) and simple requests carrying an Origin."""

from __future__ import annotations

import json
import time

import httpx
import openai
import pytest
from transformers import AutoTokenizer

from tests.test_server import API_KEY, MODEL_NAME, PROMPT, serve_for_module

ALLOWED_ORIGIN = "https://app.example"
OTHER_ORIGIN = "https://evil.example"
MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Name a colour."}]
CITY = {"type": "object", "properties": {"city": {"type": "string"}}}
TOOLS = [{"type": "function",
          "function": {"name": "get_weather", "description": "Weather in a city", "parameters": CITY}}]

TOOLS_TEMPLATE = ("{{ greeting | default('') }}{% for tool in tools or [] %}<{{ tool.function.name }}>{% endfor %}"
                  "{% for m in messages %}[{{ m.role }}:{{ m.content }}]{% endfor %}")


@pytest.fixture(scope="module")
def server(qwen3_dir, tmp_path_factory):
    yield from serve_for_module(qwen3_dir, tmp_path_factory, "tokenization-logs",
                                "--allowed-origins", json.dumps([ALLOWED_ORIGIN]), "--allowed-methods",
                                '["GET", "POST"]', "--allow-credentials", "--enable-tokenizer-info-endpoint",
                                "--enable-force-include-usage", "--enable-request-id-headers",
                                "--enable-server-load-tracking", "--middleware", "tests.server_middleware.ServedBy",
                                "--middleware", "tests.server_middleware:path_echo", "--trust-request-chat-template")


@pytest.fixture(scope="module")
def http(server):
    with httpx.Client(base_url=server.url, headers={"Authorization": f"Bearer {API_KEY}"}, timeout=60) as client:
        yield client


@pytest.fixture(scope="module")
def hf_tokenizer(qwen3_dir):
    return AutoTokenizer.from_pretrained(qwen3_dir)


def error_of(response: httpx.Response, status: int) -> dict:
    assert response.status_code == status, response.text
    return response.json()["error"]


# -- /tokenize --------------------------------------------------------------------------------------
def test_tokenize_text_matches_the_tokenizer_and_the_completion_prompt(server, http, hf_tokenizer):
    body = http.post("/tokenize", json={"model": MODEL_NAME, "prompt": PROMPT, "return_token_strs": True}).json()
    expected = hf_tokenizer.encode(PROMPT, add_special_tokens=True)
    assert body == {"count": len(expected), "max_model_len": 512, "tokens": expected,
                    "token_strs": hf_tokenizer.convert_ids_to_tokens(expected)}
    bare = http.post("/tokenize", json={"prompt": PROMPT, "add_special_tokens": False}).json()
    assert bare["tokens"] == hf_tokenizer.encode(PROMPT, add_special_tokens=False) and bare["token_strs"] is None
    completion = server.client().completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=1)
    assert completion.usage.prompt_tokens == body["count"]


def test_tokenize_chat_matches_the_chat_endpoints_prompt(server, http, hf_tokenizer):
    cases = [
        ({"messages": MESSAGES}, dict(add_generation_prompt=True)),
        ({"messages": MESSAGES, "add_generation_prompt": False}, dict(add_generation_prompt=False)),
        ({"messages": MESSAGES + [{"role": "assistant", "content": "Bl"}], "add_generation_prompt": False,
          "continue_final_message": True}, dict(add_generation_prompt=False, continue_final_message=True)),
        ({"messages": MESSAGES, "tools": TOOLS}, dict(add_generation_prompt=True, tools=TOOLS)),
        # The test model's template ignores tools: this one shows whether they reach it.
        ({"messages": MESSAGES, "tools": TOOLS, "chat_template": TOOLS_TEMPLATE},
         dict(tools=TOOLS, chat_template=TOOLS_TEMPLATE)),
        ({"messages": MESSAGES, "chat_template": TOOLS_TEMPLATE, "chat_template_kwargs": {"greeting": "Hi"}},
         dict(chat_template=TOOLS_TEMPLATE, greeting="Hi")),
        ({"messages": MESSAGES, "chat_template": "{% for m in messages %}[{{ m.content }}]{% endfor %}"},
         dict(chat_template="{% for m in messages %}[{{ m.content }}]{% endfor %}")),
    ]
    for request, hf_kwargs in cases:
        body = http.post("/tokenize", json={**request, "return_token_strs": True}).json()
        text = hf_tokenizer.apply_chat_template(request["messages"], tokenize=False, **hf_kwargs)
        expected = hf_tokenizer.encode(text, add_special_tokens=False)
        assert body["tokens"] == expected and body["count"] == len(expected), request
        assert body["token_strs"] == hf_tokenizer.convert_ids_to_tokens(expected)
    chat = server.client().chat.completions.create(model=MODEL_NAME, messages=MESSAGES, max_completion_tokens=1)
    assert chat.usage.prompt_tokens == http.post("/tokenize", json={"messages": MESSAGES}).json()["count"]
    with_bos = http.post("/tokenize", json={"messages": MESSAGES, "add_special_tokens": True}).json()
    text = hf_tokenizer.apply_chat_template(MESSAGES, tokenize=False, add_generation_prompt=True)
    assert with_bos["tokens"] == hf_tokenizer.encode(text, add_special_tokens=True)


def test_tokenize_refuses_what_it_does_not_honour(http):
    error = error_of(http.post("/tokenize", json={"prompt": "x", "truncate_prompt_tokens": 2}), 400)
    assert error["param"] == "truncate_prompt_tokens" and error["code"] == "unknown_field"
    # Both forms at once: the chat form, whose "prompt" is not a field.
    error = error_of(http.post("/tokenize", json={"prompt": "x", "messages": MESSAGES}), 400)
    assert error["param"] == "prompt"
    assert error_of(http.post("/tokenize", json={"promt": "x"}), 400)["param"] == "prompt"
    assert error_of(http.post("/tokenize", json={"prompt": 3}), 400)["param"] == "prompt"
    error = error_of(http.post("/tokenize", json={"prompt": "x", "model": "other"}), 404)
    assert error["code"] == "model_not_found" and error["param"] == "model"
    surrogate = b'{"prompt": "ab\\ud800"}'
    error = error_of(http.post("/tokenize", content=surrogate, headers={"content-type": "application/json"}), 400)
    assert error["param"] == "prompt", error
    error = error_of(http.post("/tokenize", json={"messages": MESSAGES, "chat_template": "{% for %}"}), 400)
    assert error["param"] == "chat_template"
    error = error_of(http.post("/tokenize", json={"messages": MESSAGES, "continue_final_message": True}), 400)
    assert "continue_final_message" in error["message"]
    error = error_of(http.post("/tokenize", json={"messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "http://x"}}]}]}), 400)
    assert error["param"] == "messages[0].content"
    assert error_of(http.post("/tokenize", json={"messages": []}), 400)["param"] == "messages"
    # JSON types are strict, as on the generation endpoints: "yes" and 1 are not booleans.
    for body, param in [({"prompt": "x", "add_special_tokens": "yes"}, "add_special_tokens"),
                        ({"prompt": "x", "return_token_strs": 1}, "return_token_strs"),
                        ({"messages": MESSAGES, "add_generation_prompt": "no"}, "add_generation_prompt")]:
        assert error_of(http.post("/tokenize", json=body), 400)["param"] == param, body
    assert error_of(http.post("/tokenize", json=["x"]), 400)["code"] == "invalid_value"
    assert error_of(http.post("/tokenize", content=b"{not json", headers={"content-type": "application/json"}),
                    400)["code"] == "invalid_value"


# -- /detokenize ------------------------------------------------------------------------------------
def test_detokenize_round_trips_and_refuses_ids_outside_the_vocabulary(http, hf_tokenizer):
    tokens = http.post("/tokenize", json={"messages": MESSAGES}).json()["tokens"]
    text = hf_tokenizer.apply_chat_template(MESSAGES, tokenize=False, add_generation_prompt=True)
    assert http.post("/detokenize", json={"model": MODEL_NAME, "tokens": tokens}).json() == {"prompt": text}
    assert http.post("/detokenize", json={"tokens": []}).json() == {"prompt": ""}
    vocab = len(hf_tokenizer)
    error = error_of(http.post("/detokenize", json={"tokens": [5, vocab]}), 400)
    assert error["param"] == "tokens" and str(vocab) in error["message"] and "position 1" in error["message"]
    for bad in ([-1], [2**40], ["a"], "12"):
        assert error_of(http.post("/detokenize", json={"tokens": bad}), 400)["param"] == "tokens", bad
    assert error_of(http.post("/detokenize", json={"tokens": [1], "skip": True}), 400)["param"] == "skip"
    assert error_of(http.post("/detokenize", json={"tokens": [1], "model": "x"}), 404)["code"] == "model_not_found"


# -- /tokenizer_info --------------------------------------------------------------------------------
def test_tokenizer_info_has_what_clients_read(http, hf_tokenizer):
    info = http.get("/tokenizer_info").json()
    assert info["tokenizer_class"] == type(hf_tokenizer).__name__
    assert info["eos_token"] == hf_tokenizer.eos_token == "<|im_end|>"
    assert info["pad_token"] == hf_tokenizer.pad_token and info["bos_token"] is None
    assert info["chat_template"] == hf_tokenizer.chat_template
    assert info["model_max_length"] == hf_tokenizer.model_max_length
    assert info["clean_up_tokenization_spaces"] is False
    # Paths on the server are nobody's business.
    assert not {"vocab_file", "name_or_path", "tokenizer_file"} & set(info), sorted(info)
    # lm-evaluation-harness's check for a remote tokenizer: both endpoints answer.
    assert isinstance(http.post("/tokenize", json={"prompt": "test", "add_special_tokens": False}).json()["tokens"],
                      list)


# -- /v1/models/{id} ----------------------------------------------------------------------------------
def test_retrieve_model_with_the_openai_client(server):
    client = server.client()
    card = client.models.retrieve(MODEL_NAME)
    assert card.id == MODEL_NAME and card.object == "model"
    assert card.model_dump() == client.models.list().data[0].model_dump() | {"created": card.created}
    with pytest.raises(openai.NotFoundError) as caught:
        client.models.retrieve("Qwen/not-served")
    assert caught.value.code == "model_not_found" and "Qwen/not-served" in caught.value.message


# -- auth and CORS ------------------------------------------------------------------------------------
def test_the_api_key_guards_the_tokenizer_endpoints(server):
    for method, path in [("POST", "/tokenize"), ("POST", "/detokenize"), ("GET", "/tokenizer_info"),
                         ("GET", f"/v1/models/{MODEL_NAME}")]:
        response = httpx.request(method, server.url + path, json={"prompt": "x", "tokens": [1]})
        assert error_of(response, 401)["code"] == "invalid_api_key", path
    assert httpx.get(server.url + "/health").status_code == 200


def test_cors_preflight_and_simple_requests(server):
    preflight = {"Origin": ALLOWED_ORIGIN, "Access-Control-Request-Method": "POST",
                 "Access-Control-Request-Headers": "authorization, content-type"}
    for path in ("/tokenize", "/v1/chat/completions", "/v1/completions"):
        # Browsers send preflights without credentials: answered before the API key is asked for.
        response = httpx.options(server.url + path, headers=preflight)
        assert response.status_code == 200, response.text
        assert response.headers["access-control-allow-origin"] == ALLOWED_ORIGIN
        assert response.headers["access-control-allow-credentials"] == "true"
        assert set(response.headers["access-control-allow-methods"].replace(" ", "").split(",")) == {"GET", "POST"}
        assert "authorization" in response.headers["access-control-allow-headers"].lower()
    # Refused (another origin, a method not listed): a 400 in OpenAI's shape without any CORS header.
    refusals = [({"Origin": OTHER_ORIGIN}, OTHER_ORIGIN), ({"Access-Control-Request-Method": "DELETE"}, "DELETE")]
    for changed, named in refusals:
        refused = httpx.options(server.url + "/tokenize", headers=preflight | changed)
        error = error_of(refused, 400)
        assert error["code"] == "cors_refused" and named in error["message"], error
        assert not [name for name in refused.headers if name.lower().startswith("access-control-")], refused.headers

    headers = {"Origin": ALLOWED_ORIGIN, "Authorization": f"Bearer {API_KEY}"}
    response = httpx.post(server.url + "/tokenize", json={"prompt": "hi"}, headers=headers)
    assert response.status_code == 200 and response.headers["access-control-allow-origin"] == ALLOWED_ORIGIN
    # An error is readable by the page too (the browser hides a response without the header).
    response = httpx.post(server.url + "/tokenize", json={"prompt": "hi"}, headers={"Origin": ALLOWED_ORIGIN})
    assert response.status_code == 401 and response.headers["access-control-allow-origin"] == ALLOWED_ORIGIN
    response = httpx.post(server.url + "/tokenize", json={"prompt": "hi"}, headers=headers | {"Origin": OTHER_ORIGIN})
    assert response.status_code == 200 and "access-control-allow-origin" not in response.headers
    assert "/tokenize" in httpx.get(server.url + "/openapi.json").json()["paths"]


def test_cors_flags_parse_as_json_lists(capsys):
    import argparse

    from sparrow.entrypoints.openai.api_server import add_serve_parser

    parser = argparse.ArgumentParser(prog="sparrow")
    add_serve_parser(parser.add_subparsers())
    args = parser.parse_args(["serve"])
    assert (args.allowed_origins, args.allowed_methods, args.allowed_headers, args.allow_credentials) == (
        ["*"], ["*"], ["*"], False)
    args = parser.parse_args(["serve", "--allowed-origins", '["https://a.example", "http://localhost:3000"]'])
    assert args.allowed_origins == ["https://a.example", "http://localhost:3000"]
    for bad in ("https://a.example", '"*"', "[1]"):
        with pytest.raises(SystemExit) as caught:
            parser.parse_args(["serve", "--allowed-origins", bad])
        assert caught.value.code == 2
        assert "--allowed-origins" in capsys.readouterr().err


def test_force_include_usage_ends_every_stream_with_its_usage(server):
    """--enable-force-include-usage (vLLM's): a stream that did not ask for usage still ends with
    its usage chunk, on both endpoints; the usage counts the tokens the stream carried."""
    client = server.client()
    chunks = list(client.completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=4, temperature=0.0,
                                            stream=True, extra_body={"ignore_eos": True}))
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 4
    assert all(chunk.usage is None for chunk in chunks[:-1])
    chat = list(client.chat.completions.create(model=MODEL_NAME, messages=[{"role": "user", "content": PROMPT}],
                                               max_completion_tokens=3, temperature=0.0, stream=True,
                                               extra_body={"ignore_eos": True}))
    assert chat[-1].choices == [] and chat[-1].usage.completion_tokens == 3
    assert chat[-1].usage.prompt_tokens == client.chat.completions.create(
        model=MODEL_NAME, messages=[{"role": "user", "content": PROMPT}], max_completion_tokens=1).usage.prompt_tokens


def test_request_id_headers(server):
    """--enable-request-id-headers (vLLM's): every response carries X-Request-Id, the client's own
    when it sent one, else a new one per response; an error response too."""
    auth = {"Authorization": f"Bearer {API_KEY}"}
    body = {"model": MODEL_NAME, "prompt": PROMPT}
    given = httpx.post(server.url + "/tokenize", json=body, headers={**auth, "X-Request-Id": "trace-42"}, timeout=30)
    assert given.status_code == 200 and given.headers["x-request-id"] == "trace-42"
    first, second = (httpx.post(server.url + "/tokenize", json=body, headers=auth, timeout=30) for _ in range(2))
    assert len(first.headers["x-request-id"]) == 32 and first.headers["x-request-id"] != second.headers["x-request-id"]
    refused = httpx.post(server.url + "/tokenize", json=body, timeout=30)  # no API key
    assert refused.status_code == 401 and "x-request-id" in refused.headers


def test_server_load_counts_generation_requests_in_flight(server):
    """--enable-server-load-tracking (vLLM's): GET /load counts a completion while it runs, and not
    once it is done."""
    import threading

    auth = {"Authorization": f"Bearer {API_KEY}"}

    def load() -> int:
        return httpx.get(server.url + "/load", headers=auth, timeout=30).json()["server_load"]

    assert load() == 0
    body = {"model": MODEL_NAME, "prompt": PROMPT, "max_tokens": 400, "ignore_eos": True}
    done = threading.Event()
    request = threading.Thread(target=lambda: (httpx.post(server.url + "/v1/completions", json=body, headers=auth,
                                                          timeout=120), done.set()))
    request.start()
    seen = 0
    while not done.is_set() and not seen:
        seen = load()
        time.sleep(0.005)
    request.join()
    assert seen == 1 and load() == 0


def test_middleware_flag_adds_the_users_middleware(server):
    """--middleware (vLLM's): a class and an async function, by import path, wrap every route."""
    response = httpx.post(server.url + "/tokenize", json={"model": MODEL_NAME, "prompt": PROMPT},
                          headers={"Authorization": f"Bearer {API_KEY}"}, timeout=30)
    assert response.status_code == 200
    assert response.headers["x-served-by"] == "sparrow-test" and response.headers["x-path"] == "/tokenize"


@pytest.mark.parametrize(("value", "phrase"), [
    ("tests.server_middleware.Missing", "cannot import"),
    ("no_such_module.Thing", "cannot import"),
    ("tests.server_middleware.NOT_MIDDLEWARE", "neither a class"),
    ("ServedBy", "expected an import path"),
])
def test_a_wrong_middleware_is_refused_at_start_up(value, phrase, capsys):
    from sparrow.entrypoints.cli import build_parser

    with pytest.raises(SystemExit) as info:
        build_parser().parse_args(["serve", "--middleware", value])
    assert info.value.code == 2
    last = capsys.readouterr().err.strip().splitlines()[-1]
    assert "argument --middleware" in last and phrase in last, last
