"""`sparrow chat`, `sparrow complete` and `sparrow collect-env` as a user runs them: the real
`sparrow` command in a subprocess, against a real `sparrow serve` of a small local model whose
replies must equal HF transformers' greedy generation for the same conversation or prompt."""

from __future__ import annotations

import importlib.metadata
import json
import os
import re
import subprocess
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from tests.test_cli import assert_one_error_line, sparrow_command
from tests.test_server import API_KEY, MODEL_NAME, free_port, serve_for_module

# The server caps every request at this many tokens (vLLM's `chat` has no --max-tokens) and
# samples greedily unless a request says otherwise.
SERVER_MAX_TOKENS = 8
COMPLETE_MAX_TOKENS = 5  # `complete --max-tokens`, below the server's cap


@pytest.fixture(scope="module")
def server(qwen3_dir, tmp_path_factory):
    generation = json.dumps({"temperature": 0, "max_new_tokens": SERVER_MAX_TOKENS})
    yield from serve_for_module(qwen3_dir, tmp_path_factory, "cli-clients", "--override-generation-config",
                                generation)


@pytest.fixture(scope="module")
def hf(qwen3_dir):
    """Greedy text of HF transformers on the same model: ``chat(messages)`` for a conversation
    (rendered with the tokenizer's chat template), ``complete(prompt, n)`` for a prompt."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(qwen3_dir, local_files_only=True)
    model = AutoModelForCausalLM.from_pretrained(qwen3_dir, dtype=torch.float32, local_files_only=True).eval()

    def greedy(ids: list[int], max_tokens: int) -> str:
        with torch.inference_mode():
            out = model.generate(torch.tensor([ids]), max_new_tokens=max_tokens, do_sample=False, pad_token_id=0)
        return tokenizer.decode(out[0, len(ids):], skip_special_tokens=True)

    class HF:
        @staticmethod
        def chat(messages: list[dict[str, str]]) -> str:
            text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
            return greedy(tokenizer(text, add_special_tokens=False).input_ids, SERVER_MAX_TOKENS)

        @staticmethod
        def complete(prompt: str, max_tokens: int) -> str:
            return greedy(tokenizer(prompt).input_ids, max_tokens)

    return HF


def run_client(*args: str, stdin: str | None = None, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    base = {name: value for name, value in os.environ.items()
            if name not in ("OPENAI_API_KEY", "SPARROW_LOGGING_LEVEL")}
    return subprocess.run([*sparrow_command(), *args], input=stdin if stdin is not None else "",
                          capture_output=True, text=True, timeout=180, env={**base, **(env or {})})


def api(server) -> str:
    return server.url + "/v1"


# -- chat -----------------------------------------------------------------------------------------
def test_chat_quick_prints_the_greedy_reply(server, hf):
    # No --model-name: the first model GET /models lists; no --api-key: $OPENAI_API_KEY.
    message = "Tell me about sparrows."
    result = run_client("chat", "--url", api(server), "-q", message, env={"OPENAI_API_KEY": API_KEY})
    assert result.returncode == 0, result.stderr
    reply = hf.chat([{"role": "user", "content": message}])
    assert reply.strip() and result.stdout == reply + "\n"
    assert result.stderr == ""


def test_chat_session_sends_the_whole_conversation(server, hf):
    system = "You are a helpful assistant."
    first, second = "Hello, who are you?", "And what do sparrows eat?"
    # A blank line between the two messages is skipped, not sent.
    result = run_client("chat", "--url", api(server), "--api-key", API_KEY, "--model-name", MODEL_NAME,
                        "--system-prompt", system, stdin=f"{first}\n\n{second}\n")
    assert result.returncode == 0, result.stderr
    history = [{"role": "system", "content": system}, {"role": "user", "content": first}]
    reply1 = hf.chat(history)
    history += [{"role": "assistant", "content": reply1}, {"role": "user", "content": second}]
    reply2 = hf.chat(history)
    assert reply1.strip() and reply2.strip()
    assert reply2 != hf.chat([{"role": "system", "content": system}, {"role": "user", "content": second}])
    # Standard input is not a terminal: no prompt, only the replies on standard output.
    assert result.stdout == f"{reply1}\n{reply2}\n"
    assert f"Using model: {MODEL_NAME}" in result.stderr and "Traceback" not in result.stderr


# -- complete -------------------------------------------------------------------------------------
def test_complete_quick_prints_the_greedy_continuation_and_stats(server, hf):
    prompt = "The quick brown fox jumps over the lazy dog. Once upon a time"
    result = run_client("complete", "--url", api(server), "--api-key", API_KEY, "--model-name", MODEL_NAME,
                        "--max-tokens", str(COMPLETE_MAX_TOKENS), "-q", prompt, "--stats")
    assert result.returncode == 0, result.stderr
    assert result.stdout == hf.complete(prompt, COMPLETE_MAX_TOKENS) + "\n"
    stats = result.stderr.splitlines()
    assert stats[0].startswith("TTFT: ") and stats[0].endswith(" ms"), result.stderr
    assert stats[1].startswith("TPS: ") and f"({COMPLETE_MAX_TOKENS} tokens in " in stats[1], result.stderr


def test_complete_session_sends_each_prompt_alone(server, hf):
    prompts = ["Once upon a time", "The sky is"]
    result = run_client("complete", "--url", api(server), "--api-key", API_KEY, stdin="\n".join(prompts) + "\n")
    assert result.returncode == 0, result.stderr
    assert result.stdout == "".join(hf.complete(prompt, SERVER_MAX_TOKENS) + "\n" for prompt in prompts)


# -- errors ---------------------------------------------------------------------------------------
def test_an_unreachable_server_is_one_line(server):
    url = f"http://127.0.0.1:{free_port()}/v1"  # nothing listens there
    for command in ("chat", "complete"):
        result = run_client(command, "--url", url, "-q", "Hello")
        assert result.returncode == 1
        line = assert_one_error_line(result, "cannot reach the server", url)
        assert "Connection refused" in line


def test_server_errors_are_the_servers_message_on_one_line(server):
    for command in ("chat", "complete"):
        result = run_client(command, "--url", api(server), "--api-key", API_KEY, "--model-name", "no-such-model",
                            "-q", "Hello")
        assert result.returncode == 1
        assert_one_error_line(result, "404", "the model 'no-such-model' does not exist", MODEL_NAME)
        assert result.stdout == ""
    result = run_client("chat", "--url", api(server), "--api-key", "wrong-key", "-q", "Hello")
    assert result.returncode == 1
    assert_one_error_line(result, "401", "invalid or missing API key")
    # The server's root is not the API's base URL: a hint, not a bare "Not Found".
    result = run_client("chat", "--url", server.url, "--api-key", API_KEY, "-q", "Hello")
    assert result.returncode == 1
    assert_one_error_line(result, "404", "/v1")


def test_only_vllms_flags_and_good_values_are_taken():
    from sparrow.entrypoints.cli import build_parser

    parser = build_parser()
    for argv in (["chat", "--max-tokens", "3"], ["chat", "--url", "localhost:8000"], ["complete", "--max-tokens", "0"],
                 ["complete", "--url", "http://127.0.0.1:abc/v1"], ["collect-env", "--url", "http://localhost:8000/v1"]):
        with pytest.raises(SystemExit) as info:
            parser.parse_args(argv)
        assert info.value.code == 2, argv
    args = parser.parse_args(["complete", "-q", "Hi", "--max-tokens", "4", "--stats"])
    assert (args.url, args.model_name, args.api_key, args.quick, args.max_tokens, args.stats) == (
        "http://localhost:8000/v1", None, None, "Hi", 4, True)
    args = parser.parse_args(["chat", "--url", "http://h:1/v1/", "--system-prompt", "S", "--quick", "M"])
    assert (args.url, args.system_prompt, args.quick, args.stats) == ("http://h:1/v1", "S", "M", False)


# -- what other servers may send ------------------------------------------------------------------
class FakeServer(ThreadingHTTPServer):
    """A stand-in for a server with a reasoning parser: ``events`` are the data of the events it
    streams to every POST."""

    events: list[str]
    bodies: list[dict]


class FakeHandler(BaseHTTPRequestHandler):
    server: FakeServer

    def do_POST(self):  # noqa: N802 - http.server's name
        self.server.bodies.append(json.loads(self.rfile.read(int(self.headers["Content-Length"]))))
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.end_headers()
        try:
            for data in self.server.events:
                # A comment line, and the data of one event split over two lines, as SSE allows.
                head, _, tail = data.partition(", ")
                self.wfile.write(f": keep-alive\n\ndata: {head},\ndata: {tail}\n\n".encode() if tail
                                 else f"data: {data}\n\n".encode())
                self.wfile.flush()
        except OSError:
            pass  # the client stopped reading at [DONE]

    def log_message(self, *args):
        pass


@pytest.fixture
def fake_server():
    srv = FakeServer(("127.0.0.1", 0), FakeHandler)
    srv.events, srv.bodies = [], []
    thread = threading.Thread(target=srv.serve_forever, daemon=True)
    thread.start()
    yield srv
    srv.shutdown()
    srv.server_close()


def _delta(**delta) -> str:
    return json.dumps({"choices": [{"index": 0, "delta": delta}]})


def test_reasoning_goes_to_stderr_and_the_answer_to_stdout(fake_server):
    fake_server.events = [_delta(role="assistant"), _delta(reasoning_content="Let me think. "),
                          _delta(reasoning_content="Sparrows are birds."), _delta(content="They "),
                          _delta(content="eat seeds."), "[DONE]", _delta(content="never read")]
    url = f"http://127.0.0.1:{fake_server.server_address[1]}/v1"
    result = run_client("chat", "--url", url, "--model-name", "m", stdin="What do sparrows eat?\nAnd?\n")
    assert result.returncode == 0, result.stderr
    assert result.stdout == "They eat seeds.\nThey eat seeds.\n"
    assert result.stderr.count("Let me think. Sparrows are birds.\n") == 2, result.stderr
    # The reasoning is not sent back: the second request has the first reply's answer only.
    assert fake_server.bodies[1]["messages"] == [
        {"role": "user", "content": "What do sparrows eat?"}, {"role": "assistant", "content": "They eat seeds."},
        {"role": "user", "content": "And?"}]
    assert all(body["stream"] is True and body["model"] == "m" for body in fake_server.bodies)


def test_an_error_during_the_stream_is_one_line(fake_server):
    fake_server.events = [_delta(content="Partial"),
                          json.dumps({"error": {"message": "the engine died", "type": "InternalServerError"}})]
    url = f"http://127.0.0.1:{fake_server.server_address[1]}/v1"
    result = run_client("chat", "--url", url, "--model-name", "m", "-q", "Hi")
    assert result.returncode == 1
    assert_one_error_line(result, "the engine died")
    assert result.stdout == "Partial\n"


# -- collect-env ----------------------------------------------------------------------------------
def test_collect_env_reports_versions_plugins_and_hides_secrets():
    import torch

    from sparrow import __version__

    result = run_client("collect-env", env={"SPARROW_API_KEY": "s3cr3t-value", "SPARROW_CPU_THREADS": "1",
                                            "SPARROW_HF_TOKEN": "hf_s3cr3t"})
    assert result.returncode == 0, result.stderr
    text = result.stdout

    def value(name: str) -> str:  # the value on the line of `name` (names are padded to one width)
        match = re.search(rf"^{re.escape(name)}: +(.*)$", text, re.MULTILINE)
        assert match, (name, text)
        return match.group(1)

    assert value("Sparrow").startswith(f"{__version__} (")
    assert value("version") == torch.__version__  # the PyTorch section's
    assert value("torch.cuda.is_available()") == str(torch.cuda.is_available())
    for name in ("transformers", "pyzmq", "msgspec", "pydantic", "fastapi", "uvicorn"):
        assert value(name) == importlib.metadata.version(name), name
    assert value("flashinfer-python")  # a version or "not installed"
    assert value("cpu").startswith("sparrow_cpu")  # the built-in plugins' entry points
    assert value("SPARROW_CPU_THREADS") == "1"
    assert "s3cr3t" not in text and value("SPARROW_API_KEY") == value("SPARROW_HF_TOKEN") == "*** (set, hidden)"
    # The level `sparrow` sets for its own processes is not reported as the user's setting.
    assert "SPARROW_LOGGING_LEVEL" not in text
    if sys.platform == "linux" and os.path.exists("/proc/cpuinfo"):
        assert "instruction sets:" in text and "absent:" in text


NO_TORCH = """
import sys
sys.modules["torch"] = None  # `import torch` raises ImportError, as where it is not installed
from sparrow.entrypoints.cli import main
sys.exit(main(["collect-env"]))
"""


def test_collect_env_without_torch():
    result = subprocess.run([sys.executable, "-c", NO_TORCH], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert "torch: not installed" in result.stdout and "Traceback" not in result.stderr


# -- help -----------------------------------------------------------------------------------------
@pytest.mark.parametrize("command", ["chat", "complete", "collect-env"])
def test_help(command):
    import argparse

    from tests.test_cli import _subparser

    result = run_client(command, "--help")
    assert result.returncode == 0, result.stderr
    assert f"usage: sparrow {command}" in result.stdout
    from sparrow.entrypoints.cli import build_parser

    for action in _subparser(build_parser(), command)._actions:
        if isinstance(action, argparse._HelpAction):
            continue
        assert action.help and action.help.rstrip().endswith(")") and "(default: " in action.help, action.dest
