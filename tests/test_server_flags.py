"""`sparrow serve --chat-template / --response-role / --enable-log-requests / --max-log-len /
--root-path / --stream-interval / --default-chat-template-kwargs / --exclude-tools-when-tool-choice-none
/ --log-error-stack / --h11-*`: one real server on 127.0.0.1 with all of them, the real `openai` client, and
references computed independently (jinja2 renders the template, the Hugging Face tokenizer
tokenizes it). Wrong values are refused at start-up: subprocesses that never load the model."""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys

import httpx
import jinja2
import openai
import pytest

from tests.test_server import API_KEY, MODEL_NAME, Server, serve_for_module, wait_until

# Writes a marker before each turn: nothing like the tokenizer's own template.
TEMPLATE = ("{% for m in messages %}{% if m['role'] == 'user' %}<<USER>>{% else %}<<{{ m['role'] | upper }}>>"
            "{% endif %}{{ m['content'] }}|{% endfor %}{% if add_generation_prompt %}<<BOT>>{% endif %}")
MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Name a small bird."}]
MAX_LOG_LEN = 20
ROOT_PATH = "/proxy"
STREAM_INTERVAL = 3
TEMPLATE_DEFAULTS = {"house_style": "Answer in rhyme.", "mood": "calm"}
MAX_HEADER_COUNT = 40
MAX_HEAD_BYTES = 8192


class FlagsServer(Server):
    def _engine_pid(self) -> None:
        return None  # never signalled here


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> str:
    from sparrow.tiny.model import build_model_dir

    return str(build_model_dir(tmp_path_factory.mktemp("flags-model"), "qwen3", "test", seed=5))


@pytest.fixture(scope="module")
def template_file(tmp_path_factory) -> str:
    path = tmp_path_factory.mktemp("template") / "chat.jinja"
    path.write_text(TEMPLATE)
    return str(path)


@pytest.fixture(scope="module")
def server(model_dir, template_file, tmp_path_factory):
    yield from serve_for_module(model_dir, tmp_path_factory, "flags-logs", "--chat-template", template_file,
                                "--response-role", "bot", "--enable-log-requests", "--enable-log-outputs",
                                "--return-tokens-as-token-ids", "--enable-prompt-tokens-details",
                                "--max-log-len", str(MAX_LOG_LEN),
                                "--root-path", ROOT_PATH, "--enable-sleep-mode", "--trust-request-chat-template",
                                "--stream-interval", str(STREAM_INTERVAL),
                                "--default-chat-template-kwargs", json.dumps(TEMPLATE_DEFAULTS),
                                "--exclude-tools-when-tool-choice-none", "--log-error-stack",
                                "--h11-max-header-count", str(MAX_HEADER_COUNT),
                                "--h11-max-incomplete-event-size", str(MAX_HEAD_BYTES), "--api-server-count", "1",
                                server_cls=FlagsServer,
                                env={"SPARROW_SERVER_DEV_MODE": "1"})


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return server.client()


@pytest.fixture(scope="module")
def http(server):
    with httpx.Client(base_url=server.url, headers={"Authorization": f"Bearer {API_KEY}"}, timeout=60) as client:
        yield client


@pytest.fixture(scope="module")
def hf_tokenizer(model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_dir)


def render(template: str, messages=MESSAGES, add_generation_prompt: bool = True) -> str:
    return jinja2.Environment().from_string(template).render(messages=messages,
                                                             add_generation_prompt=add_generation_prompt)


def chat(client: openai.OpenAI, messages=MESSAGES, **extra):
    return client.chat.completions.create(model=MODEL_NAME, messages=messages, temperature=0.0,
                                          max_completion_tokens=3, extra_body={"ignore_eos": True, **extra})


# -- --chat-template ------------------------------------------------------------------------------
def test_chat_template_file_renders_the_prompt(server, client, http, hf_tokenizer, template_file):
    text = render(TEMPLATE)
    assert text.startswith("<<SYSTEM>>Be brief.|<<USER>>Name a small bird.|<<BOT>>")
    expected = hf_tokenizer.encode(text, add_special_tokens=False)
    tokenized = http.post("/tokenize", json={"model": MODEL_NAME, "messages": MESSAGES})
    assert tokenized.status_code == 200, tokenized.text
    assert tokenized.json()["tokens"] == expected
    reply = chat(client)
    assert reply.usage.prompt_tokens == len(expected)
    # Without a generation prompt: the template's other branch.
    continued = http.post("/tokenize", json={"model": MODEL_NAME, "messages": MESSAGES,
                                             "add_generation_prompt": False}).json()
    assert continued["tokens"] == hf_tokenizer.encode(render(TEMPLATE, add_generation_prompt=False),
                                                      add_special_tokens=False)
    # /tokenizer_info reports the template in use, as vLLM's does.
    assert http.get("/tokenizer_info").json()["chat_template"] == open(template_file).read()


def test_a_requests_own_chat_template_wins(client, http, hf_tokenizer):
    own = "{% for m in messages %}[{{ m['content'] }}]{% endfor %}"
    expected = hf_tokenizer.encode(render(own), add_special_tokens=False)
    tokenized = http.post("/tokenize", json={"model": MODEL_NAME, "messages": MESSAGES, "chat_template": own})
    assert tokenized.json()["tokens"] == expected
    assert chat(client, chat_template=own).usage.prompt_tokens == len(expected)


def test_content_parts_reach_the_template_as_it_reads_them(http, hf_tokenizer):
    """--chat-template-content-format auto (the default): a list of text parts is joined for a
    template that prints the content, and kept as parts for one that loops over it."""
    parts = [{"type": "text", "text": "Name a"}, {"type": "text", "text": "small bird."}]
    messages = [{"role": "user", "content": parts}]
    joined = http.post("/tokenize", json={"model": MODEL_NAME, "messages": messages}).json()["tokens"]
    assert joined == hf_tokenizer.encode(render(TEMPLATE, [{"role": "user", "content": "Name a\nsmall bird."}]),
                                         add_special_tokens=False)
    looping = "{% for m in messages %}{% for part in m['content'] %}<{{ part['text'] }}>{% endfor %}{% endfor %}"
    tokenized = http.post("/tokenize", json={"model": MODEL_NAME, "messages": messages, "chat_template": looping})
    assert tokenized.json()["tokens"] == hf_tokenizer.encode(render(looping, messages), add_special_tokens=False)
    # A string reaches that template as one part.
    single = http.post("/tokenize", json={"model": MODEL_NAME, "messages": [{"role": "user", "content": "Hi"}],
                                          "chat_template": looping}).json()["tokens"]
    assert single == hf_tokenizer.encode("<Hi>", add_special_tokens=False)


def test_chat_template_content_format_flag():
    from sparrow.entrypoints.cli import build_parser

    parser = build_parser()
    assert parser.parse_args(["serve"]).chat_template_content_format == "auto"
    assert parser.parse_args(["serve", "--chat-template-content-format", "openai"]).chat_template_content_format \
        == "openai"


def test_chat_template_flag_inline_or_file(template_file):
    from sparrow.entrypoints.cli import build_parser

    parser = build_parser()
    inline = "{% for m in messages %}{{ m['content'] }}{% endfor %}"
    assert parser.parse_args(["serve", "--chat-template", inline]).chat_template == inline
    assert parser.parse_args(["serve", "--chat-template", template_file]).chat_template == TEMPLATE
    args = parser.parse_args(["serve"])
    assert args.chat_template is None and args.response_role == "assistant" and args.root_path == ""
    assert not args.enable_log_requests and args.max_log_len is None


# -- --response-role ------------------------------------------------------------------------------
def test_response_role(client):
    assert chat(client).choices[0].message.role == "bot"
    stream = client.chat.completions.create(model=MODEL_NAME, messages=MESSAGES, max_completion_tokens=2,
                                            stream=True, extra_body={"ignore_eos": True})
    first = next(iter(stream))
    assert first.choices[0].delta.role == "bot"
    stream.close()
    # Continuing a conversation without a new turn keeps the last message's role (vLLM's rule).
    assert chat(client, add_generation_prompt=False).choices[0].message.role == "user"


# -- --enable-log-requests / --max-log-len -----------------------------------------------------------
def test_requests_are_logged_cut_to_max_log_len(server, client, hf_tokenizer):
    reply = chat(client)
    text = render(TEMPLATE)
    ids = hf_tokenizer.encode(text, add_special_tokens=False)
    lines = [line for line in server.log().splitlines() if f"Received request {reply.id}:" in line]
    assert len(lines) == 1, server.log()
    line = lines[0]
    assert line.startswith("INFO sparrow.entrypoints.openai.request_logger:")
    assert f"prompt: {text[:MAX_LOG_LEN]!r}," in line
    assert f"prompt_token_ids: {ids[:MAX_LOG_LEN]}," in line
    assert "max_tokens=3" in line and "lora_request: None" in line


def generated_lines(server, request_id: str) -> dict[int, str]:
    """The --enable-log-outputs lines of one request (its choices), by choice index."""
    found = {}
    for line in server.log().splitlines():
        match = re.search(rf"Generated response {re.escape(request_id)}(?:-\d+)? \(choice (\d+)\): (.*)$", line)
        if match:
            found[int(match.group(1))] = match.group(2)
    return found


def test_outputs_are_logged_whole_when_they_finish(server, client, http):
    # Full response, two choices: each choice's text (cut to --max-log-len) and finish reason.
    reply = client.completions.create(model=MODEL_NAME, prompt="once upon a time", n=2, max_tokens=12,
                                      temperature=1.0, seed=3)
    lines = wait_until(lambda: generated_lines(server, reply.id) if len(generated_lines(server, reply.id)) == 2
                       else None, what="two output lines")
    for choice in reply.choices:
        line = lines[choice.index]
        assert line.startswith(f"output: {choice.text[:MAX_LOG_LEN]!r}, output_token_ids: ["), line
        assert line.endswith(f"finish_reason: {choice.finish_reason}."), line
        ids = json.loads(line.split("output_token_ids: ", 1)[1].split("]", 1)[0] + "]")
        assert 0 < len(ids) <= MAX_LOG_LEN
    # Streamed: the deltas put together, as the whole reply would be.
    text, request_id = "", None
    for chunk in client.completions.create(model=MODEL_NAME, prompt="the quick brown fox", max_tokens=12,
                                           temperature=0, stream=True):
        request_id = chunk.id
        text += chunk.choices[0].text if chunk.choices else ""
    assert request_id is not None
    line = wait_until(lambda: generated_lines(server, request_id).get(0), what="the streamed request's line")
    assert line.startswith(f"output: {text[:MAX_LOG_LEN]!r}, "), (line, text)


def test_request_logging_is_off_by_default():
    from sparrow.entrypoints.openai.request_logger import request_logger_from_args

    assert request_logger_from_args(argparse.Namespace(enable_log_requests=False, max_log_len=5)) is None
    assert request_logger_from_args(None) is None


# -- --root-path -----------------------------------------------------------------------------------
def test_root_path(server, client, http):
    assert [model.id for model in client.models.list()] == [MODEL_NAME]  # the usual paths still serve
    schema = http.get("/openapi.json").json()
    assert schema["servers"][0]["url"] == ROOT_PATH
    assert f"{ROOT_PATH}/openapi.json" in http.get("/docs").text
    # The API key is still required behind the root path.
    assert httpx.get(server.url + "/v1/models").status_code == 401
    assert httpx.post(server.url + "/tokenize", json={"prompt": "hi"}).status_code == 401


# -- wrong values: exit 2 before the model loads --------------------------------------------------------
@pytest.mark.parametrize(("flag", "value", "phrase"), [
    ("--chat-template", "/nonexistent/chat.jinja", "no such file"),
    ("--chat-template", "{% for m in messages %}{{ m.content }}", "not a valid Jinja template"),
    ("--root-path", "proxy", "must start with '/'"),
    ("--max-log-len", "-1", ">= 0"),
    ("--response-role", "", "must not be empty"),
])
def test_wrong_values_fail_at_start_up(flag, value, phrase):
    # A model directory that does not exist: the flag is refused before anything would load it.
    result = subprocess.run([sys.executable, "-m", "sparrow.entrypoints.cli", "serve", "/nonexistent-model",
                             flag, value], capture_output=True, text=True, timeout=60)
    assert result.returncode == 2, result.stderr
    last = result.stderr.strip().splitlines()[-1]
    assert last.startswith(f"sparrow: error: argument {flag}:") and phrase in last, result.stderr


@pytest.mark.parametrize("flags", [["--enable-log-outputs"], ["--max-log-len", "10"]])
def test_log_flags_without_enable_log_requests_are_refused(flags):
    result = subprocess.run([sys.executable, "-m", "sparrow.entrypoints.cli", "serve", "/nonexistent-model", *flags],
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 2, result.stderr
    assert result.stderr.strip().splitlines()[-1] == f"sparrow: error: {flags[0]} needs --enable-log-requests"


def test_return_tokens_as_token_ids_for_every_request(server, client, hf_tokenizer):
    # --return-tokens-as-token-ids: a request that does not ask still gets 'token_id:N' labels,
    # and N is the sampled token (checked against the tokenizer's decoding of the text).
    reply = client.completions.create(model=MODEL_NAME, prompt="the quick brown fox", max_tokens=4, temperature=0,
                                      logprobs=2)
    logprobs = reply.choices[0].logprobs
    ids = [int(token.removeprefix("token_id:")) for token in logprobs.tokens]
    assert all(token.startswith("token_id:") for token in logprobs.tokens)
    assert hf_tokenizer.decode(ids) == reply.choices[0].text
    assert all(key.startswith("token_id:") for top in logprobs.top_logprobs for key in top)
    chat_reply = client.chat.completions.create(model=MODEL_NAME, messages=[{"role": "user", "content": "hi"}],
                                                max_tokens=3, logprobs=True, top_logprobs=1)
    assert all(entry.token.startswith("token_id:") for entry in chat_reply.choices[0].logprobs.content)


def test_vllms_access_log_flag_is_the_same_switch():
    # The test servers all run with --disable-access-log; vLLM's name must set the same switch.
    from sparrow.entrypoints.cli import build_parser

    parser = build_parser()
    assert parser.parse_args(["serve", "m", "--disable-uvicorn-access-log"]).disable_access_log is True
    assert parser.parse_args(["serve", "m"]).disable_access_log is False


def test_prompt_tokens_details_count_the_prefix_cache_hits(client):
    # --enable-prompt-tokens-details: usage.prompt_tokens_details.cached_tokens, whole and streamed,
    # on both endpoints. A prompt no earlier test sent: nothing cached the first time; the same
    # prompt again finds its whole blocks (16 tokens each) in the prefix cache.
    prompt = " ".join(f"word{index}" for index in range(40))
    first = client.completions.create(model=MODEL_NAME, prompt=prompt, max_tokens=2, temperature=0)
    again = client.completions.create(model=MODEL_NAME, prompt=prompt, max_tokens=2, temperature=0)
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    cached = again.usage.prompt_tokens_details.cached_tokens
    assert 16 <= cached < again.usage.prompt_tokens and cached % 16 == 0, again.usage
    chunks = list(client.completions.create(model=MODEL_NAME, prompt=prompt, max_tokens=2, temperature=0,
                                            stream=True, stream_options={"include_usage": True}))
    assert chunks[-1].usage.prompt_tokens_details.cached_tokens == cached
    messages = [{"role": "user", "content": prompt}]
    client.chat.completions.create(model=MODEL_NAME, messages=messages, max_tokens=2)
    chat = client.chat.completions.create(model=MODEL_NAME, messages=messages, max_tokens=2)
    assert chat.usage.prompt_tokens_details.cached_tokens >= 16
    streamed = list(client.chat.completions.create(model=MODEL_NAME, messages=messages, max_tokens=2, stream=True,
                                                   stream_options={"include_usage": True}))
    assert streamed[-1].usage.prompt_tokens_details.cached_tokens == chat.usage.prompt_tokens_details.cached_tokens


def test_cache_salt_keeps_requests_out_of_each_others_prefix_cache(client, http):
    """vLLM's cache_salt: a request shares cached blocks only with requests of the same salt, on
    both endpoints; the tokens are the same either way. An empty salt is a 400 naming it."""
    prompt = " ".join(f"salted{index}" for index in range(40))

    def cached(salt, chat=False):
        extra = {"cache_salt": salt} if salt is not None else {}
        if chat:
            reply = client.chat.completions.create(model=MODEL_NAME, messages=[{"role": "user", "content": prompt}],
                                                   max_tokens=4, temperature=0, extra_body=extra)
            return reply.usage.prompt_tokens_details.cached_tokens, reply.choices[0].message.content
        reply = client.completions.create(model=MODEL_NAME, prompt=prompt, max_tokens=4, temperature=0,
                                          extra_body=extra)
        return reply.usage.prompt_tokens_details.cached_tokens, reply.choices[0].text

    unsalted, text = cached(None)
    assert unsalted == 0
    first_a, text_a = cached("tenant-a")
    assert first_a == 0 and text_a == text  # no hit on the unsalted blocks, the same tokens
    again_a, _ = cached("tenant-a")
    assert again_a >= 16  # the same salt shares
    assert cached("tenant-b")[0] == 0 and cached(None)[0] >= 16  # another salt does not; no salt finds its own
    cached("tenant-a", chat=True)
    assert cached("tenant-a", chat=True)[0] >= 16 and cached("tenant-c", chat=True)[0] == 0
    for path, body in (("/v1/completions", {"prompt": prompt}),
                       ("/v1/chat/completions", {"messages": [{"role": "user", "content": prompt}]})):
        response = http.post(path, json={"model": MODEL_NAME, "max_tokens": 2, "cache_salt": "", **body})
        assert response.status_code == 400 and response.json()["error"]["param"] == "cache_salt", response.text
    # Beam search keys every beam's request with the salt: a request of that salt finds its blocks.
    beams = client.completions.create(model=MODEL_NAME, prompt=prompt, max_tokens=2, n=2,
                                      extra_body={"use_beam_search": True, "cache_salt": "tenant-d"})
    assert len(beams.choices) == 2
    assert cached("tenant-d")[0] >= 16 and cached("tenant-e")[0] == 0


def test_disable_log_requests_is_the_default_and_contradicts_enable():
    """vLLM's older --disable-log-requests asks for what is already the default (no request log);
    beside --enable-log-requests it is refused rather than one of them silently winning."""
    from sparrow.entrypoints.cli import build_parser

    assert build_parser().parse_args(["serve", "--disable-log-requests"]).disable_log_requests is True
    result = subprocess.run([sys.executable, "-m", "sparrow.entrypoints.cli", "serve", "/nonexistent-model",
                             "--disable-log-requests", "--enable-log-requests"], capture_output=True, text=True,
                            timeout=60)
    assert result.returncode == 2, result.stderr
    assert result.stderr.strip().splitlines()[-1] == ("sparrow: error: --disable-log-requests and "
                                                      "--enable-log-requests contradict each other; give one")


def test_dev_mode_endpoints_sleep_wake_up_and_call_the_workers(server, client, http):
    """vLLM's development endpoints (SPARROW_SERVER_DEV_MODE=1), as an RLHF trainer drives a
    colocated server: sleep, refused requests while asleep, wake up, collective_rpc by name."""
    def complete():
        return client.completions.create(model=MODEL_NAME, prompt="hello there", max_tokens=4, temperature=0)

    before = complete().choices[0].text
    assert http.get("/is_sleeping").json() == {"is_sleeping": False}
    assert http.post("/sleep", params={"level": 1}).status_code == 200
    assert http.get("/is_sleeping").json() == {"is_sleeping": True}
    with pytest.raises(openai.BadRequestError, match="asleep"):
        complete()
    assert http.post("/wake_up", params={"tags": "weights"}).status_code == 200
    assert http.get("/is_sleeping").json() == {"is_sleeping": True}  # the KV cache still sleeps
    assert http.post("/wake_up").status_code == 200
    assert complete().choices[0].text == before
    assert http.post("/collective_rpc", json={"method": "is_sleeping"}).json() == {"results": [False]}
    assert http.post("/reset_prefix_cache").status_code == 200
    for method, path, kwargs, param in [("post", "/sleep", {"params": {"level": 3}}, "level"),
                                        ("post", "/wake_up", {"params": {"tags": "activations"}}, "tags"),
                                        ("post", "/collective_rpc", {"json": {"method": "no_such_method"}}, "method")]:
        response = getattr(http, method)(path, **kwargs)
        assert response.status_code == 400, response.text
        assert response.json()["error"]["param"] == param
    assert complete().choices[0].text == before


def test_dev_mode_pause_and_resume(client, http):
    """vLLM's /pause, /resume and /is_paused: a request sent while paused waits for /resume (the
    semantics of each mode are tests/test_pause_generation.py's)."""
    import concurrent.futures

    def complete():
        return client.completions.create(model=MODEL_NAME, prompt="hello there", max_tokens=4, temperature=0)

    before = complete().choices[0].text
    assert http.get("/is_paused").json() == {"is_paused": False}
    assert http.post("/pause", params={"mode": "keep", "clear_cache": "false"}).status_code == 200
    assert http.get("/is_paused").json() == {"is_paused": True}
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        waiting = pool.submit(complete)
        with pytest.raises(concurrent.futures.TimeoutError):
            waiting.result(timeout=0.5)  # held while paused
        assert http.post("/resume").status_code == 200
        assert waiting.result(timeout=60).choices[0].text == before
    assert http.get("/is_paused").json() == {"is_paused": False}
    bad = http.post("/pause", params={"mode": "drain"})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "mode", bad.text
    assert http.get("/is_paused").json() == {"is_paused": False}


# -- --stream-interval ------------------------------------------------------------------------------
def test_streamed_chunks_carry_the_stream_interval(client):
    # With --return-tokens-as-token-ids on, each chunk's logprob tokens are its token ids.
    whole = client.completions.create(model=MODEL_NAME, prompt="the quick brown fox", max_tokens=11, temperature=0,
                                      logprobs=0, extra_body={"ignore_eos": True})
    chunks = [chunk.choices[0] for chunk in client.completions.create(
        model=MODEL_NAME, prompt="the quick brown fox", max_tokens=11, temperature=0, logprobs=0, stream=True,
        extra_body={"ignore_eos": True}) if chunk.choices and chunk.choices[0].logprobs]
    sizes = [len(choice.logprobs.tokens) for choice in chunks]
    # The first token at once, then at least STREAM_INTERVAL per chunk, the rest in the last one. (The
    # server may merge outputs it has not sent yet, so a chunk can be larger, never smaller; the
    # exact chunking is tests/test_stream_interval.py's.)
    assert all(size >= STREAM_INTERVAL for size in sizes[1:-1]) and sum(sizes) == 11, sizes
    assert len(sizes) <= 2 + 10 // STREAM_INTERVAL, sizes
    assert [t for choice in chunks for t in choice.logprobs.tokens] == whole.choices[0].logprobs.tokens
    assert "".join(choice.text for choice in chunks) == whole.choices[0].text


# -- --default-chat-template-kwargs / --exclude-tools-when-tool-choice-none ------------------------------
STYLE_TEMPLATE = ("[{{ house_style }}|{{ mood | default('-') }}]{% if tools %}<tools "
                  "{{ tools | map(attribute='function') | map(attribute='name') | join(',') }}>{% endif %}"
                  "{% for m in messages %}{{ m['content'] }}|{% endfor %}")
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather in a city",
                                           "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                                                          "required": ["city"]}}}]


def styled(hf_tokenizer, tools=None, **variables) -> list[int]:
    text = jinja2.Environment().from_string(STYLE_TEMPLATE).render(messages=MESSAGES, tools=tools, **variables)
    return hf_tokenizer.encode(text, add_special_tokens=False)


def test_default_chat_template_kwargs_sit_under_the_requests_own(client, http, hf_tokenizer):
    tokenized = http.post("/tokenize", json={"model": MODEL_NAME, "messages": MESSAGES,
                                             "chat_template": STYLE_TEMPLATE}).json()
    assert tokenized["tokens"] == styled(hf_tokenizer, **TEMPLATE_DEFAULTS)
    assert chat(client, chat_template=STYLE_TEMPLATE).usage.prompt_tokens == len(tokenized["tokens"])
    # A request's own chat_template_kwargs win key by key; the other defaults stay.
    own = {"house_style": "Be terse, very terse indeed."}
    expected = styled(hf_tokenizer, **{**TEMPLATE_DEFAULTS, **own})
    assert http.post("/tokenize", json={"model": MODEL_NAME, "messages": MESSAGES, "chat_template": STYLE_TEMPLATE,
                                        "chat_template_kwargs": own}).json()["tokens"] == expected
    assert chat(client, chat_template=STYLE_TEMPLATE, chat_template_kwargs=own).usage.prompt_tokens == len(expected)


def test_tool_choice_none_renders_without_the_tools(client, http, hf_tokenizer):
    with_tools = styled(hf_tokenizer, tools=TOOLS, **TEMPLATE_DEFAULTS)
    without = styled(hf_tokenizer, **TEMPLATE_DEFAULTS)
    assert len(with_tools) > len(without)
    # /tokenize has no tool_choice: the tools are rendered.
    assert http.post("/tokenize", json={"model": MODEL_NAME, "messages": MESSAGES, "chat_template": STYLE_TEMPLATE,
                                        "tools": TOOLS}).json()["tokens"] == with_tools
    reply = client.chat.completions.create(model=MODEL_NAME, messages=MESSAGES, tools=TOOLS, tool_choice="none",
                                           max_completion_tokens=2, extra_body={"chat_template": STYLE_TEMPLATE})
    assert reply.usage.prompt_tokens == len(without)
    assert reply.choices[0].message.tool_calls in (None, [])


def test_reserved_default_template_kwargs_are_refused(hf_tokenizer):
    from types import SimpleNamespace

    from sparrow.entrypoints.openai.serving_chat import check_default_template_kwargs

    engine = SimpleNamespace(tokenizer=hf_tokenizer)
    assert check_default_template_kwargs(engine, {"enable_thinking": False}) == {"enable_thinking": False}
    with pytest.raises(ValueError, match="--default-chat-template-kwargs: 'tokenize' cannot be set there"):
        check_default_template_kwargs(engine, {"tokenize": True})
    with pytest.raises(ValueError, match="--default-chat-template-kwargs: this server has no tokenizer"):
        check_default_template_kwargs(SimpleNamespace(tokenizer=None), {"mood": "x"})


# -- --log-error-stack -----------------------------------------------------------------------------------
def test_error_responses_log_their_stack(server, client):
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model=MODEL_NAME, prompt="hi", max_tokens=2, logit_bias={"999999": 1})
    record = wait_until(lambda: next((part for part in server.log().split("ERROR sparrow.entrypoints.openai."
                                                                          "error_handlers:")[1:]
                                      if "logit_bias: token id 999999" in part.splitlines()[0]), None),
                        what="the error's stack in the log")
    assert record.splitlines()[0].lstrip().startswith("error response 400:"), record
    # The check that failed (the input processor's, hidden from the client by `from None`) and
    # the answer made from it.
    assert "Traceback (most recent call last)" in record and "input_processor.py" in record, record
    assert "InvalidArgumentError" in record and "which was answered as:" in record and "APIError" in record, record
    # A pydantic refusal is logged too.
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model=MODEL_NAME, prompt="hi", max_tokens=2, temperature=-1.0)
    wait_until(lambda: "RequestValidationError" in server.log(), what="the validation error's stack")


# -- --h11-max-header-count / --h11-max-incomplete-event-size ---------------------------------------------
def test_too_many_header_fields_are_a_431(server):
    extra = {f"x-extra-{i}": "1" for i in range(MAX_HEADER_COUNT)}
    answer = httpx.get(server.url + "/v1/models", headers={"Authorization": f"Bearer {API_KEY}", **extra})
    assert answer.status_code == 431, answer.text
    assert answer.json()["error"]["code"] == "too_many_headers"
    assert f"limit of {MAX_HEADER_COUNT}" in answer.json()["error"]["message"]
    few = dict(list(extra.items())[:MAX_HEADER_COUNT // 2])
    assert httpx.get(server.url + "/v1/models", headers={"Authorization": f"Bearer {API_KEY}", **few}).status_code \
        == 200


def test_a_request_head_over_the_h11_limit_is_refused(server):
    """h11 holds at most --h11-max-incomplete-event-size bytes of a head it has not seen the end of:
    a head still arriving past that is answered 400 and the connection closed."""
    import socket
    from urllib.parse import urlsplit

    address = urlsplit(server.url)

    def send_head(header_bytes: int, finish: bool) -> bytes:
        with socket.create_connection((address.hostname, address.port), timeout=30) as sock:
            sock.sendall(b"GET /health HTTP/1.1\r\nHost: test\r\nX-Big: " + b"a" * header_bytes)
            if finish:
                sock.sendall(b"\r\nConnection: close\r\n\r\n")
            answer = b""
            while chunk := sock.recv(65536):
                answer += chunk
            return answer

    assert send_head(MAX_HEAD_BYTES + 1000, finish=False).startswith(b"HTTP/1.1 400 ")
    assert send_head(MAX_HEAD_BYTES // 2, finish=True).startswith(b"HTTP/1.1 200 ")


def test_api_server_count_takes_one():
    from sparrow.entrypoints.cli import build_parser

    assert build_parser().parse_args(["serve", "m", "--api-server-count", "1"]).api_server_count == 1
    result = subprocess.run([sys.executable, "-m", "sparrow.entrypoints.cli", "serve", "/nonexistent-model",
                             "--api-server-count", "2"], capture_output=True, text=True, timeout=60)
    assert result.returncode == 2 and "sparrow serve runs one API server process" in result.stderr, result.stderr


# -- repetition_detection (a request field, vLLM's) ---------------------------------------------------------
def test_repetition_detection_ends_a_looping_reply(client, http):
    # logit_bias forces one token, so the reply loops at once: it ends after min_count tokens.
    reply = client.completions.create(model=MODEL_NAME, prompt="the quick brown fox", max_tokens=40, temperature=0,
                                      logit_bias={"7": 100}, logprobs=0,
                                      extra_body={"ignore_eos": True,
                                                  "repetition_detection": {"max_pattern_size": 2, "min_count": 5}})
    assert reply.choices[0].finish_reason == "repetition"
    assert reply.choices[0].logprobs.tokens == ["token_id:7"] * 5 and reply.usage.completion_tokens == 5
    chat_reply = client.chat.completions.create(
        model=MODEL_NAME, messages=MESSAGES, max_completion_tokens=40, logit_bias={"7": 100},
        extra_body={"ignore_eos": True, "repetition_detection": {"max_pattern_size": 1, "min_count": 3}})
    assert chat_reply.choices[0].finish_reason == "repetition" and chat_reply.usage.completion_tokens == 3
    bad = http.post("/v1/completions", json={"model": MODEL_NAME, "prompt": "hi", "max_tokens": 4,
                                             "repetition_detection": {"max_pattern_size": 3, "min_count": 1}})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "repetition_detection", bad.text
    assert "repetition_detection.min_count must be >= 2" in bad.json()["error"]["message"]


# -- request_id and X-Request-Id; documents (vLLM's request fields) ----------------------------------------
def test_request_ids_come_from_the_header_or_the_field(client, http):
    reply = client.completions.create(model=MODEL_NAME, prompt="hi", max_tokens=2,
                                      extra_body={"request_id": "trace-42"})
    assert reply.id == "cmpl-trace-42"
    # The X-Request-Id header wins over the field (vLLM's order), streamed too.
    chunks = list(client.chat.completions.create(model=MODEL_NAME, messages=MESSAGES, max_completion_tokens=2,
                                                 stream=True, extra_body={"request_id": "field-1"},
                                                 extra_headers={"X-Request-Id": "hdr-9"}))
    assert {chunk.id for chunk in chunks} == {"chatcmpl-hdr-9"}
    assert client.chat.completions.create(model=MODEL_NAME, messages=MESSAGES,
                                          max_completion_tokens=2).id.startswith("chatcmpl-")
    for headers, body in [({"X-Request-Id": "x" * 300}, {}), ({}, {"request_id": ""})]:
        bad = http.post("/v1/completions", headers=headers,
                        json={"model": MODEL_NAME, "prompt": "hi", "max_tokens": 2, **body})
        assert bad.status_code == 400 and bad.json()["error"]["param"] == "request_id", bad.text


def test_documents_reach_the_chat_template(client, hf_tokenizer):
    template = ("{% for d in documents %}<doc {{ d['title'] }}>{{ d['text'] }}</doc>{% endfor %}"
                "{% for m in messages %}{{ m['content'] }}|{% endfor %}")
    documents = [{"title": "birds", "text": "Sparrows are small."}, {"title": "sky", "text": "It is blue."}]
    text = jinja2.Environment().from_string(template).render(messages=MESSAGES, documents=documents)
    reply = chat(client, chat_template=template, documents=documents)
    assert reply.usage.prompt_tokens == len(hf_tokenizer.encode(text, add_special_tokens=False))
    with pytest.raises(openai.BadRequestError, match="documents"):
        chat(client, chat_template=template, documents=[{"title": 3}])


def test_reasoning_effort_reaches_the_chat_template(client, hf_tokenizer):
    template = ("<effort {{ reasoning_effort | default('unset') }}>"
                "{% for m in messages %}{{ m['content'] }}|{% endfor %}")

    def expected(effort: str) -> int:
        text = jinja2.Environment().from_string(template).render(messages=MESSAGES, reasoning_effort=effort)
        return len(hf_tokenizer.encode(text, add_special_tokens=False))

    assert chat(client, chat_template=template).usage.prompt_tokens == expected("unset")
    reply = client.chat.completions.create(model=MODEL_NAME, messages=MESSAGES, max_completion_tokens=2,
                                           reasoning_effort="medium", extra_body={"chat_template": template})
    assert reply.usage.prompt_tokens == expected("medium") != expected("unset")
    # chat_template_kwargs win, as they do over the server's defaults.
    assert chat(client, chat_template=template, reasoning_effort="low",
                chat_template_kwargs={"reasoning_effort": "high"}).usage.prompt_tokens == expected("high")


def test_the_data_parallel_rank_header(client, http):
    # vLLM's X-data-parallel-rank: this server runs one engine, so 0 is the only rank (routing over
    # several is tests/test_data_parallel.py's).
    assert client.completions.create(model=MODEL_NAME, prompt="hi", max_tokens=2,
                                     extra_headers={"X-data-parallel-rank": "0"}).usage.completion_tokens == 2
    for rank, words in [("1", "must be an integer in [0, 1)"), ("first", "must be an engine index")]:
        bad = http.post("/v1/chat/completions", headers={"X-data-parallel-rank": rank},
                        json={"model": MODEL_NAME, "messages": MESSAGES, "max_tokens": 2})
        assert bad.status_code == 400 and bad.json()["error"]["param"] == "data_parallel_rank", bad.text
        assert words in bad.json()["error"]["message"]
