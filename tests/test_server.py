"""`sparrow serve` end to end: a real server process on 127.0.0.1, a small real model built
locally, the real `openai` client (and httpx for what the client cannot express)."""

from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import openai
import pytest

API_KEY = "test-key"
MODEL_NAME = "tiny-test"
MAX_BODY_BYTES = 1_000_000
PROMPT = "The quick brown fox jumps over the lazy dog. Once upon a time"


# -- the server process ---------------------------------------------------------------------
def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _proc_children(pid: int) -> list[tuple[int, bytes]]:
    children = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text().rsplit(")", 1)[1].split()
            cmdline = (entry / "cmdline").read_bytes()
        except OSError:
            continue
        if int(stat[1]) == pid and stat[0] != "Z":
            children.append((int(entry.name), cmdline))
    return children


def is_running(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


class Server:
    def __init__(self, model_dir: str, log_path: Path, *extra: str, env: dict[str, str] | None = None) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = log_path
        command = [
            sys.executable, "-m", "sparrow.entrypoints.cli", "serve", model_dir, "--port", str(self.port),
            "--served-model-name", MODEL_NAME, "--api-key", API_KEY, "--max-model-len", "512",
            "--kv-cache-memory-bytes", str(16 << 20), "--max-request-body-bytes", str(MAX_BODY_BYTES),
            "--disable-access-log", *extra,
        ]
        self._log = open(log_path, "wb")
        self.proc = subprocess.Popen(command, stdout=self._log, stderr=subprocess.STDOUT,
                                     env={**os.environ, **env} if env else None)
        deadline = time.monotonic() + 120
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with {self.proc.returncode}:\n{self.log()}")
            try:
                if httpx.get(self.url + "/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"server not healthy in time:\n{self.log()}")
            time.sleep(0.2)
        self.engine_pid = self._engine_pid()

    def _engine_pid(self) -> int:
        engines = [pid for pid, cmdline in _proc_children(self.proc.pid) if b"EngineCore" in cmdline.split(b"\0")]
        assert len(engines) == 1, f"expected one engine process, found {engines}"
        return engines[0]

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")[-5000:]

    def client(self, **kwargs) -> openai.OpenAI:
        return openai.OpenAI(base_url=self.url + "/v1", api_key=API_KEY, max_retries=0, **kwargs)

    def async_client(self, **kwargs) -> openai.AsyncOpenAI:
        return openai.AsyncOpenAI(base_url=self.url + "/v1", api_key=API_KEY, max_retries=0, **kwargs)

    def metrics(self) -> dict[str, float]:
        values = {}
        for line in httpx.get(self.url + "/metrics").text.splitlines():
            if line and not line.startswith("#"):
                name, _, value = line.rpartition(" ")
                # Drop the model_name label: 'x{a="1",model_name="m"}' -> 'x{a="1"}', 'x{model_name="m"}' -> 'x'.
                name = re.sub(r',?model_name="[^"]*"', "", name).replace("{,", "{").replace("{}", "")
                values[name] = float(value)
        return values

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        self._log.close()


def serve_for_module(model_dir: str, tmp_path_factory, name: str, *extra: str, server_cls: type | None = None,
                     env: dict[str, str] | None = None):
    """The body of a module-scoped server fixture (``yield from`` it): a real ``sparrow serve``
    with ``extra`` flags (and ``env`` over this process's environment), stopped at the end, which
    must exit cleanly."""
    srv = (server_cls or Server)(model_dir, tmp_path_factory.mktemp(name) / "server.log", *extra, env=env)
    yield srv
    srv.stop()
    assert srv.proc.returncode == 0, srv.log()


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> str:
    from sparrow.tiny.model import build_model_dir

    return str(build_model_dir(tmp_path_factory.mktemp("serve-model"), "qwen3", "test", seed=5))


@pytest.fixture(scope="module")
def server(model_dir, tmp_path_factory):
    srv = Server(model_dir, tmp_path_factory.mktemp("logs") / "server.log")
    yield srv
    engine_pid = srv.engine_pid
    srv.stop()
    assert srv.proc.returncode == 0, srv.log()
    deadline = time.monotonic() + 10
    while is_running(engine_pid):
        assert time.monotonic() < deadline, "the engine process outlived the server"
        time.sleep(0.1)


def wait_until(predicate, timeout_s: float = 10.0, what: str = "condition"):
    deadline = time.monotonic() + timeout_s
    while True:
        value = predicate()
        if value:
            return value
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


# -- the command line ---------------------------------------------------------------------------
def test_serve_has_a_flag_for_every_engine_argument():
    import argparse

    from sparrow.config import EngineConfig
    from sparrow.entrypoints.cli import build_parser

    parser = build_parser()
    subparsers = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    serve = subparsers.choices["serve"]
    flags = set(serve._option_string_actions)
    missing = [name for name in EngineConfig.field_names() if "--" + name.replace("_", "-") not in flags]
    assert not missing
    assert {"--host", "--port", "--api-key", "--served-model-name"} <= flags
    args = parser.parse_args(["serve", "/m", "--max-num-seqs", "8", "--no-enable-prefix-caching"])
    assert (args.model_pos, args.max_num_seqs, args.enable_prefix_caching) == ("/m", 8, False)
    assert (args.host, args.port) == ("127.0.0.1", 8000)
    bench = next(a for a in subparsers.choices["bench"]._actions if isinstance(a, argparse._SubParsersAction))
    assert "serve" in bench.choices


# -- endpoints --------------------------------------------------------------------------------
def test_health_models_and_version(server):
    assert httpx.get(server.url + "/health").status_code == 200
    models = server.client().models.list()
    assert [m.id for m in models.data] == [MODEL_NAME]
    assert httpx.get(server.url + "/version").json()["version"]


def test_sagemaker_ping_and_invocations_route_a_body_by_its_fields(server):
    """vLLM's SageMaker routes: /ping is /health; /invocations answers a chat or a completion
    body as its endpoint does (the same greedy text), with that endpoint's errors."""
    headers = {"Authorization": f"Bearer {API_KEY}"}
    assert httpx.get(server.url + "/ping").status_code == 200 and httpx.post(server.url + "/ping").status_code == 200
    client = server.client()
    messages = [{"role": "user", "content": "Hello"}]
    chat = client.chat.completions.create(model=MODEL_NAME, messages=messages, max_tokens=8, temperature=0)
    routed = httpx.post(server.url + "/invocations", headers=headers, timeout=60,
                        json={"messages": messages, "max_tokens": 8, "temperature": 0}).json()
    assert routed["object"] == "chat.completion", routed
    assert routed["choices"][0]["message"]["content"] == chat.choices[0].message.content
    completion = client.completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=8, temperature=0)
    routed = httpx.post(server.url + "/invocations", headers=headers, timeout=60,
                        json={"prompt": PROMPT, "max_tokens": 8, "temperature": 0}).json()
    assert routed["object"] == "text_completion" and routed["choices"][0]["text"] == completion.choices[0].text
    for body, param in (({"prompt": PROMPT, "temperature": "hot"}, "temperature"), ({"input": "hi"}, None),
                        ({"messages": messages, "max_tokens": 8, "bogus": 1}, "bogus")):
        refused = httpx.post(server.url + "/invocations", headers=headers, json=body, timeout=60)
        assert refused.status_code == 400 and refused.json()["error"]["param"] == param, refused.text
    assert httpx.post(server.url + "/invocations", json={"prompt": PROMPT}, timeout=60).status_code == 401


def test_completion_streamed_text_equals_whole_text_under_greedy(server):
    client = server.client()
    whole = client.completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=24, temperature=0,
                                      extra_body={"ignore_eos": True})
    chunks = list(client.completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=24, temperature=0,
                                            stream=True, stream_options={"include_usage": True},
                                            extra_body={"ignore_eos": True}))
    streamed = "".join(choice.text for chunk in chunks for choice in chunk.choices)
    assert streamed == whole.choices[0].text and len(whole.choices[0].text) > 0
    assert whole.choices[0].finish_reason == "length"
    assert [c.finish_reason for chunk in chunks for c in chunk.choices if c.finish_reason] == ["length"]
    assert whole.usage.completion_tokens == 24
    assert whole.usage.total_tokens == whole.usage.prompt_tokens + 24
    assert chunks[-1].choices == [] and chunks[-1].usage.model_dump() == whole.usage.model_dump()


def test_completion_accepts_token_ids_like_the_text_it_encodes(server, model_dir):
    from transformers import AutoTokenizer

    token_ids = AutoTokenizer.from_pretrained(model_dir).encode(PROMPT)
    client = server.client()
    by_text = client.completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=12, temperature=0)
    by_ids = client.completions.create(model=MODEL_NAME, prompt=token_ids, max_tokens=12, temperature=0)
    assert by_ids.choices[0].text == by_text.choices[0].text
    assert by_ids.usage.prompt_tokens == len(token_ids) == by_text.usage.prompt_tokens
    # Several prompts: one choice each, in order.
    several = client.completions.create(model=MODEL_NAME, prompt=[PROMPT, "Hello"], max_tokens=4, temperature=0)
    assert [c.index for c in several.choices] == [0, 1]
    assert several.choices[0].text == by_text.choices[0].text[:len(several.choices[0].text)]


def test_completion_logprobs(server):
    response = server.client().completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=8, temperature=0,
                                                  logprobs=3, extra_body={"ignore_eos": True})
    logprobs = response.choices[0].logprobs
    assert len(logprobs.tokens) == len(logprobs.token_logprobs) == len(logprobs.top_logprobs) == 8
    assert all(lp <= 0 for lp in logprobs.token_logprobs)
    assert all(3 <= len(top) <= 4 for top in logprobs.top_logprobs)
    # Greedy: the chosen token is the most likely one.
    for token, chosen, top in zip(logprobs.tokens, logprobs.token_logprobs, logprobs.top_logprobs):
        assert chosen == pytest.approx(max(top.values()))
        assert top[token] == pytest.approx(chosen)
    offsets = logprobs.text_offset
    assert offsets[0] == 0 and offsets == sorted(offsets)
    assert [b - a for a, b in zip(offsets, offsets[1:])] == [len(t) for t in logprobs.tokens[:-1]]


def test_chat_streamed_equals_whole_with_usage_and_logprobs(server):
    client = server.client()
    messages = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Say something."}]
    whole = client.chat.completions.create(model=MODEL_NAME, messages=messages, max_completion_tokens=16,
                                           temperature=0, logprobs=True, top_logprobs=2,
                                           extra_body={"ignore_eos": True})
    chunks = list(client.chat.completions.create(model=MODEL_NAME, messages=messages, max_completion_tokens=16,
                                                 temperature=0, stream=True,
                                                 stream_options={"include_usage": True},
                                                 extra_body={"ignore_eos": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    streamed = "".join(c.delta.content or "" for chunk in chunks for c in chunk.choices)
    message = whole.choices[0].message
    assert message.role == "assistant" and streamed == message.content
    assert whole.usage.completion_tokens == 16 == chunks[-1].usage.completion_tokens
    assert whole.usage.prompt_tokens == chunks[-1].usage.prompt_tokens > 10  # the template's tokens count
    content = whole.choices[0].logprobs.content
    assert len(content) == 16
    assert all(len(entry.top_logprobs) == 2 for entry in content)
    assert all(entry.logprob == pytest.approx(entry.top_logprobs[0].logprob) for entry in content)


def test_n_samples_whole_and_streamed(server):
    client = server.client()
    response = client.completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=10, n=2, temperature=1.0,
                                         seed=7, extra_body={"ignore_eos": True})
    assert sorted(c.index for c in response.choices) == [0, 1]
    assert response.usage.completion_tokens == 20
    stream = client.chat.completions.create(model=MODEL_NAME, messages=[{"role": "user", "content": "hi"}],
                                            max_tokens=6, n=2, temperature=1.0, seed=7, stream=True,
                                            extra_body={"ignore_eos": True})
    finished = {c.index: c.finish_reason for chunk in stream for c in chunk.choices if c.finish_reason}
    assert finished == {0: "length", 1: "length"}


def test_stop_string_ends_the_text_before_it(server):
    client = server.client()
    base = client.completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=40, temperature=0,
                                     extra_body={"ignore_eos": True}).choices[0].text
    # A stop string from the middle of the greedy text: the stopped text is what precedes it.
    candidates = [base[i:i + 3] for i in range(5, len(base) - 3) if "\ufffd" not in base[i:i + 3]]
    assert candidates, f"no usable stop string in {base!r}"
    stop = candidates[len(candidates) // 2]
    for stream in (False, True):
        response = client.completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=40, temperature=0,
                                             stop=[stop], stream=stream, extra_body={"ignore_eos": True})
        if stream:
            chunks = list(response)
            text = "".join(c.text for chunk in chunks for c in chunk.choices)
            finish = [c.finish_reason for chunk in chunks for c in chunk.choices if c.finish_reason]
        else:
            text, finish = response.choices[0].text, [response.choices[0].finish_reason]
        assert text == base[:base.index(stop)]
        assert finish == ["stop"]


def test_seed_reproduces_a_sample_and_sampling_fields_are_accepted(server):
    client = server.client()
    extra = {"top_k": 50, "min_p": 0.01, "repetition_penalty": 1.1, "min_tokens": 4, "ignore_eos": True}

    def sample(seed):
        return client.completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=16, temperature=1.0,
                                         top_p=0.95, presence_penalty=0.5, frequency_penalty=0.5, seed=seed,
                                         extra_body=extra).choices[0].text

    first, again, other = sample(11), sample(11), sample(12)
    assert first == again
    assert first != other
    # The server runs fcfs, which does not order by priority: a priority is refused, not ignored.
    with pytest.raises(openai.BadRequestError) as refused:
        client.completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=2, extra_body={"priority": 3})
    assert refused.value.body["param"] == "priority"
    assert "the 'fcfs' scheduler does not order requests by priority" in refused.value.body["message"]


def test_bench_serve_reports_vllm_metrics(server, tmp_path):
    import argparse

    from sparrow.bench.serve_args import add_bench_serve_parser

    parser = argparse.ArgumentParser()
    add_bench_serve_parser(parser.add_subparsers())
    result_file = tmp_path / "serve.json"
    args = parser.parse_args([
        "serve", "--base-url", server.url, "--api-key", API_KEY, "--num-prompts", "6", "--request-rate", "20",
        "--input-len-min", "4", "--input-len-max", "40", "--output-len-min", "2", "--output-len-max", "10",
        "--max-seconds", "30", "--result-file", str(result_file)])
    assert args.func(args) == 0
    result = json.loads(result_file.read_text())
    assert result["completed"] == 6 and result["failed"] == 0
    for key in ("request_throughput", "output_throughput", "mean_ttft_ms", "median_tpot_ms", "mean_e2el_ms"):
        assert result[key] > 0, key
    # A gap needs a second text chunk: when the client lags, the server sends a request's tokens
    # as one delta (a loaded CI machine once streamed every output of this run in one chunk).
    assert result["p99_itl_ms"] >= 0 and result["p99_itl_ms"] >= result["median_itl_ms"]


def test_bench_serve_summary_gaps_tpot_and_failures():
    from sparrow.bench.serve import RequestResult, summarize

    results = [RequestResult(success=True, prompt_len=4, output_tokens=3, ttft=0.1, latency=0.3, itl=[0.05, 0.15]),
               RequestResult(success=True, prompt_len=6, output_tokens=1, ttft=0.2, latency=0.2),  # one chunk
               RequestResult(error="boom")]
    summary = summarize(results, duration=2.0)
    assert (summary["completed"], summary["failed"], summary["total_output_tokens"]) == (2, 1, 4)
    assert summary["mean_itl_ms"] == pytest.approx(100.0) and summary["p99_itl_ms"] == pytest.approx(150.0)
    assert summary["mean_tpot_ms"] == pytest.approx(100.0)  # (0.3 - 0.1) / 2; a one-token output has none
    assert summary["mean_ttft_ms"] == pytest.approx(150.0) and summary["errors"] == ["boom"]
    assert summary["request_throughput"] == pytest.approx(1.0)


def test_prompt_tokens_details_are_off_by_default(server):
    # Without --enable-prompt-tokens-details, vLLM's shape: the key is there, null.
    body = {"model": MODEL_NAME, "prompt": "hello there", "max_tokens": 1}
    response = httpx.post(server.url + "/v1/completions", json=body,
                          headers={"Authorization": f"Bearer {API_KEY}"}, timeout=60)
    assert response.status_code == 200 and response.json()["usage"]["prompt_tokens_details"] is None


def test_bench_serve_takes_vllms_flags(server, tmp_path):
    """vllm bench serve's --host/--port, --dataset-name random and --random-input-len/-output-len:
    every prompt and every output has exactly the asked length."""
    import argparse

    from sparrow.bench.serve_args import add_bench_serve_parser

    parser = argparse.ArgumentParser()
    add_bench_serve_parser(parser.add_subparsers())
    result_file = tmp_path / "serve.json"
    args = parser.parse_args([
        "serve", "--host", "127.0.0.1", "--port", str(server.port), "--api-key", API_KEY, "--dataset-name", "random",
        "--random-input-len", "7", "--random-output-len", "3", "--num-prompts", "4", "--max-concurrency", "2",
        "--result-file", str(result_file)])
    assert args.func(args) == 0
    result = json.loads(result_file.read_text())
    assert result["completed"] == 4 and result["base_url"] == server.url
    assert (result["total_input_tokens"], result["total_output_tokens"]) == (4 * 7, 4 * 3)


def test_bench_serve_flags_are_checked_by_name():
    import argparse

    from sparrow.bench.serve_args import add_bench_serve_parser, resolve_workload_flags

    parser = argparse.ArgumentParser()
    add_bench_serve_parser(parser.add_subparsers())

    def resolved(*flags):
        args = parser.parse_args(["serve", *flags])
        resolve_workload_flags(args)
        return args

    args = resolved("--random-input-len", "100", "--random-output-len", "10", "--random-range-ratio", "0.5")
    assert (args.input_len_min, args.input_len_max, args.output_len_min, args.output_len_max) == (50, 151, 5, 16)
    assert args.base_url == "http://127.0.0.1:8000"
    assert resolved("--port", "9001").base_url == "http://127.0.0.1:9001"
    for flags, words in [
        (["--base-url", "http://x:1", "--port", "2"], "--base-url names the server already"),
        (["--random-input-len", "8", "--input-len-min", "4"], "--random-input-len sets the lengths"),
        (["--random-range-ratio", "0.2"], "--random-range-ratio applies to --random-input-len"),
        (["--random-input-len", "8", "--random-range-ratio", "1.5"], "--random-range-ratio must be in [0, 1)"),
        (["--input-len-min", "50", "--input-len-max", "10"], "--input-len-max (10) must be greater"),
        (["--max-concurrency", "0"], "--max-concurrency must be at least 1"),
        (["--request-rate", "0"], "--request-rate must be > 0"),
    ]:
        with pytest.raises(ValueError, match=re.escape(words)):
            resolved(*flags)
    with pytest.raises(SystemExit):  # argparse: only the random dataset is built in
        parser.parse_args(["serve", "--dataset-name", "sharegpt"])


def test_logit_bias_forces_and_bans_tokens(server, model_dir):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    client = server.client()

    def greedy(bias, chat=False):
        if chat:
            return client.chat.completions.create(
                model=MODEL_NAME, messages=[{"role": "user", "content": PROMPT}], max_tokens=5, temperature=0.0,
                logit_bias=bias).choices[0].message.content
        return client.completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=5, temperature=0.0,
                                         logit_bias=bias, extra_body={"ignore_eos": True}).choices[0].text

    assert greedy({"42": 100.0}) == tokenizer.decode([42] * 5)
    # +100 on two tokens, then -100 on one of them: the other must win every step
    assert greedy({"42": -100.0, "43": 100.0}) == tokenizer.decode([43] * 5)
    assert greedy({"43": 100.0}, chat=True) == tokenizer.decode([43] * 5)
    only = client.completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=5, temperature=1.0, seed=3,
                                     extra_body={"allowed_token_ids": [44], "ignore_eos": True})
    assert only.choices[0].text == tokenizer.decode([44] * 5)


def test_echo_scores_the_prompt_as_hf_does(server, model_dir):
    """lm-eval-harness's loglikelihood request: echo, max_tokens=0, logprobs; against HF's
    teacher-forced log-softmax on the same directory."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    prompt_ids = tokenizer(PROMPT, add_special_tokens=False)["input_ids"]
    client = server.client()
    scored = client.completions.create(model=MODEL_NAME, prompt=prompt_ids, max_tokens=0, echo=True, logprobs=1)
    choice = scored.choices[0]
    assert choice.text == tokenizer.decode(prompt_ids)
    assert scored.usage.completion_tokens == 0 and scored.usage.prompt_tokens == len(prompt_ids)
    logprobs = choice.logprobs.token_logprobs
    assert len(logprobs) == len(prompt_ids) and logprobs[0] is None and choice.logprobs.top_logprobs[0] is None
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    with torch.no_grad():
        log_softmax = model(torch.tensor([prompt_ids])).logits[0].float().log_softmax(-1)
    expected = log_softmax[:-1].gather(1, torch.tensor(prompt_ids[1:])[:, None]).squeeze(1).tolist()
    assert logprobs[1:] == pytest.approx(expected, abs=1e-3)

    # vLLM's chat prompt_logprobs: the rendered prompt's, scored the same way.
    messages = [{"role": "user", "content": PROMPT}]
    chat_ids = tokenizer(tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False),
                         add_special_tokens=False)["input_ids"]
    reply = client.chat.completions.create(model=MODEL_NAME, messages=messages, max_tokens=1,
                                           extra_body={"prompt_logprobs": 0})
    scored_chat = reply.model_extra["prompt_logprobs"]
    assert len(scored_chat) == len(chat_ids) and scored_chat[0] is None
    with torch.no_grad():
        chat_log_softmax = model(torch.tensor([chat_ids])).logits[0].float().log_softmax(-1)
    assert [scored_chat[i][str(chat_ids[i])]["logprob"] for i in range(1, len(chat_ids))] == pytest.approx(
        [chat_log_softmax[i - 1, chat_ids[i]].item() for i in range(1, len(chat_ids))], abs=1e-3)
    assert "prompt_logprobs" not in client.chat.completions.create(
        model=MODEL_NAME, messages=messages, max_tokens=1).model_extra
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model=MODEL_NAME, messages=messages, max_tokens=1, stream=True,
                                       extra_body={"prompt_logprobs": 0})
    assert info.value.body["param"] == "prompt_logprobs"

    # echo with generation: the prompt, then the greedy continuation; streamed the same
    whole = client.completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=6, echo=True, temperature=0.0,
                                      extra_body={"ignore_eos": True})
    plain = client.completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=6, temperature=0.0,
                                      extra_body={"ignore_eos": True})
    assert whole.choices[0].text == PROMPT + plain.choices[0].text
    streamed = "".join(chunk.choices[0].text for chunk in client.completions.create(
        model=MODEL_NAME, prompt=PROMPT, max_tokens=6, echo=True, temperature=0.0, stream=True,
        extra_body={"ignore_eos": True}) if chunk.choices)
    assert streamed == whole.choices[0].text
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=0)
    assert info.value.body["param"] == "max_tokens"


# -- errors ------------------------------------------------------------------------------------
def test_invalid_parameters_are_400_naming_the_field(server):
    client = server.client()
    cases = [
        (dict(top_p=5.0), "top_p"),
        (dict(temperature=-1.0), "temperature"),
        (dict(max_tokens=100_000), "max_tokens"),
        (dict(logprobs=50), "logprobs"),
        (dict(extra_body={"top_k": -7}), "top_k"),
        (dict(stop=[""]), "stop"),
        (dict(logit_bias={"5": 101.0}), "logit_bias"),
        (dict(logit_bias={"10000000": 1.0}), "logit_bias"),
        (dict(logit_bias={"x": 1.0}), "logit_bias"),
        (dict(extra_body={"allowed_token_ids": [10**7]}), "allowed_token_ids"),
    ]
    for kwargs, field in cases:
        with pytest.raises(openai.BadRequestError) as info:
            client.completions.create(model=MODEL_NAME, prompt=PROMPT, **kwargs)
        error = info.value.body
        assert error["param"] == field, (kwargs, error)
        assert field in error["message"]
        assert error["type"] and "code" in error
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model=MODEL_NAME, prompt=[1, 2, 10**6], max_tokens=2)
    assert info.value.body["param"] == "prompt"
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model=MODEL_NAME, messages=[], max_tokens=2)
    assert info.value.body["param"] == "messages"
    # Schema errors inside messages name the message and key, not pydantic's union members.
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model=MODEL_NAME, messages=[{"role": "user", "content": 123}], max_tokens=2)
    assert info.value.body["param"] == "messages[0].content"
    assert info.value.body["message"].startswith("messages[0].content: "), info.value.body
    assert ".str" not in info.value.body["message"] and "list[" not in info.value.body["message"]
    # "n": null is OpenAI's default, 1.
    reply = client.chat.completions.create(model=MODEL_NAME, messages=[{"role": "user", "content": PROMPT}],
                                           max_tokens=2, n=None)
    assert len(reply.choices) == 1
    # A request's own chat template needs --trust-request-chat-template (vLLM's), on both endpoints.
    template = {"chat_template": "{{ 'x' * 1000 }}"}
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model=MODEL_NAME, messages=[{"role": "user", "content": "hi"}], max_tokens=2,
                                       extra_body=template)
    assert info.value.body["param"] == "chat_template" and "--trust-request-chat-template" in info.value.body["message"]
    refused = httpx.post(server.url + "/tokenize", json={"messages": [{"role": "user", "content": "hi"}], **template},
                         headers={"Authorization": f"Bearer {API_KEY}"}, timeout=60)
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "chat_template"


def test_auth_model_and_size_errors(server):
    with pytest.raises(openai.AuthenticationError) as info:
        openai.OpenAI(base_url=server.url + "/v1", api_key="wrong", max_retries=0).models.list()
    assert info.value.status_code == 401 and info.value.body["type"] == "AuthenticationError"
    assert httpx.get(server.url + "/v1/models").status_code == 401
    assert httpx.get(server.url + "/health").status_code == 200  # only /v1 needs the key
    with pytest.raises(openai.NotFoundError) as info:
        server.client().completions.create(model="no-such-model", prompt=PROMPT, max_tokens=2)
    assert info.value.body["param"] == "model"

    headers = {"Authorization": f"Bearer {API_KEY}", "Content-Type": "application/json"}
    big = json.dumps({"model": MODEL_NAME, "prompt": "x" * (MAX_BODY_BYTES + 10)}).encode()
    response = httpx.post(server.url + "/v1/completions", content=big, headers=headers)
    assert response.status_code == 413 and response.json()["error"]["code"] == "request_too_large"

    def chunked():  # no Content-Length: the limit is enforced on the bytes received
        for start in range(0, len(big), 65536):
            yield big[start:start + 65536]

    response = httpx.post(server.url + "/v1/completions", content=chunked(), headers=headers)
    assert response.status_code == 413 and "error" in response.json()


# -- concurrency and aborts --------------------------------------------------------------------
def test_64_concurrent_streaming_clients_all_complete(server):
    async def one(client: openai.AsyncOpenAI, index: int) -> tuple[str, int]:
        stream = await client.completions.create(
            model=MODEL_NAME, prompt=f"{PROMPT} {index}", max_tokens=16, temperature=0.8, seed=index,
            stream=True, stream_options={"include_usage": True}, extra_body={"ignore_eos": True})
        finish, tokens = None, 0
        async for chunk in stream:
            for choice in chunk.choices:
                finish = choice.finish_reason or finish
            if chunk.usage:
                tokens = chunk.usage.completion_tokens
        return finish, tokens

    async def main():
        async with server.async_client(timeout=120) as client:
            return await asyncio.gather(*(one(client, i) for i in range(64)))

    results = asyncio.run(main())
    assert results == [("length", 16)] * 64
    metrics = server.metrics()
    assert metrics["sparrow:generation_tokens_total"] >= 64 * 16
    assert metrics["sparrow:request_success_total{finished_reason=\"length\"}"] >= 64
    assert metrics["sparrow:time_to_first_token_seconds_count"] >= 64


def test_client_disconnect_aborts_the_request_and_frees_its_blocks(server):
    aborted_before = server.metrics().get('sparrow:request_success_total{finished_reason="abort"}', 0.0)
    headers = {"Authorization": f"Bearer {API_KEY}"}
    body = {"model": MODEL_NAME, "prompt": PROMPT, "max_tokens": 400, "stream": True, "ignore_eos": True}
    with httpx.Client(timeout=30) as client:
        with client.stream("POST", server.url + "/v1/completions", json=body, headers=headers) as response:
            lines = response.iter_lines()
            assert next(line for line in lines if line.startswith("data: "))
            wait_until(lambda: server.metrics()["sparrow:kv_cache_usage_perc"] > 0, what="blocks in use")
        # Leaving the block closes the connection mid-stream.
    wait_until(lambda: server.metrics()["sparrow:num_requests_running"] == 0, what="the request to stop")
    metrics = server.metrics()
    assert metrics["sparrow:kv_cache_usage_perc"] == 0.0
    assert metrics['sparrow:request_success_total{finished_reason="abort"}'] == aborted_before + 1

    # A whole (non-streamed) request whose client gives up is aborted too: 16 samples of 480
    # tokens take seconds, the client waits 0.3 s.
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(server.url + "/v1/completions", json={**body, "stream": False, "n": 16, "max_tokens": 480},
                   headers=headers, timeout=0.3)
    wait_until(lambda: server.metrics().get('sparrow:request_success_total{finished_reason="abort"}', 0)
               == aborted_before + 1 + 16, what="the 16 samples to be aborted")
    wait_until(lambda: server.metrics()["sparrow:kv_cache_usage_perc"] == 0.0, what="blocks to be freed")


def _bounded(body):
    """Keep generated work small: a few short samples per request (the checks are about shapes)."""
    if isinstance(body, dict):
        def is_int(value):
            return isinstance(value, int) and not isinstance(value, bool)

        for key in ("max_tokens", "max_completion_tokens", "max_output_tokens"):
            if is_int(body.get(key)) and body[key] > 4:
                body[key] = 4
        # No limit means "all the room max_model_len leaves": hundreds of tokens.
        if "messages" in body:
            if body.get("max_tokens") is None and body.get("max_completion_tokens") is None:
                body["max_completion_tokens"] = 4
        elif "input" in body:  # /v1/responses
            if body.get("max_output_tokens") is None:
                body["max_output_tokens"] = 4
        elif body.get("max_tokens", 0) is None:
            body["max_tokens"] = 4
        if is_int(body.get("n")) and body["n"] > 2:
            body["n"] = 2
        if isinstance(body.get("prompt"), list) and body["prompt"] and isinstance(body["prompt"][0], list):
            body["prompt"] = body["prompt"][:2]
    return body


def test_openapi_schema_fuzzing_finds_no_server_error(server):
    import schemathesis
    from hypothesis import HealthCheck, given, settings
    from hypothesis import strategies as st
    from schemathesis import GenerationMode

    schema = schemathesis.openapi.from_url(server.url + "/openapi.json")
    headers = {"Authorization": f"Bearer {API_KEY}"}
    failures = []
    labels = []
    for result in schema.get_all_operations():
        operation = result.ok()
        labels.append(operation.label)
        strategies = [operation.as_strategy(GenerationMode.POSITIVE)]
        if operation.method.upper() == "POST":
            strategies.append(operation.as_strategy(GenerationMode.NEGATIVE))

        @given(case=st.one_of(strategies))
        @settings(max_examples=30, deadline=None, suppress_health_check=list(HealthCheck), database=None)
        def call(case):
            case.body = _bounded(case.body)
            response = case.call(base_url=server.url, headers=headers, timeout=60)
            if response.status_code >= 500:
                failures.append((operation.label, case.body, response.status_code, response.text[:300]))

        call()
    assert "POST /v1/completions" in labels and "POST /v1/chat/completions" in labels
    assert not failures, failures[:5]
    assert httpx.get(server.url + "/health").status_code == 200
