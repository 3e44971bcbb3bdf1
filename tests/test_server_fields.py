"""Honour or refuse: every request field of `sparrow serve` either has its effect or is a 400
naming it. One real server process on 127.0.0.1, the real `openai` client (vLLM's fields through
`extra_body`), and references computed independently with the Hugging Face tokenizer.

The test model's tokenizer is given a BOS token (the recipe's has none) so that
`add_special_tokens` has something to add."""

from __future__ import annotations

import json
from pathlib import Path

import httpx
import openai
import pytest

from tests.test_server import API_KEY, MODEL_NAME, PROMPT, Server, serve_for_module

MAX_MODEL_LEN = 512  # what tests.test_server.Server passes
BOS_ID = 0  # <|endoftext|>, made the BOS token below
MESSAGES = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Tell me a story."}]
GREEDY = dict(temperature=0.0, max_tokens=6)
IGNORE_EOS = {"ignore_eos": True}


def add_bos_to_tokenizer(model_dir: Path) -> None:
    """Make the tokenizer prepend <|endoftext|> when asked to add special tokens."""
    path = model_dir / "tokenizer.json"
    spec = json.loads(path.read_text())
    bos = {"SpecialToken": {"id": "<|endoftext|>", "type_id": 0}}
    template = {
        "type": "TemplateProcessing",
        "single": [bos, {"Sequence": {"id": "A", "type_id": 0}}],
        "pair": [bos, {"Sequence": {"id": "A", "type_id": 0}}, {"Sequence": {"id": "B", "type_id": 1}}],
        "special_tokens": {"<|endoftext|>": {"id": "<|endoftext|>", "ids": [BOS_ID], "tokens": ["<|endoftext|>"]}},
    }
    spec["post_processor"] = {"type": "Sequence", "processors": [spec["post_processor"], template]}
    path.write_text(json.dumps(spec))


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> str:
    from sparrow.tiny.model import build_model_dir

    directory = build_model_dir(tmp_path_factory.mktemp("fields-model"), "qwen3", "test", seed=5)
    add_bos_to_tokenizer(Path(directory))
    return str(directory)


@pytest.fixture(scope="module")
def tokenizer(model_dir):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    assert tok.encode("hi")[0] == BOS_ID and tok.encode("hi", add_special_tokens=False)[0] != BOS_ID
    return tok


class FieldsServer(Server):
    def _engine_pid(self) -> None:
        return None  # these tests never signal the engine process, so need not find it


@pytest.fixture(scope="module")
def server(model_dir, tmp_path_factory):
    yield from serve_for_module(model_dir, tmp_path_factory, "fields-logs", "--trust-request-chat-template",
                                server_cls=FieldsServer)


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return server.client()


# -- helpers ----------------------------------------------------------------------------------
def greedy_from_ids(client: openai.OpenAI, token_ids: list[int], max_tokens: int = 6) -> str:
    """The reference: greedy text after exactly these prompt token ids."""
    response = client.completions.create(model=MODEL_NAME, prompt=token_ids, temperature=0.0, max_tokens=max_tokens,
                                         extra_body=IGNORE_EOS)
    assert response.usage.prompt_tokens == len(token_ids)
    return response.choices[0].text


def chat(client: openai.OpenAI, messages=MESSAGES, **extra):
    return client.chat.completions.create(model=MODEL_NAME, messages=messages, temperature=0.0,
                                          max_completion_tokens=6, extra_body={**IGNORE_EOS, **extra})


def rendered_ids(tokenizer, messages=MESSAGES, add_special_tokens=False, **template_kwargs) -> list[int]:
    template_kwargs.setdefault("add_generation_prompt", True)
    text = tokenizer.apply_chat_template(messages, tokenize=False, **template_kwargs)
    return tokenizer.encode(text, add_special_tokens=add_special_tokens)


def post(server: Server, path: str, body: dict) -> httpx.Response:
    """A raw request: json.dumps writes lone surrogates as \\u escapes, which the openai client
    (UTF-8 bodies) cannot send."""
    return httpx.post(server.url + path, content=json.dumps(body), timeout=60,
                      headers={"Authorization": f"Bearer {API_KEY}", "Content-Type": "application/json"})


def assert_still_serving(client: openai.OpenAI) -> None:
    response = client.completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=2, temperature=0.0,
                                         extra_body=IGNORE_EOS)
    assert response.usage.completion_tokens == 2 and response.choices[0].finish_reason == "length"


def assert_400(call, param: str, *phrases: str) -> dict:
    with pytest.raises(openai.BadRequestError) as info:
        call()
    error = info.value.body
    assert error["param"] == param, error
    for phrase in phrases:
        assert phrase in error["message"], error
    return error


# -- refused fields -----------------------------------------------------------------------------
COMPLETION_REFUSED = [
    ({"no_such_field": 1}, "no_such_field", "unknown field"),
    ({"guided_decoding_backend": "outlines"}, "guided_decoding_backend", "not supported yet"),
    # Structural tags are taken (tests/test_server_structured.py); malformed ones are refused by name.
    ({"structural_tag": "{}"}, "structural_tag", "must have a format field"),
    ({"response_format": {"type": "structural_tag"}}, "response_format", "and got neither"),
    ({"bad_words": [" "]}, "bad_words", "non-space character"),
    ({"vllm_xargs": {"a": {"b": 1}}}, "vllm_xargs", "vllm_xargs"),
    ({"best_of": 3}, "best_of", "not supported yet"),
    ({"suffix": "The end."}, "suffix", "not supported yet"),
    ({"length_penalty": 0.5}, "length_penalty", "use_beam_search"),
    ({"stream_options": {"include_usage": True, "continuous_usage_stats": True}}, "stream_options", "stream"),
]
CHAT_REFUSED = [
    ({"response_format": {"type": "xml"}}, "response_format", "not supported yet"),
    # tool_choice "auto" (the default with tools) needs the server's tool-parser flags, as in vLLM.
    ({"tools": [{"type": "function", "function": {"name": "f"}}]}, "tool_choice", "--enable-auto-tool-choice"),
    ({"tools": [{"type": "function", "function": {"name": "f"}}], "tool_choice": "auto"}, "tool_choice",
     "--tool-call-parser"),
    ({"tool_choice": "required"}, "tool_choice", "needs tools"),
    ({"functions": [{"name": "f"}]}, "functions", "not supported yet"),
    ({"documents": [{"title": "a", "text": 1}]}, "documents", "documents"),
    ({"reasoning_effort": "extreme"}, "reasoning_effort", "reasoning_effort"),
    ({"messages": [{"role": "user", "content": "hi", "colour": "red"}]}, "messages[0].colour", "unknown field"),
    ({"stream": True, "stream_options": {"include_usage": True, "typo": 1}}, "stream_options.typo", "unknown field"),
    ({"stream": True, "stream_options": {"continuous_usage_stats": True}}, "stream_options", "include_usage"),
    ({"continue_final_message": True}, "continue_final_message", "add_generation_prompt"),
    ({"chat_template_kwargs": {"tokenize": True}}, "chat_template_kwargs", "tokenize"),
    ({"chat_template": "{% for %}"}, "chat_template", "Jinja"),
]


def test_unknown_and_unsupported_fields_are_400_naming_them(server, client):
    for body, param, phrase in COMPLETION_REFUSED:
        assert_400(lambda: client.completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=2, extra_body=body),
                   param, phrase)
        assert_still_serving(client)
    for body, param, phrase in CHAT_REFUSED:
        body = dict(body)
        messages = body.pop("messages", MESSAGES)
        assert_400(lambda: client.chat.completions.create(model=MODEL_NAME, messages=messages, max_completion_tokens=2,
                                                          extra_body=body), param, phrase)
        assert_still_serving(client)


def test_harmless_client_fields_are_accepted(client):
    harmless = {"metadata": {"run": "1"}, "store": False, "service_tier": "auto", "user": "u-1",
                "response_format": {"type": "text"}}
    plain = chat(client)
    same = chat(client, **harmless, parallel_tool_calls=False)
    assert same.choices[0].message.content == plain.choices[0].message.content
    # An assistant turn sent back as OpenAI returned it (empty refusal and annotations).
    turns = [*MESSAGES, {"role": "assistant", "content": "Once.", "refusal": None, "annotations": []},
             {"role": "user", "content": "Again."}]
    assert chat(client, turns).choices[0].message.content
    assert client.completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=2, extra_body=harmless).choices


# -- implemented fields -------------------------------------------------------------------------
def test_truncate_prompt_tokens_keeps_the_last_tokens(client, tokenizer):
    prompt_ids = tokenizer.encode(PROMPT)
    for keep in (5, 1):
        response = client.completions.create(model=MODEL_NAME, prompt=PROMPT, **GREEDY,
                                             extra_body={**IGNORE_EOS, "truncate_prompt_tokens": keep})
        assert response.usage.prompt_tokens == keep
        assert response.choices[0].text == greedy_from_ids(client, prompt_ids[-keep:])
    by_ids = client.completions.create(model=MODEL_NAME, prompt=prompt_ids, **GREEDY,
                                       extra_body={**IGNORE_EOS, "truncate_prompt_tokens": 3})
    assert by_ids.usage.prompt_tokens == 3 and by_ids.choices[0].text == greedy_from_ids(client, prompt_ids[-3:])
    # Echo shows the prompt the model saw.
    echoed = client.completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=1, echo=True,
                                       extra_body={"truncate_prompt_tokens": 4})
    assert echoed.choices[0].text.startswith(tokenizer.decode(prompt_ids[-4:]))
    # -1: the longest prompt that leaves room for an output token; a short prompt is kept whole.
    whole = client.completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=1,
                                      extra_body={"truncate_prompt_tokens": -1})
    assert whole.usage.prompt_tokens == len(prompt_ids)
    full = rendered_ids(tokenizer)
    chatted = chat(client, truncate_prompt_tokens=7)
    assert chatted.usage.prompt_tokens == 7
    assert chatted.choices[0].message.content == greedy_from_ids(client, full[-7:])
    for bad in (0, MAX_MODEL_LEN + 1, -2):
        assert_400(lambda: client.completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=1,
                                                     extra_body={"truncate_prompt_tokens": bad}),
                   "truncate_prompt_tokens")
    assert_still_serving(client)


def test_add_special_tokens(client, tokenizer):
    with_bos = tokenizer.encode(PROMPT)
    default = client.completions.create(model=MODEL_NAME, prompt=PROMPT, **GREEDY, extra_body=IGNORE_EOS)
    assert default.usage.prompt_tokens == len(with_bos)
    without = client.completions.create(model=MODEL_NAME, prompt=PROMPT, **GREEDY,
                                        extra_body={**IGNORE_EOS, "add_special_tokens": False})
    assert without.usage.prompt_tokens == len(with_bos) - 1
    assert without.choices[0].text == greedy_from_ids(client, with_bos[1:])
    assert default.choices[0].text == greedy_from_ids(client, with_bos)
    # Chat: the template wrote the special tokens, so none are added unless asked for.
    ids = rendered_ids(tokenizer)
    assert chat(client).usage.prompt_tokens == len(ids)
    with_special = chat(client, add_special_tokens=True)
    assert with_special.usage.prompt_tokens == len(ids) + 1
    assert with_special.choices[0].message.content == greedy_from_ids(client, [BOS_ID, *ids])


CUSTOM_TEMPLATE = ("{% for m in messages %}[{{ m.role }} says {{ greeting }}] {{ m.content }}\n{% endfor %}"
                   "{% if add_generation_prompt %}[assistant says {{ greeting }}]{% endif %}")


def test_chat_template_kwargs_and_add_generation_prompt(client, tokenizer):
    kwargs = {"greeting": "ahoy"}
    ids = rendered_ids(tokenizer, chat_template=CUSTOM_TEMPLATE, **kwargs)
    assert ids != rendered_ids(tokenizer)
    custom = chat(client, chat_template=CUSTOM_TEMPLATE, chat_template_kwargs=kwargs)
    assert custom.usage.prompt_tokens == len(ids)
    assert custom.choices[0].message.content == greedy_from_ids(client, ids)
    other = rendered_ids(tokenizer, chat_template=CUSTOM_TEMPLATE, greeting="a much longer greeting than that")
    assert chat(client, chat_template=CUSTOM_TEMPLATE,
                chat_template_kwargs={"greeting": "a much longer greeting than that"}).usage.prompt_tokens == len(other)
    no_prompt = rendered_ids(tokenizer, add_generation_prompt=False)
    response = chat(client, add_generation_prompt=False)
    assert response.usage.prompt_tokens == len(no_prompt) < len(rendered_ids(tokenizer))
    assert response.choices[0].message.content == greedy_from_ids(client, no_prompt)
    # The reply continues the last message, so its role is that message's (vLLM's rule).
    assert response.choices[0].message.role == "user"


def test_continue_final_message_with_echo(client, tokenizer):
    started = [*MESSAGES, {"role": "assistant", "content": "Once upon a"}]
    ids = rendered_ids(tokenizer, started, add_generation_prompt=False, continue_final_message=True)
    assert tokenizer.decode(ids).endswith("Once upon a")
    continued = greedy_from_ids(client, ids)
    fields = dict(add_generation_prompt=False, continue_final_message=True)
    response = chat(client, started, **fields)
    assert response.usage.prompt_tokens == len(ids)
    assert response.choices[0].message.content == continued
    echoed = chat(client, started, echo=True, **fields)
    assert echoed.choices[0].message.content == "Once upon a" + continued
    assert echoed.choices[0].message.role == "assistant"
    stream = client.chat.completions.create(model=MODEL_NAME, messages=started, temperature=0.0,
                                            max_completion_tokens=6, stream=True,
                                            extra_body={**IGNORE_EOS, "echo": True, **fields})
    assert "".join(c.delta.content or "" for chunk in stream for c in chunk.choices) == "Once upon a" + continued
    # echo with a new assistant turn after a user message: nothing to echo.
    assert chat(client, echo=True).choices[0].message.content == chat(client).choices[0].message.content
    assert_400(lambda: chat(client, started, continue_final_message=True, add_generation_prompt=True),
               "continue_final_message")


TOOLS_TEMPLATE = (
    "{% if tools %}[tools] {{ tools | tojson }}\n{% endif %}"
    "{% for m in messages %}[{{ m.role }}{% if m.name %} {{ m.name }}{% endif %}]"
    "{% if m.tool_calls %}{% for call in m.tool_calls %} call {{ call.id }} {{ call.function.name }}"
    "{{ call.function.arguments | tojson }}{% endfor %}{% endif %}"
    "{% if m.tool_call_id %} answers {{ m.tool_call_id }}{% endif %} {{ m.content or '' }}\n{% endfor %}"
    "{% if add_generation_prompt %}[assistant]{% endif %}"
)
TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]


def test_tools_tool_calls_tool_call_id_and_name_reach_the_template(client, tokenizer):
    sent = [
        {"role": "user", "name": "alice", "content": "Weather in Paris?"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_7", "type": "function",
             "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "tool_call_id": "call_7", "content": "sunny"},
    ]
    # What transformers renders when handed the same conversation, arguments as an object.
    expected_messages = json.loads(json.dumps(sent))
    expected_messages[1]["tool_calls"][0]["function"]["arguments"] = {"city": "Paris"}
    text = tokenizer.apply_chat_template(expected_messages, tools=TOOLS, chat_template=TOOLS_TEMPLATE,
                                         add_generation_prompt=True, tokenize=False)
    for part in ('"get_weather"', "alice", "call call_7 get_weather", '{"city": "Paris"}', "answers call_7"):
        assert part in text, part
    ids = tokenizer.encode(text, add_special_tokens=False)
    response = chat(client, sent, tools=TOOLS, tool_choice="none", chat_template=TOOLS_TEMPLATE)
    assert response.usage.prompt_tokens == len(ids)
    assert response.choices[0].message.content == greedy_from_ids(client, ids)


def test_return_tokens_as_token_ids(client, tokenizer):
    prompt_ids = tokenizer.encode(PROMPT)
    scored = client.completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=4, temperature=0.0, echo=True,
                                       logprobs=2, extra_body={**IGNORE_EOS, "return_tokens_as_token_ids": True})
    logprobs = scored.choices[0].logprobs
    assert logprobs.tokens[:len(prompt_ids)] == [f"token_id:{token_id}" for token_id in prompt_ids]
    generated = [int(token.split(":")[1]) for token in logprobs.tokens[len(prompt_ids):]]
    assert tokenizer.decode(prompt_ids + generated, skip_special_tokens=True) == scored.choices[0].text
    for token, chosen, top in zip(logprobs.tokens[1:], logprobs.token_logprobs[1:], logprobs.top_logprobs[1:]):
        assert all(key.startswith("token_id:") for key in top) and top[token] == pytest.approx(chosen)
    response = chat(client, logprobs=True, top_logprobs=2, return_tokens_as_token_ids=True)
    content = response.choices[0].logprobs.content
    token_ids = [int(entry.token.split(":")[1]) for entry in content]
    assert tokenizer.decode(token_ids) == response.choices[0].message.content
    assert all(top.token.startswith("token_id:") for entry in content for top in entry.top_logprobs)


def test_completion_top_logprobs_keep_the_chosen_token_when_texts_collide(client, tokenizer):
    # Byte tokens that are each part of a UTF-8 character all decode to U+FFFD. Scoring a prompt
    # made of them with 20 top logprobs a position gives positions where the prompt's (chosen)
    # token and another top token share that text.
    replacement = [token_id for token_id in range(tokenizer.vocab_size) if tokenizer.decode([token_id]) == "\ufffd"]
    prompt_ids = replacement[:40]

    def score(**extra):
        return client.completions.create(model=MODEL_NAME, prompt=prompt_ids, max_tokens=0, echo=True, logprobs=20,
                                         extra_body=extra).choices[0].logprobs

    plain, by_id = score(), score(return_tokens_as_token_ids=True)
    collisions = 0
    for position in range(1, len(prompt_ids)):
        assert by_id.tokens[position] == f"token_id:{prompt_ids[position]}"
        top_ids = [int(key.split(":")[1]) for key in by_id.top_logprobs[position]]
        assert prompt_ids[position] in top_ids  # token ids as keys are unique: nothing is lost
        collisions += sum(tokenizer.decode([other]) == "\ufffd" for other in top_ids if other != prompt_ids[position])
        # Keyed by text, the chosen token's entry is the one kept.
        assert plain.tokens[position] == "\ufffd"
        assert plain.top_logprobs[position]["\ufffd"] == pytest.approx(plain.token_logprobs[position])
        assert plain.token_logprobs[position] == pytest.approx(by_id.token_logprobs[position])
    assert collisions > 0, "no position where two top tokens share a text: the check above proved nothing"


def test_continuous_usage_stats(client):
    options = {"include_usage": True, "continuous_usage_stats": True}
    chunks = list(client.completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=8, temperature=0.0,
                                            stream=True, stream_options=options, extra_body=IGNORE_EOS))
    with_text = [chunk for chunk in chunks if chunk.choices]
    assert with_text and all(chunk.usage is not None for chunk in with_text)
    counts = [chunk.usage.completion_tokens for chunk in with_text]
    assert counts == sorted(counts) and counts[-1] == 8 == chunks[-1].usage.completion_tokens
    assert {chunk.usage.prompt_tokens for chunk in chunks} == {chunks[-1].usage.prompt_tokens}
    chunks = list(client.chat.completions.create(model=MODEL_NAME, messages=MESSAGES, max_completion_tokens=8,
                                                 temperature=0.0, stream=True, stream_options=options,
                                                 extra_body=IGNORE_EOS))
    assert all(chunk.usage is not None for chunk in chunks)
    assert chunks[0].usage.completion_tokens == 0 and chunks[-1].usage.completion_tokens == 8
    counts = [chunk.usage.completion_tokens for chunk in chunks]
    assert counts == sorted(counts)
    # Without continuous_usage_stats only the last chunk carries usage.
    chunks = list(client.chat.completions.create(model=MODEL_NAME, messages=MESSAGES, max_completion_tokens=4,
                                                 stream=True, stream_options={"include_usage": True},
                                                 extra_body=IGNORE_EOS))
    assert [chunk.usage is not None for chunk in chunks] == [False] * (len(chunks) - 1) + [True]


# -- text that is not valid Unicode ---------------------------------------------------------------
SURROGATE = "\ud800"
COMPLETION_SURROGATES = [
    ({"prompt": SURROGATE}, "prompt"),
    ({"prompt": ["fine", "bad " + SURROGATE]}, "prompt"),
    ({"stop": SURROGATE}, "stop"),
    ({"stop": ["ok", "\udc00"]}, "stop"),
    ({"user": SURROGATE}, "user"),
    ({"model": SURROGATE}, "model"),
    ({"logit_bias": {SURROGATE: 1.0}}, "logit_bias"),
    ({SURROGATE: 1}, None),  # a field whose very name is not text: the body is not valid input
]
CHAT_SURROGATES = [
    ({"messages": [{"role": "user", "content": "a" + SURROGATE}]}, "messages[0].content"),
    ({"messages": [{"role": "user", "content": [{"type": "text", "text": SURROGATE}]}]}, "messages[0].content"),
    ({"messages": [{"role": SURROGATE, "content": "hi"}]}, "messages[0].role"),
    ({"messages": [{"role": "user", "content": "hi"}, {"role": "user", "name": SURROGATE, "content": "x"}]},
     "messages[1].name"),
    ({"messages": [{"role": "tool", "tool_call_id": SURROGATE, "content": "x"}]}, "messages[0].tool_call_id"),
    ({"stop": [SURROGATE]}, "stop"),
    ({"chat_template": SURROGATE}, "chat_template"),
    ({"chat_template_kwargs": {"greeting": SURROGATE}}, "chat_template_kwargs"),
    ({"tools": [{"type": "function", "function": {"name": "f", "description": SURROGATE}}], "tool_choice": "none"},
     "tools"),
]


def test_lone_surrogates_are_400_naming_the_field(server, client):
    for path, cases, base in (
        ("/v1/completions", COMPLETION_SURROGATES, {"model": MODEL_NAME, "prompt": PROMPT, "max_tokens": 2}),
        ("/v1/chat/completions", CHAT_SURROGATES, {"model": MODEL_NAME, "messages": MESSAGES, "max_tokens": 2}),
    ):
        for fields, param in cases:
            response = post(server, path, {**base, **fields})
            assert response.status_code == 400, (fields, response.text)
            error = response.json()["error"]  # a JSON body, whatever text the request held
            assert error["param"] == param, (fields, error)
            assert param is None or "surrogate" in error["message"], error
            assert_still_serving(client)


def test_offline_llm_refuses_surrogates_naming_the_prompt(model_dir):
    from sparrow import LLM, SamplingParams

    llm = LLM(model_dir, multiprocess=False, dtype="float32", max_model_len=128, num_kv_blocks=32)
    try:
        with pytest.raises(ValueError, match=r"^prompt of request .*surrogate"):
            llm.generate([SURROGATE], use_tqdm=False)
        with pytest.raises(ValueError, match=r"^prompt of request .*surrogate"):
            llm.generate({"prompt": "fine " + SURROGATE}, use_tqdm=False)
        with pytest.raises(ValueError, match=r"^stop.*surrogate"):
            llm.generate("fine", SamplingParams(stop=["x" + SURROGATE]), use_tqdm=False)
        with pytest.raises(ValueError, match=r"^messages\[0\]\.content.*surrogate"):
            llm.chat([{"role": "user", "content": SURROGATE}], use_tqdm=False)
        params = SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True)
        output = llm.generate("fine", params, use_tqdm=False)[0]
        assert len(output.outputs[0].token_ids) == 3
    finally:
        llm.shutdown()


# -- values the engine refuses: InvalidArgumentError's field becomes the 400's param ------------
COMPLETION_INVALID = [
    ({"max_tokens": 600}, "max_tokens", "max_model_len=512"),  # the input processor's check
    ({"min_tokens": 5, "max_tokens": 2}, "min_tokens", "max_tokens"),  # SamplingParams'
    ({"stop": ["ok", ""]}, "stop", "stop[1]"),  # the field is stop[1]; OpenAI's param is the top level
    ({"logit_bias": {"5": 500}}, "logit_bias", "[-100, 100]"),
    ({"stop_token_ids": [10**6]}, "stop_token_ids", "outside the vocabulary"),
    ({"truncate_prompt_tokens": 10**6}, "truncate_prompt_tokens", "max_model_len"),
    ({"prompt": [3, 10**6]}, "prompt", "outside the vocabulary"),
]


def test_values_the_engine_refuses_are_400_naming_the_field(server, client):
    for body, param, phrase in COMPLETION_INVALID:
        body = {"prompt": PROMPT, "max_tokens": 2, **body}
        error = assert_400(lambda: client.completions.create(model=MODEL_NAME, prompt=body.pop("prompt"),
                                                             max_tokens=body.pop("max_tokens"), extra_body=body),
                           param, phrase)
        assert error["code"] == "invalid_value", error
        assert_still_serving(client)
    # The chat endpoint: a message's field, and a sampling one.
    assert_400(lambda: chat(client, [{"role": "user", "content": "hi"}], min_tokens=9), "min_tokens", "min_tokens")
    assert_400(lambda: client.chat.completions.create(model=MODEL_NAME, messages=MESSAGES, max_completion_tokens=600),
               "max_tokens", "max_model_len")


# -- return_token_ids (vLLM's) ------------------------------------------------------------------
@pytest.fixture(scope="module")
def hf_greedy(model_dir):
    """The reference: HF transformers' greedy ``generate`` on the same directory (float32), EOS
    suppressed as ``ignore_eos`` does: prompt ids -> the ``max_tokens`` generated ids."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()

    def generate(prompt_ids: list[int], max_tokens: int = 6) -> list[int]:
        with torch.inference_mode():
            out = model.generate(torch.tensor([prompt_ids]), max_new_tokens=max_tokens, min_new_tokens=max_tokens,
                                 do_sample=False, pad_token_id=0)
        return out[0, len(prompt_ids):].tolist()

    return generate


TOKEN_IDS = {**IGNORE_EOS, "return_token_ids": True}


def test_return_token_ids_on_completions(server, client, tokenizer, hf_greedy):
    prompts = [PROMPT, "Hello there"]
    whole = client.completions.create(model=MODEL_NAME, prompt=prompts, n=2, **GREEDY, extra_body=TOKEN_IDS)
    assert [choice.index for choice in whole.choices] == [0, 1, 2, 3]
    for choice in whole.choices:  # each choice has its own prompt's ids (with the BOS the tokenizer adds)
        prompt_ids = tokenizer.encode(prompts[choice.index // 2])
        assert choice.prompt_token_ids == prompt_ids
        assert choice.token_ids == hf_greedy(prompt_ids)
        assert tokenizer.decode(choice.token_ids) == choice.text
    # Streamed: the prompt's ids in the choice's first chunk only, each chunk's new tokens after.
    chunks = [choice for chunk in client.completions.create(model=MODEL_NAME, prompt=PROMPT, stream=True, **GREEDY,
                                                             extra_body=TOKEN_IDS) for choice in chunk.choices]
    assert chunks[0].prompt_token_ids == whole.choices[0].prompt_token_ids
    assert all(getattr(choice, "prompt_token_ids", None) is None for choice in chunks[1:])
    assert [token for choice in chunks for token in choice.token_ids] == whole.choices[0].token_ids
    # n=2 samples: each choice its own tokens.
    sampled = client.completions.create(model=MODEL_NAME, prompt=PROMPT, n=2, max_tokens=8, temperature=1.0, seed=3,
                                        extra_body=TOKEN_IDS)
    assert [tokenizer.decode(choice.token_ids) for choice in sampled.choices] == [c.text for c in sampled.choices]
    assert sampled.choices[0].token_ids != sampled.choices[1].token_ids
    assert sum(len(choice.token_ids) for choice in sampled.choices) == sampled.usage.completion_tokens
    # A stop string ends the text before it; token_ids are the engine's: up to the token that completed it.
    text, ids = whole.choices[0].text, whole.choices[0].token_ids
    stop = text[3:6]
    stopped = client.completions.create(model=MODEL_NAME, prompt=PROMPT, **GREEDY, stop=[stop], extra_body=TOKEN_IDS)
    choice = stopped.choices[0]
    assert choice.text == text[:text.index(stop)] and choice.finish_reason == "stop"
    assert choice.token_ids == ids[:len(choice.token_ids)]
    assert stop in tokenizer.decode(choice.token_ids) and stop not in tokenizer.decode(choice.token_ids[:-1])
    # echo: the prompt is in the text, and in prompt_token_ids; token_ids stay the generated ones.
    echoed = client.completions.create(model=MODEL_NAME, prompt=PROMPT, echo=True, **GREEDY, extra_body=TOKEN_IDS)
    assert echoed.choices[0].token_ids == ids and echoed.choices[0].prompt_token_ids == tokenizer.encode(PROMPT)
    # Not asked for: OpenAI's shape, no such keys.
    plain = post(server, "/v1/completions", {"model": MODEL_NAME, "prompt": PROMPT, "max_tokens": 2}).json()
    assert not {"token_ids", "prompt_token_ids"} & set(plain["choices"][0])
    assert_400(lambda: client.completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=2,
                                                 extra_body={"return_token_ids": "yes"}), "return_token_ids")


def test_return_token_ids_on_chat(server, client, tokenizer, hf_greedy):
    prompt_ids = tokenizer.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=True, return_dict=False)
    whole = chat(client, return_token_ids=True)
    assert whole.prompt_token_ids == prompt_ids
    assert whole.choices[0].token_ids == hf_greedy(prompt_ids)
    assert tokenizer.decode(whole.choices[0].token_ids) == whole.choices[0].message.content
    chunks = list(client.chat.completions.create(model=MODEL_NAME, messages=MESSAGES, **GREEDY, stream=True,
                                                 extra_body=TOKEN_IDS))
    assert chunks[0].prompt_token_ids == prompt_ids
    assert all(getattr(chunk, "prompt_token_ids", None) is None for chunk in chunks[1:])
    # The role chunk carries no tokens (nor the key), as in vLLM.
    assert all(getattr(choice, "token_ids", None) is None for choice in chunks[0].choices)
    streamed = [token for chunk in chunks[1:] for choice in chunk.choices for token in choice.token_ids]
    assert streamed == whole.choices[0].token_ids
    sampled = chat(client, n=2, temperature=1.0, seed=3, return_token_ids=True)
    assert [tokenizer.decode(c.token_ids) for c in sampled.choices] == [c.message.content for c in sampled.choices]
    plain = post(server, "/v1/chat/completions", {"model": MODEL_NAME, "messages": MESSAGES, "max_tokens": 2}).json()
    assert "prompt_token_ids" not in plain and "token_ids" not in plain["choices"][0]
